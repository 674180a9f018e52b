"""Tests of the experiments: every scheme's config end to end, compare, errors.

The smoke tests run each scheme's ``quick`` setting (three workers, seconds of
virtual or wall time) in a temporary directory and check the outputs. They share
the test session's persistent compilation cache (``session_compile_cache`` in
``conftest.py``), in this process and in the worker processes, so that the
schemes' identical programs compile once; this process's cache is switched off
again after this module.

Every scheme runs in the simulator; on processes, each distinct server and
worker path runs once (:data:`PROCESSES_PATH_OF` names where the others' is
run).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _jax_cache import compiling_into

from experiments import build, compare, registry, train
from experiments.configs import common
from experiments.configs.suites import SUITES, Suite
from hpsjax.metrics import read_tensorboard
from hpsjax.profiling import WorkerProfile

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The figures' format of runs whose PNGs a test looks at: PDF and SVG are
# drawn from the same figures (test_timeline_marks_of_simulated_replans_and_
# stage_switch writes all three).
PNG = ("png",)

# The processes smoke test kept in the fast default set: it profiles, plans,
# pipelines and quantizes, so it runs the most of the processes backend.
FAST_PROCESS_SCHEME = "hps"

# Schemes whose processes run would take the same path through the server and
# the workers as another run's: where that path is run. What sets them apart
# is computed by the server core (the simulator's smoke run drives the same
# ServerCore, built by the same experiments.build functions) or is the name of
# the workers' local optax optimizer.
PROCESSES_PATH_OF = {
    "staleness_aware_asp": "asp (the server scales each push by its staleness)",
    "dc_asgd": "asp (the server compensates each push's delay)",
    "clipped_asgd": "asp (the server clips each push)",
    "ormo": "asp (the server optimizer is ordered_momentum)",
    "asgd_momentum": "asp (the server optimizer is momentum)",
    "streaming_diloco_eager": (
        "streaming_diloco (the workers' local optimizer takes eager updates)"
    ),
    "local_sgd": "muloco (BSP rounds of local steps; sgd inside)",
    "diloco": "muloco (BSP rounds of local steps; adam inside, nesterov outside)",
    "ashl_reference": (
        "tests/experiments/test_research_schemes.py::"
        "test_ashl_reference_on_processes_switches_and_pushes_top_k"
    ),
}
PROCESSES_SMOKE_SCHEMES = [
    s
    for s in registry.SCHEMES
    if s not in registry.SIM_ONLY_SCHEMES and s not in PROCESSES_PATH_OF
]


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache():
    with compiling_into(os.environ["HPSJAX_TESTS_JAX_CACHE"]):
        yield


def _quick(scheme: str, backend: str = "sim"):
    config = registry.load_config(scheme, "quick")
    config.backend = backend
    return config


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _check_outputs(workdir: pathlib.Path, config, summary: dict) -> None:
    for name in ("config.json", "metrics.jsonl", "summary.json", "timeline.json"):
        assert (workdir / name).is_file(), name
    for name in ("accuracy.png", "timeline.png"):
        data = (workdir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["scheme"] == config.scheme
    assert saved["backend"] == config.backend
    assert saved["server"]["policy"] == config.server.policy

    records = _read_jsonl(workdir / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    workers = [r for r in records if r["event"] == "worker"]
    summaries = [r for r in records if r["event"] == "summary"]
    assert len(summaries) == 1 and records[-1]["event"] == "summary"
    assert len(workers) == len(config.workers.slowdowns)
    assert len(evals) >= 3
    times = [e["time"] for e in evals]
    assert times == sorted(times)
    # An evaluation at t = 0 of the initial parameters, profiling or not.
    assert times[0] == 0.0 and evals[0]["version"] == 0
    assert times[-1] <= config.budget_seconds + 1e-6
    for e in evals:
        assert 0.0 <= e["accuracy"] <= 1.0
    # Training reduced the held-out loss and made updates.
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert summary["updates"] > 0
    for w in workers:
        assert w["compute_s"] > 0
        # Ringmaster's calculation stops may stop every round of a slow worker
        # before it pushes (the stops are what that scheme is for).
        stops = (config.server.policy_kwargs or {}).get("stop_stale", False)
        assert (w["bytes_sent"] > 0 and w["pushes"] > 0) or stops
        assert 0.0 <= w["idle_fraction"] <= 1.0

    timeline = json.loads((workdir / "timeline.json").read_text())
    assert set(timeline["workers"]) == {
        str(i) for i in range(len(config.workers.slowdowns))
    }
    for spans in timeline["workers"].values():
        assert spans and all(s[0] <= s[1] for s in spans)
        assert {s[2] for s in spans} <= set(timeline["kinds"])
        assert "compute" in {s[2] for s in spans}

    on_disk = json.loads((workdir / "summary.json").read_text())
    assert on_disk["scheme"] == summary["scheme"] == config.scheme
    assert on_disk["final_accuracy"] == pytest.approx(evals[-1]["accuracy"])
    reached = train.time_to_target(evals, config.eval.target_accuracy)
    assert summary["time_to_target"] == reached

    # The same records as TensorBoard event files, one run per scheme and seed.
    logdir = workdir / "tensorboard" / f"{config.scheme}_seed{config.seed}"
    assert logdir == train.tensorboard_dir(config, workdir)
    scalars = read_tensorboard(logdir)
    assert [v for _, v in scalars[""]["eval/accuracy"]] == pytest.approx(
        [e["accuracy"] for e in evals]
    )
    for w in workers:
        run = scalars[f"worker{w['worker']}"]
        assert run["worker/compute_s"][-1][1] == pytest.approx(w["compute_s"])


# ---------------------------------------------------------------------------
# Configs and registries.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", registry.SCHEMES)
def test_every_scheme_config_loads_in_every_setting(scheme):
    path = REPO / "experiments" / "configs" / f"{scheme}.py"
    assert path.is_file()
    for setting in common.SETTINGS:
        config = registry.load_config(scheme, setting)
        registry.check_config(config)
        assert config.scheme == scheme and config.setting == setting
    module = __import__(f"experiments.configs.{scheme}", fromlist=["get_config"])
    command = f"python -m experiments.run --config=experiments/configs/{scheme}.py"
    assert command in " ".join(module.__doc__.split()).replace("\\ ", "")


def test_config_defaults_to_sim8_and_unknown_setting_lists_names():
    assert registry.load_config("bsp").setting == "sim8"
    with pytest.raises(ValueError, match=r"unknown setting 'huge'.*demo.*proc4"):
        registry.load_config("bsp", "huge")


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown scheme 'bspp'; valid names: ") as e:
        registry.load_config("bspp")
    for scheme in registry.SCHEMES:
        assert scheme in str(e.value)


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("server.policy", "bulk", "policy"),
        ("server.optimizer", "sgdd", "optimizer"),
        ("backend", "cluster", "backend"),
        ("worker.overlap", "sometimes", "overlap"),
        ("worker.local_optimizer", "lionn", "optimizer"),
        ("model.name", "vgg", "model"),
        ("data.name", "mnist", "dataset"),
        ("plan.scheme", "fastest", "plan scheme"),
        ("server.staleness_lr", "inverted", "staleness policy"),
    ],
)
def test_bad_registry_name_is_a_clear_error_and_writes_nothing(
    tmp_path, field, value, kind
):
    config = _quick("bsp")
    node = config
    *parents, leaf = field.split(".")
    for name in parents:
        node = node[name]
    node[leaf] = value
    with pytest.raises(ValueError, match=rf"unknown {kind} '{value}'; valid names: "):
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_lookup_of_an_unknown_registry_lists_the_registries():
    with pytest.raises(ValueError, match=r"unknown registry 'colour'.*optimizer"):
        registry.lookup("colour", "red")


def test_local_steps_without_local_optimizer_is_refused():
    config = _quick("bsp")
    config.worker.local_steps = 4
    with pytest.raises(ValueError, match=r"needs a worker\.local_optimizer"):
        registry.check_config(config)


def test_bad_slowdowns_and_speed_changes_are_refused():
    config = _quick("asp")
    config.workers.slowdowns = (1.0, 0.5)
    with pytest.raises(ValueError, match="factors >= 1"):
        registry.check_config(config)
    config = _quick("asp")
    config.workers.speed_changes = ((7, 1.0, 2.0),)
    with pytest.raises(ValueError, match="speed change for worker 7"):
        build.worker_specs(config)


def _power_sgd(scheme: str, rank: int = 2):
    config = _quick(scheme)
    config.worker.bits = None
    config.worker.compression = "power_sgd"
    config.worker.powersgd_rank = rank
    return config


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("worker.bits", 8, "replaces quantization: set worker.bits=None"),
        ("worker.powersgd_rank", 0, "worker.powersgd_rank must be an int >= 1"),
        ("worker.powersgd_rank", -1, "worker.powersgd_rank must be an int >= 1"),
        ("stages.compress_from_stage", 0, "set stages.compress_from_stage=None"),
    ],
)
def test_power_sgd_compression_refuses_what_cannot_run(field, value, message):
    config = _power_sgd("hps")
    registry.check_config(config)
    group, name = field.split(".")
    config[group][name] = value
    with pytest.raises(ValueError, match=message) as e:
        registry.check_config(config)
    assert "\n" not in str(e.value)


def test_power_sgd_compression_reaches_both_backends():
    from experiments import backends
    from hpsjax.transforms import powersgd_nbytes

    config = _power_sgd("hps", rank=3)
    config.worker.error_feedback = False
    flags = backends._worker_flags(config, 0, plan_file=None)
    assert flags[flags.index("--powersgd_rank") + 1] == "3"
    assert "--bits" not in flags and "--no_error_feedback" in flags
    params = build.setup(config).params
    transform, codec, push_bytes = backends._push_compression(config, params)
    assert codec is None and transform is not None
    promised = sum(
        powersgd_nbytes(x.shape, x.dtype, 3) for x in jax.tree.leaves(params)
    )
    assert push_bytes == promised
    # PowerSGD leaves the plan's workers uncompressed by top-k.
    profiles = [WorkerProfile.synthetic(i, 640.0 / k) for i, k in enumerate((1, 2))]
    work_plan = build.work_plan(config, profiles)
    assert [w.compress_ratio for w in work_plan.workers] == [1.0, 1.0]


def test_bad_npz_path_is_a_clear_error_and_writes_nothing(tmp_path):
    config = _quick("bsp")
    config.data.name = "npz"
    config.data.path = str(tmp_path / "missing.npz")
    with pytest.raises(FileNotFoundError, match=r"no \.npz file at"):
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    not_npz = tmp_path / "data.npz"
    not_npz.write_text("not an archive")
    config.data.path = str(not_npz)
    with pytest.raises(ValueError, match=r"not a readable \.npz archive"):
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    config.data.path = ""
    with pytest.raises(ValueError, match=r"needs data\.path"):
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_time_to_target_is_the_first_evaluation_at_the_target():
    evals = [
        {"time": 0.0, "accuracy": 0.1},
        {"time": 1.0, "accuracy": 0.8},
        {"time": 2.0, "accuracy": 0.7},
        {"time": 3.0, "accuracy": 0.9},
    ]
    assert train.time_to_target(evals, 0.75) == 1.0
    assert train.time_to_target(evals, 0.9) == 3.0
    assert train.time_to_target(evals, 0.95) is None


def test_slowdown_schedule_follows_speed_changes():
    config = _quick("asp")
    config.workers.slowdowns = (1.0, 2.0)
    config.workers.speed_changes = ((1, 5.0, 3.0), (1, 2.0, 0.75))
    assert build.slowdown_schedule(config, 0) == ((0.0, 1.0),)
    assert build.slowdown_schedule(config, 1) == ((0.0, 2.0), (2.0, 1.5), (5.0, 4.5))


def test_planned_hybrid_hints_each_worker_its_planned_steps():
    from hpsjax.ps import HybridStage, PlannedHybrid, ServerCore

    assert build.PlannedHybrid is PlannedHybrid
    policy = PlannedHybrid(
        [
            HybridStage("async", 4, 8, until_version=2),
            HybridStage("semi_async", 1, 2),
        ],
        [{"a": 4, "b": 16}, {"a": 1, "b": 4}],
    )
    core = ServerCore({"w": np.zeros(2, np.float32)}, optax.sgd(1.0), policy)
    assert core.join("a", now=0.0)[0].local_steps == 4
    assert core.join("b", now=0.0)[0].local_steps == 16
    update = {"w": np.ones(2, np.float32)}
    core.push("a", update, version=0, now=1.0)
    acks = core.push("b", update, version=0, now=1.0)
    assert policy.stage == 1
    assert acks[0].local_steps == 4
    with pytest.raises(ValueError, match="2 local-step plans for 1 stages"):
        PlannedHybrid([HybridStage("async", 1)], [{}, {}])


def _output(records, info, evals=()):
    from experiments.backends import RunOutput

    timelines = {
        w: [(0.0, 1.0, "profile"), (1.0, 4.0 + w, "compute"), (4.0 + w, 9.0, "wait")]
        for w in range(4)
    }
    return RunOutput(list(evals), {}, timelines, records, info)


def test_timeline_marks_of_simulated_replans_and_stage_switch(tmp_path):
    config = _quick("ashl")
    config.stages.switch_version = 3

    def push(time, version, staleness, status="applied"):
        return {
            "event": "push",
            "time": time,
            "version": version,
            "staleness": staleness,
            "status": status,
        }

    records = [
        push(1.5, 0, 0),  # the server at version 1 after it
        push(2.0, 0, 1),  # version 2
        {"event": "replan", "time": 2.2, "revision": 1},
        push(2.5, 1, 1, "dropped"),  # still version 2
        push(3.0, 1, 1),  # version 3: the switch
        push(4.0, 2, 1),
        {"event": "replan", "time": 5.0, "revision": 2},
    ]
    info = {"profile_seconds": 1.0, "final_stage": 1, "switched_at": None}
    evals = [
        {"time": t, "version": v, "accuracy": a, "loss": 1.0}
        for t, v, a in ((1.0, 0, 0.1), (9.0, 5, 0.6))
    ]
    output = _output(records, info, evals)
    marks = [(2.2, "re-plan 1"), (3.0, "stage switch"), (5.0, "re-plan 2")]
    assert train.timeline_marks(config, output) == marks
    # The loss switch's own version wins over the config's.
    assert (2.0, "stage switch") in train.timeline_marks(
        config, _output(records, {**info, "switched_at": 2})
    )
    # No switch happened: no mark; stages off: none either.
    assert train.timeline_marks(config, _output(records, {**info, "final_stage": 0}))[
        1:
    ] == [(5.0, "re-plan 2")]
    config.stages.enabled = False
    assert "stage switch" not in {m[1] for m in train.timeline_marks(config, output)}

    # write_outputs draws them, in every format, and keeps them in timeline.json.
    config.stages.enabled = True
    train.write_outputs(config, output, {}, tmp_path)
    saved = json.loads((tmp_path / "timeline.json").read_text())
    assert [tuple(m) for m in saved["marks"]] == marks
    for stem in ("timeline", "accuracy"):
        for fmt in ("png", "pdf", "svg"):
            assert (tmp_path / f"{stem}.{fmt}").stat().st_size > 1000, (stem, fmt)


def test_timeline_marks_of_real_workers_rounds():
    config = _quick("ashl", "processes")
    config.stages.switch_version = 2

    def round_(worker, time, revision, pulled):
        return {
            "event": "round",
            "worker": worker,
            "time": time,
            "plan_revision": revision,
            "pull_end": time + 0.5,
            "pulled_version": pulled,
        }

    # Each worker's clock starts at its own origin; its rounds are shifted so
    # that its first starts at the end of profiling (1 s), as its timeline is.
    records = [
        round_(0, 10.0, 0, 1),
        round_(0, 11.0, 1, 2),  # at 2.0: re-plan 1; pulled version 2 at 2.5
        round_(1, 20.0, 0, 1),
        round_(1, 20.8, 1, 2),  # at 1.8: re-plan 1 first; version 2 at 2.3
        {"event": "final", "worker": 1, "time": 30.0},
    ]
    output = _output(records, {"profile_seconds": 1.0, "final_stage": 1})
    marks = train.timeline_marks(config, output)
    assert marks == [
        (pytest.approx(1.8), "re-plan 1"),
        (pytest.approx(2.3), "stage switch"),
    ]


def test_format_table_speedups_and_missing_targets():
    def summary(scheme, ttt, end=10.0):
        return {
            "scheme": scheme,
            "backend": "sim",
            "target_accuracy": 0.9,
            "time_to_target": ttt,
            "end_time": end,
            "final_accuracy": 0.91,
            "best_accuracy": 0.92,
            "bytes_sent": 2_000_000,
            "idle_fraction": 0.25,
            "updates": 7,
        }

    table = compare.format_table(
        [summary("bsp", 8.0), summary("hps", 4.0), summary("asp", None)]
    )
    lines = table.strip().splitlines()
    assert len(lines) == 5
    assert "time to 0.9 accuracy (virtual s)" in lines[0]
    assert lines[2].startswith(
        "| bsp | 8.0 | 1.00x | 0.910 | 0.920 | 2.0 | 0.25 | - | 7 |"
    )
    assert lines[3].startswith("| hps | 4.0 | 2.00x |")
    assert lines[4].startswith("| asp | not reached | - |")
    no_base = compare.format_table([summary("bsp", None), summary("hps", 4.0)])
    assert "| hps | 4.0 | > 2.50x |" in no_base
    with pytest.raises(ValueError, match=r"different targets: 0\.5 accuracy, 0\.9"):
        compare.format_table(
            [summary("bsp", 1.0), {**summary("a", 1.0), "target_accuracy": 0.5}]
        )


# ---------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", registry.SCHEMES)
def test_sim_smoke(tmp_path, scheme):
    config = _quick(scheme)
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=PNG)
    _check_outputs(tmp_path, config, summary)
    if config.plan.scheme != "none":
        assert summary["info"]["profile_seconds"] > 0
        assert summary["info"]["plans"]


def test_a_simulated_run_ends_at_max_updates(tmp_path):
    config = _quick("asp")
    config.max_updates = 25
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    assert summary["updates"] == 25
    evals = [r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "eval"]
    assert evals[-1]["version"] == 25
    assert evals[-1]["time"] < config.budget_seconds
    assert all(e["version"] < 25 for e in evals[:-1])


@pytest.mark.parametrize("value", [0, -3])
def test_a_bad_max_updates_is_one_line_and_runs_nothing(tmp_path, value):
    config = _quick("asp")
    with pytest.raises(ValueError, match=r"max_updates must be int \| None"):
        config.max_updates = True  # the typed field refuses it at once
    config.max_updates = value
    with pytest.raises(
        ValueError, match="max_updates must be an int >= 1 or None"
    ) as e:
        train.train_and_evaluate(config, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_sim_run_with_power_sgd_pushes_its_factors(tmp_path):
    from hpsjax.transforms import powersgd_nbytes

    config = _power_sgd("hps")
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=PNG)
    _check_outputs(tmp_path, config, summary)
    params = build.setup(config).params
    promised = sum(
        powersgd_nbytes(x.shape, x.dtype, 2) for x in jax.tree.leaves(params)
    )
    assert promised < 0.2 * sum(x.nbytes for x in jax.tree.leaves(params))
    # Every push carries the factors' bytes; a worker's push still on the
    # wire when the run ends is counted in bytes but not yet as a push.
    sent, pushes = summary["bytes_sent"], summary["pushes"]
    workers = summary["num_workers"]
    assert sent % promised == 0, (sent, promised)
    assert pushes <= sent // promised <= pushes + workers, (sent, promised, pushes)


def test_sim_smoke_on_user_npz_data(tmp_path):
    from hpsjax.data import synthetic_digits

    data = synthetic_digits(600, seed=3)
    path = tmp_path / "mine.npz"
    np.savez(path, images=(data.x * 255).astype(np.uint8), labels=data.y)
    config = _quick("asp")
    config.data.name = "npz"
    config.data.path = str(path)
    config.data.x_key = "images"
    config.data.y_key = "labels"
    summary = train.train_and_evaluate(
        config, tmp_path / "out", progress=False, formats=PNG
    )
    _check_outputs(tmp_path / "out", config, summary)


def test_a_diverging_sim_run_says_when_instead_of_failing(tmp_path, capsys):
    from experiments import summary as run_summary

    config = _quick("asp")
    config.server.learning_rate = 1e20  # the next loss overflows float32
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    at = summary["diverged_at"]
    assert at is not None and 0 < at < config.budget_seconds
    assert summary["info"]["diverged"]["time"] == at
    assert train.describe(summary).startswith(f"asp: diverged at t = {at:.1f} s")
    row = compare.format_table([summary]).splitlines()[-1]
    assert row.startswith(f"| asp | diverged at t = {at:.1f} s |")
    assert run_summary.main(["--workdir", str(tmp_path)]) == 0
    assert f"the run diverged at t = {at:.1f} s" in capsys.readouterr().out


def test_sim_runs_are_reproducible(tmp_path):
    config = _quick("ssp")
    # formats=(): the runs write no figure, and everything else.
    first = train.train_and_evaluate(config, tmp_path / "a", progress=False, formats=())
    second = train.train_and_evaluate(
        config, tmp_path / "b", progress=False, formats=()
    )
    assert first["final_accuracy"] == second["final_accuracy"]
    assert first["updates"] == second["updates"]
    for run in ("a", "b"):
        written = {p.name for p in (tmp_path / run).iterdir()}
        assert {"metrics.jsonl", "timeline.json", "summary.json"} <= written
        assert not {n for n in written if n.endswith((".png", ".pdf", ".svg"))}


@pytest.mark.parametrize("formats", [("jpg",), "png", ("png", 3)])
def test_bad_figure_formats_are_one_line_and_run_nothing(tmp_path, formats):
    with pytest.raises(ValueError, match="formats must be") as e:
        train.train_and_evaluate(
            _quick("asp"), tmp_path / "out", progress=False, formats=formats
        )
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_every_schemes_processes_path_is_run_somewhere():
    assert set(PROCESSES_PATH_OF) <= set(registry.SCHEMES)
    assert not set(PROCESSES_PATH_OF) & set(registry.SIM_ONLY_SCHEMES)
    for where in PROCESSES_PATH_OF.values():
        scheme = where.split()[0]
        if scheme in registry.SCHEMES:
            assert scheme in PROCESSES_SMOKE_SCHEMES, where
        else:
            for test in where.split(" and "):
                path, name = test.split("::")
                assert f"def {name}(" in (REPO / path).read_text(), test
    assert FAST_PROCESS_SCHEME in PROCESSES_SMOKE_SCHEMES


def _check_processes_run(workdir: pathlib.Path, config, summary: dict) -> None:
    _check_outputs(workdir, config, summary)
    for i in range(len(config.workers.slowdowns)):
        own = _read_jsonl(workdir / "workers" / f"metrics_{i}.jsonl")
        assert any(r["event"] == "round" for r in own)
        # Each worker process wrote its own event files too.
        scalars = read_tensorboard(workdir / "workers" / "tensorboard")
        rounds = [r for r in own if r["event"] == "round"]
        assert len(scalars[f"worker{i}"]["round/loss"]) == len(rounds)
    assert summary["info"]["worker_returncodes"] == [0] * len(config.workers.slowdowns)


# The versions a processes smoke run ends at: one local step a round, several.
SMOKE_UPDATES = {False: 100, True: 20}


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheme", [s for s in PROCESSES_SMOKE_SCHEMES if s != FAST_PROCESS_SCHEME]
)
def test_processes_smoke(tmp_path, scheme, session_compile_cache):
    # No warm-up (every worker's first rounds against a throwaway server, so
    # that the timed run loads its compiled step): it is for timings, which
    # these runs do not check, and without it each run starts its workers once
    # instead of twice. The H-PS smoke run below keeps it and checks it. The
    # workers then compile inside the budget (3 s beside two busy processes).
    # A planned scheme keeps the quick setting's 8 s (its profiling pass is
    # charged to it; ASHL's first round of planned local steps once took 7.5 s
    # on a machine loaded ten times over). Fixed local steps and no plan: 6 s
    # (beside two busy processes MuLoCo's synchronous rounds of 8 local steps
    # made a version a second once compiled). One local step a round: 5 s
    # (once compiled its rounds take tens of milliseconds; at a load of 12,
    # in 4 s after a warm-up, every worker of these seven schemes pushed 28
    # to 169 times).
    #
    # Each run ends at SMOKE_UPDATES versions where that comes before the
    # budget (on an idle machine in 1 to 4 s), evaluated every 0.2 s so as to
    # evaluate at least three times; the budget is for a loaded machine. The
    # server holds the first pull until every worker joined, and every worker
    # pushed by version 20 in every scheme's run to the budget (the slowest
    # pushes about a quarter of the versions: the quick setting's rounds are
    # mostly the link's and the server's), so each worker pushes many times.
    config = _quick(scheme, backend="processes")
    config.processes.warmup = False
    if config.plan.scheme == "none" and not config.stages.enabled:
        config.budget_seconds = 5.0 if config.worker.local_steps == 1 else 6.0
    config.max_updates = SMOKE_UPDATES[config.worker.local_steps > 1]
    config.eval.every_seconds = 0.2
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=PNG)
    _check_processes_run(tmp_path, config, summary)
    assert not (tmp_path / "workers" / "warmup.log").exists()
    # It ended at the first evaluation at its versions (or at the budget,
    # before them).
    evals = [r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "eval"]
    assert all(e["version"] < config.max_updates for e in evals[:-1])
    if evals[-1]["version"] < config.max_updates:
        assert evals[-1]["time"] == pytest.approx(config.budget_seconds)


def test_processes_smoke_of_hps_re_plans_on_the_server_and_workers_follow(
    tmp_path, session_compile_cache
):
    """The processes smoke run of FAST_PROCESS_SCHEME (H-PS, which re-plans by
    default), re-planning at any drift: every check of the other schemes' smoke
    runs, and the server's re-plans reach the workers."""
    config = _quick(FAST_PROCESS_SCHEME, backend="processes")
    assert config.plan.replan
    # Any drift re-plans, as soon as each worker reported twice.
    config.plan.replan_threshold = 1e-6
    config.plan.replan_cooldown = 0.0
    config.plan.replan_window = 2
    assert config.processes.warmup
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=PNG)
    _check_processes_run(tmp_path, config, summary)
    # The warm-up ran every worker for its two rounds first.
    for i in range(len(config.workers.slowdowns)):
        warm = _read_jsonl(tmp_path / "workers" / "warmup" / f"metrics_{i}.jsonl")
        assert 1 <= sum(r["event"] == "round" for r in warm) <= 2, warm
    replans = [
        r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "replan"
    ]
    assert replans and replans[0]["revision"] == 1
    # Each revision's predicted round, to set against the rounds after it.
    assert all(r["predicted_round_s"] > 0 for r in replans)
    times = [r["time"] for r in replans]
    assert times == sorted(times) and times[0] > 0
    followed = [
        r["plan_revision"]
        for i in range(len(config.workers.slowdowns))
        for r in _read_jsonl(tmp_path / "workers" / f"metrics_{i}.jsonl")
        if r["event"] == "round"
    ]
    assert max(r or 0 for r in followed) >= 1


def test_processes_refuse_a_plateau_stage_switch(tmp_path):
    config = _quick("ashl", backend="processes")
    config.stages.switch = "plateau"
    with pytest.raises(ValueError, match="switches ASHL's stages at a server version"):
        train.train_and_evaluate(config, tmp_path, progress=False)


def test_compare_writes_a_row_per_scheme(tmp_path, monkeypatch):
    suite = Suite("quick", schemes=("bsp", "asp", "local_sgd"))
    run_all, order = compare._run_all, []

    def recorded(todo, **kwargs):
        order.extend(where.relative_to(tmp_path).parts for _, where, _ in todo)
        return run_all(todo, **kwargs)

    monkeypatch.setattr(compare, "_run_all", recorded)
    result = compare.run_suite(
        suite, tmp_path, seeds=[0, 1], progress=False, formats=PNG
    )
    text = result["table_path"].read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert "mean of 2 runs" in rows[0]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["bsp", "asp", "local_sgd"]
    assert rows[1].split("|")[3].strip() in ("1.00x", "-")
    assert "--seeds=0,1" in text
    # Seed by seed, so that a drifting machine slows every scheme alike.
    assert order == [
        ("bsp", "seed_0"), ("asp", "seed_0"), ("local_sgd", "seed_0"),
        ("bsp", "seed_1"), ("asp", "seed_1"), ("local_sgd", "seed_1"),
    ]  # fmt: skip
    for scheme in suite.schemes:
        for seed in (0, 1):
            config = json.loads(
                (tmp_path / scheme / f"seed_{seed}" / "config.json").read_text()
            )
            assert config["seed"] == seed and config["model"]["seed"] == seed
    assert result["plot_path"].read_bytes().startswith(PNG_MAGIC)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["seeds"] == [0, 1]
    assert [s["scheme"] for s in saved["summaries"]] == [
        "bsp", "bsp", "asp", "asp", "local_sgd", "local_sgd"
    ]  # fmt: skip
    again = compare.run_suite(
        suite, tmp_path, seeds=[0, 1], render_only=True, progress=False, formats=PNG
    )
    assert again["table"] == result["table"]


def test_aggregate_means_and_partial_runs():
    def summary(scheme, ttt, final):
        return {
            "scheme": scheme,
            "backend": "sim",
            "target_accuracy": 0.9,
            "time_to_target": ttt,
            "end_time": 60.0,
            "final_accuracy": final,
            "best_accuracy": final,
            "bytes_sent": 1e6,
            "idle_fraction": 0.5,
            "updates": 10,
        }

    row = compare.aggregate([summary("a", 10.0, 0.9), summary("a", 14.0, 0.95)])
    assert row["runs"] == 2 and row["reached"] == 2
    assert row["time_to_target"] == 12.0 and row["time_to_target_std"] == 2.0
    assert row["final_accuracy"] == pytest.approx(0.925)
    table = compare.format_table(
        [
            summary("bsp", 24.0, 0.9),
            summary("bsp", 24.0, 0.9),
            summary("a", 10.0, 0.9),
            summary("a", 14.0, 0.9),
            summary("b", 30.0, 0.9),
            summary("b", None, 0.8),
        ]
    )
    assert "| a | 12.0 ± 2.0 | 2.00x |" in table
    assert "| b | 30.0 (1/2 runs) | - |" in table
    with pytest.raises(ValueError, match="one scheme's runs"):
        compare.aggregate([summary("a", 1.0, 0.9), summary("b", 1.0, 0.9)])


def test_mean_curve_interpolates_runs_on_one_grid():
    runs = [
        [{"time": 0.0, "accuracy": 0.0}, {"time": 2.0, "accuracy": 1.0}],
        [{"time": 0.0, "accuracy": 0.5}, {"time": 1.0, "accuracy": 0.5}],
    ]
    curve = compare.mean_curve(runs, points=3)
    assert [p["time"] for p in curve] == [0.0, 1.0, 2.0]
    assert [p["accuracy"] for p in curve] == pytest.approx([0.25, 0.5, 0.75])
    with pytest.raises(ValueError, match="runs with evaluations"):
        compare.mean_curve([[]])


def test_compare_rejects_unknown_suites_and_schemes(tmp_path):
    with pytest.raises(ValueError, match=r"unknown suite 'huge'; valid names: .*sim8"):
        compare.run_suite("huge", tmp_path)
    with pytest.raises(ValueError, match=r"unknown scheme 'bspp'"):
        compare.run_suite("quick", tmp_path, schemes=["bspp"])
    with pytest.raises(ValueError, match="seeds must be distinct ints"):
        compare.run_suite("quick", tmp_path, seeds=[1, 1])
    assert not any(tmp_path.iterdir())
    assert {"quick", "sim8", "proc4"} <= set(SUITES)


def test_suites_are_named_after_their_setting():
    # One vocabulary: --suite=quick runs setting quick, --suite=demo runs demo.
    assert {"demo", "quick"} <= set(SUITES)
    for name, suite in SUITES.items():
        assert suite.setting == name, (name, suite.setting)


@pytest.mark.slow
def test_run_and_compare_commands(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The run as a user starts it, without JAX_PLATFORMS: its result printed
    # once, and no line about a TPU backend JAX did not find.
    user_env = dict(os.environ)
    user_env.pop("JAX_PLATFORMS", None)
    run = subprocess.run(
        [
            sys.executable, "-m", "experiments.run",
            "--config=experiments/configs/asp.py:quick",
            "--config.budget_seconds=4", f"--workdir={tmp_path / 'run'}",
        ],
        cwd=REPO, env=user_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "asp: time to 0.5 accuracy" in run.stdout
    both = run.stdout + run.stderr
    assert both.count("asp: time to 0.5 accuracy") == 1, both[-2000:]
    assert "Unable to initialize backend" not in both
    assert (tmp_path / "run" / "accuracy.png").is_file()
    bad = subprocess.run(
        [
            sys.executable, "-m", "experiments.run",
            "--config=experiments/configs/asp.py:quick",
            "--config.server.policy=bulk", f"--workdir={tmp_path / 'bad'}",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "unknown policy 'bulk'; valid names:" in bad.stderr
    out = subprocess.run(
        [
            sys.executable, "-m", "experiments.compare", "--suite=quick",
            "--schemes=bsp,asp", f"--workdir={tmp_path / 'cmp'}", "--formats=png",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| bsp |" in out.stdout and "| asp |" in out.stdout
    assert f"plot: {tmp_path / 'cmp' / 'accuracy.png'}" in out.stdout
    # --formats=png: each run's figures and the comparison's in PNG alone.
    for where in ("cmp", "cmp/bsp", "cmp/asp"):
        assert (tmp_path / where / "accuracy.png").is_file(), where
        assert not list((tmp_path / where).glob("*.pdf")), where


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--config=experiments/configs/bsp.py", "--config.server.polcy=x"],
            "--config.server.polcy: config.server has no field 'polcy'; did you "
            "mean 'policy'? its fields: ",
        ),
        (
            ["--config=experiments/configs/bsp.py", "--config.servr.policy=x"],
            "config has no field 'servr'; did you mean 'server'?",
        ),
        (
            ["--config=experiments/configs/bsp.py", "--config.seed.x=1"],
            "--config.seed.x: config.seed is a int, not a group of fields",
        ),
        (
            ["--config=experiments/configs/bspp.py"],
            "--config: no config file 'experiments/configs/bspp.py'; the schemes' "
            "configs: experiments/configs/<scheme>.py for a scheme of adsp",
        ),
        (
            ["--config=experiments/configs/bsp.py:quik"],
            "unknown setting 'quik'; valid names: "
            f"{', '.join(sorted(common.SETTINGS))}",
        ),
    ],
)
def test_a_config_flag_mistake_is_named_in_one_line(argv, message):
    from experiments import _cli

    found = _cli.diagnose_config_flag(argv)
    assert message in found and "\n" not in found and "Did you" not in found
    assert _cli.diagnose_config_flag(["--config=experiments/configs/bsp.py"]) is None


def test_check_config_refuses_a_missing_npz_file():
    config = registry.load_config("bsp", "quick")
    config.data.name, config.data.path = "npz", "/no/such/file.npz"
    with pytest.raises(
        FileNotFoundError, match=r"no \.npz file at '/no/such/file\.npz'"
    ):
        registry.check_config(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["experiments.run", "--config=experiments/configs/bsp.py",
             "--config.server.polcy=x"],
            "experiments.run: error: --config.server.polcy: config.server has no "
            "field 'polcy'; did you mean 'policy'?",
        ),
        (
            ["experiments.run", "--config=experiments/configs/bsp.py:quick",
             "--config.data.name=npz", "--config.data.path=/no/such.npz"],
            "experiments.run: error: data.path: no .npz file at '/no/such.npz'",
        ),
        (
            ["experiments.compare", "--suite=huge"],
            "experiments.compare: error: argument --suite: invalid choice: 'huge' "
            f"(choose from {', '.join(map(repr, SUITES))})",
        ),
        (
            ["experiments.compare", "--suite=quick", "--schemes=bsp,bspp"],
            "experiments.compare: error: argument --schemes: unknown scheme "
            "'bspp'; valid names:",
        ),
    ],
)  # fmt: skip
def test_experiment_commands_fail_in_one_line(tmp_path, command, message):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", *command, f"--workdir={tmp_path / 'w'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(message), out.stderr
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------
# The summary command.
# ---------------------------------------------------------------------------


def test_summary_of_a_simulated_run(tmp_path, capsys):
    from experiments import summary as run_summary

    config = _quick("asp")
    train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    assert run_summary.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == [
        "worker", "rounds", "idle", "stale", "p90", "examples/s"
    ]  # fmt: skip
    records = _read_jsonl(tmp_path / "metrics.jsonl")
    table = json.loads((tmp_path / "summary_workers.json").read_text())
    assert set(table) == {str(i) for i in range(len(config.workers.slowdowns))}
    for worker, row in table.items():
        pushes = [
            r for r in records if r["event"] == "push" and str(r["worker"]) == worker
        ]
        totals = next(
            r for r in records if r["event"] == "worker" and str(r["worker"]) == worker
        )
        assert row["rounds"] == len(pushes) == totals["pushes"]
        assert row["idle_fraction"] == pytest.approx(totals["idle_fraction"])
        assert row["staleness_mean"] == pytest.approx(
            np.mean([r["staleness"] for r in pushes])
        )
        assert row["throughput"] > 0
    for name in ("summary_staleness.png", "summary_accuracy.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_summary_of_worker_files(tmp_path, capsys):
    from experiments import summary as run_summary

    def round_(step, staleness):
        return {
            "event": "round", "worker": 1, "step": step, "time": 2.0 * step,
            "round_s": 2.0, "wait_s": 0.5, "batch_size": 8, "local_steps": 2,
            "staleness": staleness,
        }  # fmt: skip

    lines = [round_(i, s) for i, s in enumerate([None, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9])]
    lines.append({"event": "eval", "worker": 1, "time": 3.0, "accuracy": 0.5})
    (tmp_path / "metrics_1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines)
    )
    assert run_summary.main(["--workdir", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "summary_workers.json").read_text())["1"]
    assert row == {
        "rounds": 11,
        "idle_fraction": pytest.approx(0.25),
        "staleness_mean": pytest.approx(4.5),
        "staleness_p90": pytest.approx(8.1),
        "throughput": pytest.approx(11 * 16 / 22.0),
    }
    assert "      1      11  25.0%" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_summary.main(["--workdir", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("experiments.summary: ") and "\n" not in err
