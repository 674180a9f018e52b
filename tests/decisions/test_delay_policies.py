"""The naive optimal baseline of the delay papers (SGD over the m fastest
workers): its choice of m and one round of it on the server core, by hand."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.decisions._core import ServerCore
from hpsjax.decisions._policies import NaiveOptimal, get_policy
from hpsjax.decisions._policies_delay import fastest_count


def upd(x):
    return {"w": np.full(2, x, np.float32)}


def make(policy):
    return ServerCore({"w": jnp.zeros(2, jnp.float32)}, optax.sgd(1.0), policy)


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_fastest_count_minimises_the_time_complexity_by_hand():
    times = [10.0, 1.0, 1.5]
    # Minibatch: tau_(m) (1 + S/m); S = 4: m=1: 1*5 = 5, m=2: 1.5*3 = 4.5,
    # m=3: 10*(7/3) = 23.3.
    assert fastest_count(times, 4.0) == 2
    # S = 1: 2, 2.25, 13.3.
    assert fastest_count(times, 1.0) == 1
    # Asynchronous: (mean of 1/tau)^-1 (1 + S/m); S = 4: m=1: 5,
    # m=2: 1.2*3 = 3.6, m=3: (3/(1 + 2/3 + 0.1)) (7/3) = 3.96.
    assert fastest_count(times, 4.0, asynchronous=True) == 2
    # Equal workers: all of them.
    assert fastest_count([2.0] * 5, 3.0) == 5
    with pytest.raises(ValueError, match="at least one"):
        fastest_count([], 1.0)


def test_one_round_measures_then_only_the_m_fastest_train_by_hand():
    core = make(NaiveOptimal(noise_ratio=4.0))
    for w in "abc":
        core.join(w, 0.0)
    # Round 1: nobody is measured yet, so everyone takes part.
    for w, t, x in [("a", 1.0, 1.0), ("b", 1.5, 2.0)]:
        assert core.push(w, upd(x), version=0, now=t, step_time=t)[0].status == (
            "buffered"
        )
        assert kinds(core.pull(w, t)) == ["Wait"]
    last = core.push("c", upd(6.0), version=0, now=10.0, step_time=10.0)
    assert last[0].status == "applied"
    # SGD(1) on the mean of 1, 2, 6.
    assert np.asarray(core.params["w"]).tolist() == [-3, -3]
    # Measured 1, 1.5, 10 s with S = 4: m = 2, a and b.
    assert core.policy.chosen(core) == {"a", "b"}
    assert kinds(core.pull("c", 10.0)) == ["Wait"]
    assert "not one of the m fastest" in core.pull("c", 10.0)[0].reason
    core.push("a", upd(1.0), version=1, now=11.0, step_time=1.0)
    assert core.version == 1  # waits for b, not for c
    assert core.push("b", upd(3.0), version=1, now=11.5, step_time=1.5)[0].status == (
        "applied"
    )
    # x_2 = -3 - mean(1, 3).
    assert core.version == 2
    assert np.asarray(core.params["w"]).tolist() == [-5, -5]


def test_a_fixed_m_and_the_asynchronous_form():
    core = make(NaiveOptimal(workers=1, asynchronous=True))
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0, step_time=1.0)
    assert core.version == 1  # applied at once
    core.push("b", upd(1.0), version=0, now=2.0, step_time=2.0)
    assert core.policy.chosen(core) == {"a"}
    # b is measured slower: its next push is ignored and its pull waits.
    ack = core.push("b", upd(5.0), version=2, now=4.0, step_time=2.0)[0]
    assert (ack.status, ack.weight) == ("dropped", 0.0)
    assert kinds(core.pull("b", 4.0)) == ["Wait"]
    assert kinds(core.pull("a", 4.0)) == ["SendParams"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"workers": 0}, "workers"),
        ({"noise_ratio": -1.0}, "noise_ratio"),
        ({"asynchronous": "no"}, "asynchronous"),
    ],
)
def test_bad_values_are_one_line(kwargs, name):
    with pytest.raises(ValueError) as err:
        get_policy("naive_optimal", **kwargs)
    assert name in str(err.value) and "\n" not in str(err.value)
