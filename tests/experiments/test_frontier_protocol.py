"""The frontier table under the verdict protocol: equal tuning budgets, grids
extended off their edges, the bootstrap interval of the ratio of times, bytes
both ways."""

import doctest

import pytest

from experiments import frontier, protocol, registry


def test_module_doctests():
    assert doctest.testmod(frontier).failed == 0


def _summary(t, *, sent=1000, received=3000, end=60.0, pushes=10, acc=0.9):
    return {
        "time_to_target": t,
        "end_time": end,
        "bytes_sent": sent,
        "bytes_received": received,
        "pushes": pushes,
        "best_accuracy": acc,
        "diverged_at": None,
    }


def _stats(times, budget=60.0, **kwargs):
    return frontier.scheme_stats([_summary(t, **kwargs) for t in times], budget)


CLAIM = {c.method: c for c in reversed(frontier.CLAIMS)}  # each's first claim


def test_a_claim_is_read_from_the_interval_of_the_ratio_of_times():
    fast, slow = _stats([10, 10.5, 11, 10.2, 10.8]), _stats([20, 20.5, 21, 19, 22])
    word, (ratio, low, high) = frontier.verdict(CLAIM["ringmaster"], fast, slow)
    assert word == "reproduced" and low <= ratio <= high < 1
    assert frontier.verdict(CLAIM["ringmaster"], slow, fast)[0] == "refuted"
    # Overlapping spreads: the interval holds 1.
    a, b = _stats([10, 30, 20, 15, 25]), _stats([20, 10, 30, 25, 15])
    assert frontier.verdict(CLAIM["ringmaster"], a, b)[0] == "level"


def test_times_one_evaluation_apart_are_level():
    # Every seed 0.5 s apart, evaluated every 0.5 s: the interval is tight
    # and below 1, but the evaluations cannot resolve the gap.
    method = frontier.scheme_stats([_summary(t) for t in [18.0] * 5], 60, 0.5)
    base = frontier.scheme_stats([_summary(t) for t in [18.5] * 5], 60, 0.5)
    word, (_, _, high) = frontier.verdict(CLAIM["ringmaster"], method, base)
    assert high < 1 and word == "level"
    finer = frontier.scheme_stats([_summary(t) for t in [18.5] * 5], 60, 0.25)
    finer_method = {**method, "eval_every": 0.25}
    assert frontier.verdict(CLAIM["ringmaster"], finer_method, finer)[0] == (
        "reproduced"
    )


def test_one_seed_gives_no_verdict():
    word, (ratio, _, _) = frontier.verdict(
        CLAIM["ringmaster"], _stats([10]), _stats([20, 21, 19])
    )
    assert word == "too few seeds" and ratio == pytest.approx(0.5)


def test_a_run_that_misses_the_target_counts_as_its_budget():
    # The method never reaches the target in a 60 s budget: 60 s is a lower
    # bound on its time, and the baseline's 20 s is surely faster.
    never, base = _stats([None] * 5), _stats([20, 21, 19, 20, 22])
    assert never["censored"] == [60.0] * 5 and never["reached"] == 0
    assert frontier.verdict(CLAIM["ringmaster"], never, base)[0] == "refuted"
    both_never = frontier.verdict(CLAIM["ringmaster"], never, _stats([None] * 5))
    assert both_never == ("undecided", (1.0, 1.0, 1.0))


def test_a_reading_the_budget_could_reverse_is_undecided():
    claim = CLAIM["ringmaster"]
    fast, slow = [10, 11, 10.5, 10.2, 10.8], [20, 21, 19, 20, 22]
    # Runs of both cut at the budget: the counted ratio bounds nothing.
    some_cut = _stats([None, None, 30, None, None], budget=40.0)
    other_cut = _stats([39, None, None, None, None], budget=40.0)
    assert frontier.verdict(claim, some_cut, other_cut)[0] == "undecided"
    # A method with a cut run reads faster: its true time may be longer.
    method_cut = _stats([10, 11, None, 10, 11], budget=60.0)
    base = _stats([50, 52, 51, 49, 50])
    reading = frontier._reading(claim, method_cut, base)[0]
    assert reading == "reproduced"
    assert frontier.verdict(claim, method_cut, base)[0] == "undecided"
    # A baseline with a cut run reads faster than the method: undecided; the
    # same baseline against a faster method proves the method faster.
    base_cut = _stats([10, 11, None, 10, 11], budget=60.0)
    assert frontier._reading(claim, base, base_cut)[0] == "refuted"
    assert frontier.verdict(claim, base, base_cut)[0] == "undecided"
    faster = frontier.verdict(claim, _stats(fast), _stats([20, 21, None, 20, 22]))
    assert faster[0] == "reproduced"
    # Every run reached: the reading stands.
    assert frontier.verdict(claim, _stats(slow), _stats(fast))[0] == "refuted"


def test_a_scheme_that_never_reaches_the_target_shows_its_best_target_metric():
    # An accuracy target shows the best accuracy; a loss target the best loss,
    # not the accuracy the language model's summary also carries.
    assert "best accuracy 0.850" in frontier._time_text(_stats([None] * 2, acc=0.85))
    lm = [
        dict(_summary(None, acc=0.2), target_metric="loss", best_metric=b)
        for b in (3.0, 3.2)
    ]
    text = frontier._time_text(frontier.scheme_stats(lm, 45.0))
    assert text == "not reached (0/2; best loss 3.100)"
    # A diverged run has no finite best: left out of the mean, and shown as
    # "-" when no run has one.
    nan = dict(lm[0], best_metric=float("nan"))
    assert frontier.scheme_stats([*lm, nan], 45.0)["best_metric"] == 3.1
    text = frontier._time_text(frontier.scheme_stats([nan, nan], 45.0))
    assert text == "not reached (0/2; best loss -)"


def test_faster_by_needs_the_whole_interval_below_the_cut():
    claim = CLAIM["ashl_reference"]  # 35% less time than ADSP
    base = _stats([20, 20.2, 19.8, 20.1, 19.9])
    assert frontier.verdict(claim, _stats([10, 10.2, 9.8, 10, 10.1]), base)[0] == (
        "reproduced"
    )
    assert frontier.verdict(claim, _stats([15, 15.2, 14.8, 15, 15.1]), base)[0] == (
        "refuted"
    )
    # 30-40% less: the interval straddles 0.65.
    spread = _stats([12, 14, 13, 11.5, 14.5])
    assert frontier.verdict(claim, spread, base)[0] == "level"


def test_bytes_are_counted_both_ways_to_the_target():
    # MuLoCo pushes 8x fewer bytes than DiLoCo but pulls as much: both ways it
    # moves far less than 8x fewer, so the claim is refuted.
    times = [20, 20.5, 19.5, 20.2, 19.8]
    method = _stats(times, sent=1000, received=8000)
    base = _stats(times, sent=8000, received=8000)
    assert method["mb_to_target"] == pytest.approx(9000 * 20 / 60 / 1e6, rel=0.03)
    assert frontier.verdict(CLAIM["muloco"], method, base)[0] == "refuted"
    lean = _stats(times, sent=1000, received=1000)
    assert frontier.verdict(CLAIM["muloco"], lean, base)[0] == "reproduced"
    # 8x fewer bytes but slower is not the claim.
    slow = _stats([40, 41, 39, 40, 40.5], sent=500, received=500)
    assert frontier.verdict(CLAIM["muloco"], slow, base)[0] == "refuted"


def test_start_grids_scale_the_configs_value_and_resolve_r():
    config = registry.load_config("ringmaster", "sim8")
    assert frontier.start_grid(config, "server.learning_rate", (0.5, 1, 2)) == (
        pytest.approx([0.05, 0.1, 0.2])
    )
    r = "server.policy_kwargs.delay_threshold"
    assert frontier.start_grid(config, r, (0.5, 1, 2)) == [4, 8, 16]
    config = registry.load_config("clipped_asgd", "sim8")
    assert frontier.start_grid(config, "server.clip_norm", (1,)) == [1.0]


def test_every_knob_of_every_scheme_has_a_grid():
    for scheme, knobs in frontier.KNOBS.items():
        config = registry.load_config(scheme, "sim8")
        for path in knobs:
            assert len(frontier.start_grid(config, path, (0.5, 1, 2))) == 3, path


def test_bad_arguments_are_one_line_errors(tmp_path):
    cases = [
        ({"seeds": (0,)}, "tuning seed"),
        ({"settings": ("nowhere",)}, "unknown setting"),
        ({"tune_budget": 0}, "tune_budget"),
        ({"factors": (0.0,)}, "factors"),
        ({"seeds": (1, 1)}, "distinct"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            frontier.run_frontier(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--tune_budget=0", "--tune_budget must be an int >= 1"),
        ("--seeds=a", "argument --seeds: expected comma-separated ints"),
        ("--factors=x", "argument --factors: expected comma-separated numbers"),
    ],
)
def test_the_cli_refuses_bad_flags_in_one_line(tmp_path, flag, message):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "experiments.frontier", f"--workdir={tmp_path}", flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith("experiments.frontier: error: ")
    assert not any(tmp_path.iterdir())


def test_the_cli_answers_help_with_exit_0():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "experiments.frontier", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: experiments.frontier")
    for flag in ("--workdir", "--settings", "--seeds", "--tune_seed", "--factors",
                 "--tune_budget", "--schemes", "--jobs", "--budget", "--render_only",
                 "--out"):  # fmt: skip
        assert flag in out.stdout, flag


@pytest.mark.slow
def test_frontier_tunes_with_equal_budgets_and_judges_a_claim(tmp_path):
    claim = CLAIM["ringmaster"]
    kwargs = dict(
        settings=("quick",),
        seeds=(1, 2),
        tune_budget=3,
        claims=[claim],
        budget_seconds=2.0,
        log=lambda _: None,
    )
    result = frontier.run_frontier(tmp_path, **kwargs)
    tuning = result["tuning"]["quick"]
    # The same cap for both; Ringmaster's search moves R as well as its step.
    assert 1 <= len(tuning["asp"]["trials"]) <= 3
    assert len(tuning["ringmaster"]["trials"]) == 3
    knobs = {k for t in tuning["ringmaster"]["trials"] for k in t["point"]}
    assert knobs == set(frontier.KNOBS["ringmaster"])
    cell = result["claims"][0]["settings"]["quick"]
    word = cell["verdict"]
    assert word in ("reproduced", "refuted", "level", "undecided")
    # The cell's verdict is the rule's, read again from its figures; at a
    # 2 s budget some runs may be cut, and only then can it be undecided.
    assert frontier.verdict(claim, cell["method"], cell["baseline"])[0] == word
    if word == "undecided":
        cut = [cell[k]["reached"] < cell[k]["runs"] for k in ("method", "baseline")]
        assert any(cut)
    ratio, low, high = cell["interval"]
    assert low <= ratio <= high
    assert cell["method"]["runs"] == 2 and len(cell["method"]["censored"]) == 2
    text = frontier.format_frontier(result)
    assert "| ringmaster vs asp | quick |" in text and "95% CI" in text
    # Rendering again from the finished runs gives the same table.
    again = frontier.run_frontier(tmp_path, render_only=True, **kwargs)
    assert frontier.format_frontier(again) == text
    assert protocol.SEEDS == (1, 2, 3, 4, 5)


def test_every_seed_paper_has_a_claim_with_tunable_knobs():
    # H-PS, ASHL, PS+, SaPS and ADSP are judged under the same protocol as
    # the newer methods: each a claim against its paper's baseline.
    methods = {c.method: c for c in frontier.CLAIMS}
    for scheme in ("hps", "ashl_reference", "ps_plus", "saps", "adsp"):
        assert scheme in methods, scheme
        assert scheme in frontier.KNOBS, scheme
    baselines = {(c.method, c.baseline) for c in frontier.CLAIMS}
    assert {("saps", "bsp"), ("saps", "asp"), ("adsp", "bsp")} <= baselines
    # 1.4x less time: the whole interval of the ratio below 1 / 1.4 = 0.714.
    claim, base = methods["hps"], _stats([20, 20.2, 19.8, 20.1, 19.9])
    at_1_5x = _stats([13.3, 13.4, 13.2, 13.3, 13.35])
    at_1_2x = _stats([16.7, 16.8, 16.6, 16.7, 16.65])
    assert frontier.verdict(claim, at_1_5x, base)[0] == "reproduced"
    assert frontier.verdict(claim, at_1_2x, base)[0] == "refuted"
