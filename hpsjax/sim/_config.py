"""The simulator's settings, :class:`SimConfig`, and the checks of what it takes.

:class:`SimConfig` holds the policy, the server's and the workers' optimizers
and transforms, overlap, stops, evaluation and data sharding, checked once;
beside it, the checks of :func:`hpsjax.sim.simulate`'s other inputs (its
workers, its data) and the policies that need a local optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from hpsjax import worker as wc
from hpsjax._checks import check_int, check_number, check_positive, is_number
from hpsjax.data import Batch, Dataset
from hpsjax.decisions import ADSP, Hybrid
from hpsjax.sim._workers import WorkerSpec
from hpsjax.worker import OVERLAP_MODES

__all__ = ["OVERLAP_MODES", "SimConfig"]

_DATA_SHARDINGS = ("disjoint", "shared")


def _default_worker() -> wc.WorkerOptions:
    """The simulated workers' default options (see ``SimConfig.worker``)."""
    return wc.WorkerOptions(eager_pulls=3, compress_from_stage=None)


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
      worker: the simulated workers' side, a
        :class:`~hpsjax.worker.WorkerOptions` (a
        :class:`~hpsjax.worker.WorkerConfig` is taken as its options), declared
        and checked there as for real workers. The simulator reads four of its
        fields: ``overlap`` (``"none"``: compute, then push and pull in one
        round trip, also for ``None``; ``"pipeline"``, H-PS and PS+: the
        previous round's push and the next pull travel while a round computes;
        ``"eager"``: ``"pipeline"`` with up to ``eager_pulls`` pulls a round
        while compute time is left), ``eager_pulls``, ``staleness_lr`` (PS+'s
        modulation: each update is scaled, when sent, by
        :math:`f(\hat\tau)` with :math:`\hat\tau = V_\text{known} - v`, the
        newest version the worker heard of minus the version it computed on;
        ``"drop"`` is refused: use the policy's ``max_staleness``) and
        ``compress_from_stage`` (with a work plan, each worker's pushes are
        top-k sparsified at its plan's ``compress_ratio`` once the server's
        stage is at least this, and count the wire's top-k bytes; only the
        bytes are simulated: the update applied is the whole one; ``None``
        never sparsifies). Batches, local steps and step-size scales are the
        :class:`WorkerSpec`\ s'. The default:
        ``WorkerOptions(eager_pulls=3, compress_from_stage=None)``.
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
      merge_steps: the first steps of a round that take no gradient (Streaming
        DiLoCo's merge of a synchronised fragment,
        :func:`~hpsjax.transforms.streaming_local`): run but not billed, so a
        round of ``k`` local steps takes the time of ``max(k - merge_steps,
        1)`` steps. ``0`` (the default): every step is billed.
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
    worker: wc.WorkerOptions = dataclasses.field(default_factory=_default_worker)
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
    merge_steps: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.policy_kwargs is not None and not isinstance(
            self.policy_kwargs, Mapping
        ):
            raise ValueError("policy_kwargs must be a mapping or None.")
        check_number("learning_rate", self.learning_rate)
        for name in ("server_optimizer", "local_optimizer", "push_transform"):
            value = getattr(self, name)
            if value is not None and not isinstance(
                value, optax.GradientTransformation
            ):
                raise ValueError(
                    f"{name} must be an optax GradientTransformation or None, got "
                    f"{type(value).__name__}."
                )
        self._check_worker_side()
        check_positive("duration", self.duration, allow_none=True)
        check_int("max_updates", self.max_updates, low=1, allow_none=True)
        check_int("max_gradients", self.max_gradients, low=1, allow_none=True)
        if (
            self.duration is None
            and self.max_updates is None
            and (self.max_gradients is None)
        ):
            raise ValueError(
                "Give at least one of duration, max_updates and max_gradients, "
                "or the simulation never ends."
            )
        check_positive("eval_every", self.eval_every, allow_none=True)
        check_int("eval_every_updates", self.eval_every_updates, low=1, allow_none=True)
        check_int("eval_batch_size", self.eval_batch_size, low=1, allow_none=True)
        check_int("batch_rows", self.batch_rows, low=1, allow_none=True)
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
        if not isinstance(self.stop_on_divergence, bool):
            raise ValueError(
                "stop_on_divergence must be True or False, got "
                f"{self.stop_on_divergence!r}."
            )
        check_number("server_service_time", self.server_service_time, low=0)
        check_int("merge_steps", self.merge_steps, low=0)
        check_int("seed", self.seed, low=0)

    def _check_worker_side(self) -> None:
        """Takes the simulated workers' options (checked by
        :class:`~hpsjax.worker.WorkerOptions`) and refuses what the simulator
        cannot do with them."""
        if not isinstance(self.worker, wc.WorkerOptions):
            raise ValueError(
                "worker must be a hpsjax.worker.WorkerOptions, got "
                f"{type(self.worker).__name__}."
            )
        object.__setattr__(self, "worker", self.worker.core_options())
        if self.worker.staleness_lr == "drop":
            raise ValueError(
                "worker.staleness_lr='drop' needs a cut-off; use the server "
                "policy's max_staleness to drop stale updates."
            )


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


@functools.lru_cache(maxsize=16)
def _default_optimizer(learning_rate: float) -> optax.GradientTransformation:
    # One object per step size, so that code compiled for it can be reused.
    return optax.sgd(learning_rate)


def _check_workers(workers: Any) -> list[WorkerSpec]:
    if is_number(workers) or isinstance(workers, bool):
        count = check_int("workers", workers, low=1)
        return [WorkerSpec() for _ in range(count)]
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
