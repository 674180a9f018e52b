r"""HALoS's hierarchy as a policy: local servers per region under a global one.

:class:`HALoS` is what each local parameter server (LPS) does with its region's
workers, ASP (every push applied as it arrives), plus the settings of the
hierarchy above them: how many regions the workers form, how many local
updates an LPS accumulates before it sends them to the global parameter server
(GPS), the GPS's Delayed Nesterov step, the weight of the GPS's model when an
LPS merges it, and the inter-region link. The simulator builds the two-level
server from it (:class:`hpsjax.sim.HalosCore`); a :class:`~hpsjax.ps.ServerCore`
given it directly is one ASP server, with no hierarchy.
"""

from __future__ import annotations

from hpsjax._checks import check_int, check_number
from hpsjax.decisions._policies_async import ASP

__all__ = ["HALoS"]


class HALoS(ASP):
    r"""Hierarchical asynchronous local SGD (HALoS): its local servers and settings.

    The workers are cut into ``regions`` contiguous groups (worker :math:`i` of
    :math:`n` in region :math:`\lfloor i R / n \rfloor`, as the authors'
    simulator assigns them), each served by a local parameter server with the
    server optimizer (HALoS: Delayed Nesterov with local momentum
    :math:`\beta_l`) under this ASP policy. Each time an LPS has applied
    ``accumulation`` = :math:`K` updates since it last merged the global
    model, it sends :math:`\theta_l^{\text{merged}} - \theta_l` to the GPS over
    the inter-region link; the GPS applies it as it arrives with Delayed
    Nesterov (learning rate ``global_learning_rate``, momentum :math:`\beta_g`
    = ``global_momentum``, delay ``global_delay``) and sends its model back,
    which the LPS merges as :math:`\theta_l \leftarrow (1 - \alpha)\theta_l +
    \alpha\theta_g`, :math:`\alpha` = ``merge_weight``.

    Args:
      regions: :math:`R`, the number of regions (one LPS each), >= 1.
      accumulation: :math:`K`, local updates between two sends to the GPS, >= 1.
      merge_weight: :math:`\alpha` in ``[0, 1]``.
      global_learning_rate: the GPS's Delayed Nesterov learning rate, > 0 (as
        :func:`hpsjax.transforms.delayed_nesterov` takes it: a plain step is
        this over ``global_delay``).
      global_momentum: :math:`\beta_g` in ``[0, 1)``.
      global_delay: the GPS's Delayed Nesterov delay :math:`N_g`, >= 1.
      global_bandwidth: bytes per second of the link between an LPS and the
        GPS, or ``None`` for an instant one.
      global_latency: seconds of latency per message on that link, >= 0.
      **asp: the local servers' :class:`~hpsjax.ps.ASP` arguments.

    Raises:
      ValueError: for a value out of range.

    Examples:
      >>> from hpsjax.decisions._policies_halos import HALoS
      >>> HALoS(regions=4, accumulation=32).region_of(5, 8)
      2
    """

    name = "halos"

    def __init__(
        self,
        *,
        regions: int = 4,
        accumulation: int = 32,
        merge_weight: float = 0.25,
        global_learning_rate: float = 0.3,
        global_momentum: float = 0.5,
        global_delay: int = 2,
        global_bandwidth: float | None = None,
        global_latency: float = 0.0,
        **asp,
    ):
        super().__init__(**asp)
        self.regions = check_int("regions", regions, low=1)
        self.accumulation = check_int("accumulation", accumulation, low=1)
        self.merge_weight = float(
            check_number("merge_weight", merge_weight, low=0.0, high=1.0)
        )
        lr = global_learning_rate
        self.global_learning_rate = float(
            check_number("global_learning_rate", lr, low=0.0, low_inclusive=False)
        )
        self.global_momentum = float(
            check_number(
                "global_momentum", global_momentum, low=0.0, high=1.0,
                high_inclusive=False,
            )
        )  # fmt: skip
        self.global_delay = check_int("global_delay", global_delay, low=1)
        if global_bandwidth is not None:
            global_bandwidth = float(
                check_number(
                    "global_bandwidth", global_bandwidth, low=0.0, low_inclusive=False
                )
            )
        self.global_bandwidth = global_bandwidth
        self.global_latency = float(
            check_number("global_latency", global_latency, low=0.0)
        )

    def region_of(self, index: int, num_workers: int) -> int:
        """The region of the ``index``-th of ``num_workers`` workers.

        Raises:
          ValueError: fewer workers than regions, or an index out of range.
        """
        n = check_int("num_workers", num_workers, low=1)
        if n < self.regions:
            raise ValueError(
                f"halos: {n} workers cannot fill {self.regions} regions; give at "
                "most as many regions as workers."
            )
        i = check_int("index", index, low=0, high=n - 1)
        return i * self.regions // n

    def transfer_time(self, nbytes: int) -> float:
        """Seconds a message of ``nbytes`` takes between an LPS and the GPS."""
        if self.global_bandwidth is None:
            return self.global_latency
        return self.global_latency + nbytes / self.global_bandwidth

    def _config(self):
        return {
            **super()._config(),
            "regions": self.regions,
            "accumulation": self.accumulation,
            "merge_weight": self.merge_weight,
            "global_learning_rate": self.global_learning_rate,
            "global_momentum": self.global_momentum,
            "global_delay": self.global_delay,
            "global_bandwidth": self.global_bandwidth,
            "global_latency": self.global_latency,
        }
