"""The asynchronous policies: nobody waits for a barrier.

ASP (pushes applied at once, or every ``aggregate`` pushes: n-softsync), SaPS
(version-based straggler detection; damp or drop, force a pull), semi-async
(bounded version staleness, stale pushes damped or dropped) and Ringmaster
(ASP that ignores pushes delayed :math:`R` versions or more, and may stop
computations that fall that far behind), each a
:class:`~hpsjax.decisions.Policy` (see :mod:`hpsjax.decisions._policy`).
"""

from __future__ import annotations

from hpsjax._checks import check_choice, check_int
from hpsjax.decisions._policy import (
    STALE_ACTIONS,
    Policy,
    PolicyView,
    Verdict,
    stale_verdict,
)

__all__ = ["ASP", "Ringmaster", "SaPS", "SemiAsync"]


class ASP(Policy):
    r"""Asynchronous parallel: nobody waits; pushes applied at once.

    With ``aggregate`` :math:`c > 1` this is n-softsync: updates are buffered and
    their average applied once :math:`\min(c, \#\text{live})` of them have arrived.
    With ``max_staleness`` :math:`s`, pushes with :math:`\tau > s` are damped by
    :math:`(1+s)/(1+\tau)` or dropped (``on_stale``); nobody is made to wait.

    Args:
      aggregate: :math:`c`, updates averaged per applied version (int >= 1).
      max_staleness: staleness bound for damping/dropping, or ``None``.
      on_stale: ``"damp"`` or ``"drop"``.

    Examples:
      >>> from hpsjax.decisions._policies import ASP
      >>> ASP(aggregate=4)
      ASP(aggregate=4, max_staleness=None, on_stale='damp')

    References:
      Zhang, Gupta, Lian, Liu, `Staleness-aware Async-SGD for Distributed Deep
      Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016.
    """

    name = "asp"

    def __init__(
        self,
        *,
        aggregate: int = 1,
        max_staleness: int | None = None,
        on_stale: str = "damp",
    ):
        check_int("aggregate", aggregate, low=1)
        check_int("max_staleness", max_staleness, low=0, allow_none=True)
        check_choice("on_stale", on_stale, STALE_ACTIONS)
        self.aggregate = int(aggregate)
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.on_stale = on_stale

    def judge(self, core, worker_id, staleness):
        del core, worker_id
        return stale_verdict(
            staleness, self.max_staleness, self.on_stale, force_pull=False, who="asp"
        )

    def ready(self, core):
        return core.buffered >= min(self.aggregate, max(1, len(core.live)))

    def completes(self, core, worker_id):
        del worker_id
        return core.buffered + 1 >= min(self.aggregate, max(1, len(core.live)))

    def _config(self):
        return {
            "aggregate": self.aggregate,
            "max_staleness": self.max_staleness,
            "on_stale": self.on_stale,
        }


class SaPS(Policy):
    r"""Straggler-aware PS: stragglers found by version, fast workers never wait.

    Our reading of SaPS: a push with staleness :math:`\tau` above a threshold
    :math:`\theta` comes from a straggler. Its update is damped by
    :math:`(1+\theta)/(1+\tau)` or dropped (``on_straggler``), and the worker is told
    to pull fresh parameters (:class:`~hpsjax.ps.ForcePull`: the ``force_pull``
    of its PUSH_ACK, on which ``hpsjax-worker`` discards its round and pulls),
    which bounds the staleness it works at; only that worker is forced, and
    nobody ever waits. With ``threshold=None``,
    :math:`\theta = \max(1, 2(n-1))` for :math:`n` live workers: in steady ASP each
    push is about :math:`n-1` versions stale, so this flags workers about twice
    slower than the rest.

    Args:
      threshold: :math:`\theta`, an int >= 0, or ``None`` for the rule above.
      on_straggler: ``"damp"`` or ``"drop"``.

    Examples:
      >>> from hpsjax.decisions._policies import SaPS
      >>> SaPS(threshold=4, on_straggler="drop")
      SaPS(threshold=4, on_straggler='drop')

    References:
      Yu, Chen, Xu, Wang, Li, `Accelerating Distributed Training in Heterogeneous
      Clusters via a Straggler-Aware Parameter Server
      <https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042>`_, IEEE HPCC 2019.
    """

    name = "saps"

    def __init__(self, *, threshold: int | None = None, on_straggler: str = "damp"):
        check_int("threshold", threshold, low=0, allow_none=True)
        check_choice("on_straggler", on_straggler, STALE_ACTIONS)
        self.threshold = None if threshold is None else int(threshold)
        self.on_straggler = on_straggler

    def current_threshold(self, core: PolicyView) -> int:
        """:math:`\\theta` for the current live set."""
        if self.threshold is not None:
            return self.threshold
        return max(1, 2 * (len(core.live) - 1))

    def judge(self, core, worker_id, staleness):
        del worker_id
        return stale_verdict(
            staleness,
            self.current_threshold(core),
            self.on_straggler,
            force_pull=True,
            who="saps straggler",
        )

    def _config(self):
        return {"threshold": self.threshold, "on_straggler": self.on_straggler}


class SemiAsync(Policy):
    r"""Semi-asynchronous with bounded version staleness (ASHL's SHL stage).

    Like SSP, but bounded in versions rather than clocks: a worker may pull only if
    every live worker that is computing (not waiting) works on parameters at most
    :math:`s` versions old,

    .. math::

       V - \min_{j\ \text{live, not waiting}} v_j \le s,

    with :math:`v_j` the version last sent to :math:`j`. Fast workers thus stop
    where a slow one would fall more than :math:`s` versions behind, and go on once
    it pulls again. Pushes already in flight can still exceed the bound; those are
    damped by :math:`(1+s)/(1+\tau)` or dropped (``on_stale``). Workers that wait
    are not counted, so the worker with the oldest parameters is never blocked and
    the scheme cannot deadlock.

    Args:
      max_staleness: :math:`s`, an int >= 0.
      on_stale: ``"damp"`` or ``"drop"``.

    Examples:
      >>> from hpsjax.decisions._policies import SemiAsync
      >>> SemiAsync(max_staleness=2)
      SemiAsync(max_staleness=2, on_stale='damp')

    References:
      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 2024.
    """

    name = "semi_async"

    def __init__(self, *, max_staleness: int = 4, on_stale: str = "damp"):
        check_int("max_staleness", max_staleness, low=0)
        check_choice("on_stale", on_stale, STALE_ACTIONS)
        self.max_staleness = int(max_staleness)
        self.on_stale = on_stale
        self._cache_epoch = -1
        self._cache_oldest: int | None = None

    def _oldest(self, core: PolicyView) -> int | None:
        # Within one event, only releases change who computes, and a released
        # worker gets the newest version, so the oldest base computed once per
        # event stays exact; this keeps admit O(1) for many waiting workers.
        if self._cache_epoch != core.epoch:
            oldest = None
            for w in core.live:
                if not core.is_waiting(w):
                    v = core.pulled_version(w)
                    if oldest is None or v < oldest:
                        oldest = v
            self._cache_epoch = core.epoch
            self._cache_oldest = oldest
        return self._cache_oldest

    def admit(self, core, worker_id):
        del worker_id
        oldest = self._oldest(core)
        return oldest is None or core.version - oldest <= self.max_staleness

    def admit_key(self, core):
        # The answer is the same for every worker, so it is its own key.
        return self.admit(core, None)

    def wait_reason(self, core, worker_id):
        del worker_id
        oldest = self._oldest(core)
        if oldest is None:
            return "semi_async: waiting"
        return (
            f"semi_async: a computing worker is {core.version - oldest} "
            f"versions behind (bound {self.max_staleness})"
        )

    def judge(self, core, worker_id, staleness):
        del core, worker_id
        return stale_verdict(
            staleness,
            self.max_staleness,
            self.on_stale,
            force_pull=False,
            who="semi_async",
        )

    def _config(self):
        return {"max_staleness": self.max_staleness, "on_stale": self.on_stale}


class Ringmaster(Policy):
    r"""Ringmaster ASGD: asynchronous SGD that ignores gradients delayed R or more.

    Every push is applied at once, as in ASP, unless its delay (staleness)
    :math:`\tau` reaches the threshold :math:`R`: such a push is dropped without
    being applied (weight 0) and its worker is told to pull
    (:class:`~hpsjax.ps.ForcePull`), so that its next gradient is computed at
    the current point. With :math:`k` the server's version and :math:`g` the
    gradient a worker computed on version :math:`k - \tau_k`:

    .. math::

       x_{k+1} = x_k - \gamma\, g(x_{k-\tau_k}) \quad \text{if } \tau_k < R,
       \qquad \text{else the push is ignored and } x_{k+1} = x_k.

    With ``stop_stale`` (the paper's algorithm with calculation stops), every
    new version :math:`k` also stops the workers still computing on a version
    :math:`k - R` or older (:meth:`stops`): a gradient they finish could only
    be ignored, so each drops its round and starts again on :math:`x_k`
    instead of spending the rest of it. A worker computes on the version last
    sent to it until it pushes a gradient of that version; one that has
    pushed and awaits its pull is not stopped (its pull brings :math:`x_k`),
    and each computation is stopped once.

    The paper proves that this is optimal in time under arbitrarily
    heterogeneous and changing worker speeds, for :math:`R = \max(1,
    \lceil \sigma^2 / \varepsilon \rceil)` (:math:`\sigma^2` the gradient noise,
    :math:`\varepsilon` the target squared gradient norm), without knowing the
    workers' speeds. Neither is known to a training run, so
    ``delay_threshold=None`` takes :math:`R = n`, the number of live workers:
    in steady ASP with equal workers each push is about :math:`n - 1` versions
    stale, so only workers slower than the rest are cut. Nobody waits.

    What was read: the paper's abstract, introduction and summary ("achieves
    optimality by ignoring gradients with delays larger than a certain
    threshold"; a gradient is used only when :math:`\delta_k < R`), and the
    names of its algorithms (Ringmaster ASGD without and with calculation
    stops). What differs: the paper's stop is instantaneous; a real worker
    (``hpsjax-worker``) cannot interrupt a compiled step, so it drops the
    round's result when the step ends (its push and the server's judgement
    are saved, not the step), while the simulator stops the computation at
    once. ``SaPS(threshold=R - 1, on_straggler="drop")`` drops the same
    pushes; this class names the rule as the paper states it.

    Args:
      delay_threshold: :math:`R`, an int >= 1 (a push with
        :math:`\tau \ge R` is ignored), or ``None`` for the number of live
        workers.
      stop_stale: also stop computations that fall :math:`R` versions behind.

    Examples:
      >>> from hpsjax.decisions._policies import Ringmaster
      >>> Ringmaster(delay_threshold=4)
      Ringmaster(delay_threshold=4, stop_stale=False)

    References:
      Maranjyan, Tyurin, Richtárik, `Ringmaster ASGD: The First Asynchronous
      SGD with Optimal Time Complexity <https://arxiv.org/abs/2501.16168>`_,
      ICML 2025.
    """

    name = "ringmaster"

    def __init__(self, *, delay_threshold: int | None = None, stop_stale: bool = False):
        check_int("delay_threshold", delay_threshold, low=1, allow_none=True)
        if not isinstance(stop_stale, bool):
            raise ValueError(f"stop_stale must be a bool, got {stop_stale!r}.")
        self.delay_threshold = None if delay_threshold is None else int(delay_threshold)
        self.stop_stale = stop_stale
        # worker -> the version whose computation was stopped (stopped once).
        self._stopped: dict = {}

    def current_threshold(self, core: PolicyView) -> int:
        """:math:`R` for the current live set."""
        if self.delay_threshold is not None:
            return self.delay_threshold
        return max(1, len(core.live))

    def judge(self, core, worker_id, staleness):
        del worker_id
        threshold = self.current_threshold(core)
        if staleness < threshold:
            return Verdict()
        return Verdict(
            0.0, True, f"ringmaster: delay {staleness} >= R = {threshold}, ignored"
        )

    def stops(self, core):
        if not self.stop_stale:
            return ()
        threshold = self.current_threshold(core)
        version = core.version
        stops = []
        for worker_id in sorted(core.live, key=repr):
            base = core.pulled_version(worker_id)
            if version - base < threshold or self._stopped.get(worker_id) == base:
                continue
            if (
                core.is_waiting(worker_id)
                or core.worker(worker_id).pushed_version == base
            ):
                continue  # not computing on ``base``: its pull brings the new one
            self._stopped[worker_id] = base
            stops.append(
                (
                    worker_id,
                    f"ringmaster: computing on version {base}, {version - base} "
                    f">= R = {threshold} behind, stopped",
                )
            )
        return tuple(stops)

    def _config(self):
        return {"delay_threshold": self.delay_threshold, "stop_stale": self.stop_stale}
