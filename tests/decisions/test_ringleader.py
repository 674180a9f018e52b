"""Ringleader ASGD: the policy's rounds and the gradient table's steps on the
server core, worked by hand, and the same pushes through the simulator's
deferring aggregator."""

import jax.numpy as jnp
import numpy as np
import pytest

from hpsjax.apply import DeferredAggregator
from hpsjax.decisions._core import PushAck, ServerCore
from hpsjax.decisions._policies import Ringleader, get_policy
from hpsjax.transforms import TABLE_OPS, gradient_table


def upd(x):
    return {"w": np.full(2, x, np.float32)}


def make(n=2, **kwargs):
    return ServerCore(
        {"w": jnp.zeros(2, jnp.float32)},
        gradient_table(1.0, num_slots=n),
        Ringleader(num_workers=n),
        **kwargs,
    )


# (worker, gradient, the table's operation, the parameters after, by hand)
SCRIPT = [
    # Phase 1: a's gradients fill its slot, no step (G_a = 1 + 3, b_a = 2).
    ("a", 1.0, "add", 0.0),
    ("a", 3.0, "add", 0.0),
    # b fills the last empty slot: the round's first step,
    # x = 0 - (4/2 + 2/1)/2 = -2; b is updated.
    ("b", 2.0, "add_step", -2.0),
    # b again: already updated, into the next round's table (G+_b = 10).
    ("b", 10.0, "add_next", -2.0),
    # a, not yet updated: into its slot (G_a = 9, b_a = 3) and a step,
    # x = -2 - (9/3 + 2/1)/2 = -4.5; all updated, so the next round's table
    # (only b's 10) becomes the table.
    ("a", 5.0, "add_step_roll", -4.5),
    # Round 2, phase 1: a fills the last empty slot and steps,
    # x = -4.5 - (1/1 + 10/1)/2 = -10.
    ("a", 1.0, "add_step", -10.0),
]


def _run(core):
    for w in "ab":
        core.join(w, 0.0)
    for t, (w, g, op, x) in enumerate(SCRIPT, start=1):
        assert TABLE_OPS[core.policy.operation(w)] == op
        ack = core.push(w, upd(g), version=core.version, now=float(t))[0]
        assert isinstance(ack, PushAck) and ack.status == "applied"
        core.pull(w, float(t))
        yield x


def test_rounds_and_steps_by_hand():
    core = make()
    for x in _run(core):
        assert np.asarray(core.params["w"]).tolist() == [x, x]
    # Every push is applied alone: one version each.
    assert core.version == len(SCRIPT)


def test_the_simulators_deferred_applies_give_the_same_parameters():
    core = make(aggregator=DeferredAggregator)
    for _ in _run(core):
        pass
    assert np.asarray(core.params["w"]).tolist() == [-10.0, -10.0]


def test_a_worker_beyond_the_table_is_ignored():
    core = make(n=1)
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)  # n = 1: fills and steps
    ack = core.push("b", upd(5.0), version=1, now=2.0)[0]
    assert (ack.status, ack.weight) == ("dropped", 0.0)
    assert "no table slot" in ack.reason
    assert np.asarray(core.params["w"]).tolist() == [-1.0, -1.0]


def test_its_state_survives_a_checkpoint():
    core = make()
    for _, x in zip(range(4), _run(core), strict=False):
        del x
    state = core.policy.state_dict()
    again = Ringleader(num_workers=2)
    again.load_state_dict(state)
    assert again.operation("a") == core.policy.operation("a") == 2
    assert again.operation("b") == core.policy.operation("b") == 3
    with pytest.raises(ValueError, match="bad ringleader state"):
        again.load_state_dict({"slots": 3})


@pytest.mark.parametrize(
    ("factory", "kwargs", "name"),
    [
        (get_policy, {"num_workers": 0}, "num_workers"),
        (lambda _, **k: gradient_table(0.1, **k), {"num_slots": 0}, "num_slots"),
        (
            lambda _, **k: gradient_table(**k),
            {"learning_rate": -1.0, "num_slots": 2},
            "learning_rate",
        ),
    ],
)
def test_bad_values_are_one_line(factory, kwargs, name):
    with pytest.raises(ValueError) as err:
        factory("ringleader", **kwargs)
    assert name in str(err.value) and "\n" not in str(err.value)
