"""Ringmaster ASGD with calculation stops: the policy's decision on the server
core (worked by hand) and the worker core carrying it out (the simulator:
``tests/experiments/test_delay_methods.py``)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.decisions._core import ForcePull, ServerCore
from hpsjax.decisions._policies import Ringmaster, get_policy
from hpsjax.worker import (
    Acked,
    Compute,
    Computed,
    Discard,
    Joined,
    Pull,
    Pulled,
    Reported,
    StopComputing,
    WorkerCore,
)


def upd(x):
    return {"w": np.full(2, x, np.float32)}


def make(policy):
    return ServerCore({"w": jnp.zeros(2, jnp.float32)}, optax.sgd(1.0), policy)


def stops(actions):
    return [a for a in actions if isinstance(a, ForcePull) and a.stop]


def test_a_computation_r_versions_behind_is_stopped_once_by_hand():
    core = make(Ringmaster(delay_threshold=2, stop_stale=True))
    for w in "abc":
        core.join(w, 0.0)  # each computes on version 0
    # a's gradient makes version 1: c is 1 < R behind.
    assert stops(core.push("a", upd(1.0), version=0, now=1.0)) == []
    # b's (staleness 1 < R) makes version 2: c, still computing on version 0,
    # is R behind and is stopped; a and b pushed their version-0 gradients and
    # await their pulls, so they are not.
    second = core.push("b", upd(1.0), version=0, now=1.1)
    assert second[0].status == "applied"
    assert stops(second) == [
        ForcePull(
            "c", "ringmaster: computing on version 0, 2 >= R = 2 behind, stopped", True
        )
    ]
    # Two SGD steps of 1.0 each: x_2 = 0 - 1 - 1.
    assert core.version == 2 and np.asarray(core.params["w"]).tolist() == [-2, -2]
    # a pulls version 2 and pushes again: version 3; c is stopped only once.
    core.pull("a", 1.2)
    assert stops(core.push("a", upd(1.0), version=2, now=2.0)) == []
    # c pulls version 3 and computes on it; b, on version 0 until it pulls,
    # pulls version 3 too. Two more versions put both R behind.
    core.pull("c", 2.1)
    core.pull("b", 2.1)
    core.pull("a", 2.1)
    core.push("a", upd(1.0), version=3, now=3.0)
    core.pull("a", 3.0)
    fifth = core.push("a", upd(1.0), version=4, now=4.0)
    assert [s.worker_id for s in stops(fifth)] == ["b", "c"]
    assert core.version == 5 and np.asarray(core.params["w"]).tolist() == [-5, -5]


def test_without_stop_stale_nobody_is_stopped():
    core = make(Ringmaster(delay_threshold=2))
    for w in "abc":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    assert stops(core.push("b", upd(1.0), version=0, now=1.1)) == []


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bad_stop_stale_is_one_line(bad):
    with pytest.raises(ValueError) as err:
        get_policy("ringmaster", stop_stale=bad)
    assert "stop_stale" in str(err.value) and "\n" not in str(err.value)


def test_the_worker_stops_its_round_and_pulls_at_once():
    core = WorkerCore(device_batches=(8,))
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.1))[-1]
    assert isinstance(compute, Compute) and compute.version == 0
    assert core.handle(StopComputing(1, 0.5)) == [Discard(0), Pull(1, False)]
    # The stopped round's end, if it still comes, is ignored.
    assert core.handle(Computed(0, 1.0, 0.9)) == []
    nxt = core.handle(Pulled(1, 4, 0.6))[-1]
    assert isinstance(nxt, Compute) and (nxt.round, nxt.version) == (1, 4)
    # A stop that comes after the round was pushed changes nothing.
    core.handle(Computed(1, 1.6, 1.0))
    assert core.handle(Reported(1.6))[0].meta.version == 4
    assert core.handle(StopComputing(1, 1.7)) == []
    assert core.handle(Acked(1, 5, 1.8)) == []


def test_a_pipelined_worker_drops_the_stopped_round_when_it_ends():
    core = WorkerCore(device_batches=(8,), overlap="pipeline")
    core.handle(Joined(0.0))
    compute = core.handle(Pulled(1, 0, 0.0))[-1]
    assert core.handle(StopComputing(1, 0.5)) == []
    core.handle(Pulled(1, 3, 0.6))
    after = core.handle(Computed(compute.round, 1.0, 1.0))
    assert after[0] == Discard(0)
