"""The docs stay true to the repository: CI's command, links, tutorials."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


def _readme_test_command() -> str:
    """The README's command that runs the tests (its one line with ``-m pytest``)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    lines = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if "-m pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(lines) == 1, f"README.md must give one test command: {lines}"
    return lines[0]


def test_readme_test_command_runs_every_test():
    assert _readme_test_command().endswith("-m pytest -m 'slow or not slow'")


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _readme_test_command()
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


def test_results_lists_every_scheme_with_a_config():
    from experiments.configs import SCHEMES

    text = (ROOT / "experiments" / "RESULTS.md").read_text()
    table = text[text.index("**Every scheme with a config**") :]
    table = table[table.index("| scheme |") :]
    table = table[: table.index("\n\n")]
    listed = re.findall(r"\| `(\w+)\.py` \|$", table, re.M)
    assert sorted(listed) == sorted(SCHEMES)


def test_the_verdicts_at_a_glance_are_those_of_the_frontier_files():
    # Each column of RESULTS.md's glance table against its setting's
    # results/frontier_*.json (a later file's claims over an earlier's: sim32's
    # DiLoCo family from its longer budget): the verdict and the ratio of
    # mean times.
    from experiments.frontier import CLAIMS

    files = {
        "sim8": ["frontier_sim8"],
        "sim8_slowlink": ["frontier_sim8_slowlink"],
        "sim32": ["frontier_sim32_protocol", "frontier_sim32_long"],
        "lm_sim8": ["frontier_lm_sim8"],
        "lm_sim32": ["frontier_lm_sim32"],
    }
    text = (ROOT / "experiments" / "RESULTS.md").read_text()
    header = "| claim | " + " | ".join(files) + " |"
    rows = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert len(rows) == len(CLAIMS)
    pairs = [(c.method, c.baseline) for c in CLAIMS]
    for col, (setting, names) in enumerate(files.items(), start=1):
        judged = {}
        for name in names:
            path = ROOT / "experiments" / "results" / f"{name}.json"
            claims = json.loads(path.read_text())["claims"]
            assert [(c["method"], c["baseline"]) for c in claims] == pairs, name
            for pair, claim in zip(pairs, claims, strict=True):
                if setting in claim["settings"]:
                    judged[pair] = claim["settings"][setting]
        for row, pair in zip(rows, pairs, strict=True):
            cell = row.strip("|").split("|")[col].strip()
            j = judged.get(pair)
            expected = f"{j['verdict']} {j['interval'][0]:.2f}" if j else "-"
            assert cell == expected, (setting, pair)
