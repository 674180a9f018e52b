r"""The synchronous and clock-bounded policies: BSP, SSP and ADSP.

BSP waits for every live worker each round and applies their average; SSP
bounds the clock gap (proceed only if :math:`\min_j c_j \ge c_i - s`); ADSP
gives local-step hints so that all workers commit equally often. Each is a
:class:`~hpsjax.decisions.Policy` (see :mod:`hpsjax.decisions._policy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hpsjax._checks import check_int, check_positive
from hpsjax.decisions._policy import Policy, PolicyView

__all__ = ["ADSP", "BSP", "SSP"]


class BSP(Policy):
    r"""Bulk synchronous parallel: each round waits for every live worker.

    A worker that has pushed :math:`c_i` times may pull only when every live worker
    has pushed as often (:math:`\min_j c_j \ge c_i`). Pushes are buffered and their
    average applied once every live worker has an update in the buffer, so a round
    makes exactly one version and everyone is released at it. A worker dropped for
    a missed deadline no longer holds the round; one joining mid-round takes part
    in it (it joins at the smallest live clock).

    Examples:
      >>> from hpsjax.decisions._policies import BSP
      >>> BSP()
      BSP()
    """

    name = "bsp"
    synchronous = True

    def admit(self, core, worker_id):
        return core.min_clock >= core.clock(worker_id)

    def admit_key(self, core):
        return core.min_clock

    def wait_reason(self, core, worker_id):
        return f"bsp: round {core.clock(worker_id)} not complete"

    def ready(self, core):
        return core.buffered > 0 and core.live <= core.buffer_contributors

    def completes(self, core, worker_id):
        missing = core.live.difference(core.buffer_contributors)
        return not missing or missing == {worker_id}


class SSP(Policy):
    r"""Stale synchronous parallel: the clock gap between workers is bounded.

    A worker at clock :math:`c_i` (pushes done) may pull only if the slowest live
    worker's clock is at least :math:`c_i - s`; it waits otherwise and is released
    when the slowest catches up or is dropped. Pushes are applied at once. ``s = 0``
    waits like BSP but applies every push on its own.

    Args:
      staleness_bound: :math:`s`, an int >= 0.

    Examples:
      >>> from hpsjax.decisions._policies import SSP
      >>> SSP(staleness_bound=3)
      SSP(staleness_bound=3)

    References:
      Ho, Cipar, Cui, Lee, Kim, Gibbons, Gibson, Ganger, Xing, `More Effective
      Distributed ML via a Stale Synchronous Parallel Parameter Server
      <https://papers.nips.cc/paper/4894>`_, NIPS 2013.
    """

    name = "ssp"

    def __init__(self, *, staleness_bound: int = 3):
        check_int("staleness_bound", staleness_bound, low=0)
        self.staleness_bound = int(staleness_bound)

    def admit(self, core, worker_id):
        return core.min_clock >= core.clock(worker_id) - self.staleness_bound

    def admit_key(self, core):
        return core.min_clock

    def wait_reason(self, core, worker_id):
        return (
            f"ssp: clock {core.clock(worker_id)} ahead of slowest "
            f"{core.min_clock} by more than {self.staleness_bound}"
        )

    def _config(self):
        return {"staleness_bound": self.staleness_bound}


class ADSP(Policy):
    r"""ADSP: every worker commits about equally often, nobody waits.

    Time is cut into check periods of :math:`T` seconds, starting at the first
    push. From the core's measurements each worker :math:`i` has a compute time per
    local step :math:`t_i` and a per-commit overhead :math:`o_i` (measured
    interval minus reported compute time; 0 when not reported). For a target of
    :math:`C` commits per period, worker :math:`i` is told (``local_steps`` in each
    answer) to take

    .. math::

       H_i = \operatorname{clip}\Big(\operatorname{round}
             \frac{T/C - o_i}{t_i},\ 1,\ H_{\max}\Big)

    local steps per commit, so that :math:`H_i t_i + o_i \approx T/C` for all:
    a worker 4x faster takes 4x the local steps. Commits are applied at once.

    Search of :math:`C` (our reading of ADSP's online search), at each period end:
    :math:`C_{\max} = \lfloor T / \max_i (t_i + o_i) \rfloor` is the most the
    slowest worker can do (one step per commit). The first target is
    ``commits_per_period`` or :math:`C_{\max}`. With ``search`` and losses reported
    with the pushes, the gain of a period is the drop of the mean loss from the
    previous period per second, :math:`J_k = (\bar L_{k-1} - \bar L_k)/T`; when
    :math:`J_k < J_{k-1}` the search turns around, and each period
    :math:`C \leftarrow \operatorname{round}(C \cdot \gamma^{\pm 1})` in the
    current direction (first towards fewer commits), kept in
    :math:`[1, C_{\max}]`. Without losses :math:`C` only follows :math:`C_{\max}`.

    Args:
      check_period: :math:`T` in seconds, > 0.
      commits_per_period: the first :math:`C` (int >= 1), or ``None`` for
        :math:`C_{\max}`.
      search: search :math:`C` online from the reported losses.
      search_factor: :math:`\gamma > 1`, the multiplicative search step.
      max_local_steps: :math:`H_{\max}`, an int >= 1.

    Examples:
      >>> from hpsjax.decisions._policies import ADSP
      >>> policy = ADSP(check_period=30.0, commits_per_period=6)
      >>> policy.target, policy.check_period
      (6, 30.0)

    References:
      Hu, Wang, Wu, `Distributed Machine Learning through Heterogeneous Edge
      Systems <https://arxiv.org/abs/1911.06949>`_, AAAI 2020.
    """

    name = "adsp"

    def __init__(
        self,
        *,
        check_period: float = 10.0,
        commits_per_period: int | None = None,
        search: bool = True,
        search_factor: float = 1.5,
        max_local_steps: int = 1000,
    ):
        check_positive("check_period", check_period)
        check_int("commits_per_period", commits_per_period, low=1, allow_none=True)
        if not isinstance(search, bool):
            raise ValueError(f"search must be a bool, got {search!r}.")
        check_positive("search_factor", search_factor)
        if search_factor <= 1:
            raise ValueError(f"search_factor must be > 1, got {search_factor!r}.")
        check_int("max_local_steps", max_local_steps, low=1)
        self.check_period = float(check_period)
        self.commits_per_period = commits_per_period
        self.search = search
        self.search_factor = float(search_factor)
        self.max_local_steps = int(max_local_steps)
        self._target: int | None = commits_per_period
        self._period_start: float | None = None
        self._periods = 0
        self._counts: dict = {}
        self._last_counts: dict = {}
        self._loss_sum = 0.0
        self._loss_count = 0
        self._prev_loss: float | None = None
        self._prev_gain: float | None = None
        self._direction = -1

    @property
    def target(self) -> int | None:
        """:math:`C`, the current target of commits per period per worker."""
        return self._target

    @property
    def periods(self) -> int:
        """Number of check periods completed."""
        return self._periods

    @property
    def last_counts(self) -> dict:
        """Commits of each worker in the last completed period."""
        return dict(self._last_counts)

    def _timing(self, core: PolicyView, worker_id: Any) -> tuple[float, float] | None:
        info = core.worker(worker_id)
        if info.time_per_step is None:
            return None
        return info.time_per_step, info.overhead or 0.0

    def _close_period(self, core: PolicyView) -> None:
        self._periods += 1
        self._last_counts = self._counts
        self._counts = {}
        cycles = [
            t + o for t, o in filter(None, (self._timing(core, w) for w in core.live))
        ]
        if not cycles:
            return
        c_max = max(1, math.floor(self.check_period / max(cycles)))
        if self._target is None:
            self._target = c_max
        elif self.search and self._loss_count:
            mean_loss = self._loss_sum / self._loss_count
            if self._prev_loss is not None:
                gain = (self._prev_loss - mean_loss) / self.check_period
                if self._prev_gain is not None and gain < self._prev_gain:
                    self._direction = -self._direction
                self._prev_gain = gain
                self._target = round(self._target * self.search_factor**self._direction)
            self._prev_loss = mean_loss
        self._target = min(max(self._target, 1), c_max)
        self._loss_sum = 0.0
        self._loss_count = 0

    def on_push(self, core, worker_id, now):
        if self._period_start is None:
            self._period_start = now
        while now >= self._period_start + self.check_period:
            self._close_period(core)
            self._period_start += self.check_period
        self._counts[worker_id] = self._counts.get(worker_id, 0) + 1
        loss = core.worker(worker_id).last_loss
        if loss is not None:
            self._loss_sum += loss
            self._loss_count += 1

    def local_steps(self, core, worker_id):
        if self._target is None:
            return None
        timing = self._timing(core, worker_id)
        if timing is None:
            return None
        time_per_step, overhead = timing
        interval = self.check_period / self._target
        steps = round((interval - overhead) / max(time_per_step, 1e-12))
        return min(max(steps, 1), self.max_local_steps)

    def state_dict(self):
        return {
            "target": self._target,
            "period_start": self._period_start,
            "periods": self._periods,
            "counts": [[k, v] for k, v in self._counts.items()],
            "last_counts": [[k, v] for k, v in self._last_counts.items()],
            "loss_sum": self._loss_sum,
            "loss_count": self._loss_count,
            "prev_loss": self._prev_loss,
            "prev_gain": self._prev_gain,
            "direction": self._direction,
        }

    def load_state_dict(self, state):
        expected = set(self.state_dict())
        if not isinstance(state, Mapping) or set(state) != expected:
            raise ValueError(
                f"An ADSP state needs exactly the keys {sorted(expected)}, got "
                f"{sorted(state) if isinstance(state, Mapping) else state!r}."
            )
        check_int("target", state["target"], low=1, allow_none=True)
        if state["direction"] not in (-1, 1):
            raise ValueError(f"direction must be -1 or 1, got {state['direction']!r}.")
        try:
            counts = {_key(k): int(v) for k, v in state["counts"]}
            last_counts = {_key(k): int(v) for k, v in state["last_counts"]}
            values = {
                "period_start": _opt_float(state["period_start"]),
                "periods": int(state["periods"]),
                "loss_sum": float(state["loss_sum"]),
                "loss_count": int(state["loss_count"]),
                "prev_loss": _opt_float(state["prev_loss"]),
                "prev_gain": _opt_float(state["prev_gain"]),
            }
        except (TypeError, ValueError) as err:
            raise ValueError(f"Bad ADSP state: {err}") from None
        self._target = state["target"]
        self._direction = state["direction"]
        self._counts = counts
        self._last_counts = last_counts
        self._period_start = values["period_start"]
        self._periods = values["periods"]
        self._loss_sum = values["loss_sum"]
        self._loss_count = values["loss_count"]
        self._prev_loss = values["prev_loss"]
        self._prev_gain = values["prev_gain"]

    def _config(self):
        return {
            "check_period": self.check_period,
            "commits_per_period": self.commits_per_period,
            "search": self.search,
            "search_factor": self.search_factor,
            "max_local_steps": self.max_local_steps,
        }


def _key(value: Any) -> Any:
    # msgpack turns tuples into lists; worker ids are str or int.
    if isinstance(value, str | int) and not isinstance(value, bool):
        return value
    raise ValueError(f"a worker id must be a str or an int, got {value!r}")


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
