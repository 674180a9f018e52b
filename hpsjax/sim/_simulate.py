r"""A virtual-clock simulator of parameter-server training with unequal workers.

:func:`simulate` trains one model with :math:`n` simulated workers through the
same :class:`~hpsjax.ps.ServerCore` that the asyncio server drives: the same
policies (BSP, ASP, SSP, SaPS, ADSP, semi-async, hybrid), the same server
optimizer and staleness handling. The gradients are real JAX computations on real
data; only the clock is simulated. A discrete-event loop pops ``(time, seq,
event)`` from a heap; a worker's compute takes the time its
:class:`~hpsjax.sim.ComputeModel` draws (scaled by its slowdown schedule), a
message of :math:`n` bytes takes :math:`\ell + n/B` on its link, and the server
reacts the moment a message arrives.

A worker's round follows the worker runtime (:mod:`hpsjax.worker`). With
``overlap="none"``::

    params arrive -> H local steps (compute) -> push + pull -> [server: apply,
    maybe Wait until Release] -> params arrive -> ...

With ``overlap="pipeline"`` (H-PS, PS+) a round starts by sending the previous
round's update and, right behind it on the connection, a pull; both travel while
the round computes, and the next round starts once the compute is done and the
pull answered (an update is pushed one round after it was computed). With
``overlap="eager"`` the worker also pulls again while the running compute leaves
time for another round trip (at most ``eager_pulls`` pulls a round), so the next
round starts on fresher parameters.

Worker-side transforms: local steps with ``local_optimizer`` (the pushed
update is the pseudo-gradient :math:`w_\text{pulled} - w_\text{local}`; plain
gradients without one), the step-size scale of the work plan, PS+'s modulation of
the pushed update by :math:`f(\hat\tau)` (:func:`~hpsjax.transforms.staleness_factor`
of :math:`\hat\tau = V_\text{known} - v`, the newest version the worker heard of
minus the one it computed on), and a
``push_transform`` such as quantization with error feedback, whose bytes on the
wire set the push transfer time. Policies' hints (``local_steps`` of ADSP and of
hybrid stages) and :class:`~hpsjax.ps.ForcePull` (SaPS) are obeyed; work plans
set per-worker batch sizes, local steps and step-size scales, and a
:class:`~hpsjax.profiling.Replanner` revises them as measured speeds drift.

Speed: rounds are evaluated lazily and in batches with ``jax.vmap`` (see
``hpsjax/sim/_engine.py``), parameters travel as host arrays (zero-copy views),
and every shape compiles once.

Determinism: every random draw (compute times, batches, quantization) comes from
generators seeded by ``SimConfig.seed``; the same seed gives identical metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import msgspec
import numpy as np
import optax

from hpsjax.apply._deferred import DeferredAggregator
from hpsjax.data import Batch, Dataset, share_split
from hpsjax.decisions._core import (
    Applied,
    Drop,
    ForcePull,
    PlanChanged,
    PushAck,
    Release,
    SendParams,
    ServerCore,
    StageChanged,
    Wait,
)
from hpsjax.decisions._policies import ADSP, BSP, Hybrid, Policy, get_policy
from hpsjax.planning import Replanner, WorkPlan
from hpsjax.profiling import tree_wire_nbytes
from hpsjax.sim._engine import DeferredLeaves, Engine, IndexStream, Round, SummedRow
from hpsjax.sim._workers import WorkerSpec, finish_time
from hpsjax.transforms import (
    last_encoded,
    last_powersgd_encoded,
    last_sparseloco_nbytes,
    last_streaming_nbytes,
    topk_nbytes,
)
from hpsjax.transforms._staleness import STALENESS_POLICIES
from hpsjax.wire._errors import HpsError, NonFiniteUpdate, WorkerDropped
from hpsjax.worker import _core as wc
from hpsjax.worker._core import OVERLAP_MODES

__all__ = [
    "OVERLAP_MODES",
    "ApplyRecord",
    "Divergence",
    "Interval",
    "PushRecord",
    "SendRecord",
    "SimConfig",
    "SimResult",
    "simulate",
]

_DATA_SHARDINGS = ("disjoint", "shared")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool
    )


def _check_optional(name: str, value: Any, *, integer: bool = False) -> None:
    if value is None:
        return
    if integer:
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}.")
        if value < 1:
            raise ValueError(f"{name} must be an int >= 1 or None, got {value}.")
    elif not _is_number(value) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    r"""How a simulation runs: policy, optimizers, worker behaviour, stop, eval.

    Attributes:
      policy: a policy name (``"bsp"``, ``"asp"``, ``"ssp"``, ``"saps"``,
        ``"adsp"``, ``"semi_async"``, ``"hybrid"``), class or object, as for
        :class:`~hpsjax.ps.ServerCore`. An object belongs to one simulation.
      policy_kwargs: keyword arguments of a policy given by name or class.
      learning_rate: step size of the default server optimizer
        ``optax.sgd(learning_rate)`` when workers push gradients (no
        ``local_optimizer``); with local steps the default is ``optax.sgd(1.0)``,
        which moves the server by exactly the workers' local deltas.
      server_optimizer: the server's optax transform (extra args ``staleness``
        and ``stale_params`` reach it: ``scale_by_staleness``,
        ``delay_compensation``), or ``None`` for the default above.
      local_optimizer: optax transform of a worker's local steps (possibly
        :func:`~hpsjax.transforms.hybrid_stages`), or ``None``: each round is one
        gradient, pushed as it is. Needed for more than one local step.
      push_transform: optax transform applied by each worker to every pushed
        update, with its own state per worker (quantization with error feedback),
        or ``None``.
      codec: the wire codec of the pushes (a ``hpsjax.transforms.Codec``) for
        their byte count, or ``None``: the bytes that a
        :func:`~hpsjax.transforms.quantize` (or a
        :func:`~hpsjax.transforms.power_sgd`) in ``push_transform`` keeps for
        the wire, else float32-size (uncompressed) pushes. Pulls are never
        compressed.
      compress_from_stage: with a work plan, each worker's pushes are top-k
        sparsified at its plan's ``compress_ratio`` once the server's stage is
        at least this (the worker core's rule; ASHL's SHL is stage 1), and
        count the wire's top-k bytes; ``None`` never sparsifies. Only the bytes
        are simulated: the update applied is the whole one.
      overlap: ``"none"`` (compute, then push and pull in one round trip),
        ``"pipeline"`` (H-PS, PS+: the previous round's push and the next pull
        travel while a round computes) or ``"eager"`` (``"pipeline"`` with up to
        ``eager_pulls`` pulls a round while compute time is left), as the
        worker's ``overlap`` and ``eager_pulls``.
      eager_pulls: the most pulls per round with ``overlap="eager"``, >= 1.
      staleness_lr: PS+'s worker-side modulation: a policy name of
        :data:`~hpsjax.transforms.STALENESS_POLICIES` or a callable ``tau ->
        factor``; each update is scaled, when sent, by :math:`f(\hat\tau)` with
        :math:`\hat\tau = V_\text{known} - v`, the newest version the worker
        heard of (from pulls and push acknowledgements) minus the version it
        computed on. ``None`` for no modulation.
      duration: stop at this virtual time (s), or ``None``.
      max_updates: stop once the server made this many versions, or ``None``.
      max_gradients: stop once this many local steps were pushed, or ``None``.
        At least one of the three stops must be given.
      eval_every: evaluate every this many virtual seconds, or ``None``.
      eval_every_updates: evaluate every this many server versions, or ``None``.
        The first evaluation is at time 0 and the last at the end whenever
        evaluation data are given.
      eval_batch_size: examples per evaluation call.
      data_sharding: ``"disjoint"`` (worker :math:`i` of :math:`n` draws from
        examples :math:`i, i+n, \ldots`, like :meth:`hpsjax.data.Dataset.shard`)
        or ``"shared"`` (every worker draws from all examples). Disjoint shards
        follow the work plan's ``data_share`` where it gives every worker one
        (:func:`hpsjax.data.share_split`).
      core_kwargs: keyword arguments of :class:`~hpsjax.ps.ServerCore`
        (``keep_stale_params``, deadlines, ``expected_workers``, ...).
      batch_rows: the most worker steps evaluated in one batched call, or
        ``None`` to choose from the FLOPs of one gradient: up to 256 for a cheap
        gradient, one for an expensive one (see ``hpsjax/sim/_engine.py``).
      server_service_time: seconds the server spends handling one push
        (decoding, applying, answering), >= 0. The server handles one message
        at a time, first come first served: a push or pull that arrives while
        it is busy waits in a queue (in virtual time), and a push is applied
        and answered when its handling ends. Pulls take no service of their
        own but queue behind the pushes ahead of them. ``0`` (the default):
        every message is handled the instant it arrives, as before. On real
        processes this is several milliseconds a push
        (``python -m experiments.calibrate`` fits it).
      stop_on_divergence: a round whose training loss or update is not finite
        (NaN or infinity) ends the run where its worker finds it, as a worker
        stops on one, and the result says so (:attr:`SimResult.diverged`); so
        does the server's refusal of an update that would make the parameters
        non-finite. ``False``: the push is sent, the server refuses it and
        its worker leaves, and the others go on (the run's first such event
        is still recorded).
      seed: seed of every random draw.

    Raises:
      ValueError: for a value out of range, an unknown name, or no stop.
    """

    policy: Any = "asp"
    policy_kwargs: Mapping[str, Any] | None = None
    learning_rate: float = 0.1
    server_optimizer: optax.GradientTransformation | None = None
    local_optimizer: optax.GradientTransformation | None = None
    push_transform: optax.GradientTransformation | None = None
    codec: Any = None
    compress_from_stage: int | None = None
    overlap: str = "none"
    eager_pulls: int = 3
    staleness_lr: Any = None
    duration: float | None = None
    max_updates: int | None = None
    max_gradients: int | None = None
    eval_every: float | None = None
    eval_every_updates: int | None = None
    eval_batch_size: int = 4096
    data_sharding: str = "disjoint"
    core_kwargs: Mapping[str, Any] | None = None
    batch_rows: int | None = None
    server_service_time: float = 0.0
    stop_on_divergence: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.policy_kwargs is not None and not isinstance(
            self.policy_kwargs, Mapping
        ):
            raise ValueError("policy_kwargs must be a mapping or None.")
        if not _is_number(self.learning_rate) or not math.isfinite(self.learning_rate):
            raise ValueError(
                f"learning_rate must be a finite number, got {self.learning_rate!r}."
            )
        for name in ("server_optimizer", "local_optimizer", "push_transform"):
            value = getattr(self, name)
            if value is not None and not isinstance(
                value, optax.GradientTransformation
            ):
                raise ValueError(
                    f"{name} must be an optax GradientTransformation or None, got "
                    f"{type(value).__name__}."
                )
        wc.check_overlap(self.overlap)
        _check_optional("eager_pulls", self.eager_pulls, integer=True)
        if self.compress_from_stage is not None and (
            isinstance(self.compress_from_stage, bool)
            or not isinstance(self.compress_from_stage, int)
            or self.compress_from_stage < 0
        ):
            raise ValueError(
                f"compress_from_stage must be an int >= 0 or None, got "
                f"{self.compress_from_stage!r}."
            )
        if self.staleness_lr is not None and not callable(self.staleness_lr):
            if self.staleness_lr not in STALENESS_POLICIES:
                raise ValueError(
                    f"Unknown staleness_lr {self.staleness_lr!r}; valid names are "
                    f"{', '.join(sorted(STALENESS_POLICIES))}, or a callable."
                )
            if self.staleness_lr == "drop":
                raise ValueError(
                    "staleness_lr='drop' needs a cut-off; use the server policy's "
                    "max_staleness to drop stale updates."
                )
        _check_optional("duration", self.duration)
        _check_optional("max_updates", self.max_updates, integer=True)
        _check_optional("max_gradients", self.max_gradients, integer=True)
        if (
            self.duration is None
            and self.max_updates is None
            and (self.max_gradients is None)
        ):
            raise ValueError(
                "Give at least one of duration, max_updates and max_gradients, "
                "or the simulation never ends."
            )
        _check_optional("eval_every", self.eval_every)
        _check_optional("eval_every_updates", self.eval_every_updates, integer=True)
        _check_optional("eval_batch_size", self.eval_batch_size, integer=True)
        _check_optional("batch_rows", self.batch_rows, integer=True)
        if self.data_sharding not in _DATA_SHARDINGS:
            raise ValueError(
                f"Unknown data_sharding {self.data_sharding!r}; valid values are "
                f"{', '.join(_DATA_SHARDINGS)}."
            )
        if self.core_kwargs is not None and not isinstance(self.core_kwargs, Mapping):
            raise ValueError("core_kwargs must be a mapping or None.")
        if self.push_transform is None and self.codec is not None:
            raise ValueError(
                "codec counts the bytes of compressed pushes; give the "
                "push_transform that compresses them too."
            )
        service = self.server_service_time
        if not isinstance(self.stop_on_divergence, bool):
            raise ValueError(
                "stop_on_divergence must be True or False, got "
                f"{self.stop_on_divergence!r}."
            )
        if not _is_number(service) or not (math.isfinite(service) and service >= 0):
            raise ValueError(
                f"server_service_time must be a finite number >= 0, got {service!r}."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer):
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}.")
        if self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed}.")


class Interval(NamedTuple):
    """A span of virtual time.

    Attributes:
      start: seconds.
      end: seconds, ``>= start``.
      kind: for worker timelines ``"compute"``, ``"discarded"`` (compute thrown
        away on a force-pull or drop), ``"transfer"`` (blocked on its own
        messages) or ``"wait"`` (blocked by the server: a barrier); for link
        transfers ``"push"`` or ``"pull"``.
    """

    start: float
    end: float
    kind: str


class PushRecord(NamedTuple):
    """One push as the server handled it.

    Attributes:
      time: arrival at the server (s).
      sent: when the worker sent it (s).
      worker_id: the worker.
      version: the version it was computed on.
      staleness: server version at arrival minus ``version``.
      status: ``"applied"``, ``"buffered"``, ``"dropped"`` or ``"rejected"`` (the
        server refused it: an error, see ``SimResult.errors``).
      weight: the policy's damping factor.
      local_steps: local steps behind it.
      batch_size: samples per local step.
      loss: mean training loss of its local steps.
    """

    time: float
    sent: float
    worker_id: Any
    version: int
    staleness: int
    status: str
    weight: float
    local_steps: int
    batch_size: int
    loss: float


class SendRecord(NamedTuple):
    """Parameters sent to a worker (the answer to a pull or join).

    Attributes:
      time: seconds.
      worker_id: the worker.
      version: the version sent.
      clock: the worker's clock (pushes) at that moment.
      min_clock: the smallest clock among live workers at that moment.
    """

    time: float
    worker_id: Any
    version: int
    clock: int
    min_clock: int


class ApplyRecord(NamedTuple):
    """A new server version.

    Attributes:
      time: seconds.
      version: the new version.
      num_updates: updates averaged into it.
      staleness: the staleness passed to the server optimizer.
      contributors: the workers whose updates it holds.
    """

    time: float
    version: int
    num_updates: int
    staleness: int
    contributors: tuple


class Divergence(NamedTuple):
    """Where a simulated run diverged.

    Attributes:
      time: the virtual time (s) it was found at: when the worker's round
        ended (a non-finite loss or update) or when the server refused the
        update.
      worker_id: the worker whose round it was.
      version: the version the round computed on.
      loss: the round's training loss (NaN or infinity where that was it).
      reason: ``"loss"`` (a non-finite training loss), ``"update"`` (a
        non-finite update) or ``"server"`` (the server refused an update that,
        applied, would make the parameters non-finite).
    """

    time: float
    worker_id: Any
    version: int
    loss: float
    reason: str

    def __str__(self) -> str:
        what = {
            "loss": f"loss {self.loss:g}",
            "update": "a non-finite update",
            "server": "an update that would make the parameters non-finite",
        }[self.reason]
        return (
            f"diverged at t = {self.time:.3g} s: worker {self.worker_id!r}, "
            f"{what} on version {self.version}"
        )


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a simulation produced.

    Attributes:
      metrics: columns over virtual time, each a numpy array of one entry per
        evaluation: ``"time"``, ``"version"``, ``"gradients"`` (local steps
        pushed so far), ``"train_loss"`` (mean loss of the pushes since the
        previous entry, NaN if none), and every metric of ``eval_fn``.
      timelines: per worker id, its time from joining to the end (or leaving)
        cut into :class:`Interval` of kind ``"compute"``, ``"discarded"``,
        ``"transfer"`` and ``"wait"``, in order, without gaps or overlaps.
      transfers: per worker id, its link's busy spans (``"push"``, ``"pull"``),
        which may overlap its compute.
      bytes_sent: per worker id, bytes of its pushes.
      bytes_received: per worker id, bytes of the parameters it received.
      pushes: every push handled by the server, in order.
      applies: every new version, in order.
      sends: every parameter send, in order.
      staleness: histogram ``{staleness: pushes}`` of the handled pushes.
      num_updates: server versions made.
      num_gradients: local steps in pushed rounds.
      evaluated_gradients: local steps evaluated (pushed, in flight at the end
        or discarded), without padding.
      padded_gradients: padding rows evaluated to keep shapes fixed.
      drops: times a worker was dropped by a deadline (or refused) and rejoined.
      errors: messages of the errors the server answered pushes or pulls with.
      work_plans: the work plans in force, the initial one first, then each
        revision (empty without a plan).
      params: the server's final parameters.
      end_time: the virtual time the simulation stopped at (s).
      wall_seconds: wall-clock seconds it took.
      diverged: the first :class:`Divergence` of the run, or ``None``; with
        ``SimConfig.stop_on_divergence`` the run stopped there.
    """

    metrics: Mapping[str, np.ndarray]
    timelines: Mapping[Any, tuple[Interval, ...]]
    transfers: Mapping[Any, tuple[Interval, ...]]
    bytes_sent: Mapping[Any, int]
    bytes_received: Mapping[Any, int]
    pushes: tuple[PushRecord, ...]
    applies: tuple[ApplyRecord, ...]
    sends: tuple[SendRecord, ...]
    staleness: Mapping[int, int]
    num_updates: int
    num_gradients: int
    evaluated_gradients: int
    padded_gradients: int
    drops: int
    errors: tuple[str, ...]
    work_plans: tuple[WorkPlan, ...]
    params: Any
    end_time: float
    wall_seconds: float
    diverged: Divergence | None = None

    def time_in(self, worker_id: Any) -> dict[str, float]:
        """Seconds a worker spent in each timeline kind.

        Raises:
          KeyError: for an unknown worker.
        """
        totals = dict.fromkeys(("compute", "discarded", "transfer", "wait"), 0.0)
        for iv in self.timelines[worker_id]:
            totals[iv.kind] += iv.end - iv.start
        return totals

    def idle_fraction(self, worker_id: Any = None) -> float:
        """Share of a worker's time (or all workers' time) not spent on kept work.

        Everything but ``"compute"`` counts as idle: waiting for the server or
        the link, and compute that was thrown away.

        Args:
          worker_id: a worker, or ``None`` for all workers together.

        Returns:
          A number in ``[0, 1]`` (0 for a worker that spent no time).
        """
        ids = list(self.timelines) if worker_id is None else [worker_id]
        total = busy = 0.0
        for w in ids:
            for iv in self.timelines[w]:
                total += iv.end - iv.start
                if iv.kind == "compute":
                    busy += iv.end - iv.start
        return 0.0 if total <= 0 else 1.0 - busy / total


class _Worker:
    """A simulated worker: its decisions (a :class:`~hpsjax.worker.WorkerCore`),
    its rounds in the engine, its link and its timeline."""

    __slots__ = (
        "blocked_since",
        "blocked_spans",
        "bytes_received",
        "bytes_sent",
        "compute_spans",
        "core",
        "down_free",
        "het",
        "id",
        "index",
        "join_time",
        "latency",
        "params",
        "rng",
        "rounds",
        "server_wait_since",
        "server_waits",
        "slowdown",
        "spans",
        "spec",
        "startup",
        "stream",
        "transfer_spans",
        "up_free",
    )

    def __init__(self, index, worker_id, spec, rng, stream, core):
        self.index = index
        self.id = worker_id
        self.spec = spec
        self.het = spec.heterogeneity
        self.latency = 0.0 if self.het is None else self.het.latency
        self.slowdown = ((0.0, 1.0),) if self.het is None else self.het.slowdown
        self.join_time = float(spec.join_time)
        self.startup = float(spec.startup_time)  # left to charge: first round
        self.rng = rng
        self.stream = stream
        self.core = core
        self.params = None
        self.rounds: dict[int, Round] = {}  # computing or waiting to be pushed
        self.spans: dict[int, list] = {}  # their compute spans
        self.blocked_since = None
        self.server_wait_since = None
        self.up_free = 0.0
        self.down_free = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.compute_spans: list[list] = []
        self.blocked_spans: list[tuple[float, float]] = []
        self.server_waits: list[tuple[float, float]] = []
        self.transfer_spans: list[Interval] = []

    @property
    def session(self) -> int:
        return self.core.session

    def bandwidth(self, now: float) -> float | None:
        if self.het is None:
            return None
        return self.het.bandwidth_at(now - self.join_time)


def _plan_shares(
    work_plan: WorkPlan, ids: list[Any], n_examples: int
) -> list[np.ndarray] | None:
    """Each worker's example indices by the plan's ``data_share``
    (:func:`hpsjax.data.share_split`), or ``None`` when the plan gives none."""
    by_id = {w.worker_id: w.data_share for w in work_plan.workers}
    shares = [by_id.get(i) for i in ids]
    if any(s is None for s in shares):
        return None
    return share_split(n_examples, shares)


def _is_dataset(data: Any) -> bool:
    return isinstance(data, Dataset)


def _as_arrays(data: Any, name: str) -> tuple[Any, int]:
    """A pytree of host arrays with a common leading axis, and its length."""
    if _is_dataset(data):
        data = Batch(data.x, data.y)
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError(f"{name} holds no arrays.")
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(
            f"{name} must be a Dataset or a pytree of arrays with one common "
            f"leading (example) axis, got leading sizes {sorted(lengths)}."
        )
    n = lengths.pop()
    if n == 0:
        raise ValueError(f"{name} holds no examples.")
    return data, n


class _Simulation:
    """One run of :func:`simulate`; see there."""

    def __init__(
        self,
        loss_fn,
        params,
        train_data,
        workers,
        config: SimConfig,
        eval_data,
        eval_fn,
        work_plan,
        callback,
    ):
        self.config = config
        self.callback = callback
        specs = _check_workers(workers)

        policy = get_policy(config.policy, **dict(config.policy_kwargs or {}))
        local = config.local_optimizer is not None
        self.local = local
        if not local:
            _check_policy_without_local_steps(policy)
        server_optimizer = config.server_optimizer
        if server_optimizer is None:
            server_optimizer = _default_optimizer(
                1.0 if local else float(config.learning_rate)
            )
        core_kwargs = dict(config.core_kwargs or {})

        data, n_examples = _as_arrays(train_data, "train_data")
        ids = [
            s.worker_id if s.worker_id is not None else i for i, s in enumerate(specs)
        ]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids repeat: {ids}")
        if config.data_sharding == "disjoint" and len(specs) > n_examples:
            raise ValueError(
                f"{len(specs)} workers cannot get disjoint shards of "
                f"{n_examples} examples; use data_sharding='shared'."
            )

        self.replanner = None
        self.plans: list[WorkPlan] = []
        if isinstance(work_plan, Replanner):
            self.replanner = work_plan
            work_plan = work_plan.plan
        if work_plan is not None and not isinstance(work_plan, WorkPlan):
            raise ValueError(
                "work_plan must be a WorkPlan, a Replanner or None, got "
                f"{type(work_plan).__name__}."
            )

        seed = int(config.seed)
        self.workers = self._make_workers(specs, ids, n_examples, work_plan)
        self.by_id = {w.id: w for w in self.workers}
        if work_plan is not None:
            self._apply_plan(work_plan)
        if not local:
            for w in self.workers:
                if w.core.plan_steps > 1:
                    raise ValueError(
                        f"worker {w.id!r} takes {w.core.plan_steps} local steps; more "
                        "than one local step needs a local_optimizer."
                    )

        self._set_up_eval(loss_fn, eval_data, eval_fn)
        self.engine = Engine(
            loss_fn,
            params,
            jax.device_put(data),
            len(self.workers),
            local_optimizer=config.local_optimizer,
            push_transform=config.push_transform,
            batch_rows=config.batch_rows,
            batch_sizes=tuple(w.core.device_batches[0] for w in self.workers),
            seed=seed,
        )
        self._make_server(params, policy, server_optimizer, core_kwargs)

        self._reset_state()

    def _make_workers(self, specs, ids, n_examples, work_plan) -> list[_Worker]:
        """The workers, each with its shard of the data and its core."""
        config = self.config
        seed = int(config.seed)
        shares = None
        if config.data_sharding == "disjoint" and work_plan is not None:
            shares = _plan_shares(work_plan, ids, n_examples)
        workers: list[_Worker] = []
        for i, (spec, worker_id) in enumerate(zip(specs, ids, strict=True)):
            if shares is not None:
                # The plan's data shares (ASHL's reference re-partitions so).
                indices = shares[i].astype(np.int32)
            elif config.data_sharding == "disjoint":
                indices = np.arange(i, n_examples, len(specs), dtype=np.int32)
            else:
                indices = np.arange(n_examples, dtype=np.int32)
            workers.append(
                _Worker(
                    i,
                    worker_id,
                    spec,
                    np.random.default_rng([seed, 0, i]),
                    IndexStream(indices, (seed, 1, i)),
                    wc.WorkerCore(
                        device_batches=(spec.batch_size,),
                        local_steps=spec.local_steps,
                        lr_scale=float(spec.lr_scale),
                        pushes_gradients=not self.local,
                        overlap=config.overlap,
                        eager_pulls=config.eager_pulls,
                        staleness_lr=config.staleness_lr,
                    ),
                )
            )
        return workers

    def _set_up_eval(self, loss_fn, eval_data, eval_fn) -> None:
        """The evaluation batches on the device and the jitted ``eval_fn``."""
        config = self.config
        self.eval_sets = None
        self.eval_fn = None
        if eval_data is not None:
            eval_arrays, n_eval = _as_arrays(eval_data, "eval_data")
            size = config.eval_batch_size
            self.eval_sets = [
                (
                    jax.device_put(
                        jax.tree.map(lambda a, s=start: a[s : s + size], eval_arrays)
                    ),
                    min(size, n_eval - start),
                )
                for start in range(0, n_eval, size)
            ]
            if eval_fn is None:

                def eval_fn(p, batch):
                    return {"loss": loss_fn(p, batch)}

            self.eval_fn = jax.jit(eval_fn)
        elif eval_fn is not None:
            raise ValueError("eval_fn was given without eval_data.")

    def _make_server(self, params, policy, server_optimizer, core_kwargs) -> None:
        """The server core and the sizes of what goes over the wire."""
        config = self.config
        # Workers compute on a version only when the engine evaluates their
        # rounds, so with batched rounds the server core may defer its applies
        # until then and carry many out in one call: the same decisions and,
        # up to rounding, the same parameters (see DeferredAggregator). Each
        # deferral keeps the parameters of every version it makes, so it is
        # bounded in bytes. Rounds evaluated summed (one call for a version's
        # workers, however costly a gradient) push lazy updates, which only a
        # deferring core takes.
        param_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
        self.max_deferred = min(256, (64 << 20) // max(1, param_bytes))
        # Updates the engine checked itself need no second check by the core.
        self.prechecked = config.push_transform is None and (
            config.staleness_lr is None
        )
        engine = self.engine
        # Sums pay where a version is made of the rounds started on the one
        # before: a barrier's. Elsewhere each version takes one push, whose
        # update a sum cannot give; and with costly gradients the deferral
        # itself pays only with sums (each update would otherwise go through
        # the deferred chain one row at a time, slower than applied alone).
        engine.sums = (
            engine.sums and self.prechecked and type(policy).ready is BSP.ready
        )
        if (
            (not engine.sequential or engine.sums)
            and self.max_deferred > 1
            and not core_kwargs.get("keep_stale_params", False)
        ):
            core_kwargs.setdefault("aggregator", DeferredAggregator)
        self.core = ServerCore(
            params,
            server_optimizer,
            policy,
            replanner=self.replanner,
            # Fed as each round's compute ends (_report), not at its push.
            replan_from_pushes=False,
            **core_kwargs,
        )
        aggregator = self.core.aggregator
        # The deferring aggregator, or None where applies are carried out at once.
        self.deferring = (
            aggregator if isinstance(aggregator, DeferredAggregator) else None
        )
        engine.sums = engine.sums and self.deferring is not None
        self.policy = self.core.policy
        # The server's stage as announced (StageChanged); acknowledgements
        # carry it to workers whose pushes it compresses.
        self.stage = self.core.stage
        self.deferred: dict[int, DeferredLeaves] = {}
        engine.resolve = self._resolve
        self.pull_bytes = tree_wire_nbytes(params)
        self.push_bytes = _push_bytes(params, config, self.pull_bytes)
        self.param_specs = [(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        self.topk_bytes: dict[float, int] = {}  # per ratio
        # The server averages buffered updates weighted by their samples. When
        # every push carries the same number, the weights cancel; leaving them
        # out then gives the same average and spares the server a rescaling of
        # every update.
        self.weigh_samples = (
            self.replanner is not None
            or type(policy).local_steps is not Policy.local_steps
            or len({w.core.device_batches[0] * w.core.plan_steps for w in self.workers})
            > 1
        )

    def _reset_state(self) -> None:
        """The virtual clock, the event queues and what the run records."""
        config = self.config
        self.heap: list = []
        self.ready: collections.deque = collections.deque()
        self.seq = 0
        self.now = 0.0
        self.stop = False
        self.tick_at: float | None = None
        self.service_time = float(config.server_service_time)
        self.server_free = 0.0  # when the server has handled its queue
        self.ticked_at = -math.inf
        self.leaves_version = -1
        self.version_leaves = None
        self.gradients = 0
        self.errors: list[str] = []
        self.pushes: list[PushRecord] = []
        self.applies: list[ApplyRecord] = []
        self.sends: list[SendRecord] = []
        self.staleness: Counter = Counter()
        self.metrics: dict[str, list] = {}
        self.loss_sum = 0.0
        self.loss_count = 0
        self.last_eval: tuple[float, int] | None = None
        self.diverged: Divergence | None = None

    # ------------------------------------------------------------ plumbing

    def schedule(self, t: float, fn, *args) -> None:
        self.seq += 1
        if t == self.now:
            # Due at this very instant: after every event already due now (they
            # were scheduled earlier), so a queue keeps the heap's order.
            self.ready.append((t, 0, self.seq, fn, args))
        else:
            heapq.heappush(self.heap, (t, 0, self.seq, fn, args))

    def run(self) -> SimResult:
        # The objects alive before the run (JAX's, the model's, the data's) are
        # kept out of the garbage collector's passes while it runs: a full pass
        # over them costs about as much as all of a long run's own objects.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return self._run()
        finally:
            if freeze:
                gc.unfreeze()

    def _run(self) -> SimResult:
        wall = time.perf_counter()
        config = self.config
        for w in self.workers:
            self.schedule(w.join_time, self._worker_join, w)
            if w.spec.leave_time is not None:
                self.schedule(float(w.spec.leave_time), self._worker_leave, w)
        if self.eval_sets is not None:
            self._evaluate()
            if config.eval_every is not None:
                self.seq += 1
                heapq.heappush(
                    self.heap, (config.eval_every, 1, self.seq, self._timed_eval, ())
                )
        horizon = math.inf if config.duration is None else float(config.duration)
        heap = self.heap
        ready = self.ready
        pop, popleft = heapq.heappop, ready.popleft
        end = 0.0
        while not self.stop:
            # Events due now wait in ``ready`` (in the order they were
            # scheduled); the heap holds the later ones, and any due now that
            # were scheduled before the clock reached this instant.
            if ready:
                event = pop(heap) if heap and heap[0] < ready[0] else popleft()
            elif heap:
                event = pop(heap)
            else:
                break
            t = event[0]
            if t > horizon:
                break
            self.now = end = t
            event[3](*event[4])
        if not self.stop and config.duration is not None:
            end = horizon
        self.now = end
        if self.eval_sets is not None and self.last_eval != (end, self.core.version):
            self._evaluate()
        return self._result(end, time.perf_counter() - wall)

    # ------------------------------------------------------------ worker side
    #
    # The worker follows hpsjax.worker's runtime. Without overlap a round is
    # compute, then push and pull in one round trip. With overlap ("pipeline",
    # "eager") a round starts by sending the previous round's update and, right
    # behind it on the connection, a pull; both travel while the round computes,
    # and the next round starts once the compute is done and the pull answered.
    # "eager" pulls again while the running compute leaves time for another
    # round trip, so the next round starts on fresher parameters.

    def _carry_out_worker(self, w: _Worker, actions: list, leaves=None) -> None:
        """Carries out a worker core's actions (``leaves``: of the parameters
        that the event handled brought)."""
        for action in actions:
            kind = type(action)
            if kind is wc.Compute:
                self._start_round(w, action)
            elif kind is wc.Push:
                self._send_push(w, w.rounds.pop(action.round), action)
            elif kind is wc.Pull:
                self._send_pull(w, action.session)
            elif kind is wc.KeepParams:
                w.params = leaves
            elif kind is wc.Discard:
                self.engine.cancel(w.rounds.pop(action.round))
                w.spans.pop(action.round)[2] = "discarded"
            elif kind is wc.Report:
                self._report(w, action)
            elif kind is wc.Join:
                self.schedule(self.now + w.latency, self._server_join, w, w.session)
            elif kind is wc.Stop:
                self.schedule(self.now + w.latency, self._server_leave, w)
            else:
                raise TypeError(f"unexpected worker action {action!r}")

    def _worker_join(self, w: _Worker) -> None:
        w.blocked_since = self.now
        self._carry_out_worker(w, w.core.handle(wc.Joined(self.now)))

    def _worker_leave(self, w: _Worker) -> None:
        now = self.now
        computing = w.core.current
        if computing is not None:
            w.spans[computing.round][1] = now
        elif w.blocked_since is not None:
            w.blocked_spans.append((w.blocked_since, now))
            w.blocked_since = None
        self._carry_out_worker(w, w.core.handle(wc.Left(now)))

    def _start_round(self, w: _Worker, compute: wc.Compute) -> None:
        now = self.now
        if w.blocked_since is not None:
            w.blocked_spans.append((w.blocked_since, now))
            w.blocked_since = None
        batch, steps = compute.batch_size, compute.local_steps
        model = w.spec.compute
        start = now
        if w.startup:
            # The first round: the worker's start-up comes before its steps.
            start, w.startup = now + w.startup, 0.0
        if (
            steps == 1
            and len(w.slowdown) == 1
            and model.sigma == 0
            and not (model.straggle_probability > 0 and model.straggle_slowdown > 1)
        ):
            # No randomness and one slowdown: the same sum as ``finish_time``'s,
            # without its arrays.
            step = float(model.mean_step_time(batch))
            end = w.join_time + ((start - w.join_time) + w.slowdown[0][1] * step)
        else:
            durations = model.draw(w.rng, batch, steps)
            end = w.join_time + finish_time(w.slowdown, start - w.join_time, durations)
        w.rounds[compute.round] = self.engine.submit(
            Round(w.index, w.params, steps, batch, compute.lr_scale, w.stream)
        )
        span = w.spans[compute.round] = [now, end, "compute"]
        w.compute_spans.append(span)
        self.schedule(end, self._compute_done, w, compute.round)

    def _compute_done(self, w: _Worker, round_: int) -> None:
        current = w.core.current
        if current is None or current.round != round_:
            return  # thrown away as the worker left
        w.blocked_since = self.now
        step_time = self.now - w.spans[round_][0]
        actions = w.core.handle(wc.Computed(round_, self.now, step_time))
        self._carry_out_worker(w, actions)

    def _report(self, w: _Worker, report: wc.Report) -> None:
        actions = self.core.observe_speed(
            w.id, report.batch_size, report.time_per_step, report.now
        )
        if actions:
            self._carry_out(actions)
        self._carry_out_worker(w, w.core.handle(wc.Reported(self.now)))

    def _send_push(self, w: _Worker, r: Round, push: wc.Push) -> None:
        if not r.done:
            self.engine.flush()
        if self.config.stop_on_divergence and (
            not math.isfinite(r.loss) or r.finite is False
        ):
            # The worker finds it before sending, and the run ends here.
            reason = "loss" if not math.isfinite(r.loss) else "update"
            self._diverge(w, push.version, r.loss, reason)
            return
        job = self.engine.prepare_push(w.index, r.update, push.lr_factor)
        nbytes = self.push_bytes
        if push.compress_ratio < 1.0:
            # A top-k push (the worker core's rule): the wire codec's bytes.
            nbytes = self.topk_bytes.get(push.compress_ratio)
            if nbytes is None:
                nbytes = self.topk_bytes[push.compress_ratio] = sum(
                    topk_nbytes(shape, dtype, push.compress_ratio)
                    for shape, dtype in self.param_specs
                )
        arrival = self._send_up(w, nbytes, "push")
        self._to_server(
            arrival,
            self.service_time,
            self._server_push,
            (w, push.session, r, job, push, self.now),
        )
        self.gradients += r.steps
        if self.config.max_gradients is not None and (
            self.gradients >= self.config.max_gradients
        ):
            self.stop = True

    def _send_pull(self, w: _Worker, session: int) -> None:
        # On one connection a request queues behind the push being sent.
        start = max(self.now, w.up_free)
        self._to_server(start + w.latency, 0.0, self._server_pull, (w, session))

    def _params_arrive(self, w, session, leaves, version, hint) -> None:
        event = wc.Pulled(session, version, self.now, local_steps=hint)
        self._carry_out_worker(w, w.core.handle(event), leaves)

    def _ack_arrive(self, w, session, version, hint, stage=None) -> None:
        event = wc.Acked(session, version, self.now, local_steps=hint, stage=stage)
        self._carry_out_worker(w, w.core.handle(event))

    def _force_arrive(self, w, session) -> None:
        self._carry_out_worker(w, w.core.handle(wc.ForcePulled(session)))

    def _dropped_arrive(self, w, session) -> None:
        self._carry_out_worker(w, w.core.handle(wc.Dropped(session, self.now)))

    def _send_up(self, w: _Worker, nbytes: int, kind: str) -> float:
        now = self.now
        start = max(now, w.up_free)
        bandwidth = w.bandwidth(start)
        end = start if bandwidth is None else start + nbytes / bandwidth
        w.up_free = end
        arrival = end + w.latency
        w.bytes_sent += nbytes
        w.transfer_spans.append(Interval(start, arrival, kind))
        return arrival

    def _send_down(self, w: _Worker, nbytes: int) -> float:
        now = self.now
        start = max(now, w.down_free)
        bandwidth = w.bandwidth(start)
        end = start if bandwidth is None else start + nbytes / bandwidth
        w.down_free = end
        arrival = end + w.latency
        w.bytes_received += nbytes
        w.transfer_spans.append(Interval(start, arrival, "pull"))
        return arrival

    # ------------------------------------------------------------ server side

    def _to_server(self, arrival: float, service: float, handler, args) -> None:
        """Delivers a message to the server at ``arrival``; with a service
        time it joins the server's queue there (see ``_server_queue``)."""
        if self.service_time:
            self.schedule(arrival, self._server_queue, service, handler, args)
        else:
            self.schedule(arrival, handler, *args)

    def _server_queue(self, service: float, handler, args) -> None:
        """A message arrived: the server handles it once the messages ahead
        of it are handled, taking ``service`` seconds, then acts on it."""
        done = max(self.now, self.server_free) + service
        self.server_free = done
        self.schedule(done, handler, *args)

    def _server_join(self, w: _Worker, session: int) -> None:
        if session != w.session:
            return
        self._carry_out(self.core.join(w.id, self.now))

    def _server_leave(self, w: _Worker) -> None:
        try:
            actions = self.core.leave(w.id, self.now)
        except HpsError as err:
            self.errors.append(f"leave of worker {w.id!r}: {err}")
            return
        self._close_server_wait(w)
        self._carry_out(actions)

    def _server_pull(self, w: _Worker, session: int) -> None:
        if session != w.session:
            return
        try:
            actions = self.core.pull(w.id, self.now)
        except HpsError as err:
            self._refused(w, "pull", err)
            return
        self._carry_out(actions)

    def _server_push(self, w, session, r, job, push, sent) -> None:
        if session != w.session:
            return
        now = self.now
        core = self.core
        if not job.done:
            self.engine.finish_pushes()
        loss = r.loss if math.isfinite(r.loss) else None
        version = push.version
        try:
            if type(job.update) is SummedRow:
                update = job.update  # evaluated with its version's apply
            else:
                update = self.engine.tree(job.update)
                if not (self.prechecked and r.finite):
                    update = core.aggregator.check_update(update)
            # The worker core's meta, with what this lazily evaluated round
            # knows only now.
            meta = msgspec.structs.replace(
                push.meta,
                num_samples=r.batch_size * r.steps if self.weigh_samples else None,
                local_steps=r.steps,
                loss=loss,
                stage=r.stage,
            )
            actions = core.push_message(w.id, update, meta, now=now)
        except HpsError as err:
            if isinstance(err, NonFiniteUpdate):
                # A non-finite update (one the worker could not check), or one
                # that would make the parameters non-finite.
                reason = "update" if "applied" not in str(err) else "server"
                self._diverge(w, version, r.loss, reason, stop=False)
                if self.config.stop_on_divergence:
                    self.stop = True
            self.pushes.append(
                PushRecord(
                    now,
                    sent,
                    w.id,
                    version,
                    core.version - version,
                    "rejected",
                    0.0,
                    r.steps,
                    r.batch_size,
                    r.loss,
                )
            )
            self._refused(w, "push", err)
            return
        if self.deferring and self.deferring.deferred_applies >= self.max_deferred:
            self._resolve()
        ack = actions[0]
        self.pushes.append(
            PushRecord(
                now,
                sent,
                w.id,
                version,
                ack.staleness,
                ack.status,
                ack.weight,
                r.steps,
                r.batch_size,
                r.loss,
            )
        )
        self.staleness[ack.staleness] += 1
        self.loss_sum += r.loss
        self.loss_count += 1
        compresses = w.core.compress_ratio < 1.0
        if (
            self.config.staleness_lr is not None
            or ack.local_steps is not None
            or compresses
        ):
            self.schedule(
                now + w.latency,
                self._ack_arrive,
                w,
                session,
                ack.version,
                ack.local_steps,
                # This push's stage change, or the one announced before it.
                (self.stage if ack.stage is None else ack.stage)
                if compresses
                else None,
            )
        self._carry_out(actions)
        if push.with_pull and session == w.session:
            try:
                actions = core.pull(w.id, now)
            except HpsError as err:
                self._refused(w, "pull", err)
                return
            self._carry_out(actions)

    def _diverge(
        self, w: _Worker, version: int, loss: float, reason: str, *, stop=True
    ) -> None:
        """Records the run's first divergence; ends the run with ``stop``."""
        if self.diverged is None:
            self.diverged = Divergence(
                self.now, w.id, int(version), float(loss), reason
            )
        if stop:
            self.stop = True

    def _refused(self, w: _Worker, what: str, err: HpsError) -> None:
        self.errors.append(f"{what} of worker {w.id!r}: {type(err).__name__}: {err}")
        if isinstance(err, WorkerDropped):
            self.schedule(self.now + w.latency, self._dropped_arrive, w, w.session)
        else:
            # The worker runtime stops on any other refusal (a bad update, a
            # protocol error): its connection closes and the server lets it go.
            self.schedule(self.now + w.latency, self._worker_leave, w)

    def _tick(self) -> None:
        self.tick_at = None
        self.ticked_at = self.now
        self._carry_out(self.core.tick(self.now))

    def _carry_out(self, actions: list) -> None:
        now = self.now
        core = self.core
        for action in actions:
            kind = type(action)
            if kind is SendParams:
                w = self.by_id[action.worker_id]
                if self.leaves_version != action.version:
                    if self.deferring and self.deferring.deferred_applies:
                        self.version_leaves = self.deferred[action.version] = (
                            DeferredLeaves(action.version)
                        )
                    else:
                        self.version_leaves = self.engine.version_leaves(core.params)
                    self.leaves_version = action.version
                self.sends.append(
                    SendRecord(
                        now, w.id, action.version, core.clock(w.id), core.min_clock
                    )
                )
                arrival = self._send_down(w, self.pull_bytes)
                self.schedule(
                    arrival,
                    self._params_arrive,
                    w,
                    w.session,
                    self.version_leaves,
                    action.version,
                    action.local_steps,
                )
            elif kind is Applied:
                self.applies.append(
                    ApplyRecord(
                        now,
                        action.version,
                        action.num_updates,
                        action.staleness,
                        action.contributors,
                    )
                )
                every = self.config.eval_every_updates
                if (
                    every is not None
                    and self.eval_sets is not None
                    and action.version % every == 0
                ):
                    self._evaluate()
                if (
                    self.config.max_updates is not None
                    and action.version >= self.config.max_updates
                ):
                    self.stop = True
            elif kind is Wait:
                w = self.by_id[action.worker_id]
                if w.server_wait_since is None:
                    w.server_wait_since = now
            elif kind is Release:
                self._close_server_wait(self.by_id[action.worker_id])
            elif kind is ForcePull:
                w = self.by_id[action.worker_id]
                self.schedule(now + w.latency, self._force_arrive, w, w.session)
            elif kind is Drop:
                w = self.by_id[action.worker_id]
                self._close_server_wait(w)
                self.errors.append(f"worker {w.id!r} dropped: {action.reason}")
                self.schedule(now + w.latency, self._dropped_arrive, w, w.session)
            elif kind is StageChanged:
                self.stage = action.stage
            elif kind is PlanChanged:
                self._apply_plan(action.plan)
            elif kind is not PushAck:
                raise TypeError(f"unexpected action {action!r}")
        deadline = core.next_deadline()
        if (
            deadline is not None
            and deadline > self.ticked_at
            and (self.tick_at is None or deadline < self.tick_at)
        ):
            self.tick_at = deadline
            self.schedule(max(deadline, now), self._tick)

    def _close_server_wait(self, w: _Worker) -> None:
        if w.server_wait_since is not None:
            w.server_waits.append((w.server_wait_since, self.now))
            w.server_wait_since = None

    # ------------------------------------------------------------ plans

    def _apply_plan(self, work_plan: WorkPlan) -> None:
        for w in self.workers:
            try:
                p = work_plan.worker(w.id)
            except ValueError:
                raise ValueError(
                    f"the work plan has no worker {w.id!r}; its workers are "
                    f"{[x.worker_id for x in work_plan.workers]}."
                ) from None
            if p.batch_size < 1:
                raise ValueError(f"the work plan gives worker {w.id!r} an empty batch.")
            w.core.handle(
                wc.PlanChanged(
                    device_batches=(p.batch_size,),
                    local_steps=p.local_steps,
                    lr_scale=float(p.lr_scale),
                )
            )
            if self.config.compress_from_stage is not None:
                w.core.compress_ratio = float(p.compress_ratio)
                w.core.compress_from_stage = self.config.compress_from_stage
        self.plans.append(work_plan)

    # ------------------------------------------------------------ evaluation

    def _timed_eval(self) -> None:
        self._evaluate()
        if self.heap or self.ready:
            # Only while anything else can still happen: evaluations alone
            # would go on for ever.
            self.seq += 1
            heapq.heappush(
                self.heap,
                (self.now + self.config.eval_every, 1, self.seq, self._timed_eval, ()),
            )

    def _resolve(self) -> None:
        """Carries out the core's deferred applies; fills in deferred leaves."""
        if not (self.deferring and self.deferring.deferred_applies):
            return
        rows, history = self.deferring.apply_deferred()
        if not self.engine.sequential:
            history = [np.asarray(x) for x in history]
        for version, deferred in self.deferred.items():
            row = rows[version]
            deferred.leaves = tuple(x[row] for x in history)
        self.deferred = {}

    def _evaluate(self) -> None:
        self._resolve()
        params = self.core.params
        totals: dict[str, float] = {}
        count = 0
        for batch, size in self.eval_sets:
            values = self.eval_fn(params, batch)
            if not isinstance(values, Mapping):
                raise ValueError(
                    "eval_fn must return a dict of scalar metrics, got "
                    f"{type(values).__name__}."
                )
            for key, value in jax.device_get(values).items():
                totals[key] = totals.get(key, 0.0) + float(value) * size
            count += size
        record = {
            "time": self.now,
            "version": self.core.version,
            "gradients": self.gradients,
            "train_loss": (
                self.loss_sum / self.loss_count if self.loss_count else math.nan
            ),
        }
        for key, value in totals.items():
            if key in record:
                raise ValueError(f"eval_fn metric name {key!r} is reserved.")
            record[key] = value / count
        self.loss_sum = 0.0
        self.loss_count = 0
        for key, value in record.items():
            self.metrics.setdefault(key, []).append(value)
        self.last_eval = (self.now, self.core.version)
        if self.callback is not None and self.callback(dict(record)):
            self.stop = True

    # ------------------------------------------------------------ result

    def _result(self, end: float, wall: float) -> SimResult:
        self._resolve()
        for w in self.workers:
            if w.blocked_since is not None:
                w.blocked_spans.append((w.blocked_since, end))
            if w.server_wait_since is not None:
                w.server_waits.append((w.server_wait_since, end))
        metrics = {k: np.asarray(v) for k, v in self.metrics.items()}
        return SimResult(
            metrics=metrics,
            timelines={w.id: _timeline(w, end) for w in self.workers},
            transfers={w.id: tuple(w.transfer_spans) for w in self.workers},
            bytes_sent={w.id: w.bytes_sent for w in self.workers},
            bytes_received={w.id: w.bytes_received for w in self.workers},
            pushes=tuple(self.pushes),
            applies=tuple(self.applies),
            sends=tuple(self.sends),
            staleness=dict(sorted(self.staleness.items())),
            num_updates=self.core.version,
            num_gradients=self.gradients,
            evaluated_gradients=self.engine.evaluations,
            padded_gradients=self.engine.padded_evaluations,
            drops=sum(w.core.drops for w in self.workers),
            errors=tuple(self.errors),
            work_plans=tuple(self.plans),
            params=self.core.params,
            end_time=end,
            wall_seconds=wall,
            diverged=self.diverged,
        )


def _timeline(w: _Worker, end: float) -> tuple[Interval, ...]:
    """Compute spans plus blocked spans split into server waits and transfers."""
    out = [Interval(s, min(e, end), k) for s, e, k in w.compute_spans if s < end]
    waits = [(s, e) for s, e in w.server_waits if e > s]
    j = 0
    for start, stop in w.blocked_spans:
        stop = min(stop, end)
        if stop <= start:
            continue
        t = start
        while j < len(waits) and waits[j][1] <= t:
            j += 1
        k = j
        while k < len(waits) and waits[k][0] < stop:
            ws, we = max(waits[k][0], t), min(waits[k][1], stop)
            if ws > t:
                out.append(Interval(t, ws, "transfer"))
            if we > ws:
                out.append(Interval(ws, we, "wait"))
                t = we
            if waits[k][1] > stop:
                break
            k += 1
        if t < stop:
            out.append(Interval(t, stop, "transfer"))
    out.sort()
    return tuple(iv for iv in out if iv.end > iv.start)


@functools.lru_cache(maxsize=16)
def _default_optimizer(learning_rate: float) -> optax.GradientTransformation:
    # One object per step size, so that code compiled for it can be reused.
    return optax.sgd(learning_rate)


def _push_bytes(params: Any, config: SimConfig, raw: int) -> int:
    """Bytes of one push on the wire (headers excluded)."""
    if config.codec is not None:
        return tree_wire_nbytes(params, config.codec)
    if config.push_transform is None:
        return raw

    state = config.push_transform.init(params)
    # What a quantizer or a PowerSGD in it keeps for the wire: a PowerSGD
    # push is its factors, powersgd_nbytes per leaf.
    for last in (last_encoded, last_powersgd_encoded):
        try:
            encoded = last(state)
        except ValueError:  # not this one
            continue
        return int(sum(x.nbytes for x in jax.tree.leaves(encoded)))

    # SparseLoCo: k indices and k few-bit values per leaf; Streaming DiLoCo:
    # one fragment's few-bit codes (the fragments' mean).
    for last in (last_sparseloco_nbytes, last_streaming_nbytes):
        try:
            return last(state)
        except ValueError:
            continue
    return raw  # no compressor in it: the update goes out uncompressed


def _check_workers(workers: Any) -> list[WorkerSpec]:
    if isinstance(workers, bool):
        raise ValueError(f"workers must be an int or WorkerSpecs, got {workers!r}.")
    if isinstance(workers, int | np.integer):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}.")
        return [WorkerSpec() for _ in range(int(workers))]
    if isinstance(workers, WorkerSpec) or not isinstance(workers, Sequence):
        raise ValueError(
            "workers must be a number of workers or a sequence of WorkerSpec, got "
            f"{type(workers).__name__}."
        )
    specs = list(workers)
    if not specs:
        raise ValueError("workers is empty: a simulation needs at least one worker.")
    for i, spec in enumerate(specs):
        if not isinstance(spec, WorkerSpec):
            raise ValueError(
                f"workers[{i}] must be a WorkerSpec, got {type(spec).__name__}."
            )
    return specs


def _check_policy_without_local_steps(policy: Any) -> None:
    if isinstance(policy, ADSP):
        raise ValueError(
            "The 'adsp' policy sets local steps per commit; give a "
            "local_optimizer for the local steps."
        )
    if isinstance(policy, Hybrid) and any(s.local_steps > 1 for s in policy.stages):
        raise ValueError(
            "A hybrid stage takes more than one local step; give a "
            "local_optimizer for the local steps."
        )


def simulate(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    train_data: Any,
    workers: Sequence[WorkerSpec] | int,
    config: SimConfig,
    *,
    eval_data: Any = None,
    eval_fn: Callable[[Any, Any], Mapping[str, jax.Array]] | None = None,
    work_plan: WorkPlan | Replanner | None = None,
    callback: Callable[[dict], bool | None] | None = None,
) -> SimResult:
    r"""Simulates parameter-server training of one model on unequal workers.

    The server is a :class:`~hpsjax.ps.ServerCore` driven with a virtual clock;
    the workers compute real gradients of ``loss_fn`` on their own batches and
    spend the virtual time their :class:`~hpsjax.sim.WorkerSpec` gives. With
    worker :math:`i` pulling version :math:`v_i` and the server at :math:`V` when
    its push arrives, the push has staleness :math:`\tau = V - v_i` and the server
    applies (per its policy's aggregation)

    .. math::

       w \leftarrow w + \operatorname{opt}\big(\bar u;\ \tau\big), \qquad
       u_i = \begin{cases}
         s_i\, f(\hat\tau_i)\, \nabla \ell(w_{v_i}; B_i) & \text{(gradients)} \\
         f(\hat\tau_i)\,\big(w_{v_i} - w_i^{(H_i)}\big) & \text{(local steps)}
       \end{cases}

    where :math:`s_i` is the worker's step-size scale (it also scales each local
    step), :math:`w_i^{(H_i)}` its parameters after :math:`H_i` local steps with
    ``local_optimizer``, :math:`f(\hat\tau_i)` PS+'s modulation (1 without
    ``staleness_lr``) and :math:`\bar u` the sample-weighted average of the
    buffered updates (``num_samples`` = batch size times local steps), after the
    worker's ``push_transform`` (e.g. quantization) where one is given.

    Args:
      loss_fn: ``(params, batch) -> scalar``, the mean training loss of a batch
        (``batch`` has the structure of ``train_data``: a
        :class:`hpsjax.data.Batch` for a :class:`hpsjax.data.Dataset`).
      params: the initial parameters, a pytree of floating arrays.
      train_data: a :class:`hpsjax.data.Dataset`, or a pytree of arrays with a
        common leading example axis.
      workers: a list of :class:`~hpsjax.sim.WorkerSpec`, or a number of default
        workers.
      config: the :class:`SimConfig`.
      eval_data: held-out data like ``train_data``, or ``None`` (no evaluation).
      eval_fn: ``(params, batch) -> {name: scalar}``, metrics averaged over the
        held-out set; ``None`` uses ``{"loss": loss_fn}``.
      work_plan: a :class:`~hpsjax.profiling.WorkPlan` (per worker batch size,
        local steps and step-size scale; its worker ids are the workers'), or a
        :class:`~hpsjax.profiling.Replanner` that is fed every round's measured
        step time and revises the plan as speeds drift, or ``None``.
      callback: called with each evaluation's record (a dict of the metric
        columns' values); returning ``True`` stops the simulation.

    Returns:
      A :class:`SimResult`.

    Raises:
      ValueError: for bad arguments (nothing runs), or when a worker is asked for
        local steps without a ``local_optimizer``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
      >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
      >>> data = (x, x @ np.arange(1.0, 5.0, dtype=np.float32))
      >>> def loss(w, batch):
      ...     return jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> workers = [WorkerSpec(ComputeModel(step_time=t)) for t in (1.0, 4.0)]
      >>> result = simulate(loss, jnp.zeros(4), data, workers,
      ...                   SimConfig(policy="asp", learning_rate=0.05,
      ...                             duration=40.0))
      >>> [result.bytes_sent[i] // 16 for i in (0, 1)]   # pushes of 16 bytes
      [40, 10]
      >>> result.metrics == {}   # no eval_data
      True

    References:
      Ho, Cipar, Cui, Lee, Kim, Gibbons, Gibson, Ganger, Xing, `More Effective
      Distributed ML via a Stale Synchronous Parallel Parameter Server
      <https://papers.nips.cc/paper/4894>`_, NIPS 2013.

      Yu et al., `Accelerating Distributed Training in Heterogeneous Clusters via
      a Straggler-Aware Parameter Server
      <https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042>`_ (SaPS), IEEE HPCC
      2019.

      Xian, Li, Liu, Guo, Du, `H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training
      <https://doi.org/10.1109/ACCESS.2021.3060154>`_, IEEE Access, 2021.

      Jin et al., `PS+: A Simple yet Effective Framework for Fast Training on
      Parameter Server <https://doi.org/10.1109/TPDS.2022.3200518>`_, IEEE TPDS
      33(12), 2022.

      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 73(1),
      2024.

      Hu, Wang, Wu, `Distributed Machine Learning through Heterogeneous Edge
      Systems <https://arxiv.org/abs/1911.06949>`_ (ADSP), AAAI 2020.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    if not isinstance(config, SimConfig):
        raise ValueError(f"config must be a SimConfig, got {type(config).__name__}.")
    if eval_fn is not None and not callable(eval_fn):
        raise ValueError(f"eval_fn must be callable, got {type(eval_fn).__name__}.")
    if callback is not None and not callable(callback):
        raise ValueError(f"callback must be callable, got {type(callback).__name__}.")
    return _Simulation(
        loss_fn,
        params,
        train_data,
        workers,
        config,
        eval_data,
        eval_fn,
        work_plan,
        callback,
    ).run()
