"""The asyncio server's actions: what the core decided, done on connections.

:class:`ServerActions` is the part of :class:`~hpsjax.net.Server` that carries
out the core's actions through the shared
:class:`~hpsjax.decisions.ActionInterpreter`, one handler per action (answer a
held pull with parameters, notify a forced pull, a drop, a stage or a plan,
start an apply, save a checkpoint, publish a new version to subscribers), and
builds the PARAMS frames it sends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import jax
import numpy as np

from hpsjax.decisions import (
    ActionInterpreter,
    Applied,
    Drop,
    ForcePull,
    Joined,
    PlanChanged,
    PushAck,
    Release,
    SaveCheckpoint,
    SendParams,
    StageChanged,
    StartApply,
    Wait,
)
from hpsjax.net._connection import error_frame
from hpsjax.net._session import HELD_REPORTED_S, Session, plan_hint
from hpsjax.wire import (
    ForcePullNotice,
    HpsError,
    MsgType,
    Notice,
    PackedFields,
    PreparedFrame,
    StageNotice,
    WorkerDropped,
    encode_frame,
    leaf_buffers,
    notice_to_wire,
    pack_fields,
    prepare_frame,
)

__all__ = ["ServerActions"]

# The server's one log, whichever of its modules writes the line.
logger = logging.getLogger("hpsjax.net._server")


class ServerActions:
    """The actions of a :class:`~hpsjax.net.Server` (its base; its state is
    the server's)."""

    def _interpreter(self) -> ActionInterpreter:
        """The server's handler of every action the core returns."""
        ignore = ActionInterpreter.ignore
        return ActionInterpreter(
            {
                Joined: self._on_joined,
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
            if held >= HELD_REPORTED_S:
                extra["held_s"] = held
                arrived = self._arrived
                waited = held if arrived is None else arrived - started
                if waited >= HELD_REPORTED_S:
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

    def _announce(self, notice: Notice, *, skip: Any = None) -> None:
        """Sends ``notice`` to every authenticated worker but ``skip``."""
        for session in self._connections:
            if session.state == "ready" and session is not skip:
                with contextlib.suppress(HpsError):
                    self._notify(session, notice)

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
            self.send_plan(entry.worker_id, plan_hint(entry, revised.revision))

    def _notify(self, session: Session, notice: Notice) -> None:
        if not session.protocol.closed:
            session.protocol.send(
                encode_frame(MsgType.NOTICE, 0, notice_to_wire(notice))
            )

    def _notify_error(self, session: Session, error: HpsError) -> None:
        if not session.protocol.closed:
            session.protocol.send(error_frame(0, error))

    def _fail_pulls(self, session: Session, error: HpsError) -> None:
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

    def _send_params(self, session: Session, request_id: int, extra=None) -> None:
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

    async def _flush_sub(self, session: Session) -> None:
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
