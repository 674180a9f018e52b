"""The scheme advisor (experiments.advise) and the frontier table's rules
(experiments.frontier)."""

import dataclasses
import math
import subprocess
import sys

import pytest

from experiments import advise
from hpsjax.config import parse_server
from hpsjax.profiling import Link, WorkerProfile

_LINK = Link(4e6, 0.002)


def _profile(worker_id, speed, *, overhead=0.002, link=_LINK):
    p = WorkerProfile.synthetic(worker_id, speed, overhead=overhead)
    push = link.estimate(9000, 36000) if link is not None else None
    return dataclasses.replace(p, transfer=push)


def _write(tmp_path, profiles):
    for p in profiles:
        (tmp_path / f"profile_{p.worker_id}.json").write_text(p.to_json())
    return str(tmp_path / "profile_*.json")


def test_load_profiles_sorted_by_worker(tmp_path):
    pattern = _write(tmp_path, [_profile(i, 100.0 * (i + 1)) for i in (2, 0, 10, 1)])
    assert [p.worker_id for p in advise.load_profiles(pattern)] == [0, 1, 2, 10]


def test_load_profiles_errors(tmp_path):
    with pytest.raises(ValueError, match="no profile files match"):
        advise.load_profiles(str(tmp_path / "nothing_*.json"))
    (tmp_path / "profile_bad.json").write_text('{"format": "other"}')
    with pytest.raises(
        ValueError, match=r"profile_bad\.json: not a JSON WorkerProfile"
    ):
        advise.load_profiles(str(tmp_path / "profile_*.json"))
    (tmp_path / "profile_bad.json").unlink()
    p = _profile(0, 100.0)
    (tmp_path / "a.json").write_text(p.to_json())
    (tmp_path / "b.json").write_text(p.to_json())
    with pytest.raises(ValueError, match="several profiles of worker 0"):
        advise.load_profiles(str(tmp_path / "*.json"))


def test_link_from_two_message_sizes_is_exact():
    profiles = [_profile(i, 100.0, link=Link(2e6, 0.005)) for i in range(3)]
    latency, bandwidth, note = advise.link_of(profiles)
    assert latency == pytest.approx(0.005)
    assert bandwidth == pytest.approx(2e6)
    assert note == ""


def test_link_of_differing_and_missing_links_is_noted():
    profiles = [
        _profile(0, 100.0, link=Link(1e6, 0.001)),
        _profile(1, 100.0, link=Link(8e6, 0.001)),
        _profile(2, 100.0, link=None),
    ]
    _, bandwidth, note = advise.link_of(profiles)
    assert bandwidth == pytest.approx(4.5e6)  # the median of 1 and 8 MB/s
    assert "differ" in note and "without a link" in note
    assert advise.link_of([_profile(0, 1.0, link=None)])[1] == math.inf


def test_cluster_config_follows_the_profiles():
    # Steps of 32 samples: 0.002 + 32 / speed seconds.
    profiles = [_profile(i, s) for i, s in enumerate((800.0, 200.0, 400.0))]
    config = advise.cluster_config("asp", profiles, setting="quick", budget=3.0)
    assert config.backend == "sim"
    assert config.budget_seconds == 3.0
    fastest = 0.002 + 32 / 800.0
    assert config.workers.step_time == pytest.approx(fastest)
    expected = [1.0, (0.002 + 32 / 200) / fastest, (0.002 + 32 / 400) / fastest]
    assert list(config.workers.slowdowns) == pytest.approx(expected)
    assert config.workers.bandwidth == pytest.approx(4e6)
    assert config.workers.latency == pytest.approx(0.002)
    with pytest.raises(ValueError, match="unknown scheme 'nope'"):
        advise.cluster_config("nope", profiles, setting="quick")
    with pytest.raises(ValueError, match="target"):
        advise.cluster_config("asp", profiles, setting="quick", target=1.5)


def test_a_given_link_replaces_every_profiled_one():
    assert advise.parse_link("50,1") == pytest.approx((0.001, 5e7))
    assert advise.parse_link("0.5") == pytest.approx((0.0, 5e5))
    profiles = [_profile(i, 100.0, link=Link(2e6, 0.005)) for i in range(2)]
    profiles.append(_profile(2, 100.0, link=None))
    latency, bandwidth, note = advise.link_of(profiles, (0.001, 5e7))
    assert (latency, bandwidth) == (0.001, 5e7)
    assert "--link" in note
    config = advise.cluster_config(
        "asp", profiles, setting="quick", link=advise.parse_link("50,1")
    )
    assert config.workers.bandwidth == pytest.approx(5e7)
    assert config.workers.latency == pytest.approx(0.001)
    # Without it, the profiles' own (the median of the two measured).
    config = advise.cluster_config("asp", profiles, setting="quick")
    assert config.workers.bandwidth == pytest.approx(2e6)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fast", "expected MB_PER_S"),
        ("0", "expected MB_PER_S"),
        ("-5", "expected MB_PER_S"),
        ("inf", "expected MB_PER_S"),
        ("50,1,2", "expected MB_PER_S"),
        ("50,-1", "latency must be >= 0"),
        ("50,x", "expected MB_PER_S"),
    ],
)
def test_a_bad_link_is_one_line(text, message):
    with pytest.raises(ValueError, match=message) as err:
        advise.parse_link(text)
    assert "\n" not in str(err.value) and repr(text) in str(err.value)


def test_cli_bad_link_is_one_line_and_runs_nothing(tmp_path):
    pattern = _write(tmp_path, [_profile(0, 100.0)])
    result = _cli(f"--profiles={pattern}", "--link=fast", f"--workdir={tmp_path}/w")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "experiments.advise: error: --link: expected MB_PER_S[,LATENCY_MS] with "
        "MB_PER_S > 0, "
        "got 'fast'"
    ]
    assert not (tmp_path / "w").exists()


def test_launch_command_names_what_it_cannot_carry():
    profiles = [_profile(i, 100.0 * (i + 1)) for i in range(3)]
    config = advise.cluster_config("clipped_asgd", profiles, setting="quick")
    launch, run, not_carried = advise.launch_command(config, profiles)
    assert launch.startswith("hpsjax-launch --workers 3 ")
    assert "--policy asp" in launch
    assert "--slowdown" not in launch and "--worker_id" not in launch
    # The server's flags read back as the config's (0.1 is the default step).
    server_flags = launch.split(" --server ")[1].split(" -- ")[0].split()
    options = parse_server(["--init", "init.npz", *server_flags])
    assert (options.learning_rate, options.momentum) == (0.1, 0.0)
    assert any(s.startswith("server.clip_norm=") for s in not_carried)
    assert "experiments/configs/clipped_asgd.py:quick" in run
    assert "--config.server.learning_rate=0.1" in run
    hps = advise.cluster_config("hps", profiles, setting="quick")
    assert "--config.server.learning_rate=" in advise.launch_command(hps, profiles)[1]
    _, _, none = advise.launch_command(
        advise.cluster_config("asp", profiles, setting="quick"), profiles
    )
    assert none == []


@pytest.mark.slow
def test_advise_ranks_and_prints_the_winner(tmp_path):
    profiles = [_profile(i, s) for i, s in enumerate((1600.0, 800.0, 400.0))]
    rows = advise.advise(
        profiles,
        schemes=["bsp", "asp"],
        factors=(1.0,),
        workdir=tmp_path / "runs",
        setting="quick",
        budget=2.0,
    )
    assert [r["scheme"] for r in rows] in (["bsp", "asp"], ["asp", "bsp"])
    times = [r["time_to_target"] for r in rows]
    # Ranked: a scheme that reached the target comes before one that did not,
    # and sooner before later.
    reached = [t for t in times if t is not None]
    assert reached == sorted(reached) and times[: len(reached)] == reached
    for r in rows:
        assert r["bytes_moved"] > 0 and 0 <= r["idle_fraction"] <= 1
    text = advise.format_advice(rows, profiles)
    assert f"| 1 | {rows[0]['scheme']} |" in text
    assert "hpsjax-launch --workers 3" in text
    # A second call reuses the finished runs.
    again = advise.advise(
        profiles,
        schemes=["bsp", "asp"],
        factors=(1.0,),
        workdir=tmp_path / "runs",
        setting="quick",
        budget=2.0,
    )
    assert [r["time_to_target"] for r in again] == times


def test_advise_rejects_bad_arguments():
    profiles = [_profile(0, 100.0)]
    with pytest.raises(ValueError, match="unknown scheme"):
        advise.advise(profiles, schemes=["bsp", "bogus"], setting="quick")
    with pytest.raises(ValueError, match="factors"):
        advise.advise(profiles, schemes=["bsp"], factors=(0.0,), setting="quick")
    with pytest.raises(ValueError, match="no schemes"):
        advise.advise(profiles, schemes=[], setting="quick")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.advise", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_no_profiles_is_one_line(tmp_path):
    result = _cli(f"--profiles={tmp_path}/none_*.json")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"experiments.advise: error: no profile files match '{tmp_path}/none_*.json'"
    ]


@pytest.mark.slow
def test_cli_bad_profile_and_scheme_are_one_line(tmp_path):
    (tmp_path / "profile_0.json").write_text("{not json")
    result = _cli(f"--profiles={tmp_path}/profile_*.json")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "profile_0.json: not a JSON WorkerProfile" in lines[0]
    _write(tmp_path, [_profile(0, 100.0)])
    result = _cli(f"--profiles={tmp_path}/profile_*.json", "--schemes=bsp,bogus")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown scheme 'bogus'" in lines[0]
