"""The asyncio parameter server: moves bytes, and lets ``ServerCore`` decide.

:class:`Server` accepts worker connections, authenticates them, reads frames into
preallocated arrays (see :mod:`hpsjax.wire._stream`) and turns every complete,
validated request into an event of :class:`~hpsjax.ps.ServerCore`: the first
``PULL`` of a connection joins its worker, ``PULL`` pulls, ``PUSH`` pushes, a
closed connection leaves, and a timer ticks the core at ``core.next_deadline()``.
It then carries out the actions the core returns (send parameters, acknowledge,
notify, drop, start an apply, save) on the right connections, through the
:class:`~hpsjax.decisions.ActionInterpreter` the simulator shares. All decisions
(versions, staleness, who waits, what is applied, deadlines) are the core's.
:class:`Server` is composed of its parts, each its own module: connections
(:mod:`~hpsjax.net._session`), pushes (``_server_pushes``), actions
(``_server_actions``) and checkpoints (``_server_checkpoints``).

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
import concurrent.futures
import contextlib
import logging
import math
import os
import ssl as ssl_lib
from collections.abc import Mapping
from typing import Any

import jax
import optax

from hpsjax._checks import check_int, check_number, check_positive
from hpsjax._devices import describe_device, resolve_device
from hpsjax._logs import Every
from hpsjax._progress import Progress
from hpsjax.apply import OverlapAggregator
from hpsjax.decisions import (
    DEFAULT_POLICY,
    ReplannerProtocol,
    ServerCore,
    StageSet,
    Tick,
    WorkerPulled,
)
from hpsjax.net import _auth
from hpsjax.net._connection import error_frame
from hpsjax.net._server_actions import ServerActions
from hpsjax.net._server_checkpoints import ServerCheckpoints
from hpsjax.net._server_pushes import ServerPushes
from hpsjax.net._session import (
    ServerSessions,
    Session,
    is_loopback,
    live_workers,
    on_device,
    plan_hint,
)
from hpsjax.storage import CheckpointManager
from hpsjax.wire import (
    DEFAULT_LIMITS,
    BufferPool,
    DecoderCache,
    Frame,
    FrameError,
    HpsError,
    LayoutCache,
    MsgType,
    PlanNotice,
    PreparedFrame,
    ProtocolError,
    ShuttingDown,
    Subscribe,
    Subscribed,
    UnexpectedMessage,
    WireLimits,
    check_same_spec,
    encode_frame,
    flatten_tree,
    pack_fields,
    tree_to_wire,
)

__all__ = ["Server", "is_loopback"]

logger = logging.getLogger(__name__)


# Least seconds between two "checkpoint written" lines at INFO (the others
# at DEBUG), and between two lines about refused non-finite updates.
_CHECKPOINT_LOG_EVERY_S = 60.0
_NONFINITE_LOG_EVERY_S = 10.0

# What a client's BYE says when it simply ends its run.
_CLEAN_BYE = "client closing"

# Frames a client may send under request id 0: they expect no reply.
_NOTICE_TYPES = frozenset({MsgType.ERROR, MsgType.BYE})


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


class Server(ServerSessions, ServerPushes, ServerActions, ServerCheckpoints):
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
                checkpoint_every_s=checkpoint_every_s,
                **({"check_result": bool(check_finite)} | dict(core_kwargs or {})),
            )
        self._host = host
        self._requested_port = port
        self._ssl = ssl
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._check_finite = bool(check_finite)
        # The session whose push is being applied as it arrives, if any.
        self._overlap_owner: Session | None = None
        # Pushes at least this big are applied as they arrive (math.inf: none).
        self._overlap_min_bytes = (
            math.inf if overlap_apply_bytes is None else overlap_apply_bytes
        )
        self._checkpoint_dir = checkpoint_dir
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
        self._sessions: dict[Any, Session] = {}
        # Ids assigned to workers that asked for one: never handed out again.
        self._assigned_ids: set[int] = set()
        self._plans: dict[Any, PlanNotice] = {}
        if replanner is not None:
            work_plan = replanner.plan
            for entry in work_plan.workers:
                self._plans[entry.worker_id] = plan_hint(entry, work_plan.revision)
        self._connections: set[Session] = set()
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

    @on_device
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

    @on_device
    def set_stage(self, index: int) -> None:
        """Moves a staged policy (``"hybrid"``) to stage ``index``.

        Workers learn of it through a stage NOTICE and the new local-steps hints.

        Raises:
          ValueError: the policy has no such stage (nothing changes).
        """
        self._carry_out(self._core.handle(StageSet(index, self._now())))
        self._rearm()

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

    # ---------------------------------------------------------- checkpoints

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
                notes=(f"{rate:.1f} pushes/s", live_workers(len(self._core.live))),
            )
            if shown is not None:
                pushes, t = self._pushes, now
            if self._metrics is not None and now - scalars_at >= self._status_interval:
                scalars_at = now
                self._metrics.write_scalars(self._scalar_state())

    # ---------------------------------------------------------- connections

    def _now(self) -> float:
        return self._loop.time()

    @on_device
    def _on_event(self, session: Session, event: Frame | FrameError) -> None:
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

    # ---------------------------------------------------------- handshake

    # ---------------------------------------------------------- requests

    def _request(self, session: Session, frame: Frame) -> None:
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

    def _pull(self, session: Session) -> None:
        # A connection's first pull, or a dropped worker's, joins it: the
        # core says so (Joined, carried out by _on_joined).
        self._carry_out(
            self._core.handle(WorkerPulled(session.worker_id, self._now(), True))
        )

    # ---------------------------------------------------------- actions

    # ---------------------------------------------------------- leaving

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

    @on_device
    def _on_tick(self) -> None:
        self._timer = None
        self._last_tick_deadline = self._core.next_deadline()
        try:
            self._carry_out(self._core.handle(Tick(self._now())))
        except Exception:
            logger.exception("core tick failed")
        self._rearm()
