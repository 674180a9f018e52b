"""Tests of hpsjax.storage._checkpoint: round trips, atomicity, pruning, bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path.atomicity import AtomicRenameTemporaryPath

from hpsjax.storage import _checkpoint, _checkpoint_orbax
from hpsjax.storage._checkpoint import Checkpoint, CheckpointError, CheckpointManager

LOGGER = "hpsjax.storage._checkpoint"
TMP = _checkpoint_orbax.TMP_SUFFIX


def _params(scale: float = 1.0):
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    return {
        "dense": {
            "kernel": scale * jax.random.normal(k1, (4, 3), jnp.float32),
            "bias": jnp.full((3,), scale, jnp.float32),
        },
        "embed": (scale * jax.random.normal(k2, (5, 2))).astype(jnp.bfloat16),
        "temperature": jnp.asarray(scale, jnp.float32),
    }


def _server_state(scale: float = 1.0):
    params = _params(scale)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state, "version": 17}


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, bool | int | float | str):
            assert type(x) is type(y) and x == y
            continue
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _entries(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != _checkpoint._LOCK)


def _meta(root: pathlib.Path) -> pathlib.Path:
    return root / "meta" / "meta.msgpack"


# -- round trips --------------------------------------------------------------


def test_round_trip_adam_state_with_like_restores_namedtuples(tmp_path):
    state = _server_state(2.0)
    metadata = {"workers": {0: {"clock": 3, "addr": "127.0.0.1"}, 1: {"clock": 5}}}
    manager = CheckpointManager(tmp_path)
    path = manager.save(4, state, metadata)
    assert path == tmp_path / "ckpt_4"

    like = _server_state(0.0)
    restored = manager.restore_latest(like=like)
    assert isinstance(restored, Checkpoint)
    step, tree, meta = restored
    assert step == 4
    assert meta == metadata
    _assert_trees_equal(tree, state)
    adam_state = tree["opt_state"][1][0]
    assert type(adam_state) is optax.ScaleByAdamState
    assert type(tree["opt_state"][0]) is optax.EmptyState
    assert isinstance(tree["params"]["dense"]["kernel"], jax.Array)
    assert tree["params"]["embed"].dtype == jnp.bfloat16
    assert tree["version"] == 17 and type(tree["version"]) is int


def test_round_trip_without_like_gives_plain_containers(tmp_path):
    state = _server_state()
    manager = CheckpointManager(tmp_path)
    manager.save(0, state)
    step, tree, meta = manager.restore_latest()
    assert (step, meta) == (0, None)
    # Orbax's plain containers: tuples as lists, NamedTuples as dicts, empty
    # nodes (optax.EmptyState) as None.
    adam = tree["opt_state"][1][0]
    assert isinstance(tree["opt_state"], list)
    assert set(adam) == {"count", "mu", "nu"}
    assert isinstance(adam["mu"]["dense"]["kernel"], np.ndarray)
    np.testing.assert_array_equal(
        adam["nu"]["embed"], np.asarray(state["opt_state"][1][0].nu["embed"])
    )
    assert tree["opt_state"][0] is None
    assert tree["version"] == 17


def test_like_of_shape_dtype_structs_gives_jax_arrays(tmp_path):
    state = _server_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state)
    abstract = jax.eval_shape(lambda: _server_state())
    _, tree, _ = manager.restore(1, like=abstract)
    # eval_shape makes the Python int version a 0-d int32 leaf.
    assert isinstance(tree["version"], jax.Array)
    assert tree["version"].dtype == jnp.int32 and int(tree["version"]) == 17
    tree["version"] = int(tree["version"])
    _assert_trees_equal(tree, state)
    assert isinstance(tree["params"]["embed"], jax.Array)


def test_abstract_like_refuses_a_scalar_its_dtype_cannot_hold(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"version": 2**40, "lr": 0.5})
    like = {"version": jax.ShapeDtypeStruct((), jnp.int32), "lr": 0.1}
    with pytest.raises(ValueError, match="does not fit"):
        manager.restore(1, like=like)
    like = {"version": jax.ShapeDtypeStruct((), jnp.int64), "lr": 0.1}
    with pytest.raises(ValueError, match="shape"):
        manager.restore(1, like={**like, "version": jax.ShapeDtypeStruct((2,), "f4")})


def test_bfloat16_scalars_empty_and_python_leaves_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tree = {
        "bf16": rng.normal(size=(7, 5)).astype(ml_dtypes.bfloat16),
        "bf16_scalar": jnp.asarray(3.25, jnp.bfloat16),
        "f32_scalar": np.asarray(-1.5, np.float32),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u8": np.arange(9, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float32),
        "np_scalar": np.float16(0.5),
        "py": [1, 2.5, True, "text", None],
        "count": jnp.asarray(9, jnp.int32),
    }
    manager = CheckpointManager(tmp_path)
    manager.save(2, tree)
    _, with_like, _ = manager.restore(2, like=tree)
    _assert_trees_equal(with_like, tree)
    assert type(with_like["np_scalar"]) is np.float16
    assert isinstance(with_like["bf16_scalar"], jax.Array)
    assert with_like["bf16_scalar"].shape == ()

    _, plain, _ = manager.restore(2)
    assert plain["bf16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        plain["bf16"].view(np.uint16), tree["bf16"].view(np.uint16)
    )
    assert plain["empty"].shape == (0, 3)
    assert plain["py"] == [1, 2.5, True, "text", None]
    assert type(plain["py"][2]) is bool


def test_metadata_round_trips_msgpack_values(tmp_path):
    metadata = {
        "version": 12,
        "workers": {3: {"batch_size": 64, "seen": [1, 2, 3]}, 7: None},
        "loss": float("inf"),
        "blob": b"\x00\x01",
        "name": "ssp",
    }
    manager = CheckpointManager(tmp_path)
    manager.save(5, {"w": np.ones(2)}, metadata)
    assert manager.restore(5).metadata == metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Pair:
    first: jax.Array
    second: jax.Array


def test_custom_pytree_node(tmp_path):
    tree = {"pair": _Pair(jnp.arange(3.0), jnp.ones((2, 2)))}
    manager = CheckpointManager(tmp_path)
    manager.save(0, tree)
    _, restored, _ = manager.restore(0, like=tree)
    assert isinstance(restored["pair"], _Pair)
    _assert_trees_equal(restored, tree)
    _, plain, _ = manager.restore(0)
    np.testing.assert_array_equal(plain["pair"]["second"], np.ones((2, 2)))


def test_empty_tree_and_empty_states(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(0, optax.EmptyState())
    assert manager.restore(0, like=optax.EmptyState()).tree == optax.EmptyState()
    manager.save(1, {})
    assert manager.restore_latest().tree == {}


# -- listing and pruning ------------------------------------------------------


def test_keep_prunes_oldest_after_commit(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    assert manager.latest_step() is None and manager.restore_latest() is None
    for step in (1, 3, 10, 11):
        manager.save(step, {"w": np.full(3, step, np.float32)})
    assert manager.steps() == [10, 11]
    assert manager.latest_step() == 11
    assert _entries(tmp_path) == ["ckpt_10", "ckpt_11"]
    np.testing.assert_array_equal(manager.restore(10).tree["w"], np.full(3, 10))


def test_keep_none_keeps_all(tmp_path):
    manager = CheckpointManager(tmp_path, keep=None)
    for step in range(5):
        manager.save(step, {"w": np.zeros(1)})
    assert manager.steps() == [0, 1, 2, 3, 4]


def test_a_new_manager_sees_existing_checkpoints(tmp_path):
    CheckpointManager(tmp_path).save(8, {"w": np.arange(3)})
    again = CheckpointManager(tmp_path)
    assert again.steps() == [8]
    np.testing.assert_array_equal(again.restore_latest().tree["w"], np.arange(3))


def test_a_step_saved_is_not_saved_again(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"w": np.zeros(2)}, {"v": 1})
    with pytest.raises(ValueError, match="already exists"):
        manager.save(3, {"w": np.ones(2)})
    with pytest.raises(ValueError, match="already exists"):
        manager.save_async(3, {"w": np.ones(2)})
    manager.close()
    assert manager.restore(3).metadata == {"v": 1}
    assert _entries(tmp_path) == ["ckpt_3"]


# -- atomicity ---------------------------------------------------------------


def test_failure_while_writing_leaves_keeps_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    first = _server_state(1.0)
    manager.save(1, first)

    def failing_write(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(_checkpoint_orbax, "write_meta", failing_write)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, _server_state(2.0))
    monkeypatch.undo()

    assert _entries(tmp_path) == ["ckpt_1"]
    step, tree, _ = manager.restore_latest(like=first)
    assert step == 1
    _assert_trees_equal(tree, first)


def test_failure_before_commit_keeps_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": np.zeros(4)})

    async def failing_commit(self, *args, **kwargs):
        raise OSError("I/O error")

    monkeypatch.setattr(AtomicRenameTemporaryPath, "finalize", failing_commit)
    with pytest.raises(OSError, match="I/O error"):
        manager.save(2, {"w": np.ones(4)})
    monkeypatch.undo()
    assert manager.steps() == [1]
    np.testing.assert_array_equal(manager.restore_latest().tree["w"], np.zeros(4))


_CHILD = textwrap.dedent(
    """
    import pathlib, sys, time
    import numpy as np
    from orbax.checkpoint._src.path.atomicity import AtomicRenameTemporaryPath
    from hpsjax.storage import _checkpoint_orbax
    from hpsjax.storage._checkpoint import CheckpointManager

    directory, stage, marker = sys.argv[1:4]
    manager = CheckpointManager(directory)

    def tree(value):
        return {"w": np.full((64, 64), value, np.float32),
                "b": [np.full(5, value, np.float64) for _ in range(6)]}

    manager.save(1, tree(1.0), {"step": 1})

    def pause():
        pathlib.Path(marker).touch()
        time.sleep(600)

    async def pause_commit(self, *args, **kwargs):
        pause()

    if stage == "leaves":
        _checkpoint_orbax.write_meta = lambda path, data: pause()
    elif stage == "commit":
        AtomicRenameTemporaryPath.finalize = pause_commit
    manager.save(2, tree(2.0), {"step": 2})
    """
)


def _start_child(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("child did not reach the crash point")
        time.sleep(0.02)


@pytest.mark.parametrize("stage", ["leaves", "commit"])
def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path, stage, caplog):
    directory = tmp_path / "ckpts"
    marker = tmp_path / "paused"
    proc = _start_child([_CHILD, str(directory), stage, str(marker)])
    try:
        _wait_for(marker, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()

    leftovers = [n for n in _entries(directory) if n.startswith(".") or TMP in n]
    assert leftovers, "the crash should have left a temporary directory"

    with caplog.at_level(logging.INFO, logger=LOGGER):
        manager = CheckpointManager(directory)
        restored = manager.restore_latest()
    assert restored.step == 1
    assert restored.metadata == {"step": 1}
    np.testing.assert_array_equal(restored.tree["w"], np.full((64, 64), 1.0))
    assert _entries(directory) == ["ckpt_1"]
    assert "interrupted checkpoint save" in caplog.text


_HOLDER = textwrap.dedent(
    """
    import pathlib, sys, time
    import numpy as np
    from hpsjax.storage._checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[1])
    manager.save(2, {"w": np.zeros(1)})
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(600)
    """
)


def test_temp_dir_of_a_live_saving_process_is_left_alone(tmp_path):
    directory, marker = tmp_path / "ckpts", tmp_path / "ready"
    holder = _start_child([_HOLDER, str(directory), str(marker)])
    try:
        _wait_for(marker, holder)
        # The holder's save in progress, as another manager would see it.
        live = directory / f"ckpt_3{TMP}-123"
        live.mkdir()
        manager = CheckpointManager(directory)
        assert manager.restore_latest().step == 2
        assert live.exists()
        with pytest.raises(ValueError, match="another live checkpoint manager"):
            manager.save(4, {"w": np.zeros(1)})
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stderr.close()
    # The holder is gone: its lock with it.
    assert manager.restore_latest().step == 2
    assert not live.exists()
    manager.save(4, {"w": np.ones(1)})
    manager.close()
    assert _entries(directory) == ["ckpt_2", "ckpt_4"]


_LOOP_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from hpsjax.storage._checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[1], keep=2)
    start = (manager.latest_step() or 0) + 1
    for step in range(start, start + 100000):
        value = float(step)
        manager.save(step, {"w": np.full((256, 256), value, np.float32),
                            "v": [np.full(100, value) for _ in range(20)]},
                     {"step": step})
    """
)


def _newest_on_disk(directory: pathlib.Path) -> int:
    """Newest committed step, read without opening a manager (which cleans up)."""
    steps = [
        int(p.name.removeprefix("ckpt_"))
        for p in directory.glob("ckpt_*")
        if p.name.removeprefix("ckpt_").isdigit()
    ]
    return max(steps, default=0)


@pytest.mark.slow
def test_random_sigkills_never_leave_a_broken_latest(tmp_path):
    rng = np.random.default_rng(1)
    for _ in range(4):
        before = _newest_on_disk(tmp_path)
        proc = _start_child([_LOOP_CHILD, str(tmp_path)])
        # Kill at a random moment once the child is saving (its start-up time
        # depends on the machine's load).
        deadline = time.monotonic() + 120
        while _newest_on_disk(tmp_path) <= before:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "child never saved"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        restored = CheckpointManager(tmp_path, keep=2).restore_latest()
        assert restored is not None
        step = restored.step
        assert restored.metadata == {"step": step}
        np.testing.assert_array_equal(restored.tree["w"], np.full((256, 256), step))
        for v in restored.tree["v"]:
            np.testing.assert_array_equal(v, np.full(100, float(step)))
        assert not [n for n in _entries(tmp_path) if n.startswith(".") or TMP in n]


# -- damaged checkpoints -----------------------------------------------------


def _three_checkpoints(tmp_path) -> CheckpointManager:
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        manager.save(step, {"w": np.full((8, 8), step, np.float32)}, {"s": step})
    return manager


@pytest.mark.parametrize(
    "damage",
    ["flip_byte", "truncate", "delete", "wrong_magic", "not_a_manifest"],
)
def test_damaged_manifest_is_skipped_with_a_warning(tmp_path, damage, caplog):
    manager = _three_checkpoints(tmp_path)
    manifest = _meta(tmp_path / "ckpt_3")
    data = manifest.read_bytes()
    if damage == "flip_byte":
        manifest.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif damage == "truncate":
        manifest.write_bytes(data[:20])
    elif damage == "delete":
        manifest.unlink()
    elif damage == "wrong_magic":
        manifest.write_bytes(b"XXXXXXXX" + data[8:])
    else:
        manifest.write_bytes(_checkpoint._pack_meta({"format": "something else"}))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        restored = manager.restore_latest()
    assert restored.step == 2 and restored.metadata == {"s": 2}
    assert "skipping damaged checkpoint" in caplog.text
    assert "ckpt_3" in caplog.text
    assert manager.steps() == [1, 2]
    aside = tmp_path / "ckpt_3.damaged-1"
    assert aside.is_dir(), "damaged checkpoints are kept for a look"
    assert "ckpt_3.damaged-1" in caplog.text
    with pytest.raises(ValueError, match="no checkpoint for step 3"):
        manager.restore(3)


def _damage_leaf(root: pathlib.Path) -> None:
    """Flips one bit in the biggest data file of the arrays item."""
    chunk = max(
        (p for p in (root / "state").rglob("d/*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))


def test_saving_goes_on_after_falling_back_from_a_damaged_checkpoint(tmp_path):
    manager = _three_checkpoints(tmp_path)
    manager.close()
    _damage_leaf(tmp_path / "ckpt_3")
    # A restarted run resumes from step 2 and saves its next steps, older
    # than the damaged one; a clean close raises nothing.
    manager = CheckpointManager(tmp_path)
    assert manager.restore_latest().step == 2
    manager.save(3, {"w": np.full((8, 8), 30, np.float32)}, {"s": 30})
    manager.save_async(4, {"w": np.full((8, 8), 40, np.float32)})
    manager.close()
    assert manager.steps() == [2, 3, 4]
    assert manager.restore(3).metadata == {"s": 30}
    assert _meta(tmp_path / "ckpt_3.damaged-1").is_file()
    # Damaged again: moved aside under the next free name, the first kept.
    _damage_leaf(tmp_path / "ckpt_4")
    assert CheckpointManager(tmp_path).restore_latest().step == 3
    _damage_leaf(tmp_path / "ckpt_3")
    assert CheckpointManager(tmp_path).restore_latest().step == 2
    assert (tmp_path / "ckpt_3.damaged-2").is_dir()
    assert (tmp_path / "ckpt_4.damaged-1").is_dir()
    assert (tmp_path / "ckpt_3.damaged-1").is_dir()


def test_damaged_leaf_data_is_detected(tmp_path, caplog):
    manager = _three_checkpoints(tmp_path)
    _damage_leaf(tmp_path / "ckpt_3")
    with pytest.raises(CheckpointError):
        manager.restore(3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.restore_latest().step == 2
    assert "skipping damaged checkpoint" in caplog.text


def test_a_flipped_bit_in_array_data_fails_its_crc32(tmp_path):
    manager = CheckpointManager(tmp_path)
    rng = np.random.default_rng(0)
    manager.save(1, {"w": rng.normal(size=(256, 256)).astype(np.float32)})
    _damage_leaf(tmp_path / "ckpt_1")
    with pytest.raises(CheckpointError, match="crc32"):
        manager.restore(1)


def test_missing_leaf_is_detected(tmp_path):
    manager = _three_checkpoints(tmp_path)
    for p in sorted((tmp_path / "ckpt_3" / "state").iterdir()):
        if p.is_dir():
            _checkpoint.shutil.rmtree(p)
        else:
            p.unlink()
    with pytest.raises(CheckpointError, match="cannot read leaf"):
        manager.restore(3)
    assert manager.restore_latest().step == 2


# -- bad input ----------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, None])
def test_bad_step_is_refused(tmp_path, step):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step must be"):
        manager.save(step, {"w": np.zeros(1)})
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("keep", [0, -2, 1.0, True, "3"])
def test_bad_keep_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path / "d", keep=keep)
    assert not (tmp_path / "d").exists()


def test_directory_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        CheckpointManager(path)


@pytest.mark.parametrize(
    "tree, match",
    [
        ({"w": np.array([object()], dtype=object)}, "cannot store"),
        ({"f": len}, "unsupported type"),
        ({"s": {1, 2}}, "unsupported type"),
        ({(1, 2): np.zeros(1)}, "not a str or int"),
        ({"big": 2**70}, "int64"),
        ({"abstract": jax.ShapeDtypeStruct((2,), jnp.float32)}, "no data"),
    ],
)
def test_bad_tree_changes_nothing(tmp_path, tree, match):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": np.zeros(1)})
    with pytest.raises(ValueError, match=match):
        manager.save(2, tree)
    with pytest.raises(ValueError, match=match):
        manager.save_async(2, tree)
    assert _entries(tmp_path) == ["ckpt_1"]
    manager.close()


@pytest.mark.parametrize("metadata", [{"a": np.zeros(2)}, {"s": {1}}, object()])
def test_bad_metadata_changes_nothing(tmp_path, metadata):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="msgpack"):
        manager.save(1, {"w": np.zeros(1)}, metadata)
    assert _entries(tmp_path) == []


def test_older_step_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, {"w": np.zeros(1)})
    with pytest.raises(ValueError, match="older than"):
        manager.save(4, {"w": np.zeros(1)})
    with pytest.raises(ValueError, match="older than"):
        manager.save_async(4, {"w": np.zeros(1)})
    manager.close()
    assert manager.steps() == [5]


def test_restore_of_a_missing_step_lists_available(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(2, {"w": np.zeros(1)})
    with pytest.raises(ValueError, match=r"no checkpoint for step 7.*\[2\]"):
        manager.restore(7)


@pytest.mark.parametrize(
    "like, match",
    [
        (
            {"params": {"w": jnp.zeros((2, 2))}},
            r"only the checkpoint has \['params.b'\]",
        ),
        (
            {"params": {"w": jnp.zeros(3), "b": jnp.zeros(2)}},
            r"params.w: .*float32\[3\]",
        ),
        (
            {"params": {"w": jnp.zeros((2, 2), jnp.int32), "b": jnp.zeros(2)}},
            "int32",
        ),
        ({"params": [jnp.zeros(2), jnp.zeros((2, 2))]}, r"only like has \['params.0'"),
        ({"params": {"w": jnp.zeros((2, 2)), "b": 1.0}}, "Python float"),
    ],
)
def test_like_mismatch_is_a_clear_value_error(tmp_path, like, match):
    manager = CheckpointManager(tmp_path)
    manager.save(
        1, {"params": {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}}
    )
    with pytest.raises(ValueError, match=match) as info:
        manager.restore(1, like=like)
    assert not isinstance(info.value, CheckpointError)
    with pytest.raises(ValueError, match=match):
        manager.restore_latest(like=like)


# -- asynchronous saves and threads ------------------------------------------


def test_save_async_snapshots_the_tree(tmp_path):
    manager = CheckpointManager(tmp_path)
    array = np.zeros(1000, np.float32)
    future = manager.save_async(1, {"w": array}, {"n": 1})
    array += 5.0
    assert future.result(timeout=60) == tmp_path / "ckpt_1"
    manager.close()
    np.testing.assert_array_equal(manager.restore(1).tree["w"], np.zeros(1000))


def test_save_async_writes_the_newest_state_and_prunes(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as manager:
        futures = [manager.save_async(s, {"w": np.full(4, s)}) for s in range(5)]
    assert all(f.done() for f in futures)
    # Requests folded while an earlier save was written end in the newest one.
    assert futures[-1].result() == tmp_path / "ckpt_4"
    assert manager.steps()[-1] == 4 and len(manager.steps()) <= 2
    assert manager.folded_saves == 5 - len({f.result() for f in futures})
    np.testing.assert_array_equal(manager.restore(4).tree["w"], np.full(4, 4))


def test_failed_background_save_surfaces_on_next_call(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)

    def failing_write(path, data):
        raise OSError("disk gone")

    monkeypatch.setattr(_checkpoint_orbax, "write_meta", failing_write)
    future = manager.save_async(1, {"w": np.zeros(2)})
    with pytest.raises(OSError, match="disk gone"):
        future.result(timeout=60)
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        manager.save_async(2, {"w": np.zeros(2)})
    monkeypatch.undo()
    manager.save_async(2, {"w": np.zeros(2)}).result(timeout=60)
    manager.close()
    assert manager.steps() == [2]
    assert _entries(tmp_path) == ["ckpt_2"]


def test_save_async_from_asyncio_does_not_block_the_loop(tmp_path):
    manager = CheckpointManager(tmp_path)
    tree = {"w": np.ones((512, 512), np.float32)}

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        path = await asyncio.wrap_future(manager.save_async(1, tree))
        task.cancel()
        return path, ticks

    path, ticks = asyncio.run(main())
    manager.close()
    assert path == tmp_path / "ckpt_1"
    assert ticks > 1
    np.testing.assert_array_equal(manager.restore(1).tree["w"], tree["w"])


def test_restores_from_another_thread_see_only_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(0, {"w": np.zeros((64, 64)), "meta_step": 0})
    errors = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                step, tree, _ = manager.restore_latest()
                assert tree["meta_step"] == step
                np.testing.assert_array_equal(tree["w"], np.full((64, 64), step))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(1, 8):
            manager.save_async(step, {"w": np.full((64, 64), step), "meta_step": step})
        manager.wait_until_finished()
    finally:
        stop.set()
        thread.join(timeout=60)
        manager.close()
    assert not errors
    steps = manager.steps()
    assert steps[-1] == 7 and len(steps) <= 2
