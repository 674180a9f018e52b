"""The experiments with a task other than classification: a language model and a
regression, on the simulator and on real processes, and their bad inputs.

A run's target follows its task (``experiments/target.py``): the language
model's validation loss, down; tables and plots name the metric. The runs here
are tiny (a transformer of a few thousand parameters, sequences of 16 bytes),
so that they take seconds.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from _jax_cache import compiling_into

from experiments import build, compare, plots, registry, summary, train
from experiments.configs import common, halos
from experiments.configs.suites import SUITES
from experiments.target import Target

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LM_SETTINGS = ("lm_sim8", "lm_sim32", "lm_proc4", "lm_devices")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache():
    with compiling_into(os.environ["HPSJAX_TESTS_JAX_CACHE"]):
        yield


def _tiny_lm(scheme: str, setting: str = "lm_sim8", *, workers: int = 3):
    """``scheme`` on ``setting`` at test size: a transformer of one small
    layer on sequences of 16 bytes, a few workers, seconds of time."""
    config = registry.load_config(scheme, setting)
    config.workers.slowdowns = (1.0, 2.0, 4.0, 4.0)[:workers]
    config.workers.speed_changes = ()
    kwargs = dict(config.server.policy_kwargs or {})
    if "regions" in kwargs:  # HALoS: a region a worker at least, its counts
        # derived for these workers as its config derives them for the setting's
        kwargs["regions"] = min(kwargs["regions"], workers)
        per_region = max(1, workers // kwargs["regions"])
        kwargs["accumulation"] = halos.K_PER_WORKER * per_region
        config.server.outer_delay = halos.N_PER_WORKER * per_region
        config.server.learning_rate = halos.LOCAL_LR * config.server.outer_delay
        # Two local steps a push (8 in the config): the global server then
        # takes its first updates inside the 4 s of a tiny run.
        config.plan.local_steps = 2
    if "num_workers" in kwargs:  # Ringleader's table: a slot a worker
        kwargs["num_workers"] = workers
        config.server.optimizer_args = {"num_slots": workers}
    config.server.policy_kwargs = kwargs
    config.data.args.seq_len = 16
    config.model.args.d_model = 16
    config.model.args.num_layers = 1
    config.model.args.num_heads = 2
    config.budget_seconds = 4.0
    config.eval.every_seconds = 1.0
    # A loss the first updates reach (ln 256 = 5.5 at the start).
    config.eval.target_value = 5.0
    return config


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------
# The target: a metric, a value, a direction.
# ---------------------------------------------------------------------------


def test_a_loss_target_is_reached_going_down():
    target = Target("loss", 2.0, higher_is_better=False)
    evals = [
        {"time": 0.0, "loss": 5.5},
        {"time": 1.0, "loss": 2.5},
        {"time": 2.0, "loss": float("nan")},
        {"time": 3.0, "loss": 1.9},
    ]
    assert target.time_to(evals) == 3.0
    assert train.time_to_target(evals, target) == 3.0
    assert target.best([5.5, 1.9, float("nan"), None]) == 1.9
    assert target.label == "val loss 2"
    # A number is a test accuracy, as before targets had a metric.
    assert train.time_to_target([{"time": 1.0, "accuracy": 0.95}], 0.9) == 1.0


def test_the_target_follows_the_task_of_the_config():
    lm = build.target(registry.load_config("bsp", "lm_sim8"))
    assert lm.metric == "loss" and not lm.higher_is_better
    digits = build.target(registry.load_config("bsp", "sim8"))
    assert digits == Target("accuracy", 0.9, higher_is_better=True)
    config = registry.load_config("bsp", "lm_sim8")
    config.eval.target_metric = "perplexity"
    config.eval.target_value = 12.0
    assert build.target(config) == Target("perplexity", 12.0, False)


def test_summaries_of_before_targets_had_a_metric_still_read():
    old = {"target_accuracy": 0.9, "best_accuracy": 0.95}
    assert Target.of_summary(old) == Target("accuracy", 0.9, True)


@pytest.mark.parametrize("setting", LM_SETTINGS)
def test_every_scheme_has_a_config_on_the_lm_settings(setting):
    for scheme in registry.SCHEMES:
        config = registry.load_config(scheme, setting)
        registry.check_config(config)
        assert config.task == "lm" and build.target(config).metric == "loss"
    assert SUITES[setting].setting == setting


def test_the_lm_settings_keep_their_workers_and_links():
    bases = ("sim8", "sim32", "proc4", "devices")
    for lm, base in zip(LM_SETTINGS, bases, strict=True):
        for key in ("backend", "slowdowns", "bandwidth", "latency", "speed_changes"):
            assert common.SETTINGS[lm][key] == common.SETTINGS[base][key], key
    # The real devices' placement too: the same processes, the same cores.
    for key in ("devices", "server_cores"):
        assert common.SETTINGS["lm_devices"][key] == common.SETTINGS["devices"][key]


# ---------------------------------------------------------------------------
# Bad input: one line, nothing started.
# ---------------------------------------------------------------------------


def test_an_unknown_task_is_one_line_and_writes_nothing(tmp_path):
    config = registry.load_config("bsp", "quick")
    config.task = "translation"
    with pytest.raises(ValueError, match="unknown task 'translation'") as e:
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_target_on_a_metric_the_task_does_not_report_is_refused(tmp_path):
    config = registry.load_config("bsp", "quick")
    config.task = "regression"
    config.data.name = "synthetic_regression"
    config.eval.target_metric = "accuracy"
    with pytest.raises(ValueError, match="accuracy") as e:
        registry.check_config(config)
    assert "\n" not in str(e.value)
    # Without a value, a loss target cannot be guessed from an accuracy's.
    config.eval.target_metric = None
    with pytest.raises(ValueError, match=r"eval\.target_value must be a number"):
        registry.check_config(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--config.task=translation"],
            "experiments.run: error: unknown task 'translation'",
        ),
        (
            ["--config.task=regression", "--config.data.name=synthetic_regression",
             "--config.eval.target_metric=accuracy",
             "--config.eval.target_value=0.5"],
            "experiments.run: error: task 'regression' reports no metric "
            "'accuracy'; its metrics: loss",
        ),
    ],
)  # fmt: skip
def test_run_command_refuses_a_bad_task_in_one_line(tmp_path, flags, message):
    out = subprocess.run(
        [
            sys.executable, "-m", "experiments.run",
            "--config=experiments/configs/bsp.py:quick", *flags,
            f"--workdir={tmp_path / 'w'}",
        ],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(message), out.stderr
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------
# End to end on the simulator.
# ---------------------------------------------------------------------------


def test_a_language_model_trains_in_the_simulator_to_a_loss_target(tmp_path):
    config = _tiny_lm("asp")
    result = train.train_and_evaluate(
        config, tmp_path, progress=False, formats=("png",)
    )
    assert result["task"] == "lm"
    assert result["target_metric"] == "loss" and not result["higher_is_better"]
    assert result["target_accuracy"] is None
    records = _read_jsonl(tmp_path / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[0]["loss"] > 4.0  # about ln 256 = 5.5 at the start
    assert evals[-1]["loss"] < evals[0]["loss"]
    for e in evals:
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]), rel=1e-4)
        assert 0.0 <= e["accuracy"] <= 1.0
    assert result["time_to_target"] == Target("loss", 5.0, False).time_to(evals)
    assert result["time_to_target"] is not None
    assert result["best_metric"] == min(e["loss"] for e in evals)
    assert result["final_metric"] == evals[-1]["loss"]
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "accuracy.png").exists()
    assert "asp: time to val loss 5 " in train.describe(result)
    # The summary command plots the run's own metric.
    assert summary.write_summary(tmp_path)["paths"]["loss_plot"].is_file()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", registry.SCHEMES)
def test_every_scheme_trains_the_language_model_in_the_simulator(tmp_path, scheme):
    result = train.train_and_evaluate(
        _tiny_lm(scheme), tmp_path, progress=False, formats=()
    )
    assert result["updates"] > 0 and result["diverged_at"] is None
    assert result["best_metric"] < math.log(256)


def test_compare_tables_and_plots_name_the_loss_target(tmp_path):
    suite = SUITES["lm_sim8"]
    for scheme in ("bsp", "asp"):
        config = _tiny_lm(scheme)
        config.budget_seconds = 2.0
        train.train_and_evaluate(config, tmp_path / scheme, progress=False, formats=())
    summaries = [compare.load_run(tmp_path / s)[0] for s in ("bsp", "asp")]
    table = compare.format_table(summaries)
    header = table.splitlines()[0]
    assert "time to val loss 5 (virtual s)" in header
    assert "final loss | best loss" in header
    runs = {s: [compare.load_run(tmp_path / s)[1]] for s in ("bsp", "asp")}
    path = plots.plot_comparison(
        runs, tmp_path / "loss.png", target=5.0, metric="loss", formats=("png",),
        caption=suite.description,
    )  # fmt: skip
    assert path.read_bytes().startswith(PNG_MAGIC)
    curve = compare.mean_curve(runs["bsp"], points=3, metric="loss")
    assert curve[0]["loss"] == pytest.approx(runs["bsp"][0][0]["loss"])


@pytest.mark.slow
def test_a_regression_trains_through_the_run_command(tmp_path):
    out = subprocess.run(
        [
            sys.executable, "-m", "experiments.run",
            "--config=experiments/configs/asp.py:quick",
            "--config.task=regression", "--config.data.name=synthetic_regression",
            "--config.eval.target_value=10.0", "--config.budget_seconds=3",
            f"--workdir={tmp_path}",
        ],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "asp: time to val loss 10 " in out.stdout
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["task"] == "regression" and result["final_accuracy"] is None
    evals = [r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "eval"]
    assert "accuracy" not in evals[0]
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert (tmp_path / "loss.png").is_file()


# ---------------------------------------------------------------------------
# Real processes.
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_language_model_trains_on_real_processes(tmp_path, session_compile_cache):
    config = _tiny_lm("asp", "lm_proc4", workers=2)
    config.processes.warmup = False
    config.budget_seconds = 20.0
    config.max_updates = 30
    result = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    assert result["backend"] == "processes" and result["task"] == "lm"
    assert result["info"]["worker_returncodes"] == [0, 0]
    evals = [r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "eval"]
    assert evals[-1]["version"] > 0 and evals[-1]["loss"] < evals[0]["loss"]
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["loss"]))
    for i in range(2):
        rounds = [
            r
            for r in _read_jsonl(tmp_path / "workers" / f"metrics_{i}.jsonl")
            if r["event"] == "round"
        ]
        assert rounds and all(math.isfinite(r["loss"]) for r in rounds)
