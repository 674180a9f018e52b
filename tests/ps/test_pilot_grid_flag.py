"""hpsjax-server --pilot_grid and --pilot_balance: the pilot's batch sizes
(the workers' --precompile) and its balancing, from the command line."""

from __future__ import annotations

import pytest

from hpsjax.ps import parse_server
from hpsjax.ps._cli import _replanner, main

PILOT = ["--pilot", "hps", "--global_batch", "128", "--expected_workers", "4"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([*PILOT, "--pilot_grid", "8,x"], "--pilot_grid must be batch sizes >= 1"),
        ([*PILOT, "--pilot_grid", "16,8"], "--pilot_grid must be batch sizes >= 1"),
        ([*PILOT, "--pilot_grid", "0,8"], "--pilot_grid must be batch sizes >= 1"),
        ([*PILOT, "--pilot_grid", "8,8"], "--pilot_grid must be batch sizes >= 1"),
        ([*PILOT, "--pilot_grid", ""], "--pilot_grid must be batch sizes >= 1"),
        (["--pilot_grid", "8,16"], "--pilot_grid needs --pilot"),
        ([*PILOT, "--pilot_balance", "-1"], "--pilot_balance must be an int >= 0"),
        (["--pilot_balance", "8"], "--pilot_balance needs --pilot"),
    ],
)
def test_bad_pilot_grid_and_balance_are_one_line_and_start_nothing(
    tmp_path, capsys, flags, message
):
    code = main(["--init", str(tmp_path / "none.npz"), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def _drive(pilot, costs, rounds=400):
    """Every worker's step per round of a barrier, as the plan says; the
    plans the pilot installed."""
    installed, start = [], 0.0
    for _ in range(rounds):
        if pilot.done:
            break
        ends = []
        for w in pilot.plan.workers:
            a, c = costs[w.worker_id]
            ends.append(start + 0.01 + a + c * w.batch_size)
            new = pilot.observe(
                w.worker_id, w.batch_size, a + c * w.batch_size, ends[-1]
            )
            if new is not None:
                installed.append(new)
        start = max(ends)
    return installed


def test_the_pilots_plans_stay_on_the_flags_grid():
    grid = "4,8,12,16,24,32,48,64"
    options = parse_server(
        ["--init", "none.npz", *PILOT, "--pilot_grid", grid, "--pilot_balance", "5"]
    )
    assert options.pilot_sizes() == (4, 8, 12, 16, 24, 32, 48, 64)
    pilot = _replanner(options)
    # proc4's speeds 1:1:2:4 with a fixed cost.
    costs = {0: (0.03, 0.008), 1: (0.03, 0.008), 2: (0.03, 0.004), 3: (0.03, 0.002)}
    installed = _drive(pilot, costs)
    assert pilot.done and len(installed) >= 2
    sizes = {int(b) for b in grid.split(",")}
    assert all(w.batch_size in sizes for p in installed for w in p.workers)
    # Unset: any size, no balancing.
    plain = parse_server(["--init", "none.npz", *PILOT])
    assert plain.pilot_sizes() is None and plain.pilot_balance == 0
