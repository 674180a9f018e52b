"""Every library command answers a bad value in one line naming the flag and
exits 2, before it starts anything (no server listens, no process starts).

Each case runs the command's ``main`` in this process, with
:class:`subprocess.Popen` made to fail, so that a command that got as far as
starting a process would fail the test instead.
"""

from __future__ import annotations

import subprocess

import pytest

from hpsjax import export
from hpsjax.cli import worker as worker_cli
from hpsjax.launch import _cli as launch_cli
from hpsjax.profiling import in_place
from hpsjax.ps import _cli as server_cli

SERVER = ["--init_from", "mlp", "--loop", "asyncio", "--no_malloc_tuning"]
WORKER = ["--port", "1"]
PROFILE = ["--profile_out", "profile.json", "--profile_link", "1e9"]

# (command, argv, what the one line must name)
CASES = [
    (server_cli.main, [*SERVER, "--policy", "nope"], "--policy 'nope'; valid schemes"),
    (server_cli.main, [*SERVER, "--policy", "ssp", "--policy_arg", "bound=2"],
     "--policy_arg bound: policy 'ssp' has no such argument; valid names: "
     "staleness_bound"),
    (server_cli.main, [*SERVER, "--policy", "hps", "--policy_arg", "bound=2"],
     "--policy_arg bound: policy 'bsp'"),
    (server_cli.main, [*SERVER, "--port", "abc"], "--port: invalid int value"),
    (server_cli.main, [*SERVER, "--status_interval", "-1"], "--status_interval must"),
    (server_cli.main, [*SERVER, "--loop", "nope"], "--loop: invalid choice"),
    (server_cli.main, [*SERVER, "--data_path", "x.npz"], "--data_path is the file"),
    (server_cli.main, [*SERVER[2:], "--init_from", "nope"],
     "unknown model 'nope'; valid names: cnn, mlp"),
    (worker_cli.main, [*WORKER, "--bits", "3"], "--bits must be one of 1, 2, 4, 8,"),
    (worker_cli.main, [*WORKER, "--steps", "0"], "--steps must be an int >= 1, got 0"),
    (worker_cli.main, [*WORKER, "--batch_size", "0"], "--batch_size must"),
    (worker_cli.main, [*WORKER, "--request_timeout", "-1"], "--request_timeout must"),
    (worker_cli.main, [*WORKER, "--overlap", "nope"], "--overlap: invalid choice"),
    (worker_cli.main, [*WORKER, "--local_steps", "0"], "--local_steps must"),
    (worker_cli.main, [*WORKER, "--worker_id", ""], "--worker_id must"),
    (worker_cli.main, [*WORKER, "--dataset", "npz"], "--data_path"),
    (worker_cli.main, [*WORKER, "--model", "nope"], "unknown model 'nope'"),
    (launch_cli.main, ["--workers", "0"], "--workers must be an int >= 1, got 0"),
    (launch_cli.main, ["--workers", "2", "--policy", "nope"], "--policy 'nope'"),
    (launch_cli.main, ["--workers", "2", "--steps", "0"], "--steps must"),
    (launch_cli.main, ["--workers", "2", "--run_timeout", "-1"], "--run_timeout must"),
    (launch_cli.main, ["--workers", "2", "--replan_threshold", "0.2"],
     "--replan_threshold needs --plan"),
    (launch_cli.main, ["--workers", "2", "--plan", "nope"], "--plan: invalid choice"),
    (launch_cli.main, ["--workers", "2", "--backend", "nope"], "--backend: invalid"),
    (launch_cli.main, ["--workers", "2", "--", "--bits", "3"],
     "bad worker flags: --bits must"),
    (launch_cli.main, ["--workers", "2", "--", "--overlap", "nope"],
     "--overlap: invalid choice"),
    (launch_cli.main, ["--workers", "2", "--server", "--learning_rate", "x"],
     "--learning_rate: invalid float value"),
    (launch_cli.main, ["--workers", "2", "--policy", "ssp", "--server", "--policy_arg",
                       "bound=2"], "bad server flags: --policy_arg bound"),
    (export.main, ["ckpt"], "required: out"),
    (export.main, ["ckpt", "out.npz", "--step", "x"], "--step: invalid int value"),
    (in_place.main, [*PROFILE, "--bits", "3"], "--bits must"),
    (in_place.main, [*PROFILE, "--overlap", "nope"], "--overlap: invalid choice"),
]  # fmt: skip


@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("main", "argv", "named"),
    CASES,
    ids=[f"{main.__module__}:{' '.join(argv)}" for main, argv, _ in CASES],
)
def test_a_bad_value_is_one_line_and_exit_2(
    main, argv, named, capsys, tmp_path, monkeypatch, no_processes
):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert named in lines[0], err
    assert "Traceback" not in err and "None" not in err and "__init__" not in err
    assert "listening" not in out and list(tmp_path.iterdir()) == []


def test_an_old_flag_name_still_works_and_says_its_new_one_once(capsys):
    from hpsjax.config import parse_worker

    settings = parse_worker(["--max_steps", "3", "--timeout", "5", "--max_steps", "4"])
    assert settings.config.max_steps == 4 and settings.config.timeout == 5
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "hpsjax-worker: --max_steps is deprecated; use --steps",
        "hpsjax-worker: --timeout is deprecated; use --request_timeout",
    ]


def test_a_scheme_name_is_a_policy_and_worker_flags():
    from hpsjax.config import RUN_SCHEMES, get_scheme, parse_server

    hps = parse_server(["--init", "x.npz", "--policy", "hps"])
    assert hps.scheme().policy == "bsp" and hps.scheme().worker_flags == ("--bits", "8")
    ashl = parse_server(["--init", "x.npz", "--policy", "ASHL"])
    assert ashl.scheme().policy == "hybrid"
    modes = [s["mode"] for s in ashl.policy_kwargs()["stages"]]
    assert modes == ["async", "semi_async"]
    # A --policy_arg given with a scheme replaces the scheme's.
    own = parse_server(["--init", "x.npz", "--policy", "ashl", "--policy_arg",
                        'stages=[{"mode": "sync"}]'])  # fmt: skip
    assert own.policy_kwargs() == {"stages": [{"mode": "sync"}]}
    for name in ("bsp", "asp", "ssp", "saps", "adsp", "hybrid", "ringmaster"):
        assert get_scheme(name).policy == name  # every policy is a scheme
    assert {"hps", "ashl", "ps_plus", "local_sgd"} <= set(RUN_SCHEMES)
    assert get_scheme("hps").describe("hps") == (
        "scheme hps: server --policy bsp; workers --bits 8; plan hps (hpsjax-launch)"
    )


def test_every_schemes_worker_flags_parse():
    from hpsjax.config import RUN_SCHEMES, parse_worker

    for name, scheme in RUN_SCHEMES.items():
        parse_worker(list(scheme.worker_flags))  # raises if one did not
        assert scheme.plan is None or name == scheme.plan
