"""The ``hpsjax-export`` console script: declared, its help, and one-line refusals."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import pytest

from hpsjax import export

REPO = pathlib.Path(__file__).resolve().parents[3]


def _script(tmp_path: pathlib.Path) -> pathlib.Path:
    """``hpsjax-export`` as pip writes a console script: a file of that name
    that imports the entry point pyproject.toml declares and exits with it."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["hpsjax-export"].partition(":")
    path = tmp_path / "hpsjax-export"
    path.write_text(
        f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n"
    )
    return path


def _run(script: pathlib.Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=script.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_hpsjax_export_is_a_console_script_with_help_and_one_line_errors(
    tmp_path, monkeypatch, capsys
):
    script = _script(tmp_path)
    shown = _run(script, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: hpsjax-export ")
    assert "checkpoint_dir" in shown.stdout and "--step" in shown.stdout
    refused = _run(script, str(tmp_path / "nothing"), "p.npz")
    assert refused.returncode == 2
    assert refused.stderr == (
        f"hpsjax-export: no checkpoint directory at {tmp_path / 'nothing'}\n"
    )
    # The same entry point in this process, under the script's name.
    monkeypatch.setattr(sys, "argv", [str(script)])
    for argv, message in [
        ((), "the following arguments are required: checkpoint_dir, out"),
        (("--step", "x", "ckpt", "p.npz"), "--step: invalid int value: 'x'"),
    ]:
        with pytest.raises(SystemExit) as e:
            export.main(list(argv))
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        assert err.startswith("hpsjax-export: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not (tmp_path / "p.npz").exists()
