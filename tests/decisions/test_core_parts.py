"""The parts ServerCore is composed of, each on its own: membership and
deadlines, versions and stale copies, stages and re-planning, who waits."""

from __future__ import annotations

import pytest

from hpsjax.decisions import (
    ASP,
    Applied,
    Hybrid,
    HybridStage,
    PlanChanged,
    Release,
    SaveCheckpoint,
    StageChanged,
    Wait,
)
from hpsjax.decisions._admission import Admission
from hpsjax.decisions._membership import Membership, WorkerRecord
from hpsjax.decisions._stages import Stages
from hpsjax.decisions._versions import Versions
from hpsjax.wire import InvalidUpdate, PushMeta, UnexpectedMessage, WorkerDropped


def _members(**kwargs):
    args = dict(
        deadline_factor=4.0,
        min_timeout=1.0,
        max_timeout=None,
        initial_timeout=100.0,
        ewma_alpha=0.5,
        straggler_factor=2.0,
    )
    return Membership(**(args | kwargs))


def _joined(members, worker_id, now=0.0):
    rec = members.workers.setdefault(worker_id, WorkerRecord(worker_id))
    members.join(rec, now)
    return rec


def test_membership_places_a_joiner_at_the_slowest_clock_and_times_its_pushes():
    members = _members()
    a = _joined(members, "a")
    members.record_push(a, PushMeta(version=0, step_time=1.5), now=2.0)
    members.record_push(a, PushMeta(version=0, step_time=1.5), now=4.0)
    assert (a.clock, a.interval, a.step_time, a.overhead) == (2, 2.0, 1.5, 0.5)
    b = _joined(members, "b", now=4.0)
    assert b.clock == 2 and members.min_clock == 2 and members.max_clock == 2
    members.remove(a, "gone")
    assert members.live_view == frozenset({"b"}) and members.info("a").live is False
    with pytest.raises(WorkerDropped, match="gone"):
        members.live_record("a")
    with pytest.raises(UnexpectedMessage):
        members.record("z")


def test_membership_deadlines_count_only_while_a_pull_is_blocked():
    members = _members()
    a, b = _joined(members, "a"), _joined(members, "b")
    members.progress(a, 0.0)
    members.progress(b, 0.0)
    assert members.next_deadline() is None and members.expired(500.0) == []
    members.waiting["a"] = 0.0
    # The blocked worker has no deadline of its own; the other has the
    # initial timeout of a worker not yet measured.
    assert members.next_deadline() == 100.0
    assert members.expired(99.0) == []
    assert members.expired(100.0) == [b]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deadline_factor": 0}, "deadline_factor"),
        ({"max_timeout": 0.5}, "max_timeout"),
        ({"ewma_alpha": 1.5}, "ewma_alpha"),
    ],
)
def test_membership_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _members(**kwargs)


class _Arithmetic:
    """The few aggregator members the versions part calls, recorded."""

    def __init__(self):
        self.calls = []

    def apply(self, version, staleness):
        self.calls.append(("apply", version, staleness))

    def keep_copy(self, version):
        self.calls.append(("keep", version))

    def drop_copy(self, version):
        self.calls.append(("drop", version))

    def copy_of(self, version, current):
        return None


def test_versions_apply_the_buffer_and_ask_for_checkpoints_by_versions_and_seconds():
    agg = _Arithmetic()
    versions = Versions(
        agg,
        keep_stale_params=False,
        checkpoint_every_updates=2,
        checkpoint_every_s=10.0,
    )
    workers = {"a": WorkerRecord("a")}
    versions.clock(0.0)
    for step in range(2):
        versions.buffer("a", step)
        actions = []
        versions.apply(workers, actions)
    assert actions == [Applied(2, ("a",), 1, 1), SaveCheckpoint(2)]
    assert workers["a"].applied == 2 and versions.contributors == []
    actions = []
    versions.timed_save(9.0, actions)
    versions.timed_save(10.0, actions)
    versions.timed_save(20.0, actions)  # the version did not move
    assert actions == [SaveCheckpoint(2)] and versions.save_at == 30.0


def test_versions_keep_a_copy_while_a_live_worker_may_push_against_it():
    agg = _Arithmetic()
    versions = Versions(agg, keep_stale_params=True, checkpoint_every_updates=None)
    a, b = WorkerRecord("a"), WorkerRecord("b")
    versions.sent(a)
    versions.sent(b)
    versions.buffer("a", 0)
    versions.apply({"a": a}, [])
    versions.sent(a)
    versions.pushed(a, 1)
    versions.forget(b)
    assert agg.calls == [
        ("keep", 0),
        ("keep", 0),
        ("apply", 1, 0),
        ("keep", 1),
        ("drop", 0),
    ]
    assert versions.judge(ASP(), None, "a", 0)[:3] == (
        0.0,
        True,
        "no stale copy of version 0 is kept",
    )


def test_versions_weigh_pushes_by_worker_and_refuse_bad_weights():
    versions = Versions(
        _Arithmetic(),
        keep_stale_params=False,
        checkpoint_every_updates=None,
        push_weights={"a": 0.5},
    )
    assert versions.judge(ASP(), None, "a", 0) == (0.5, False, None, None, None)
    assert versions.start_apply("a", 0, None).plan == (0.5, 1, 0)
    assert versions.start_apply("b", 0, 8).plan == (1.0, 8, 0)
    with pytest.raises(ValueError, match="push_weights"):
        Versions(
            _Arithmetic(),
            keep_stale_params=False,
            checkpoint_every_updates=None,
            push_weights={"a": -1},
        )


class _Replanner:
    def __init__(self, revise):
        self.revise = revise
        self.plan = type("Plan", (), {"workers": [type("E", (), {"worker_id": "a"})]})

    def observe(self, worker_id, batch_size, time_per_step, now):
        return "revised" if self.revise else None


def test_stages_announce_each_change_once_and_refuse_a_stage_past_the_last():
    policy = Hybrid([HybridStage("async"), HybridStage("sync")])
    stages = Stages(policy, None, replan_from_pushes=True)
    assert stages.switch(PushMeta(version=0, stage=1)) is True
    assert stages.switch(PushMeta(version=0, stage=0)) is False
    with pytest.raises(InvalidUpdate, match="past the policy's last stage 1"):
        stages.switch(PushMeta(version=0, stage=2))
    policy.set_stage(None, 1)
    actions = []
    stages.note(3, actions)
    stages.note(3, actions)
    assert actions == [StageChanged(1, 3)] and stages.stage == 1


def test_stages_feed_the_replanner_and_announce_its_plan():
    stages = Stages(ASP(), _Replanner(True), replan_from_pushes=True)
    meta = PushMeta(version=0, step_time=2.0, num_samples=64, local_steps=4)
    assert stages.observe_push("a", meta, 0.1, 1.0, 5) == [
        PlanChanged("revised", 5, "worker a's speed drifted")
    ]
    # A worker the plan does not name, or pushes not fed: nothing.
    assert stages.observe_speed("z", 16, 0.5, 1.0, 5) == []
    quiet = Stages(ASP(), _Replanner(True), replan_from_pushes=False)
    assert quiet.observe_push("a", meta, 0.1, 1.0, 5) == []


def test_admission_holds_the_start_then_releases_in_order():
    members = _members()
    sent = []
    admission = Admission(
        ASP(),
        None,
        members,
        expected_workers=2,
        start_timeout=30.0,
        send=lambda rec, now, actions: sent.append(rec.worker_id),
    )
    a = _joined(members, "a")
    admission.joined(0.0)
    actions = []
    admission.pull(a, 0.0, 0, lambda: None, actions)
    assert actions == [Wait("a", None, "start: 1 of 2 expected workers live")]
    assert admission.start_deadline() == 30.0 and not admission.started
    admission.tick(30.0)
    assert admission.started and admission.start_deadline() is None
    # Once started, the policy (ASP: everyone) admits the held pull.
    actions = []
    admission.release(31.0, 0, actions)
    assert actions == [Release("a", 0, 31.0)] and sent == ["a"]
    with pytest.raises(ValueError, match="start_timeout"):
        Admission(
            ASP(), None, members, expected_workers=None, start_timeout=0, send=None
        )
