"""The periodic status line: its text, when it is shown, bar or log."""

import contextlib
import io
import logging
import re

import pytest

from hpsjax._logs import Every, setup_logging
from hpsjax._progress import Progress, format_duration, format_status


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_status_line_says_what_is_known_and_nothing_else():
    assert format_status("worker 2", "step", 7) == "worker 2: step 7"
    assert (
        format_status(
            "worker 2",
            "step",
            40,
            total=100,
            rate=2.0,
            version=85,
            loss=1.23456,
            staleness=0.25,
            seconds_left=30,
        )
        == "worker 2: step 40/100, 2 steps/s, version 85, loss 1.235, "
        "staleness 0.25, 30 s left"
    )
    assert format_status("server", "version", 5, rate=1234.5, notes=("x", "y")) == (
        "server: version 5, 1234 versions/s, x, y"
    )
    assert [format_duration(s) for s in (0, 59.6, 61, 3600, -5)] == [
        "0 s",
        "1 min 0 s",
        "1 min 1 s",
        "1 h 0 min",
        "0 s",
    ]


def test_not_a_terminal_gives_a_log_line_every_interval(caplog):
    caplog.set_level(logging.INFO, logger="hpsjax.progress")
    clock = _Clock()
    progress = Progress(
        "worker 0", "step", total=100, interval=10, stream=io.StringIO(), clock=clock
    )
    assert not progress.bar and progress.period == 10
    shown = []
    for step in range(1, 31):  # a step a second for 30 s
        clock.t += 1.0
        shown.append(progress.update(step, loss=float(step), staleness=1.0))
    lines = [line for line in shown if line is not None]
    assert len(lines) == 3
    assert [r.getMessage() for r in caplog.records] == lines
    # Means of the losses since the last line; 1 step/s, so 90 s left at 10.
    assert lines[0] == (
        "worker 0: step 10/100, 1 steps/s, loss 5.5, staleness 1, 1 min 30 s left"
    )
    assert lines[2].startswith("worker 0: step 30/100, 1 steps/s, loss 25.5,")
    progress.close()


def test_time_left_is_the_nearest_limit():
    clock = _Clock()
    progress = Progress(
        "worker 0",
        total=1000,
        max_seconds=50,
        until_version=60,
        interval=10,
        stream=io.StringIO(),
        clock=clock,
    )
    clock.t += 10
    # 10 steps/s: 99 s to 1000 steps; 40 s to the time limit; versions at
    # 2/s from the first line on: unknown at the first line.
    assert progress.update(100, version=20).endswith("40 s left")
    clock.t += 10
    # Versions 20 -> 40 in 10 s: 10 s to version 60, the nearest.
    assert progress.update(200, version=40).endswith("10 s left")


def test_a_terminal_gets_a_bar_that_ends_at_the_last_count():
    pytest.importorskip("tqdm")
    stream, clock = _Terminal(), _Clock()
    progress = Progress("worker 1", "step", total=50, stream=stream, clock=clock)
    assert progress.bar and progress.period < 1
    clock.t += 1
    postfix = progress.update(10, version=12, loss=0.5)
    assert postfix == "version 12, loss 0.5"
    progress.update(11)  # too soon to redraw
    progress.close()
    progress.close()
    text = stream.getvalue()
    assert "worker 1" in text and "11/50" in text and "loss 0.5" in text


def test_the_choice_can_be_forced_and_bad_arguments_are_refused():
    assert Progress("s", bar=False, stream=_Terminal()).bar is False
    pytest.importorskip("tqdm")
    progress = Progress("s", bar=True, stream=io.StringIO())
    assert progress.bar
    progress.close()
    for kwargs, match in [
        ({"interval": 0}, "interval"),
        ({"total": 0}, "total"),
        ({"max_seconds": -1}, "max_seconds"),
        ({"until_version": 1.5}, "until_version"),
    ]:
        with pytest.raises(ValueError, match=match):
            Progress("s", stream=io.StringIO(), **kwargs)


def test_every_lets_one_line_through_per_period_and_counts_the_others():
    clock = _Clock()
    every = Every(60, clock=clock)
    assert every.ready() == (True, 0)
    for _ in range(5):
        clock.t += 10
        assert every.ready() == (False, 0)
    clock.t += 10
    assert every.ready() == (True, 5)


def test_logging_setup_quiets_the_libraries_unless_debug():
    try:
        setup_logging("warning")
        assert logging.getLogger().level == logging.WARNING
        for name in ("absl", "orbax", "jax", "tensorstore"):
            assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING
        setup_logging("DEBUG")
        assert logging.getLogger("absl").getEffectiveLevel() == logging.DEBUG
        with pytest.raises(ValueError, match="unknown log level 'loud'"):
            setup_logging("loud")
    finally:
        logging.getLogger().setLevel(logging.WARNING)
        for name in ("absl", "orbax", "jax", "tensorstore", "etils"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_a_worker_and_its_server_show_their_progress_in_their_logs(tmp_path):
    """Real processes, stderr a file (not a terminal): status lines."""
    import subprocess
    import sys

    from hpsjax.cli import worker as worker_cli

    small = ["--dataset_arg", "num_examples=64", "--model_arg", "hidden=[16]"]
    init = tmp_path / "init.npz"
    worker_cli.write_init(worker_cli.parse_args(small), init)
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
             "--policy", "asp", "--status_interval", "0.3", "--loop", "asyncio"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
    try:
        port = server.stdout.readline().rsplit(":", 1)[1].strip()
        worker = subprocess.run(
            [sys.executable, "-m", "hpsjax.cli.worker", *small, "--port", port,
             "--batch_size", "8", "--max_steps", "60", "--status_interval", "0.3",
             "--slowdown", "2"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        server.terminate()
        server.communicate(timeout=60)
    assert worker.returncode == 0, worker.stderr
    lines = re.findall(r"INFO hpsjax\.worker: (worker 0: step .*)", worker.stderr)
    assert lines, worker.stderr
    assert all(
        re.fullmatch(
            r"worker 0: step \d+/60, [\d.]+ steps/s, version \d+, loss [\d.e+-]+"
            r"(, staleness [\d.e+-]+)?, (\d+ min )?\d+ s left",
            line,
        )
        for line in lines
    ), lines
    server_lines = re.findall(
        r"INFO hpsjax\.net\._server: (server: version .*)",
        (tmp_path / "server.log").read_text(),
    )
    assert any("loss" in line and "1 live worker" in line for line in server_lines), (
        server_lines
    )


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "openpty"), reason="no pty")
def test_a_server_on_a_terminal_draws_a_bar_with_its_log_above(tmp_path):
    import asyncio
    import fcntl
    import os
    import struct
    import subprocess
    import sys
    import termios
    import time

    import numpy as np

    from hpsjax.models import save_params_npz
    from hpsjax.net._client import Client

    init = tmp_path / "init.npz"
    save_params_npz(init, {"w": np.zeros((4, 4), np.float32)})
    master, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    server = subprocess.Popen(
        [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
         "--policy", "asp", "--loop", "asyncio"],
        stdout=subprocess.PIPE, stderr=terminal, text=True,
    )  # fmt: skip
    os.close(terminal)
    try:
        port = int(server.stdout.readline().rsplit(":", 1)[1])

        async def main():
            async with Client("127.0.0.1", port, worker_id=0, secret=None) as c:
                _, version = await c.pull()
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    _, _, version = await c.push_pull(
                        {"w": np.zeros((4, 4), np.float32)}, version=version, loss=1.5
                    )

        asyncio.run(main())
    finally:
        server.terminate()
        server.communicate(timeout=60)
    screen = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(master, 1 << 16):
            screen += chunk
    os.close(master)
    text = screen.decode()
    # Redrawn in place (carriage returns), the log written above it; the rate
    # reads "1.77s/ versions" when versions come slower than one a second (a
    # loaded machine).
    assert re.search(
        r"\rserver: \d+ versions \[[\d:]+,\s+(?:[\d.]+ versions/s|[\d.]+s/ versions), "
        r"loss 1.5, staleness 0",
        text,
    ), text
    assert re.search(r"INFO hpsjax\.net\._server: worker 0 left: done", text), text
