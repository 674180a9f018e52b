"""The worker's driver: carries out its core's actions, and records the rounds.

:class:`_Run` is one run of a :class:`~hpsjax.worker.Worker`: it turns each
action of the :class:`~hpsjax.worker.WorkerCore` into a task (a round's
compute in the compute thread, a push encoded in the encoding thread, a pull,
a join), feeds back what happened as events, reconnects when the server goes
away, and fills in each round's metrics record. Every decision (when to pull,
push, discard or stop) is the core's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from hpsjax.telemetry import (
    from_record,
)
from hpsjax.wire import ConnectionClosed, ShuttingDown, WorkerDropped
from hpsjax.worker._compute import _Computed, _tree_nbytes
from hpsjax.worker._core import (
    Acked,
    Compute,
    Computed,
    Discard,
    Dropped,
    Join,
    Joined,
    KeepParams,
    Pull,
    Pulled,
    Push,
    Report,
    Reported,
    Stop,
    StopComputing,
    StopRequested,
    WorkerCore,
)
from hpsjax.worker._records import _TRANSFER_PARTS, _finite_or_none

logger = logging.getLogger("hpsjax.worker")


class _ServerGone(Exception):
    """The server stayed away longer than ``reconnect_timeout`` (said in one
    line where it happened)."""


# What a request raises when the server went away (a goodbye, a lost or
# refused connection): the worker reconnects.
def _lost_errors() -> tuple[type[BaseException], ...]:
    return (ConnectionClosed, ShuttingDown, OSError)


class _Run:
    """One run of a :class:`Worker`: carries out its core's actions (I/O and
    compute as tasks), feeds back what happened, and keeps the metrics."""

    def __init__(self, worker: Any, client, computer, encoder, totals):
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
            self.computer,
            self.w._compute.compute_round,
            params,
            compute.version,
            compute,
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
        if not self.core.pipeline and self.client.force_pull is not None:
            # Told to stop while computing (Ringmaster's stopping form); a
            # compiled step cannot be interrupted, so its result is dropped.
            return [(StopComputing(self.core.session, event.now), None), (event, None)]
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
            w._compute.initialise(params)
            if w._compute.compresses:
                self.encoder.submit(w._compute.warm_compressor)
        elif join:
            logger.info(
                "worker %s joined again at version %d", w._config.worker_id, version
            )
        hint = self.client.local_steps
        event = Pulled(session, version, w._elapsed(), local_steps=hint)
        return [*self.hints(), (event, params)]

    async def push(self, push: Push) -> list:
        w = self.w
        record = self.final_record() if push.final else self.current
        computed = self.computed.pop(push.round)
        if push.session <= self.lost_session:  # computed for a lost connection
            return [] if push.final else [(Dropped(push.session, w._elapsed()), None)]
        sending = self.sending = asyncio.Event()
        start = time.monotonic()
        connection = self.connection
        try:
            prepared = await self.loop.run_in_executor(
                self.encoder, w._compute.prepare, computed, push
            )
            if record is not None:
                record["staleness_estimate"] = push.staleness_estimate
                record["lr_factor"] = push.lr_factor
                record["encode_s"] += prepared.encode_s
            sent = time.monotonic()
            link = await w._injector.transfer(prepared.nbytes)
            try:
                reply, held = await self.send(push, prepared, record, sending)
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
        if push.with_pull:
            link += await w._injector.transfer(_tree_nbytes(params))
        self.transferred(record, start, link)
        if record is not None:
            # A push-pull's acknowledgement comes with the parameters: its
            # whole trip is the pull's. The server's hold is an apply's (and
            # a push-pull's barrier).
            part = "pull_s" if push.with_pull else "push_s"
            record[part] += time.monotonic() - sent
            record["server_s"] += held[0]
            record["barrier_s"] += held[1]
        events = self.acknowledged(push, record, ack)
        if push.with_pull:
            now = w._elapsed()
            if record is not None:
                record["pull_end"] = now
            hint = self.client.local_steps
            events += self.hints()
            events.append((Pulled(push.session, version, now, hint), params))
        if push.final:
            self.close_final(record)
        return events

    def final_record(self) -> dict:
        """The record of the run's last push, which no round follows."""
        return {
            "event": "final",
            "worker": self.w._config.worker_id,
            "step": self.totals["steps"],
            "time": self.w._elapsed(),
            "transfer_s": 0.0,
            "link_delay_s": 0.0,
            **dict.fromkeys(_TRANSFER_PARTS, 0.0),
            "_bytes": (self.client.bytes_sent, self.client.bytes_received),
        }

    async def send(self, push: Push, prepared, record, sending) -> tuple:
        """Hands a push (a push-pull) to the client, sets ``sending`` once its
        frame is on the transport; returns the reply and the seconds the
        server held it."""
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
            record["pull_start"] = self.w._elapsed()
            record["pulls"] += 1
        return await task

    def acknowledged(self, push: Push, record: dict | None, ack) -> list:
        """Counts an acknowledged push towards ``record``; its event."""
        self.totals["pushes"] += 1
        self.w._last_status = ack.status
        if record is not None:
            record.update(
                pushed_step=push.round,
                staleness=ack.staleness,
                status=ack.status,
                weight=ack.weight,
            )
            record["force_pull"] = record.get("force_pull", False) or ack.force_pull
        acked = Acked(
            push.session,
            ack.version,
            self.w._elapsed(),
            ack.local_steps,
            ack.force_pull,
            getattr(self.client, "stage", None),
        )
        return [(acked, None)]

    def close_final(self, record: dict) -> None:
        """Emits the last push's record, its bytes and transfer in the totals."""
        sent0, received0 = record.pop("_bytes")
        record.update(
            bytes_sent=self.client.bytes_sent - sent0,
            bytes_received=self.client.bytes_received - received0,
        )
        self.totals["transfer_s"] += record["transfer_s"]
        self.totals["bytes_sent"] += record["bytes_sent"]
        self.totals["bytes_received"] += record["bytes_received"]
        self.w._emit(record)

    def transferred(
        self,
        record: dict | None,
        start: float,
        link: float,
        part: str = "",
        held: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Counts a transfer from ``start`` (with ``link`` seconds of injected
        link delay) towards ``record``; a ``part`` (``"pull_s"``) too, and
        ``held``, the seconds the server held its answer and of them its wait
        at a barrier (:meth:`client_held`)."""
        if record is None:
            return
        seconds = time.monotonic() - start
        record["transfer_s"] += seconds
        record["link_delay_s"] += link
        if part:
            record[part] += seconds
            record["server_s"] += held[0]
            record["barrier_s"] += held[1]

    def client_held(self) -> tuple[float, float]:
        """Seconds the server held the answer the client read last, and of
        them its wait at a barrier (0 for a client that does not say); read
        before the next ``await``."""
        held, barrier = (
            getattr(self.client, name, None) for name in ("held_s", "barrier_s")
        )
        return tuple(
            float(x) if isinstance(x, int | float) else 0.0 for x in (held, barrier)
        )

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
