"""The pilot's balancing after its fit's plan: each worker's fit scaled to the
steps it takes at its planned batch, the plan made again where it shortens
the round (hpsjax.profiling.Pilot(balance_rounds=...))."""

from __future__ import annotations

import math
import random

import pytest

from hpsjax.planning import batch_grid
from hpsjax.profiling import Pilot

# proc4's speeds 1:1:2:4 with a fixed cost: (fixed seconds, seconds per sample).
TRUE = {"a": (0.03, 0.008), "b": (0.03, 0.008), "c": (0.03, 0.004),
        "d": (0.03, 0.002)}  # fmt: skip
# During the pilot's phases the two slow workers step 1.6 times slower than
# they do at the planned batches (the first rounds' contention): the fit's plan
# gives them too few samples, and they wait at the barrier.
SLOWER = {**TRUE, "a": (0.048, 0.0128), "b": (0.048, 0.0128)}
# Or 0.6 times as long: the fit's plan gives them too many, the others wait.
FASTER = {**TRUE, "a": (0.018, 0.0048), "b": (0.018, 0.0048)}
LINK = 0.01


def _drive(pilot, phases=SLOWER, *, rounds=300, noise=0.0, seed=0):
    """Feeds the pilot every worker's step per round of a barrier (each push
    at the round's start plus its link and step), at ``phases``'s costs until
    the fit's plan and TRUE's after. Returns the plans installed and the
    reason each came with."""
    rng = random.Random(seed)
    installed, start, fitted = [], 0.0, False
    for _ in range(rounds):
        if pilot.done:
            break
        costs = TRUE if fitted else phases
        pushes = []
        for w in pilot.plan.workers:
            a, c = costs[w.worker_id]
            t = (a + c * w.batch_size) * math.exp(rng.gauss(0.0, noise))
            pushes.append((start + LINK + t, w.worker_id, w.batch_size, t))
        for now, worker, batch, t in sorted(pushes):
            new = pilot.observe(worker, batch, t, now)
            if new is not None:
                installed.append((new, pilot.reason))
                fitted = fitted or pilot.reason.startswith("the pilot's fit")
        start = max(p[0] for p in pushes)
    return installed


def _true_round(plan):
    return max(
        TRUE[w.worker_id][0] + TRUE[w.worker_id][1] * w.batch_size + LINK
        for w in plan.workers
    )


@pytest.mark.parametrize(
    ("phases", "fitted_batches"),
    [(SLOWER, [10, 10, 32, 64]), (FASTER, [23, 23, 27, 45])],
)
def test_balancing_follows_the_steps_at_the_planned_batches(phases, fitted_batches):
    grid = batch_grid(128)
    plain = Pilot(list(TRUE), global_batch=128, batch_sizes=grid)
    fitted = _drive(plain, phases)[-1][0]
    assert plain.done
    pilot = Pilot(list(TRUE), global_batch=128, batch_sizes=grid, balance_rounds=5)
    installed = _drive(pilot, phases)
    assert pilot.done
    reasons = [r for _, r in installed]
    assert any(r.startswith("the pilot's fit") for r in reasons)
    balances = [p for p, r in installed if r.startswith("the pilot's balance")]
    assert 1 <= len(balances) <= 4
    # The fit's plan, from the phases' steps, is off; balanced on the steps
    # at the planned batches, every worker's step takes 158 ms: at least 10%
    # more samples a second (SLOWER: the slow workers take more in a round no
    # longer; FASTER: the round is 25% shorter).
    final = pilot.plan
    assert [w.batch_size for w in fitted.workers] == fitted_batches
    assert [w.batch_size for w in final.workers] == [16, 16, 32, 64]
    rate = final.global_batch / _true_round(final)
    assert rate >= 1.1 * fitted.global_batch / _true_round(fitted)
    assert _true_round(final) <= _true_round(fitted) * (1 + 1e-9)
    assert all(w.batch_size in grid for w in final.workers)
    # Its predicted round is the round the workers take at its batches.
    assert final.round_time == pytest.approx(_true_round(final), rel=0.15)


def test_balancing_moves_nothing_on_a_plan_already_balanced():
    # Phases as fast as the rounds after: the fit's plan is right, and a
    # check that gains under 5% ends the pilot without another plan.
    pilot = Pilot(list(TRUE), global_batch=128, balance_rounds=5)
    installed, start = [], 0.0
    for _ in range(300):
        if pilot.done:
            break
        ends = []
        for w in pilot.plan.workers:
            a, c = TRUE[w.worker_id]
            t = a + c * w.batch_size
            ends.append(start + LINK + t)
            new = pilot.observe(w.worker_id, w.batch_size, t, ends[-1])
            if new is not None:
                installed.append(pilot.reason)
        start = max(ends)
    assert pilot.done
    assert not any(r.startswith("the pilot's balance") for r in installed)


def test_balancing_under_noise_ends_within_its_checks():
    pilot = Pilot(
        list(TRUE), global_batch=128, batch_sizes=batch_grid(128),
        balance_rounds=8, max_balances=3,
    )  # fmt: skip
    installed = _drive(pilot, noise=0.15, seed=3)
    assert pilot.done
    balances = [r for _, r in installed if r.startswith("the pilot's balance")]
    assert len(balances) <= 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance_rounds": -1}, "balance_rounds"),
        ({"balance_rounds": 2.5}, "balance_rounds"),
        ({"max_balances": 0}, "max_balances"),
    ],
)
def test_bad_balance_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        Pilot(["a", "b"], global_batch=64, **kwargs)
    assert "\n" not in str(info.value)


def test_balancing_does_not_chase_the_noise_of_busy_cores():
    # The phases as fast as the rounds after (the fit's plan is right) and
    # every step spread 40% (proc4's at load 15-20): no check moves a batch,
    # the medians of six rounds are too noisy to tell.
    for seed in range(3):
        pilot = Pilot(
            list(TRUE), global_batch=128, batch_sizes=batch_grid(128),
            balance_rounds=6, max_rounds=20,
        )  # fmt: skip
        installed = _drive(pilot, TRUE, noise=0.4, seed=seed, rounds=500)
        assert pilot.done
        assert not any(r.startswith("the pilot's balance") for _, r in installed)
