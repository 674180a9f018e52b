"""The verdict protocol's tuning order: a budget smaller than a grid runs the
config's value first."""

from experiments.protocol import tune


def _recorder(times):
    """A tuning run that records the points it is asked for and reaches the
    target at ``times[lr]`` (``None``: never)."""
    asked = []

    def run(point):
        asked.append(point["lr"])
        return {"time_to_target": times.get(point["lr"]), "best_metric": 0.5}

    return run, asked


def test_a_budget_of_one_runs_the_configs_value_not_the_grids_lowest():
    run, asked = _recorder({0.5: 30.0, 1.0: 20.0, 2.0: 25.0})
    chosen, trials = tune(run, {"lr": [0.5, 1.0, 2.0]}, budget=1)
    assert asked == [1.0] and chosen == {"lr": 1.0} and len(trials) == 1


def test_the_current_value_runs_first_then_the_grid_in_order():
    run, asked = _recorder({0.5: 30.0, 1.0: 20.0, 2.0: 25.0})
    chosen, _ = tune(run, {"lr": [0.5, 1.0, 2.0]}, budget=10)
    assert asked == [1.0, 0.5, 2.0] and chosen == {"lr": 1.0}


def test_a_second_knob_starts_from_the_first_knobs_best():
    def run(point):
        t = 10 + abs(point["lr"] - 2.0) + abs(point["outer"] - 0.7)
        return {"time_to_target": t, "best_metric": -t}

    chosen, trials = tune(
        run, {"lr": [0.5, 1.0, 2.0], "outer": [0.35, 0.7, 1.4]}, budget=3
    )
    # The budget is spent on the first knob's grid, starting at its middle.
    assert [p for p, _ in trials] == [
        {"lr": 1.0, "outer": 0.7},
        {"lr": 0.5, "outer": 0.7},
        {"lr": 2.0, "outer": 0.7},
    ]
    assert chosen == {"lr": 2.0, "outer": 0.7}


def test_a_tuned_outer_step_of_eager_updates_moves_the_workers_copy_too():
    from experiments import frontier, registry

    point = {"server.learning_rate": 0.35, "worker.local_learning_rate": 0.01}
    config = frontier.point_config("streaming_diloco_eager", "sim8", 3, point, 20.0)
    assert config.worker.local_optimizer_args.outer_learning_rate == 0.35
    assert config.seed == 3 and config.model.seed == 3 and config.budget_seconds == 20.0
    registry.check_config(config)  # refused when the two steps differ
    # Schemes without ties set the knob alone.
    plain = frontier.point_config("streaming_diloco", "sim8", 1, point)
    assert plain.server.learning_rate == 0.35
    assert "outer_learning_rate" not in plain.worker.local_optimizer_args


def test_the_tuning_table_names_each_knobs_grid_and_marks_an_edge():
    from experiments import frontier

    trial = {"time": 20.0, "best_accuracy": 0.9, "diverged": False}
    result = {
        "settings": ["sim8"],
        "claims": [],
        "tuning": {
            "sim8": {
                "diloco": {
                    "chosen": {
                        "worker.local_learning_rate": 0.04,
                        "server.learning_rate": 0.7,
                    },
                    "trials": [
                        {
                            **trial,
                            "point": {
                                "worker.local_learning_rate": lr,
                                "server.learning_rate": 0.7,
                            },
                        }
                        for lr in (0.02, 0.01, 0.04)
                    ],
                }
            }
        },
    }
    assert frontier.searched_grids(result["tuning"]["sim8"]["diloco"]) == {
        "server.learning_rate": [0.7],
        "worker.local_learning_rate": [0.01, 0.02, 0.04],
    }
    text = frontier.format_frontier(result)
    assert (
        "| learning_rate: 0.7; local_learning_rate: 0.01, 0.02, 0.04 (edge) |" in text
    )
