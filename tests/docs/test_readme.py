"""README.md runs as written, every code block, and stays short to read.

Each fenced block of the README is claimed by one runner below, found by a line
only that block holds (:data:`RUNNERS`); a block no runner claims fails
:func:`test_every_readme_block_is_run_or_checked`. The Python blocks are
executed; the recipe for three hosts runs on this machine as separate processes
on loopback (``HOST_A=127.0.0.1``; ``PORT=0`` for the server, then the port it
picked for the workers); the demo runs with two of its schemes and prints the
README's rows for them; the install block is checked against the project's
address and extras, and the test command is CI's (``tests/docs/test_docs.py``). The
length is the README's words as ``wc -w`` counts them: every whitespace-separated
token of the file, code blocks and tables included.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import tomllib

import numpy as np
import pytest

from hpsjax._project import REPOSITORY_URL

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_WORDS = 1250
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str | None = None) -> list[str]:
    found = BLOCK.findall(README.read_text())
    return [body for kind, body in found if lang is None or kind == lang]


def _block(marker: str) -> str:
    (block,) = [b for b in _blocks() if marker in b]
    return block


def _commands(block: str) -> list[str]:
    """A shell block's commands: continuations joined, comments left out."""
    joined = block.replace("\\\n", " ")
    return [
        line.strip()
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


# Which test runs (or checks) each block, by a line only that block holds.
RUNNERS = {
    "git clone": "test_install_block_names_this_project_and_its_extras",
    "-m pytest": "test_docs.py::test_ci_runs_the_readme_test_command_verbatim",
    "--suite=demo": "test_demo_prints_the_readmes_rows",
    "| scheme | time to": "test_demo_prints_the_readmes_rows",
    "# my_model.py": "test_recipe_trains_on_three_processes_and_exports",
    "np.savez(": "test_recipe_trains_on_three_processes_and_exports",
    "hpsjax-server --init": "test_recipe_trains_on_three_processes_and_exports",
    "load_params(model": "test_recipe_trains_on_three_processes_and_exports",
    "hpsjax.quantize(bits=8": "test_optax_block_runs_as_written",
}


def test_readme_is_short():
    words = len(README.read_text().split())
    assert words <= MAX_WORDS, f"README.md has {words} words (at most {MAX_WORDS})"


def test_every_readme_block_is_run_or_checked():
    for block in _blocks():
        claimed = [key for key in RUNNERS if key in block]
        assert len(claimed) >= 1, f"no test runs this README block:\n{block}"
        assert len({RUNNERS[key] for key in claimed}) == 1, (claimed, block)
    for key in RUNNERS:
        assert sum(key in block for block in _blocks()) == 1, key


def test_install_block_names_this_project_and_its_extras():
    commands = _commands(_block("git clone"))
    assert (
        commands[0]
        == f"git clone {REPOSITORY_URL} && cd {REPOSITORY_URL.split('/')[-1]}"
    )
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = re.findall(r"'\.\[([\w,]+)\]'", README.read_text())
    assert named
    for group in named:
        assert set(group.split(",")) <= set(extras), group


def test_optax_block_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__readme__"}
    block = _block("hpsjax.quantize(bits=8")
    exec(compile(block, "README.md optax block", "exec"), ns)
    # The loss falls: the worker's pushes and the server's step agree in sign.
    assert float(ns["loss"](ns["params"])) < 0.1 * float(ns["loss_before"])
    # The 8-bit payload is a quarter of the float32 bytes (plus one scale a leaf).
    fp32 = sum(x.size * 4 for x in ns["jax"].tree.leaves(ns["params"]))
    assert ns["pushed"] == pytest.approx(fp32 / 4, rel=0.01)


def test_model_factory_block_builds_the_model_it_says(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(_block("# my_model.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_model", raising=False)
    from flax import nnx

    from hpsjax.models import resolve_model

    resolved = resolve_model("my_model:make_model", input_shape=(8, 8))
    logits = resolved.model(np.zeros((3, 8, 8), np.float32))
    assert resolved.input_shape == (8, 8) and logits.shape == (3, 10)
    assert isinstance(resolved.model, nnx.Module)
    sys.modules.pop("my_model", None)


@pytest.mark.slow
def test_demo_prints_the_readmes_rows(tmp_path):
    (command,) = _commands(_block("--suite=demo"))
    schemes = ("bsp", "hps")
    argv = command.replace(".venv/bin/python", sys.executable).split()
    argv = [a.replace("workdirs/demo", str(tmp_path / "demo")) for a in argv]
    # As a user runs it: XLA's optimization passes on (the test session turns
    # them off, tests/conftest.py), which moves H-PS's row.
    xla = os.environ.get("XLA_FLAGS", "").replace(
        "--xla_backend_optimization_level=0", ""
    )
    run = subprocess.run(
        [*argv, f"--schemes={','.join(schemes)}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla.strip()},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    expected = _block("| scheme | time to").splitlines()
    printed = run.stdout.splitlines()
    assert expected[0] in printed  # the header
    for scheme in schemes:
        (row,) = [line for line in expected if line.startswith(f"| {scheme} |")]
        assert row in printed, (row, run.stdout[-2000:])
    assert any(line.startswith("plot: ") for line in printed)


def _wait_for(path: pathlib.Path, text: str, proc, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text()[-2000:]}")


def _start(script: str, log: pathlib.Path, env: dict, cwd: pathlib.Path):
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "-c", script], cwd=cwd, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _run_recipe(tmp_path: pathlib.Path, env: dict) -> str:
    """Runs the recipe's commands in order, the server and the workers as the
    processes they are on their hosts; returns the server's log."""
    setup, *commands = _commands(_block("hpsjax-server --init"))
    assert setup.startswith("export "), setup
    server, workers = None, []
    try:
        for command in commands:
            if command.startswith("hpsjax-server"):
                # Loopback only here; the README's server listens on every address.
                assert "--host 0.0.0.0" in command
                script = f"{setup}\n{command.replace('0.0.0.0', '127.0.0.1')}"
                server = _start(script, tmp_path / "server.log", env, tmp_path)
                _wait_for(tmp_path / "server.log", "listening on", server, 120)
                # PORT=0: the system picked the port; the workers take it.
                log = (tmp_path / "server.log").read_text()
                env["PORT"] = re.search(r"listening on [\d.]+:(\d+)", log).group(1)
            elif "hpsjax-worker" in command and "--worker_id" in command:
                log = tmp_path / f"worker{len(workers)}.log"
                workers.append(_start(f"{setup}\n{command}", log, env, tmp_path))
            else:
                done = subprocess.run(
                    ["bash", "-c", f"{setup}\n{command}"], cwd=tmp_path, env=env,
                    capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                assert done.returncode == 0, (command, done.stderr[-2000:])
        assert server is not None and len(workers) == 3
        for i, worker in enumerate(workers):
            code = worker.wait(timeout=600)
            assert code == 0, (tmp_path / f"worker{i}.log").read_text()[-2000:]
        # "When the workers end, stop the server (Ctrl-C)."
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=120) == 0
        return (tmp_path / "server.log").read_text()
    finally:
        for proc in [server, *workers]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_recipe_trains_on_three_processes_and_exports(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(_block("# my_model.py"))
    monkeypatch.chdir(tmp_path)
    exec(compile(_block("np.savez("), "README.md data block", "exec"), {})
    scripts = pathlib.Path(sys.executable).parent  # hpsjax-server, hpsjax-worker
    env = {
        **os.environ,
        "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}",
        "HOST_A": "127.0.0.1",
        "PORT": "0",
        "PYTHONUNBUFFERED": "1",
    }
    log = _run_recipe(tmp_path, env)
    # The server planned from the run (the pilot) and wrote the parameters.
    assert "after the pilot" in log, log[-3000:]
    assert "params.npz" in log and (tmp_path / "params.npz").is_file()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_model", raising=False)
    ns: dict = {"__name__": "__readme__"}
    exec(compile(_block("load_params(model"), "README.md load block", "exec"), ns)
    sys.modules.pop("my_model", None)
    # "about 0.95": 300 rounds of the three workers train the digits well.
    assert ns["accuracy"] > 0.85, ns["accuracy"]


def _help(command: str) -> str:
    script = pathlib.Path(sys.executable).parent / command
    run = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_scheme_table_names_flags_the_commands_take():
    text = README.read_text()
    table = text[text.index("| your cluster | scheme |") :]
    rows = [line for line in table[: table.index("\n\n")].splitlines()[2:]]
    assert len(rows) >= 3
    given = {"hpsjax-server": set(), "hpsjax-worker": set()}
    for row in rows:
        _, _, _, server, worker, *_ = row.split("|")
        given["hpsjax-server"] |= set(re.findall(r"--\w+", server))
        given["hpsjax-worker"] |= set(re.findall(r"--\w+", worker))
    for command, flags in given.items():
        known = set(re.findall(r"--\w+", _help(command)))
        assert flags and flags <= known, (command, flags - known)
