"""The docs stay true to the repository: CI's command, links, tutorials."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "CONTRIBUTING.md",
    "PROTOCOL.md",
    "LAUNCH.md",
    "BENCHMARKS.md",
    "experiments/RESULTS.md",
    "colab/README.md",
]
# [text](target) and ![alt](target); targets without a scheme are files here.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n.*?```sh\n(.*?)```", text, re.S)
    assert block, "README.md has no Quick start shell block"
    return [
        line.strip()
        for line in block.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_quick_start_has_a_main_job_and_a_test_command():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert "experiments.compare" in commands[0]
    assert "-m pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _quick_start_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci], (
        f".ci/run must run README's test command as written: {test_command!r}"
    )


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_point_at_files_that_exist(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{doc} links to missing files: {broken}"


def test_readme_links_every_tutorial():
    readme = (ROOT / "README.md").read_text()
    tutorials = sorted(p.name for p in (ROOT / "colab").glob("*.ipynb"))
    assert tutorials
    missing = [t for t in tutorials if f"(colab/{t})" not in readme]
    assert not missing, f"README.md does not link {missing}"


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _check_optax_block(ns: dict) -> None:
    # The loss falls: the worker's pushes and the server's step agree in sign.
    assert float(ns["loss"](ns["params"])) < 0.1 * float(ns["loss_before"])
    # The 8-bit payload is a quarter of the float32 bytes (plus one scale a leaf).
    fp32 = sum(x.size * 4 for x in ns["jax"].tree.leaves(ns["params"]))
    assert ns["pushed"] == pytest.approx(fp32 / 4, rel=0.01)
    assert ns["staged"] is not None


def _check_server_block(ns: dict) -> None:
    assert ns["version"] == 10
    assert ns["final_loss"] < 0.1 * float(ns["loss"](ns["params"]))


# What each block claims, keyed by a line only that block holds.
_CLAIMS = {
    "hpsjax.quantize(bits=8": _check_optax_block,
    "async with ps.Server(": _check_server_block,
}


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())))
def test_readme_python_block_runs_as_written(index, tmp_path, monkeypatch):
    block = _readme_python_blocks()[index]
    checks = [check for key, check in _CLAIMS.items() if key in block]
    assert len(checks) == 1, f"README block {index} has no claims checked here"
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__readme__"}
    exec(compile(block, f"README.md python block {index}", "exec"), ns)
    checks[0](ns)


def test_readme_server_block_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    (block,) = [b for b in _readme_python_blocks() if "ps.Server(" in b]
    monkeypatch.chdir(tmp_path)
    first: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md server block", "exec"), first)
    second: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md server block", "exec"), second)
    assert (first["version"], second["version"]) == (10, 20)
