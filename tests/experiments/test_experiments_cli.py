"""The experiments' commands share one command line, and the configs one schema.

Every ``python -m experiments.<command>`` answers ``--help`` with exit 0 and a
bad value with one line naming the flag, exit 2, before anything starts;
``--budget`` is the budget everywhere (``--budget_seconds`` still taken, saying
its new name once). Every scheme's config is a typed
:class:`~experiments.configs.schema.ExperimentConfig`, checked field by field.
"""

from __future__ import annotations

import importlib
import json

import pytest

from experiments import _cli, registry
from experiments.configs import SCHEMES
from experiments.configs.common import SETTINGS
from experiments.configs.schema import ExperimentConfig, UnknownField

COMMANDS = (
    "run", "compare", "calibrate", "advise", "plots", "summary", "chaos", "frontier",
)  # fmt: skip


def _main(command: str, argv: list[str]) -> int:
    module = importlib.import_module(f"experiments.{command}")
    try:
        status = module.main(argv)
    except SystemExit as e:
        return e.code
    return status


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_0_and_names_every_flag_with_help(command, capsys):
    assert _main(command, ["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: experiments.{command}")
    assert "(default: " in text
    if command == "run":  # every config field, from its declaration
        from experiments.configs.schema import field_help

        for name, _, _ in field_help():
            assert f"--config.{name} " in text, name


BAD = [
    ("run", ["--config=experiments/configs/bsp.py:quick", "--config.worker.bits=x"],
     "--config.worker.bits"),
    ("run", ["--config=experiments/configs/bsp.py:quik"], "unknown setting 'quik'"),
    ("run", ["--config=experiments/configs/bsp.py", "--config.servr.policy=x"],
     "--config.servr.policy"),
    ("run", ["--config=experiments/configs/bsp.py", "--confg=1"], "--confg"),
    ("compare", ["--suite=nope"], "--suite"),
    ("compare", ["--suite=quick", "--budget=-1"], "--budget"),
    ("compare", ["--suite=quick", "--budget_seconds=0"], "--budget"),
    ("compare", ["--suite=quick", "--jobs=0"], "--jobs"),
    ("compare", ["--suite=quick", "--seeds=a"], "--seeds"),
    ("compare", ["--suite=quick", "--seeds=1,1"], "--seeds"),
    ("compare", ["--suite=quick", "--formats=gif"], "--formats"),
    ("compare", ["--suite=quick", "--schemes=nope"], "--schemes"),
    ("compare", ["--suite=quick", "--set=plan.nothing=1"], "--set"),
    ("calibrate", ["--setting=nope"], "--setting"),
    ("calibrate", ["--seeds=x"], "--seeds"),
    ("calibrate", ["--budget=0"], "--budget"),
    ("calibrate", ["--bandwidth=-5"], "--bandwidth"),
    ("calibrate", ["--slowdowns=1,x"], "--slowdowns"),
    ("advise", ["--profiles=p.json", "--setting=nope"], "--setting"),
    ("advise", ["--profiles=p.json", "--factors=a"], "--factors"),
    ("advise", ["--profiles=p.json", "--budget=0"], "--budget"),
    ("advise", ["--profiles=p.json", "--jobs=0"], "--jobs"),
    ("advise", ["--profiles=p.json", "--schemes=nope"], "--schemes"),
    ("advise", [], "--profiles"),
    ("plots", ["--results=r.json", "--formats=gif"], "--formats"),
    ("plots", ["--results=r.json", "--max_lines=0"], "--max_lines"),
    ("summary", [], "--workdir"),
    ("chaos", ["--seeds=a"], "--seeds"),
    ("chaos", ["--kills=-1"], "--kills"),
    ("chaos", ["--run_timeout=0"], "--run_timeout"),
    ("chaos", ["--timeout=0"], "--run_timeout"),
    ("frontier", ["--settings=nope"], "--settings"),
    ("frontier", ["--settings=sim8,nope"], "--settings"),
    ("frontier", ["--seeds=a"], "--seeds"),
    ("frontier", ["--seeds=1,1"], "--seeds"),
    ("frontier", ["--seeds=-1"], "--seeds"),
    ("frontier", ["--tune_seed=x"], "--tune_seed"),
    ("frontier", ["--seeds=1,2", "--tune_seed=2"], "--tune_seed"),
    ("frontier", ["--factors=x"], "--factors"),
    ("frontier", ["--factors=0,1"], "--factors"),
    ("frontier", ["--factors=,"], "--factors"),
    ("frontier", ["--tune_budget=0"], "--tune_budget"),
    ("frontier", ["--tune_budget=1.5"], "--tune_budget"),
    ("frontier", ["--schemes=nope"], "--schemes"),
    ("frontier", ["--schemes=sim8=asp+nope"], "--schemes"),
    ("frontier", ["--schemes=nowhere=asp"], "--schemes"),
    ("frontier", ["--jobs=0"], "--jobs"),
    ("frontier", ["--budget=-1"], "--budget"),
    ("frontier", ["--budget_seconds=0"], "--budget"),
    ("frontier", ["--render_onl"], "--render_onl"),
]  # fmt: skip


@pytest.mark.parametrize(
    "command, argv, flag", BAD, ids=[f"{c}:{' '.join(a)}" for c, a, _ in BAD]
)
def test_a_bad_value_is_one_line_naming_the_flag_and_starts_nothing(
    command, argv, flag, tmp_path, capsys
):
    workdir = tmp_path / "work"
    extra = {
        "run": [f"--workdir={workdir}"],
        "compare": [f"--workdir={workdir}"],
        "calibrate": [f"--workdir={workdir}"],
        "advise": [f"--workdir={workdir}"],
        "plots": [f"--out={workdir / 'plot.png'}"],
        "chaos": [f"--workdir={workdir}"],
        "frontier": [f"--workdir={workdir}"],
    }.get(command, [])
    assert _main(command, argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1 and errors[0] == err[-1], err
    assert errors[0].startswith(f"experiments.{command}: error: "), err
    assert flag in errors[0], err
    assert not workdir.exists()


def test_frontier_without_workdir_is_one_line_naming_it(capsys):
    assert _main("frontier", ["--settings=sim8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("experiments.frontier: error: ")
    assert "--workdir" in err[0]


def test_the_frontier_command_lines_of_results_md_still_parse():
    from experiments import frontier

    args = frontier.parser().parse(
        ["--workdir=D", "--settings=sim8_slowlink", "--jobs=2", "--seeds=1,2",
         "--schemes=ormo,asgd_momentum", "--factors=0.25,0.5,1,2",
         "--tune_budget=6", "--budget=30", "--render_only"]
    )  # fmt: skip
    frontier._check_flags(args)
    assert (args.settings, args.seeds, args.factors) == (
        ["sim8_slowlink"],
        [1, 2],
        [0.25, 0.5, 1.0, 2.0],
    )
    assert (args.schemes, args.tune_budget, args.budget, args.jobs) == (
        ["ormo", "asgd_momentum"],
        6,
        30.0,
        2,
    )
    assert args.render_only and args.tune_seed == 0
    per = frontier.parser().parse(
        ["--workdir=D", "--schemes=asp,sim32=adsp+ashl_reference"]
    )
    assert frontier._schemes_by_setting(per.schemes, ["sim8", "sim32"]) == {
        "sim8": ["asp"], "sim32": ["adsp", "ashl_reference"]
    }  # fmt: skip


def test_budget_seconds_is_a_deprecated_alias_of_budget(capsys):
    from experiments import compare

    args = compare.parser().parse(
        ["--suite=quick", "--workdir=w", "--budget_seconds=5", "--budget_seconds=6"]
    )
    assert args.budget == 6.0
    err = capsys.readouterr().err
    assert err.count("--budget_seconds is deprecated; use --budget") == 1
    assert (
        compare.parser().parse(["--suite=quick", "--workdir=w", "--budget=5"]).budget
        == 5.0
    )


def test_the_lm_proc4_command_line_still_parses():
    from experiments import compare

    args = compare.parser().parse(
        ["--suite=lm_proc4", "--workdir=D", "--schemes=hps", "--seeds=3",
         "--formats=png"]
    )  # fmt: skip
    assert (args.schemes, args.seeds, args.formats) == (["hps"], [3], ["png"])
    compare._check_flags(args)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_schemes_config_is_typed_in_every_setting(scheme):
    module = importlib.import_module(f"experiments.configs.{scheme}")
    for setting in SETTINGS:
        config = module.get_config(setting)
        assert isinstance(config, ExperimentConfig)
        assert (config.scheme, config.setting) == (scheme, setting)
        assert isinstance(config.budget_seconds, float)
        assert all(isinstance(s, float) for s in config.workers.slowdowns)


def test_a_field_is_checked_as_it_is_set():
    config = registry.load_config("hps", "quick")
    config.budget_seconds = 3  # an int for a float field
    assert config.budget_seconds == 3.0 and isinstance(config.budget_seconds, float)
    config.workers.slowdowns = [1, 2]
    assert config.workers.slowdowns == (1.0, 2.0)
    with pytest.raises(ValueError, match=r"worker\.bits must be int \| None"):
        config.worker.bits = 8.5
    with pytest.raises(UnknownField, match="did you mean 'learning_rate'"):
        config.server.learning_rat = 0.1
    with pytest.raises(ValueError, match=r"config\.seed is a int, not a group"):
        config.set_path("seed.x", 1)
    config.set_path("server.policy_kwargs.staleness_bound", 2)
    assert config.server.policy_kwargs.staleness_bound == 2


def test_a_frozen_config_refuses_changes_and_a_copy_takes_them():
    config = registry.load_config("bsp", "quick")
    config.freeze()
    with pytest.raises(ValueError, match="frozen"):
        config.server.learning_rate = 0.3
    copy = config.copy()
    copy.server.learning_rate = 0.3
    assert (config.server.learning_rate, copy.server.learning_rate) != (0.3, 0.3)
    assert not copy.frozen and config.frozen


def test_a_config_json_without_newer_fields_matches_at_their_defaults():
    config = registry.load_config("bsp", "quick")
    saved = json.loads(config.to_json())
    assert config.matches(saved)
    del saved["worker"]["demo_topk"]  # a field declared after it was written
    assert config.matches(saved)
    config.worker.demo_topk = 8
    assert not config.matches(saved)
    saved["server"]["learning_rate"] = 99.0
    assert not registry.load_config("bsp", "quick").matches(saved)


def test_config_overrides_set_typed_values():
    import argparse

    args = argparse.Namespace(
        config="experiments/configs/bsp.py:quick",
        config_overrides=[
            "--config.server.learning_rate=0.2",
            "--config.data.path=1e-3",
            "--config.plan.replan",
            "--noconfig.processes.warmup",
        ],
    )
    config = _cli.config_of(args)
    assert config.server.learning_rate == 0.2
    assert config.data.path == "1e-3"  # a string field keeps the text
    assert config.plan.replan is True and config.processes.warmup is False


def test_no_experiments_module_uses_ml_collections():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "experiments"
    users = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if "import ml_collections" in path.read_text(encoding="utf-8")
        or "from ml_collections" in path.read_text(encoding="utf-8")
    ]
    assert users == []


def test_sweep_choose_stats_and_compare_times():
    import doctest

    from experiments import sweep

    assert doctest.testmod(sweep).failed == 0

    def summary(time, best, diverged=None):
        return {"time_to_target": time, "best_accuracy": best, "diverged_at": diverged,
                "bytes_sent": 1e6, "end_time": 10.0, "pushes": 10}  # fmt: skip

    tried = {0.1: summary(None, 0.8), 0.2: summary(5.0, 0.9), 0.4: summary(2.0, 0.9, 1)}
    assert sweep.choose(tried) == 0.2  # the diverged run is not chosen
    stats = sweep.seed_stats([summary(4.0, 0.9), summary(6.0, 0.92)])
    assert (stats["reached"], stats["mean"], stats["std"]) == (2, 5.0, 1.0)
    assert stats["mb_to_target"] == 0.5
    never = sweep.seed_stats([summary(None, 0.5), summary(None, 0.5)])
    assert sweep.compare_times(stats, never) == "faster"
