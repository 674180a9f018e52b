"""WorkerCore: every worker rule as a sequence of events and the actions due."""

from __future__ import annotations

import pytest

from hpsjax.worker import WorkerCore
from hpsjax.worker._core import (
    Acked,
    Compute,
    Computed,
    Discard,
    Dropped,
    ForcePulled,
    Join,
    Joined,
    KeepParams,
    Left,
    PlanChanged,
    Pull,
    Pulled,
    Push,
    Report,
    Reported,
    StepsHinted,
    Stop,
    StopRequested,
    ewma,
)


def kinds(actions):
    return [type(a).__name__ for a in actions]


def started(core, version=0, now=0.0):
    """Joins and returns the first round's Compute."""
    assert core.handle(Joined(now)) == [Join(1)]
    actions = core.handle(Pulled(1, version, now))
    assert actions[0] == KeepParams(version)
    return actions[-1]


def finish(core, compute, now, step_time, **kw):
    """Compute done and reported: the actions after the report."""
    first = core.handle(Computed(compute.round, now, step_time, **kw))
    assert first == [Report(compute.batch_size, step_time / compute.local_steps, now)]
    return core.handle(Reported(now))


def test_round_trip_without_pipeline():
    core = WorkerCore(device_batches=(16, 16))
    compute = started(core)
    assert compute == Compute(0, 0, (16, 16), 1, 1.0)
    after = finish(core, compute, 1.0, 1.0, loss=2.5)
    assert kinds(after) == ["Push"]
    push = after[0]
    assert push.with_pull and push.version == 0 and push.meta.num_samples == 32
    assert push.meta.to_wire() == {
        "version": 0,
        "step_time": 1.0,
        "num_samples": 32,
        "local_steps": 1,
        "loss": 2.5,
    }
    # The next round waits for the pull answering the push.
    assert kinds(core.handle(Acked(1, 1, 1.1))) == []
    nxt = core.handle(Pulled(1, 1, 1.2))
    assert nxt == [KeepParams(1), Compute(1, 1, (16, 16), 1, 1.0)]


def test_pipeline_pushes_previous_round_and_pulls_at_round_start():
    core = WorkerCore(device_batches=(8,), overlap="pipeline", local_steps=2)
    core.handle(Joined(0.0))
    first = core.handle(Pulled(1, 0, 0.0))
    assert kinds(first) == ["KeepParams", "Pull", "Compute"]
    # Compute ends before the pull is answered: the worker waits.
    assert finish(core, first[-1], 1.0, 1.0) == []
    second = core.handle(Pulled(1, 3, 1.5))
    assert kinds(second) == ["KeepParams", "Push", "Pull", "Compute"]
    push = second[1]
    assert (push.round, push.version, push.with_pull) == (0, 0, False)
    assert push.meta.num_samples == 16 and push.meta.local_steps == 2
    # The pull answered before the compute ended: the next round starts at once.
    core.handle(Pulled(1, 4, 1.6))
    third = finish(core, second[-1], 2.5, 1.0)
    assert kinds(third) == ["Push", "Pull", "Compute"]
    assert third[-1].version == 4


def test_pipeline_with_pull_with_push_sends_one_push_pull_a_round():
    core = WorkerCore(device_batches=(8,), overlap="pipeline", pull_with_push=True)
    core.handle(Joined(0.0))
    first = core.handle(Pulled(1, 0, 0.0))
    # Nothing to push yet: the first round still pulls.
    assert kinds(first) == ["KeepParams", "Pull", "Compute"]
    assert finish(core, first[-1], 1.0, 1.0) == []
    second = core.handle(Pulled(1, 1, 1.5))
    # The push carries the pull: no pull request of its own.
    assert kinds(second) == ["KeepParams", "Push", "Compute"]
    push = second[1]
    assert (push.round, push.version, push.with_pull) == (0, 0, True)
    assert core.pull_in_flight
    # The answer (acknowledgement, then parameters) comes while computing.
    assert core.handle(Acked(1, 2, 1.9, None, False, None)) == []
    assert core.handle(Pulled(1, 2, 1.9)) == [KeepParams(2)]
    third = finish(core, second[-1], 2.5, 1.0)
    assert kinds(third) == ["Push", "Compute"] and third[0].with_pull
    assert third[-1].version == 2
    # The last update is flushed by a push without a pull.
    core.handle(StopRequested())
    core.handle(Pulled(1, 3, 2.6))
    last = finish(core, third[-1], 3.0, 0.5)
    assert kinds(last) == ["Push", "Stop"]
    assert last[0].final and not last[0].with_pull


def test_pull_with_push_needs_the_pipeline():
    core = WorkerCore(device_batches=(8,), pull_with_push=True)
    assert not core.pull_with_push
    core.handle(Joined(0.0))
    first = core.handle(Pulled(1, 0, 0.0))
    assert kinds(first) == ["KeepParams", "Compute"]
    assert kinds(finish(core, first[-1], 1.0, 1.0)) == ["Push"]


def test_eager_pull_rule():
    core = WorkerCore(device_batches=(8,), overlap="eager", eager_pulls=3)
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.1))[-1]  # pull took 0.1 s
    # No compute time measured yet: no eager pull.
    assert core.handle(Pulled(1, 1, 0.2)) == [KeepParams(1)]
    # The pull is in: round 1 starts when round 0 ends, and pulls.
    assert kinds(finish(core, compute, 1.0, 0.9)) == ["Push", "Pull", "Compute"]
    # 0.9 s of compute expected, 0.1 s gone, pulls take 0.1 s: pull again.
    assert core.handle(Pulled(1, 2, 1.1)) == [KeepParams(2), Pull(1, eager=True)]
    assert core.handle(Pulled(1, 3, 1.2)) == [KeepParams(3), Pull(1, eager=True)]
    # Three pulls this round: no more.
    assert core.handle(Pulled(1, 4, 1.3)) == [KeepParams(4)]


@pytest.mark.parametrize(
    ("overlap", "pipeline", "eager_pulls"),
    [("none", False, 1), ("pipeline", True, 1), ("eager", True, 3)],
)
def test_overlap_sets_the_pipeline_and_eager_pulls_only_when_eager(
    overlap, pipeline, eager_pulls
):
    core = WorkerCore(device_batches=(8,), overlap=overlap, eager_pulls=3)
    assert core.pipeline is pipeline and core.eager_pulls == eager_pulls


def test_eager_pull_skipped_when_compute_ends_soon_and_old_params_ignored():
    core = WorkerCore(device_batches=(8,), overlap="eager", eager_pulls=3)
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 5, 0.1))[-1]
    core.handle(Pulled(1, 5, 0.2))
    finish(core, compute, 1.0, 0.9)
    core.handle(Pulled(1, 6, 1.0))
    # 0.9 - 0.6 < 2 * pull time: no pull; an older version is not kept.
    assert core.handle(Pulled(1, 4, 1.6)) == []


def test_staleness_estimate_scales_update():
    core = WorkerCore(device_batches=(8,), staleness_lr="inverse_plus_one")
    compute = started(core, version=2)
    core.handle(Acked(1, 6, 0.5))  # heard of version 6 meanwhile
    push = finish(core, compute, 1.0, 1.0)[0]
    assert push.staleness_estimate == 4
    assert push.lr_factor == pytest.approx(0.2)
    core = WorkerCore(device_batches=(8,), staleness_lr=lambda tau: 0.5**tau)
    compute = started(core)
    core.handle(Acked(1, 2, 0.5))
    assert finish(core, compute, 1.0, 1.0)[0].lr_factor == 0.25


def test_force_pull_discards_with_pipeline_only():
    core = WorkerCore(device_batches=(8,), overlap="pipeline")
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    assert core.handle(Acked(1, 3, 0.5, force_pull=True)) == []
    core.handle(Pulled(1, 3, 0.6))
    after = core.handle(Computed(compute.round, 1.0, 1.0))
    assert after[0] == Discard(0)
    assert kinds(after) == ["Discard", "Pull", "Compute"]  # nothing pushed
    # Without the pipeline nothing was computed on old parameters: ignored.
    core = WorkerCore(device_batches=(8,))
    compute = started(core)
    assert core.handle(ForcePulled(1)) == []
    assert kinds(finish(core, compute, 1.0, 1.0)) == ["Push"]


def test_force_pull_while_waiting_discards_the_pending_update():
    core = WorkerCore(device_batches=(8,), overlap="pipeline")
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    finish(core, compute, 1.0, 1.0)  # pending, waiting for the pull
    assert core.handle(ForcePulled(1)) == [Discard(0)]
    assert kinds(core.handle(Pulled(1, 2, 1.2))) == ["KeepParams", "Pull", "Compute"]


def test_dropped_twice_rejoins_and_ignores_the_old_session():
    core = WorkerCore(device_batches=(8,), overlap="pipeline")
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    core.handle(StepsHinted(4))
    assert core.handle(Dropped(1, 0.5)) == [Join(2)]
    assert core.local_steps == 1  # a rejoin forgets the hints
    # Answers to the dropped session are ignored.
    assert core.handle(Pulled(1, 7, 0.6)) == []
    assert core.handle(Dropped(1, 0.6)) == []
    core.handle(Pulled(2, 7, 0.7))
    assert kinds(core.handle(Computed(compute.round, 1.0, 1.0))) == [
        "Discard",
        "Pull",
        "Compute",
    ]
    assert core.handle(Dropped(2, 1.5)) == [Join(3)]
    assert kinds(core.handle(Pulled(3, 9, 1.6))) == ["KeepParams"]
    assert core.drops == 2


def test_drop_without_pipeline_restarts_when_rejoined():
    core = WorkerCore(device_batches=(8,))
    compute = started(core)
    core.handle(Dropped(1, 0.5))
    core.handle(Pulled(2, 4, 0.6))
    # The round computed before the drop is thrown away; the next starts at once.
    after = core.handle(Computed(compute.round, 1.0, 1.0))
    assert after == [Discard(0), Compute(1, 4, (8,), 1, 1.0)]


def test_plans_and_hints():
    core = WorkerCore(device_batches=(32,), local_steps=2)
    core.handle(PlanChanged(revision=2, device_batches=(48,), lr_scale=0.5))
    core.handle(PlanChanged(revision=1, device_batches=(8,), local_steps=9))
    compute = started(core)
    assert compute == Compute(0, 0, (48,), 2, 0.5)
    core.handle(StepsHinted(5))
    core.handle(PlanChanged(revision=3, local_steps=3))
    assert core.local_steps == 5  # the server's hint overrides the plan
    grads = WorkerCore(device_batches=(8,), pushes_gradients=True)
    grads.handle(StepsHinted(4))
    grads.handle(PlanChanged(local_steps=3))
    assert grads.local_steps == 1
    deaf = WorkerCore(device_batches=(8,), follow_hints=False)
    deaf.handle(PlanChanged(revision=1, device_batches=(4,)))
    deaf.handle(StepsHinted(3))
    assert (deaf.device_batches, deaf.local_steps) == ((8,), 1)


def test_stage_travels_with_the_push():
    core = WorkerCore(device_batches=(8,), local_steps=4)
    compute = started(core)
    push = finish(core, compute, 1.0, 2.0, loss=0.1, local_steps=4, stage=1)[0]
    assert push.meta.stage == 1 and push.meta.to_wire()["stage"] == 1
    assert Report(8, 0.5, 1.0) != push


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"max_steps": 2}, "max_steps"),
        ({"until_version": 2}, "until_version"),
        ({"max_seconds": 1.5}, "max_seconds"),
    ],
)
def test_the_run_ends_and_flushes_the_last_update(kwargs, reason):
    core = WorkerCore(device_batches=(8,), overlap="pipeline", **kwargs)
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    core.handle(Pulled(1, 1, 0.5))
    compute = finish(core, compute, 1.0, 1.0)[-1]
    core.handle(Pulled(1, 2, 1.5))
    end = finish(core, compute, 2.0, 1.0)
    assert kinds(end) == ["Push", "Stop"]
    assert end[0].final and end[0].round == 1 and end[1] == Stop(reason)
    assert core.done and core.handle(Pulled(1, 3, 2.5)) == []


def test_stop_requested_and_left():
    core = WorkerCore(device_batches=(8,))
    compute = started(core)
    core.handle(StopRequested())
    push = finish(core, compute, 1.0, 1.0)[0]
    assert kinds(core.handle(Pulled(1, 1, 1.1))) == ["KeepParams", "Stop"]
    assert core.ended_by == "stopped" and push.with_pull
    core = WorkerCore(device_batches=(8,), overlap="pipeline")
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    assert core.handle(Left(0.5)) == [Discard(0), Stop("left")]
    assert core.handle(Computed(compute.round, 1.0, 1.0)) == []


def test_speed_estimates():
    assert ewma(None, 2.0) == 2.0
    assert ewma(2.0, 4.0) == pytest.approx(2.6)
    core = WorkerCore(device_batches=(8,))
    compute = started(core)
    finish(core, compute, 3.0, 3.0)
    core.handle(Pulled(1, 1, 3.5))
    assert core.compute_ewma == 3.0 and core.pull_ewma == pytest.approx(0.15)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device_batches": ()}, "device_batches is empty"),
        ({"device_batches": (0,)}, "device_batches entry"),
        ({"device_batches": (8,), "local_steps": 0}, "local_steps"),
        ({"device_batches": (8,), "eager_pulls": True}, "eager_pulls"),
        (
            {"device_batches": (8,), "overlap": "sideways"},
            "Unknown overlap 'sideways'; valid modes are none, pipeline, eager",
        ),
        ({"device_batches": (8,), "lr_scale": -1.0}, "lr_scale"),
        ({"device_batches": (8,), "staleness_lr": "nope"}, "unknown staleness_lr"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerCore(**kwargs)


def test_unknown_event():
    with pytest.raises(TypeError, match="not a worker event"):
        WorkerCore(device_batches=(8,)).handle(Push)
