"""The server alone weights batches: no path through a plan changes the step.

Equal gradients under any plan give the step of one big batch, whether the plan
comes from the launcher, a plan file read by the worker command line, or the
experiments' builders (simulated and real processes). The simulator's side is in
``test_sim.py``, the plan's and the server's in ``test_plan.py``.
"""

import io
import json
import math

import pytest

from hpsjax import launch
from hpsjax.cli import worker as worker_cli
from hpsjax.profiling import LR_SCALINGS, WorkerProfile, WorkPlan, plan
from hpsjax.worker._runtime import WorkerConfig

SMALL = ["--dataset_arg", "num_examples=64"]


def _planned_scales(work_plan: WorkPlan) -> list[float]:
    """What each worker of a plan read from a file multiplies its updates by."""
    read = WorkPlan.from_json(work_plan.to_json())
    return [
        WorkerConfig(work_plan=read, worker_id=w.worker_id).planned()[3]
        for w in read.workers
    ]


@pytest.mark.parametrize("lr_scaling", LR_SCALINGS)
def test_experiment_plans_scale_every_worker_alike(lr_scaling):
    from experiments import build
    from experiments.configs import hps

    config = hps.get_config("quick")
    config.plan.lr_scaling = lr_scaling
    specs = build.worker_specs(config)
    profiles, _ = build.simulated_profiles(
        config, specs, push_bytes=1000, pull_bytes=1000
    )
    first, _ = build.plans(config, profiles)
    assert len({w.batch_size for w in first.workers}) > 1
    n = len(first.workers)
    expected = {"none": 1.0, "linear": float(n), "sqrt": math.sqrt(n)}[lr_scaling]
    # The simulated backend takes the plan's scales; the processes backend
    # writes the plan to a file that each worker reads.
    assert [w.lr_scale for w in first.workers] == pytest.approx([expected] * n)
    assert _planned_scales(first) == pytest.approx([expected] * n)


@pytest.mark.slow
def test_launcher_plan_leaves_the_step_alone(tmp_path):
    work = tmp_path / "run"
    result = launch.launch(
        2,
        policy="bsp",
        steps=2,
        worker_args=[*SMALL, "--batch_size", "16"],
        per_worker_args={0: ["--slowdown", "1"], 1: ["--slowdown", "3.34"]},
        plan="hps",
        workdir=work,
        progress=False,
        log=io.StringIO(),
        timeout=240,
    )
    assert result.returncode == 0, result.reason
    work_plan = WorkPlan.from_json((work / "plan.json").read_text())
    # The plan is H-PS's plan of the profiles measured (which worker they find
    # faster depends on the load as much as on the slowdown when a step takes
    # a fraction of a millisecond), and it leaves the step size alone.
    profiles = [
        WorkerProfile.from_json((work / f"profile_{i}.json").read_text())
        for i in range(2)
    ]
    replanned = plan(profiles, "hps", global_batch=work_plan.global_batch)
    assert [w.batch_size for w in work_plan.workers] == [
        w.batch_size for w in replanned.workers
    ]
    assert _planned_scales(work_plan) == [1.0, 1.0]


def test_worker_refuses_a_plan_file_that_weights_batches_twice(tmp_path, capsys):
    profiles = [WorkerProfile.synthetic(i, s) for i, s in enumerate((197, 59))]
    data = json.loads(plan(profiles, global_batch=256).to_json())
    for w in data["workers"]:
        w["lr_scale"] = w["batch_size"] / 128
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    argv = [*SMALL, "--port", "1", "--worker_id", "0", "--work_plan", str(path)]
    assert worker_cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("hpsjax-worker: the workers' lr_scale differ")
