"""The server core's decisions driven through an aggregator of plain NumPy.

``ServerCore`` decides (versions, clocks, waits, deadlines, refusals) and leaves
every array to its aggregator. Here a NumPy stand-in with the aggregator's
interface does the arithmetic (SGD on float64 arrays): the core's actions are
those it takes with the real, compiled aggregator, and its refusals change
nothing.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from hpsjax.decisions._core import (
    Applied,
    Drop,
    PlanChanged,
    PushAck,
    Release,
    SaveCheckpoint,
    SendParams,
    ServerCore,
    StageChanged,
    Wait,
)
from hpsjax.decisions._events import (
    PushBegun,
    SpeedMeasured,
    StageSet,
    Tick,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.decisions._policies import BSP, Hybrid, HybridStage, Policy, PolicyView
from hpsjax.wire._errors import (
    InvalidUpdate,
    NonFiniteUpdate,
    SpecMismatch,
    UnexpectedMessage,
    WorkerDropped,
)
from hpsjax.wire._messages import PushMeta

CORE = pathlib.Path(__file__).resolve().parents[2] / "hpsjax" / "decisions" / "_core.py"


class NumpyAggregator:
    """SGD with learning rate ``optimizer`` (a float) on dicts of NumPy arrays."""

    def __init__(self, params, optimizer, *, check_finite, check_result,
                 keep_stale_params, max_stale_copies):  # fmt: skip
        del check_result, max_stale_copies
        self.lr = float(optimizer)
        self._params = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.check_finite = check_finite
        self.keep_stale_params = keep_stale_params
        self.copies: dict[int, dict] = {}
        self.completes: list = []
        self.reset()

    @property
    def params(self):
        return self._params

    @property
    def opt_state(self):
        return ()

    def reset(self):
        self.buffer, self.samples = None, 0

    def check_update(self, update):
        if set(update) != set(self._params):
            raise SpecMismatch(f"keys {sorted(update)} differ from the parameters'")
        update = {k: np.asarray(v, np.float64) for k, v in update.items()}
        if self.check_finite and not all(np.isfinite(v).all() for v in update.values()):
            raise NonFiniteUpdate("update holds NaN or infinite values")
        return update

    def copy_of(self, version, current):
        return self._params if version == current else self.copies.get(version)

    def keep_copy(self, version):
        self.copies.setdefault(version, self._params)

    def drop_copy(self, version):
        self.copies.pop(version, None)

    @property
    def stale_versions(self):
        return tuple(sorted(self.copies))

    def params_at(self, version, current):
        return self._params if version == current else self.copies[version]

    def candidate(self, update, weight, samples, staleness, version, stale, *,
                  completes, args=None):  # fmt: skip
        del staleness, version, stale
        assert not args, "these tests' policies give the optimizer no arguments"
        self.completes.append(completes)
        total = self.samples + samples
        keep, w = self.samples / total, weight * samples / total
        buffer = {
            k: w * u if self.buffer is None else keep * self.buffer[k] + w * u
            for k, u in update.items()
        }
        if not all(np.isfinite(v).all() for v in buffer.values()):
            raise NonFiniteUpdate("the buffered average would be non-finite")
        return buffer, samples

    def commit(self, pending):
        self.buffer, samples = pending
        self.samples += samples

    def apply(self, version, staleness):
        del version, staleness
        self._params = {
            k: p - self.lr * self.buffer[k] for k, p in self._params.items()
        }
        self.reset()

    def check_restore(self, params, opt_state):
        del opt_state
        return params, None

    def restore(self, params, opt_state):
        del opt_state
        self.copies = {}
        self.reset()
        if params is not None:
            self._params = params


def numpy_core(policy="bsp", **kwargs):
    return ServerCore(
        {"w": np.zeros(3)}, 0.5, policy, aggregator=NumpyAggregator, **kwargs
    )


def upd(x):
    return {"w": np.full(3, x)}


@pytest.mark.parametrize(
    "module", sorted(p.name for p in CORE.parent.glob("*.py")), ids=str
)
def test_the_core_and_its_parts_compute_nothing_themselves(module):
    imported = set()
    source = (CORE.parent / module).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"jax", "optax", "flax"}


def test_a_bsp_round_waits_releases_and_averages_by_samples():
    core = numpy_core("bsp")
    for w in ("a", "b", "c"):
        assert core.join(w, 0.0) == [SendParams(w, 0, None)]
    acts = core.push("a", upd(1.0), version=0, now=1.0, num_samples=1)
    assert acts == [PushAck("a", 0, 0, "buffered", 1.0)]
    assert core.pull("a", 1.0) == [
        Wait("a", until=120.0, reason="bsp: round 1 not complete")
    ]
    core.push("b", upd(2.0), version=0, now=2.0, num_samples=1)
    acts = core.push("c", upd(4.0), version=0, now=3.0, num_samples=2)
    assert acts[0] == PushAck("c", 1, 0, "applied", 1.0)
    assert acts[1] == Applied(1, ("a", "b", "c"), 0, 3)
    assert acts[2:] == [Release("a", 1, 2.0), SendParams("a", 1, None)]
    # (1 + 2 + 2 * 4) / 4 samples, times the learning rate 0.5.
    np.testing.assert_allclose(core.params["w"], [-11 / 8] * 3)
    # Only the round's last push completes it, as BSP says before each push.
    assert core.aggregator.completes == [False, False, True]


@pytest.mark.parametrize(
    ("policy", "kwargs"),
    [("bsp", {}), ("ssp", {"staleness_bound": 1}), ("asp", {"aggregate": 2})],
)
def test_the_numpy_aggregator_gets_the_decisions_of_the_compiled_one(policy, kwargs):
    import optax  # the compiled aggregator's optimizer, for comparison only

    cores = [
        numpy_core(policy, policy_kwargs=kwargs),
        ServerCore({"w": np.zeros(3)}, optax.sgd(0.5), policy, policy_kwargs=kwargs),
    ]
    rng = np.random.default_rng(0)
    script = [(int(rng.integers(3)), float(rng.normal())) for _ in range(30)]
    answers = [[], []]
    for core, log in zip(cores, answers, strict=True):
        for w in range(3):
            log.append(core.join(w, 0.0))
        for step, (w, x) in enumerate(script):
            now = 1.0 + step
            log.append(core.tick(now))
            if w not in core.live:
                log.append(core.join(w, now))
                continue
            if core.is_waiting(w):
                continue
            version = core.pulled_version(w)
            log.append(core.push(w, upd(x), version=version, now=now))
            log.append(core.pull(w, now))
    assert answers[0] == answers[1]
    assert cores[0].version == cores[1].version > 0
    np.testing.assert_allclose(cores[0].params["w"], cores[1].params["w"], rtol=1e-5)


def test_handle_takes_each_event_to_its_decision():
    # The same round through the events as through the methods, action for action.
    core, twin = (
        numpy_core("bsp", initial_timeout=10.0),
        numpy_core("bsp", initial_timeout=10.0),
    )
    meta = PushMeta(version=0, num_samples=1)
    for w in ("a", "b"):
        assert core.handle(WorkerJoined(w, 0.0)) == twin.join(w, 0.0)
    assert core.handle(WorkerPushed("a", upd(1.0), meta, 1.0)) == twin.push_message(
        "a", upd(1.0), meta, now=1.0
    )
    assert core.handle(WorkerPulled("a", 1.0)) == twin.pull("a", 1.0)
    assert core.handle(Tick(10.0)) == twin.tick(10.0)
    assert core.handle(WorkerLeft("a", 11.0)) == twin.leave("a", 11.0)
    assert core.version == twin.version == 1 and core.live == twin.live
    assert core.handle(SpeedMeasured("a", 8, 0.1, 12.0)) == []  # no re-planner
    with pytest.raises(TypeError, match="not a server event"):
        core.handle(("pull", "a", 12.0))


def test_handle_sets_a_stage():
    core = hybrid_core()
    core.join("a", 0.0)
    assert core.handle(StageSet(1, 1.0)) == [StageChanged(1, 0)]
    assert core.handle(StageSet(1, 2.0)) == []


def test_a_checkpoint_is_asked_for_every_so_many_versions():
    core = numpy_core("asp", checkpoint_every_updates=2)
    core.join("a", 0.0)
    saves = []
    for v in range(5):
        acts = core.push("a", upd(1.0), version=v, now=1.0 + v)
        saves += [a.version for a in acts if isinstance(a, SaveCheckpoint)]
        # Asked for right after the apply that made the version.
        kinds = [type(a) for a in acts]
        if SaveCheckpoint in kinds:
            assert kinds.index(SaveCheckpoint) == kinds.index(Applied) + 1
    assert saves == [2, 4] and core.version == 5
    # A restored core counts from the version it restored.
    restored = numpy_core("asp", checkpoint_every_updates=2)
    restored.load_state_dict(core.state_dict(), params=core.params, opt_state=None)
    restored.join("a", 10.0)
    acts = restored.push("a", upd(1.0), version=5, now=11.0)
    assert not any(isinstance(a, SaveCheckpoint) for a in acts)
    acts = restored.push("a", upd(1.0), version=6, now=12.0)
    assert SaveCheckpoint(7) in acts
    plain = numpy_core("asp")
    plain.join("a", 0.0)
    acts = [a for v in range(3) for a in plain.push("a", upd(1.0), version=v, now=1.0)]
    assert not any(isinstance(a, SaveCheckpoint) for a in acts)
    with pytest.raises(ValueError, match="checkpoint_every_updates"):
        numpy_core("asp", checkpoint_every_updates=0)


def test_a_checkpoint_is_asked_for_every_so_many_seconds_when_the_version_moved():
    core = numpy_core("asp", checkpoint_every_s=10.0)
    assert core.next_deadline() is None  # the clock starts with the first event
    assert core.join("a", 5.0) == [SendParams("a", 0, None)]
    assert core.next_deadline() == 15.0
    # A waiting worker's Wait names its own deadline, never the save's.
    core.push("a", upd(1.0), version=0, now=6.0)
    assert core.handle(Tick(14.0)) == []
    assert core.handle(Tick(15.0)) == [SaveCheckpoint(1)]
    assert core.next_deadline() == 25.0
    # Nothing new: no save, and the next one is due ten seconds on.
    assert core.handle(Tick(25.0)) == []
    assert core.next_deadline() == 35.0
    core.push("a", upd(1.0), version=1, now=30.0)
    assert core.handle(Tick(36.0)) == [SaveCheckpoint(2)]
    held = numpy_core("bsp", checkpoint_every_s=100.0, initial_timeout=10.0)
    held.join("a", 0.0)
    held.join("b", 0.0)
    held.push("a", upd(1.0), version=0, now=1.0)
    wait = held.pull("a", 1.0)[0]
    assert isinstance(wait, Wait) and wait.until == 10.0
    with pytest.raises(ValueError, match="checkpoint_every_s"):
        numpy_core("asp", checkpoint_every_s=0)


def test_a_worker_past_its_deadline_is_dropped_and_the_round_goes_on():
    core = numpy_core("bsp", initial_timeout=10.0)
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    assert isinstance(core.pull("a", 1.0)[0], Wait)
    assert core.next_deadline() == 10.0
    assert core.tick(5.0) == []
    acts = core.tick(10.0)
    assert isinstance(acts[0], Drop) and acts[0].worker_id == "b"
    assert isinstance(acts[1], Applied) and acts[1].contributors == ("a",)
    assert core.live == {"a"} and core.version == 1
    with pytest.raises(WorkerDropped, match="join again"):
        core.push("b", upd(1.0), version=0, now=11.0)


def snapshot(core):
    return (
        core.version,
        core.buffered,
        core.workers(),
        {k: v.copy() for k, v in core.params.items()},
    )


@pytest.mark.parametrize(
    ("worker", "version", "update", "error"),
    [
        ("nobody", 0, upd(1.0), UnexpectedMessage),
        ("a", 3, upd(1.0), InvalidUpdate),
        ("a", 0, {"v": np.zeros(3)}, SpecMismatch),
        ("a", 0, upd(np.inf), NonFiniteUpdate),
    ],
)
def test_a_refused_push_changes_nothing(worker, version, update, error):
    core = numpy_core("asp", policy_kwargs={"aggregate": 2})
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("b", upd(1.0), version=0, now=0.5)
    before = snapshot(core)
    with pytest.raises(error):
        core.push(worker, update, version=version, now=1.0)
    after = snapshot(core)
    assert after[:3] == before[:3]
    np.testing.assert_array_equal(after[3]["w"], before[3]["w"])


def test_a_push_is_checked_once_where_it_enters_the_core():
    # No separate check before the update is read: the push's one way in
    # refuses it, and a push begun says nothing about whether it is valid.
    core = numpy_core("asp")
    core.join("a", 0.0)
    assert not hasattr(core, "check_push")
    with pytest.raises(InvalidUpdate, match=r"\[0, 0\]"):
        core.handle(WorkerPushed("a", upd(1.0), PushMeta(version=1), 0.5))
    with pytest.raises(UnexpectedMessage):
        core.handle(WorkerPushed("b", upd(1.0), PushMeta(version=0), 0.5))
    assert core.handle(PushBegun("b", 0, None, 0.5)) == []
    core.leave("a", 1.0)
    with pytest.raises(WorkerDropped):
        core.push_message("a", upd(1.0), PushMeta(version=0), now=2.0)
    assert core.version == 0


def test_policies_see_a_view_of_the_core_not_the_core():
    seen = set()

    class Recording(Policy):
        def admit(self, core, worker_id):
            seen.add(type(core))
            return True

        def judge(self, core, worker_id, staleness):
            seen.add(type(core))
            return super().judge(core, worker_id, staleness)

        def ready(self, core):
            seen.add(type(core))
            return core.buffered >= 1

    core = numpy_core(Recording())
    core.join("a", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    assert seen == {PolicyView}
    assert not hasattr(PolicyView(core), "params")


def test_bsp_says_which_push_completes_a_round():
    core = numpy_core("bsp")
    view = PolicyView(core)
    for w in ("a", "b"):
        core.join(w, 0.0)
    assert BSP().completes(view, "a") is False
    core.push("a", upd(1.0), version=0, now=1.0)
    assert BSP().completes(view, "b") is True
    # A policy that cannot tell before the push is recorded says None.
    assert Policy().completes(view, "b") is None


class _Replanner:
    """Records what it is fed; revises the plan on the second report."""

    def __init__(self, worker_ids):
        entries = [type("Entry", (), {"worker_id": w})() for w in worker_ids]
        self.plan = type("Plan", (), {"workers": entries})()
        self.seen = []

    def observe(self, worker_id, batch_size, time_per_step, now):
        self.seen.append((worker_id, batch_size, time_per_step, now))
        return "revised" if len(self.seen) == 2 else None


def test_the_core_feeds_its_replanner_the_workers_of_its_plan():
    replanner = _Replanner(["a", "b"])
    core = numpy_core("asp", replanner=replanner)
    assert core.replanner is replanner
    assert core.observe_speed("a", 32, 0.5, 1.0) == []
    assert core.observe_speed("nobody", 32, 0.5, 2.0) == []  # not planned
    assert core.observe_speed("b", 16, 0.25, 3.0) == [
        PlanChanged("revised", 0, "worker b's speed drifted")
    ]
    assert replanner.seen == [("a", 32, 0.5, 1.0), ("b", 16, 0.25, 3.0)]
    assert numpy_core("asp").observe_speed("a", 32, 0.5, 1.0) == []


def announcements(actions):
    return [a for a in actions if isinstance(a, StageChanged | PlanChanged)]


def test_the_push_that_revises_the_plan_announces_it_once():
    replanner = _Replanner(["a", "b"])
    core = numpy_core("asp", replanner=replanner)
    core.join("a", 0.0)
    core.join("b", 0.0)
    timed = {"step_time": 0.8, "num_samples": 64, "local_steps": 2}
    # A push without a measured speed feeds nothing.
    assert announcements(core.push("a", upd(1.0), version=0, now=1.0)) == []
    assert announcements(core.push("a", upd(1.0), version=1, now=2.0, **timed)) == []
    # Each local step: 32 samples in 0.4 s.
    acts = core.push("b", upd(1.0), version=2, now=3.0, **timed)
    assert replanner.seen == [("a", 32, 0.4, 2.0), ("b", 32, 0.4, 3.0)]
    assert announcements(acts) == [
        PlanChanged("revised", 3, "worker b's speed drifted")
    ]
    assert acts[-1] == announcements(acts)[0]  # after the push's own actions
    acts = core.push("b", upd(1.0), version=3, now=4.0, **timed)
    assert announcements(acts) == []  # the replanner revised nothing more


def test_a_driver_that_feeds_speeds_itself_gets_no_plan_from_pushes():
    replanner = _Replanner(["a"])
    core = numpy_core("asp", replanner=replanner, replan_from_pushes=False)
    core.join("a", 0.0)
    for step in range(3):
        acts = core.push(
            "a", upd(1.0), version=step, now=1.0 + step, step_time=0.5, num_samples=8
        )
        assert announcements(acts) == []
    assert replanner.seen == []


def hybrid_core(**kwargs):
    stages = [
        HybridStage("async", local_steps=4, until_version=2),
        HybridStage("sync"),
        HybridStage("async", local_steps=2),
    ]
    return numpy_core(Hybrid(stages), **kwargs)


def test_a_stage_reached_by_version_is_announced_once_by_the_push_that_applies():
    core = hybrid_core()
    assert core.stage == 0
    core.join("a", 0.0)
    core.join("b", 0.0)
    acts = core.push("a", upd(1.0), version=0, now=1.0)
    assert announcements(acts) == []
    acts = core.push("b", upd(1.0), version=0, now=2.0)
    # Version 2 ends stage 0: announced after the apply that made it.
    assert [type(a) for a in acts[1:]] == [Applied, StageChanged]
    assert acts[2] == StageChanged(1, 2)
    assert acts[0].stage == 1  # and the pusher's acknowledgement says so
    assert core.stage == 1
    for step, w in enumerate(("a", "b", "a")):
        assert announcements(core.pull(w, 3.0 + step)) == []
        assert announcements(core.push(w, upd(1.0), version=2, now=3.0 + step)) == []
    assert core.stage == 1 and core.policy.stage == 1


def test_a_stage_reached_by_an_apply_after_a_drop_is_announced_by_the_tick():
    stages = [HybridStage("sync", until_version=1), HybridStage("async", 3)]
    core = numpy_core(Hybrid(stages), initial_timeout=10.0)
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    assert isinstance(core.pull("a", 1.0)[0], Wait)
    acts = core.tick(10.0)
    assert [type(a) for a in acts] == [Drop, Applied, StageChanged, Release, SendParams]
    assert acts[2] == StageChanged(1, 1)
    # The released worker gets the new stage's hint after the announcement.
    assert acts[4] == SendParams("a", 1, 3)
    assert announcements(core.tick(20.0)) == []


def test_a_pushed_stage_is_announced_once():
    core = hybrid_core()
    core.join("a", 0.0)
    core.join("b", 0.0)
    acts = core.push("a", upd(1.0), version=0, now=1.0, stage=0)
    assert announcements(acts) == [] and acts[0].stage is None
    acts = core.push("b", upd(1.0), version=1, now=2.0, stage=2)
    # Version 2 moved it to stage 1, then the pushed stage to 2: each change
    # once, in order.
    assert announcements(acts) == [StageChanged(1, 2), StageChanged(2, 2)]
    assert acts[0].stage == 2
    acts = core.push("a", upd(1.0), version=2, now=3.0, stage=2)
    assert announcements(acts) == [] and acts[0].stage is None


def test_set_stage_announces_a_change_only():
    core = hybrid_core()
    core.join("a", 0.0)
    assert core.set_stage(0, 1.0) == []
    acts = core.set_stage(2, 2.0)
    assert acts == [StageChanged(2, 0)]
    assert core.set_stage(2, 3.0) == []
    with pytest.raises(ValueError, match="Stage index"):
        core.set_stage(3, 4.0)
    assert core.stage == 2


def test_a_stage_the_policy_moves_on_a_push_is_announced_once():
    class Switching(Hybrid):
        """Moves to stage 1 on the first push that reports a loss below 1."""

        def on_push(self, core, worker_id, now):
            super().on_push(core, worker_id, now)
            loss = core.worker(worker_id).last_loss
            if self.stage == 0 and loss is not None and loss < 1.0:
                self.set_stage(core, 1)

    core = numpy_core(Switching([HybridStage("async", 4), HybridStage("async", 1)]))
    core.join("a", 0.0)
    assert announcements(core.push("a", upd(1.0), version=0, now=1.0, loss=2.0)) == []
    acts = core.push("a", upd(1.0), version=1, now=2.0, loss=0.5)
    # Decided before the push's apply: announced ahead of it.
    assert [type(a) for a in acts] == [PushAck, StageChanged, Applied]
    assert acts[1] == StageChanged(1, 1) and acts[0].stage == 1
    assert acts[0].local_steps == 1
    assert announcements(core.push("a", upd(1.0), version=2, now=3.0, loss=0.1)) == []


def test_policies_without_stages_announce_nothing():
    core = numpy_core("bsp")
    assert core.stage is None
    core.join("a", 0.0)
    for step in range(3):
        acts = core.push("a", upd(1.0), version=step, now=1.0 + step, stage=1)
        assert announcements(acts) == [] and acts[0].stage is None
        core.pull("a", 1.0 + step)


def test_a_restored_stage_is_in_force_without_an_announcement():
    core = hybrid_core()
    core.join("a", 0.0)
    core.set_stage(2, 1.0)
    state = core.state_dict()
    other = hybrid_core()
    other.load_state_dict(state)
    assert other.stage == 2
    other.join("a", 0.0)
    acts = other.push("a", upd(1.0), version=0, now=1.0)
    assert announcements(acts) == [] and acts[0].local_steps == 2
