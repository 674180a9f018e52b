"""The trained parameters out of a run, and into the user's flax module.

End to end: a real ``hpsjax-server`` process, updates pushed over loopback, a
SIGTERM; ``--export_params`` and ``python -m hpsjax.export`` give the same
file, and LAUNCH.md's recipe, run as written, loads it into the module.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from hpsjax import data, export, models
from hpsjax.net._client import Client
from hpsjax.ps import KeyRangePartition
from hpsjax.storage._checkpoint import CheckpointManager

ROOT = pathlib.Path(__file__).resolve().parents[3]
SECRET = b"export-secret-0123456789abcdef"
LR, STEP, PUSHES = 0.5, 0.01, 5


def _recipe() -> str:
    text = (ROOT / "LAUNCH.md").read_text()
    section = text.split("### The trained parameters", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    return block


def _mlp_params() -> dict:
    digits = data.get_dataset("synthetic_digits")
    model = models.resolve_model(
        "mlp", input_shape=digits.input_shape, num_classes=digits.num_classes
    ).model
    return jax.tree.map(np.asarray, models.split_model(model)[1])


def _start_server(tmp_path: pathlib.Path, *flags: str) -> tuple[subprocess.Popen, int]:
    code = "import sys; from hpsjax.ps._cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--secret_file", str(tmp_path / "secret"),
         "--loop", "asyncio", "--log_level", "WARNING", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if "listening on" in line:
            return proc, int(line.rsplit(":", 1)[1])
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"server did not listen: {proc.stderr.read()}")


async def _push(port: int, like: dict) -> int:
    update = jax.tree.map(lambda x: np.full(x.shape, STEP, x.dtype), like)
    async with Client("127.0.0.1", port, worker_id="w", secret=SECRET) as client:
        _, version = await client.pull()
        for _ in range(PUSHES):
            version = (await client.push(update, version=version)).version
    return version


def _assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_at_stop_from_checkpoints_and_into_the_module(tmp_path):
    (tmp_path / "secret").write_bytes(SECRET)
    init = _mlp_params()
    models.save_params_npz(tmp_path / "init.npz", init)
    proc, port = _start_server(
        tmp_path, "--init", "init.npz", "--optimizer", "sgd",
        "--learning_rate", str(LR), "--checkpoint_dir", "ckpt",
        "--export_params", "params.npz",
    )  # fmt: skip
    try:
        version = asyncio.run(asyncio.wait_for(_push(port, init), 120))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert version == PUSHES
    assert f"wrote the parameters of version {PUSHES} to params.npz" in out

    exported = models.load_params_npz(tmp_path / "params.npz")
    expected = jax.tree.map(lambda x: x - LR * PUSHES * np.float32(STEP), init)
    for got, want in zip(
        jax.tree.leaves(exported), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-6)  # five float32 steps

    # The checkpoint directory gives the same file; the file starts a new run.
    done = subprocess.run(
        [sys.executable, "-m", "hpsjax.export", "ckpt", "from_ckpt.npz"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"of step {PUSHES} to from_ckpt.npz" in done.stdout
    _assert_equal_trees(models.load_params_npz(tmp_path / "from_ckpt.npz"), exported)
    from hpsjax.ps._cli import load_npz_tree

    _assert_equal_trees(load_npz_tree(tmp_path / "params.npz"), exported)

    # LAUNCH.md's recipe, as written, in the run's directory.
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ns: dict = {"__name__": "__launch__"}
        exec(compile(_recipe(), "LAUNCH.md recipe", "exec"), ns)
    finally:
        os.chdir(cwd)
    _, loaded = models.split_model(ns["model"])
    _assert_equal_trees(jax.tree.map(np.asarray, loaded), exported)
    assert ns["predicted"].shape == (16,)


def _save_server_checkpoint(directory, step, params):
    opt_state = optax.sgd(0.1).init(params)
    with CheckpointManager(directory) as manager:
        manager.save(step, (params, opt_state), {"format": "hpsjax-server", "core": {}})


def test_shards_checkpoints_join_into_one_model(tmp_path):
    params = _mlp_params()
    partition = KeyRangePartition.from_tree(params, 3, split_leaves=True)
    assert partition.cuts_leaves
    for shard, part in enumerate(partition.split(params)):
        _save_server_checkpoint(tmp_path / f"shard_{shard}_of_3", 10 + shard, part)
    joined, steps = export.checkpoint_params(tmp_path)
    assert steps == [10, 11, 12]
    _assert_equal_trees(joined, params)

    (tmp_path / "shard_1_of_3" / "ckpt_11").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        export.checkpoint_params(tmp_path)
    for name in ("shard_1_of_3", "elsewhere"):
        (tmp_path / name).rename(tmp_path / f"{name}.moved")
    with pytest.raises(ValueError, match="lacks shard 1 of 3"):
        export.checkpoint_params(tmp_path)


def test_export_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    def refused(*argv):
        assert export.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m hpsjax.export: ") and err.count("\n") == 1
        return err

    assert "no checkpoint directory" in refused(tmp_path / "none", tmp_path / "p.npz")
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint" in refused(tmp_path / "empty", tmp_path / "p.npz")
    with CheckpointManager(tmp_path / "other") as manager:
        manager.save(1, {"w": np.zeros(2)}, {"run": "mine"})
    err = refused(tmp_path / "other", tmp_path / "p.npz")
    assert "something other than an hpsjax server" in err
    _save_server_checkpoint(tmp_path / "server", 3, {"w": np.ones(2, np.float32)})
    err = refused(tmp_path / "server", tmp_path / "p.npz", "--step", 4)
    assert "no checkpoint for step 4" in err
    assert "no directory" in refused(tmp_path / "server", tmp_path / "no" / "p.npz")
    assert "is a directory" in refused(tmp_path / "server", tmp_path)
    assert not list(tmp_path.glob("*.npz"))
    assert export.main([str(tmp_path / "server"), str(tmp_path / "p.npz")]) == 0
    assert "wrote 2 parameters of step 3" in capsys.readouterr().out
    # Written as any file of the user's (umask), and nothing left beside it.
    (tmp_path / "reference").write_bytes(b"")
    mode = (tmp_path / "reference").stat().st_mode
    assert (tmp_path / "p.npz").stat().st_mode == mode
    assert not list(tmp_path.glob(".p.npz*"))


def test_export_params_is_refused_at_start_when_it_cannot_be_written(tmp_path, capsys):
    from hpsjax.ps import _cli

    models.save_params_npz(tmp_path / "init.npz", {"w": np.zeros(2, np.float32)})
    base = ["--init", str(tmp_path / "init.npz"), "--loop", "asyncio"]
    assert _cli.main([*base, "--export_params", str(tmp_path / "no" / "p.npz")]) == 2
    assert "no directory" in capsys.readouterr().err
    argv = [*base, "--server_shards", "2", "--server_shard", "0",
            "--export_params", str(tmp_path / "p.npz")]  # fmt: skip
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "python -m hpsjax.export CKPT_DIR OUT.npz" in err and err.count("\n") == 1


def test_load_params_names_the_first_misfit():
    digits = data.get_dataset("synthetic_digits")
    model = models.resolve_model(
        "mlp", input_shape=digits.input_shape, num_classes=digits.num_classes
    ).model
    params = _mlp_params()
    missing = {"layers": {"0": params["layers"]["0"]}}
    with pytest.raises(ValueError, match=r"at /layers: the params lack \['1', "):
        export.load_params(model, missing)
    wrong = jax.tree.map(lambda x: x, params)
    wrong["layers"]["1"]["bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"at /layers/1/bias: the model has float32"):
        export.load_params(model, wrong)
    with pytest.raises(ValueError, match=r"must be an nnx\.Module"):
        export.load_params(params, params)
    # Nothing was changed by the refusals; a fitting tree goes in whole.
    _assert_equal_trees(jax.tree.map(np.asarray, models.split_model(model)[1]), params)
    shifted = jax.tree.map(lambda x: x + 1, params)
    export.load_params(model, shifted)
    _assert_equal_trees(jax.tree.map(np.asarray, models.split_model(model)[1]), shifted)


def test_the_export_command_line_is_made_from_its_options():
    from hpsjax._config_flags import to_argv
    from hpsjax.export import ExportOptions

    argv = to_argv(ExportOptions("ckpt", "out.npz", step=3))
    assert argv == ["ckpt", "out.npz", "--step", "3"]
    # The command refuses a missing argument in one line, exit 2.
    with pytest.raises(SystemExit) as info:
        export.main(["ckpt"])
    assert info.value.code == 2
