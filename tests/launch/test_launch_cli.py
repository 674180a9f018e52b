"""hpsjax-launch's defaults: a scheme's flags and plan, worker 0's evaluation,
and the final parameters kept without a work directory."""

from __future__ import annotations

import json
import pathlib
import re
import tempfile

import pytest

import hpsjax.launch as launch_module
from hpsjax.config import parse_server
from hpsjax.launch import _cli as launch_cli
from hpsjax.launch._prepare import check_launch, kept_params, with_export


def _fake(monkeypatch) -> dict:
    seen = {}

    def fake_launch(num_workers, **kwargs):
        seen.update(kwargs, num_workers=num_workers)
        return launch_module.LaunchResult(0, "completed", 0, (0,), (), None, None,
                                          None, 0.0)  # fmt: skip

    monkeypatch.setattr(launch_cli, "launch", fake_launch)
    return seen


def test_a_scheme_gives_its_policy_plan_and_says_so(monkeypatch, capsys):
    seen = _fake(monkeypatch)
    assert launch_module.main(["--workers", "2", "--policy", "hps"]) == 0
    assert seen["policy"] == "hps" and seen["plan"] == "hps"
    out = capsys.readouterr().out
    assert "scheme hps: server --policy bsp; workers --bits 8; plan hps" in out
    # A plan given wins; a plain policy says nothing and plans nothing.
    assert launch_module.main(["--workers", "2", "--policy", "hps", "--plan",
                               "equal"]) == 0  # fmt: skip
    assert seen["plan"] == "equal"
    capsys.readouterr()
    assert launch_module.main(["--workers", "2", "--policy", "asp"]) == 0
    assert seen["plan"] is None and "scheme" not in capsys.readouterr().out


def test_the_schemes_worker_flags_come_first_and_its_policy_is_checked():
    flags, shared = check_launch(
        2, steps=3, worker_args=["--batch_size", "8"], per_worker_args=None,
        server_args=[], timeout=None, plan=None, replan=None, server_shards=1,
        split_leaves=False, policy="ps_plus",
    )  # fmt: skip
    assert shared == ["--overlap", "eager", "--eager_pulls", "3", "--staleness_lr",
                      "inverse_plus_one", "--batch_size", "8"]  # fmt: skip
    assert flags == [[], []]
    # The server reads the scheme name as it is.
    assert parse_server(["--init", "i.npz", "--policy", "ps_plus"]).scheme().policy == (
        "asp"
    )


def test_worker_0_evaluates_by_default_where_there_is_test_data(monkeypatch, capsys):
    seen = _fake(monkeypatch)
    assert launch_module.main(["--workers", "2"]) == 0
    assert seen["per_worker_args"] == {0: ["--eval_every", "60.0"]}
    assert "worker 0 evaluates every 60 s" in capsys.readouterr().out
    for argv in (
        ["--workers", "2", "--no_eval"],
        ["--workers", "2", "--", "--eval_every", "5"],
        ["--workers", "2", "--worker_flags", "1", "--eval_every 5"],
        ["--workers", "2", "--", "--test_fraction", "0"],
        ["--workers", "2", "--", "--test_fraction=0.0"],
    ):
        assert launch_module.main(argv) == 0
        assert "--eval_every 60.0" not in " ".join(
            a for flags in seen["per_worker_args"].values() for a in flags
        ), argv


def test_without_a_workdir_the_server_exports_its_final_parameters(tmp_path):
    args, path = with_export(["--optimizer", "adam"], kept=False, server_shards=1)
    assert args[:2] == ["--optimizer", "adam"]
    assert args[2:] == ["--export_params", str(path)]
    assert path.parent == pathlib.Path(tempfile.gettempdir())
    assert path.name.startswith("hpsjax-params-") and path.suffix == ".npz"
    # Not with a kept workdir, shards, or an export the flags name.
    assert with_export([], kept=True, server_shards=1) == ([], None)
    assert with_export([], kept=False, server_shards=2) == ([], None)
    mine = ["--export_params=mine.npz"]
    assert with_export(mine, kept=False, server_shards=1) == (mine, None)
    # The last line names the file once it is there.
    file = tmp_path / "p.npz"
    assert kept_params(file).startswith("no final parameters at")
    file.write_bytes(b"")
    assert kept_params(file) == (
        f"final parameters in {file} (hpsjax.export.load_params reads them)"
    )


def test_hpsjax_launch_says_where_the_final_parameters_are(
    monkeypatch, capsys, tmp_path
):
    seen = _fake(monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch_module.main(["--workers", "1", "--no_eval"]) == 0
    flag, path = seen["server_args"][-2:]
    assert flag == "--export_params" and path.startswith(str(tmp_path))
    assert f"no final parameters at {path}" in capsys.readouterr().out
    # A work directory keeps everything: no export is added.
    argv = ["--workers", "1", "--no_eval", "--workdir", str(tmp_path / "run")]
    assert launch_module.main(argv) == 0
    assert seen["server_args"] == []


@pytest.mark.slow
def test_hpsjax_launch_runs_ashl_by_its_scheme_name(
    tmp_path, capsys, monkeypatch, session_compile_cache
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = [
        "--workers", "2", "--policy", "ashl", "--steps", "3", "--no_progress",
        "--run_timeout", "240", "--compile_cache", session_compile_cache, "--",
        "--model_arg", "hidden=[16]", "--dataset_arg", "num_examples=64",
        "--status_interval", "0",
    ]  # fmt: skip
    assert launch_module.main(argv) == 0
    out = capsys.readouterr().out
    assert "scheme ashl: server --policy hybrid" in out, out
    assert "workers --bits 8 --local_optimizer sgd" in out, out
    # The first stage's four local steps a round, and worker 0's last eval.
    done = re.findall(r"hpsjax-worker done: (\{.*\})", out)
    assert [json.loads(d)["local_steps"] for d in done] == [12, 12], out
    assert "[worker 0] hpsjax-worker eval: version" in out, out
    (params,) = tmp_path.glob("hpsjax-params-*.npz")
    assert f"hpsjax-launch: final parameters in {params}" in out
