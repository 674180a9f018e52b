r"""Synchronisation policies of the parameter server.

A policy answers five questions for :class:`~hpsjax.ps.ServerCore`, which keeps
all the bookkeeping and asks them at the right moments:

* :meth:`Policy.admit`: may this worker's pull proceed now, or must it wait?
* :meth:`Policy.judge`: how much of a push of staleness :math:`\tau` is used
  (a weight; 0 drops it), and must the worker pull fresh parameters?
* :meth:`Policy.ready`: apply the buffered updates now (averaged)?
* :meth:`Policy.completes`: would one more push of this worker make it ready
  (asked before the push is recorded; ``None`` where it cannot tell)?
* :meth:`Policy.local_steps`: how many local steps should a worker take before its
  next push (a hint sent with each answer)?

and may keep state of its own through :meth:`Policy.on_push` and
:meth:`Policy.on_apply`. Notation: worker :math:`i` pushes an update computed on
parameters of version :math:`v_i` while the server is at version :math:`V`; its
staleness is :math:`\tau = V - v_i`; its clock :math:`c_i` counts its pushes.

Built-in policies, by name (:data:`POLICIES`, :func:`get_policy`):

=============== =============================================================
``"bsp"``       wait for every live worker each round, apply their average
``"asp"``       apply pushes at once (or every ``aggregate`` pushes: n-softsync)
``"ssp"``       bounded clock gap: proceed only if :math:`\min_j c_j \ge c_i - s`
``"saps"``      version-based straggler detection; damp or drop, force a pull
``"adsp"``      local-step hints so that all workers commit equally often
``"semi_async"`` bounded version staleness, stale pushes damped or dropped
``"hybrid"``    a sequence of stages, each async, semi-async or sync
``"ringmaster"`` ASP that ignores pushes delayed :math:`R` versions or more
=============== =============================================================

Writing your own: subclass :class:`Policy` and override only what differs; the
defaults are those of ASP (never wait, use every push fully, apply at once)::

    class EveryOther(Policy):
        name = "every_other"

        def ready(self, core):
            return core.buffered >= 2

        def judge(self, core, worker_id, staleness):
            if staleness > 8:
                return Verdict(weight=0.0, force_pull=True, reason="too stale")
            return Verdict()

    core = ServerCore(params, optax.sgd(0.1), EveryOther())

Policies read the core through a :class:`PolicyView`, the few read-only
members they need (``core.version``, ``core.live``, ``core.clock(i)``,
``core.min_clock``, ``core.worker(i)``, ...), and never change it. A stateful
policy object belongs to one core.

A damped push (``on_stale="damp"``) beyond a staleness bound :math:`s` is scaled by

.. math::

   f(\tau) = \frac{1 + s}{1 + \tau}, \qquad \tau > s,

which is 1 at the bound and falls like :math:`1/\tau` beyond it, as the staleness-
aware rule of Zhang et al. (2016) does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from hpsjax._checks import check_choice, check_int, check_positive, is_int

if TYPE_CHECKING:
    from hpsjax.decisions._core import ServerCore

__all__ = [
    "ADSP",
    "ASP",
    "BSP",
    "DEFAULT_POLICY",
    "POLICIES",
    "SSP",
    "Hybrid",
    "HybridStage",
    "PlannedHybrid",
    "Policy",
    "PolicyView",
    "Ringmaster",
    "SaPS",
    "SemiAsync",
    "Verdict",
    "get_policy",
]

STALE_ACTIONS = ("damp", "drop")
"""What to do with a push beyond a staleness bound."""

HYBRID_MODES = ("async", "semi_async", "sync")
"""Modes of a :class:`HybridStage` (those of ``hpsjax.transforms.Stage``)."""


class Verdict(NamedTuple):
    """What the server does with one push.

    Attributes:
      weight: factor the update is scaled by before averaging, in [0, 1]; 0 drops
        it.
      force_pull: tell the worker to discard its local work and pull.
      reason: why it was damped, dropped or force-pulled (reported to the worker).
    """

    weight: float = 1.0
    force_pull: bool = False
    reason: str | None = None


_ACCEPT = Verdict()


class PolicyView:
    """What a policy reads of its :class:`~hpsjax.ps.ServerCore`, read only.

    The core hands every policy hook one view of itself; the view's members
    are the core's of the same names.

    Args:
      core: the server core.

    Attributes:
      clock: ``clock(worker_id)``, a worker's clock :math:`c_i` (pushes done).
      pulled_version: ``pulled_version(worker_id)``, the version last sent to
        a worker.
      is_waiting: ``is_waiting(worker_id)``, whether a worker's pull is blocked.
      worker: ``worker(worker_id)``, a snapshot of a worker's bookkeeping
        (:class:`~hpsjax.ps.WorkerInfo`: its measured times, its loss).
    """

    __slots__ = ("_core", "clock", "is_waiting", "pulled_version", "worker")

    def __init__(self, core: ServerCore):
        self._core = core
        # The core's own methods, so that a policy's reads of every worker
        # (SemiAsync's) cost no more through the view.
        self.clock = core.clock
        self.pulled_version = core.pulled_version
        self.is_waiting = core.is_waiting
        self.worker = core.worker

    @property
    def version(self) -> int:
        """The server version :math:`V`."""
        return self._core.version

    @property
    def epoch(self) -> int:
        """Counts the core's events; a policy may key a cache on it."""
        return self._core.epoch

    @property
    def live(self) -> frozenset:
        """Ids of the live workers."""
        return self._core.live

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        return self._core.min_clock

    @property
    def buffered(self) -> int:
        """Number of updates buffered and not yet applied."""
        return self._core.buffered

    @property
    def buffer_contributors(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        return self._core.buffer_contributors


def _stale_verdict(
    staleness: int, bound: int | None, on_stale: str, *, force_pull: bool, who: str
) -> Verdict:
    """Damps or drops a push beyond ``bound`` (see the module docstring)."""
    if bound is None or staleness <= bound:
        return _ACCEPT
    if on_stale == "drop":
        return Verdict(
            0.0, force_pull, f"{who}: staleness {staleness} > {bound}, dropped"
        )
    return Verdict(
        (1.0 + bound) / (1.0 + staleness),
        force_pull,
        f"{who}: staleness {staleness} > {bound}, damped",
    )


class Policy:
    """Base class of synchronisation policies; its defaults behave as ASP.

    Override any of the hooks below. Each receives the
    :class:`~hpsjax.ps.ServerCore` (read it, never change it) and must be cheap:
    the core calls ``admit`` for every blocked worker after every event (after
    every event that changes :meth:`admit_key`, for a policy that defines it).

    Attributes:
      name: the policy's name, used in reasons, reprs and checkpoints.
      synchronous: every round waits for every live worker (a barrier), so a
        worker computes on the newest version and pushes with staleness 0
        unless it pipelines its transfers; told to workers when they connect
        (the INFO map's ``synchronous``), whose overlap follows it by default.
      stages: a staged policy's stages (:meth:`set_stage`), else empty.
      stage: a staged policy's current stage index, else ``None``.
    """

    name: str = "custom"
    synchronous: bool = False
    stages: tuple = ()
    stage: int | None = None

    def admit(self, core: ServerCore, worker_id: Any) -> bool:
        """Whether ``worker_id``'s pull may proceed now.

        Called when the worker pulls (it already counts as waiting, so it is
        excluded from "the workers that are not waiting") and, while it waits,
        after every later event (every one that changes :meth:`admit_key`, or
        the worker's own record), in the order the workers began to wait.

        Args:
          core: the server core.
          worker_id: a live worker.

        Returns:
          ``True`` to send it parameters now, ``False`` to make it wait.
        """
        del core, worker_id
        return True

    def admit_key(self, core: ServerCore) -> Any:
        """What :meth:`admit` depends on, beyond the asking worker's own record.

        A hashable value such that, as long as it stays equal and a blocked
        worker's own record (its clock, its membership) is unchanged,
        :meth:`admit` gives that worker the same answer. The core then re-examines
        blocked workers only when the key changes, which keeps an event O(1) in
        the number of blocked workers instead of O(n). ``None`` (the default)
        means unknown: every blocked worker is re-examined after every event.

        Args:
          core: the server core.

        Returns:
          A hashable value, or ``None``.
        """
        del core
        return None

    def wait_reason(self, core: ServerCore, worker_id: Any) -> str:
        """A short text saying what a blocked worker waits for."""
        del core, worker_id
        return f"{self.name}: waiting"

    def judge(self, core: ServerCore, worker_id: Any, staleness: int) -> Verdict:
        """Decides the weight of a push and whether its worker must pull.

        Called once per valid push, before any bookkeeping changes (``core``
        shows the state before the push).

        Args:
          core: the server core.
          worker_id: the pushing worker.
          staleness: :math:`\\tau = V - v_i` of the push, an int >= 0.

        Returns:
          A :class:`Verdict`.
        """
        del core, worker_id, staleness
        return _ACCEPT

    def ready(self, core: ServerCore) -> bool:
        """Whether the buffered updates (``core.buffered`` > 0) are applied now."""
        return core.buffered >= 1

    def completes(self, core: ServerCore, worker_id: Any) -> bool | None:
        """Whether a buffered push of ``worker_id`` would make :meth:`ready` true.

        Asked before the push is judged and recorded (``core`` shows the state
        before it), so only a policy whose readiness depends on the buffer and
        the live workers alone can answer; ``None`` (the default) means it
        cannot tell. The answer changes where the arithmetic happens, never a
        decision: a push said to complete a version has its apply worked out
        (and checked) with it, and may have it started before it is whole;
        others have only the buffer checked. A subclass that changes
        :meth:`ready` or :meth:`on_push` says so here too.
        """
        del core, worker_id
        return None

    def local_steps(self, core: ServerCore, worker_id: Any) -> int | None:
        """Hint: local steps ``worker_id`` should take before its next push."""
        del core, worker_id
        return None

    def on_push(self, core: ServerCore, worker_id: Any, now: float) -> None:
        """Sees every valid push after the core recorded it (before any apply)."""
        del core, worker_id, now

    def on_apply(self, core: ServerCore, now: float) -> None:
        """Sees every new version right after it was applied."""
        del core, now

    def set_stage(self, core: ServerCore, index: int) -> None:
        """Moves to stage ``index``; only staged policies have stages."""
        del core
        raise ValueError(
            f"Policy {self.name!r} has no stages (asked for stage {index!r}); "
            "use the 'hybrid' policy."
        )

    def state_dict(self) -> dict:
        """The policy's own state as plain Python values (msgpack-able)."""
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores :meth:`state_dict`; raises ``ValueError`` on a bad state."""
        if state:
            raise ValueError(
                f"Policy {self.name!r} keeps no state, got keys {sorted(state)}."
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({fields})"

    def _config(self) -> dict:
        return {}


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
        return _stale_verdict(
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

    def current_threshold(self, core: ServerCore) -> int:
        """:math:`\\theta` for the current live set."""
        if self.threshold is not None:
            return self.threshold
        return max(1, 2 * (len(core.live) - 1))

    def judge(self, core, worker_id, staleness):
        del worker_id
        return _stale_verdict(
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

    def _oldest(self, core: ServerCore) -> int | None:
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
        return _stale_verdict(
            staleness,
            self.max_staleness,
            self.on_stale,
            force_pull=False,
            who="semi_async",
        )

    def _config(self):
        return {"max_staleness": self.max_staleness, "on_stale": self.on_stale}


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

    def _timing(self, core: ServerCore, worker_id: Any) -> tuple[float, float] | None:
        info = core.worker(worker_id)
        if info.time_per_step is None:
            return None
        return info.time_per_step, info.overhead or 0.0

    def _close_period(self, core: ServerCore) -> None:
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


@dataclasses.dataclass(frozen=True)
class HybridStage:
    """Server settings of one stage of :class:`Hybrid`.

    ``hpsjax.transforms.Stage`` objects can be given to :class:`Hybrid` directly:
    their ``mode``, ``local_steps`` and ``max_staleness`` mean the same, and their
    ``until_step`` (updates applied in all) is read as ``until_version``.

    Attributes:
      mode: ``"async"`` (ASP; with ``max_staleness``, stale pushes are damped or
        dropped, nobody waits), ``"semi_async"`` (:class:`SemiAsync`, needs
        ``max_staleness``) or ``"sync"`` (:class:`BSP`).
      local_steps: the local step hint of the stage, an int >= 1.
      max_staleness: the stage's staleness bound (int >= 0) or ``None``.
      until_version: leave the stage once the server reaches this version, or
        ``None`` (only an explicit ``set_stage`` leaves it).
    """

    mode: str = "async"
    local_steps: int = 1
    max_staleness: int | None = None
    until_version: int | None = None

    def __post_init__(self):
        if self.mode not in HYBRID_MODES:
            raise ValueError(
                f"Unknown stage mode {self.mode!r}; valid modes are "
                f"{', '.join(HYBRID_MODES)}."
            )
        check_int("local_steps", self.local_steps, low=1)
        check_int("max_staleness", self.max_staleness, low=0, allow_none=True)
        check_int("until_version", self.until_version, low=1, allow_none=True)
        if self.mode == "semi_async" and self.max_staleness is None:
            raise ValueError("A semi_async stage needs max_staleness (an int >= 0).")
        if self.mode == "sync" and self.max_staleness not in (None, 0):
            raise ValueError(
                "A sync stage has staleness 0; max_staleness must be None or 0, "
                f"got {self.max_staleness!r}."
            )


def _as_hybrid_stage(stage: Any, index: int) -> HybridStage:
    if isinstance(stage, HybridStage):
        return stage
    try:
        mode = stage.mode
        local_steps = stage.local_steps
        max_staleness = stage.max_staleness
    except AttributeError:
        raise ValueError(
            f"stages[{index}] must be a HybridStage or have mode, local_steps and "
            f"max_staleness attributes, got {type(stage).__name__}."
        ) from None
    until = getattr(stage, "until_version", None)
    if until is None:
        until = getattr(stage, "until_step", None)
    return HybridStage(mode, local_steps, max_staleness, until)


class Hybrid(Policy):
    r"""A sequence of stages, each run by the ASP, semi-async or BSP policy.

    ASHL's scheme: a first asynchronous stage with many local steps and a large
    staleness tolerance (AHL), then a semi-asynchronous one with few local steps
    and frequent pushes (SHL). The current stage's policy answers every question;
    its ``local_steps`` is the hint sent to workers. The stage advances when the
    server version reaches its ``until_version``, or when told by
    :meth:`ServerCore.set_stage` (a worker whose staged optimizer switched on a
    flat loss reports it). Blocked workers and buffered updates are re-examined
    under the new stage at once.

    ``hpsjax-server`` takes the stages as JSON objects of :class:`HybridStage`'s
    fields: ``--policy hybrid --policy_arg 'stages=[{"mode": "async",
    "local_steps": 8, "max_staleness": 16, "until_version": 100}, {"mode":
    "semi_async", "max_staleness": 2}]'`` (LAUNCH.md).

    Args:
      stages: a non-empty sequence of :class:`HybridStage` (or
        ``hpsjax.transforms.Stage``); ``until_version`` increases along it.
      on_stale: ``"damp"`` or ``"drop"`` for pushes beyond a stage's bound.

    Examples:
      >>> from hpsjax.decisions._policies import Hybrid, HybridStage
      >>> policy = Hybrid([
      ...     HybridStage("async", local_steps=8, max_staleness=16,
      ...                 until_version=100),
      ...     HybridStage("semi_async", local_steps=1, max_staleness=2),
      ... ])
      >>> policy.stage, policy.current.mode
      (0, 'async')

    References:
      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 2024.
    """

    name = "hybrid"

    def __init__(self, stages: Sequence[Any], *, on_stale: str = "damp"):
        check_choice("on_stale", on_stale, STALE_ACTIONS)
        if isinstance(stages, str | bytes) or not isinstance(stages, Sequence):
            raise ValueError(
                f"stages must be a sequence of stages, got {type(stages).__name__}."
            )
        if not stages:
            raise ValueError("Hybrid needs at least one stage.")
        converted = tuple(_as_hybrid_stage(s, i) for i, s in enumerate(stages))
        untils = [s.until_version for s in converted if s.until_version is not None]
        if any(b <= a for a, b in itertools.pairwise(untils)):
            raise ValueError(f"until_version must increase along stages: {untils}.")
        self.stages = converted
        self.on_stale = on_stale
        self._delegates = tuple(self._delegate(s) for s in converted)
        self._stage = 0

    def _delegate(self, stage: HybridStage) -> Policy:
        if stage.mode == "sync":
            return BSP()
        if stage.mode == "semi_async":
            return SemiAsync(max_staleness=stage.max_staleness, on_stale=self.on_stale)
        return ASP(max_staleness=stage.max_staleness, on_stale=self.on_stale)

    @property
    def stage(self) -> int:
        """Index of the current stage."""
        return self._stage

    @property
    def current(self) -> HybridStage:
        """Settings of the current stage."""
        return self.stages[self._stage]

    @property
    def synchronous(self) -> bool:
        """Whether the current stage is synchronous (``"sync"``)."""
        return self._delegates[self._stage].synchronous

    def admit(self, core, worker_id):
        return self._delegates[self._stage].admit(core, worker_id)

    def admit_key(self, core):
        inner = self._delegates[self._stage].admit_key(core)
        return None if inner is None else (self._stage, inner)

    def wait_reason(self, core, worker_id):
        inner = self._delegates[self._stage].wait_reason(core, worker_id)
        return f"hybrid stage {self._stage}: {inner}"

    def judge(self, core, worker_id, staleness):
        return self._delegates[self._stage].judge(core, worker_id, staleness)

    def ready(self, core):
        return self._delegates[self._stage].ready(core)

    def local_steps(self, core, worker_id):
        del core, worker_id
        return self.current.local_steps

    def on_push(self, core, worker_id, now):
        self._delegates[self._stage].on_push(core, worker_id, now)

    def on_apply(self, core, now):
        self._delegates[self._stage].on_apply(core, now)
        last = len(self.stages) - 1
        while self._stage < last:
            until = self.stages[self._stage].until_version
            if until is None or core.version < until:
                break
            self._stage += 1

    def set_stage(self, core, index):
        del core
        if not is_int(index) or not 0 <= index < len(self.stages):
            raise ValueError(
                f"Stage index must be an int in [0, {len(self.stages)}), got {index!r}."
            )
        self._stage = int(index)

    def state_dict(self):
        return {"stage": self._stage}

    def load_state_dict(self, state):
        if not isinstance(state, Mapping) or set(state) != {"stage"}:
            raise ValueError(f"A hybrid state needs exactly the key 'stage': {state!r}")
        index = state["stage"]
        if not is_int(index) or not 0 <= index < len(self.stages):
            raise ValueError(f"Stage index {index!r} out of range.")
        self._stage = int(index)

    def _config(self):
        return {"stages": list(self.stages), "on_stale": self.on_stale}


class PlannedHybrid(Hybrid):
    r"""ASHL's staged policy with each worker's planned local steps.

    :class:`Hybrid` hints the same local step count to every worker of a stage.
    ASHL plans :math:`H_i` per worker so that :math:`H_i t_i + T_i` is equal for
    all (``hpsjax.planning.plan(..., "ashl")``); this policy hints worker
    :math:`i` its planned :math:`H_i` of the current stage (the stage's own count
    for a worker the plan does not name). Everything else is :class:`Hybrid`'s.

    Args:
      stages: the stages, as for :class:`Hybrid`.
      local_steps: per stage, a mapping worker id -> :math:`H_i` (for instance
        ``{w.worker_id: w.local_steps for w in work_plan.workers}``).
      on_stale: as for :class:`Hybrid`.

    Raises:
      ValueError: if ``local_steps`` does not hold one mapping per stage.

    Examples:
      >>> from hpsjax.ps import HybridStage, PlannedHybrid
      >>> policy = PlannedHybrid(
      ...     [HybridStage("async", 8, 32, until_version=10),
      ...      HybridStage("semi_async", 2, 4)],
      ...     [{0: 8, 1: 32}, {0: 2, 1: 8}])
      >>> policy.planned_steps[1][1]
      8

    References:
      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, `ASHL: An Adaptive
      Multi-Stage Distributed Deep Learning Training Scheme for Heterogeneous
      Environments <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans.
      Computers 73(1), 2024.
    """

    name = "hybrid"

    def __init__(
        self,
        stages: Sequence[Any],
        local_steps: Sequence[Mapping[Any, int]],
        *,
        on_stale: str = "damp",
    ):
        super().__init__(stages, on_stale=on_stale)
        if len(local_steps) != len(self.stages):
            raise ValueError(
                f"{len(local_steps)} local-step plans for {len(self.stages)} stages"
            )
        self.planned_steps = tuple(dict(p) for p in local_steps)

    def local_steps(self, core, worker_id):
        del core
        return self.planned_steps[self.stage].get(worker_id, self.current.local_steps)

    def _config(self):
        return {**super()._config(), "local_steps": list(self.planned_steps)}


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

    The paper proves that this is optimal in time under arbitrarily
    heterogeneous and changing worker speeds, for :math:`R = \max(1,
    \lceil \sigma^2 / \varepsilon \rceil)` (:math:`\sigma^2` the gradient noise,
    :math:`\varepsilon` the target squared gradient norm), without knowing the
    workers' speeds. Neither is known to a training run, so
    ``delay_threshold=None`` takes :math:`R = n`, the number of live workers:
    in steady ASP with equal workers each push is about :math:`n - 1` versions
    stale, so only workers slower than the rest are cut. Nobody waits.

    Our reading: the paper's abstract, introduction and its summary ("achieves
    optimality by ignoring gradients with delays larger than a certain
    threshold"; a gradient is used only when :math:`\delta_k < R`); its second
    form, which also stops a worker's computation once it can no longer arrive
    in time, is not built here (the worker learns it at its next push, from
    the forced pull). ``SaPS(threshold=R - 1, on_straggler="drop")`` drops the
    same pushes; this class names the rule as the paper states it.

    Args:
      delay_threshold: :math:`R`, an int >= 1 (a push with
        :math:`\tau \ge R` is ignored), or ``None`` for the number of live
        workers.

    Examples:
      >>> from hpsjax.decisions._policies import Ringmaster
      >>> Ringmaster(delay_threshold=4)
      Ringmaster(delay_threshold=4)

    References:
      Maranjyan, Tyurin, Richtárik, `Ringmaster ASGD: The First Asynchronous
      SGD with Optimal Time Complexity <https://arxiv.org/abs/2501.16168>`_,
      ICML 2025.
    """

    name = "ringmaster"

    def __init__(self, *, delay_threshold: int | None = None):
        check_int("delay_threshold", delay_threshold, low=1, allow_none=True)
        self.delay_threshold = None if delay_threshold is None else int(delay_threshold)

    def current_threshold(self, core: ServerCore) -> int:
        """:math:`R` for the current live set."""
        if self.delay_threshold is not None:
            return self.delay_threshold
        return max(1, len(core.live))

    def judge(self, core, worker_id, staleness):
        del worker_id
        threshold = self.current_threshold(core)
        if staleness < threshold:
            return _ACCEPT
        return Verdict(
            0.0, True, f"ringmaster: delay {staleness} >= R = {threshold}, ignored"
        )

    def _config(self):
        return {"delay_threshold": self.delay_threshold}


POLICIES: dict[str, type[Policy]] = {
    "asp": ASP,
    "bsp": BSP,
    "ssp": SSP,
    "saps": SaPS,
    "adsp": ADSP,
    "semi_async": SemiAsync,
    "hybrid": Hybrid,
    "ringmaster": Ringmaster,
}
"""Built-in policies by name."""

DEFAULT_POLICY = "bsp"
"""The policy of a server told none (:class:`hpsjax.ps.Server`,
``hpsjax-server``; ``hpsjax-launch`` has the same): synchronous rounds, the
baseline every other scheme is measured against."""


def get_policy(name_or_obj: str | Policy | type[Policy], **kwargs: Any) -> Policy:
    """Returns a policy from its name, its class or itself.

    Args:
      name_or_obj: a name in :data:`POLICIES` (case-insensitive), a
        :class:`Policy` subclass, or a :class:`Policy` object (returned as is).
      **kwargs: keyword arguments of the policy's constructor (none allowed with
        an object).

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: for an unknown name, bad or unknown keyword arguments, or
        keyword arguments given with an object.

    Examples:
      >>> from hpsjax.decisions._policies import get_policy
      >>> get_policy("ssp", staleness_bound=2)
      SSP(staleness_bound=2)
      >>> get_policy("nope")
      Traceback (most recent call last):
      ...
      ValueError: Unknown policy 'nope'; valid names are adsp, asp, bsp, hybrid, \
ringmaster, saps, semi_async, ssp.
    """
    if isinstance(name_or_obj, Policy):
        if kwargs:
            raise ValueError(
                f"Keyword arguments {sorted(kwargs)} given with a policy object; "
                "pass them to its constructor instead."
            )
        return name_or_obj
    if isinstance(name_or_obj, type) and issubclass(name_or_obj, Policy):
        cls = name_or_obj
    elif isinstance(name_or_obj, str):
        cls = POLICIES.get(name_or_obj.lower())
        if cls is None:
            raise ValueError(
                f"Unknown policy {name_or_obj!r}; valid names are "
                f"{', '.join(sorted(POLICIES))}."
            )
    else:
        raise ValueError(
            "A policy must be a name, a Policy subclass or a Policy object, got "
            f"{type(name_or_obj).__name__}."
        )
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"Bad arguments for policy {cls.name!r}: {err}") from None
