"""hpsjax-server --pilot: the plan made from the run, with real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from hpsjax.ps._cli import main

# A step of some milliseconds: a model whose step is a fraction of one is
# all scheduler noise on a loaded machine, and the pilot then (rightly)
# cannot tell a 4x slower worker from an equal one in five reports.
MODEL = [
    "--model", "mlp", "--model_arg", "hidden=[384,384]",
    "--dataset", "synthetic_digits", "--dataset_arg", "image_size=16",
]  # fmt: skip
SECRET = b"pilot-cli-secret-0123456789abcdef\n"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _command(module):
    return [
        sys.executable,
        "-c",
        f"import sys; from {module} import main; sys.exit(main())",
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pilot", "fastest", "--global_batch", "32", "--expected_workers", "2"],
         "unknown --pilot scheme 'fastest'"),
        (["--pilot", "hps", "--global_batch", "32"],
         "--pilot needs --global_batch and --expected_workers"),
        (["--global_batch", "32"], "--global_batch needs --pilot"),
        (["--pilot", "hps", "--global_batch", "1", "--expected_workers", "2"],
         "--global_batch must be an int >= --expected_workers"),
        (["--pilot", "hps", "--global_batch", "8", "--expected_workers", "0"],
         "--expected_workers must be an int >= 1"),
        (["--pilot", "hps", "--global_batch", "8", "--expected_workers", "2",
          "--pilot_tolerance", "0"], "--pilot_tolerance must be a finite number > 0"),
        (["--pilot", "hps", "--global_batch", "8", "--expected_workers", "2",
          "--work_plan", "plan.json"], "give one of --pilot and --work_plan"),
        (["--pilot", "hps", "--global_batch", "8", "--expected_workers", "2",
          "--core_arg", "expected_workers=2"], "give the workers once"),
    ],
)  # fmt: skip
def test_bad_pilot_flags_are_one_line_and_start_nothing(
    tmp_path, capsys, flags, message
):
    code = main(["--init", str(tmp_path / "none.npz"), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def _server(tmp, *extra):
    args = [
        *_command("hpsjax.ps._cli"), "--init", str(tmp / "init.npz"),
        "--secret_file", str(tmp / "secret.txt"), "--host", "127.0.0.1",
        "--port", "0", "--policy", "bsp", "--optimizer", "sgd",
        "--learning_rate", "0.1", "--loop", "asyncio", *extra,
    ]  # fmt: skip
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(
            r"listening on 127\.0\.0\.1:(\d+)", (tmp / "server.log").read_text()
        )
        if m:
            return proc, int(m.group(1))
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the server did not start:\n{(tmp / 'server.log').read_text()}")


def _worker(tmp, port, worker_id, steps, slowdown):
    args = [
        *_command("hpsjax.cli.worker"), "--host", "127.0.0.1",
        "--port", str(port), "--secret_file", str(tmp / "secret.txt"),
        "--worker_id", str(worker_id), "--shard_index", str(worker_id),
        "--shard_count", "2", *MODEL, "--batch_size", "16",
        "--max_steps", str(steps), "--slowdown", str(slowdown),
        "--metrics", str(tmp / f"w{worker_id}.jsonl"), "--loop", "asyncio",
        "--timeout", "120",
    ]  # fmt: skip
    with open(tmp / f"w{worker_id}.log", "w") as log:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=ENV)


@pytest.mark.slow
@pytest.mark.usefixtures("session_compile_cache")
def test_workers_end_on_the_pilots_fitted_plan(tmp_path):
    (tmp_path / "secret.txt").write_bytes(SECRET)
    os.chmod(tmp_path / "secret.txt", 0o600)
    init = ["--write_init", str(tmp_path / "init.npz")]
    subprocess.run(
        [*_command("hpsjax.cli.worker"), *MODEL, *init],
        check=True, timeout=120, capture_output=True, env=ENV,
    )  # fmt: skip
    server, port = _server(
        tmp_path, "--pilot", "hps", "--global_batch", "48", "--expected_workers", "2",
        "--pilot_tolerance", "0.25", "--replan_cooldown", "1000",
    )  # fmt: skip
    workers = []
    try:
        workers = [_worker(tmp_path, port, i, 120, s) for i, s in ((0, 1), (1, 4))]
        for w in workers:
            assert w.wait(240) == 0, (tmp_path / "w0.log").read_text() + (
                tmp_path / "w1.log"
            ).read_text()
    finally:
        for p in (*workers, server):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    log = (tmp_path / "server.log").read_text()
    fitted = re.findall(
        r"re-planned \(revision (\d+)\) after the pilot's fit after \d+ rounds"
        r"(?:, the batches it ran kept [^:]*)?: "
        r"batches \{0: (\d+), 1: (\d+)\}",
        log,
    )
    assert len(fitted) == 1, log
    revision, *batches = (int(x) for x in fitted[0])
    assert revision >= 2 and "pilot phase 1" in log
    # Four times slower per step: the slow worker gets less.
    assert batches[1] < batches[0] and sum(batches) == 48
    for i in (0, 1):
        rounds = [
            r
            for r in map(
                json.loads, (tmp_path / f"w{i}.jsonl").read_text().splitlines()
            )
            if r.get("event") == "round"
        ]
        # The fitted plan is the last; its batch runs once compiled (a new
        # batch compiles beside the rounds, which keep the last one meanwhile).
        assert rounds[-1]["plan_revision"] == revision
        assert (revision, batches[i]) in {
            (r["plan_revision"], r["batch_size"]) for r in rounds
        }
