"""Workers outlive a server restart: they reconnect, join again and go on.

In this process: a worker against an in-process ``hpsjax.ps.Server`` that is
closed and started again on the same port (loopback). As processes (slow): a
real ``hpsjax-server`` with checkpoints SIGTERMed and SIGKILLed mid-run and
restarted from them while three real ``hpsjax-worker`` processes train.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax import data
from hpsjax.ps import Server
from hpsjax.worker import Worker, WorkerConfig

SECRET = "reconnect-secret"
LIMIT = 120.0


@pytest.fixture(scope="module")
def setup():
    train = data.synthetic_digits(600, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "w": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
        "b": np.zeros(10, np.float32),
    }

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        logits = x @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)

    return train, params, loss_fn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(setup, port, records, **config):
    train, _, loss_fn = setup
    return Worker(
        WorkerConfig(port=port, secret=SECRET, worker_id="w0", batch_size=16, **config),
        loss_fn=loss_fn,
        batches=train.batches(16, seed=0).next,
        metrics=records.append,
    )


async def _until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("policy", ["asp", "bsp"])
def test_a_worker_rejoins_a_restarted_server_at_its_version(setup, policy, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup
    port = _free_port()
    records: list[dict] = []

    async def go():
        first = Server(params, optax.sgd(0.1), policy, secret=SECRET, port=port)
        await first.start()
        worker = _worker(setup, port, records, max_steps=10_000)
        task = asyncio.ensure_future(worker.run())
        await _until(lambda: first.version >= 20)
        await first.close()
        # A server "resumed" from an older checkpoint: version 0 again.
        second = Server(params, optax.sgd(0.1), policy, secret=SECRET, port=port)
        await asyncio.sleep(0.3)  # the worker finds nobody for a while
        await second.start()
        try:
            await _until(lambda: second.version >= 20)
            worker.stop()
            summary = await task
            pushes = second.core.worker("w0").pushes
        finally:
            await second.close()
        return summary, pushes, second.version

    summary, pushes, version = asyncio.run(asyncio.wait_for(go(), LIMIT))
    assert summary.reconnects == 1 and summary.ended_by == "stopped"
    assert pushes >= 20 and version >= 20
    rounds = [r for r in records if r["event"] == "round"]
    rejoined = [i for i, r in enumerate(rounds) if r["rejoined"]]
    assert rejoined, "no round saw the reconnection"
    # The rounds after it compute on the new server's versions, from 0 up.
    after = [r["version"] for r in rounds[rejoined[-1] + 1 :]]
    assert after and after[0] < 5 and after == sorted(after)
    said = [m for m in caplog.messages if "lost the server" in m]
    assert len(said) == 1 and "reconnecting for up to 60s" in said[0]
    assert any("joined again at version" in m for m in caplog.messages)


def test_with_no_patience_the_worker_stops_in_one_line(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup
    records: list[dict] = []

    async def go():
        server = Server(params, optax.sgd(0.1), "asp", secret=SECRET, port=0)
        await server.start()
        worker = _worker(
            setup, server.port, records, max_steps=10_000, reconnect_timeout=0
        )
        task = asyncio.ensure_future(worker.run())
        await _until(lambda: server.version >= 5)
        await server.close()
        return await task

    summary = asyncio.run(asyncio.wait_for(go(), LIMIT))
    assert summary.ended_by == "server" and summary.reconnects == 0
    said = [m for m in caplog.messages if "lost the server" in m]
    assert len(said) == 1 and "it stops (reconnect_timeout 0)" in said[0]


def test_a_worker_gives_up_after_reconnect_timeout(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup

    async def go():
        server = Server(params, optax.sgd(0.1), "asp", secret=SECRET, port=0)
        await server.start()
        worker = _worker(
            setup, server.port, [], max_steps=10_000, reconnect_timeout=1.0
        )
        task = asyncio.ensure_future(worker.run())
        await _until(lambda: server.version >= 5)
        await server.close()
        start = time.monotonic()
        summary = await task
        return summary, time.monotonic() - start

    summary, waited = asyncio.run(asyncio.wait_for(go(), LIMIT))
    assert summary.ended_by == "server"
    assert 0.5 < waited < 20
    assert any(re.search(r"no server for 1s .*it stops", m) for m in caplog.messages)


@pytest.mark.parametrize("value", [-1.0, float("inf"), "60", True])
def test_a_bad_reconnect_timeout_is_refused(value):
    with pytest.raises(ValueError, match="reconnect_timeout"):
        WorkerConfig(reconnect_timeout=value)


# ---------------------------------------------------------------- processes

MODEL = [
    "--model", "mlp", "--model_arg", "hidden=[32]",
    "--dataset", "synthetic_digits", "--dataset_arg", "image_size=8",
]  # fmt: skip
PROCESS_SECRET = b"reconnect-e2e-secret-0123456789ab\n"


def _command(module):
    code = f"import sys; from {module} import main; sys.exit(main())"
    return [sys.executable, "-c", code]


class _Proc:
    """A process whose output (stdout and stderr) is read as it comes."""

    def __init__(self, args):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def end(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._reader.join(5)
        self.proc.stdout.close()
        return code


def _server(tmp, port, ckpt):
    server = _Proc(
        [
            *_command("hpsjax.ps._cli"),
            "--init",
            str(tmp / "init.npz"),
            "--secret_file",
            str(tmp / "secret.txt"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--loop",
            "asyncio",
            "--policy",
            "bsp",
            "--checkpoint_dir",
            str(ckpt),
            "--checkpoint_every_s",
            "0.5",
        ]
    )
    deadline = time.monotonic() + 120
    while "listening on" not in server.text():
        if time.monotonic() > deadline or server.proc.poll() is not None:
            server.end(signal.SIGKILL)
            pytest.fail("the server did not start:\n" + server.text())
        time.sleep(0.05)
    return server


def _versions(paths) -> list[int]:
    """Each worker's newest version computed on, from its metrics (-1: none)."""
    newest = []
    for path in paths:
        newest.append(-1)
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if record.get("event") == "round":
                newest[-1] = max(newest[-1], record["version"])
    return newest


@pytest.mark.slow
def test_workers_outlive_a_server_stopped_and_killed(tmp_path, session_compile_cache):
    tmp, ckpt = tmp_path, tmp_path / "ckpt"
    (tmp / "secret.txt").write_bytes(PROCESS_SECRET)
    os.chmod(tmp / "secret.txt", 0o600)
    subprocess.run(
        [*_command("hpsjax.cli.worker"), *MODEL, "--write_init",
         str(tmp / "init.npz")],
        check=True, timeout=120, capture_output=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    port = _free_port()
    servers = [_server(tmp, port, ckpt)]
    metrics = [tmp / f"w{i}.jsonl" for i in range(3)]
    workers = [
        _Proc(
            [
                *_command("hpsjax.cli.worker"),
                *MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--secret_file",
                str(tmp / "secret.txt"),
                "--worker_id",
                str(i),
                "--shard_index",
                str(i),
                "--shard_count",
                "3",
                "--batch_size",
                "16",
                "--loop",
                "asyncio",
                "--metrics",
                str(metrics[i]),
                "--tensorboard_dir",
                "none",
            ]
        )
        for i in range(3)
    ]

    def rise_past(version, timeout=120):
        deadline = time.monotonic() + timeout
        # Every worker computes past it: each has rejoined this server before
        # the next stop (a worker still backing off from the last stop would
        # otherwise miss a whole server's life, and one of its two losses).
        while min(_versions(metrics)) <= version:
            for w in workers:
                assert w.proc.poll() is None, w.text()
            assert time.monotonic() < deadline, "".join(w.text() for w in workers)
            time.sleep(0.1)

    try:
        rise_past(10)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            reached = max(_versions(metrics))
            code = servers[-1].end(sig)
            assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            servers.append(_server(tmp, port, ckpt))
            assert "resum" in servers[-1].text().lower(), servers[-1].text()
            # The version keeps rising past what it was before the stop.
            rise_past(reached + 5)
        assert all(w.proc.poll() is None for w in workers)
        codes = [w.end(signal.SIGTERM, timeout=90) for w in workers]
    finally:
        for p in [*workers, *servers]:
            p.end(signal.SIGKILL, timeout=10)
    texts = [w.text() for w in workers]
    assert codes == [0, 0, 0], texts
    for text in texts:
        assert "Traceback" not in text, text
        assert text.count("lost the server") == 2, text
        assert text.count("reconnected after") == 2, text
    # Under BSP every push was made on the newest version, restarts and all.
    stale = {
        json.loads(line).get("staleness")
        for path in metrics
        for line in path.read_text().splitlines()
    }
    assert stale - {None} == {0}, stale
