"""The real-device setting: workers placed on GPUs and CPU core sets, the
``devices`` suite at smoke size, a diverged run in the comparison table, and
``benchmarks/gpu_check.sh`` on a machine without a GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import compare
from experiments.configs.suites import SUITES
from experiments.placement import Placement, parse_spec, place

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_parse_spec_reads_gpus_and_core_counts():
    assert parse_spec("gpu:0, cpu:4,cpu:2 , CPU:1") == [
        ("gpu", 0),
        ("cpu", 4),
        ("cpu", 2),
        ("cpu", 1),
    ]
    for bad in ("tpu:0", "cpu:0", "cpu", "gpu:x", ""):
        with pytest.raises(ValueError, match="bad worker device") as e:
            parse_spec(bad)
        assert "\n" not in str(e.value)


def test_place_gives_disjoint_core_sets_and_the_server_its_own():
    ps, server, notes = place(
        "gpu:0, cpu:4, cpu:2, cpu:1", server_cores=3, cpus=range(16), gpus=1
    )
    assert server == (0, 1, 2)
    assert [p.platform for p in ps] == ["cuda", "cpu", "cpu", "cpu"]
    assert ps[0].gpu == 0 and ps[0].cores == (3,)
    assert [p.cores for p in ps[1:]] == [(4, 5, 6, 7), (8, 9), (10,)]
    assert notes == []
    env = ps[0].env()
    assert env["JAX_PLATFORMS"] == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "0"
    one = ps[3].env()
    assert one["JAX_PLATFORMS"] == "cpu" and one["CUDA_VISIBLE_DEVICES"] == ""
    assert "--xla_cpu_multi_thread_eigen=false" in one["XLA_FLAGS"]
    assert "XLA_FLAGS" not in ps[1].env()


def test_without_a_gpu_the_gpu_worker_runs_on_the_widest_core_set():
    ps, server, notes = place(
        "gpu:0, cpu:2, cpu:1", server_cores=1, cpus=[0, 1], gpus=0
    )
    assert server == (0,)
    assert [p.platform for p in ps] == ["cpu"] * 3
    assert [len(p.cores) for p in ps] == [2, 2, 1]
    assert all(set(p.cores) <= {0, 1} for p in ps)
    assert any("no GPU" in n for n in notes)
    assert any("wrap around" in n for n in notes)


def test_a_placement_pins_the_process_it_starts():
    cores = sorted(os.sched_getaffinity(0))[:1]
    placement = Placement("cpu:1", "cpu", None, tuple(cores))
    argv = placement.wrap(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    )
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **placement.env()},
        timeout=60,
    ).stdout
    assert json.loads(out) == cores


def _summary(scheme: str, t: float | None, diverged: float | None) -> dict:
    return {
        "scheme": scheme,
        "backend": "processes",
        "target_accuracy": 0.9,
        "time_to_target": t,
        "end_time": 30.0,
        "final_accuracy": 0.5,
        "best_accuracy": 0.6,
        "bytes_sent": 1e6,
        "idle_fraction": 0.1,
        "updates": 10,
        "info": {}
        if diverged is None
        else {"diverged": {"worker": 1, "time": diverged}},
    }


def test_the_table_says_when_a_run_diverged():
    table = compare.format_table(
        [_summary("bsp", 10.0, None), _summary("asp", None, 4.25)]
    )
    row = next(line for line in table.splitlines() if line.startswith("| asp"))
    assert "diverged at t = 4.2 s" in row
    two = compare.format_table(
        [_summary("asp", None, 4.25), _summary("asp", 8.0, None)]
    )
    assert "diverged at t = 4.2 s (1/2 runs)" in two


def test_compare_refuses_a_bad_worker_spec_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--suite=devices",
         "--workdir=/nonexistent/x", "--devices=gpu:0,tpu:1"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "bad worker device 'tpu:1'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_devices_suite_at_smoke_size(tmp_path, session_compile_cache):
    # Two workers: the GPU worker (on CPU cores where there is no GPU) and a
    # single-core CPU worker, for a few seconds. The suite's planned scheme,
    # whose plan is made for the placed workers: every scheme is placed alike
    # (experiments.placement), and each scheme's own path on processes is run
    # by tests/experiments/test_experiments.py's processes smoke runs (ASHL's reference:
    # tests/experiments/test_research_schemes.py).
    assert SUITES["devices"].schemes == ("bsp", "hps", "asp", "ashl_reference")
    result = compare.run_suite(
        "devices",
        tmp_path,
        schemes=("hps",),
        progress=False,
        budget_seconds=4.0,
        devices="gpu:0, cpu:1",
        formats=("png",),  # the table is checked: the fewest figures
    )
    summaries = result["summaries"]
    assert [s["scheme"] for s in summaries] == ["hps"]
    for s in summaries:
        info = s["info"]
        assert len(info["placement"]) == 2
        assert info["placement"][1].startswith("cpu:1 ")
        assert s["updates"] > 0
    hps = summaries[0]["info"]
    assert hps["predicted_round_s"] > 0 and hps["measured_round_s"] > 0
    assert "| hps |" in result["table"]


def _gpu_check(env: dict[str, str], tmp_path: pathlib.Path):
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


@pytest.mark.skipif(
    __import__("experiments.placement").placement.gpu_count() > 0,
    reason="this machine has a GPU: the check would run in full",
)
def test_gpu_check_says_there_is_no_gpu_and_measures_nothing(tmp_path):
    out = _gpu_check({"PYTHON": sys.executable}, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "gpu_check: no GPU found" in out.stdout
    assert "nothing was measured" in out.stdout
    assert "| check | result |" not in out.stdout


def test_gpu_check_installs_missing_packages_from_local_wheels_only(tmp_path):
    # An interpreter without msgspec (its pip installs nothing, and finds
    # what is installed already no answer), and a wheel directory without it.
    python = tmp_path / "python.sh"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ] && [ "$2" = "import msgspec" ]; then exit 1; fi\n'
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "$3" = "install" ]; then\n'
        "  shift 3\n"
        f"  exec {sys.executable} -m pip install --dry-run --ignore-installed "
        '"$@"\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out = _gpu_check({"PYTHON": str(python), "WHEELS": str(wheels)}, tmp_path)
    assert out.returncode == 2
    assert f"installing msgspec from {wheels} (no network)" in out.stdout
    assert "cannot install msgspec" in out.stdout
    log = (tmp_path / "out" / "pip.log").read_text()
    assert "--no-index" not in log  # pip's own words, not the command line
    assert "msgspec" in log
    out = _gpu_check({"PYTHON": str(python), "WHEELS": str(tmp_path / "no")}, tmp_path)
    assert out.returncode == 2 and "put their wheels in" in out.stdout


@pytest.mark.slow
def test_a_diverging_processes_run_says_when_in_the_table(
    tmp_path, session_compile_cache
):
    from experiments import registry, train

    config = registry.load_config("asp", "quick")
    config.backend = "processes"
    config.server.learning_rate = 1e12  # the loss overflows within a few pushes
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    diverged = summary["info"]["diverged"]
    assert diverged["worker"] in range(len(config.workers.slowdowns))
    assert 0 < diverged["time"] <= config.budget_seconds
    assert 3 in summary["info"]["worker_returncodes"]
    row = compare.format_table([summary]).splitlines()[-1]
    assert f"diverged at t = {diverged['time']:.1f} s" in row


def test_gpu_check_refuses_an_unknown_step_before_anything(tmp_path):
    out = _gpu_check({"PYTHON": sys.executable, "STEPS": "tests bogus"}, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.strip().splitlines() == [
        "gpu_check: STEPS: unknown step 'bogus'; valid: devices lm_devices "
        "lm_step tests codecs ps"
    ]
    assert not (tmp_path / "out").exists()
