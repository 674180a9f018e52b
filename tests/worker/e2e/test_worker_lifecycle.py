"""A worker's life against a real server: the overlap its policy calls for, a
compile that keeps no barrier waiting, and divergence as an event.

Workers run in this process against an in-process ``hpsjax.ps.Server`` over
loopback sockets (port 0); the divergence test also runs a real
``hpsjax-worker`` process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from _models import digits_mlp
from _servers import held_start

from hpsjax.ps import Server
from hpsjax.worker import NONFINITE_ACTIONS, Worker, WorkerConfig
from hpsjax.worker._core import Joined

SECRET = "lifecycle-secret"
LIMIT = 120.0  # seconds any one async test may take


@pytest.fixture(scope="module")
def setup():
    """Generated digits and a small functional MLP (per-example losses)."""
    return digits_mlp(900)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


def _workers(setup, port, configs, records, *, cls=Worker, first=0):
    train, _, loss_fn = setup
    return [
        cls(
            dataclasses.replace(
                config,
                port=port,
                secret=SECRET,
                worker_id=f"w{first + i}",
                batch_size=16,
            ),
            loss_fn=loss_fn,
            batches=train.shard(len(configs), i).batches(16, seed=i).next,
            metrics=records.append,
        )
        for i, config in enumerate(configs)
    ]


async def _train(setup, configs, *, policy, hold=False):
    """``hold``: the server's start waits for every worker to join."""
    _, params, _ = setup
    records: list[dict] = []
    core = held_start(len(configs)) if hold else None
    async with Server(
        params, optax.sgd(0.1), policy, secret=SECRET, core_kwargs=core
    ) as server:
        workers = _workers(setup, server.port, configs, records)
        await asyncio.gather(*(w.run() for w in workers))
        version = server.version
    return records, version


def _pushed(records):
    """The rounds whose records carry a push's acknowledgement."""
    return [r for r in records if r.get("pushed_step") is not None]


# ---------------------------------------------------------------- overlap


def test_under_bsp_every_push_of_default_workers_has_staleness_0(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    steps = 10
    records, version = _run(
        _train(setup, [WorkerConfig(max_steps=steps)] * 3, policy="bsp", hold=True)
    )
    pushed = _pushed(records)
    assert len(pushed) == 3 * steps
    assert {r["staleness"] for r in pushed} == {0}
    assert all(r["pushed_step"] == r["step"] for r in pushed)
    # One version a round, all three in every round (the start held for them).
    assert version == steps
    said = [m for m in caplog.messages if "synchronous" in m]
    assert len(said) == 3 and all("staleness 0" in m for m in said)


def test_asked_for_pipelining_under_bsp_it_pipelines_and_says_so(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    config = WorkerConfig(max_steps=20, overlap="pipeline")
    records, _ = _run(_train(setup, [config] * 2, policy="bsp", hold=True))
    pushed = [r for r in _pushed(records) if r["event"] == "round"]
    # Each push travels during the next round: one version stale (but the
    # first).
    stale = [r["staleness"] for r in pushed]
    assert set(stale) <= {0, 1} and stale.count(1) > len(stale) / 2, stale
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # One warning per worker (a loaded machine may add a drop's warning).
    said = [m for m in warned if "every push is 1 version stale" in m]
    assert len(said) == 2 and {m.split(":")[0] for m in said} == {
        "worker w0",
        "worker w1",
    }, warned


def test_under_asp_the_default_pipelines(setup):
    records, _ = _run(_train(setup, [WorkerConfig(max_steps=6)], policy="asp"))
    rounds = [r for r in records if r["event"] == "round"]
    assert all(r["pushed_step"] == r["step"] - 1 for r in rounds[1:])


# ---------------------------------------------------------------- compile


class _SlowCompile(Worker):
    """A worker whose first compile takes ``DELAY`` seconds longer (a device
    whose step compiles slowly).

    The delay comes after the real compile: in this one process, compiling
    holds the interpreter's lock for a while, which would slow the server and
    the other workers too (separate processes in a real run).
    """

    DELAY = 5.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        compile_step = self._compute._compile  # the worker's round arithmetic
        slowed = []

        def slow(args):
            compiled = compile_step(args)
            if not slowed:
                slowed.append(True)
                start = time.monotonic()
                time.sleep(self.DELAY)
                self.slept = (start, time.monotonic())
            return compiled

        self._compute._compile = slow


def test_a_slow_compile_keeps_no_barrier_waiting(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup
    delay = _SlowCompile.DELAY
    records: list[dict] = []

    async def go():
        async with Server(params, optax.sgd(0.1), "bsp", secret=SECRET) as server:
            # The fast pair trains until the slow one is done, so that they are
            # live through its whole compile however long a loaded machine
            # makes the real compile before the delay.
            fast = _workers(
                setup, server.port, [WorkerConfig(max_seconds=600)] * 2, records
            )
            slow = _workers(
                setup, server.port, [WorkerConfig(max_steps=5)], records,
                cls=_SlowCompile, first=2,
            )  # fmt: skip
            seen: list[tuple[float, int]] = []

            async def watch():
                while True:
                    seen.append((time.monotonic(), server.version))
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            runs = [asyncio.create_task(w.run()) for w in (*fast, *slow)]
            await runs[2]
            for w in fast:
                w.stop()
            await asyncio.gather(*runs)
            watcher.cancel()
            return seen, slow[0].slept

    seen, (slept_from, slept_to) = _run(go())
    rounds = [r for r in records if r["event"] == "round"]
    slow_rounds = [r for r in rounds if r["worker"] == "w2"]
    compiles = {r["worker"]: r["compile_s"] for r in records if r["event"] == "compile"}
    # Every worker compiled before joining, the slow one while the others went on...
    assert sorted(compiles) == ["w0", "w1", "w2"] and compiles["w2"] >= delay
    assert len(slow_rounds) == 5 and all(r["compile_s"] == 0 for r in slow_rounds)
    assert slow_rounds[0]["version"] > 0
    assert any("compiled its step for batch 16" in m for m in caplog.messages)
    # ...and the barrier did not wait for it: the server made versions during
    # the delay, when a barrier counting the slow worker would make none (its
    # waits are not the measure: in this one process a compile holds the
    # interpreter's lock, so every worker's wait grows with a loaded machine's
    # compile times).
    during = [v for t, v in seen if slept_from <= t <= slept_to]
    assert during and during[-1] > during[0], (during[:1], during[-1:])


# ---------------------------------------------------------------- divergence


def test_the_core_never_pushes_a_round_that_is_not_finite():
    from hpsjax.worker._core import Computed, Discard, Pulled, Stop, WorkerCore

    for on_nonfinite in NONFINITE_ACTIONS:
        core = WorkerCore(device_batches=(8,), on_nonfinite=on_nonfinite)
        core.handle(Joined(0.0))
        core.handle(Pulled(1, 5, now=0.1))
        actions = core.handle(Computed(0, 0.2, 0.1, loss=None, finite=False))
        assert actions[0] == Discard(0)
        assert not any(type(a).__name__ == "Push" for a in actions)
        if on_nonfinite == "stop":
            assert actions[-1] == Stop("diverged") and core.ended_by == "diverged"
        else:
            assert type(actions[-1]).__name__ == "Compute" and not core.done
    with pytest.raises(ValueError, match="on_nonfinite"):
        WorkerCore(device_batches=(8,), on_nonfinite="ignore")
    with pytest.raises(ValueError, match="on_nonfinite"):
        WorkerConfig(on_nonfinite="ignore")


def test_push_metadata_carries_no_non_finite_loss():
    from hpsjax.worker._core import Compute, Computed, Pulled, Reported, WorkerCore

    core = WorkerCore(device_batches=(8,))
    core.handle(Joined(0.0))
    (compute,) = [a for a in core.handle(Pulled(1, 0, 0.1)) if type(a) is Compute]
    # A skipped round never gets here: this is a loss the check let through.
    core.handle(Computed(compute.round, 1.0, 0.9, loss=math.inf))
    (push,) = core.handle(Reported(1.0))
    assert push.meta.loss is None and "loss" not in push.meta.to_wire()


def _poisoned(setup, at: int):
    """Batches of the first shard, of which call ``at`` holds an infinity."""
    train, _, _ = setup
    stream = train.batches(16, seed=0)
    calls = []

    def batches(n):
        batch = stream.next(n)
        calls.append(n)
        if len(calls) == at:
            x = np.array(batch.x, copy=True)
            x[0, 0] = np.inf
            batch = batch._replace(x=x)
        return batch

    return batches


@pytest.mark.parametrize("on_nonfinite", NONFINITE_ACTIONS)
def test_a_round_that_is_not_finite_is_never_pushed(setup, on_nonfinite, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, loss_fn = setup
    records: list[dict] = []

    async def go():
        async with Server(params, optax.sgd(0.1), "asp", secret=SECRET) as server:
            worker = Worker(
                WorkerConfig(
                    port=server.port, secret=SECRET, worker_id="w0", batch_size=16,
                    max_steps=6, on_nonfinite=on_nonfinite,
                ),
                loss_fn=loss_fn,
                batches=_poisoned(setup, at=4),
                metrics=records.append,
            )  # fmt: skip
            summary = await worker.run()
            return summary, server.core.worker("w0").pushes

    summary, pushes = _run(go())
    (event,) = [r for r in records if r["event"] == "diverged"]
    rounds = [r for r in records if r["event"] == "round"]
    # The batch drawn to compile with is the first round's: call 4 is round 3.
    assert event["step"] == 3 and event["loss"] is None
    assert event["action"] == on_nonfinite and rounds[3]["loss"] is None
    lines = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    lines += [r.getMessage() for r in caplog.records if "diverged at" in r.getMessage()]
    assert len(lines) == 1, lines
    if on_nonfinite == "stop":
        assert summary.ended_by == "diverged" and summary.steps == 4
        assert lines[0].startswith("worker w0 diverged at step 3 (version ")
        assert "loss nan" in lines[0] or "loss inf" in lines[0]
        assert pushes <= 3
    else:
        assert summary.ended_by == "max_steps" and summary.steps == 6
        assert pushes == 5 and summary.discarded == 1
        assert math.isfinite(summary.loss)


def test_the_diverged_status_is_the_launchers():
    from hpsjax import launch
    from hpsjax.cli import worker as _cli

    assert _cli.DIVERGED == launch.DIVERGED != 0


# ---------------------------------------------------------------- processes

MODEL = [
    "--model", "mlp", "--model_arg", "hidden=[32]",
    "--dataset", "synthetic_digits", "--dataset_arg", "image_size=8",
]  # fmt: skip
PROCESS_SECRET = b"lifecycle-e2e-secret-0123456789ab\n"


def _command(module):
    code = f"import sys; from {module} import main; sys.exit(main())"
    return [sys.executable, "-c", code]


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def workdir(tmp_path, session_compile_cache):
    """Its processes use the session's compilation cache (conftest.py)."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(PROCESS_SECRET)
    os.chmod(secret, 0o600)
    subprocess.run(
        [*_command("hpsjax.cli.worker"), *MODEL, "--write_init",
         str(tmp_path / "init.npz")],
        check=True, timeout=120, capture_output=True, env=_env(),
    )  # fmt: skip
    return tmp_path


class _Server:
    """An ``hpsjax-server`` process; its log is read as it comes."""

    def __init__(self, tmp, *extra, port=0):
        args = [
            *_command("hpsjax.ps._cli"), "--init", str(tmp / "init.npz"),
            "--secret_file", str(tmp / "secret.txt"), "--host", "127.0.0.1",
            "--port", str(port), "--loop", "asyncio", *extra,
        ]  # fmt: skip
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=_env(),
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.lines):
                m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    return
            time.sleep(0.05)
        self.kill()
        pytest.fail("the server did not start:\n" + "".join(self.lines))

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def kill(self, sig=signal.SIGKILL, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self._reader.join(5)
        self.proc.stdout.close()
        return code


def _worker_args(tmp, port, worker_id, *extra):
    return [
        *_command("hpsjax.cli.worker"), *MODEL, "--host", "127.0.0.1",
        "--port", str(port), "--secret_file", str(tmp / "secret.txt"),
        "--worker_id", str(worker_id), "--shard_index", "0",
        "--batch_size", "16", "--loop", "asyncio", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_a_diverging_worker_process_says_so_in_one_line(workdir):
    # A step size of 1e20: the second round's logits overflow float32.
    server = _Server(workdir, "--policy", "asp", "--learning_rate", "1e20")
    try:
        done = subprocess.run(
            _worker_args(workdir, server.port, 0, "--max_steps", "100"),
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
    finally:
        server.kill(signal.SIGTERM)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    lines = [line for line in out.splitlines() if "diverged at" in line]
    assert len(lines) == 1, out
    assert re.search(r"worker 0 diverged at step \d+ \(version \d+\): loss", lines[0])
    assert "Traceback" not in out and "malformed push" not in out, out


# ---------------------------------------------------------------- what it says


@pytest.mark.parametrize(
    ("policy", "overlap", "n"), [("asp", "pipeline", 1), ("bsp", None, 2)]
)
def test_the_summary_says_the_version_the_server_ended_at(setup, policy, overlap, n):
    _, params, _ = setup

    async def go():
        # The start held until all n joined: alone, the first would end its six
        # rounds before the other's compile ended (a loaded machine's).
        async with Server(
            params, optax.sgd(0.1), policy, secret=SECRET, core_kwargs=held_start(n)
        ) as server:
            configs = [WorkerConfig(max_steps=6, overlap=overlap)] * n
            workers = _workers(setup, server.port, configs, [])
            summaries = await asyncio.gather(*(w.run() for w in workers))
            await asyncio.sleep(0.1)
            return summaries, server.version

    summaries, version = _run(go())
    # The last push (a pipelined flush, acknowledged after the run's end)
    # counts: the server's final version, which its checkpoint is named after
    # (under BSP a worker that joined first may end a round before the other).
    assert max(s.version for s in summaries) == version >= 6
    assert min(s.version for s in summaries) >= version - 1


def test_the_plan_received_on_connecting_sets_the_first_compile(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup
    records: list[dict] = []

    async def go():
        async with Server(params, optax.sgd(0.1), "bsp", secret=SECRET) as server:
            server.send_plan("w0", {"revision": 3, "batch_size": 8})
            (worker,) = _workers(
                setup, server.port, [WorkerConfig(max_steps=3)], records
            )
            await worker.run()

    _run(go())
    (compiled,) = [r for r in records if r["event"] == "compile"]
    rounds = [r for r in records if r["event"] == "round"]
    assert compiled["batch_size"] == 8
    assert [r["batch_size"] for r in rounds] == [8, 8, 8]
    assert all(r["compile_s"] == 0 for r in rounds)
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("hpsjax.worker") and "plan revision" in r.getMessage()
    ]
    assert said == ["worker w0: plan revision 3 received: batch 8, local steps "
                    "unchanged, lr scale unchanged"]  # fmt: skip


def _cli_args(*extra):
    from hpsjax.cli import worker as _cli

    return _cli.parse_args(
        ["--model", "mlp", "--model_arg", "hidden=[8]", "--port", "1", *extra]
    )


def test_help_says_each_default_once(capsys):
    from hpsjax.cli import worker as _cli

    with pytest.raises(SystemExit):
        _cli.parse_args(["--help"])
    parser_help = capsys.readouterr().out
    flat = " ".join(parser_help.split())
    assert "(default: None)" not in flat
    assert "shuffle seed of this worker's batches (default: its shard index) " in flat
    assert "--reconnect_timeout" in flat and "--on_nonfinite {stop,skip}" in flat
    assert _cli_args().overlap is None


def test_your_npz_data_from_the_command_line(tmp_path, capsys):
    from hpsjax.cli import worker as _cli
    from hpsjax.worker import _build

    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.random((50, 6, 6, 1)), y=rng.integers(0, 3, 50))
    worker, _, params, _ = _build.build(
        _cli_args("--dataset", "npz", "--data_path", str(path), "--batch_size", "4")
    )
    assert worker.config.batch_size == 4
    assert jax.tree.leaves(params)[0].shape[0] in (36, 8, 3)
    np.savez(tmp_path / "noy.npz", x=np.zeros((5, 2)))
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    cases = {
        (): "--dataset npz needs --data_path FILE.npz",
        ("--data_path", str(tmp_path / "gone.npz")): "no .npz file at",
        ("--data_path", str(tmp_path / "noy.npz")): "has no array 'y'; it holds ['x']",
        ("--data_path", str(tmp_path / "bad.npz")): "bad.npz",
    }
    for extra, message in cases.items():
        argv = ["--dataset", "npz", *extra, "--port", "1", "--steps", "1"]
        assert _cli.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert _cli.main(["--data_path", str(path), "--port", "1"]) == 2
    assert "--data_path is the file of --dataset npz" in capsys.readouterr().err
