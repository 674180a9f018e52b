"""Checkpoints that keep up: saves folded while one is written, atomic pruning.

A save slower than the requests must not pile up snapshots or fall further and
further behind; a stop writes one save; a crash while old checkpoints are
deleted leaves only whole checkpoints under committed names.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.net._client import Client
from hpsjax.net._server import Server
from hpsjax.storage import _checkpoint, _checkpoint_orbax
from hpsjax.storage._checkpoint import CheckpointManager

LOGGER = "hpsjax.storage._checkpoint"
SAVE_DELAY_S = 0.2


def _step(path: pathlib.Path) -> int:
    return int(path.name.removeprefix("ckpt_"))


class _SlowSaves:
    """Wraps orbax's save with a delay; records each save's step at its start."""

    def __init__(self, monkeypatch, delay: float = SAVE_DELAY_S):
        self.started: list[int] = []
        self.requested = 0  # what the test has asked for so far
        self.lags: list[int] = []
        real = _checkpoint_orbax.save

        def slow_save(checkpointer, path, tree, meta):
            step = _step(path)
            self.started.append(step)
            self.lags.append(self.requested - step)
            time.sleep(delay)
            real(checkpointer, path, tree, meta)

        monkeypatch.setattr(_checkpoint_orbax, "save", slow_save)


def test_a_save_slower_than_the_requests_keeps_two_snapshots_at_most(
    tmp_path, monkeypatch
):
    slow = _SlowSaves(monkeypatch)
    manager = CheckpointManager(tmp_path, keep=2)
    snapshots: list[weakref.ref] = []
    most_held = most_queued = 0
    requests = 40
    for step in range(1, requests + 1):
        array = np.full(1000, step, np.float32)
        snapshots.append(weakref.ref(array))
        # By reference: the manager holds the very arrays it will write.
        manager.save_async(step, {"w": array}, {"step": step}, snapshot=False)
        slow.requested = step
        del array
        most_held = max(most_held, sum(r() is not None for r in snapshots))
        most_queued = max(most_queued, manager.queued_saves)
        time.sleep(0.01)
    manager.close()

    assert most_held <= 2, most_held
    assert most_queued <= 2, most_queued
    assert all(r() is None for r in snapshots)
    # Each save writes the newest state asked for when it starts: the lag stays
    # bounded (the old queue reached requests - save count, about 30 here).
    assert max(slow.lags) <= 3, slow.lags
    assert len(slow.started) < requests / 2, slow.started
    assert slow.started[-1] == requests
    assert manager.folded_saves == requests - len(slow.started)
    assert manager.steps() == slow.started[-2:]
    restored = manager.restore_latest()
    assert restored.step == requests and restored.metadata == {"step": requests}
    np.testing.assert_array_equal(restored.tree["w"], np.full(1000, requests))


def test_close_writes_one_save_however_many_were_due(tmp_path, monkeypatch):
    slow = _SlowSaves(monkeypatch)
    manager = CheckpointManager(tmp_path)
    for step in range(1, 30):
        manager.save_async(step, {"w": np.full(8, step)})
    manager.close()
    # At most the save being written when close came (under load its thread
    # may not have begun it yet) and one of the newest state.
    assert len(slow.started) <= 2
    assert manager.latest_step() == 29


def test_falling_behind_is_logged_at_most_once_a_minute(tmp_path, monkeypatch, caplog):
    _SlowSaves(monkeypatch)
    manager = CheckpointManager(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in range(1, 20):
            manager.save_async(step, {"w": np.zeros(4)})
        manager.wait_until_finished()
    behind = [r for r in caplog.records if "fall behind" in r.getMessage()]
    assert manager.folded_saves >= 10
    assert len(behind) == 1, [r.getMessage() for r in behind]
    assert "folded into newer ones" in behind[0].getMessage()

    caplog.clear()
    monkeypatch.setattr(_checkpoint, "_BEHIND_LOG_INTERVAL_S", 0.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in range(20, 25):
            manager.save_async(step, {"w": np.zeros(4)})
        manager.close()
    behind = [r for r in caplog.records if "fall behind" in r.getMessage()]
    assert len(behind) >= 2
    assert "the last save took" in behind[-1].getMessage()


def test_a_failed_save_does_not_stop_the_waiting_one(tmp_path, monkeypatch):
    real = _checkpoint_orbax.save
    entered, gate = threading.Event(), threading.Event()

    def save(checkpointer, path, tree, meta):
        entered.set()
        gate.wait(30)
        if _step(path) == 1:
            raise OSError("disk hiccup")
        real(checkpointer, path, tree, meta)

    monkeypatch.setattr(_checkpoint_orbax, "save", save)
    manager = CheckpointManager(tmp_path)
    first = manager.save_async(1, {"w": np.zeros(2)})
    assert entered.wait(60)  # step 1 is being written: step 2 waits
    second = manager.save_async(2, {"w": np.ones(2)})
    gate.set()
    with pytest.raises(OSError, match="disk hiccup"):
        first.result(timeout=60)
    assert second.result(timeout=60) == tmp_path / "ckpt_2"
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        manager.close()
    assert manager.steps() == [2]


# -- the server ----------------------------------------------------------------

SECRET = b"keep-up secret"


def _big_params():
    return {"w": jnp.zeros((256, 256), jnp.float32), "b": jnp.zeros(8, jnp.float32)}


def test_server_checkpoints_keep_up_with_an_interval_shorter_than_a_save(
    tmp_path, monkeypatch
):
    slow = _SlowSaves(monkeypatch)
    params = _big_params()
    update = {k: np.full(v.shape, 0.01, np.float32) for k, v in params.items()}

    async def main():
        server = Server(
            params,
            optax.sgd(0.1),
            "asp",
            secret=SECRET,
            checkpoint_dir=tmp_path,
            checkpoint_every_s=0.02,
            checkpoint_keep=2,
        )
        await server.start()
        client = Client("127.0.0.1", server.port, worker_id="w", secret=SECRET)
        await client.connect()
        _, version = await client.pull()
        manager = server._manager
        most_queued = 0
        # Versions, not seconds: under load the pushes slow down, the saves too.
        deadline = time.monotonic() + 120.0
        while version < 60 and time.monotonic() < deadline:
            version = (await client.push(update, version=version)).version
            slow.requested = version
            most_queued = max(most_queued, manager.queued_saves)
            await asyncio.sleep(0.005)
        await client.close()
        # Nothing awaits between these and close's own request for a save.
        written_before_close = len(slow.started)
        waiting = manager.queued_saves == 2
        await server.close()
        return server.version, most_queued, written_before_close, waiting, manager

    version, most_queued, written_before_close, waiting, manager = asyncio.run(main())
    # Saves came due every 20 ms, each took 200 ms: folded, never queued up.
    assert most_queued <= 2
    assert manager.folded_saves > 0
    assert max(slow.lags) <= 3 + version // 10, (version, slow.lags)
    # The stop wrote one save (after the running one, and one already waiting).
    assert len(slow.started) - written_before_close <= 1 + waiting, slow.started
    assert slow.started[-1] == version
    with CheckpointManager(tmp_path) as reader:
        assert reader.latest_step() == version


# -- pruning -------------------------------------------------------------------

_PRUNE_CHILD = textwrap.dedent(
    """
    import os, pathlib, shutil, sys, time
    import numpy as np
    from hpsjax.storage import _checkpoint
    from hpsjax.storage._checkpoint import CheckpointManager

    directory, stage, marker = sys.argv[1:4]
    manager = CheckpointManager(directory, keep=2)

    def tree(value):
        return {"w": np.full((64, 64), value, np.float32),
                "b": [np.full(5, value, np.float64) for _ in range(6)]}

    manager.save(1, tree(1.0), {"step": 1})
    manager.save(2, tree(2.0), {"step": 2})

    def pause():
        pathlib.Path(marker).touch()
        time.sleep(600)

    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.basename(path).startswith(_checkpoint._PRUNED_PREFIX):
            if stage == "half-deleted":
                files = sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())
                for p in files[: len(files) // 2]:
                    p.unlink()
            pause()
        real_rmtree(path, *args, **kwargs)

    _checkpoint.shutil.rmtree = rmtree
    manager.save(3, tree(3.0), {"step": 3})
    """
)


def _committed_checkpoint_is_whole(root: pathlib.Path) -> bool:
    return (
        (root / "_CHECKPOINT_METADATA").is_file()
        and (root / "meta" / "meta.msgpack").is_file()
        and (root / "state").is_dir()
    )


@pytest.mark.parametrize("stage", ["moved-aside", "half-deleted"])
def test_a_kill_while_pruning_leaves_only_whole_checkpoints(tmp_path, stage, caplog):
    directory, marker = tmp_path / "ckpts", tmp_path / "paused"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PRUNE_CHILD, str(directory), stage, str(marker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"child exited: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "child did not reach the prune"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()

    committed = sorted(p.name for p in directory.glob("ckpt_*"))
    assert committed == ["ckpt_2", "ckpt_3"]
    assert all(_committed_checkpoint_is_whole(directory / n) for n in committed)
    leftovers = [p.name for p in directory.glob(f"{_checkpoint._PRUNED_PREFIX}*")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".pruned-ckpt_1-")

    with caplog.at_level(logging.INFO, logger=LOGGER):
        manager = CheckpointManager(directory, keep=2)
    assert "removing interrupted prune" in caplog.text
    assert not list(directory.glob(f"{_checkpoint._PRUNED_PREFIX}*"))
    for step in (2, 3):  # every committed checkpoint restores, checksums and all
        restored = manager.restore(step)
        assert restored.metadata == {"step": step}
        np.testing.assert_array_equal(restored.tree["w"], np.full((64, 64), step))
    assert manager.restore_latest().step == 3
    manager.save(4, {"w": np.zeros(2)})
    manager.close()
    assert manager.steps() == [3, 4]


def test_pruning_keeps_the_newest_and_leaves_nothing_aside(tmp_path):
    with CheckpointManager(tmp_path, keep=3) as manager:
        for step in range(6):
            manager.save(step, {"w": np.full(3, step)})
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != _checkpoint._LOCK)
    assert names == ["ckpt_3", "ckpt_4", "ckpt_5"]


_SLOW_SERVER = textwrap.dedent(
    """
    import sys, time
    from hpsjax.ps import _cli
    from hpsjax.storage import _checkpoint_orbax

    real = _checkpoint_orbax.save

    def slow_save(checkpointer, path, tree, meta):
        print(f"save-start {path.name.removeprefix('ckpt_')} {time.monotonic()}",
              flush=True)
        time.sleep(0.3)
        real(checkpointer, path, tree, meta)

    _checkpoint_orbax.save = slow_save
    sys.exit(_cli.main(sys.argv[1:]))
    """
)


def test_sigterm_writes_one_save_however_far_behind_the_saves_are(tmp_path):
    from hpsjax.models import save_params_npz

    save_params_npz(
        tmp_path / "init.npz", {k: np.asarray(v) for k, v in _big_params().items()}
    )
    (tmp_path / "secret").write_bytes(SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SERVER, "--init", str(tmp_path / "init.npz"),
         "--secret_file", str(tmp_path / "secret"), "--checkpoint_dir",
         str(tmp_path / "ckpt"), "--checkpoint_every_s", "0.02", "--loop", "asyncio",
         "--log_level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    try:
        port = None
        for line in proc.stdout:  # the server's output up to listening
            if "listening on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        assert port is not None, proc.stderr.read()
        reader.start()
        update = {
            k: np.full(v.shape, 0.01, np.float32) for k, v in _big_params().items()
        }

        async def push() -> int:
            async with Client("127.0.0.1", port, worker_id="w", secret=SECRET) as c:
                _, version = await c.pull()
                while version < 40:
                    version = (await c.push(update, version=version)).version
                    await asyncio.sleep(0.005)
            return version

        version = asyncio.run(asyncio.wait_for(push(), 120))
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    starts = [line.split() for line in lines if line.startswith("save-start")]
    after = [int(step) for _, step, at in starts if float(at) > signalled]
    # One save of the final state, after at most the one that was waiting.
    assert 1 <= len(after) <= 2, (after, len(starts))
    assert after[-1] == version
    with CheckpointManager(tmp_path / "ckpt") as reader_manager:
        assert reader_manager.latest_step() == version
