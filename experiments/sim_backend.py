"""The ``sim`` backend: one scheme's config on :func:`hpsjax.sim.simulate`.

Simulated workers in virtual time; the output is a
:class:`~experiments.run_output.RunOutput`, as the processes backend's.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

from experiments import build, registry
from experiments.configs.schema import ExperimentConfig
from experiments.run_output import (
    RunOutput,
    _advance,
    _eval_metrics,
    _overlap,
    _progress_bar,
    _replanner,
    _with_startup,
)
from experiments.worker_flags import _push_compression, worker_config
from hpsjax import telemetry

__all__ = ["run_sim"]


def run_sim(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    workdir: pathlib.Path,
    progress: bool = True,
) -> RunOutput:
    """Runs ``config`` in the virtual-clock simulator.

    Schemes with a work plan first run the profiling pass on the simulated
    workers (:func:`experiments.build.simulated_profiles`); its virtual time is
    charged to the scheme: training starts after it, within the same budget.
    The run ends at the budget, or once the server made ``max_updates``
    versions.

    Args:
      config: the experiment config (``backend="sim"``).
      setup: data and model from :func:`experiments.build.setup`.
      workdir: the output directory (unused; the caller writes the outputs).
      progress: show a progress bar of virtual time.

    Returns:
      The :class:`RunOutput`; times are virtual seconds.
    """
    del workdir
    from hpsjax.profiling import tree_wire_nbytes
    from hpsjax.sim import SimConfig, simulate

    specs = build.worker_specs(config)
    push_transform, codec, push_bytes = _push_compression(config, setup.params)
    pull_bytes = tree_wire_nbytes(setup.params)

    plan_scheme = registry.lookup("plan scheme", config.plan.scheme)
    profile_seconds = 0.0
    work_plan = None
    stage_plans: list[Any] = []
    info: dict[str, Any] = {"backend": "sim"}
    if plan_scheme != "none":
        profiles, profile_seconds = build.simulated_profiles(
            config, specs, push_bytes=push_bytes, pull_bytes=pull_bytes
        )
        work_plan, stage_plans = build.plans(config, profiles)
        info["profile_seconds"] = profile_seconds
    specs = _with_startup(config, specs)
    duration = float(config.budget_seconds) - profile_seconds
    if duration <= 0:
        raise ValueError(
            f"the profiling pass takes {profile_seconds:.3g}s of the "
            f"{config.budget_seconds}s budget; raise budget_seconds"
        )

    local_optimizer = build.local_optimizer(config)
    plateau = config.stages.enabled and config.stages.switch == "plateau"
    if plateau:
        local_optimizer = build.hybrid_stages(config)
    policy, policy_kwargs = build.policy(config, stage_plans, until_version=not plateau)
    plan_arg: Any = work_plan
    replans: list[dict[str, Any]] = []
    if work_plan is not None and config.plan.replan:
        plan_arg = _replanner(
            config,
            work_plan,
            lambda now, revised: replans.append(
                {
                    "event": "replan",
                    "time": profile_seconds + now,
                    "revision": revised.revision,
                    "predicted_round_s": revised.round_time,
                }
            ),
        )
    info["overlap"] = _overlap(config, work_plan)
    # The workers' side is the real workers' WorkerConfig (worker 0's: the
    # simulator gives each worker its own key and index itself).
    sim_config = SimConfig(
        policy=policy,
        policy_kwargs=policy_kwargs or None,
        server_optimizer=build.server_optimizer(config),
        local_optimizer=local_optimizer,
        push_transform=push_transform,
        codec=codec,
        worker=worker_config(config, 0, plan=work_plan),
        duration=duration,
        max_updates=config.max_updates,
        eval_every=float(config.eval.every_seconds),
        eval_batch_size=int(config.eval.batch_size),
        core_kwargs=build.core_kwargs(config, work_plan),
        server_service_time=float(config.server.service_time),
        # Streaming DiLoCo's merge step takes no gradient: not billed.
        merge_steps=int(config.worker.local_optimizer == "streaming_local"),
        seed=int(config.seed),
    )

    bar = _progress_bar(progress, float(config.budget_seconds), "virtual s")

    metric = setup.target.metric

    def callback(record: dict) -> None:
        if bar is not None:
            _advance(bar, profile_seconds + record["time"])
            value = setup.summarize(_eval_metrics(record)).get(metric, math.nan)
            bar.set_postfix({metric: f"{value:.3f}", "v": record["version"]})

    try:
        result = simulate(
            setup.loss_fn,
            setup.params,
            setup.train,
            specs,
            sim_config,
            eval_data=setup.test,
            eval_fn=setup.eval_fn,
            work_plan=plan_arg,
            callback=callback,
        )
    finally:
        if bar is not None:
            bar.close()

    metrics = result.metrics
    evals = []
    for j in range(len(metrics["time"])):
        row = {key: column[j] for key, column in metrics.items()}
        evals.append(
            {
                "time": profile_seconds + float(row["time"]),
                "version": int(row["version"]),
                **setup.summarize(_eval_metrics(row)),
                "train_loss": build.finite_or_none(row["train_loss"]),
                "gradients": int(row["gradients"]),
            }
        )
    pushes: dict[Any, int] = {}
    steps: dict[Any, int] = {}
    records = []
    for p in result.pushes:
        pushes[p.worker_id] = pushes.get(p.worker_id, 0) + 1
        steps[p.worker_id] = steps.get(p.worker_id, 0) + p.local_steps
        records.append(
            {
                "event": "push",
                "time": profile_seconds + p.time,
                "sent": profile_seconds + p.sent,
                "worker": p.worker_id,
                "version": p.version,
                "staleness": p.staleness,
                "status": p.status,
                "weight": p.weight,
                "local_steps": p.local_steps,
                "batch_size": p.batch_size,
                "loss": build.finite_or_none(p.loss),
            }
        )
    records.extend(replans)
    workers = {}
    timelines = {}
    other_idle = telemetry.idle_fraction(telemetry.from_simulation(result))
    for w, spans in result.timelines.items():
        t = result.time_in(w)
        total = sum(t.values()) + profile_seconds
        workers[w] = {
            "other_idle_fraction": other_idle.get(str(w)),
            "compute_s": t["compute"],
            "transfer_s": t["transfer"],
            "wait_s": t["wait"],
            "discarded_s": t["discarded"],
            "profile_s": profile_seconds,
            "idle_fraction": 0.0 if total <= 0 else 1.0 - t["compute"] / total,
            "bytes_sent": int(result.bytes_sent[w]),
            "bytes_received": int(result.bytes_received[w]),
            "pushes": pushes.get(w, 0),
            "local_steps": steps.get(w, 0),
        }
        line = [(0.0, profile_seconds, "profile")] if profile_seconds > 0 else []
        line += [
            (profile_seconds + s.start, profile_seconds + s.end, s.kind) for s in spans
        ]
        timelines[w] = line
    info.update(
        wall_seconds=result.wall_seconds,
        end_time=profile_seconds + result.end_time,
        num_updates=result.num_updates,
        num_gradients=result.num_gradients,
        staleness_histogram={str(k): v for k, v in result.staleness.items()},
        drops=result.drops,
        errors=list(result.errors[:20]),
        plans=[build.plan_to_dict(p) for p in result.work_plans],
    )
    if result.diverged is not None:  # the run stopped there (SimConfig)
        d = result.diverged
        info["diverged"] = {
            "worker": d.worker_id,
            "time": profile_seconds + d.time,
            "version": d.version,
            "loss": build.finite_or_none(d.loss),
            "reason": d.reason,
        }
    if stage_plans:
        info["stage_plans"] = [build.plan_to_dict(p) for p in stage_plans]
    if config.stages.enabled:
        info["final_stage"] = int(getattr(policy, "stage", -1))
        info["switched_at"] = getattr(policy, "switched_at", None)
    return RunOutput(evals, workers, timelines, records, info)
