"""The delay family in the simulator, each on the quick setting: Ringmaster
ASGD with calculation stops, the naive optimal baseline (and Ringleader
ASGD): each trains, and does what its rule says."""

import pytest

from experiments import registry, train


def _quick(scheme, **changes):
    config = registry.load_config(scheme, "quick")
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    registry.check_config(config)
    return config


def test_stopping_in_the_simulator_wastes_no_late_gradient(tmp_path):
    base = train.train_and_evaluate(
        _quick("ringmaster", **{"server.policy_kwargs.delay_threshold": 2}),
        tmp_path / "drop",
        progress=False,
        formats=(),
    )["info"]
    stop = train.train_and_evaluate(
        _quick("ringmaster_stop", **{"server.policy_kwargs.delay_threshold": 2}),
        tmp_path / "stop",
        progress=False,
        formats=(),
    )
    info = stop["info"]
    # Without stops the late gradients are computed, pushed and ignored;
    # with them only those already finished (or on their way) when the stop
    # reaches the worker are.
    wasted = base["num_gradients"] - base["num_updates"]
    assert info["num_gradients"] - info["num_updates"] < wasted / 2
    assert stop["final_loss"] < 0.8 * 2.3  # it trains (ln 10 at the start)


def test_naive_optimal_trains_on_the_fastest_workers_only(tmp_path):
    summary = train.train_and_evaluate(
        _quick("naive_optimal"), tmp_path, progress=False, formats=()
    )
    info = summary["info"]
    # quick's workers are 1, 2 and 4 times slower than the fastest; with
    # S = 3: m = 1 (1 * 4 < 2 * 2.5 < 4 * 2), so after the first round only
    # the fastest one computes.
    assert summary["final_loss"] < 0.8 * 2.3
    assert info["num_gradients"] <= info["num_updates"] + 3


@pytest.mark.slow  # about 30 s on two loaded cores: an apply per push
def test_ringleader_trains_with_a_step_in_every_round(tmp_path):
    summary = train.train_and_evaluate(
        _quick("ringleader", **{"server.learning_rate": 0.4}),
        tmp_path,
        progress=False,
        formats=(),
    )
    info = summary["info"]
    # Every push is applied alone (a version each, with or without a step),
    # none is discarded.
    assert info["num_gradients"] - info["num_updates"] <= 1
    assert summary["final_loss"] < 0.8 * 2.3


def test_ringleaders_table_must_have_a_slot_a_worker():
    # A table waiting on workers that do not exist would never step.
    config = registry.load_config("ringleader", "sim8")
    config.workers.slowdowns = (1.0, 2.0, 4.0)
    with pytest.raises(ValueError) as err:
        registry.check_config(config)
    assert str(err.value) == (
        "server.policy_kwargs.num_workers=8 but the run has 3 workers "
        "(workers.slowdowns): set it to the number of workers"
    )
    config.server.policy_kwargs = {"num_workers": 3}
    with pytest.raises(ValueError, match=r"^server\.optimizer_args\.num_slots=8 "):
        registry.check_config(config)
    config.server.optimizer_args = {"num_slots": 3}
    registry.check_config(config)
