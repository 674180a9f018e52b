r"""Server shards: a model split by key range over several parameter servers.

A model too big for one server is split across several server processes, each
holding one contiguous **key range** of the parameters (ps-lite's server groups;
PHub's chunking of the model over its aggregators):

* :class:`ShardedClient` has the interface of :class:`~hpsjax.ps.Client` that
  the worker runtime uses (``connect``, ``close``, ``pull``, ``push``,
  ``push_pull``, ``local_steps``, ``plan``, ``bytes_sent``, ...). It keeps one
  :class:`~hpsjax.ps.Client` per shard and sends each request to every shard
  concurrently, with each shard's part of the update.

The partition itself is :class:`~hpsjax.ps.KeyRangePartition` (its own module,
:mod:`hpsjax.net._partition`).

**Versions.** Every shard runs its own :class:`~hpsjax.ps.ServerCore` and counts
its own version. Every push goes to every shard, so the counts move together,
but they need not be equal at any instant. A sharded pull returns a
:class:`ShardedVersion`: an ``int`` worth the *lowest* shard version (the version
every shard has reached, which is what ``until_version`` and the worker's
staleness estimate :math:`\hat\tau = V_\text{known} - v` then use), carrying the
per-shard versions in :attr:`ShardedVersion.shards`. Passing it back to
:meth:`ShardedClient.push` tells each shard the version *it* served. A plain
``int`` means that version on every shard.

**Acknowledgements.** A sharded push's :class:`~hpsjax.ps.PushAck` combines the
shards' answers: its staleness is the **maximum** over shards (the update is as
stale as its stalest part, the conservative choice for PS+ step-size
modulation), its weight the minimum; it is ``"dropped"`` when any shard dropped
its part, ``"applied"`` when every shard applied it, else ``"buffered"``; it
asks to pull fresh parameters when any shard does. The per-shard answers are in
``shards``; its ``stage`` is shard 0's. The local-steps hint
(:attr:`ShardedClient.local_steps`) is the fewest any shard asks for; the plan
and stage are those of shard 0, the *lead shard*: give a work plan
(``hpsjax-server --work_plan``) to shard 0 only.

**Failures.** A request fails as soon as one shard fails: the other shards'
requests are cancelled (so a dead shard never leaves the call hanging on the
others), and the error raised is the failing shard's, of the same class (so
``except WorkerDropped`` or ``except ShuttingDown`` still work), with its message
naming the shard and what the other shards did. It carries two attributes:
``shard_index`` (the failing shard) and ``shard_results`` (a dict from the index
of each shard that completed the request to its result: a push that failed on
shard 1 may have been applied on shard 0). Other shards' requests cancelled
after being sent may still have been applied, as with a cancelled
:meth:`Client.push <hpsjax.ps.Client.push>`.

References:
  Li, Andersen, Park, Smola, Ahmed, Josifovski, Long, Shekita, Su, "Scaling
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
import msgspec

from hpsjax._checks import check_int
from hpsjax.net._client import Client, ServerInfo, push_meta
from hpsjax.net._partition import KeyRangePartition
from hpsjax.wire import (
    ForcePullNotice,
    HpsError,
    PlanNotice,
    PushAck,
    PushMeta,
    SpecMismatch,
)

__all__ = [
    "ShardedClient",
    "ShardedVersion",
]


class ShardedVersion(int):
    """The version of parameters pulled from several shards.

    Worth, as an ``int``, the lowest shard version: the version every shard
    has reached. :attr:`shards` holds each shard's own version, which
    :meth:`ShardedClient.push` sends back to each shard.

    Examples:
      >>> v = ShardedVersion((7, 6))
      >>> int(v), v.shards, v >= 6
      (6, (7, 6), True)
    """

    def __new__(cls, shards: Sequence[int]) -> ShardedVersion:
        versions = tuple(int(v) for v in shards)
        if not versions or any(v < 0 for v in versions):
            raise ValueError(f"shard versions must be >= 0, got {shards!r}")
        self = super().__new__(cls, min(versions))
        self.__dict__["_shards"] = versions
        return self

    @property
    def shards(self) -> tuple[int, ...]:
        """Each shard's version, in shard order."""
        return self.__dict__["_shards"]

    def __repr__(self) -> str:
        return f"ShardedVersion({self.shards})"

    def __reduce__(self):
        return ShardedVersion, (self.shards,)


def _combine(results: Sequence[PushAck]) -> PushAck:
    statuses = {r.status for r in results}
    if "dropped" in statuses:
        status = "dropped"
    elif statuses == {"applied"}:
        status = "applied"
    else:
        status = "buffered"
    hinted = [r.local_steps for r in results if r.local_steps is not None]
    reasons = [f"shard {i}: {r.reason}" for i, r in enumerate(results) if r.reason]
    return PushAck(
        worker_id=results[0].worker_id,
        version=ShardedVersion([r.version for r in results]),
        staleness=max(r.staleness for r in results),
        status=status,
        weight=min(r.weight for r in results),
        local_steps=min(hinted) if hinted else None,
        reason="; ".join(reasons) if reasons else None,
        force_pull=any(r.force_pull for r in results),
        stage=results[0].stage,
        shards=tuple(results),
    )


# ------------------------------------------------------------------ client

_UNSET: Any = object()


def _tagged(error: BaseException, prefix: str, results: dict[int, Any]):
    """A copy of ``error`` (same class) whose message starts with ``prefix``."""
    # A copy, not the error itself: a client raises the same stored error
    # object on every call after its connection failed.
    try:
        tagged = copy.copy(error)
    except Exception:
        tagged = HpsError(f"{prefix}: {type(error).__name__}: {error}")
    else:
        if isinstance(tagged, HpsError):
            tagged.message = f"{prefix}: {tagged.message or type(tagged).__name__}"
            tagged.args = (tagged.message,)
        elif isinstance(tagged, OSError) and tagged.strerror is not None:
            tagged.strerror = f"{prefix}: {tagged.strerror}"
        else:
            tagged.args = (f"{prefix}: {error}",)
    tagged.shard_results = results
    return tagged


class ShardedClient:
    """A worker's connections to a model split over several server shards.

    The interface of :class:`~hpsjax.ps.Client` that
    :class:`hpsjax.worker.Worker` uses (pass it as ``Worker(client=...)``),
    over one :class:`~hpsjax.ps.Client` per shard. Every call goes to all
    shards at once (``asyncio``), each with its part of the update, and the
    answers are merged: parameters by :meth:`KeyRangePartition.merge`,
    versions into a :class:`ShardedVersion`, acknowledgements into a
    :class:`~hpsjax.ps.PushAck` (see the module docstring for how staleness,
    status and hints combine, and for how a failing shard is reported).

    Args:
      addresses: ``(host, port)`` of each shard's server, in shard order.
      partition: the :class:`KeyRangePartition` the servers were started with;
        ``connect`` checks each server's model against its shard.
      worker_id: this worker's id (the same on every shard).
      secret: the shared secret, or ``None``.
      seed: seed of the stochastic rounding of pushes the clients compress;
        shard ``i`` uses ``seed + i``.
      **client_kwargs: the other arguments of :class:`~hpsjax.ps.Client`
        (``ssl``, ``server_hostname``, ``timeout``, ``limits``), the same for
        every shard.

    Cancellation and timeouts are those of :class:`~hpsjax.ps.Client`: every
    call takes ``timeout`` (default: the clients'), which bounds each shard's
    request; cancelling a call cancels every shard's request.

    Examples:
      Two shards::

        partition = KeyRangePartition.from_tree(params, 2)
        servers = [Server(part, optax.sgd(0.1), "asp") for part in
                   partition.split(params)]
        ...
        async with ShardedClient([("hostA", 5555), ("hostB", 5555)],
                                 partition, worker_id="w0", secret=key) as c:
            params, version = await c.pull()
            ack = await c.push(grads, version=version)

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter
      Server", OSDI 2014,
      https://www.usenix.org/conference/osdi14/technical-sessions/presentation/li_mu

      Luo et al., "Parameter Hub: a Rack-Scale Parameter Server for Distributed
      Deep Neural Network Training", SoCC 2018, https://arxiv.org/abs/1801.09805
    """

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        partition: KeyRangePartition,
        *,
        worker_id: str | int,
        secret: bytes | str | None,
        seed: int | None = None,
        **client_kwargs: Any,
    ):
        if not isinstance(partition, KeyRangePartition):
            raise ValueError(
                f"partition must be a KeyRangePartition, got {type(partition).__name__}"
            )
        addresses = [tuple(a) for a in addresses]
        if len(addresses) != partition.num_shards:
            raise ValueError(
                f"{len(addresses)} server addresses for a partition of "
                f"{partition.num_shards} shards"
            )
        for address in addresses:
            if len(address) != 2:
                raise ValueError(f"an address is (host, port), got {address!r}")
        self._partition = partition
        self._addresses = [(str(h), int(p)) for h, p in addresses]
        self._clients = [
            Client(
                host,
                port,
                worker_id=worker_id,
                secret=secret,
                seed=None if seed is None else seed + i,
                **client_kwargs,
            )
            for i, (host, port) in enumerate(self._addresses)
        ]

    # ----------------------------------------------------------- properties

    @property
    def partition(self) -> KeyRangePartition:
        """The key-range partition."""
        return self._partition

    @property
    def clients(self) -> tuple[Client, ...]:
        """The per-shard clients, in shard order."""
        return tuple(self._clients)

    @property
    def worker_id(self) -> str | int:
        """This worker's id."""
        return self._clients[0].worker_id

    @property
    def info(self) -> tuple[ServerInfo, ...]:
        """Each shard's :class:`~hpsjax.ps.ServerInfo`, in shard order."""
        return tuple(c.info for c in self._clients)

    @property
    def closed(self) -> bool:
        """Whether any shard's connection is closed (or was never opened)."""
        return any(c.closed for c in self._clients)

    @property
    def local_steps(self) -> int | None:
        """The fewest local steps any shard's latest hint asks for, or ``None``."""
        steps = [c.local_steps for c in self._clients if c.local_steps is not None]
        return min(steps) if steps else None

    @property
    def plan(self) -> PlanNotice | None:
        """The lead shard's (shard 0's) latest work plan."""
        return self._clients[0].plan

    @property
    def stage(self) -> int:
        """The lead shard's (shard 0's) stage, as last heard."""
        return self._clients[0].stage

    @property
    def force_pull(self) -> ForcePullNotice | None:
        """The first shard's pending request to pull fresh parameters."""
        for i, c in enumerate(self._clients):
            if c.force_pull is not None:
                return ForcePullNotice(f"shard {i}: {c.force_pull.reason}")
        return None

    @property
    def bytes_sent(self) -> int:
        """Bytes written to all shards on the current connections."""
        return sum(c.bytes_sent for c in self._clients)

    @property
    def bytes_received(self) -> int:
        """Bytes read from all shards on the current connections."""
        return sum(c.bytes_received for c in self._clients)

    # ----------------------------------------------------------- fan-out

    def _where(self, shard: int) -> str:
        host, port = self._addresses[shard]
        return f"shard {shard} of {len(self._clients)} ({host}:{port})"

    async def _fan_out(
        self, what: str, call: Callable[[int, Client], Awaitable[Any]]
    ) -> list[Any]:
        """Runs ``call`` on every shard at once; fails as soon as one fails."""
        # The tasks start in shard order on the next loop pass, each handing its
        # frame to its transport before it first waits: a push issued before a
        # pull reaches every shard first (the pipelined worker relies on it).
        tasks = [asyncio.ensure_future(call(i, c)) for i, c in enumerate(self._clients)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        completed = {
            i: t.result()
            for i, t in enumerate(tasks)
            if not t.cancelled() and t.exception() is None
        }
        if len(completed) == len(tasks):
            return [completed[i] for i in range(len(tasks))]
        failed = [i for i, t in enumerate(tasks) if not t.cancelled() and t.exception()]
        cancelled = [i for i, t in enumerate(tasks) if t.cancelled()]
        first = failed[0]
        error = tasks[first].exception()
        detail = [f"{self._where(first)} failed in {what}"]
        if completed:
            detail.append(f"shards {sorted(completed)} completed it")
        if cancelled:
            detail.append(f"shards {cancelled} were cancelled (outcome unknown)")
        for i in failed[1:]:
            other = tasks[i].exception()
            detail.append(f"shard {i} also failed ({type(other).__name__}: {other})")
        tagged = _tagged(error, "; ".join(detail), completed)
        tagged.shard_index = first
        raise tagged from error

    @staticmethod
    def _timeout_kw(timeout: Any) -> dict[str, Any]:
        return {} if timeout is _UNSET else {"timeout": timeout}

    async def _push_to_shards(
        self, method: str, update: Any, meta, fields, *, codec, encoded, timeout
    ) -> list[Any]:
        """Calls ``Client.<method>`` on every shard with its part of an update
        and the push's :class:`~hpsjax.ps.PushMeta` at that shard's version."""
        if meta is None:
            fields = dict(fields)
            if "version" not in fields:
                raise ValueError("push needs version= (or meta)")
            version = fields.pop("version")
            meta = push_meta(None, {**fields, "version": 0})
        else:
            version = push_meta(meta, fields).version
        metas = [
            msgspec.structs.replace(meta, version=check_int("version", v, low=0))
            for v in self._versions(version)
        ]
        updates, encodeds = self._split_update(update, encoded)
        kw = self._timeout_kw(timeout)
        return await self._fan_out(
            method,
            lambda i, c: getattr(c, method)(
                updates[i], metas[i], codec=codec, encoded=encodeds[i], **kw
            ),
        )

    def _versions(self, version: Any) -> tuple[int, ...]:
        n = len(self._clients)
        if isinstance(version, ShardedVersion):
            versions = version.shards
        elif isinstance(version, int) and not isinstance(version, bool):
            versions = (version,) * n
        elif isinstance(version, Sequence) and not isinstance(version, str | bytes):
            versions = tuple(version)
        else:
            raise ValueError(
                f"version must be a ShardedVersion, an int or one int per shard, "
                f"got {version!r}"
            )
        if len(versions) != n:
            raise ValueError(f"{len(versions)} versions for {n} shards")
        return versions

    def _split_update(self, update: Any, encoded: Any) -> tuple[list, list]:
        n = len(self._clients)
        updates = [None] * n if update is None else self._partition.split(update)
        encodeds = (
            [None] * n
            if encoded is None
            else self._partition.split_leaf_list(list(encoded))
        )
        return updates, encodeds

    # ----------------------------------------------------------- lifecycle

    async def connect(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[ServerInfo, ...]:
        """Connects to every shard not connected yet, and checks their models.

        Cancelling is safe. On any failure every shard's connection is closed.

        Returns:
          Each shard's :class:`~hpsjax.ps.ServerInfo`.

        Raises:
          SpecMismatch: a shard's server does not serve this partition's shard
            (started with another ``--server_shards``, ``--split_leaves`` or
            init file).
          AuthError, ConnectionClosed, OSError, TimeoutError: as
            :meth:`Client.connect <hpsjax.ps.Client.connect>`, for the first
            shard that failed.
        """
        if not self.closed:
            raise RuntimeError("already connected")
        kw = self._timeout_kw(timeout)

        async def connect_one(i: int, client: Client) -> ServerInfo:
            if not client.closed:
                return client.info
            return await client.connect(**kw)

        try:
            infos = await self._fan_out("connect", connect_one)
            for i, info in enumerate(infos):
                self._check_shard_spec(i, info)
        except BaseException:
            await self.close()
            raise
        return tuple(infos)

    def _check_shard_spec(self, shard: int, info: ServerInfo) -> None:
        want = self._partition.shard_spec(shard)
        got = info.spec
        want_leaves, got_leaves = jax.tree.leaves(want), jax.tree.leaves(got)
        same = jax.tree.structure(want) == jax.tree.structure(got) and all(
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(want_leaves, got_leaves, strict=True)
        )
        if not same:
            raise SpecMismatch(
                f"{self._where(shard)} serves {len(got_leaves)} leaves that are not "
                f"this partition's shard {shard} ({len(want_leaves)} leaves, "
                f"{', '.join(self._partition.shard_paths(shard)[:4])}, ...): start "
                f"every server with the same --init, --server_shards "
                f"{self._partition.num_shards} and split_leaves="
                f"{self._partition.split_leaves}, in the order of the addresses"
            )

    async def close(self, *, timeout: float | None = 5.0) -> None:
        """Closes every shard's connection; idempotent, never raises.

        Cancelling is safe (the connections are then aborted).
        """
        await asyncio.gather(*(c.close(timeout=timeout) for c in self._clients))

    async def __aenter__(self) -> ShardedClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # ----------------------------------------------------------- requests

    async def pull(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[Any, ShardedVersion]:
        """Gets every shard's parameters, merged.

        As :meth:`Client.pull <hpsjax.ps.Client.pull>`: joins the worker to
        every shard, and waits until every shard's policy lets it proceed.
        Cancelling is safe.

        Returns:
          ``(params, version)``: the whole tree and a :class:`ShardedVersion`.
        """
        kw = self._timeout_kw(timeout)
        results = await self._fan_out("pull", lambda i, c: c.pull(**kw))
        params = self._partition.merge([p for p, _ in results])
        return params, ShardedVersion([v for _, v in results])

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
        """Sends each shard its part of an update.

        Arguments are those of :meth:`Client.push <hpsjax.ps.Client.push>`,
        but the version (``meta.version`` or ``version=``) is the
        :class:`ShardedVersion` the update was computed on (or one int per
        shard, or one int for all), and ``encoded`` needs a partition of whole
        leaves. The other fields of the push go to every shard. Cancelling is
        safe for the connections, but a shard may still apply a part already
        sent; ``timeout`` bounds each shard's wait.

        Returns:
          The combined :class:`~hpsjax.ps.PushAck`.

        Raises:
          ValueError: a bad ``version``, or an update not of the partitioned
            tree.
          InvalidUpdate, WorkerDropped, ...: as ``Client.push``, from the first
            shard that failed; ``shard_results`` on the error holds the
            acknowledgements of the shards that took their part.
        """
        results = await self._push_to_shards(
            "push", update, meta, fields, codec=codec, encoded=encoded, timeout=timeout
        )
        return _combine(results)

    async def push_pull(
        self,
        update: Any = None,
        meta: PushMeta | None = None,
        *,
        codec: Any = None,
        encoded: Any = None,
        timeout: float | None = _UNSET,
        **fields: Any,
    ) -> tuple[PushAck, Any, ShardedVersion]:
        """Pushes each shard its part and pulls, one round trip per shard.

        Arguments, cancellation and errors are those of :meth:`push`; each
        shard answers when its policy lets this worker proceed.

        Returns:
          ``(result, params, version)``.
        """
        results = await self._push_to_shards(
            "push_pull",
            update,
            meta,
            fields,
            codec=codec,
            encoded=encoded,
            timeout=timeout,
        )
        params = self._partition.merge([p for _, p, _ in results])
        return (
            _combine([r for r, _, _ in results]),
            params,
            ShardedVersion([v for _, _, v in results]),
        )

    async def refresh_info(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[ServerInfo, ...]:
        """Asks every shard for its current :class:`~hpsjax.ps.ServerInfo`.

        Cancelling is safe; ``timeout`` bounds each shard's wait.
        """
        kw = self._timeout_kw(timeout)
        return tuple(
            await self._fan_out("refresh_info", lambda i, c: c.refresh_info(**kw))
        )
