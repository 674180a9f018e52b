"""The simulator's server: the real server core on the virtual clock.

:class:`_ServerSide` is the server's half of a simulation: it builds the
server core that the asyncio server drives too (``ServerCore``, with the
deferring aggregator where rounds are evaluated in batches), delivers each
message to it through a queue of service time, and carries out the core's
actions (through the :class:`~hpsjax.decisions.ActionInterpreter` the asyncio
server shares, one handler per action: sends, applies, waits, releases, forced
pulls, drops, stages and plans) as events on the clock of the simulation it is
part of.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import msgspec
import numpy as np

from hpsjax import worker as wc
from hpsjax.apply import DeferredAggregator
from hpsjax.decisions import (
    BSP,
    ActionInterpreter,
    Applied,
    Drop,
    ForcePull,
    PlanChanged,
    Policy,
    PushAck,
    Release,
    SendParams,
    ServerCore,
    StageChanged,
    Tick,
    Wait,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.planning import WorkPlan
from hpsjax.profiling import tree_wire_nbytes
from hpsjax.sim._config import SimConfig
from hpsjax.sim._engine import DeferredLeaves, SummedRow
from hpsjax.sim._halos import HalosCore
from hpsjax.sim._results import ApplyRecord, Divergence, PushRecord, SendRecord
from hpsjax.transforms import (
    last_demo_nbytes,
    last_encoded,
    last_powersgd_encoded,
    last_sparseloco_nbytes,
    last_streaming_nbytes,
)
from hpsjax.wire import HpsError, NonFiniteUpdate, WorkerDropped

if TYPE_CHECKING:
    from hpsjax.sim._simulation import _Worker


class _ServerSide:
    """The server's side of a :class:`~hpsjax.sim._simulation._Simulation`
    (which it is a base of): its state is the simulation's."""

    def _make_server(self, params, policy, server_optimizer, core_kwargs) -> None:
        """The server core and the sizes of what goes over the wire."""
        config = self.config
        # Workers compute on a version only when the engine evaluates their
        # rounds, so with batched rounds the server core may defer its applies
        # until then and carry many out in one call: the same decisions and,
        # up to rounding, the same parameters (see DeferredAggregator). Each
        # deferral keeps the parameters of every version it makes, so it is
        # bounded in bytes. Rounds evaluated summed (one call for a version's
        # workers, however costly a gradient) push lazy updates, which only a
        # deferring core takes.
        param_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
        self.max_deferred = min(256, (64 << 20) // max(1, param_bytes))
        # Updates the engine checked itself need no second check by the core.
        self.prechecked = config.push_transform is None and (
            config.worker.staleness_lr is None
        )
        engine = self.engine
        # Sums pay where a version is made of the rounds started on the one
        # before: a barrier's. Elsewhere each version takes one push, whose
        # update a sum cannot give; and with costly gradients the deferral
        # itself pays only with sums (each update would otherwise go through
        # the deferred chain one row at a time, slower than applied alone).
        engine.sums = (
            engine.sums and self.prechecked and type(policy).ready is BSP.ready
        )
        if (
            (not engine.sequential or engine.sums)
            and self.max_deferred > 1
            and not core_kwargs.get("keep_stale_params", False)
        ):
            core_kwargs.setdefault("aggregator", DeferredAggregator)
        make: Any = ServerCore
        if getattr(policy, "name", None) == "halos":
            # Local servers per region under a global one (hpsjax.sim._halos).
            make = functools.partial(HalosCore, worker_ids=[w.id for w in self.workers])
        self.core = make(
            params,
            server_optimizer,
            policy,
            replanner=self.replanner,
            # Fed as each round's compute ends (_report), not at its push.
            replan_from_pushes=False,
            **core_kwargs,
        )
        aggregator = self.core.aggregator
        # The deferring aggregator, or None where applies are carried out at once.
        self.deferring = (
            aggregator if isinstance(aggregator, DeferredAggregator) else None
        )
        engine.sums = engine.sums and self.deferring is not None
        self.policy = self.core.policy
        self._interpret = self._interpreter()
        # The server's stage as announced (StageChanged); acknowledgements
        # carry it to workers whose pushes it compresses.
        self.stage = self.core.stage
        self.deferred: dict[int, DeferredLeaves] = {}
        engine.resolve = self._resolve
        self.pull_bytes = tree_wire_nbytes(params)
        self.push_bytes = _push_bytes(params, config, self.pull_bytes)
        self.param_specs = [(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        self.topk_bytes: dict[float, int] = {}  # per ratio
        # The server averages buffered updates weighted by their samples. When
        # every push carries the same number, the weights cancel; leaving them
        # out then gives the same average and spares the server a rescaling of
        # every update.
        self.weigh_samples = (
            self.replanner is not None
            or type(policy).local_steps is not Policy.local_steps
            or len({w.core.device_batches[0] * w.core.plan_steps for w in self.workers})
            > 1
        )

    def _to_server(self, arrival: float, service: float, handler, args) -> None:
        """Delivers a message to the server at ``arrival``; with a service
        time it joins the server's queue there (see ``_server_queue``)."""
        if self.service_time:
            self.schedule(arrival, self._server_queue, service, handler, args)
        else:
            self.schedule(arrival, handler, *args)

    def _server_queue(self, service: float, handler, args) -> None:
        """A message arrived: the server handles it once the messages ahead
        of it are handled, taking ``service`` seconds, then acts on it."""
        done = max(self.now, self.server_free) + service
        self.server_free = done
        self.schedule(done, handler, *args)

    def _server_join(self, w: _Worker, session: int) -> None:
        if session != w.session:
            return
        self._carry_out(self.core.handle(WorkerJoined(w.id, self.now)))

    def _server_leave(self, w: _Worker) -> None:
        try:
            actions = self.core.handle(WorkerLeft(w.id, self.now))
        except HpsError as err:
            self.errors.append(f"leave of worker {w.id!r}: {err}")
            return
        self._close_server_wait(w)
        self._carry_out(actions)

    def _server_pull(self, w: _Worker, session: int) -> None:
        if session != w.session:
            return
        try:
            actions = self.core.handle(WorkerPulled(w.id, self.now))
        except HpsError as err:
            self._refused(w, "pull", err)
            return
        self._carry_out(actions)

    def _server_push(self, w, session, r, job, push, sent) -> None:
        if session != w.session:
            return
        now = self.now
        core = self.core
        if not job.done:
            self.engine.finish_pushes()
        loss = r.loss if math.isfinite(r.loss) else None
        version = push.version
        try:
            if type(job.update) is SummedRow:
                update = job.update  # evaluated with its version's apply
            else:
                update = self.engine.tree(job.update)
                if not (self.prechecked and r.finite):
                    update = core.aggregator.check_update(update)
            # The worker core's meta, with what this lazily evaluated round
            # knows only now.
            meta = msgspec.structs.replace(
                push.meta,
                num_samples=r.batch_size * r.steps if self.weigh_samples else None,
                local_steps=r.steps,
                loss=loss,
                stage=r.stage,
            )
            actions = core.handle(WorkerPushed(w.id, update, meta, now))
        except HpsError as err:
            self._push_refused(w, r, version, sent, err)
            return
        if self.deferring and self.deferring.deferred_applies >= self.max_deferred:
            self._resolve()
        ack = actions[0]
        self.pushes.append(
            PushRecord(
                now,
                sent,
                w.id,
                version,
                ack.staleness,
                ack.status,
                ack.weight,
                r.steps,
                r.batch_size,
                r.loss,
            )
        )
        self.staleness[ack.staleness] += 1
        self.loss_sum += r.loss
        self.loss_count += 1
        self._acknowledge(w, session, ack)
        self._carry_out(actions)
        if push.with_pull and session == w.session:
            try:
                actions = core.handle(WorkerPulled(w.id, now))
            except HpsError as err:
                self._refused(w, "pull", err)
                return
            self._carry_out(actions)

    def _push_refused(self, w: _Worker, r, version: int, sent: float, err) -> None:
        """Records a push the server core refused (a divergence where its
        update was not finite), and the worker's answer to the refusal."""
        if isinstance(err, NonFiniteUpdate):
            # A non-finite update (one the worker could not check), or one
            # that would make the parameters non-finite.
            reason = "update" if "applied" not in str(err) else "server"
            self._diverge(w, version, r.loss, reason, stop=False)
            if self.config.stop_on_divergence:
                self.stop = True
        self.pushes.append(
            PushRecord(
                self.now,
                sent,
                w.id,
                version,
                self.core.version - version,
                "rejected",
                0.0,
                r.steps,
                r.batch_size,
                r.loss,
            )
        )
        self._refused(w, "push", err)

    def _acknowledge(self, w: _Worker, session: int, ack) -> None:
        """Sends a push's acknowledgement to its worker, where its core reads
        it: for the staleness estimate, a local steps hint, or the stage of a
        compressing worker."""
        compresses = w.core.compress_ratio < 1.0
        if (
            self.config.worker.staleness_lr is not None
            or ack.local_steps is not None
            or compresses
        ):
            self.schedule(
                self.now + w.latency,
                self._ack_arrive,
                w,
                session,
                ack.version,
                ack.local_steps,
                # This push's stage change, or the one announced before it.
                (self.stage if ack.stage is None else ack.stage)
                if compresses
                else None,
            )

    def _diverge(
        self, w: _Worker, version: int, loss: float, reason: str, *, stop=True
    ) -> None:
        """Records the run's first divergence; ends the run with ``stop``."""
        if self.diverged is None:
            self.diverged = Divergence(
                self.now, w.id, int(version), float(loss), reason
            )
        if stop:
            self.stop = True

    def _refused(self, w: _Worker, what: str, err: HpsError) -> None:
        self.errors.append(f"{what} of worker {w.id!r}: {type(err).__name__}: {err}")
        if isinstance(err, WorkerDropped):
            self.schedule(self.now + w.latency, self._dropped_arrive, w, w.session)
        else:
            # The worker runtime stops on any other refusal (a bad update, a
            # protocol error): its connection closes and the server lets it go.
            self.schedule(self.now + w.latency, self._worker_leave, w)

    def _tick(self) -> None:
        self.tick_at = None
        self.ticked_at = self.now
        self._carry_out(self.core.handle(Tick(self.now)))

    def _interpreter(self) -> ActionInterpreter:
        """The simulator's handler of every action the core returns (it
        saves no checkpoint and starts no apply before a push is whole)."""
        return ActionInterpreter(
            {
                SendParams: self._on_send_params,
                # The push's answer is carried by _server_push (_acknowledge).
                PushAck: ActionInterpreter.ignore,
                Applied: self._on_applied,
                Wait: self._on_wait,
                Release: lambda a: self._close_server_wait(self.by_id[a.worker_id]),
                ForcePull: self._on_force_pull,
                Drop: self._on_drop,
                StageChanged: self._on_stage_changed,
                PlanChanged: lambda a: self._apply_plan(a.plan),
            }
        )

    def _carry_out(self, actions: list) -> None:
        """Carries out the core's actions as events on the clock, then ticks
        the core at its next deadline."""
        self._interpret(actions)
        now = self.now
        deadline = self.core.next_deadline()
        if (
            deadline is not None
            and deadline > self.ticked_at
            and (self.tick_at is None or deadline < self.tick_at)
        ):
            self.tick_at = deadline
            self.schedule(max(deadline, now), self._tick)

    def _on_send_params(self, action: SendParams) -> None:
        now, core = self.now, self.core
        w = self.by_id[action.worker_id]
        key, params = action.version, None
        if isinstance(core, HalosCore):  # the worker's local server's model
            key, params = core.sent_params(action)
        if self.leaves_version != key:
            if self.deferring and self.deferring.deferred_applies:
                self.version_leaves = self.deferred[action.version] = DeferredLeaves(
                    action.version
                )
            else:
                self.version_leaves = self.engine.version_leaves(
                    core.params if params is None else params
                )
            self.leaves_version = key
        self.sends.append(
            SendRecord(now, w.id, action.version, core.clock(w.id), core.min_clock)
        )
        arrival = self._send_down(w, self.pull_bytes)
        self.schedule(
            arrival,
            self._params_arrive,
            w,
            w.session,
            self.version_leaves,
            action.version,
            action.local_steps,
        )

    def _on_applied(self, action: Applied) -> None:
        self.applies.append(
            ApplyRecord(
                self.now,
                action.version,
                action.num_updates,
                action.staleness,
                action.contributors,
            )
        )
        every = self.config.eval_every_updates
        if (
            every is not None
            and self.eval_sets is not None
            and action.version % every == 0
        ):
            self._evaluate()
        if (
            self.config.max_updates is not None
            and action.version >= self.config.max_updates
        ):
            self.stop = True

    def _on_wait(self, action: Wait) -> None:
        w = self.by_id[action.worker_id]
        if w.server_wait_since is None:
            w.server_wait_since = self.now

    def _on_force_pull(self, action: ForcePull) -> None:
        w = self.by_id[action.worker_id]
        arrive = self._stop_arrive if action.stop else self._force_arrive
        self.schedule(self.now + w.latency, arrive, w, w.session)

    def _on_drop(self, action: Drop) -> None:
        w = self.by_id[action.worker_id]
        self._close_server_wait(w)
        self.errors.append(f"worker {w.id!r} dropped: {action.reason}")
        self.schedule(self.now + w.latency, self._dropped_arrive, w, w.session)

    def _on_stage_changed(self, action: StageChanged) -> None:
        self.stage = action.stage

    def _close_server_wait(self, w: _Worker) -> None:
        if w.server_wait_since is not None:
            w.server_waits.append((w.server_wait_since, self.now))
            w.server_wait_since = None

    def _apply_plan(self, work_plan: WorkPlan) -> None:
        for w in self.workers:
            try:
                p = work_plan.worker(w.id)
            except ValueError:
                raise ValueError(
                    f"the work plan has no worker {w.id!r}; its workers are "
                    f"{[x.worker_id for x in work_plan.workers]}."
                ) from None
            if p.batch_size < 1:
                raise ValueError(f"the work plan gives worker {w.id!r} an empty batch.")
            w.core.handle(
                wc.PlanChanged(
                    device_batches=(p.batch_size,),
                    local_steps=p.local_steps,
                    lr_scale=float(p.lr_scale),
                )
            )
            stage = self.config.worker.compress_from_stage
            if stage is not None:
                w.core.compress_ratio = float(p.compress_ratio)
                w.core.compress_from_stage = stage
        self.plans.append(work_plan)


def _push_bytes(params: Any, config: SimConfig, raw: int) -> int:
    """Bytes of one push on the wire (headers excluded)."""
    if config.codec is not None:
        return tree_wire_nbytes(params, config.codec)
    if config.push_transform is None:
        return raw

    state = config.push_transform.init(params)
    # What a quantizer or a PowerSGD in it keeps for the wire: a PowerSGD
    # push is its factors, powersgd_nbytes per leaf.
    for last in (last_encoded, last_powersgd_encoded):
        try:
            encoded = last(state)
        except ValueError:  # not this one
            continue
        return int(sum(x.nbytes for x in jax.tree.leaves(encoded)))

    # SparseLoCo: k indices and k few-bit values per leaf; Streaming DiLoCo:
    # one fragment's few-bit codes (the fragments' mean).
    # DeMo: k DCT coefficients and their indices per chunk.
    for last in (last_sparseloco_nbytes, last_streaming_nbytes, last_demo_nbytes):
        try:
            return last(state)
        except ValueError:
            continue
    return raw  # no compressor in it: the update goes out uncompressed
