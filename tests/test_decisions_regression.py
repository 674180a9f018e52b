"""The worker's and the server's decisions, pinned: every scheme's ``quick``
setting, simulated with a fixed seed, gives the versions, acknowledgements and
update counts recorded in ``tests/data/decisions_quick.json``.

A change that moves a rule from one place to another must leave these numbers
exactly as they are. A change meant to alter a decision re-records them with::

    python tests/test_decisions_regression.py
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

import pytest

from experiments import backends, build, registry

FIXTURE = pathlib.Path(__file__).resolve().parent / "data" / "decisions_quick.json"
SEED = 1


def decisions(scheme: str) -> dict:
    """Per worker: the version of each push in order, the acknowledgements by
    status and the local steps pushed; and the server's final version."""
    config = registry.load_config(scheme, "quick")
    config.backend = "sim"
    config.seed = SEED
    output = backends.run_sim(
        config, build.setup(config), workdir=pathlib.Path("."), progress=False
    )
    workers: dict[str, dict] = {}
    for record in output.records:
        if record.get("event") != "push":
            continue
        entry = workers.setdefault(
            str(record["worker"]),
            {"versions": [], "acks": collections.Counter(), "local_steps": 0},
        )
        entry["versions"].append(record["version"])
        entry["acks"][record["status"]] += 1
        entry["local_steps"] += record["local_steps"]
    for entry in workers.values():
        entry["updates"] = len(entry["versions"])
        entry["acks"] = dict(sorted(entry["acks"].items()))
    return {
        "workers": dict(sorted(workers.items())),
        "final_version": output.info["num_updates"],
        "drops": output.info["drops"],
    }


def _recorded() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", registry.SCHEMES)
def test_decisions_unchanged(scheme):
    expected = _recorded()[scheme]
    got = json.loads(json.dumps(decisions(scheme)))
    assert got["final_version"] == expected["final_version"]
    assert got == expected


def test_fixture_covers_every_scheme():
    assert sorted(_recorded()) == sorted(registry.SCHEMES)
    for scheme, entry in _recorded().items():
        assert entry["final_version"] > 0, scheme
        assert all(w["updates"] > 0 for w in entry["workers"].values()), scheme


if __name__ == "__main__":
    names = sys.argv[1:] or registry.SCHEMES
    table = _recorded() if FIXTURE.exists() else {}
    for name in names:
        table[name] = decisions(name)
        print(name, table[name]["final_version"], flush=True)
    lines = (
        f"{json.dumps(k)}: {json.dumps(table[k], sort_keys=True)}"
        for k in sorted(table)
    )
    FIXTURE.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
