"""One simulation run: the workers' side, the event loop, evaluation and the result.

:class:`_Simulation` holds the virtual clock (a heap of ``(time, seq,
event)``), builds each simulated worker around a real
:class:`~hpsjax.worker.WorkerCore` with its share of the data, carries out the
worker cores' actions (compute on the batched engine, pushes and pulls over
links of latency and bandwidth), evaluates on virtual time, and assembles the
:class:`~hpsjax.sim.SimResult`; the server's side is :class:`_ServerSide`.
"""

from __future__ import annotations

import collections
import gc
import heapq
import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from hpsjax import worker as wc
from hpsjax.data import share_split
from hpsjax.decisions import SpeedMeasured, get_policy
from hpsjax.planning import Replanner, WorkPlan
from hpsjax.sim._config import (
    SimConfig,
    _as_arrays,
    _check_policy_without_local_steps,
    _check_workers,
    _default_optimizer,
)
from hpsjax.sim._engine import Engine, IndexStream, Round
from hpsjax.sim._results import (
    ApplyRecord,
    Divergence,
    Interval,
    PushRecord,
    SendRecord,
    SimResult,
)
from hpsjax.sim._server_side import _ServerSide
from hpsjax.sim._workers import finish_time
from hpsjax.transforms import (
    topk_nbytes,
)


class _Worker:
    """A simulated worker: its decisions (a :class:`~hpsjax.worker.WorkerCore`),
    its rounds in the engine, its link and its timeline."""

    __slots__ = (
        "blocked_since",
        "blocked_spans",
        "bytes_received",
        "bytes_sent",
        "compute_spans",
        "core",
        "down_free",
        "het",
        "id",
        "index",
        "join_time",
        "latency",
        "params",
        "rng",
        "rounds",
        "server_wait_since",
        "server_waits",
        "slowdown",
        "spans",
        "spec",
        "startup",
        "stream",
        "transfer_spans",
        "up_free",
    )

    def __init__(self, index, worker_id, spec, rng, stream, core):
        self.index = index
        self.id = worker_id
        self.spec = spec
        self.het = spec.heterogeneity
        self.latency = 0.0 if self.het is None else self.het.latency
        self.slowdown = ((0.0, 1.0),) if self.het is None else self.het.slowdown
        self.join_time = float(spec.join_time)
        self.startup = float(spec.startup_time)  # left to charge: first round
        self.rng = rng
        self.stream = stream
        self.core = core
        self.params = None
        self.rounds: dict[int, Round] = {}  # computing or waiting to be pushed
        self.spans: dict[int, list] = {}  # their compute spans
        self.blocked_since = None
        self.server_wait_since = None
        self.up_free = 0.0
        self.down_free = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.compute_spans: list[list] = []
        self.blocked_spans: list[tuple[float, float]] = []
        self.server_waits: list[tuple[float, float]] = []
        self.transfer_spans: list[Interval] = []

    @property
    def session(self) -> int:
        return self.core.session

    def bandwidth(self, now: float) -> float | None:
        if self.het is None:
            return None
        return self.het.bandwidth_at(now - self.join_time)


def _plan_shares(
    work_plan: WorkPlan, ids: list[Any], n_examples: int
) -> list[np.ndarray] | None:
    """Each worker's example indices by the plan's ``data_share``
    (:func:`hpsjax.data.share_split`), or ``None`` when the plan gives none."""
    by_id = {w.worker_id: w.data_share for w in work_plan.workers}
    shares = [by_id.get(i) for i in ids]
    if any(s is None for s in shares):
        return None
    return share_split(n_examples, shares)


class _Simulation(_ServerSide):
    """One run of :func:`simulate`; see there."""

    def __init__(
        self,
        loss_fn,
        params,
        train_data,
        workers,
        config: SimConfig,
        eval_data,
        eval_fn,
        work_plan,
        callback,
    ):
        self.config = config
        self.callback = callback
        specs = _check_workers(workers)

        policy = get_policy(config.policy, **dict(config.policy_kwargs or {}))
        local = config.local_optimizer is not None
        self.local = local
        if not local:
            _check_policy_without_local_steps(policy)
        server_optimizer = config.server_optimizer
        if server_optimizer is None:
            server_optimizer = _default_optimizer(
                1.0 if local else float(config.learning_rate)
            )
        core_kwargs = dict(config.core_kwargs or {})

        data, n_examples = _as_arrays(train_data, "train_data")
        ids = [
            s.worker_id if s.worker_id is not None else i for i, s in enumerate(specs)
        ]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids repeat: {ids}")
        if config.data_sharding == "disjoint" and len(specs) > n_examples:
            raise ValueError(
                f"{len(specs)} workers cannot get disjoint shards of "
                f"{n_examples} examples; use data_sharding='shared'."
            )

        self.replanner = None
        self.plans: list[WorkPlan] = []
        if isinstance(work_plan, Replanner):
            self.replanner = work_plan
            work_plan = work_plan.plan
        if work_plan is not None and not isinstance(work_plan, WorkPlan):
            raise ValueError(
                "work_plan must be a WorkPlan, a Replanner or None, got "
                f"{type(work_plan).__name__}."
            )

        seed = int(config.seed)
        self.workers = self._make_workers(specs, ids, n_examples, work_plan)
        self.by_id = {w.id: w for w in self.workers}
        if work_plan is not None:
            self._apply_plan(work_plan)
        if not local:
            for w in self.workers:
                if w.core.plan_steps > 1:
                    raise ValueError(
                        f"worker {w.id!r} takes {w.core.plan_steps} local steps; more "
                        "than one local step needs a local_optimizer."
                    )

        self._set_up_eval(loss_fn, eval_data, eval_fn)
        self.engine = Engine(
            loss_fn,
            params,
            jax.device_put(data),
            len(self.workers),
            local_optimizer=config.local_optimizer,
            push_transform=config.push_transform,
            batch_rows=config.batch_rows,
            batch_sizes=tuple(w.core.device_batches[0] for w in self.workers),
            seed=seed,
        )
        self._make_server(params, policy, server_optimizer, core_kwargs)

        self._reset_state()

    def _make_workers(self, specs, ids, n_examples, work_plan) -> list[_Worker]:
        """The workers, each with its shard of the data and its core."""
        config = self.config
        seed = int(config.seed)
        shares = None
        if config.data_sharding == "disjoint" and work_plan is not None:
            shares = _plan_shares(work_plan, ids, n_examples)
        workers: list[_Worker] = []
        for i, (spec, worker_id) in enumerate(zip(specs, ids, strict=True)):
            if shares is not None:
                # The plan's data shares (ASHL's reference re-partitions so).
                indices = shares[i].astype(np.int32)
            elif config.data_sharding == "disjoint":
                indices = np.arange(i, n_examples, len(specs), dtype=np.int32)
            else:
                indices = np.arange(n_examples, dtype=np.int32)
            workers.append(
                _Worker(
                    i,
                    worker_id,
                    spec,
                    np.random.default_rng([seed, 0, i]),
                    IndexStream(indices, (seed, 1, i)),
                    wc.WorkerCore(
                        device_batches=(spec.batch_size,),
                        local_steps=spec.local_steps,
                        lr_scale=float(spec.lr_scale),
                        pushes_gradients=not self.local,
                        overlap=config.worker.overlap or "none",
                        eager_pulls=config.worker.eager_pulls,
                        staleness_lr=config.worker.staleness_lr,
                    ),
                )
            )
        return workers

    def _set_up_eval(self, loss_fn, eval_data, eval_fn) -> None:
        """The evaluation batches on the device and the jitted ``eval_fn``."""
        config = self.config
        self.eval_sets = None
        self.eval_fn = None
        if eval_data is not None:
            eval_arrays, n_eval = _as_arrays(eval_data, "eval_data")
            size = config.eval_batch_size
            self.eval_sets = [
                (
                    jax.device_put(
                        jax.tree.map(lambda a, s=start: a[s : s + size], eval_arrays)
                    ),
                    min(size, n_eval - start),
                )
                for start in range(0, n_eval, size)
            ]
            if eval_fn is None:

                def eval_fn(p, batch):
                    return {"loss": loss_fn(p, batch)}

            self.eval_fn = jax.jit(eval_fn)
        elif eval_fn is not None:
            raise ValueError("eval_fn was given without eval_data.")

    def _reset_state(self) -> None:
        """The virtual clock, the event queues and what the run records."""
        config = self.config
        self.heap: list = []
        self.ready: collections.deque = collections.deque()
        self.seq = 0
        self.now = 0.0
        self.stop = False
        self.tick_at: float | None = None
        self.service_time = float(config.server_service_time)
        self.server_free = 0.0  # when the server has handled its queue
        self.ticked_at = -math.inf
        self.leaves_version = -1
        self.version_leaves = None
        self.gradients = 0
        self.errors: list[str] = []
        self.pushes: list[PushRecord] = []
        self.applies: list[ApplyRecord] = []
        self.sends: list[SendRecord] = []
        self.staleness: Counter = Counter()
        self.metrics: dict[str, list] = {}
        self.loss_sum = 0.0
        self.loss_count = 0
        self.last_eval: tuple[float, int] | None = None
        self.diverged: Divergence | None = None

    # ------------------------------------------------------------ plumbing

    def schedule(self, t: float, fn, *args) -> None:
        self.seq += 1
        if t == self.now:
            # Due at this very instant: after every event already due now (they
            # were scheduled earlier), so a queue keeps the heap's order.
            self.ready.append((t, 0, self.seq, fn, args))
        else:
            heapq.heappush(self.heap, (t, 0, self.seq, fn, args))

    def run(self) -> SimResult:
        # The objects alive before the run (JAX's, the model's, the data's) are
        # kept out of the garbage collector's passes while it runs: a full pass
        # over them costs about as much as all of a long run's own objects.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return self._run()
        finally:
            if freeze:
                gc.unfreeze()

    def _run(self) -> SimResult:
        wall = time.perf_counter()
        config = self.config
        for w in self.workers:
            self.schedule(w.join_time, self._worker_join, w)
            if w.spec.leave_time is not None:
                self.schedule(float(w.spec.leave_time), self._worker_leave, w)
        if self.eval_sets is not None:
            self._evaluate()
            if config.eval_every is not None:
                self.seq += 1
                heapq.heappush(
                    self.heap, (config.eval_every, 1, self.seq, self._timed_eval, ())
                )
        horizon = math.inf if config.duration is None else float(config.duration)
        heap = self.heap
        ready = self.ready
        pop, popleft = heapq.heappop, ready.popleft
        end = 0.0
        while not self.stop:
            # Events due now wait in ``ready`` (in the order they were
            # scheduled); the heap holds the later ones, and any due now that
            # were scheduled before the clock reached this instant.
            if ready:
                event = pop(heap) if heap and heap[0] < ready[0] else popleft()
            elif heap:
                event = pop(heap)
            else:
                break
            t = event[0]
            if t > horizon:
                break
            self.now = end = t
            event[3](*event[4])
        if not self.stop and config.duration is not None:
            end = horizon
        self.now = end
        if self.eval_sets is not None and self.last_eval != (end, self.core.version):
            self._evaluate()
        return self._result(end, time.perf_counter() - wall)

    # ------------------------------------------------------------ worker side
    #
    # The worker follows hpsjax.worker's runtime. Without overlap a round is
    # compute, then push and pull in one round trip. With overlap ("pipeline",
    # "eager") a round starts by sending the previous round's update and, right
    # behind it on the connection, a pull; both travel while the round computes,
    # and the next round starts once the compute is done and the pull answered.
    # "eager" pulls again while the running compute leaves time for another
    # round trip, so the next round starts on fresher parameters.

    def _carry_out_worker(self, w: _Worker, actions: list, leaves=None) -> None:
        """Carries out a worker core's actions (``leaves``: of the parameters
        that the event handled brought)."""
        for action in actions:
            kind = type(action)
            if kind is wc.Compute:
                self._start_round(w, action)
            elif kind is wc.Push:
                self._send_push(w, w.rounds.pop(action.round), action)
            elif kind is wc.Pull:
                self._send_pull(w, action.session)
            elif kind is wc.KeepParams:
                w.params = leaves
            elif kind is wc.Discard:
                self.engine.cancel(w.rounds.pop(action.round))
                span = w.spans.pop(action.round)
                if span[1] > self.now:  # stopped while computing
                    span[1], w.blocked_since = self.now, self.now
                span[2] = "discarded"
            elif kind is wc.Report:
                self._report(w, action)
            elif kind is wc.Join:
                self.schedule(self.now + w.latency, self._server_join, w, w.session)
            elif kind is wc.Stop:
                self.schedule(self.now + w.latency, self._server_leave, w)
            else:
                raise TypeError(f"unexpected worker action {action!r}")

    def _worker_join(self, w: _Worker) -> None:
        w.blocked_since = self.now
        self._carry_out_worker(w, w.core.handle(wc.Joined(self.now)))

    def _worker_leave(self, w: _Worker) -> None:
        now = self.now
        computing = w.core.current
        if computing is not None:
            w.spans[computing.round][1] = now
        elif w.blocked_since is not None:
            w.blocked_spans.append((w.blocked_since, now))
            w.blocked_since = None
        self._carry_out_worker(w, w.core.handle(wc.Left(now)))

    def _start_round(self, w: _Worker, compute: wc.Compute) -> None:
        now = self.now
        if w.blocked_since is not None:
            w.blocked_spans.append((w.blocked_since, now))
            w.blocked_since = None
        batch, steps = compute.batch_size, compute.local_steps
        # A merge step takes no gradient: not billed (SimConfig.merge_steps).
        billed = max(steps - self.config.merge_steps, 1)
        model = w.spec.compute
        start = now
        if w.startup:
            # The first round: the worker's start-up comes before its steps.
            start, w.startup = now + w.startup, 0.0
        if (
            billed == 1
            and len(w.slowdown) == 1
            and model.sigma == 0
            and not (model.straggle_probability > 0 and model.straggle_slowdown > 1)
        ):
            # No randomness and one slowdown: the same sum as ``finish_time``'s,
            # without its arrays.
            step = float(model.mean_step_time(batch))
            end = w.join_time + ((start - w.join_time) + w.slowdown[0][1] * step)
        else:
            durations = model.draw(w.rng, batch, billed)
            end = w.join_time + finish_time(w.slowdown, start - w.join_time, durations)
        w.rounds[compute.round] = self.engine.submit(
            Round(w.index, w.params, steps, batch, compute.lr_scale, w.stream)
        )
        span = w.spans[compute.round] = [now, end, "compute"]
        w.compute_spans.append(span)
        self.schedule(end, self._compute_done, w, compute.round)

    def _compute_done(self, w: _Worker, round_: int) -> None:
        current = w.core.current
        if current is None or current.round != round_:
            return  # thrown away as the worker left
        w.blocked_since = self.now
        step_time = self.now - w.spans[round_][0]
        actions = w.core.handle(wc.Computed(round_, self.now, step_time))
        self._carry_out_worker(w, actions)

    def _report(self, w: _Worker, report: wc.Report) -> None:
        actions = self.core.handle(
            SpeedMeasured(w.id, report.batch_size, report.time_per_step, report.now)
        )
        if actions:
            self._carry_out(actions)
        self._carry_out_worker(w, w.core.handle(wc.Reported(self.now)))

    def _send_push(self, w: _Worker, r: Round, push: wc.Push) -> None:
        if not r.done:
            self.engine.flush()
        if self.config.stop_on_divergence and (
            not math.isfinite(r.loss) or r.finite is False
        ):
            # The worker finds it before sending, and the run ends here.
            reason = "loss" if not math.isfinite(r.loss) else "update"
            self._diverge(w, push.version, r.loss, reason)
            return
        job = self.engine.prepare_push(w.index, r.update, push.lr_factor)
        nbytes = self.push_bytes
        if push.compress_ratio < 1.0:
            # A top-k push (the worker core's rule): the wire codec's bytes.
            nbytes = self.topk_bytes.get(push.compress_ratio)
            if nbytes is None:
                nbytes = self.topk_bytes[push.compress_ratio] = sum(
                    topk_nbytes(shape, dtype, push.compress_ratio)
                    for shape, dtype in self.param_specs
                )
        arrival = self._send_up(w, nbytes, "push")
        self._to_server(
            arrival,
            self.service_time,
            self._server_push,
            (w, push.session, r, job, push, self.now),
        )
        self.gradients += r.steps
        if self.config.max_gradients is not None and (
            self.gradients >= self.config.max_gradients
        ):
            self.stop = True

    def _send_pull(self, w: _Worker, session: int) -> None:
        # On one connection a request queues behind the push being sent.
        start = max(self.now, w.up_free)
        self._to_server(start + w.latency, 0.0, self._server_pull, (w, session))

    def _params_arrive(self, w, session, leaves, version, hint) -> None:
        event = wc.Pulled(session, version, self.now, local_steps=hint)
        self._carry_out_worker(w, w.core.handle(event), leaves)

    def _ack_arrive(self, w, session, version, hint, stage=None) -> None:
        event = wc.Acked(session, version, self.now, local_steps=hint, stage=stage)
        self._carry_out_worker(w, w.core.handle(event))

    def _force_arrive(self, w, session) -> None:
        self._carry_out_worker(w, w.core.handle(wc.ForcePulled(session)))

    def _stop_arrive(self, w, session) -> None:
        self._carry_out_worker(w, w.core.handle(wc.StopComputing(session, self.now)))

    def _dropped_arrive(self, w, session) -> None:
        self._carry_out_worker(w, w.core.handle(wc.Dropped(session, self.now)))

    def _send_up(self, w: _Worker, nbytes: int, kind: str) -> float:
        now = self.now
        start = max(now, w.up_free)
        bandwidth = w.bandwidth(start)
        end = start if bandwidth is None else start + nbytes / bandwidth
        w.up_free = end
        arrival = end + w.latency
        w.bytes_sent += nbytes
        w.transfer_spans.append(Interval(start, arrival, kind))
        return arrival

    def _send_down(self, w: _Worker, nbytes: int) -> float:
        now = self.now
        start = max(now, w.down_free)
        bandwidth = w.bandwidth(start)
        end = start if bandwidth is None else start + nbytes / bandwidth
        w.down_free = end
        arrival = end + w.latency
        w.bytes_received += nbytes
        w.transfer_spans.append(Interval(start, arrival, "pull"))
        return arrival

    # ------------------------------------------------------------ evaluation

    def _timed_eval(self) -> None:
        self._evaluate()
        if self.heap or self.ready:
            # Only while anything else can still happen: evaluations alone
            # would go on for ever.
            self.seq += 1
            heapq.heappush(
                self.heap,
                (self.now + self.config.eval_every, 1, self.seq, self._timed_eval, ()),
            )

    def _resolve(self) -> None:
        """Carries out the core's deferred applies; fills in deferred leaves."""
        if not (self.deferring and self.deferring.deferred_applies):
            return
        rows, history = self.deferring.apply_deferred()
        if not self.engine.sequential:
            history = [np.asarray(x) for x in history]
        for version, deferred in self.deferred.items():
            row = rows[version]
            deferred.leaves = tuple(x[row] for x in history)
        self.deferred = {}

    def _evaluate(self) -> None:
        self._resolve()
        params = self.core.params
        totals: dict[str, float] = {}
        count = 0
        for batch, size in self.eval_sets:
            values = self.eval_fn(params, batch)
            if not isinstance(values, Mapping):
                raise ValueError(
                    "eval_fn must return a dict of scalar metrics, got "
                    f"{type(values).__name__}."
                )
            for key, value in jax.device_get(values).items():
                totals[key] = totals.get(key, 0.0) + float(value) * size
            count += size
        record = {
            "time": self.now,
            "version": self.core.version,
            "gradients": self.gradients,
            "train_loss": (
                self.loss_sum / self.loss_count if self.loss_count else math.nan
            ),
        }
        for key, value in totals.items():
            if key in record:
                raise ValueError(f"eval_fn metric name {key!r} is reserved.")
            record[key] = value / count
        self.loss_sum = 0.0
        self.loss_count = 0
        for key, value in record.items():
            self.metrics.setdefault(key, []).append(value)
        self.last_eval = (self.now, self.core.version)
        if self.callback is not None and self.callback(dict(record)):
            self.stop = True

    # ------------------------------------------------------------ result

    def _result(self, end: float, wall: float) -> SimResult:
        self._resolve()
        for w in self.workers:
            if w.blocked_since is not None:
                w.blocked_spans.append((w.blocked_since, end))
            if w.server_wait_since is not None:
                w.server_waits.append((w.server_wait_since, end))
        metrics = {k: np.asarray(v) for k, v in self.metrics.items()}
        return SimResult(
            metrics=metrics,
            timelines={w.id: _timeline(w, end) for w in self.workers},
            transfers={w.id: tuple(w.transfer_spans) for w in self.workers},
            bytes_sent={w.id: w.bytes_sent for w in self.workers},
            bytes_received={w.id: w.bytes_received for w in self.workers},
            pushes=tuple(self.pushes),
            applies=tuple(self.applies),
            sends=tuple(self.sends),
            staleness=dict(sorted(self.staleness.items())),
            num_updates=self.core.version,
            num_gradients=self.gradients,
            evaluated_gradients=self.engine.evaluations,
            padded_gradients=self.engine.padded_evaluations,
            drops=sum(w.core.drops for w in self.workers),
            errors=tuple(self.errors),
            work_plans=tuple(self.plans),
            params=self.core.params,
            end_time=end,
            wall_seconds=wall,
            diverged=self.diverged,
        )


def _timeline(w: _Worker, end: float) -> tuple[Interval, ...]:
    """Compute spans plus blocked spans split into server waits and transfers."""
    out = [Interval(s, min(e, end), k) for s, e, k in w.compute_spans if s < end]
    waits = [(s, e) for s, e in w.server_waits if e > s]
    j = 0
    for start, stop in w.blocked_spans:
        stop = min(stop, end)
        if stop <= start:
            continue
        t = start
        while j < len(waits) and waits[j][1] <= t:
            j += 1
        k = j
        while k < len(waits) and waits[k][0] < stop:
            ws, we = max(waits[k][0], t), min(waits[k][1], stop)
            if ws > t:
                out.append(Interval(t, ws, "transfer"))
            if we > ws:
                out.append(Interval(ws, we, "wait"))
                t = we
            if waits[k][1] > stop:
                break
            k += 1
        if t < stop:
            out.append(Interval(t, stop, "transfer"))
    out.sort()
    return tuple(iv for iv in out if iv.end > iv.start)
