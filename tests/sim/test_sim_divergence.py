"""A simulated run whose loss or update goes non-finite stops and says when."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from test_sim import constant_workers, run

from hpsjax.sim import Divergence, SimConfig

# A step size at which this problem's loss overflows within a few updates.
DIVERGING_LR = 300.0


def _diverging(**kwargs):
    kwargs.setdefault("policy", "asp")
    kwargs.setdefault("learning_rate", DIVERGING_LR)
    return SimConfig(duration=5.0, eval_every=0.5, **kwargs)


def test_a_diverging_run_stops_where_it_diverged_and_says_so():
    result = run(constant_workers((0.1, 0.1, 0.2, 0.4)), _diverging())
    d = result.diverged
    assert isinstance(d, Divergence)
    assert d.reason == "loss" and not math.isfinite(d.loss)
    assert 0 < d.time < 5.0 and result.end_time == d.time
    assert d.worker_id in (0, 1, 2, 3) and d.version >= 1
    assert str(d).startswith(f"diverged at t = {d.time:.3g} s: worker {d.worker_id}")
    # The last evaluation is where it stopped, and nothing non-finite was
    # applied (the weights are huge, so their test loss may overflow).
    assert result.metrics["time"][-1] == d.time
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(result.params))
    assert not any(p.status == "rejected" for p in result.pushes)


def test_a_run_that_does_not_diverge_says_none():
    result = run(constant_workers((0.1, 0.2)), _diverging(learning_rate=0.1))
    assert result.diverged is None and result.end_time == 5.0


@pytest.mark.parametrize(
    "config",
    [
        dict(policy="bsp", server_optimizer=optax.sgd(DIVERGING_LR, momentum=0.9)),
        dict(local_optimizer=optax.sgd(DIVERGING_LR)),
    ],
    ids=["bsp_momentum", "local_steps"],
)
def test_divergence_is_found_under_a_barrier_and_with_local_steps(config):
    result = run(constant_workers((0.1, 0.1, 0.2, 0.4)), _diverging(**config))
    assert result.diverged is not None
    assert result.end_time == result.diverged.time < 5.0


def test_without_stopping_the_server_refuses_and_the_run_goes_on():
    result = run(
        constant_workers((0.1, 0.1, 0.2, 0.4)), _diverging(stop_on_divergence=False)
    )
    assert result.diverged is not None and result.diverged.reason == "update"
    assert result.end_time == 5.0
    rejected = [p for p in result.pushes if p.status == "rejected"]
    assert rejected and any("NonFiniteUpdate" in e for e in result.errors)


def test_stop_on_divergence_must_be_a_bool():
    with pytest.raises(ValueError, match="stop_on_divergence must be True or False"):
        SimConfig(duration=1.0, stop_on_divergence="yes")
