"""The asyncio server's connections: one session each, from handshake to leave.

A :class:`Session` is one connection's state (handshake, joined, pulls waiting
on the core, subscription, the apply of the push it is receiving);
:class:`ServerSessions` is the part of :class:`~hpsjax.net.Server` that makes
them, authenticates them, assigns an id to a worker that asks for one (the
lowest free, :func:`~hpsjax.decisions.free_worker_id`), welcomes them (INFO,
a planned worker's plan), refuses a second worker under a live worker's id,
replaces a worker's older connection, and turns a goodbye or a lost connection
into the core's :class:`~hpsjax.decisions.WorkerLeft`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import logging
from typing import Any

import jax

from hpsjax.apply import LeafApply
from hpsjax.decisions import Joined, WorkerLeft, free_worker_id
from hpsjax.net import _auth
from hpsjax.net._connection import FrameProtocol, error_frame
from hpsjax.wire import (
    AuthError,
    Frame,
    Header,
    HpsError,
    InfoMessage,
    PlanNotice,
    ServerError,
    WireLimits,
    WorkerDropped,
    encode_frame,
)

__all__ = [
    "Session",
    "ServerSessions",
    "describe_plan",
    "is_loopback",
    "live_workers",
    "on_device",
    "plan_hint",
]

# A pull answered within this many seconds is not said to have been held: its
# answer is the version's cached frame (workers count it as 0).
HELD_REPORTED_S = 1e-3

# The server's one log, whichever of its modules writes the line.
logger = logging.getLogger("hpsjax.net._server")

# Until a connection has authenticated, its frames are small handshake messages:
# nothing larger is read, so a stranger cannot make the server allocate much.
_HANDSHAKE_LIMITS = WireLimits(max_message_bytes=4096, max_metadata_bytes=4096)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, 127.x, ::1)."""
    if host in (None, ""):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_device(method):
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


def live_workers(count: int) -> str:
    return f"{count} live worker" + ("" if count == 1 else "s")


def describe_plan(plan: PlanNotice) -> str:
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


def plan_hint(entry: Any, revision: int) -> PlanNotice:
    """A ``WorkerPlan`` as the plan a worker receives (see
    :meth:`~hpsjax.net.Server.send_plan`)."""
    return PlanNotice(
        revision=int(revision),
        batch_size=int(entry.batch_size),
        device_batches=tuple(int(d.batch_size) for d in entry.devices),
        local_steps=int(entry.local_steps),
        lr_scale=float(entry.lr_scale),
    )


@dataclasses.dataclass(eq=False)
class Session:
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


class ServerSessions:
    """The connections of a :class:`~hpsjax.net.Server` (its base; its state
    is the server's): handshake, welcome, replacement, leaving."""

    def _new_protocol(self) -> FrameProtocol:
        session: Session | None = None

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
        session = Session(
            protocol=protocol, peer="?", handshake=_auth.Handshake.server(self._secret)
        )
        return protocol

    def _on_made(self, session: Session) -> None:
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

    def _handshake_expired(self, session: Session) -> None:
        if session.state != "ready":
            session.protocol.fail(AuthError("handshake timed out"))

    def _another_worker(self, old: Session, new: Session) -> bool:
        """Whether ``new``, under ``old``'s worker id, is another worker: ``old``
        is joined, connected and live, and both sent HELLO instances that
        differ (a client that sends none is taken for a reconnect)."""
        live = old.joined and not old.closed and old.worker_id in self._core.live
        theirs, mine = old.handshake.instance, new.handshake.instance
        return live and None not in (theirs, mine) and theirs != mine

    def _handshake(self, session: Session, frame: Frame) -> None:
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
            if session.worker_id is None:
                meta = {**meta, "worker_id": self._assign_id(session)}
            old = self._sessions.get(session.worker_id)
            if old is not None and old is not session:
                if self._another_worker(old, session):
                    # Two workers under one id: refused, not taken for a
                    # reconnect (a dead connection's worker is dropped first).
                    session.protocol.fail(
                        ServerError(
                            f"worker id {session.worker_id!r} belongs to a live "
                            "connected worker: give each worker its own "
                            "--worker_id, or none (the server assigns one)"
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

    def _assign_id(self, session: Session) -> int:
        """Gives ``session``, whose HELLO named no worker, the lowest id no
        worker seen, no connection and no earlier assignment has."""
        worker_id = free_worker_id(
            self._core.workers(), self._sessions, self._assigned_ids
        )
        self._assigned_ids.add(worker_id)
        session.handshake.worker_id = worker_id
        logger.info("assigned worker id %d to %s", worker_id, session.peer)
        return worker_id

    def _on_joined(self, action: Joined) -> None:
        """A worker's pull joined it: its connection is joined, and a planned
        worker gets its plan before the answer (in force for its first
        round)."""
        session = self._sessions.get(action.worker_id)
        if session is None:
            return
        session.joined = True
        plan = self._plans.get(action.worker_id)
        if plan is not None:
            self._notify(session, plan)
        logger.info(
            "worker %r joined from %s at version %d (%d live)%s",
            action.worker_id,
            session.peer,
            action.version,
            len(self._core.live),
            "" if plan is None else f"; sent its {describe_plan(plan)}",
        )

    def _replace(self, old: Session) -> None:
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

    def _leave(self, session: Session, why: str, detail: str = "") -> None:
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

    @on_device
    def _on_lost(self, session: Session, error: HpsError) -> None:
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
