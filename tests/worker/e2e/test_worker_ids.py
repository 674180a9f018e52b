"""``hpsjax-worker`` without ``--worker_id``: the server assigns each worker an
id of its own, so two workers left at the default train side by side (real
server and worker processes on loopback); an explicit id works as before, and
a bad one, or a flag that needs one, is refused in one line."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("session_compile_cache")]

MODEL = [
    "--model", "mlp", "--model_arg", "hidden=[16]",
    "--dataset", "synthetic_digits", "--dataset_arg", "image_size=8",
    "--batch_size", "16", "--loop", "asyncio",
]  # fmt: skip
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _command(module):
    code = f"import sys; from {module} import main; sys.exit(main())"
    return [sys.executable, "-c", code]


def _worker(tmp, port, *flags):
    return subprocess.Popen(
        [*_command("hpsjax.cli.worker"), "--host", "127.0.0.1", "--port",
         str(port), "--secret_file", str(tmp / "secret.txt"), *MODEL, *flags],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=ENV,
    )  # fmt: skip


def _refused(tmp, *flags):
    """A worker's exit status and stderr, with no server at all."""
    done = subprocess.run(
        [*_command("hpsjax.cli.worker"), "--secret_file", str(tmp / "secret.txt"),
         *MODEL, *flags],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stderr


@pytest.fixture
def server(tmp_path):
    (tmp_path / "secret.txt").write_text("worker-ids-secret-0123456789\n")
    os.chmod(tmp_path / "secret.txt", 0o600)
    subprocess.run(
        [*_command("hpsjax.cli.worker"), *MODEL, "--write_init",
         str(tmp_path / "init.npz")],
        check=True, timeout=120, capture_output=True, env=ENV,
    )  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [*_command("hpsjax.ps._cli"), "--init", str(tmp_path / "init.npz"),
         "--secret_file", str(tmp_path / "secret.txt"), "--host", "127.0.0.1",
         "--port", "0", "--policy", "asp", "--loop", "asyncio"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        listening = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
        while not (port := listening.search(_text(tmp_path))):
            assert proc.poll() is None and time.monotonic() < deadline, _text(tmp_path)
            time.sleep(0.1)
        yield tmp_path, int(port.group(1))
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _text(tmp):
    return (tmp / "server.log").read_text()


def _ids(metrics):
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["worker"] for r in records if "step" in r}


def test_workers_without_ids_get_their_own_and_an_explicit_id_still_works(server):
    tmp, port = server
    steps = ["--steps", "6", "--shard_count", "2"]
    workers = [
        _worker(tmp, port, *steps, "--metrics", str(tmp / f"m{i}.jsonl"))
        for i in range(2)
    ]
    named = _worker(tmp, port, "--steps", "3", "--worker_id", "gpu0",
                    "--metrics", str(tmp / "named.jsonl"))  # fmt: skip
    for proc in (*workers, named):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
        assert "Traceback" not in err, err
    assert sorted([*_ids(tmp / "m0.jsonl"), *_ids(tmp / "m1.jsonl")]) == [0, 1]
    assert _ids(tmp / "named.jsonl") == {"gpu0"}
    text = _text(tmp)
    for worker_id in (0, 1):
        assert f"assigned worker id {worker_id} to" in text, text
        assert f"worker {worker_id} joined" in text, text
    assert "worker 'gpu0' joined" in text and "belongs to a live" not in text, text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--worker_id", "", "--port", "9"], "worker_id must be 1 to 256 bytes"),
        (["--worker_id", "x" * 300, "--port", "9"], "worker_id must be 1 to 256"),
        (["--work_plan", "plan.json", "--port", "9"],
         "--work_plan needs --worker_id: it is a given worker's"),
    ],
)  # fmt: skip
def test_a_bad_or_missing_id_is_one_line_before_anything_starts(
    tmp_path, flags, message
):
    (tmp_path / "secret.txt").write_text("s" * 32)
    code, err = _refused(tmp_path, *flags)
    assert code == 2, err
    assert err.startswith("hpsjax-worker: ") and err.count("\n") == 1, err
    assert message in err, err


def test_no_server_to_assign_an_id_is_one_line(tmp_path):
    (tmp_path / "secret.txt").write_text("s" * 32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    code, err = _refused(tmp_path, "--port", str(port), "--connect_timeout", "1")
    assert code == 1, err
    assert err.startswith("hpsjax-worker: no server answered at 127.0.0.1:"), err
    assert err.count("\n") == 1, err
