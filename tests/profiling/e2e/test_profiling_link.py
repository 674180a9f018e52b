"""``hpsjax-worker --profile_out`` counts the link: timed against the server
its ``--port`` names, or the one ``--profile_link`` gives; bad values are one
line and write nothing.

Loopback only: a real server on its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading

import optax
import pytest
from _models import SMALL_MODEL

from hpsjax import ps
from hpsjax.cli import worker as worker_cli
from hpsjax.profiling import Link, WorkerProfile
from hpsjax.profiling._worker_profile import parse_profile_link
from hpsjax.ps import _cli as server_cli

FLAGS = [*SMALL_MODEL, "--profile_batch_sizes", "4,8", "--profile_repeats", "2"]


class _ServerThread:
    """An ASP :class:`hpsjax.ps.Server` of ``params`` on a loop in a thread."""

    def __init__(self, params):
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._params = params
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self):
        self._stop = asyncio.Event()
        async with ps.Server(self._params, optax.sgd(0.1), "asp", secret=None) as s:
            self.server = s
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(60)
        return self.server

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        self._loop.close()


def _params(tmp_path):
    path = tmp_path / "init.npz"
    assert worker_cli.main([*SMALL_MODEL, "--write_init", str(path)]) == 0
    return server_cli.load_npz_tree(path)


@pytest.mark.parametrize(
    "text, bandwidth, latency",
    [("1e9", 1e9, 0.0), ("1.25e9,0.0001", 1.25e9, 1e-4), (" 5e6 , 0 ", 5e6, 0.0)],
)
def test_profile_link_values(text, bandwidth, latency):
    assert parse_profile_link(text) == Link(bandwidth=bandwidth, latency=latency)
    assert parse_profile_link(None) is None


@pytest.mark.parametrize(
    "text", ["", "0", "-1e6", "fast", "1e9,-0.1", "1e9,x", "1,2,3", "nan", "inf,0"]
)
def test_a_bad_profile_link_is_one_line(text):
    with pytest.raises(ValueError, match="--profile_link must be") as e:
        parse_profile_link(text)
    assert "\n" not in str(e.value)


def test_profile_out_counts_the_link_it_is_given(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = [*FLAGS, "--profile_out", str(out), "--profile_link", "1e6,0.01"]
    assert worker_cli.main(argv) == 0
    p = WorkerProfile.from_json(out.read_text())
    t = p.transfer
    assert t.method == "estimated" and t.server_seconds is None
    assert t.push_bytes == t.pull_bytes == p.param_bytes
    assert t.round_trip_seconds == pytest.approx(2 * 0.01 + 2 * p.param_bytes / 1e6)
    said = capsys.readouterr().out
    assert "push+pull (estimated)" in said and f"wrote the profile to {out}" in said

    # An injected link is added to the given one.
    both = tmp_path / "both.json"
    argv = [*FLAGS, "--profile_out", str(both), "--profile_link", "1e6,0.01"]
    assert worker_cli.main([*argv, "--latency", "0.005"]) == 0
    t2 = WorkerProfile.from_json(both.read_text()).transfer
    assert t2.round_trip_seconds == pytest.approx(t.round_trip_seconds + 0.01)


def test_profile_out_without_a_server_or_link_says_it_counts_none(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert worker_cli.main([*FLAGS, "--profile_out", str(out)]) == 0
    assert WorkerProfile.from_json(out.read_text()).transfer is None
    assert "no link counted" in capsys.readouterr().out


def test_profile_out_times_the_push_and_pull_against_the_server(tmp_path, capsys):
    out = tmp_path / "p.json"
    with _ServerThread(_params(tmp_path)) as server:
        argv = [*FLAGS, "--profile_out", str(out), "--port", str(server.port)]
        assert worker_cli.main([*argv, "--latency", "0.02"]) == 0
        version = server.version
    p = WorkerProfile.from_json(out.read_text())
    t = p.transfer
    assert t.method == "measured"
    assert t.push_bytes == t.pull_bytes == p.param_bytes
    # Each message has the injected 20 ms on top of its timed loopback time.
    assert t.push_seconds > 0.02 and t.pull_seconds > 0.02
    # (The round trip is the median of whole trips, not the sum of medians.)
    assert t.round_trip_seconds > 0.04
    assert t.server_seconds is not None and 0 <= t.server_seconds < t.push_seconds
    # The pushes were real: one untimed and three timed, zeros each.
    assert version == 4
    said = capsys.readouterr().out
    assert "push+pull (timed;" in said and "the server's" in said


def test_profile_out_with_no_server_answering_is_one_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    with _ServerThread(_params(tmp_path)) as server:
        port = server.port
    argv = [*FLAGS, "--profile_out", str(out), "--port", str(port)]
    assert worker_cli.main([*argv, "--connect_timeout", "0.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no server answered" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile_link", "fast"], "--profile_link must be"),
        (["--profile_link", "1e9", "--port", "1"], "--profile_link is for a profile"),
    ],
)
def test_a_bad_profile_flag_is_one_line_and_writes_nothing(
    tmp_path, capsys, extra, message
):
    out = tmp_path / "p.json"
    assert worker_cli.main([*FLAGS, "--profile_out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not out.exists()
