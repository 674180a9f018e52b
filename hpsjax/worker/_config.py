"""The asyncio worker's settings: :class:`WorkerConfig`, checked once.

Where to find the server and how to talk to it, what a round is (batch, local
steps, step-size scale, or a plan's entry), compression, overlap, faults and
stops: the fields the worker core shares (:class:`~hpsjax.worker.WorkerOptions`)
with the asyncio worker's defaults, and the ones only the runtime reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpsjax._checks import (
    check_choice,
    check_int,
    check_number,
    check_positive,
    check_worker_id,
)
from hpsjax.planning import WorkPlan
from hpsjax.transforms import (
    sparse_push_transform,
)
from hpsjax.worker._core import (
    WorkerOptions,
    _option,
)
from hpsjax.worker._hetero import Heterogeneity

__all__ = ["WorkerConfig"]


def _asyncio_default(name: str, default: Any) -> Any:
    """A :class:`WorkerOptions` field with the asyncio worker's default."""
    metadata = WorkerOptions.__dataclass_fields__[name].metadata
    return dataclasses.field(default=default, metadata=metadata)


def _renamed(name: str, flag: str) -> Any:
    """A :class:`WorkerOptions` field whose flag is ``flag``, its former name
    still taken (:mod:`hpsjax._config_flags`' ``aliases``)."""
    field = WorkerOptions.__dataclass_fields__[name]
    metadata = {
        **field.metadata,
        "flag": flag,
        "dest": name,
        "aliases": (field.metadata.get("flag", f"--{name}"),),
    }
    return dataclasses.field(default=field.default, metadata=metadata)


def _worker_id(text: str) -> str | int:
    """A ``--worker_id``: an int where it reads as one, else the text."""
    try:
        return int(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class WorkerConfig(WorkerOptions):
    """Settings of one worker (plain values; the command line makes one).

    The worker core's options are :class:`~hpsjax.worker.WorkerOptions`'s
    fields (``device_batches``, ``local_steps``, ``lr_scale``, ``overlap``,
    ``pull_with_push``, ``eager_pulls``, ``staleness_lr``, ``follow_hints``,
    ``max_steps``, ``max_seconds``, ``until_version``, ``compress_ratio``,
    ``compress_from_stage``, ``on_nonfinite``), checked there; here they mean
    what they mean there, with these differences:

    * ``device_batches``: ``None`` splits ``batch_size`` evenly over the
      local devices; ``work_plan``'s entry for this worker, where it has one,
      sets the batch per device, the local steps and the step-size scale.
    * ``overlap``: ``None`` (the default) follows the server's policy, told on
      connecting: ``"none"`` under a synchronous one (BSP), so that every push
      has staleness 0, ``"pipeline"`` otherwise.
    * ``pull_with_push`` is on by default: a round costs one message each way
      instead of a push, its acknowledgement, a pull and its answer.
    * ``compress_ratio``: ``None`` for ``work_plan``'s ``compress_ratio`` for
      this worker (1 without a plan); ``compress_from_stage``: ``None`` (the
      default) never sparsifies.

    Args:
      host: the parameter server's address.
      port: its port.
      worker_id: this worker's name (``str`` or ``int``), unique among workers
        (``hpsjax-worker`` without ``--worker_id`` asks its server for one
        before it makes this; made from flags without it, 0).
      secret: the shared secret (``str`` or ``bytes``), ``None`` for a server
        without authentication.
      batch_size: samples per local step, over all local devices; ignored when
        ``work_plan`` has an entry for this worker.
      work_plan: a :class:`~hpsjax.planning.WorkPlan` whose entry for
        ``worker_id`` sets the batch per device, local steps and step-size scale.
      bits: quantize pushes to this many bits: 1 (scaled sign), 2, 4, 8 or 16
        (uniform levels), ``None`` to push float32.
      stochastic: stochastic rounding in the quantizer; ``None`` for the
        scheme's default (stochastic for 2 to 16 bits, nearest for the sign).
      powersgd_rank: compress pushes to rank-``r`` factors
        (:func:`hpsjax.transforms.power_sgd`, warm-started; the wire's PowerSGD
        codec), ``None`` for none; not with ``bits``.
      error_feedback: carry the quantization (top-k or PowerSGD) residual to
        the next push.
      compile_beside: compile the step for a batch size new to this worker (a
        revised plan) on a thread of its own, the rounds meanwhile computing
        with the last batch (and saying so in their pushes' sample counts), so
        a re-plan never stalls a round; ``False`` compiles it in the round.
      precompile: batch sizes (``"4,5,6"``) whose step the worker compiles
        before it joins, beside its first batch's: a plan's later batches on
        them (a pilot's :func:`~hpsjax.planning.batch_grid`) compile nothing
        beside the rounds. ``None``: none.
      heterogeneity: injected slowdown and link limits.
      timeout: seconds any single request may take (``None``: no limit). Under
        BSP the pull waits for the slowest worker, so keep it above a round.
      seed: seed of the quantizer's random rounding.
      fail_after_steps: fault injection: raise ``RuntimeError`` after this many
        rounds (to exercise how the server and launcher handle a dying worker).
      reconnect_timeout: seconds to keep reconnecting (with backoff) when the
        server says goodbye or the connection is lost, after which the worker
        joins again at the server's version (a restarted server's, resumed from
        its checkpoint) and goes on; the rounds in flight are thrown away, never
        sent twice. ``0`` ends the run at once (``ended_by`` ``"server"``).

    Raises:
      ValueError: a bad value (checked here, before anything runs).
    """

    overlap: str | None = _asyncio_default("overlap", None)
    pull_with_push: bool = _asyncio_default("pull_with_push", True)
    compress_from_stage: int | None = _asyncio_default("compress_from_stage", None)
    # hpsjax-launch's name: rounds per worker.
    max_steps: int | None = _renamed("max_steps", "--steps")
    host: str = _option("127.0.0.1", "server address", group="server")
    port: int = 0
    worker_id: str | int = _option(
        0,
        "this worker's id, its own among the run's workers (hpsjax-launch "
        "gives each one; the server refuses a second worker under a live "
        "worker's id); by default the server assigns the lowest free one "
        "(needed for --work_plan and --profile_out)",
        type=_worker_id,
        flag_default=None,
        group="server",
    )
    secret: str | bytes | None = None
    batch_size: int = _option(32, "samples per step", group="work")
    work_plan: Any = None
    bits: int | None = _option(
        None, "quantize pushes (1, 2, 4, 8, 16 bits)", group="work"
    )
    stochastic: bool | None = None
    powersgd_rank: int | None = _option(
        None,
        "compress pushes to PowerSGD factors of this rank (not with --bits)",
        group="work",
    )
    push_transform: str | None = _option(
        None,
        'push through this transform, a JSON object {"name": "sparseloco" or '
        '"streaming_push", its arguments}, its nonzero entries sent as top-k '
        "leaves (not with --bits or --powersgd_rank)",
        group="work",
    )
    error_feedback: bool = _option(
        True,
        "with --bits or --powersgd_rank: drop the compression error "
        "instead of carrying it",
        flag="--no_error_feedback",
        group="work",
    )
    compile_beside: bool = True
    precompile: str | None = _option(
        None,
        "batch sizes to compile before joining, comma-separated (a pilot's "
        "batch_grid: its later batches then compile nothing beside the rounds)",
        group="work",
    )
    heterogeneity: Heterogeneity = dataclasses.field(default_factory=Heterogeneity)
    timeout: float | None = _option(
        600.0,
        "seconds any single request may take",
        flag="--request_timeout",
        dest="timeout",
        aliases=("--timeout",),
        group="server",
    )
    seed: int = _option(0, "quantizer seed", group="work")
    fail_after_steps: int | None = _option(
        None, "raise after this many rounds (fault injection)", group="faults"
    )
    reconnect_timeout: float = _option(
        60.0,
        "seconds to keep reconnecting (with backoff) to a server that said "
        "goodbye or was lost, then join it again at its version (a restarted "
        "server's) and go on; 0: stop at once (exit status 4)",
        group="server",
    )

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty str, got {self.host!r}")
        check_int("port", self.port, low=0, high=65535)
        check_worker_id("worker_id", self.worker_id)
        check_int("batch_size", self.batch_size, low=1)
        if self.work_plan is not None:
            if not isinstance(self.work_plan, WorkPlan):
                raise ValueError(
                    f"work_plan must be a WorkPlan, got {type(self.work_plan).__name__}"
                )
            self.work_plan.worker(self.worker_id)
        check_choice("bits", self.bits, (1, 2, 4, 8, 16), allow_none=True)
        check_int("powersgd_rank", self.powersgd_rank, low=1, allow_none=True)
        if self.bits is not None and self.powersgd_rank is not None:
            raise ValueError("give bits or powersgd_rank, not both")
        if self.push_transform is not None:
            if self.bits is not None or self.powersgd_rank is not None:
                raise ValueError("give push_transform or bits or powersgd_rank")
            sparse_push_transform(self.push_transform)  # checks it
        if self.stochastic is not None and not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic must be a bool or None: {self.stochastic!r}")
        if not isinstance(self.heterogeneity, Heterogeneity):
            raise ValueError("heterogeneity must be a Heterogeneity")
        check_positive("timeout", self.timeout, allow_none=True)
        check_int("seed", self.seed, low=0)
        check_int("fail_after_steps", self.fail_after_steps, low=1, allow_none=True)
        check_number("reconnect_timeout", self.reconnect_timeout, low=0)
        self.precompile_sizes  # noqa: B018 (checks it)

    @property
    def precompile_sizes(self) -> tuple[int, ...]:
        """``precompile`` read as batch sizes (empty for none).

        Raises:
          ValueError: not a comma-separated list of ints >= 1.
        """
        if self.precompile is None:
            return ()
        parts = str(self.precompile).split(",")
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(
                "precompile must be batch sizes >= 1, comma-separated, "
                f"got {self.precompile!r}"
            )
        return tuple(int(p) for p in parts)

    def planned(self) -> tuple[tuple[int, ...] | None, int, int, float]:
        """``(device_batches, batch_size, local_steps, lr_scale)`` to start with."""
        if self.work_plan is not None:
            entry = self.work_plan.worker(self.worker_id)
            return (
                tuple(d.batch_size for d in entry.devices),
                entry.batch_size,
                entry.local_steps,
                entry.lr_scale,
            )
        return self.device_batches, self.batch_size, self.local_steps, self.lr_scale

    def push_ratio(self) -> float:
        """The top-k ratio of sparsified pushes (see ``compress_ratio``)."""
        if self.compress_ratio is not None:
            return float(self.compress_ratio)
        if self.work_plan is not None:
            return float(self.work_plan.worker(self.worker_id).compress_ratio)
        return 1.0
