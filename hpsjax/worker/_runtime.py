r"""The worker runtime: pull, compute local steps, push, with transfers hidden.

A worker trains one model against a parameter server (:class:`hpsjax.ps.Server`).
Each **round** it takes :math:`H` local steps on the parameters of the version
:math:`v` it pulled, then pushes a gradient-like update (the sign convention of
:mod:`hpsjax.ps`):

* without a local optimizer (``H = 1``) the update is the mean gradient
  :math:`u = s \nabla \bar\ell(w_v)`, which the server's optimizer applies;
* with one, the worker runs it for :math:`H` steps from :math:`w_v` and pushes the
  pseudo-gradient :math:`u = w_v - w_H`, the negated sum that
  :func:`hpsjax.transforms.local_steps` (or :func:`hpsjax.transforms.hybrid_stages`)
  accumulates; the local steps are scaled by the plan's step-size scale
  :math:`s`.

**Pipeline (H-PS, PS+).** With ``overlap="pipeline"`` the transfers of round
:math:`r` travel while round :math:`r` computes: the push of round
:math:`r - 1`'s update and, right behind it on the same connection, the pull of
the parameters round :math:`r + 1` starts from (PS+'s *eager pull*: the worker
starts its next round on the freshest parameters that arrived). Compute runs in a
thread (JAX releases the GIL while it computes), so the event loop keeps moving
bytes. An update is thus pushed one round after it was computed, and its staleness
is at least 1; under BSP the round barrier becomes the wait for the pull, and
round time is :math:`\max(\text{compute}, \text{transfer} + \text{barrier})`
rather than their sum. ``overlap="eager"`` pulls again while compute time is
left, up to ``eager_pulls`` pulls a round. With ``overlap="none"`` the worker
computes, then pushes and pulls in one round trip (``push_pull``), all transfer
time exposed.

**Staleness-modulated step size (PS+).** With ``staleness_lr``, an update
computed on version :math:`v` is scaled, when it is sent, by
:math:`f(\hat\tau)` (:func:`hpsjax.transforms.staleness_factor`), where
:math:`\hat\tau = V_\text{known} - v` and :math:`V_\text{known}` is the newest
version the worker has heard of (from pulls and push acknowledgements), e.g.
:math:`f(\hat\tau) = 1 / (1 + \hat\tau)` for ``"inverse_plus_one"``.

**Compression.** With ``bits``, the update goes through
:func:`hpsjax.transforms.quantize` with error feedback on the worker, and the
push carries exactly the encoded bytes it kept (``last_encoded``), so the wire
moves about ``bits / 32`` of the float32 bytes and the residual is applied once.
With ``powersgd_rank`` it goes through :func:`hpsjax.transforms.power_sgd` the
same way, and the push carries its factors (``last_powersgd_encoded``):
``powersgd_nbytes`` per leaf, ``r (n + m)`` values for an ``n x m`` matrix.

**Following the server.** The worker reads the answers it gets: a
``local_steps`` hint (ADSP, the hybrid policy's stages) sets :math:`H`; a
``force_pull`` (SaPS) discards the round computed meanwhile and restarts the
local accumulation on the fresh parameters; a ``plan`` hint (its entry of the
server's :class:`~hpsjax.profiling.WorkPlan`, sent on joining and after each
re-plan: batch per device, local steps, step-size scale; see
``hpsjax.ps.Server(replanner=...)``) changes its work from the next round, so a
worker that slowed down gets less. Barrier waits (BSP, SSP) need nothing: the
server holds the pull's answer.

**Heterogeneity.** A :class:`~hpsjax.worker.Heterogeneity` makes the worker
slower (sleep :math:`(k-1) \bar c` after a step, :math:`\bar c` the median of its
last steps of that shape) and its
link narrower (hold each message of :math:`n` bytes for :math:`\ell + n/B`).

**Metrics.** After each round the worker hands one record (a flat dict of JSON
values) to its metrics sink, e.g. :class:`JsonLinesSink`. Times are seconds;
``time`` fields count from the start of :meth:`Worker.run`:

================== ==========================================================
``step``           round index (0, 1, ...)
``time``           when the round started computing
``version``        version of the parameters it computed on
``batch_size``     samples per local step, ``device_batches`` per device
``local_steps``    local steps taken; ``lr_scale`` the step-size scale
``loss``           mean training loss over the round's local steps
``samples``        samples computed (``batch_size`` times ``local_steps``)
``compute_s``      seconds of real compute, every result waited for;
                   ``compile_s`` of compiling
``slowdown_s``     seconds slept to inject the slowdown
``decode_s``       seconds putting the pulled parameters on the device
``encode_s``       seconds preparing the pushed update for the wire
``push_s``,        seconds from a push's hand-off (a pull's request) to its
``pull_s``         answer; a push-pull's whole trip is ``pull_s``
``server_s``       of those, seconds the server held the answers (a pull at a
                   barrier, a push decoded and applied), as the server said
``wait_s``         idle seconds: from the end of compute until the parameters
                   for the next round were there
``round_s``        seconds from the round's start until the next could start
``tokens_per_s``   ``samples`` times ``tokens_per_example`` per ``round_s``
``transfer_s``     seconds the round's transfers took (push, pull, link delays,
                   and any barrier wait in the pull), overlapped or not
``link_delay_s``   of which injected by the bandwidth cap and latency
``pull_start``,    when the pull for the next round was issued and answered
``pull_end``
``pushed_step``    the round whose update was pushed in this round's transfers
                   (``step - 1`` with the pipeline), ``None`` if none
``staleness``      its staleness as the server computed it; ``status``,
                   ``weight`` and ``force_pull`` from its acknowledgement
``staleness_estimate``, ``lr_factor``: :math:`\hat\tau` and :math:`f(\hat\tau)`
``bytes_sent``,    bytes on the connection during the round's transfers
``bytes_received``
``pulled_version`` version of the parameters pulled for the next round
``plan_revision``  revision of the plan hint in force, or ``None``
================== ==========================================================

These are :class:`hpsjax.telemetry.RoundTelemetry`'s fields; the worker logs
their :func:`~hpsjax.telemetry.round_summary` when it ends. The last record
(``event: "final"``) carries the flush of the last update. A
``"compile"`` record gives the seconds the first round's step took to compile,
before the worker joined; a ``"diverged"`` record marks a round whose loss or
update was not finite (never pushed; ``action`` ``"stop"`` or ``"skip"``), whose
round record has a ``null`` loss.

References:
  Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
  Distributed Neural Network Training", IEEE Access, 2021,
  https://doi.org/10.1109/ACCESS.2021.3060154

  Jin et al., "PS+: A Simple yet Effective Framework for Fast Training on
  Parameter Server", IEEE TPDS 33(12), 2022,
  https://doi.org/10.1109/TPDS.2022.3200518
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import json
import logging
import math
import os
import ssl as ssl_lib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_choice, check_int, check_number, check_positive
from hpsjax._devices import multi_device_grad
from hpsjax.planning import WorkPlan
from hpsjax.ps import (
    Client,
    ConnectionClosed,
    ProtocolError,
    ShuttingDown,
    WorkerDropped,
)
from hpsjax.wire._codecs import PowerSGDCodec, QuantizedCodec, TopKCodec
from hpsjax.telemetry import (
    RoundTelemetry,
    format_summary,
    from_record,
    round_summary,
)
from hpsjax.telemetry import rounds as telemetry_rounds
from hpsjax.transforms import (
    Codec,
    Stage,
    current_stage,
    hybrid_stages,
    local_steps,
    pending_update,
    power_sgd,
    push_due,
    quantize,
    sparse_encoded,
    sparse_push_transform,
    top_k,
)
from hpsjax.worker._core import (
    Acked,
    Compute,
    Computed,
    Discard,
    Dropped,
    Join,
    Joined,
    KeepParams,
    PlanChanged,
    Pull,
    Pulled,
    Push,
    Report,
    Reported,
    Stop,
    StopRequested,
    WorkerCore,
    WorkerOptions,
    _option,
)
from hpsjax.worker._hetero import Heterogeneity, Injector

__all__ = [
    "JsonLinesSink",
    "Worker",
    "WorkerConfig",
    "WorkerSummary",
    "run_worker",
    "summarize",
]

logger = logging.getLogger("hpsjax.worker")


def _asyncio_default(name: str, default: Any) -> Any:
    """A :class:`WorkerOptions` field with the asyncio worker's default."""
    metadata = WorkerOptions.__dataclass_fields__[name].metadata
    return dataclasses.field(default=default, metadata=metadata)


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
      worker_id: this worker's name (``str`` or ``int``), unique among workers.
      secret: the shared secret (``str`` or ``bytes``), ``None`` for a server
        without authentication.
      batch_size: samples per local step, over all local devices; ignored when
        ``work_plan`` has an entry for this worker.
      work_plan: a :class:`~hpsjax.profiling.WorkPlan` whose entry for
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
    host: str = _option("127.0.0.1", "server address", group="server")
    port: int = 0
    worker_id: str | int = _option(0, "unique id", type=_worker_id, group="server")
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
    heterogeneity: Heterogeneity = dataclasses.field(default_factory=Heterogeneity)
    timeout: float | None = _option(600.0, "request timeout (s)", group="server")
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
        check_int("port", self.port, low=0)
        if self.port > 65535:
            raise ValueError(f"port must be below 65536, got {self.port}")
        if isinstance(self.worker_id, bool) or not isinstance(
            self.worker_id, str | int
        ):
            raise ValueError(f"worker_id must be a str or int, got {self.worker_id!r}")
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


class WorkerSummary(NamedTuple):
    """What a worker did, returned by :meth:`Worker.run`.

    Attributes:
      worker_id: the worker.
      steps: rounds computed.
      pushes: updates pushed.
      local_steps: local steps taken in all.
      version: the newest server version the worker heard of: the version its
        last push was acknowledged at, or its last pull brought. The server's
        last checkpoint may be newer: a push still buffered under BSP when
        the worker left is applied with the others' (see the log's last line).
      loss: the mean training loss of its last round, or ``None``.
      elapsed: seconds the run took.
      compute_s: seconds of real compute.
      slowdown_s: seconds slept to inject slowness.
      wait_s: seconds idle, waiting for parameters.
      transfer_s: seconds of transfers, overlapped or not.
      bytes_sent: bytes written to the server.
      bytes_received: bytes read from it.
      discarded: rounds whose update was discarded on the server's request.
      rejoins: times the worker was dropped by the server and joined again.
      ended_by: why it stopped: ``"max_steps"``, ``"max_seconds"``,
        ``"until_version"``, ``"stopped"``, ``"server"`` (the server went away
        for longer than ``reconnect_timeout``) or ``"diverged"`` (a round's
        loss or update was not finite).
      reconnects: times the worker lost the server and joined it again.
    """

    worker_id: str | int
    steps: int
    pushes: int
    local_steps: int
    version: int
    loss: float | None
    elapsed: float
    compute_s: float
    slowdown_s: float
    wait_s: float
    transfer_s: float
    bytes_sent: int
    bytes_received: int
    discarded: int
    rejoins: int
    ended_by: str
    reconnects: int = 0


class JsonLinesSink:
    """A metrics sink writing one JSON object per line, flushed at once.

    Args:
      target: a path (the file is created, or appended to), or a text file
        object (not closed by :meth:`close`).

    Examples:
      >>> import io
      >>> out = io.StringIO()
      >>> sink = JsonLinesSink(out)
      >>> sink({"step": 0, "loss": 2.3})
      >>> out.getvalue()
      '{"step": 0, "loss": 2.3}\\n'
    """

    def __init__(self, target: str | os.PathLike | io.TextIOBase):
        if isinstance(target, str | os.PathLike):
            self._file = open(target, "a", encoding="utf-8")  # noqa: SIM115
            self._owned = True
        elif hasattr(target, "write"):
            self._file = target
            self._owned = False
        else:
            raise ValueError(
                f"target must be a path or a text file, got {type(target).__name__}"
            )

    def __call__(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file if this sink opened it; idempotent."""
        if self._owned and not self._file.closed:
            self._file.close()

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    r"""Idle fraction and transfer overlap of a worker's (or workers') rounds.

    .. math::

      \text{idle} = \frac{\sum_r \text{wait}_r}{\sum_r \text{round}_r}, \qquad
      \text{overlap} = 1 - \frac{\sum_r \text{wait}_r}{\sum_r \text{transfer}_r},

    the overlap being the share of transfer time hidden behind compute (clipped to
    ``[0, 1]``; meaningful without barrier waits, which also count as transfer),
    and ``other_idle_fraction`` the share of the rounds' time idle for neither
    the wire nor the server (:attr:`hpsjax.telemetry.RoundTelemetry.other_s`).

    Args:
      records: metrics records of :class:`Worker` (``"round"`` events are used).

    Returns:
      ``{"rounds", "idle_fraction", "other_idle_fraction", "overlap",
      "compute_s", "slowdown_s", "wait_s", "transfer_s", "round_s"}``.

    Raises:
      ValueError: no round records.
    """
    rounds = [r for r in records if r.get("event") == "round"]
    if not rounds:
        raise ValueError("no round records to summarize")
    total = {
        k: float(sum(r[k] for r in rounds))
        for k in ("compute_s", "slowdown_s", "wait_s", "transfer_s", "round_s")
    }
    idle = total["wait_s"] / total["round_s"] if total["round_s"] > 0 else 0.0
    overlap = (
        min(max(1.0 - total["wait_s"] / total["transfer_s"], 0.0), 1.0)
        if total["transfer_s"] > 0
        else 1.0
    )
    other = sum(r.other_s for r in telemetry_rounds(rounds))
    return {
        "rounds": float(len(rounds)),
        "idle_fraction": idle,
        "other_idle_fraction": other / total["round_s"]
        if total["round_s"] > 0
        else 0.0,
        "overlap": overlap,
        **total,
    }


def _server_info(client: Any) -> Any:
    """The server's ``ServerInfo`` as the client last heard it (shard 0's for a
    sharded client), ``None`` when it has none (a stand-in client)."""
    info = getattr(client, "info", None)
    if isinstance(info, tuple) and not hasattr(info, "_fields"):
        info = info[0] if info else None
    return info


def _server_spec(client: Any) -> Any:
    """The server's model (``jax.ShapeDtypeStruct`` leaves, the structure of a
    pull's answer) as the client knows it, or ``None``."""
    partition = getattr(client, "partition", None)
    if partition is not None:
        return partition.spec()
    return getattr(_server_info(client), "spec", None)


def _shapes_key(batch: Any) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))


# Compiles a worker's step for a batch size new to it, beside its rounds.
_COMPILER = concurrent.futures.ThreadPoolExecutor(1, "hpsjax-worker-compile")


class _ServerGone(Exception):
    """The server stayed away longer than ``reconnect_timeout`` (said in one
    line where it happened)."""


# What a request raises when the server went away (a goodbye, a lost or
# refused connection): the worker reconnects.
def _lost_errors() -> tuple[type[BaseException], ...]:
    return (ConnectionClosed, ShuttingDown, OSError)


# Rounds a worker keeps in memory for its summary (about 25 MB at most).
_TELEMETRY_KEPT = 100_000
# A round's transfer seconds by part (see hpsjax.telemetry.RoundTelemetry).
_TRANSFER_PARTS = ("encode_s", "push_s", "pull_s", "server_s")


class _Computed(NamedTuple):
    update: Any  # tree like params, float (device arrays)
    version: int
    loss: float
    local_steps: int
    batch_size: int
    compute_s: float
    slowdown_s: float
    compile_s: float
    stage: int | None
    finite: bool = True  # the loss and every value of the update
    decode_s: float = 0.0  # putting the pulled parameters on the device


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """Whether every value of a tree of float arrays is finite, as a bool array."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _finite_or_none(value: float | None) -> float | None:
    """``value``, or ``None`` where it is NaN or infinite (JSON has neither)."""
    return value if value is None or math.isfinite(value) else None


class _Prepared(NamedTuple):
    update: Any  # numpy tree, or a ShapeDtypeStruct tree when `encoded` is set
    encoded: Any  # Encoded (TopKEncoded, PowerSGDEncoded) per leaf, or None
    nbytes: int
    codec: Any = None  # the wire codec (hpsjax.wire._codecs) of `encoded`
    encode_s: float = 0.0  # scaling, compressing and copying it to the host


def _scale_by_lr_scale() -> optax.GradientTransformationExtraArgs:
    """Scales updates by the keyword extra argument ``lr_scale`` (default 1)."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, lr_scale=None, **extra_args):
        del params, extra_args
        if lr_scale is not None:
            updates = jax.tree.map(
                lambda u: u * jnp.asarray(lr_scale, u.dtype), updates
            )
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _split_evenly(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _tree_nbytes(tree: Any) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


class Worker:
    """One worker: connects, trains in rounds, pushes, and reports metrics.

    Args:
      config: the :class:`WorkerConfig`.
      loss_fn: ``loss_fn(params, batch)`` returning the per-example losses, shape
        ``(b,)`` (e.g. ``functools.partial(hpsjax.models.per_example_loss,
        graphdef=g)`` with the arguments reordered); the worker minimises their
        mean.
      batches: ``batches(n)`` returning the next batch of ``n`` examples (a
        pytree with a leading axis of ``n``), e.g. ``stream.next`` of a
        :class:`hpsjax.data.BatchStream`. Called from the compute thread.
      local_optimizer: an optax transform for local steps, in which case the
        worker pushes pseudo-gradients; ``None`` to push gradients (``H = 1``).
      stages: ``hpsjax.transforms.Stage`` s for a staged local optimizer
        (:func:`hpsjax.transforms.hybrid_stages`, ASHL); excludes
        ``local_optimizer``. The current stage sets :math:`H`.
      metrics: a callable taking each record (a dict), e.g.
        :class:`JsonLinesSink`, or ``None``.
      devices: local JAX devices to compute on, one per entry of the batch
        split; the first ``len(device_batches)`` local devices by default.
      ssl: an ``ssl.SSLContext`` for a TLS connection, or ``None``.
      state: the model's own state that this worker keeps and never pushes,
        e.g. BatchNorm's batch statistics
        (:func:`hpsjax.models.split_with_batch_stats`). With it ``loss_fn`` is
        ``loss_fn(params, state, batch) -> (per-example losses, new state)``
        and each step's new state feeds the next; :attr:`state` reads the
        current one. One device only.
      client: a ``hpsjax.ps.Client`` to use instead of making one from the
        config (it is connected by :meth:`run` if it is not yet).
      progress: a :class:`hpsjax._progress.Progress` told of every round
        (steps, version, loss, staleness) and closed at the end of
        :meth:`run`, or ``None`` (``hpsjax-worker`` makes one).
      tokens_per_example: tokens in one example (a language model's sequence
        length), for the rounds' ``tokens_per_s``; 1 counts samples.

    Raises:
      ValueError: inconsistent arguments (for example local steps without a
        local optimizer, or more device batches than devices).

    Examples:
      Train against a server on this machine::

        worker = Worker(WorkerConfig(port=port, worker_id="w0", max_steps=100),
                        loss_fn=loss_fn, batches=stream.next,
                        local_optimizer=optax.sgd(0.1),
                        metrics=JsonLinesSink("w0.jsonl"))
        summary = asyncio.run(worker.run())

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154

      Jin et al., "PS+: A Simple yet Effective Framework for Fast Training on
      Parameter Server", IEEE TPDS 33(12), 2022,
      https://doi.org/10.1109/TPDS.2022.3200518

      Yu et al., "Accelerating Distributed Training in Heterogeneous Clusters
      via a Straggler-Aware Parameter Server" (SaPS), IEEE HPCC 2019,
      https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042
    """

    def __init__(
        self,
        config: WorkerConfig,
        *,
        loss_fn: Callable[[Any, Any], jax.Array],
        batches: Callable[[int], Any],
        local_optimizer: optax.GradientTransformation | None = None,
        stages: Sequence[Any] | None = None,
        metrics: Callable[[dict], None] | None = None,
        devices: Sequence[jax.Device] | None = None,
        ssl: ssl_lib.SSLContext | None = None,
        client: Any = None,
        state: Any = None,
        progress: Any = None,
        tokens_per_example: int = 1,
    ):
        check_int("tokens_per_example", tokens_per_example, low=1)
        if not isinstance(config, WorkerConfig):
            raise ValueError(f"config must be a WorkerConfig, got {type(config)}")
        if not callable(loss_fn) or not callable(batches):
            raise ValueError("loss_fn and batches must be callable")
        if metrics is not None and not callable(metrics):
            raise ValueError("metrics must be callable or None")
        if local_optimizer is not None and stages is not None:
            raise ValueError("give local_optimizer or stages, not both")
        device_batches, batch_size, local_steps, lr_scale = config.planned()
        if device_batches is None:
            n = 1 if devices is None else len(devices)
            device_batches = _split_evenly(batch_size, n)
        if sum(device_batches) != batch_size:
            raise ValueError(
                f"device_batches {device_batches} do not sum to batch_size {batch_size}"
            )
        local = jax.local_devices()
        if devices is None:
            if len(device_batches) > len(local):
                raise ValueError(
                    f"{len(device_batches)} device batches but only {len(local)} "
                    "local devices"
                )
            devices = local[: len(device_batches)]
        devices = list(devices)
        if len(devices) != len(device_batches):
            raise ValueError(
                f"{len(device_batches)} device batches for {len(devices)} devices"
            )
        if state is not None and len(devices) > 1:
            raise ValueError("a worker with model state computes on one device")
        self._pushes_gradients = local_optimizer is None and stages is None
        if self._pushes_gradients and local_steps != 1:
            raise ValueError(
                f"local_steps={local_steps} needs a local optimizer (or stages): "
                "a worker without one pushes one gradient per round"
            )
        self._config = config
        self._loss_fn = loss_fn
        self._state = state
        self._batches = batches
        self._metrics = metrics
        self._progress = progress
        self._tokens_per_example = int(tokens_per_example)
        # The run's (last) rounds as telemetry, summarised when it ends.
        self._telemetry: collections.deque[RoundTelemetry] = collections.deque(
            maxlen=_TELEMETRY_KEPT
        )
        self._devices = devices
        self._ssl = ssl
        self._client = client
        self._stages = None if stages is None else tuple(stages)
        self._tx = self._make_transform(local_optimizer, self._stages)
        self._injector = Injector(config.heterogeneity)
        self._initial = (tuple(int(b) for b in device_batches), local_steps, lr_scale)
        self._core: WorkerCore | None = None
        self._apply = None
        self._opt_state = None
        # The transform compressing pushes (bits or powersgd_rank), its state,
        # and the wire codec of what it keeps (which finds that in its state).
        self._compressor = None
        self._compressor_state = None
        self._codec = None
        self._topk = None  # (ratio, jitted top_k update, its state)
        self._spec_like = None
        self._compiled: dict[tuple, Any] = {}
        # Batch shapes compiling in the background, and the last batch size
        # computed with (what a round uses while its own batch compiles).
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._last_batch: tuple[int, ...] | None = None
        self._peeked: Any = None  # the batch drawn to compile the first round
        self._plan_logged: int | None = None  # the last plan revision logged
        self._last_status: str | None = None  # of the last push acknowledged
        self._stop = asyncio.Event()
        self._t0 = time.monotonic()

    # ------------------------------------------------------------ set-up

    @staticmethod
    def _make_transform(local_optimizer, stages):
        if stages is not None:
            if not stages or not all(isinstance(s, Stage) for s in stages):
                raise ValueError("stages must be a non-empty list of Stage")
            scaled = [
                dataclasses.replace(
                    s, transform=optax.chain(s.transform, _scale_by_lr_scale())
                )
                for s in stages
            ]
            return hybrid_stages(scaled)
        if local_optimizer is None:
            return None
        if not isinstance(local_optimizer, optax.GradientTransformation):
            raise ValueError("local_optimizer must be an optax GradientTransformation")
        return optax.chain(local_optimizer, _scale_by_lr_scale(), local_steps(1))

    def _make_compressor(self):
        config = self._config
        if config.push_transform is not None:
            # SparseLoCo's or Streaming DiLoCo's: its output's nonzero entries
            # go out as top-k leaves (hpsjax.transforms.sparse_encoded).
            self._codec = TopKCodec
            self._compressor = sparse_push_transform(config.push_transform)
        elif config.powersgd_rank is not None:
            # The wire reads each leaf's rank from the factors.
            self._codec = PowerSGDCodec
            self._compressor = power_sgd(
                config.powersgd_rank,
                error_feedback=config.error_feedback,
                seed=config.seed,
            )
        else:
            scheme = "sign" if config.bits == 1 else "uniform"
            # The transform builds its codec from the same arguments; the wire
            # needs it to describe the bytes the transform kept.
            self._codec = QuantizedCodec(
                Codec(scheme, config.bits, stochastic=config.stochastic)
            )
            self._compressor = quantize(
                config.bits,
                scheme=scheme,
                stochastic=config.stochastic,
                error_feedback=config.error_feedback,
                seed=config.seed,
            )
        self._compress_update = jax.jit(self._compressor.update)

    @property
    def telemetry(self) -> list[RoundTelemetry]:
        """The rounds of the last (or current) :meth:`run`, as telemetry (its
        last 100,000 in a longer run)."""
        return list(self._telemetry)

    @property
    def config(self) -> WorkerConfig:
        """The configuration."""
        return self._config

    def stop(self) -> None:
        """Asks :meth:`run` to end after the current round (thread-unsafe; call
        it on the worker's event loop, e.g. from a signal handler)."""
        self._stop.set()

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------ settings

    def _plan_notice(self, plan: Any) -> PlanChanged:
        """The server's plan (a validated ``PlanNotice``) as an event; a plan
        that does not fit this worker's devices is refused."""
        batches = plan.device_batches
        if batches is None and plan.batch_size is not None:
            batches = _split_evenly(plan.batch_size, len(self._devices))
        if batches is not None and len(batches) != len(self._devices):
            raise ProtocolError(
                f"plan's device_batches {batches!r} do not fit this worker's "
                f"{len(self._devices)} device(s)"
            )
        return PlanChanged(
            revision=plan.revision,
            device_batches=None if batches is None else tuple(batches),
            local_steps=plan.local_steps,
            lr_scale=plan.lr_scale,
        )

    # ------------------------------------------------------------ compute

    @property
    def state(self) -> Any:
        """The model state this worker keeps (``state``), as of its last step."""
        return self._state

    def _step_fn(self):
        loss_fn, tx = self._loss_fn, self._tx
        stateful = self._state is not None

        def mean_loss(params, state, batch):
            if stateful:
                losses, state = loss_fn(params, state, batch)
            else:
                losses = loss_fn(params, batch)
            return jnp.mean(losses), state

        grad = jax.value_and_grad(mean_loss, has_aux=True)

        if tx is None:

            def grad_step(params, state, batch, lr_scale):
                (loss, state), grads = grad(params, state, batch)
                scaled = jax.tree.map(lambda g: g * lr_scale.astype(g.dtype), grads)
                return scaled, loss, state

            return grad_step

        def local_step(params, state, opt_state, batch, lr_scale, local_steps):
            (loss, state), grads = grad(params, state, batch)
            updates, opt_state = tx.update(
                grads,
                opt_state,
                params,
                lr_scale=lr_scale,
                local_steps=local_steps,
                loss=loss,
            )
            return optax.apply_updates(params, updates), state, opt_state, loss

        return local_step

    def _apply_fn(self):
        tx = self._tx

        def apply(params, opt_state, grads, loss, lr_scale, local_steps):
            updates, opt_state = tx.update(
                grads,
                opt_state,
                params,
                lr_scale=lr_scale,
                local_steps=local_steps,
                loss=loss,
            )
            return optax.apply_updates(params, updates), opt_state

        return jax.jit(apply)

    def _compiled_step(self, args: tuple, batch: Any) -> tuple[Any, float]:
        """The AOT-compiled step for this batch's shapes, and seconds compiling.

        Compiling ahead keeps compile time out of ``compute_s``, so a slowdown
        factor never multiplies it.
        """
        key = _shapes_key(batch)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled, 0.0
        t = time.perf_counter()
        compiled = self._compile(args)
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t

    def _compile(self, args: tuple) -> Any:
        return jax.jit(self._step_fn()).lower(*args).compile()

    def _compiling_beside(self, args: tuple, batch: Any) -> bool:
        """Whether ``batch``'s step is compiling beside the rounds.

        A batch size new to this worker (a revised plan) is compiled on a
        thread of its own; while it compiles (this returns true) the round
        computes with the batch it computed last, so a re-plan never stalls
        it (on a busy machine a compile takes seconds, and under BSP every
        worker would wait). The first batch, or one whose compile failed (to
        raise its error in the round), compiles in the round.
        """
        key = _shapes_key(batch)
        if (
            key in self._compiled
            or self._last_batch is None
            or not self._config.compile_beside
        ):
            return False
        pending = self._compiling.get(key)
        if pending is None:
            self._compiling[key] = _COMPILER.submit(self._compile, args)
            return True
        if not pending.done():
            return True
        del self._compiling[key]
        if pending.exception() is None:
            self._compiled[key] = pending.result()
        return False

    def _step_args(self, local, batch, lr_scale, steps_arg) -> tuple:
        if self._tx is None:
            return (local, self._state, batch, lr_scale)
        return (local, self._state, self._opt_state, batch, lr_scale, steps_arg)

    def _take(self, n: int) -> Any:
        """The next batch of ``n`` examples (the one drawn to compile with
        first, if it has that size)."""
        peeked, self._peeked = self._peeked, None
        if peeked is not None and len(jax.tree.leaves(peeked)[0]) == n:
            return peeked
        return self._batches(n)

    def _compile_first(self, spec: Any, device_batches: tuple[int, ...]) -> float:
        """Compiles the step for the first round's batch, before joining.

        Runs in the compute thread on parameters of the server's shapes (zeros)
        and a batch drawn for the first round (kept for it), so that no round,
        and no barrier of the server's, waits on this compile. Returns the
        seconds it took (0 when the step was compiled already, or with several
        devices, whose step is compiled at its first call).
        """
        if len(self._devices) > 1:
            return 0.0
        home = self._devices[0]
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
        self._initialise(zeros)
        batch = self._peeked = self._batches(sum(device_batches))
        args = self._step_args(
            jax.device_put(zeros, home),
            jax.device_put(batch, home),
            jnp.asarray(1.0, jnp.float32),
            jnp.asarray(1, jnp.int32),
        )
        _, seconds = self._compiled_step(args, batch)
        self._last_batch = tuple(device_batches)
        _all_finite(jax.device_put(zeros, home))  # compiled here too
        return seconds

    def _next_batches(self, settings: Compute) -> list[Any]:
        total = sum(settings.device_batches)
        batch = self._take(total)
        if len(settings.device_batches) == 1:
            return [batch]
        bounds = np.cumsum((0, *settings.device_batches))
        return [
            jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
            for a, b in itertools.pairwise(bounds)
        ]

    def _compute_round(self, params: Any, version: int, settings: Compute):
        """Runs one round of local steps; called in the compute thread."""
        home = self._devices[0]
        device_batches = settings.device_batches
        t = time.perf_counter()
        local = jax.block_until_ready(jax.device_put(params, home))
        decode_s = time.perf_counter() - t
        lr_scale = jnp.asarray(settings.lr_scale, jnp.float32)
        steps_arg = jnp.asarray(settings.local_steps, jnp.int32)
        compute = slowdown = compile_s = 0.0
        losses = []
        steps = 0
        multi = len(self._devices) > 1
        keep_last = False
        while True:
            if keep_last:
                batches = [self._batches(device_batches[0])]
            else:
                batches = self._next_batches(settings)
            if multi:
                t = time.perf_counter()
                loss, grads = multi_device_grad(
                    self._loss_fn, local, batches, self._devices
                )
                # Every result waited for, as below.
                if self._tx is None:
                    update = jax.tree.map(lambda g: g * settings.lr_scale, grads)
                    jax.block_until_ready((update, loss))
                else:
                    local, self._opt_state = self._apply(
                        local, self._opt_state, grads, loss, lr_scale, steps_arg
                    )
                    jax.block_until_ready((local, self._opt_state, loss))
            else:
                batch = jax.device_put(batches[0], home)
                state = self._state
                args = self._step_args(local, batch, lr_scale, steps_arg)
                if not keep_last and self._compiling_beside(args, batch):
                    # Its step is compiling: this round keeps the last batch.
                    keep_last, device_batches = True, self._last_batch
                    batch = jax.device_put(self._batches(device_batches[0]), home)
                    args = self._step_args(local, batch, lr_scale, steps_arg)
                step, compile_time = self._compiled_step(args, batch)
                compile_s += compile_time
                t = time.perf_counter()
                # On an accelerator the call returns once the step is queued:
                # the clock stops when every result is there, and the slowdown
                # sleeps (k - 1) times that, so a GPU told 4 is 4 times slower.
                if self._tx is None:
                    update, loss, state = step(*args)
                    jax.block_until_ready((update, loss, state))
                else:
                    local, state, self._opt_state, loss = step(*args)
                    jax.block_until_ready((local, state, self._opt_state, loss))
                self._state = state
            spent = time.perf_counter() - t
            compute += spent
            # The slowdown multiplies the typical step of this shape, so a
            # busy core's hiccup is not made k - 1 times longer.
            slowdown += self._injector.after_compute(spent, key=tuple(device_batches))
            losses.append(float(loss))
            steps += 1
            if self._tx is None or bool(push_due(self._opt_state)):
                break
        if self._tx is not None:
            update = jax.tree.map(jnp.negative, pending_update(self._opt_state))
        if not multi:
            self._last_batch = tuple(device_batches)
        loss = float(np.mean(losses))
        return _Computed(
            update=update,
            version=version,
            loss=loss,
            local_steps=steps,
            batch_size=sum(device_batches),
            compute_s=compute,
            slowdown_s=slowdown,
            compile_s=compile_s,
            stage=None if self._stages is None else int(current_stage(self._opt_state)),
            finite=math.isfinite(loss) and bool(_all_finite(update)),
            decode_s=decode_s,
        )

    def _prepare(self, computed: _Computed, push: Push) -> _Prepared:
        """:meth:`_encode`, timed (every result on the host when it returns)."""
        t = time.perf_counter()
        prepared = self._encode(computed, push)
        return prepared._replace(encode_s=time.perf_counter() - t)

    def _encode(self, computed: _Computed, push: Push) -> _Prepared:
        """Scales an update by the push's factor and encodes it for the wire.

        Runs in the encoding thread right before the push, so the quantizer's
        (PowerSGD's, top-k's) residual is updated only for an update that is
        sent. A push whose ``compress_ratio`` is below 1 (``WorkerCore``'s rule)
        is top-k sparsified at it and sends the bytes the transform kept.
        """
        update = computed.update
        if push.lr_factor != 1.0:
            factor = push.lr_factor
            update = jax.tree.map(lambda u: u * jnp.asarray(factor, u.dtype), update)
        if push.compress_ratio < 1.0:
            return self._sparsify(update, push.compress_ratio)
        if self._compressor is None:
            host = jax.device_get(update)
            host = jax.tree.map(np.asarray, host)
            return _Prepared(host, None, _tree_nbytes(host))
        sent, state = self._compress_update(update, self._compressor_state)
        self._compressor_state = state
        if self._config.push_transform is not None:
            encoded = sparse_encoded(sent)
        else:
            encoded = jax.device_get(self._codec.last_encoded(state))
        return _Prepared(self._spec_like, encoded, _tree_nbytes(encoded), self._codec)

    def _sparsify(self, update: Any, ratio: float) -> _Prepared:
        """Top-k sparsifies ``update`` at ``ratio`` with error feedback (a new
        ratio starts a new residual)."""
        if self._topk is None or self._topk[0] != ratio:
            tx = top_k(
                ratio,
                error_feedback=self._config.error_feedback,
                seed=self._config.seed,
            )
            state = jax.device_put(tx.init(update), self._devices[0])
            self._topk = (ratio, jax.jit(tx.update), state)
        _, apply, state = self._topk
        _, state = apply(update, state)
        self._topk = (ratio, apply, state)
        encoded = jax.device_get(TopKCodec.last_encoded(state))
        return _Prepared(self._spec_like, encoded, _tree_nbytes(encoded), TopKCodec)

    def _make_client(self):
        return Client(
            self._config.host,
            self._config.port,
            worker_id=self._config.worker_id,
            secret=self._config.secret,
            ssl=self._ssl,
            timeout=self._config.timeout,
            seed=self._config.seed,
        )

    def _emit(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics(record)

    async def run(self) -> WorkerSummary:
        """Connects, trains until a stop condition, flushes the last push, closes.

        Cancelling is safe: the connection is closed and the compute threads
        are left to finish their current step.

        Returns:
          A :class:`WorkerSummary`.

        Raises:
          hpsjax.ps.HpsError: the connection failed or the server refused an
            update (ShuttingDown ends the run normally instead).
          RuntimeError: ``fail_after_steps`` was reached.
        """
        self._stop.clear()
        self._t0 = time.monotonic()
        self._telemetry.clear()
        self._injector.start()
        client = self._client if self._client is not None else self._make_client()
        if client.closed:
            await client.connect()
        computer = concurrent.futures.ThreadPoolExecutor(1, "hpsjax-compute")
        encoder = concurrent.futures.ThreadPoolExecutor(1, "hpsjax-encode")
        try:
            await self._before_joining(client, computer)
        except BaseException:
            computer.shutdown(wait=False, cancel_futures=True)
            encoder.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(Exception):
                await client.close()
            raise
        totals = dict(
            steps=0, pushes=0, local_steps=0, compute_s=0.0, slowdown_s=0.0,
            wait_s=0.0, transfer_s=0.0, bytes_sent=0, bytes_received=0,
            discarded=0, rejoins=0, reconnects=0,
        )  # fmt: skip
        loss = None
        ended_by = "stopped"
        try:
            ended_by, loss = await self._train(client, computer, encoder, totals)
        except (ShuttingDown, _ServerGone) as error:
            ended_by = "server"
            if isinstance(error, ShuttingDown):
                logger.info("worker %s: the server shut down", self._config.worker_id)
        finally:
            computer.shutdown(wait=False, cancel_futures=True)
            encoder.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(Exception):
                await client.close()
            if self._progress is not None:
                self._progress.close()
        summary = WorkerSummary(
            worker_id=self._config.worker_id,
            version=0 if self._core is None else self._core.known_version,
            loss=loss,
            elapsed=self._elapsed(),
            ended_by=ended_by,
            **totals,
        )
        logger.info(
            "worker %s finished (%s) after %d rounds, %d pushes; the server was "
            "at version %d when it last heard%s",
            summary.worker_id,
            ended_by,
            summary.steps,
            summary.pushes,
            summary.version,
            " (its last push was buffered for the next version)"
            if self._last_status == "buffered"
            else "",
        )
        if self._telemetry:
            logger.info("%s", format_summary(round_summary(self._telemetry)))
        return summary

    def _initialise(self, params: Any) -> None:
        home = self._devices[0]
        device_params = jax.device_put(params, home)
        self._spec_like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
        )
        # States are committed to the home device, as every step's outputs
        # are: a jitted function called with an uncommitted state, then with
        # its own committed output, is compiled twice (the second time on the
        # second push, which waited for it).
        if self._tx is not None:
            self._opt_state = jax.device_put(self._tx.init(device_params), home)
            if len(self._devices) > 1:
                self._apply = self._apply_fn()
        config = self._config
        if (
            config.bits is not None
            or config.powersgd_rank is not None
            or config.push_transform is not None
        ):
            self._make_compressor()
            self._compressor_state = jax.device_put(
                self._compressor.init(device_params), home
            )

    def _warm_compressor(self) -> None:
        """Traces and compiles the compressor's update on zeros, its state
        untouched: in the encoding thread while the first round computes, so the
        first compressed push does not (1.3 to 1.8 s on proc4's loaded cores for
        the quantizer)."""
        home = self._devices[0]
        zeros = jax.tree.map(
            lambda s: jax.device_put(np.zeros(s.shape, s.dtype), home),
            self._spec_like,
        )
        jax.block_until_ready(self._compress_update(zeros, self._compressor_state))

    def _note_plan(self, plan: Any) -> PlanChanged:
        """The server's plan as an event (:meth:`_plan_notice`), logged once
        per revision."""
        event = self._plan_notice(plan)
        if plan.revision != self._plan_logged:
            self._plan_logged = plan.revision
            logger.info(
                "worker %s: plan revision %d received: batch %s%s, local steps %s, "
                "lr scale %s",
                self._config.worker_id,
                plan.revision,
                "unchanged"
                if event.device_batches is None
                else sum(event.device_batches),
                ""
                if event.device_batches is None or len(event.device_batches) == 1
                else f" {list(event.device_batches)}",
                "unchanged" if plan.local_steps is None else plan.local_steps,
                "unchanged" if plan.lr_scale is None else f"{plan.lr_scale:g}",
            )
        return event

    async def _before_joining(self, client: Any, computer: Any) -> None:
        """Compiles the step for the batch of the first round (the server's
        plan for this worker, which it sends on connecting, else the config's)
        before the first pull joins a round: a slow compile keeps no barrier
        of the server's waiting, and the worker joins at the version the
        server reached meanwhile. A client that does not know the server's
        model (a stand-in) leaves the compile to the first round."""
        spec = _server_spec(client)
        if spec is None or self._compiled:
            return
        device_batches = self._initial[0]
        plan = getattr(client, "plan", None)
        if plan is not None and self._config.follow_hints:
            planned = self._note_plan(plan).device_batches
            if planned is not None:
                device_batches = planned
        seconds = await asyncio.get_running_loop().run_in_executor(
            computer, self._compile_first, spec, device_batches
        )
        if seconds > 0:
            logger.info(
                "worker %s compiled its step for batch %d in %.2fs, before joining",
                self._config.worker_id,
                sum(device_batches),
                seconds,
            )
            self._emit(
                {
                    "event": "compile",
                    "worker": self._config.worker_id,
                    "time": self._elapsed(),
                    "batch_size": sum(device_batches),
                    "compile_s": seconds,
                }
            )

    def _overlap(self, client: Any) -> str:
        """The run's overlap: the config's, else the server policy's (see
        ``WorkerConfig.overlap``); logged with the staleness it leads to."""
        info = _server_info(client)
        policy = getattr(info, "policy", "of the server")
        synchronous = bool(getattr(info, "synchronous", False))
        overlap, who = self._config.overlap, self._config.worker_id
        if overlap is None:
            overlap = "none" if synchronous else "pipeline"
            if synchronous:
                logger.info(
                    "worker %s: policy %s is synchronous: each round computes, "
                    "then pushes and pulls (overlap none); pushes have staleness 0",
                    who,
                    policy,
                )
            else:
                logger.info(
                    "worker %s: policy %s: transfers travel while a round "
                    "computes (overlap pipeline); pushes are at least 1 version "
                    "stale",
                    who,
                    policy,
                )
        elif synchronous and overlap != "none":
            logger.warning(
                "worker %s: overlap %s under the synchronous policy %s: every "
                "push is 1 version stale (overlap none keeps staleness 0)",
                who,
                overlap,
                policy,
            )
        else:
            logger.info("worker %s: overlap %s (policy %s)", who, overlap, policy)
        return overlap

    async def _train(self, client, computer, encoder, totals):
        """Carries out the worker core's actions until it stops."""
        config = self._config
        device_batches, local_steps, lr_scale = self._initial
        core = self._core = WorkerCore(
            config.core_options(
                device_batches=device_batches,
                local_steps=local_steps,
                lr_scale=lr_scale,
                overlap=self._overlap(client),
                compress_ratio=config.push_ratio(),
            ),
            pushes_gradients=self._pushes_gradients,
        )
        run = _Run(self, client, computer, encoder, totals)
        await run.drive(core)
        return core.ended_by, run.loss


class _Run:
    """One run of a :class:`Worker`: carries out its core's actions (I/O and
    compute as tasks), feeds back what happened, and keeps the metrics."""

    def __init__(self, worker: Worker, client, computer, encoder, totals):
        self.w = worker
        self.client = client
        self.computer = computer
        self.encoder = encoder
        self.totals = totals
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Future] = set()
        self.params: Any = None
        self.version = 0
        self.computed: dict[int, _Computed] = {}  # rounds not pushed yet
        self.records: dict[int, dict] = {}  # rounds not emitted yet
        self.current: dict | None = None  # the record of the round computing
        self.sending: asyncio.Event | None = None  # a push not yet on the wire
        self.loss: float | None = None
        self.joined = False
        self.connection = 0  # bumped by each reconnection
        self.reconnecting: asyncio.Future | None = None
        self.lost_session = 0  # sessions up to this one lost their connection

    # ------------------------------------------------------------ the loop

    async def drive(self, core: WorkerCore) -> None:
        self.core = core
        try:
            self.carry_out(core.handle(Joined(self.w._elapsed())))
            stop_asked = False
            while self.tasks:
                done, _ = await asyncio.wait(
                    self.tasks, return_when=asyncio.FIRST_COMPLETED
                )
                if self.w._stop.is_set() and not stop_asked:
                    stop_asked = True
                    self.carry_out(core.handle(StopRequested()))
                for task in done:
                    self.tasks.discard(task)
                    if task.cancelled():  # after the run stopped
                        continue
                    for event, leaves in task.result():
                        self.carry_out(core.handle(event), leaves)
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def spawn(self, coro) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    def carry_out(self, actions: list, leaves: Any = None) -> None:
        for action in actions:
            kind = type(action)
            if kind is Compute:
                self.start_round(action)
            elif kind is Push:
                self.spawn(self.push(action))
            elif kind is Pull:
                self.spawn(self.pull(action.session))
            elif kind is Join:
                self.spawn(self.pull(action.session, join=True))
            elif kind is KeepParams:
                self.params, self.version = leaves, action.version
            elif kind is Discard:
                self.discard(action.round)
            elif kind is Report:
                # The server's replanner is fed by the push's step time.
                self.carry_out(self.core.handle(Reported(self.w._elapsed())))
            elif kind is Stop:
                self.finish_round()
                if action.reason == "diverged":
                    # Nothing more is pushed: no answer is worth waiting for
                    # (a pull held at a barrier would wait for the others).
                    for task in self.tasks:
                        task.cancel()
            else:
                raise TypeError(f"unexpected worker action {action!r}")

    # ------------------------------------------------------------ rounds

    def start_round(self, compute: Compute) -> None:
        self.finish_round()
        w = self.w
        now = w._elapsed()
        self.current = self.records[compute.round] = {
            "event": "round",
            "worker": w._config.worker_id,
            "step": compute.round,
            "time": now,
            "version": compute.version,
            "batch_size": compute.batch_size,
            "device_batches": list(compute.device_batches),
            "lr_scale": compute.lr_scale,
            "plan_revision": self.core.plan_revision,
            "staleness_estimate": None,
            "lr_factor": None,
            "_start": time.monotonic(),
            "_bytes": (self.client.bytes_sent, self.client.bytes_received),
            "transfer_s": 0.0,
            "link_delay_s": 0.0,
            **dict.fromkeys(_TRANSFER_PARTS, 0.0),
            "pull_start": None,
            "pull_end": None,
            "pulls": 0,
            "pushed_step": None,
            "staleness": None,
            "status": None,
            "weight": None,
            "force_pull": False,
            "discarded": False,
            "rejoined": False,
        }
        self.spawn(self.compute(compute, self.params))

    async def compute(self, compute: Compute, params: Any) -> list:
        computed = await self.loop.run_in_executor(
            self.computer, self.w._compute_round, params, compute.version, compute
        )
        record = self.records[compute.round]
        record["_compute_end"] = time.monotonic()
        if computed.batch_size != compute.batch_size:
            # The last batch, kept while the planned one's step compiled.
            record.update(
                batch_size=computed.batch_size,
                device_batches=[computed.batch_size],
            )
        record.update(
            compute_end=record["_compute_end"] - self.w._t0,
            local_steps=computed.local_steps,
            loss=_finite_or_none(computed.loss),
            compute_s=computed.compute_s,
            decode_s=computed.decode_s,
            compile_s=computed.compile_s,
            slowdown_s=computed.slowdown_s,
        )
        self.computed[compute.round] = computed
        if computed.finite:
            self.loss = computed.loss
        else:
            self.diverged(compute, computed)
        event = Computed(
            compute.round,
            self.w._elapsed(),
            computed.compute_s + computed.slowdown_s,
            _finite_or_none(computed.loss),
            computed.local_steps,
            computed.stage,
            computed.batch_size,
            computed.finite,
        )
        return [(event, None)]

    def diverged(self, compute: Compute, computed: _Computed) -> None:
        """Says in one line (and one record) that a round was not finite."""
        w = self.w
        action = w._config.on_nonfinite
        what = f"loss {computed.loss:g}"
        if math.isfinite(computed.loss):
            what += ", update not finite"
        if action == "skip":
            logger.warning(
                "worker %s: step %d (version %d) is not finite (%s); its push is "
                "skipped",
                w._config.worker_id,
                compute.round,
                compute.version,
                what,
            )
        else:
            logger.error(
                "worker %s diverged at step %d (version %d): %s; it stops",
                w._config.worker_id,
                compute.round,
                compute.version,
                what,
            )
        w._emit(
            {
                "event": "diverged",
                "worker": w._config.worker_id,
                "step": compute.round,
                "time": w._elapsed(),
                "version": compute.version,
                "loss": _finite_or_none(computed.loss),
                "action": action,
            }
        )

    def discard(self, round_: int) -> None:
        self.computed.pop(round_, None)
        self.totals["discarded"] += 1
        record = self.records.get(round_)
        if record is not None:
            record["discarded"] = True

    def finish_round(self) -> None:
        """Emits the record of the round that computed last: the next round
        starts (or the run ends) now."""
        record, self.current = self.current, None
        if record is None:
            return
        w, totals = self.w, self.totals
        ready = time.monotonic()
        self.records.pop(record["step"], None)
        start, compute_end = record.pop("_start"), record.pop("_compute_end", ready)
        sent0, received0 = record.pop("_bytes")
        record.setdefault("local_steps", 0)
        samples = record["batch_size"] * record["local_steps"]
        round_s = ready - start
        record.update(
            wait_s=ready - compute_end,
            round_s=round_s,
            samples=samples,
            tokens_per_s=(
                samples * w._tokens_per_example / round_s if round_s > 0 else 0.0
            ),
            bytes_sent=self.client.bytes_sent - sent0,
            bytes_received=self.client.bytes_received - received0,
            pulled_version=self.version,
        )
        w._emit(record)
        w._telemetry.append(from_record(record))
        for key in ("compute_s", "slowdown_s", "transfer_s", "wait_s"):
            totals[key] += record.get(key, 0.0)
        totals["bytes_sent"] += record["bytes_sent"]
        totals["bytes_received"] += record["bytes_received"]
        totals["local_steps"] += record["local_steps"]
        totals["steps"] += 1
        if w._progress is not None:
            w._progress.update(
                totals["steps"],
                version=self.version,
                loss=record.get("loss"),
                staleness=record.get("staleness"),
            )
        steps, fail_after = totals["steps"], w._config.fail_after_steps
        if fail_after is not None and steps >= fail_after:
            raise RuntimeError(
                f"worker {w._config.worker_id}: fault injected after {steps} rounds "
                "(fail_after_steps)"
            )

    # ------------------------------------------------------------ transfers

    def note(self, key: str, value: Any) -> dict:
        """The record transfers count towards now (the round computing)."""
        record = self.current if self.current is not None else {}
        record[key] = value
        return record

    def hints(self) -> list:
        """Plan notices the server sent, as events (before the reply's own)."""
        plan = self.client.plan
        if plan is None or not self.w._config.follow_hints:
            return []
        return [(self.w._note_plan(plan), None)]

    async def pull(self, session: int, *, join: bool = False) -> list:
        w, record = self.w, self.current
        if session <= self.lost_session:  # asked before the core heard of it
            return [(Dropped(session, w._elapsed()), None)]
        sending = self.sending
        if sending is not None:
            # The push frame goes first on the connection, so that the server
            # (BSP) counts the update before the pull behind it.
            await sending.wait()
        start = time.monotonic()
        if record is not None:
            if record["pull_start"] is None:
                record["pull_start"] = w._elapsed()
            record["pulls"] += 1
        connection = self.connection
        try:
            params, version = await self.client.pull()
        except WorkerDropped as error:
            return self.dropped(session, error)
        except _lost_errors() as error:
            return await self.lost(session, connection, error)
        held = self.client_held()
        link = await w._injector.transfer(_tree_nbytes(params))
        self.transferred(record, start, link, "pull_s", held)
        if record is not None:
            record["pull_end"] = w._elapsed()
        if join and not self.joined:
            self.joined = True
            logger.info(
                "worker %s joined at version %d after %.2fs",
                w._config.worker_id,
                version,
                time.monotonic() - start,
            )
            w._initialise(params)
            if w._compressor is not None:
                self.encoder.submit(w._warm_compressor)
        elif join:
            logger.info(
                "worker %s joined again at version %d", w._config.worker_id, version
            )
        hint = self.client.local_steps
        event = Pulled(session, version, w._elapsed(), local_steps=hint)
        return [*self.hints(), (event, params)]

    async def push(self, push: Push) -> list:
        w, record = self.w, self.current
        if push.final:
            record = {
                "event": "final",
                "worker": w._config.worker_id,
                "step": self.totals["steps"],
                "time": w._elapsed(),
                "transfer_s": 0.0,
                "link_delay_s": 0.0,
                **dict.fromkeys(_TRANSFER_PARTS, 0.0),
                "_bytes": (self.client.bytes_sent, self.client.bytes_received),
            }
        computed = self.computed.pop(push.round)
        if push.session <= self.lost_session:  # computed for a lost connection
            return [] if push.final else [(Dropped(push.session, w._elapsed()), None)]
        sending = self.sending = asyncio.Event()
        start = time.monotonic()
        connection = self.connection
        try:
            prepared = await self.loop.run_in_executor(
                self.encoder, w._prepare, computed, push
            )
            if record is not None:
                record["staleness_estimate"] = push.staleness_estimate
                record["lr_factor"] = push.lr_factor
                record["encode_s"] += prepared.encode_s
            sent = time.monotonic()
            link = await w._injector.transfer(prepared.nbytes)
            encoding = {}
            if prepared.encoded is not None:
                encoding = {"codec": prepared.codec, "encoded": prepared.encoded}
            method = self.client.push_pull if push.with_pull else self.client.push

            async def send():
                # What the server says it held the answer is read with it.
                reply = await method(prepared.update, push.meta, **encoding)
                return reply, self.client_held()

            task = asyncio.ensure_future(send())
            await asyncio.sleep(0)  # the frame is handed to the transport
            sending.set()
            if push.with_pull and record is not None:
                record["pull_start"] = w._elapsed()
                record["pulls"] += 1
            try:
                reply, held = await task
            except WorkerDropped as error:
                return self.dropped(push.session, error, last=push.final)
            except _lost_errors() as error:
                if push.final:
                    logger.warning(
                        "worker %s lost the server (%s); its last update is lost",
                        w._config.worker_id,
                        error,
                    )
                    return []
                return await self.lost(push.session, connection, error)
        finally:
            sending.set()
            if self.sending is sending:
                self.sending = None
        ack, params, version = reply if push.with_pull else (reply, None, None)
        events = []
        if push.with_pull:
            link += await w._injector.transfer(_tree_nbytes(params))
        self.transferred(record, start, link)
        if record is not None:
            # A push-pull's acknowledgement comes with the parameters: its
            # whole trip is the pull's. The server's hold is an apply's (and
            # a push-pull's barrier).
            part = "pull_s" if push.with_pull else "push_s"
            record[part] += time.monotonic() - sent
            record["server_s"] += held
        self.totals["pushes"] += 1
        w._last_status = ack.status
        if record is not None:
            record.update(
                pushed_step=push.round,
                staleness=ack.staleness,
                status=ack.status,
                weight=ack.weight,
            )
            record["force_pull"] = record.get("force_pull", False) or ack.force_pull
        now = w._elapsed()
        events.append(
            (
                Acked(
                    push.session,
                    ack.version,
                    now,
                    ack.local_steps,
                    ack.force_pull,
                    getattr(self.client, "stage", None),
                ),
                None,
            )
        )
        if push.with_pull:
            if record is not None:
                record["pull_end"] = now
            hint = self.client.local_steps
            events += self.hints()
            events.append((Pulled(push.session, version, now, hint), params))
        if push.final:
            sent0, received0 = record.pop("_bytes")
            record.update(
                bytes_sent=self.client.bytes_sent - sent0,
                bytes_received=self.client.bytes_received - received0,
            )
            self.totals["transfer_s"] += record["transfer_s"]
            self.totals["bytes_sent"] += record["bytes_sent"]
            self.totals["bytes_received"] += record["bytes_received"]
            w._emit(record)
        return events

    def transferred(
        self,
        record: dict | None,
        start: float,
        link: float,
        part: str = "",
        held: float = 0.0,
    ) -> None:
        """Counts a transfer from ``start`` (with ``link`` seconds of injected
        link delay) towards ``record``; a ``part`` (``"pull_s"``) too, and
        ``held``, the seconds the server held its answer."""
        if record is None:
            return
        seconds = time.monotonic() - start
        record["transfer_s"] += seconds
        record["link_delay_s"] += link
        if part:
            record[part] += seconds
            record["server_s"] += held

    def client_held(self) -> float:
        """Seconds the server held the answer the client read last (0 for a
        client that does not say); read before the next ``await``."""
        held = getattr(self.client, "held_s", None)
        return float(held) if isinstance(held, int | float) else 0.0

    async def lost(self, session: int, connection: int, error: Exception) -> list:
        """The server went away while a request of ``connection`` was in
        flight: reconnects (once for all the requests that fail with it), then
        the core joins again, throwing away the rounds in flight."""
        self.lost_session = max(self.lost_session, session)
        if connection == self.connection:
            if self.reconnecting is None:
                self.reconnecting = asyncio.ensure_future(self.reconnect(error))
            reconnecting = self.reconnecting
            await asyncio.shield(reconnecting)
        return [(Dropped(session, self.w._elapsed()), None)]

    async def reconnect(self, error: Exception) -> None:
        """Connects again, 0.1 s apart doubling up to 2 s, for
        ``reconnect_timeout`` seconds; raises ``_ServerGone`` (after saying
        so in one line) when no server answers by then."""
        w = self.w
        who, patience = w._config.worker_id, w._config.reconnect_timeout
        reason = str(error) or type(error).__name__
        try:
            with contextlib.suppress(Exception):
                await self.client.close(timeout=1.0)
            if patience == 0:
                logger.error(
                    "worker %s lost the server (%s); it stops (reconnect_timeout 0)",
                    who,
                    reason,
                )
                raise _ServerGone(reason)
            logger.warning(
                "worker %s lost the server (%s); reconnecting for up to %gs",
                who,
                reason,
                patience,
            )
            start = time.monotonic()
            delay = 0.1
            while True:
                try:
                    await self.client.connect()
                    break
                except (*_lost_errors(), TimeoutError) as e:
                    if time.monotonic() - start + delay > patience:
                        logger.error(
                            "worker %s: no server for %gs (%s); it stops",
                            who,
                            patience,
                            str(e) or type(e).__name__,
                        )
                        raise _ServerGone(reason) from None
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)
            self.connection += 1
            self.totals["reconnects"] += 1
            if self.current is not None:
                self.current["rejoined"] = True
            logger.info(
                "worker %s reconnected after %.1fs; joining again",
                who,
                time.monotonic() - start,
            )
        finally:
            self.reconnecting = None

    def dropped(self, session: int, error: Exception, *, last: bool = False) -> list:
        w = self.w
        if last:
            # The last push of a run: nothing follows it to rejoin for.
            logger.warning(
                "worker %s was dropped by the server (%s); its last update is lost",
                w._config.worker_id,
                error,
            )
            return []
        if session == self.core.session:
            logger.warning(
                "worker %s was dropped by the server (%s); joining again",
                w._config.worker_id,
                error,
            )
            self.totals["rejoins"] += 1
            if self.current is not None:
                self.current["rejoined"] = True
        return [(Dropped(session, w._elapsed()), None)]


def run_worker(config: WorkerConfig, **kwargs: Any) -> WorkerSummary:
    """Runs a :class:`Worker` to the end on a fresh event loop.

    Args:
      config: the :class:`WorkerConfig`.
      **kwargs: the other arguments of :class:`Worker` (``loss_fn`` and
        ``batches`` are required).

    Returns:
      The :class:`WorkerSummary`.
    """
    worker = Worker(config, **kwargs)
    return asyncio.run(worker.run())
