"""The asyncio parameter-server client.

A :class:`Client` is one worker's connection to a :class:`~hpsjax.ps.Server`. It
authenticates on connect (HMAC challenge-response, see PROTOCOL.md), then carries
any number of concurrent requests: every request gets its own request id and the
replies, which may arrive in any order, are matched to their callers by the
protocol's receive callback, so a ``pull()`` can be awaited while a ``push()`` on
the same connection is still in flight (PS+'s eager pull).

Errors never vanish: a failure of the connection (or of its stream) fails the
requests in flight and is raised by every later call; an error the server reports
unasked (for example :class:`~hpsjax.ps.WorkerDropped`) is raised by the next
call.

Cancellation and timeouts. Every awaitable takes ``timeout`` (seconds; ``None``
waits forever; the default is the client's ``timeout``), and can also be wrapped
in ``asyncio.timeout(...)``/``asyncio.wait_for``. A frame is handed to the
transport whole, so cancelling never leaves half a frame on the connection: a
cancelled request only stops waiting for its reply (a cancelled push that was
already sent may still be applied by the server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import ssl as ssl_lib
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

import jax
import msgpack

from hpsjax.net import _auth
from hpsjax.net._connection import FrameProtocol
from hpsjax.transforms import Codec, encode_tree
from hpsjax.wire import (
    DEFAULT_LIMITS,
    DTYPES,
    ConnectionClosed,
    ForcePullNotice,
    Frame,
    FrameError,
    HpsError,
    InfoMessage,
    MsgType,
    ParamsMeta,
    PlanNotice,
    ProtocolError,
    PushAck,
    PushMeta,
    StageNotice,
    Subscribe,
    TreeLayout,
    UnexpectedMessage,
    WireLimits,
    WireTree,
    WorkerDropped,
    encode_frame,
    encoded_tree_to_wire,
    error_from_wire,
    notice_from_wire,
    tree_layout,
    tree_to_wire,
    unflatten_tree,
)

__all__ = ["Client", "ServerInfo", "Subscription"]


@functools.partial(jax.jit, static_argnums=1)
def _encode_tree(tree, codec, key):
    """Encodes a push in one compiled program (one per tree structure/codec)."""
    return encode_tree(tree, codec, key)


def _error_of(frame: Frame) -> HpsError:
    meta = frame.metadata
    code, message = meta.get("code"), meta.get("message", "")
    if not isinstance(code, int) or not isinstance(message, str):
        return ProtocolError("malformed ERROR frame")
    return error_from_wire(code, message)


class ServerInfo(NamedTuple):
    """What the server told about itself on connect (or on ``refresh_info()``).

    Attributes:
      policy: the synchronisation policy's name.
      version: the parameter version at the time.
      stage: the policy's stage index (0 for single-stage policies).
      spec: the model: a pytree of ``jax.ShapeDtypeStruct``.
      layout: the model's wire layout (structure and leaf specs).
      limits: the server's frame limits, as a dict.
      synchronous: the policy holds every round for every live worker (BSP, a
        hybrid policy's sync stage); ``False`` when the server does not say.
    """

    policy: str
    version: int
    stage: int
    spec: Any
    layout: TreeLayout
    limits: dict[str, Any]
    synchronous: bool = False


def _server_info(meta: Mapping[str, Any]) -> ServerInfo:
    try:
        info = InfoMessage.from_wire(meta)
        spec_meta = info.spec
        leaves, offset = [], 0
        for entry in spec_meta["leaves"]:
            name, shape = entry
            dtype = DTYPES[name]
            nbytes = math.prod(shape) * dtype.itemsize
            leaves.append([name, list(shape), offset, nbytes])
            offset += nbytes
        layout = tree_layout(
            {"tree": spec_meta["tree"], "leaves": leaves, "codec": None}
        )
        spec = unflatten_tree(
            layout.structure,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves],
        )
        return ServerInfo(
            policy=info.policy,
            version=info.version,
            stage=info.stage,
            spec=spec,
            layout=layout,
            limits=info.limits,
            synchronous=info.synchronous,
        )
    except (KeyError, TypeError, ValueError, HpsError) as e:
        raise ProtocolError(f"malformed server info: {e}") from None


_UNSET: Any = object()


def _time_out(future: asyncio.Future, timeout: float) -> None:
    if not future.done():
        future.set_exception(TimeoutError(f"no reply within {timeout} s"))


@dataclasses.dataclass
class _Latest:
    params: Any = None
    version: int = -1
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def push_meta(meta: PushMeta | None, fields: Mapping[str, Any]) -> PushMeta:
    """A push's :class:`PushMeta`: ``meta`` as given, or made of ``fields``
    (keywords of :meth:`Client.push`), checked here so that a bad one fails the
    call with a one-line ``ValueError``, not the server.

    Examples:
      >>> push_meta(None, {"version": 3, "loss": 0.5})
      PushMeta(version=3, step_time=None, num_samples=None, local_steps=None, \
loss=0.5, stage=None)
      >>> push_meta(None, {"version": -1})
      Traceback (most recent call last):
      ...
      ValueError: malformed push metadata: Expected `int` >= 0 - at `$.version`
    """
    if meta is None:
        plain = {k: getattr(v, "item", lambda v=v: v)() for k, v in fields.items()}
        return PushMeta.from_wire(plain, error=ValueError)
    if fields:
        raise ValueError(f"give meta or its fields, not both: {', '.join(fields)}")
    if not isinstance(meta, PushMeta):
        raise ValueError(f"meta must be a PushMeta, got {type(meta).__name__}")
    return meta


class Subscription:
    """Parameters the server sends after every applied update (PHub-style).

    Holds only the newest parameters: a consumer slower than the server skips
    versions instead of queueing them. Use :attr:`latest` for a non-blocking
    read, or iterate::

        sub = await client.subscribe()
        async for params, version in sub:
            ...

    Iteration ends when the subscription or the client is closed; it raises the
    client's error if the connection failed.
    """

    def __init__(self, client: Client, slot: _Latest):
        self._client = client
        self._slot = slot
        self._seen = -1
        self._closed = False

    @property
    def latest(self) -> tuple[Any, int] | None:
        """``(params, version)`` last received, or ``None`` before the first."""
        if self._slot.version < 0:
            return None
        return self._slot.params, self._slot.version

    async def next(self, *, timeout: float | None = _UNSET) -> tuple[Any, int]:
        """Waits for parameters newer than the last ones returned.

        Cancelling is safe. ``timeout`` defaults to the client's.

        Returns:
          ``(params, version)``.

        Raises:
          TimeoutError: nothing newer within ``timeout``.
          ConnectionClosed: the subscription or client was closed.
        """
        timeout = self._client._timeout if timeout is _UNSET else timeout
        async with asyncio.timeout(timeout):
            while True:
                if self._client._error is not None:
                    raise self._client._error
                if self._closed:
                    raise ConnectionClosed("subscription closed")
                if self._slot.version > self._seen:
                    self._seen = self._slot.version
                    return self._slot.params, self._slot.version
                self._slot.changed.clear()
                await self._slot.changed.wait()

    def __aiter__(self) -> AsyncIterator[tuple[Any, int]]:
        return self._iterate()

    async def _iterate(self):
        while True:
            try:
                yield await self.next(timeout=None)
            except ConnectionClosed:
                if self._closed or self._client.closed:
                    return
                raise

    async def close(self, *, timeout: float | None = _UNSET) -> None:
        """Stops the server's sends. Safe to cancel; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._slot.changed.set()
        if not self._client.closed:
            await self._client._request(
                MsgType.SUBSCRIBE, Subscribe(on=False).to_wire(), timeout=timeout
            )
        self._client._subscription = None


class Client:
    """One worker's asyncio connection to a parameter server.

    Args:
      host: server address.
      port: server port.
      worker_id: this worker's name (``str`` or ``int``), unique among workers;
        connecting again under the same id replaces the old connection.
        ``None`` asks the server for one on the first connection (the lowest
        id free there, :attr:`worker_id` from then on), kept for reconnecting.
      secret: the shared secret (bytes or str), or ``None`` for a server that
        runs without authentication; it never crosses the wire.
      ssl: an ``ssl.SSLContext`` for TLS, or ``None``.
      server_hostname: the name to verify the server certificate against
        (defaults to ``host``).
      timeout: default timeout (s) of every call; ``None`` waits forever.
      limits: limits on frames received from the server.
      seed: seed of the PRNG used for stochastic rounding when the client
        compresses a push itself.

    Examples:
      A worker loop (``grad_fn`` computes a gradient)::

        async with Client("127.0.0.1", port, worker_id="w0", secret=key) as c:
            params, version = await c.pull()
            for batch in batches:
                ack, params, version = await c.push_pull(
                    grad_fn(params, batch), version=version)

    References:
      Jin, Xu, Guo, Hu, Yeung, "PS+: A Simple yet Effective Framework for Fast
      Training on Parameter Server", IEEE TPDS 33(12), 2022,
      https://doi.org/10.1109/TPDS.2022.3200518 (eager pulls beside pushes).

      Luo, Nelson, Ceze, Phanishayee, Krishnamurthy, "Parameter Hub: a
      Rack-Scale Parameter Server for Distributed Deep Neural Network Training",
      SoCC 2018, https://arxiv.org/abs/1801.09805 (subscriptions).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        worker_id: str | int | None,
        secret: bytes | str | None,
        ssl: ssl_lib.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float | None = 60.0,
        limits: WireLimits = DEFAULT_LIMITS,
        seed: int | None = None,
    ):
        if worker_id is not None:
            _auth.check_worker_id(worker_id)
        if ssl is not None and not isinstance(ssl, ssl_lib.SSLContext):
            raise ValueError("ssl must be an ssl.SSLContext or None")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive or None, got {timeout!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"bad port {port!r}")
        self._host = host
        self._port = port
        self._worker_id = worker_id
        self._secret = _auth.secret_bytes(secret)
        # Sent on every connection: the server takes a new one under this id
        # for a reconnect, not for a second worker.
        self._instance = os.urandom(16)
        self._ssl = ssl
        self._server_hostname = server_hostname
        self._timeout = timeout
        self._limits = limits
        self._seed = seed
        self._key = None
        self._protocol: FrameProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._error: HpsError | None = None
        self._unsolicited_error: HpsError | None = None
        self._info: ServerInfo | None = None
        self._subscription: Subscription | None = None
        self._latest = None
        self._local_steps: int | None = None
        self._held_s = 0.0
        self._barrier_s = 0.0
        self._plan: PlanNotice | None = None
        self._stage: int | None = None
        self._force_pull: ForcePullNotice | None = None

    # ----------------------------------------------------------- properties

    @property
    def worker_id(self) -> str | int | None:
        """This worker's id (``None`` until the server assigned the one asked
        for)."""
        return self._worker_id

    @property
    def info(self) -> ServerInfo:
        """What the server reported on connect (see :meth:`refresh_info`)."""
        if self._info is None:
            raise ConnectionClosed("not connected")
        return self._info

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (or was never opened)."""
        return self._protocol is None or self._protocol.closed

    @property
    def local_steps(self) -> int | None:
        """The server's latest local-steps hint (steps before the next push)."""
        return self._local_steps

    @property
    def held_s(self) -> float:
        """Seconds the server held its last answer to a pull or push after the
        request arrived (a barrier, an apply), as it said; 0 when it did not."""
        return self._held_s

    @property
    def barrier_s(self) -> float:
        """Of :attr:`held_s`, the seconds the answer waited for other
        workers' pushes (a barrier), as the server said; 0 when it did not."""
        return self._barrier_s

    @property
    def plan(self) -> PlanNotice | None:
        """The latest work plan the server sent (see ``Server.send_plan``)."""
        return self._plan

    @property
    def stage(self) -> int:
        """The server policy's stage, as last heard (INFO, notices, acks)."""
        if self._stage is not None:
            return self._stage
        return self._info.stage if self._info is not None else 0

    @property
    def force_pull(self) -> ForcePullNotice | None:
        """The server's request to discard local work and pull, until fresh
        parameters arrive; else ``None``."""
        return self._force_pull

    @property
    def bytes_sent(self) -> int:
        """Bytes written on the current connection."""
        return self._protocol.bytes_sent if self._protocol else 0

    @property
    def bytes_received(self) -> int:
        """Bytes read on the current connection."""
        return self._protocol.bytes_received if self._protocol else 0

    # ----------------------------------------------------------- lifecycle

    async def connect(self, *, timeout: float | None = _UNSET) -> ServerInfo:
        """Opens the connection and authenticates (mutually).

        Connecting again after a close or a failure starts a new connection.
        Cancelling is safe: a half-open connection is closed.

        Args:
          timeout: seconds for connecting and the handshake (default: the
            client's).

        Returns:
          The :class:`ServerInfo`.

        Raises:
          AuthError: wrong secret, or the server failed to prove it knows it.
          ConnectionClosed, OSError: the server cannot be reached.
          TimeoutError: no answer within ``timeout``.
        """
        timeout = self._timeout if timeout is _UNSET else timeout
        if self._protocol is not None and not self._protocol.closed:
            raise RuntimeError("already connected")
        self._reset()
        self._generation += 1
        generation = self._generation

        # Callbacks of an earlier connection (a late connection_lost) must not
        # touch the state of this one.
        def on_frame(event):
            if generation == self._generation:
                self._on_frame(event)

        def on_lost(error):
            if generation == self._generation:
                self._on_lost(error)

        loop = self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, protocol = await loop.create_connection(
                    lambda: FrameProtocol(on_frame, on_lost, limits=self._limits),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=(
                        (self._server_hostname or self._host) if self._ssl else None
                    ),
                )
                self._protocol = protocol
                self._info = await self._handshake()
        except BaseException:
            if self._protocol is not None:
                self._protocol.abort()
            raise
        return self._info

    def _reset(self) -> None:
        self._pending = {}
        self._error = None
        self._unsolicited_error = None
        self._info = None
        self._subscription = None
        self._latest = None
        self._local_steps = None
        self._plan = None
        self._stage = None
        self._force_pull = None

    async def _handshake(self) -> ServerInfo:
        handshake = _auth.Handshake.client(
            self._secret, self._worker_id, self._instance
        )
        step = handshake.hello()
        while step is not None:
            reply = await self._request(*step, timeout=None, expect=handshake.expects)
            step = handshake.receive(reply.msg_type, reply.metadata)
        # An id the server assigned (none asked for) is this client's from now on.
        self._worker_id = handshake.worker_id
        return _server_info(reply.metadata.get("info", {}))

    async def close(self, *, timeout: float | None = 5.0) -> None:
        """Says goodbye and closes the connection; idempotent.

        Requests still in flight fail with ConnectionClosed. Never raises for a
        server that is gone or stalled: after ``timeout`` seconds of waiting for
        queued frames to be written, the connection is aborted. Cancelling is
        safe (the connection is then aborted).

        Args:
          timeout: seconds to wait for queued frames to be written.
        """
        protocol = self._protocol
        if protocol is None or protocol.closed:
            return
        try:
            protocol.send(encode_frame(MsgType.BYE, 0, {"reason": "client closing"}))
            async with asyncio.timeout(timeout):
                await protocol.drain()
        except (HpsError, TimeoutError):
            protocol.abort()
        except asyncio.CancelledError:
            protocol.abort()
            raise
        else:
            protocol.close()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ requests

    async def pull(self, *, timeout: float | None = _UNSET) -> tuple[Any, int]:
        """Gets the current parameters.

        The first pull joins the worker to the server's live set. Under a
        synchronising policy (BSP, SSP) the answer waits until the policy lets
        this worker proceed. May be awaited while a push is in flight.
        Cancelling is safe (the reply is discarded when it comes).

        Args:
          timeout: seconds to wait (default: the client's).

        Returns:
          ``(params, version)``: a pytree of numpy arrays owned by the caller
          (their memory serves a later pull only once they are all dropped)
          and its version.
        """
        frame = await self._request(
            MsgType.PULL, {}, timeout=timeout, expect=MsgType.PARAMS
        )
        return self._params_of(frame)

    async def push(
        self,
        update: Any = None,
        meta: PushMeta | None = None,
        *,
        codec: Any = None,
        encoded: Any = None,
        timeout: float | None = _UNSET,
        **fields: Any,
    ) -> PushAck:
        """Sends an update, with what the push says about it (``meta``).

        ``meta`` is a :class:`~hpsjax.ps.PushMeta` (the worker core's push
        carries one; the server checks it on arrival), or its fields are given
        as keywords, ``push(update, version=v, loss=0.3)``, checked here.

        Three forms of the update: ``push(update, version=v)`` sends raw leaves;
        ``push(update, version=v, codec=c)`` quantizes them here (no error
        feedback); ``push(version=v, codec=c, encoded=e)`` sends the packed
        bytes of an already encoded tree (the ``encoded`` kept by
        ``hpsjax.quantize``, whose error feedback is then applied exactly once,
        on this worker), with ``codec="topk"`` the entries kept by
        ``hpsjax.top_k``, with ``codec="powersgd"`` the factors of
        ``hpsjax.power_sgd``. The update's arrays are referenced, not copied,
        until written: do not modify them before this returns.

        Cancelling is safe for the connection, but a push already handed to the
        transport may still be applied by the server.

        Args:
          update: pytree of the model's structure, shapes and dtypes.
          meta: the push's :class:`~hpsjax.ps.PushMeta`: the version the update
            was computed on, its compute seconds (for adaptive deadlines), its
            samples (for weighted averaging), its local steps, the worker's
            latest loss (for staged policies) and its staged optimizer's stage
            (ASHL).
          codec: a ``hpsjax.transforms.Codec`` for a compressed push, or
            ``"topk"`` or ``"powersgd"`` with ``encoded``.
          encoded: the encoded leaves in leaf order (requires ``codec``): the
            ``Encoded`` returned by ``encode_tree`` or ``last_encoded(opt_state)``,
            the ``TopKEncoded`` by ``last_topk_encoded(opt_state)`` or the
            ``PowerSGDEncoded`` by ``last_powersgd_encoded(opt_state)``.
          timeout: seconds to wait (default: the client's).
          **fields: instead of ``meta``, its fields (``version=`` at least).

        Returns:
          The :class:`~hpsjax.ps.PushAck`.

        Raises:
          ValueError: a bad field (given as a keyword), or ``meta`` and fields.
          InvalidUpdate: the server refused the update (shape, dtype, NaN); its
            parameters are unchanged.
          SpecMismatch: ``encoded`` does not fit the model (leaf count, sizes,
            dtypes, ranks); nothing was sent.
          WorkerDropped: this worker was dropped; pull to rejoin.
        """
        meta, buffers = self._push_message(
            update, push_meta(meta, fields), codec=codec, encoded=encoded
        )
        frame = await self._request(
            MsgType.PUSH, meta, buffers, timeout=timeout, expect=MsgType.PUSH_ACK
        )
        self._note_held(frame.metadata)
        return self._note_ack(frame.metadata)

    async def push_pull(
        self,
        update: Any = None,
        meta: PushMeta | None = None,
        *,
        codec: Any = None,
        encoded: Any = None,
        timeout: float | None = _UNSET,
        **fields: Any,
    ) -> tuple[PushAck, Any, int]:
        """Pushes an update and pulls the parameters in one round trip.

        Arguments, cancellation and errors are those of :meth:`push`; the reply
        comes when the policy lets this worker proceed (as for :meth:`pull`).

        Returns:
          ``(result, params, version)``.
        """
        meta, buffers = self._push_message(
            update, push_meta(meta, fields), codec=codec, encoded=encoded
        )
        frame = await self._request(
            MsgType.PUSH_PULL, meta, buffers, timeout=timeout, expect=MsgType.PARAMS
        )
        meta = ParamsMeta.from_wire(frame.metadata, ProtocolError)
        result = self._note_ack(meta.ack)
        params, new_version = self._params_of(frame)
        return result, params, new_version

    async def subscribe(self, *, timeout: float | None = _UNSET) -> Subscription:
        """Asks the server to send the parameters after every applied update.

        The current parameters come at once. Subscribing does not join the
        worker (pull does). Cancelling is safe.

        Returns:
          The :class:`Subscription` (one per connection; subscribing again
          returns the same one).
        """
        if self._subscription is not None:
            return self._subscription
        slot = _Latest()
        self._latest = slot
        await self._request(
            MsgType.SUBSCRIBE,
            Subscribe(on=True).to_wire(),
            timeout=timeout,
            expect=MsgType.SUBSCRIBE,
        )
        self._subscription = Subscription(self, slot)
        return self._subscription

    async def refresh_info(self, *, timeout: float | None = _UNSET) -> ServerInfo:
        """Asks the server for its current :class:`ServerInfo`. Safe to cancel."""
        frame = await self._request(
            MsgType.INFO, {}, timeout=timeout, expect=MsgType.INFO
        )
        self._info = _server_info(frame.metadata)
        return self._info

    # ------------------------------------------------------------ internals

    def _push_message(self, update, fields: PushMeta, *, codec, encoded):
        if encoded is not None:
            if codec is None:
                raise ValueError("encoded= needs the codec it was encoded with")
            like = update if update is not None else self.info.spec
            meta, buffers, _ = encoded_tree_to_wire(
                encoded, like, codec, limits=self._limits
            )
        elif update is None:
            raise ValueError("push needs an update (or encoded= and codec=)")
        elif codec is not None:
            if not isinstance(codec, Codec):
                raise ValueError(
                    f"codec={codec!r} sends encoded= leaves (last_topk_encoded, "
                    "last_powersgd_encoded); only a Codec is encoded here"
                )
            if self._key is None:
                seed = self._seed
                if seed is None:
                    # Stable across processes, unlike hash() of a str.
                    seed = zlib.crc32(msgpack.packb(self._worker_id))
                self._key = jax.random.key(seed % 2**32)
            self._key, key = jax.random.split(self._key)
            encoded = _encode_tree(update, codec, key)
            meta, buffers, _ = encoded_tree_to_wire(
                encoded, update, codec, limits=self._limits
            )
        else:
            meta, buffers, _ = tree_to_wire(update, limits=self._limits)
        meta.update(fields.to_wire())
        return meta, buffers

    def _params_of(self, frame: Frame) -> tuple[Any, int]:
        meta = ParamsMeta.from_wire(frame.metadata, ProtocolError)
        if not isinstance(frame.payload, WireTree):
            raise ProtocolError("malformed PARAMS frame")
        if frame.payload.layout.codec is not None:
            raise ProtocolError("compressed PARAMS are not supported")
        if meta.local_steps is not None:
            self._local_steps = meta.local_steps
        self._held_s, self._barrier_s = meta.held_s or 0.0, meta.barrier_s or 0.0
        # Fresh parameters are what a forced pull asked for.
        self._force_pull = None
        return frame.payload.tree(), meta.version

    def _note_held(self, meta: Mapping[str, Any]) -> None:
        """Notes the seconds the server says it held an answer (0 if it does
        not say, or says something else than a positive number)."""
        held, barrier = meta.get("held_s"), meta.get("barrier_s")
        self._held_s, self._barrier_s = (
            float(x)
            if isinstance(x, int | float) and not isinstance(x, bool) and x > 0
            else 0.0
            for x in (held, barrier)
        )

    def _note_ack(self, meta: Any) -> PushAck:
        """The acknowledgement, validated (once, here); its hints noted."""
        ack = PushAck.from_wire(meta, self._worker_id)
        if ack.local_steps is not None:
            self._local_steps = ack.local_steps
        if ack.force_pull:
            self._force_pull = ForcePullNotice(ack.reason or "requested by the server")
        if ack.stage is not None:
            self._stage = ack.stage
        return ack

    def _raise_pending_error(self) -> None:
        if self._unsolicited_error is not None:
            error, self._unsolicited_error = self._unsolicited_error, None
            raise error
        if self._error is not None:
            raise self._error
        if self._protocol is None:
            raise ConnectionClosed("not connected")

    async def _request(
        self,
        msg_type: MsgType,
        meta: dict[str, Any],
        buffers=(),
        *,
        timeout: float | None = _UNSET,
        expect: MsgType | None = None,
    ) -> Frame:
        timeout = self._timeout if timeout is _UNSET else timeout
        self._raise_pending_error()
        protocol = self._protocol
        self._next_id = self._next_id % (2**32 - 1) + 1
        request_id = self._next_id
        # The connection's loop (asking for the running one costs a syscall).
        loop = self._loop
        future = loop.create_future()
        self._pending[request_id] = future
        try:
            protocol.send(encode_frame(msg_type, request_id, meta, buffers))
            # The future holds the frame in a box that is emptied here: the
            # loop may keep the finished future (and what it holds) alive for
            # a while, and a frame pins its receive buffer.
            if protocol.paused:
                async with asyncio.timeout(timeout):
                    await protocol.drain()
                    frame = (await future).pop()
            elif timeout is None:
                frame = (await future).pop()
            else:
                # Nothing to drain: a timer failing the future bounds the wait
                # at a fraction of asyncio.timeout's cost per request.
                timer = loop.call_later(timeout, _time_out, future, timeout)
                try:
                    frame = (await future).pop()
                finally:
                    timer.cancel()
        finally:
            self._pending.pop(request_id, None)
        if expect is not None and frame.msg_type != expect:
            raise UnexpectedMessage(
                f"expected {expect.name} in reply to {msg_type.name}, got "
                f"{frame.msg_type.name}"
            )
        return frame

    def _on_frame(self, event: Frame | FrameError) -> None:
        if isinstance(event, FrameError):
            # A reply this side refused (over a limit, malformed): fail its
            # request; unasked frames that fail are reported on the next call.
            future = self._pending.pop(event.request_id, None)
            if future is not None and not future.done():
                future.set_exception(event.error)
            elif event.request_id == 0:
                self._unsolicited_error = event.error
            return
        if event.request_id == 0:
            self._on_unsolicited(event)
            return
        future = self._pending.pop(event.request_id, None)
        if future is None or future.done():
            return  # the caller gave up (cancelled or timed out)
        if event.msg_type == MsgType.ERROR:
            error = _error_of(event)
            if error.code == WorkerDropped.code and isinstance(
                self._unsolicited_error, WorkerDropped
            ):
                # The drop's notice came first and this reply says the same
                # (a push sent meanwhile): raised once, not again by the pull
                # that rejoins.
                self._unsolicited_error = None
            future.set_exception(error)
        else:
            future.set_result([event])

    def _on_unsolicited(self, frame: Frame) -> None:
        if frame.msg_type == MsgType.PARAMS:
            slot = self._latest
            try:
                version = ParamsMeta.from_wire(frame.metadata).version
            except HpsError:
                return
            if slot is None:
                return
            if version > slot.version and isinstance(frame.payload, WireTree):
                slot.params = frame.payload.tree()
                slot.version = version
                slot.changed.set()
        elif frame.msg_type == MsgType.NOTICE:
            try:
                notice = notice_from_wire(frame.metadata)
            except HpsError as error:
                self._unsolicited_error = error
                return
            if isinstance(notice, PlanNotice):
                if self._plan is None or notice.revision > self._plan.revision:
                    self._plan = notice
            elif isinstance(notice, StageNotice):
                self._stage = notice.stage
            else:
                self._force_pull = notice
        elif frame.msg_type == MsgType.ERROR:
            # Requests in flight get their own replies; this notice (e.g. the
            # worker was dropped) is raised by the next call.
            self._unsolicited_error = _error_of(frame)
        elif frame.msg_type == MsgType.BYE:
            self._error = ConnectionClosed(
                f"server said goodbye: {frame.metadata.get('reason', '')}"[:200]
            )
        else:
            self._protocol.fail(
                UnexpectedMessage(f"unexpected unasked {frame.msg_type.name}")
            )

    def _on_lost(self, error: HpsError) -> None:
        if self._error is None or not isinstance(error, ConnectionClosed):
            self._error = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._error)
        self._pending.clear()
        if self._latest is not None:
            self._latest.changed.set()
