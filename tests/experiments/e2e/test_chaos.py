"""The chaos run (``experiments.chaos``): SIGKILLed workers and server,
restarted by the local launcher, finish the run (no hang, no orphan) as the
undisturbed run does."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from experiments import chaos
from hpsjax._compile_cache import cache_dir_for


def test_the_kill_schedule_is_seeded_and_spread_over_the_run():
    def schedule_of(seed):
        return chaos.kill_schedule(seed, kills=6, until_version=300, server_kills=2)

    schedule = schedule_of(3)
    assert schedule == schedule_of(3) and schedule != schedule_of(4)
    assert [k.target for k in schedule].count("server") == 2
    versions = [k.version for k in schedule]
    assert versions == sorted(versions) and 30 <= min(versions) <= max(versions) <= 240
    assert all(k.target == "server" or 0 <= k.target < 4 for k in schedule)
    assert chaos.kill_schedule(0, kills=0, until_version=300, server_kills=0) == []
    with pytest.raises(ValueError, match="server_kills"):
        chaos.kill_schedule(0, kills=1, until_version=300, server_kills=2)


def test_final_accuracy_is_the_newest_evaluated_version(tmp_path):
    assert chaos.final_accuracy(tmp_path) == (None, None)
    records = {
        0: [{"event": "round", "version": 9}, {"event": "eval", "version": 7,
            "accuracy": 0.5}],
        1: [{"event": "eval", "version": 12, "accuracy": 0.75}],
    }  # fmt: skip
    for i, lines in records.items():
        text = "\n".join(map(json.dumps, lines)) + "\n"
        (tmp_path / f"metrics_{i}.jsonl").write_text(text + '{"event": "ro')
    assert chaos.final_accuracy(tmp_path) == (0.75, 12)
    assert chaos._curve(tmp_path) == ((7, 0.5), (12, 0.75))


def _children() -> set[int]:
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.add(int(entry.name))
    return found


@pytest.mark.slow
def test_a_run_with_killed_workers_and_server_ends_like_an_undisturbed_one(
    tmp_path, session_compile_cache
):
    # Both runs' work directories hold the session's compilation cache as
    # their own: the chaos run's processes load what the calm run compiled.
    for name in ("calm", "chaos"):
        (tmp_path / name).mkdir()
        cache_dir_for(tmp_path / name).symlink_to(session_compile_cache)
    calm = chaos.run(tmp_path / "calm", 0, until_version=150, timeout=150)
    stormy = chaos.run(
        tmp_path / "chaos", 0, until_version=150, kills=3, server_kills=1,
        timeout=200,
    )  # fmt: skip
    assert calm.reason == "completed" and calm.kills == ()
    assert stormy.reason == "completed", stormy
    # Every planned kill happened: the server once, workers twice. The server
    # came back, and so did each killed worker; a worker that only lost the
    # server reconnects to the restarted one instead of being restarted.
    assert [t for _, t in stormy.kills].count("server") == 1, stormy
    assert len(stormy.kills) == 3, stormy
    assert stormy.server_restarts == 1
    assert sum(stormy.worker_restarts) >= 2, stormy
    # Both trained to the same version, well above chance (0.1). How close
    # their accuracies are is measured, not asserted, in the Chaos section of
    # experiments/RESULTS.md: there, runs of 2000 versions (where accuracy has
    # levelled off) end within seed noise of the undisturbed ones; at this
    # size accuracy is still climbing and BSP rounds run with fewer workers
    # while killed ones restart, which moves it more than seed noise.
    assert calm.version >= 150 and stormy.version >= 150
    assert calm.accuracy > 0.3 and stormy.accuracy > 0.3, (calm, stormy)
    assert not _children()
