"""The plan counts the server: a barrier round's pushes wait for each other there.

Synthetic profiles only (no processes): the queue's arithmetic by hand, its
place in the predicted round and idle fraction, how it changes H-PS's batches,
where it comes from (the profiles' measured ``server_seconds`` or the
argument) and that it travels with a plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from hpsjax.planning._solve import _queue_seconds
from hpsjax.profiling import (
    Replanner,
    TransferProfile,
    WorkerProfile,
    WorkPlan,
    measure_transfer,
    plan,
)

SPEEDS = [100.0, 100.0, 200.0, 400.0]  # samples per second


def _workers(speeds=SPEEDS, transfer=0.01, server=None):
    out = []
    for i, s in enumerate(speeds):
        w = WorkerProfile.synthetic(i, s, transfer_seconds=transfer)
        if server is not None:
            w = dataclasses.replace(
                w, transfer=dataclasses.replace(w.transfer, server_seconds=server)
            )
        out.append(w)
    return out


@pytest.mark.parametrize(
    "arrivals, expected",
    [
        ([0.0, 0.0, 0.0], 2.0),  # all at once: the last waits for two
        ([0.0, 1.0, 2.0], 0.0),  # one service apart: none waits
        ([0.0, 0.5, 3.0], 0.0),  # the last comes after the queue emptied
        ([0.0, 0.5, 1.2], 0.8),  # done at 0, 1, 2: the last 0.8 after it came
        ([2.0, 0.0, 0.0, 2.0], 1.0),  # order does not matter
        ([5.0], 0.0),
    ],
)
def test_queue_by_hand(arrivals, expected):
    assert _queue_seconds(arrivals, 1.0) == pytest.approx(expected)
    assert _queue_seconds(arrivals, 0.0) == 0.0


def test_no_server_time_leaves_the_plan_as_it_was():
    for scheme in ("hps", "equal", "ashl", "adsp", "dylu", "ashl_reference"):
        base = plan(_workers(), scheme, global_batch=256)
        assert base.server_seconds == 0.0 and base.queue_seconds == 0.0
        zero = plan(_workers(server=0.05), scheme, global_batch=256, server_seconds=0)
        assert dataclasses.replace(zero, server_seconds=0.0) == base


def test_equal_workers_finishing_together_queue_n_minus_one_pushes():
    s = 0.02
    base = plan(_workers([100.0] * 4), "equal", global_batch=256)
    queued = plan(_workers([100.0] * 4), "equal", global_batch=256, server_seconds=s)
    # 64 samples at 100/s and a 10 ms round trip: 0.65 s, then 3 pushes ahead.
    assert base.round_time == pytest.approx(0.65)
    assert queued.queue_seconds == pytest.approx(3 * s)
    assert queued.round_time == pytest.approx(0.65 + 3 * s)
    # The queue is time every device waits.
    assert base.idle_fraction == pytest.approx(0.0, abs=1e-12)
    assert queued.idle_fraction == pytest.approx(1 - 0.65 / 0.71)
    assert [w.batch_size for w in queued.workers] == [64] * 4


def test_unequal_workers_with_equal_batches_arrive_apart_and_queue_less():
    s = 0.02
    p = plan(_workers(), "equal", global_batch=256, server_seconds=s)
    # Pushes done alone at 0.645, 0.645, 0.325, 0.165 s: only the two slow
    # workers' come together, and one waits for the other.
    assert p.queue_seconds == pytest.approx(s)
    assert p.round_time == pytest.approx(0.65 + s)


def test_hps_staggers_finish_times_when_the_server_queues():
    s = 0.02
    base = plan(_workers(), "hps", global_batch=256)
    assert [w.batch_size for w in base.workers] == [32, 32, 64, 128]
    assert base.round_time == pytest.approx(0.33)
    p = plan(_workers(server=s), "hps", global_batch=256)  # s from the profiles
    assert p.server_seconds == s
    batches = [w.batch_size for w in p.workers]
    assert sum(batches) == 256
    # The slow workers finish first with less, the fastest last with more...
    assert batches[0] < 32 and batches[1] < 32 and batches[3] > 128
    # ... so that little is queued and the round is shorter than the balanced
    # batches' round with all three pushes queued, yet longer than no server.
    balanced_queued = base.round_time + 3 * s
    assert p.queue_seconds < s
    assert base.round_time < p.round_time < balanced_queued
    # By hand: finish times 0.01 + place * s + b / speed equal at tau, the
    # fastest at place 0: sum of batches 800 (tau - 0.01) - 14 = 256.
    assert p.round_time == pytest.approx(0.01 + 270 / 800, abs=0.005)


def test_hps_round_grows_with_the_server_time_and_the_workers():
    rounds = [
        plan(_workers(), "hps", global_batch=256, server_seconds=s).round_time
        for s in (0.0, 0.005, 0.02, 0.08)
    ]
    assert rounds == sorted(rounds) and rounds[0] < rounds[-1]
    few = plan(_workers([100.0] * 2), "hps", global_batch=128, server_seconds=0.05)
    many = plan(_workers([100.0] * 8), "hps", global_batch=512, server_seconds=0.05)
    # The same compute per worker; more workers, more pushes to serve.
    assert many.round_time > few.round_time


def test_schemes_without_a_barrier_count_no_queue():
    for scheme in ("adsp", "dylu"):
        base = plan(_workers(), scheme, global_batch=256, local_steps=4)
        p = plan(_workers(), scheme, global_batch=256, local_steps=4, server_seconds=1)
        assert p.queue_seconds == 0.0
        assert p.round_time == base.round_time
        assert p.server_seconds == 1.0


def test_server_time_is_the_median_of_the_profiles_measured_ones():
    workers = _workers()
    workers = [
        dataclasses.replace(
            w, transfer=dataclasses.replace(w.transfer, server_seconds=s)
        )
        for w, s in zip(workers, [0.01, 0.03, None, 0.02], strict=True)
    ]
    assert plan(workers, "hps", global_batch=256).server_seconds == pytest.approx(0.02)
    assert (
        plan(workers, "hps", global_batch=256, server_seconds=0.5).server_seconds == 0.5
    )
    assert plan(_workers(), "hps", global_batch=256).server_seconds == 0.0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1", True])
def test_a_bad_server_time_is_one_line(bad):
    with pytest.raises(ValueError, match="server_seconds must be") as e:
        plan(_workers(), "hps", global_batch=256, server_seconds=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="server_seconds must be"):
        TransferProfile(0.1, 0.05, 0.05, 1, 1, "measured", server_seconds=bad)


def test_server_time_travels_with_plan_and_profile_json():
    p = plan(_workers(server=0.02), "hps", global_batch=256)
    assert WorkPlan.from_json(p.to_json()) == p
    w = _workers(server=0.02)[0]
    assert WorkerProfile.from_json(w.to_json()) == w
    # A plan written before the fields existed reads with none.
    import json

    old = json.loads(plan(_workers(), "hps", global_batch=256).to_json())
    del old["server_seconds"], old["queue_seconds"]
    read = WorkPlan.from_json(json.dumps(old))
    assert read.server_seconds == 0.0 and read.queue_seconds == 0.0


def test_a_replan_keeps_counting_the_server():
    p = plan(_workers(), "hps", global_batch=256, server_seconds=0.02)
    replanner = Replanner(p, cooldown=0.0, min_observations=2)
    new = None
    for k in range(4):
        # Worker 3 runs at half its planned speed.
        w = p.worker(3)
        new = replanner.observe(3, w.batch_size, 2 * w.step_time, now=float(k)) or new
    assert new is not None and new.revision == 1
    assert new.server_seconds == 0.02
    assert new.round_time > plan(_workers(), "hps", global_batch=256).round_time


class _Client:
    """A client whose push takes ``push`` seconds and a bare request ``bare``."""

    def __init__(self, push: float, bare: float):
        self.push_s, self.bare_s, self.closed = push, bare, False

    async def pull(self):
        return {"w": np.zeros(4, np.float32)}, 0

    async def push(self, update, *, version, codec=None):
        await asyncio.sleep(self.push_s)

    async def refresh_info(self):
        await asyncio.sleep(self.bare_s)


def test_measure_transfer_takes_the_push_beyond_a_bare_request_as_the_servers():
    t0 = time.perf_counter()
    link = asyncio.run(
        measure_transfer(_Client(0.06, 0.001), {"w": np.zeros(4, np.float32)})
    )
    # Sleeps are lower bounds; a loaded machine may stretch either.
    assert link.server_seconds is not None
    assert 0.03 < link.server_seconds <= link.push_seconds
    assert link.push_seconds >= 0.06
    assert time.perf_counter() - t0 < 30

    async def trip(update):
        await asyncio.sleep(0.001)

    # A round-trip callable has no bare request to set against.
    only_trips = asyncio.run(measure_transfer(trip, {"w": np.zeros(4, np.float32)}))
    assert only_trips.server_seconds is None
