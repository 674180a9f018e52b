"""The asyncio worker: :class:`Worker` pulls, computes local steps and pushes.

A worker trains one model against a parameter server in rounds, following
its sans-I/O :class:`~hpsjax.worker.WorkerCore`: this module builds the worker
from its settings, joins the server (the step compiled first), picks the
overlap of transfers with compute, and hands the run to its driver
(:mod:`hpsjax.worker._driver`), which carries out the core's actions with the
round's arithmetic (:mod:`hpsjax.worker._compute`). The docs' worker notes
describe the pipeline, the staleness-modulated step size, compression,
following the server, heterogeneity and every metrics field.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import ssl as ssl_lib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from hpsjax._checks import check_int
from hpsjax.net import Client
from hpsjax.telemetry import (
    RoundTelemetry,
    format_summary,
    round_summary,
)
from hpsjax.wire import ProtocolError, ShuttingDown
from hpsjax.worker._compute import RoundCompute, _split_evenly
from hpsjax.worker._config import WorkerConfig
from hpsjax.worker._core import (
    PlanChanged,
    WorkerCore,
)
from hpsjax.worker._driver import _Run, _ServerGone
from hpsjax.worker._hetero import Injector
from hpsjax.worker._records import (
    _TELEMETRY_KEPT,
    JsonLinesSink,
    WorkerSummary,
    summarize,
)

__all__ = [
    "JsonLinesSink",
    "Worker",
    "WorkerConfig",
    "WorkerSummary",
    "run_worker",
    "summarize",
]

logger = logging.getLogger("hpsjax.worker")


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
        devices, device_batches = _devices_and_batches(
            devices, device_batches, batch_size
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
        self._injector = Injector(config.heterogeneity)
        self._compute = RoundCompute(
            config,
            loss_fn=loss_fn,
            batches=batches,
            local_optimizer=local_optimizer,
            stages=None if stages is None else tuple(stages),
            devices=devices,
            state=state,
            injector=self._injector,
        )
        self._initial = (tuple(int(b) for b in device_batches), local_steps, lr_scale)
        self._core: WorkerCore | None = None
        self._plan_logged: int | None = None  # the last plan revision logged
        self._last_status: str | None = None  # of the last push acknowledged
        self._stop = asyncio.Event()
        self._t0 = time.monotonic()

    @property
    def state(self) -> Any:
        """The model state this worker keeps (``state``), as of its last step."""
        return self._compute.state

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
        plan for this worker, which it sends on connecting, else the config's),
        runs it once, and warms the push's compressor, before the first pull
        joins a round: a slow compile keeps no barrier
        of the server's waiting, and the worker joins at the version the
        server reached meanwhile. A client that does not know the server's
        model (a stand-in) leaves the compile to the first round."""
        spec = _server_spec(client)
        if spec is None or self._compute.compiled_any:
            return
        device_batches = self._initial[0]
        plan = getattr(client, "plan", None)
        if plan is not None and self._config.follow_hints:
            planned = self._note_plan(plan).device_batches
            if planned is not None:
                device_batches = planned
        loop = asyncio.get_running_loop()
        seconds = await loop.run_in_executor(
            computer, self._compute.compile_first, spec, device_batches
        )
        if self._compute.compresses:
            # Else the first push waits for it (0.7-1 s of proc4's first round).
            await loop.run_in_executor(computer, self._compute.warm_compressor)
        if self._config.precompile_sizes:
            count, more = await loop.run_in_executor(
                computer,
                self._compute.precompile,
                spec,
                self._config.precompile_sizes,
            )
            logger.info(
                "worker %s compiled its step for %d more batch sizes in %.2fs, "
                "before joining",
                self._config.worker_id,
                count,
                more,
            )
            self._emit(
                {
                    "event": "precompile",
                    "worker": self._config.worker_id,
                    "time": self._elapsed(),
                    "batch_sizes": count,
                    "compile_s": more,
                }
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


def _devices_and_batches(
    devices: Sequence[jax.Device] | None,
    device_batches: tuple[int, ...] | None,
    batch_size: int,
) -> tuple[list[jax.Device], tuple[int, ...]]:
    """The devices a worker computes on and each one's batch: the config's
    split (an even one by default) over the first local devices by default."""
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
    return devices, tuple(device_batches)


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
