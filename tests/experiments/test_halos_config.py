"""experiments/configs/halos.py: the paper's knobs, regions, simulator only."""

from __future__ import annotations

import pathlib

import pytest

from experiments import registry, train
from experiments.configs import common, halos


def test_sim8_has_four_regions_of_two_behind_a_fast_link():
    config = registry.load_config("halos", "sim8")
    registry.check_config(config)
    kwargs = config.server.policy_kwargs
    assert config.server.policy == "halos" and kwargs["regions"] == 4
    assert kwargs["accumulation"] == halos.K_PER_WORKER * 2 == 16
    assert kwargs["merge_weight"] == 0.25 and kwargs["global_momentum"] == 0.5
    assert kwargs["global_learning_rate"] == pytest.approx(0.15 * 2)
    # The local servers' Delayed Nesterov: the reference's 0.2 a plain step.
    assert config.server.optimizer == "delayed_nesterov"
    assert config.server.outer_delay == 8 and config.server.momentum == 0.9
    assert config.server.learning_rate == pytest.approx(0.2 * 8)
    # The setting's link is the inter-region one; the workers' is 100x faster.
    sim8 = common.SETTINGS["sim8"]
    assert kwargs["global_bandwidth"] == sim8["bandwidth"]
    assert kwargs["global_latency"] == sim8["latency"]
    assert config.workers.bandwidth == pytest.approx(100 * sim8["bandwidth"])
    assert config.plan.scheme == "dylu" and not config.plan.replan


def test_a_processes_setting_is_simulated_and_processes_are_refused(tmp_path):
    config = registry.load_config("halos", "proc4")
    assert config.backend == "sim"
    config.backend = "processes"
    with pytest.raises(ValueError, match="simulator only") as err:
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_quick_setting_runs_end_to_end(tmp_path: pathlib.Path):
    config = registry.load_config("halos", "quick")
    summary = train.train_and_evaluate(
        config, tmp_path, progress=False, formats=("png",)
    )
    assert summary["scheme"] == "halos" and summary["backend"] == "sim"
    assert summary["updates"] > 0 and summary["pushes"] > summary["updates"]
    assert summary["final_accuracy"] > 0.3
