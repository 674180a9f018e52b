"""The asyncio parameter server: moves bytes, and lets ``ServerCore`` decide.

:class:`Server` accepts worker connections, authenticates them, reads frames into
preallocated arrays (see :mod:`hpsjax.wire._stream`) and turns every complete,
validated request into an event of :class:`~hpsjax.ps.ServerCore`: the first
``PULL`` of a connection joins its worker, ``PULL`` pulls, ``PUSH`` pushes, a
closed connection leaves, and a timer ticks the core at ``core.next_deadline()``.
It then carries out the actions the core returns (send parameters, acknowledge,
notify, drop) on the right connections. All decisions (versions, staleness, who
waits, what is applied, deadlines) are the core's.

Guarantees:

* a push is handed to the core only once fully received and validated (tree
  structure, shapes and dtypes against the model before its payload is read;
  NaN and infinity in each leaf as soon as its bytes are in): a worker killed
  mid-push changes nothing;
* a worker's pushes are applied in the order it sent them;
* bad input gets an ``ERROR`` frame with a code and a short message; the
  server's parameters are unchanged and other workers are unaffected; a broken
  stream (bad magic, version, a length over the limits) is closed;
* a dead or stalled worker never hangs the others: its connection's end is a
  ``leave``, and the core's adaptive deadlines drop a worker that stops making
  progress while others wait for it.

Security: with a ``secret``, every connection proves it knows it (HMAC-SHA256
challenge-response, both ways); the secret never crosses the wire. Without one,
anyone who can reach the port can push updates, so ``secret=None`` is refused
unless the server listens on a loopback address or ``insecure=True`` is passed.
TLS is available through ``ssl=ssl.SSLContext(...)``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import math
import os
import ssl as ssl_lib
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from hpsjax._checks import check_int, check_number, check_positive
from hpsjax._devices import describe_device, resolve_device
from hpsjax._logs import Every
from hpsjax._progress import Progress
from hpsjax.apply import LeafApply, OverlapAggregator
from hpsjax.decisions import (
    DEFAULT_POLICY,
    ActionInterpreter,
    Applied,
    Drop,
    ForcePull,
    PlanChanged,
    PushAck,
    PushBegun,
    Release,
    ReplannerProtocol,
    SaveCheckpoint,
    SendParams,
    ServerCore,
    StageChanged,
    StageSet,
    StartApply,
    Tick,
    Wait,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.net import _auth
from hpsjax.net._connection import FrameProtocol, error_frame
from hpsjax.storage import (
    SERVER_CHECKPOINT_FORMAT,
    SERVER_CHECKPOINT_FORMAT_VERSION,
    CheckpointManager,
)
from hpsjax.wire import (
    DEFAULT_LIMITS,
    AuthError,
    BufferPool,
    DecoderCache,
    ForcePullNotice,
    Frame,
    FrameError,
    Header,
    HpsError,
    InfoMessage,
    LayoutCache,
    MalformedMetadata,
    MsgType,
    NonFiniteUpdate,
    Notice,
    PackedFields,
    PlanNotice,
    PreparedFrame,
    ProtocolError,
    PushMeta,
    ServerError,
    ShuttingDown,
    StageNotice,
    Subscribe,
    Subscribed,
    UnexpectedMessage,
    WireLimits,
    WireTree,
    WorkerDropped,
    check_same_spec,
    encode_frame,
    flatten_tree,
    leaf_buffers,
    notice_to_wire,
    pack_fields,
    prepare_frame,
    tree_to_wire,
)

__all__ = ["Server", "is_loopback"]

logger = logging.getLogger(__name__)

# Until a connection has authenticated, its frames are small handshake messages:
# nothing larger is read, so a stranger cannot make the server allocate much.
_HANDSHAKE_LIMITS = WireLimits(max_message_bytes=4096, max_metadata_bytes=4096)

# Least seconds between two "checkpoint written" lines at INFO (the others
# at DEBUG), and between two lines about refused non-finite updates.
_CHECKPOINT_LOG_EVERY_S = 60.0
_NONFINITE_LOG_EVERY_S = 10.0
# A pull answered within this many seconds is not said to have been held: its
# answer is the version's cached frame (workers count it as 0).
_HELD_REPORTED_S = 1e-3

# What a client's BYE says when it simply ends its run.
_CLEAN_BYE = "client closing"

# Frames a client may send under request id 0: they expect no reply.
_NOTICE_TYPES = frozenset({MsgType.ERROR, MsgType.BYE})

# Fields of a PUSH besides the tree, with the types the core accepts.
# Decoders of quantized pushes of big models are compiled here, one at a time,
# while numpy decodes the pushes that arrive meanwhile (see DecoderCache).
_COMPILER = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="hpsjax-server-compile"
)


def is_loopback(host: str | None) -> bool:
    if host in (None, ""):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _on_device(method):
    """Runs a method of :class:`Server` with the server's device as JAX's
    default, so arrays the core makes there (buffers, scalars, a resumed
    state) and the steps it compiles stay on that device whatever the
    process's default is (JAX's default device is set per thread and
    context, so each entry from the event loop or a thread sets it). Where the
    server's device is the process's default (``hpsjax-server`` on the host),
    nothing needs setting: a microsecond saved on every frame."""

    @functools.wraps(method)
    def placed(self, *args, **kwargs):
        if self._device_is_default:
            return method(self, *args, **kwargs)
        with jax.default_device(self._device):
            return method(self, *args, **kwargs)

    return placed


def _live_workers(count: int) -> str:
    return f"{count} live worker" + ("" if count == 1 else "s")


def _describe_plan(plan: PlanNotice) -> str:
    """A plan notice in words, for the log (its fields that are set)."""
    parts = [
        f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in (
            ("batch", plan.batch_size),
            ("local steps", plan.local_steps),
            ("step-size scale", plan.lr_scale),
        )
        if value is not None
    ]
    return f"plan revision {plan.revision}: {', '.join(parts) or 'no change'}"


def _plan_hint(entry: Any, revision: int) -> PlanNotice:
    """A ``WorkerPlan`` as the plan a worker receives (see :meth:`send_plan`)."""
    return PlanNotice(
        revision=int(revision),
        batch_size=int(entry.batch_size),
        device_batches=tuple(int(d.batch_size) for d in entry.devices),
        local_steps=int(entry.local_steps),
        lr_scale=float(entry.lr_scale),
    )


@dataclasses.dataclass(eq=False)
class _Session:
    """One connection: its handshake state and its requests waiting on the core."""

    protocol: FrameProtocol
    peer: str
    handshake: _auth.Handshake
    closed: bool = False
    joined: bool = False
    # Requests answered by the core's next SendParams for this worker, in
    # order: (request id, push acknowledgement to embed or None).
    pulls: collections.deque = dataclasses.field(default_factory=collections.deque)
    subscribed: bool = False
    sub_dirty: bool = False
    sub_task: asyncio.Task | None = None
    handshake_timer: asyncio.TimerHandle | None = None
    # The apply of the push being received, fed leaf by leaf (or None).
    overlap: LeafApply | None = None

    @property
    def state(self) -> str:
        """hello -> auth -> ready -> closed."""
        return "closed" if self.closed else self.handshake.state.value

    @property
    def worker_id(self) -> Any:
        """The worker's id, once its HELLO is in (else ``None``)."""
        return self.handshake.worker_id


def _check_server_args(
    *,
    port: Any,
    ssl: Any,
    checkpoint_dir: Any,
    checkpoint_every_s: Any,
    checkpoint_every_updates: Any,
    handshake_timeout: Any,
    status_interval: Any,
    limits: Any,
    overlap_apply_bytes: Any,
    replanner: Any,
) -> None:
    """Refuses :class:`Server`'s bad arguments, each in one line."""
    if ssl is not None and not isinstance(ssl, ssl_lib.SSLContext):
        raise ValueError("ssl must be an ssl.SSLContext or None")
    check_int("port", port, low=0, high=65535)
    check_positive("checkpoint_every_s", checkpoint_every_s, allow_none=True)
    check_positive("handshake_timeout", handshake_timeout, allow_none=True)
    check_number("status_interval", status_interval, low=0)
    check_int(
        "checkpoint_every_updates", checkpoint_every_updates, low=1, allow_none=True
    )
    if checkpoint_dir is None and (checkpoint_every_s or checkpoint_every_updates):
        raise ValueError("checkpoint_every_* needs a checkpoint_dir")
    if not isinstance(limits, WireLimits):
        raise ValueError("limits must be a WireLimits")
    check_int("overlap_apply_bytes", overlap_apply_bytes, low=0, allow_none=True)
    if replanner is not None and not isinstance(replanner, ReplannerProtocol):
        raise ValueError(
            "replanner must have a plan and observe() (a Replanner), got "
            f"{type(replanner).__name__}"
        )


class Server:
    r"""An asyncio TCP parameter server for one model.

    Args:
      params: the initial parameters (a pytree of arrays; dict keys must be
        strings), version 0 unless a checkpoint is resumed.
      optimizer: the server's optax optimizer (see ``ServerCore`` for how an
        update :math:`u` is applied: :math:`w \leftarrow w +
        \operatorname{opt.update}(u)`).
      policy: a policy name (``"asp"``, ``"bsp"``, ``"ssp"``, ``"saps"``,
        ``"adsp"``, ``"semi_async"``, ``"hybrid"``) or a ``Policy`` object;
        BSP by default (:data:`hpsjax.ps.DEFAULT_POLICY`, as the commands').
      host: address to listen on.
      port: port to listen on; 0 picks a free one (see :attr:`port`).
      secret: shared secret (bytes or str) workers must prove they know, or
        ``None`` for no authentication (only on loopback, or with
        ``insecure=True``).
      ssl: an ``ssl.SSLContext`` (server side) for TLS, or ``None``.
      insecure: allow ``secret=None`` on a non-loopback address.
      checkpoint_dir: directory for orbax checkpoints; the server resumes
        from the newest one on :meth:`start` and saves a final one on
        :meth:`close`. ``None`` disables checkpoints.
      checkpoint_every_s: also save every this many seconds (if the version
        changed).
      checkpoint_every_updates: also save every this many new versions.
      checkpoint_keep: how many checkpoints to keep.
      limits: frame limits (message bytes, metadata bytes, leaves, dtypes).
      check_finite: refuse updates holding NaN or infinity, and updates
        that, applied, would make the parameters non-finite.
      handshake_timeout: seconds a new connection has to authenticate.
      core_kwargs: more keyword arguments of ``ServerCore`` (for example
        ``expected_workers``, ``deadline_factor``, ``min_timeout``,
        ``initial_timeout``, ``keep_stale_params``).
      replanner: a :class:`hpsjax.planning.Replanner` for H-PS dynamic
        scheduling, or ``None``. Each worker of its plan gets its entry
        (``batch_size``, ``device_batches``, ``local_steps``, ``lr_scale``)
        when it joins; every push's ``step_time``, ``num_samples`` and
        ``local_steps`` feed it as one local step of ``num_samples /
        local_steps`` samples taking ``step_time / local_steps`` seconds; and
        when the measured speeds drift it revises the plan, whose entries go
        to the workers at once (:meth:`send_plan`). The replanner's state is
        not checkpointed: a restarted server starts again from its plan.
      status_interval: seconds between the INFO status lines (version, its
        rate, the workers' mean loss and staleness, pushes per second, live
        workers; :class:`hpsjax._progress.Progress`), and between the points
        of ``metrics``' TensorBoard scalars; 0 for neither. On a terminal
        (``status_bar``) the status is a bar instead. Joins, leaves (done,
        crashed, replaced) and drops, plans sent, refused non-finite updates,
        checkpoints (at most a line a minute) and a resume are logged too.
      status_bar: show the status as a tqdm bar on stderr (``True``), as log
        lines (``False``), or as a bar exactly when stderr is a terminal
        (``None``).
      metrics: a :class:`hpsjax.metrics.ServerMetrics` told of every push,
        pull, apply, barrier wait, leave, refused update and checkpoint, or
        None (no cost).
      overlap_apply_bytes: a push of uncompressed leaves of at least this
        many bytes after which the server applies at once (an ASP push,
        the last push of a BSP round) is averaged into the buffer and applied
        leaf by leaf as its leaves arrive, where the optimizer is
        leaf-separable (elementwise chains: sgd, momentum, adam...; not
        global-norm clipping): the optimizer runs while the rest of the push
        is received. ``None`` applies every push
        after its last byte. :meth:`start` logs which applies are used.
      device: where the parameters and optimizer state live and the
        optimizer runs: ``None`` for the host CPU (where the socket's bytes
        are; an accelerator's transfers would cost every push more than its
        arithmetic saves), a platform name (``"gpu"``, ``"cuda"``,
        ``"tpu"``, optionally ``":INDEX"``) or a ``jax.Device``
        (:func:`hpsjax._devices.resolve_device`). :meth:`start` logs it.
      **policy_kwargs: keyword arguments of the policy given by name (e.g.
        ``staleness_bound=2`` for ``"ssp"``).

    Raises:
      ValueError: bad arguments (checked here, before anything starts).

    Examples:
      Serve until cancelled::

        async def main():
            async with Server(params, optax.sgd(0.1), "ssp", staleness_bound=2,
                              secret=key, port=5555) as server:
                await server.serve_forever()

        asyncio.run(main())   # or uvloop.run(main()), faster for big models

    References:
      Luo, Nelson, Ceze, Phanishayee, Krishnamurthy, "Parameter Hub: a
      Rack-Scale Parameter Server for Distributed Deep Neural Network Training",
      SoCC 2018, https://arxiv.org/abs/1801.09805 (reused receive buffers;
      parameters sent to subscribers right after each update).

      Jin, Xu, Guo, Hu, Yeung, "PS+: A Simple yet Effective Framework for Fast
      Training on Parameter Server", IEEE TPDS 33(12), 2022,
      https://doi.org/10.1109/TPDS.2022.3200518 (pulls answered while pushes
      are in flight).
    """

    def __init__(
        self,
        params: Any,
        optimizer: optax.GradientTransformation,
        policy: Any = DEFAULT_POLICY,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str | None,
        ssl: ssl_lib.SSLContext | None = None,
        insecure: bool = False,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every_s: float | None = None,
        checkpoint_every_updates: int | None = None,
        checkpoint_keep: int | None = 3,
        limits: WireLimits = DEFAULT_LIMITS,
        check_finite: bool = True,
        handshake_timeout: float = 10.0,
        core_kwargs: Mapping[str, Any] | None = None,
        replanner: Any = None,
        status_interval: float = 10.0,
        status_bar: bool | None = None,
        metrics: Any = None,
        overlap_apply_bytes: int | None = 1 << 20,
        device: Any = None,
        **policy_kwargs: Any,
    ):
        self._device = resolve_device(device)
        self._device_is_default = (
            jax.config.jax_default_device is None and self._device == jax.devices()[0]
        )
        self._secret = _auth.secret_bytes(secret)
        if self._secret is None and not (insecure or is_loopback(host)):
            raise ValueError(
                f"refusing to serve on {host!r} without a secret: anyone who can "
                "reach the port could push updates; pass secret=... (or "
                "insecure=True to accept that)"
            )
        _check_server_args(
            port=port,
            ssl=ssl,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_s=checkpoint_every_s,
            checkpoint_every_updates=checkpoint_every_updates,
            handshake_timeout=handshake_timeout,
            status_interval=status_interval,
            limits=limits,
            overlap_apply_bytes=overlap_apply_bytes,
            replanner=replanner,
        )
        with jax.default_device(self._device):
            self._core = ServerCore(
                jax.device_put(params, self._device),
                optimizer,
                policy,
                policy_kwargs=policy_kwargs,
                # Checked here on the received arrays instead (numpy, one pass,
                # naming the leaf), before the core ever sees the update.
                check_finite=False,
                aggregator=OverlapAggregator,
                replanner=replanner,
                checkpoint_every_updates=checkpoint_every_updates,
                **({"check_result": bool(check_finite)} | dict(core_kwargs or {})),
            )
        self._host = host
        self._requested_port = port
        self._ssl = ssl
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._check_finite = bool(check_finite)
        # The session whose push is being applied as it arrives, if any.
        self._overlap_owner: _Session | None = None
        # Pushes at least this big are applied as they arrive (math.inf: none).
        self._overlap_min_bytes = (
            math.inf if overlap_apply_bytes is None else overlap_apply_bytes
        )
        self._checkpoint_dir = checkpoint_dir
        self._checkpoint_every_s = checkpoint_every_s
        self._checkpoint_keep = checkpoint_keep
        self._status_interval = float(status_interval)
        self._status_bar = status_bar
        self._status_task: asyncio.Task | None = None
        self._progress: Progress | None = None
        self._pushes = 0
        if metrics is not None and not callable(getattr(metrics, "push", None)):
            raise ValueError("metrics must be a ServerMetrics or None")
        self._metrics = metrics
        self._pull_started: dict[tuple[int, int], float] = {}
        self._checkpoint_lines = Every(_CHECKPOINT_LOG_EVERY_S)
        self._nonfinite_lines = Every(_NONFINITE_LOG_EVERY_S)
        self._describe_model(limits)
        # Pushes are received into reused blocks (PHub's pre-registered
        # buffers); a block returns once the core and JAX let go of it.
        self._pool = BufferPool(max_blocks=8)
        self._layouts = LayoutCache(
            limits, check=lambda layout: check_same_spec(layout, self._model)
        )
        self._decoders = DecoderCache(
            [(s.shape, s.dtype.name) for s in self._model.leaves], size=8
        )
        self._compiling: set[Any] = set()  # codecs whose decoder is compiling
        self._sessions: dict[Any, _Session] = {}
        self._plans: dict[Any, PlanNotice] = {}
        if replanner is not None:
            work_plan = replanner.plan
            for entry in work_plan.workers:
                self._plans[entry.worker_id] = _plan_hint(entry, work_plan.revision)
        self._connections: set[_Session] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_tick_deadline: float | None = None
        self._closing = False
        self._closed: asyncio.Future | None = None
        self._params_cache: tuple[int, list, list] | None = None
        # (version, {(has extra, local steps): PARAMS frame}), see _params_frame.
        self._params_frames: tuple[int, dict[tuple, PreparedFrame]] = (-1, {})
        self._manager: CheckpointManager | None = None
        self._saved_version: int | None = None
        self._checkpoint_task: asyncio.Task | None = None
        self._checkpoint_error: BaseException | None = None
        self._checkpoint_futures: list[concurrent.futures.Future] = []
        self._port: int | None = None
        # The call of _carry_out under way: the push its actions answer, when
        # that push arrived, and whether to publish and to save after them.
        self._pusher: Any = None
        self._arrived: float | None = None
        self._applied = self._save_due = False
        self._interpret = self._interpreter()

    def _describe_model(self, limits: WireLimits) -> None:
        """The model's wire description, packed once.

        Raises:
          ValueError: the parameters' leaf order is not JAX's.
        """
        meta, _, self._model = tree_to_wire(self._core.params, limits=limits)
        # Shapes and dtypes never change, so the parameters' description is
        # packed once; each version adds only its number.
        self._params_description = pack_fields(meta)
        # Received leaves are put back into the parameters' own tree type, so
        # the wire's leaf order must be JAX's.
        _, wire_leaves = flatten_tree(self._core.params, limits=limits)
        jax_leaves, self._treedef = jax.tree.flatten(self._core.params)
        if len(wire_leaves) != len(jax_leaves) or any(
            a is not b for a, b in zip(wire_leaves, jax_leaves, strict=False)
        ):
            raise ValueError(
                "params must be a pytree of dicts (str keys), lists, tuples and "
                "arrays whose leaf order is JAX's"
            )
        self._spec_meta = {
            "tree": self._model.structure,
            "leaves": [[s.dtype.name, list(s.shape)] for s in self._model.leaves],
        }

    # ---------------------------------------------------------- properties

    @property
    def core(self) -> ServerCore:
        """The server's core (read it; drive it only through the server)."""
        return self._core

    @property
    def port(self) -> int:
        """The port the server listens on (valid after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def params(self) -> Any:
        """The current parameters."""
        return self._core.params

    @property
    def version(self) -> int:
        """The current parameter version."""
        return self._core.version

    @property
    def device(self) -> jax.Device:
        """The device holding the parameters and optimizer state."""
        return self._device

    @_on_device
    def _call_on_device(self, fn, *args):
        """``fn(*args)`` with the server's device as the default (for threads)."""
        return fn(*args)

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint step resumed from by :meth:`start`, or ``None``."""
        return getattr(self, "_resumed_from", None)

    # ---------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Resumes from the newest checkpoint (if any) and starts listening.

        Bound it with ``asyncio.timeout`` if reading a checkpoint may be slow.
        Cancelling is safe: a cancelled start leaves nothing listening.

        Raises:
          OSError: the address cannot be bound.
          ValueError: the checkpoint does not match the model.
        """
        if self._server is not None:
            raise RuntimeError("the server is already started")
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._resumed_from = None
        if self._checkpoint_dir is not None:
            # The manager writes on its own thread; opening and reading block.
            self._manager = await asyncio.to_thread(
                CheckpointManager, self._checkpoint_dir, keep=self._checkpoint_keep
            )
            await self._resume()
        self._server = await self._loop.create_server(
            self._new_protocol,
            self._host,
            self._requested_port,
            ssl=self._ssl,
            reuse_address=True,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        await self._decide_overlap()
        if self._checkpoint_every_s is not None:
            self._checkpoint_task = self._loop.create_task(self._checkpoint_loop())
        if self._status_interval > 0:
            self._progress = Progress(
                "server",
                "version",
                interval=self._status_interval,
                bar=self._status_bar,
                logger=logger,
            )
            self._status_task = self._loop.create_task(self._status_loop())
        self._rearm()
        logger.info("server state on %s", describe_device(self._device))
        logger.info(
            "serving %s (%s) on %s:%d at version %d",
            type(self._core.policy).__name__,
            "tls" if self._ssl else "tcp",
            self._host,
            self._port,
            self._core.version,
        )

    async def _decide_overlap(self) -> None:
        """Whether pushes can be applied as they arrive, decided and logged once
        (the separability test compiles, so off the event loop)."""
        if self._model.nbytes < self._overlap_min_bytes:
            return
        aggregator = self._core.aggregator
        if not aggregator.can_overlap:
            self._overlap_min_bytes = math.inf
            logger.info("applies: whole-tree (this core setup applies no push alone)")
            return
        steps = await self._loop.run_in_executor(
            _COMPILER, self._call_on_device, lambda: aggregator.leaf_steps
        )
        if steps is None:
            self._overlap_min_bytes = math.inf
            logger.info(
                "applies: whole-tree after each push's last byte (the optimizer "
                "is not leaf-separable)"
            )
        else:
            logger.info(
                "applies: leaf by leaf as pushes of %d bytes or more arrive (the "
                "optimizer is leaf-separable)",
                self._overlap_min_bytes,
            )

    async def serve_forever(self) -> None:
        """Waits until :meth:`close` is called (by another task or a signal).

        Cancelling it is safe and does not close the server; use :meth:`close`
        (the async context manager does).
        """
        if self._closed is None:
            raise RuntimeError("the server is not started")
        await asyncio.shield(self._closed)

    async def close(self, *, timeout: float = 10.0) -> None:
        """Closes gracefully; idempotent.

        Stops accepting connections; fails the requests waiting on the policy
        with :class:`ShuttingDown`; says BYE to every worker and closes the
        connections (after at most ``timeout`` seconds of flushing); saves a final
        checkpoint. A push still being received is never applied.

        ``timeout`` bounds the wait for connections to close; writing the final
        checkpoint is not bounded (a half-written checkpoint is never committed,
        so cancelling then loses only that checkpoint). Cancelling the close
        otherwise leaves connections to be aborted by the event loop's shutdown.

        Args:
          timeout: seconds to let workers read their last frames.

        Raises:
          Exception: the error of a failed checkpoint save, if any.
        """
        if self._closing or self._server is None:
            return
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self._checkpoint_task is not None:
            self._checkpoint_task.cancel()
        if self._status_task is not None:
            self._status_task.cancel()
        if self._progress is not None:
            self._progress.close()
        self._server.close()
        for session in list(self._connections):
            for request_id, _ in session.pulls:
                session.protocol.send(
                    error_frame(request_id, ShuttingDown("server is closing"))
                )
            session.pulls.clear()
            if session.sub_task is not None:
                session.sub_task.cancel()
            with contextlib.suppress(HpsError):
                session.protocol.send(
                    encode_frame(MsgType.BYE, 0, {"reason": "server closing"})
                )
            session.protocol.close()
        # Server.wait_closed() does not wait for connections on every Python
        # this supports, so wait for them to end here.
        deadline = self._loop.time() + timeout
        while self._connections and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        for session in list(self._connections):
            session.protocol.abort()
        if self._metrics is not None and self._status_interval > 0:
            self._metrics.write_scalars(self._scalar_state())
        try:
            if self._manager is not None:
                await self._finish_checkpoints()
        finally:
            if not self._closed.done():
                self._closed.set_result(None)
        if self._checkpoint_error is not None:
            raise self._checkpoint_error

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    @_on_device
    def set_stage(self, index: int) -> None:
        """Moves a staged policy (``"hybrid"``) to stage ``index``.

        Workers learn of it through a stage NOTICE and the new local-steps hints.

        Raises:
          ValueError: the policy has no such stage (nothing changes).
        """
        self._carry_out(self._core.handle(StageSet(index, self._now())))
        self._rearm()

    def _announce(self, notice: Notice, *, skip: Any = None) -> None:
        """Sends ``notice`` to every authenticated worker but ``skip``."""
        for session in self._connections:
            if session.state == "ready" and session is not skip:
                with contextlib.suppress(HpsError):
                    self._notify(session, notice)

    def send_plan(self, worker_id: Any, plan: PlanNotice | Mapping[str, Any]) -> None:
        """Sends a worker a new work plan (H-PS re-planning), now or on joining.

        The plan reaches the worker in a plan NOTICE and shows in its client's
        ``plan``; a worker that is not connected gets the latest one before the
        answer to its next join.

        Args:
          worker_id: the worker.
          plan: a :class:`~hpsjax.ps.PlanNotice`, or a map of its fields with an
            int ``revision`` (higher revisions replace lower ones), e.g.
            ``{"revision": 2, "batch_size": 48, "local_steps": 4,
            "lr_scale": 0.5}``.

        Raises:
          ValueError: the plan is not a valid plan (nothing is sent or kept).
        """
        if not isinstance(plan, PlanNotice):
            plan = PlanNotice.from_wire(plan, error=ValueError)
        self._plans[worker_id] = plan
        session = self._sessions.get(worker_id)
        if session is not None and session.state == "ready":
            self._notify(session, plan)

    @property
    def work_plan(self) -> Any:
        """The work plan in force (``replanner``'s), or ``None`` without one."""
        replanner = self._core.replanner
        return None if replanner is None else replanner.plan

    def _send_plans(self, change: PlanChanged) -> None:
        """Hands every worker its entry of a revised plan (H-PS re-planning)."""
        revised = change.plan
        logger.info(
            "re-planned (revision %d) after %s: batches %s",
            revised.revision,
            change.reason,
            {entry.worker_id: entry.batch_size for entry in revised.workers},
        )
        for entry in revised.workers:
            self.send_plan(entry.worker_id, _plan_hint(entry, revised.revision))

    # ---------------------------------------------------------- checkpoints

    async def _resume(self) -> None:
        like = (self._core.params, self._core.opt_state)
        restored = await asyncio.to_thread(
            self._call_on_device, lambda: self._manager.restore_latest(like=like)
        )
        if restored is None:
            return
        meta = restored.metadata or {}
        if meta.get("format") != SERVER_CHECKPOINT_FORMAT:
            raise ValueError(
                f"{self._checkpoint_dir} holds checkpoints of another kind"
            )
        params, opt_state = restored.tree
        with jax.default_device(self._device):
            self._core.load_state_dict(meta["core"], params=params, opt_state=opt_state)
        self._saved_version = self._core.version
        self._resumed_from = restored.step
        logger.info(
            "resumed from checkpoint %s at version %d",
            self._manager.directory / f"ckpt_{restored.step}",
            self._core.version,
        )

    def _checkpoint_metadata(self) -> dict:
        return {
            "format": SERVER_CHECKPOINT_FORMAT,
            "format_version": SERVER_CHECKPOINT_FORMAT_VERSION,
            "core": self._core.state_dict(),
        }

    def _save_async(self) -> None:
        """Hands a checkpoint of the current version to the manager's thread.

        Parameters and optimizer state are immutable JAX arrays, so handing
        their references to the thread is a consistent snapshot; the
        bookkeeping is captured here, at the same moment. A save due while
        another is written is folded into the next (``save_async``).
        """
        version = self._core.version
        if self._manager is None or version == self._saved_version:
            return
        tree = (self._core.params, self._core.opt_state)
        try:
            future = self._manager.save_async(
                version, tree, self._checkpoint_metadata(), snapshot=False
            )
        except RuntimeError:  # an earlier save failed: _note_save kept it
            return
        self._saved_version = version
        if future not in self._checkpoint_futures:  # a folded save's is
            self._checkpoint_futures = [
                f for f in self._checkpoint_futures if not f.done()
            ] + [future]
            future.add_done_callback(self._note_save)

    def _note_save(self, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None:
            logger.error("checkpoint save failed: %s", error)
            self._checkpoint_error = error
        else:
            # At most one line a minute (every one at DEBUG), and the last.
            show, held = self._checkpoint_lines.ready()
            if show or self._closing:
                more = f" ({held} more since the last line)" if held else ""
                logger.info("checkpoint written: %s%s", future.result(), more)
            else:
                logger.debug("checkpoint written: %s", future.result())
            if self._metrics is not None:
                self._metrics.checkpoint_saved()

    async def _finish_checkpoints(self) -> None:
        self._save_async()
        for future in self._checkpoint_futures:
            with contextlib.suppress(Exception):  # recorded by _note_save
                await asyncio.wrap_future(future)
        with contextlib.suppress(RuntimeError):  # a failed save, kept above
            await asyncio.to_thread(self._manager.close)

    def _scalar_state(self) -> dict[str, int]:
        return {"version": self._core.version, "live_workers": len(self._core.live)}

    async def _status_loop(self) -> None:
        """Shows the status when due and writes the TensorBoard scalars."""
        progress = self._progress
        pushes, t = self._pushes, self._loop.time()
        scalars_at = t
        while True:
            await asyncio.sleep(progress.period)
            now = self._loop.time()
            rate = (self._pushes - pushes) / max(now - t, 1e-9)
            shown = progress.update(
                self._core.version,
                notes=(f"{rate:.1f} pushes/s", _live_workers(len(self._core.live))),
            )
            if shown is not None:
                pushes, t = self._pushes, now
            if self._metrics is not None and now - scalars_at >= self._status_interval:
                scalars_at = now
                self._metrics.write_scalars(self._scalar_state())

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self._checkpoint_every_s)
            self._save_async()

    # ---------------------------------------------------------- connections

    def _now(self) -> float:
        return self._loop.time()

    def _new_protocol(self) -> FrameProtocol:
        session: _Session | None = None

        def allocate(header: Header, meta: dict) -> tuple:
            return self._allocate(session, header, meta)

        protocol = FrameProtocol(
            lambda event: self._on_event(session, event),
            lambda error: self._on_lost(session, error),
            limits=_HANDSHAKE_LIMITS,
            allocate=allocate,
            on_made=lambda: self._on_made(session),
            on_filled=lambda payload, index: self._on_filled(session, payload, index),
        )
        session = _Session(
            protocol=protocol, peer="?", handshake=_auth.Handshake.server(self._secret)
        )
        return protocol

    def _on_made(self, session: _Session) -> None:
        # Only connections that got this far (past TLS) are ever "lost", so
        # only they are tracked.
        peer = session.protocol.transport.get_extra_info("peername")
        session.peer = str(peer)
        if self._closing:
            session.protocol.close()
            return
        self._connections.add(session)
        session.handshake_timer = self._loop.call_later(
            self._handshake_timeout, self._handshake_expired, session
        )

    def _handshake_expired(self, session: _Session) -> None:
        if session.state != "ready":
            session.protocol.fail(AuthError("handshake timed out"))

    @_on_device
    def _allocate(self, session: _Session, header: Header, meta: dict):
        if session.state != "ready":
            raise UnexpectedMessage(f"{header.msg_type.name} before authentication")
        if header.msg_type not in (MsgType.PUSH, MsgType.PUSH_PULL):
            raise UnexpectedMessage(f"clients do not send {header.msg_type.name}")
        layout = self._layouts.get(meta)
        if layout.nbytes != header.payload_length:
            raise MalformedMetadata(
                f"leaves hold {layout.nbytes} bytes, header says "
                f"{header.payload_length}"
            )
        arrays, buffers = layout.receive_buffers(self._pool)
        session.overlap = None
        owner = self._overlap_owner
        if (
            layout.codec is None
            and layout.nbytes >= self._overlap_min_bytes
            # One at a time: pushes received side by side would apply on each
            # other's parameters, and all but the first be done again.
            and (owner is None or owner.overlap is None or owner.closed)
        ):
            self._carry_out(
                self._core.handle(
                    PushBegun(
                        session.worker_id,
                        meta.get("version"),
                        meta.get("num_samples"),
                        self._now(),
                    )
                )
            )
        return buffers, WireTree(layout, arrays)

    @_on_device
    def _on_event(self, session: _Session, event: Frame | FrameError) -> None:
        if self._closing:
            return
        request_id = event.request_id
        if not request_id and event.msg_type not in _NOTICE_TYPES:
            # Id 0 marks notices; a request under it could not be answered.
            session.protocol.fail(
                ProtocolError(f"{event.msg_type.name} with request id 0")
            )
            return
        try:
            if isinstance(event, FrameError):
                session.overlap = None
                self._note_refused(session, event.error)
                if session.state != "ready":
                    session.protocol.fail(event.error, request_id=request_id)
                else:
                    session.protocol.send(error_frame(request_id, event.error))
                return
            if session.state != "ready":
                self._handshake(session, event)
            else:
                self._request(session, event)
        except HpsError as e:
            self._note_refused(session, e)
            if not session.protocol.closed:
                session.protocol.send(error_frame(request_id, e))
        except Exception as e:
            logger.exception("failed to serve %s", event.msg_type.name)
            if not session.protocol.closed:
                session.protocol.send(error_frame(request_id, e))
        finally:
            self._rearm()

    def _note_refused(self, session: _Session, error: BaseException) -> None:
        """Says, in one line at most every few seconds, that a worker sent a
        non-finite update (a diverging run), and counts it."""
        if not isinstance(error, NonFiniteUpdate):
            return
        if self._metrics is not None:
            self._metrics.nonfinite_update()
        show, held = self._nonfinite_lines.ready()
        if show:
            more = f"; {held} more refused since the last line" if held else ""
            logger.warning(
                "worker %r sent a non-finite update at version %d (refused: %s%s)",
                session.worker_id,
                self._core.version,
                error.message if isinstance(error, HpsError) else error,
                more,
            )

    # ---------------------------------------------------------- handshake

    def _handshake(self, session: _Session, frame: Frame) -> None:
        try:
            msg_type, meta = session.handshake.receive(frame.msg_type, frame.metadata)
        except HpsError as e:
            if isinstance(e, AuthError):
                logger.warning(
                    "authentication failed for %r from %s",
                    session.worker_id,
                    session.peer,
                )
            session.protocol.fail(e, request_id=frame.request_id)
            return
        if session.handshake.ready:
            session.protocol.decoder.limits = self._limits
            if session.handshake_timer is not None:
                session.handshake_timer.cancel()
            old = self._sessions.get(session.worker_id)
            if old is not None and old is not session:
                if old.joined and not old.closed and old.worker_id in self._core.live:
                    # Two workers under one id: refused, not taken for a
                    # reconnect (a dead connection's worker is dropped first).
                    session.protocol.fail(
                        ServerError(
                            f"worker id {session.worker_id!r} belongs to a live "
                            "connected worker: give each worker its own --worker_id"
                        ),
                        request_id=frame.request_id,
                    )
                    return
                self._replace(old)
            self._sessions[session.worker_id] = session
            meta = {**meta, "info": self._info()}
            plan = self._plans.get(session.worker_id)
            if plan is not None:
                # Before the welcome, so the worker can compile its planned
                # step before it joins a round.
                self._notify(session, plan)
        session.protocol.send(encode_frame(msg_type, frame.request_id, meta))

    def _replace(self, old: _Session) -> None:
        error = WorkerDropped("replaced by a newer connection of the same worker")
        self._fail_pulls(old, error)
        with contextlib.suppress(HpsError):
            old.protocol.send(error_frame(0, error))
        self._leave(old, "replaced", "by a newer connection of the same worker")
        old.protocol.close()

    def _info(self) -> dict[str, Any]:
        policy = self._core.policy
        limits = self._limits
        return InfoMessage(
            policy=getattr(policy, "name", type(policy).__name__),
            version=self._core.version,
            stage=int(self._core.stage or 0),
            synchronous=bool(getattr(policy, "synchronous", False)),
            spec=self._spec_meta,
            limits={
                "max_message_bytes": limits.max_message_bytes,
                "max_metadata_bytes": limits.max_metadata_bytes,
                "max_leaves": limits.max_leaves,
                "max_depth": limits.max_depth,
                "max_rank": limits.max_rank,
                "dtypes": sorted(limits.dtypes),
            },
            workers=len(self._core.live),
        ).to_wire()

    # ---------------------------------------------------------- requests

    def _request(self, session: _Session, frame: Frame) -> None:
        t = frame.msg_type
        rid = frame.request_id
        if t in (MsgType.PULL, MsgType.PUSH_PULL):
            # When the answer leaves, the worker hears how long it was held.
            if len(self._pull_started) > 65536:  # unanswered ones of lost sessions
                self._pull_started.clear()
            self._pull_started[id(session), rid] = self._loop.time()
        if t == MsgType.PULL:
            session.pulls.append((rid, None))
            try:
                self._pull(session)
            except BaseException:
                if (rid, None) in session.pulls:
                    session.pulls.remove((rid, None))
                raise
        elif t in (MsgType.PUSH, MsgType.PUSH_PULL):
            self._push(session, frame)
        elif t == MsgType.SUBSCRIBE:
            on = Subscribe.from_wire(frame.metadata).on
            session.subscribed = on
            reply = Subscribed(on=on, version=self._core.version)
            session.protocol.send(encode_frame(MsgType.SUBSCRIBE, rid, reply.to_wire()))
            if on:
                self._send_params(session, 0)
        elif t == MsgType.INFO:
            session.protocol.send(encode_frame(MsgType.INFO, rid, self._info()))
        elif t == MsgType.BYE:
            reason = frame.metadata.get("reason")
            said = (
                "" if reason in (None, _CLEAN_BYE) else f"saying {str(reason)[:200]!r}"
            )
            self._leave(session, "done", said)
            session.protocol.close()
        elif t == MsgType.ERROR:
            logger.info(
                "worker %r reported error %s: %s",
                session.worker_id,
                frame.metadata.get("code"),
                str(frame.metadata.get("message"))[:200],
            )
        else:
            raise UnexpectedMessage(f"clients do not send {t.name}")

    def _pull(self, session: _Session) -> None:
        now = self._now()
        if session.joined and session.worker_id in self._core.live:
            actions = self._core.handle(WorkerPulled(session.worker_id, now))
        else:
            plan = self._plans.get(session.worker_id)
            if plan is not None:
                # Before the answer to the join, so the plan is in force for
                # the worker's first round.
                self._notify(session, plan)
            actions = self._core.handle(WorkerJoined(session.worker_id, now))
            session.joined = True
            logger.info(
                "worker %r joined from %s at version %d (%d live)%s",
                session.worker_id,
                session.peer,
                self._core.version,
                len(self._core.live),
                "" if plan is None else f"; sent its {_describe_plan(plan)}",
            )
        self._carry_out(actions)

    def _push(self, session: _Session, frame: Frame) -> None:
        arrived = self._loop.time()
        # The one place a push's fields are validated.
        meta = PushMeta.from_wire(frame.metadata)
        prepared, session.overlap = session.overlap, None
        codec = frame.payload.layout.wire
        if codec is not None and self._decoders.worth_compiling(codec):
            self._compile_decoder(codec)
        leaves = self._decode_update(frame.payload)
        if self._check_finite and codec is not None and codec.finite_decoded:
            # Raw leaves were checked as they arrived (_check_received), and
            # compressed parts, but decoding them may still overflow.
            self._require_finite(leaves)
        update = jax.tree.unflatten(self._treedef, leaves)
        # The layout was checked against the model before the payload was read
        # (a compressed one decodes to the model's shapes and dtypes), and the
        # values as they arrived: the core need not check them again.
        started = self._loop.time() if self._metrics is not None else 0.0
        aggregator = self._core.aggregator
        # The apply started as the push arrived serves this push only.
        aggregator.prepare(prepared)
        try:
            actions = self._core.handle(
                WorkerPushed(session.worker_id, update, meta, self._now())
            )
        finally:
            aggregator.prepare(None)
        self._pushes += 1
        if self._metrics is not None and any(isinstance(a, Applied) for a in actions):
            self._metrics.apply(self._loop.time() - started, version=self._core.version)
        ack = None
        for action in actions:
            if isinstance(action, PushAck) and action.worker_id == session.worker_id:
                ack = action
                break
        if ack is None:
            raise ServerError("the policy did not acknowledge the push")
        if self._metrics is not None:
            self._metrics.push(staleness=ack.staleness, received_bytes=frame.nbytes)
        if self._progress is not None:
            self._progress.observe(loss=meta.loss, staleness=ack.staleness)
        ack_meta = ack.to_wire()
        if frame.msg_type == MsgType.PUSH:
            held = self._loop.time() - arrived
            if held >= _HELD_REPORTED_S:
                # The acknowledgement says how long decoding and applying took.
                ack_meta = {**ack_meta, "held_s": held}
            session.protocol.send(
                encode_frame(MsgType.PUSH_ACK, frame.request_id, ack_meta)
            )
            self._carry_out(actions, pusher=session.worker_id, arrived=arrived)
        else:
            self._carry_out(actions, pusher=session.worker_id, arrived=arrived)
            entry = (frame.request_id, ack_meta)
            session.pulls.append(entry)
            try:
                self._pull(session)
            except HpsError as e:
                # The push stands; only the pull half failed: report that.
                if entry in session.pulls:
                    session.pulls.remove(entry)
                raise type(e)(f"update applied, pull failed: {e.message}") from e

    def _compile_decoder(self, codec) -> None:
        """Compiles ``codec``'s decoder off the loop, once; keeps it when done.

        Pushes are not held meanwhile: numpy decodes them (same values).
        """
        if codec in self._compiling:
            return
        self._compiling.add(codec)
        future = self._loop.run_in_executor(
            _COMPILER, self._call_on_device, self._decoders.compile, codec
        )
        future.add_done_callback(functools.partial(self._compiled, codec))

    def _compiled(self, codec, future) -> None:
        self._compiling.discard(codec)
        if self._closing or future.cancelled():
            return
        if future.exception() is None:
            self._decoders.put(codec, future.result())
        else:
            # Numpy keeps decoding this codec's pushes.
            logger.warning(
                "cannot compile a decoder for %s: %s", codec, future.exception()
            )

    def _decode_update(self, payload: WireTree) -> list[Any]:
        """The update's leaves, in the parameters' leaf order."""
        layout = payload.layout
        if layout.codec is None:
            # Received 64-byte aligned, so JAX takes them without a copy when the
            # core's compiled steps are called on them (cheaper than device_put
            # for small leaves, as fast for big ones).
            return payload.arrays
        return self._decoders.decoder(layout.wire)(payload.arrays)

    @_on_device
    def _on_filled(self, session: _Session, payload: WireTree, index: int) -> None:
        """Leaf ``index`` of a push is in: checked, and its apply started."""
        self._check_received(payload, index)
        if session.overlap is not None:
            session.overlap.add(index, payload.arrays[index])

    def _check_received(self, payload: WireTree, index: int) -> None:
        """Refuses a raw push as soon as a leaf holding NaN or infinity is in
        (a compressed one as soon as its codec refuses a part: see
        ``check_part`` of :class:`~hpsjax.wire._codecs.WireCodec`).

        Called by the decoder for each buffer once its bytes have arrived, so
        the check overlaps the transfer of the following ones.
        """
        layout = payload.layout
        if layout.wire is None:
            leaf, array = index, payload.arrays[index]
        else:
            # Every compressed leaf sends two arrays.
            leaf, part = divmod(index, 2)
            size = math.prod(layout.leaves[leaf].shape)
            array = layout.wire.check_part(
                payload.arrays[leaf], part, size, finite=self._check_finite
            )
            if array is None:
                return
        if not self._check_finite:
            return
        if array.dtype.kind not in "biu" and not np.isfinite(array).all():
            raise NonFiniteUpdate(
                f"leaf {self._model.paths()[leaf]} holds NaN or infinity"
            )

    def _require_finite(self, leaves: list[Any]) -> None:
        paths = None
        for i, (leaf, spec) in enumerate(zip(leaves, self._model.leaves, strict=True)):
            if spec.dtype.kind in "biu":
                continue
            if not np.isfinite(np.asarray(leaf)).all():
                paths = paths or self._model.paths()
                raise NonFiniteUpdate(f"leaf {paths[i]} holds NaN or infinity")

    # ---------------------------------------------------------- actions

    def _interpreter(self) -> ActionInterpreter:
        """The server's handler of every action the core returns."""
        ignore = ActionInterpreter.ignore
        return ActionInterpreter(
            {
                SendParams: self._on_send_params,
                # The push's own answer is sent by _push; a held pull waits
                # for its SendParams.
                PushAck: ignore,
                Wait: ignore,
                Release: ignore,
                ForcePull: self._on_force_pull,
                Drop: self._on_drop,
                Applied: self._on_applied,
                SaveCheckpoint: self._on_save,
                StartApply: self._on_start_apply,
                StageChanged: self._on_stage_changed,
                PlanChanged: self._send_plans,
            }
        )

    def _carry_out(
        self, actions, *, pusher: Any = None, arrived: float | None = None
    ) -> None:
        """Carries out the core's actions; ``pusher``, the worker whose push
        they answer, learns a forced pull and a stage change from its
        acknowledgement instead; ``arrived``: when that push arrived (a pull
        held before it waited for the others: ``barrier_s``). Subscribers get
        the newest version, and a checkpoint is handed on, once per call."""
        self._pusher, self._arrived = pusher, arrived
        self._applied = self._save_due = False
        self._interpret(actions)
        if self._applied:
            self._publish()
        if self._save_due:
            self._save_async()

    def _on_send_params(self, action: SendParams) -> None:
        session = self._sessions.get(action.worker_id)
        if session is None or not session.pulls:
            return
        request_id, ack_meta = session.pulls.popleft()
        extra = {"local_steps": action.local_steps}
        started = self._pull_started.pop((id(session), request_id), None)
        if started is not None:
            held = self._loop.time() - started
            if self._metrics is not None:
                self._metrics.barrier_wait(held)
            # An answer at once keeps the version's cached frame.
            if held >= _HELD_REPORTED_S:
                extra["held_s"] = held
                arrived = self._arrived
                waited = held if arrived is None else arrived - started
                if waited >= _HELD_REPORTED_S:
                    extra["barrier_s"] = min(waited, held)
        if ack_meta is not None:
            extra["ack"] = ack_meta
        self._send_params(session, request_id, extra)

    def _on_force_pull(self, action: ForcePull) -> None:
        if action.worker_id == self._pusher:
            return
        session = self._sessions.get(action.worker_id)
        if session is not None:
            self._notify(session, ForcePullNotice(action.reason))

    def _on_drop(self, action: Drop) -> None:
        session = self._sessions.get(action.worker_id)
        logger.info(
            "dropped worker %r: %s (%d live)",
            action.worker_id,
            action.reason,
            len(self._core.live),
        )
        if self._metrics is not None:
            self._metrics.worker_left("dropped")
        if session is not None:
            error = WorkerDropped(action.reason)
            self._fail_pulls(session, error)
            self._notify_error(session, error)

    def _on_applied(self, action: Applied) -> None:
        del action
        self._applied = True

    def _on_save(self, action: SaveCheckpoint) -> None:
        del action
        self._save_due = True

    def _on_start_apply(self, action: StartApply) -> None:
        session = self._sessions.get(action.worker_id)
        if session is not None:
            session.overlap = self._core.aggregator.start(action.plan)
            self._overlap_owner = session

    def _on_stage_changed(self, action: StageChanged) -> None:
        self._announce(StageNotice(action.stage), skip=self._sessions.get(self._pusher))

    def _notify(self, session: _Session, notice: Notice) -> None:
        if not session.protocol.closed:
            session.protocol.send(
                encode_frame(MsgType.NOTICE, 0, notice_to_wire(notice))
            )

    def _notify_error(self, session: _Session, error: HpsError) -> None:
        if not session.protocol.closed:
            session.protocol.send(error_frame(0, error))

    def _fail_pulls(self, session: _Session, error: HpsError) -> None:
        while session.pulls:
            request_id, _ = session.pulls.popleft()
            if not session.protocol.closed:
                session.protocol.send(error_frame(request_id, error))

    def _params_parts(self) -> tuple[list[PackedFields], list[memoryview]]:
        version = self._core.version
        if self._params_cache is None or self._params_cache[0] != version:
            # The model's description was checked once; its leaves are the
            # wire's in order, little-endian and contiguous (numpy views of
            # JAX's CPU buffers, no copy).
            buffers = leaf_buffers(
                [np.asarray(leaf) for leaf in jax.tree.leaves(self._core.params)]
            )
            fields = [
                self._params_description,
                pack_fields({"version": version}),
            ]
            self._params_cache = (version, fields, buffers)
        return self._params_cache[1], self._params_cache[2]

    def _params_frame(self, extra: dict[str, Any] | None) -> PreparedFrame:
        """The PARAMS frame of the current version with ``extra`` fields.

        A pull's answer adds nothing or only the policy's local-steps hint,
        which takes few values: each such frame is encoded once per version
        and every reply packs only its header.
        """
        fields, buffers = self._params_parts()
        steps = None if extra is None else extra.get("local_steps")
        if extra is not None and (
            len(extra) != 1
            or "local_steps" not in extra
            or not (steps is None or type(steps) is int)
        ):
            return prepare_frame(MsgType.PARAMS, [*fields, pack_fields(extra)], buffers)
        key = (extra is not None, steps)
        frames = self._params_frames
        if frames[0] != self._params_cache[0]:
            frames = self._params_frames = (self._params_cache[0], {})
        frame = frames[1].get(key)
        if frame is None:
            if extra is not None:
                fields = [*fields, pack_fields(extra)]
            if len(frames[1]) >= 256:
                frames[1].clear()
            frame = frames[1][key] = prepare_frame(MsgType.PARAMS, fields, buffers)
        return frame

    def _send_params(self, session: _Session, request_id: int, extra=None) -> None:
        if session.protocol.closed:
            return
        started = time.perf_counter()
        frame = self._params_frame(extra)
        session.protocol.send(frame.parts(request_id), frame.nbytes)
        if self._metrics is not None:
            self._metrics.served(
                time.perf_counter() - started,
                version=self._core.version,
                pull=bool(request_id),
            )
            if request_id:
                self._metrics.pull(sent_bytes=frame.nbytes)
            else:  # a subscriber's parameters
                self._metrics.transfer(sent_bytes=frame.nbytes)

    def _publish(self) -> None:
        for session in self._connections:
            if not session.subscribed or session.protocol.closed:
                continue
            if not session.protocol.paused:
                self._send_params(session, 0)
            else:
                # The worker is still reading earlier bytes: send it only the
                # newest parameters once it has caught up, never a backlog.
                session.sub_dirty = True
                if session.sub_task is None:
                    session.sub_task = self._loop.create_task(self._flush_sub(session))

    async def _flush_sub(self, session: _Session) -> None:
        try:
            while session.sub_dirty and not session.protocol.closed:
                await session.protocol.drain()
                session.sub_dirty = False
                if session.subscribed:
                    self._send_params(session, 0)
        except HpsError:
            pass
        finally:
            session.sub_task = None

    # ---------------------------------------------------------- leaving

    def _leave(self, session: _Session, why: str, detail: str = "") -> None:
        """The worker of ``session`` leaves, ``why`` being ``"done"`` (it said
        goodbye), ``"crashed"`` (its connection ended without one) or
        ``"replaced"`` (it connected again): logged with ``detail``, counted."""
        if (
            session.joined
            and self._sessions.get(session.worker_id) is session
            and session.worker_id in self._core.live  # not already dropped
        ):
            session.joined = False
            try:
                actions = self._core.handle(WorkerLeft(session.worker_id, self._now()))
            except HpsError:
                return
            logger.info(
                "worker %r left: %s%s (%d live)",
                session.worker_id,
                why,
                f", {detail}" if detail else "",
                len(self._core.live),
            )
            if self._metrics is not None:
                self._metrics.worker_left(why)
            self._carry_out(actions)

    @_on_device
    def _on_lost(self, session: _Session, error: HpsError) -> None:
        self._connections.discard(session)
        if session.handshake_timer is not None:
            session.handshake_timer.cancel()
        if session.sub_task is not None:
            session.sub_task.cancel()
        session.pulls.clear()
        if self._closing:
            return
        logger.debug("connection of %r ended: %s", session.worker_id, error)
        self._leave(
            session, "crashed", f"its connection ended without a goodbye ({error})"
        )
        if self._sessions.get(session.worker_id) is session:
            del self._sessions[session.worker_id]
        session.closed = True
        self._rearm()

    # ---------------------------------------------------------- timer

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closing or self._loop is None:
            return
        deadline = self._core.next_deadline()
        if deadline is not None:
            # A deadline the last tick left in place is not retried in a tight
            # loop: the clock must move on a little first.
            if deadline == self._last_tick_deadline:
                deadline = max(deadline, self._loop.time() + 1e-3)
            self._timer = self._loop.call_at(deadline, self._on_tick)

    @_on_device
    def _on_tick(self) -> None:
        self._timer = None
        self._last_tick_deadline = self._core.next_deadline()
        try:
            self._carry_out(self._core.handle(Tick(self._now())))
        except Exception:
            logger.exception("core tick failed")
        self._rearm()
