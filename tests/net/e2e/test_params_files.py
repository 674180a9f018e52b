"""Parameter files: the format marker, and --init refusing anything else."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hpsjax import _npz, models
from hpsjax.ps import _cli


def test_save_params_npz_writes_the_marker_and_readers_leave_it_out(tmp_path):
    path = tmp_path / "init.npz"
    models.save_params_npz(path, {"dense": {"w": np.ones((2, 3))}, "b": np.zeros(3)})
    with np.load(path) as archive:
        assert int(archive[_npz.PARAMS_MARKER]) == _npz.PARAMS_FORMAT
    _npz.check_params_file(path)
    for tree in (models.load_params_npz(path), _cli.load_npz_tree(path)):
        assert sorted(tree) == ["b", "dense"]
        assert tree["dense"]["w"].dtype == np.float32
    part, _ = _cli.load_npz_shard(path, 0, 2)
    assert _npz.PARAMS_MARKER not in part


def test_init_refuses_a_data_file_in_one_line_naming_its_arrays(tmp_path, capsys):
    digits = tmp_path / "digits.npz"
    np.savez(digits, x=np.zeros((10, 64), np.float32), y=np.zeros(10, np.int64))
    assert _cli.main(["--init", str(digits), "--loop", "asyncio"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hpsjax-server: {digits} holds arrays x, y, not hpsjax parameters (no "
        "format marker): write it with hpsjax.models.save_params_npz or "
        "hpsjax-worker --write_init\n"
    )


def test_init_names_a_few_arrays_of_a_big_file(tmp_path):
    path = tmp_path / "many.npz"
    np.savez(path, **{f"a{i:02d}": np.zeros(1) for i in range(12)})
    with pytest.raises(ValueError, match=r"a00, .*, a07 and 4 more, not hpsjax"):
        _npz.check_params_file(path)


def test_init_refuses_other_format_versions_and_non_archives(tmp_path):
    future = tmp_path / "future.npz"
    np.savez(future, w=np.zeros(2), **{_npz.PARAMS_MARKER: np.asarray(7)})
    with pytest.raises(ValueError, match="of format 7; this hpsjax reads format 1"):
        _cli.load_npz_tree(future)
    text = tmp_path / "notes.txt"
    text.write_text("not arrays")
    with pytest.raises(ValueError, match=r"is not an \.npz file"):
        _cli.load_npz_tree(text)
    with pytest.raises(FileNotFoundError, match=r"no \.npz file"):
        _cli.load_npz_tree(tmp_path / "missing.npz")


def test_the_refusal_is_one_line_from_the_installed_command(tmp_path):
    digits = tmp_path / "digits.npz"
    np.savez(digits, x=np.zeros((4, 8)), y=np.zeros(4))
    done = subprocess.run(
        [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(digits)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "holds arrays x, y, not hpsjax parameters" in done.stderr
