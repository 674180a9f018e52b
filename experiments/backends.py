"""Backends: run one scheme's config and report what happened, in one shape.

* ``sim``: :func:`hpsjax.sim.simulate` on simulated workers (virtual time);
* ``processes``: a real :class:`hpsjax.ps.Server` in this process and one
  ``hpsjax-worker`` process per worker on loopback, started and watched by
  :mod:`hpsjax.launch` (wall time).

Both return a :class:`RunOutput`: evaluations over time, per-worker totals,
per-worker timelines (compute, transfer, wait, discarded), and raw records.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from experiments import build, registry
from experiments.configs.schema import ExperimentConfig
from hpsjax import telemetry
from hpsjax._config_flags import argv_of
from hpsjax.config import RunConfig, WorkerSettings
from hpsjax.launch import DIVERGED
from hpsjax.worker import WorkerConfig, WorkerOptions
from hpsjax.worker._command import WorkerCommand

__all__ = ["BACKENDS", "RunOutput", "run_config", "run_processes", "run_sim"]

TIMELINE_KINDS = ("profile", "compile", "compute", "transfer", "wait", "discarded")
"""Kinds of time in a worker's timeline (everything but compute is idle)."""


class RunOutput(NamedTuple):
    """What a backend reports.

    Attributes:
      evals: one dict per evaluation, in time order: ``time`` (seconds since
        the start, profiling included), ``version``, the task's metrics on
        the test set (``loss``, and ``accuracy``, ``perplexity``, ... as the
        task reports them), and where known ``train_loss`` and ``gradients``.
      workers: per worker id, totals: ``compute_s``, ``transfer_s``,
        ``wait_s``, ``discarded_s``, ``idle_fraction``, ``bytes_sent``,
        ``bytes_received``, ``pushes``, ``local_steps``.
      timelines: per worker id, ``(start, end, kind)`` spans in time order,
        ``kind`` one of :data:`TIMELINE_KINDS`.
      records: raw per-push (sim) or per-round (processes) records.
      info: anything else worth keeping (plans, wall seconds, errors, ...).
    """

    evals: list[dict[str, Any]]
    workers: dict[Any, dict[str, Any]]
    timelines: dict[Any, list[tuple[float, float, str]]]
    records: list[dict[str, Any]]
    info: dict[str, Any]


def _evaluate(setup: build.Setup, params: Any, batch_size: int) -> dict[str, float]:
    """The task's metrics of ``params`` on the test set, averaged over examples
    and summarized (:meth:`experiments.build.Setup.summarize`)."""
    totals: dict[str, float] = {}
    count = 0
    for batch in setup.test.eval_batches(batch_size):
        values = jax.device_get(setup.eval_fn(params, batch))
        n = len(batch.y)
        for key, value in values.items():
            totals[key] = totals.get(key, 0.0) + float(value) * n
        count += n
    return setup.summarize({key: value / count for key, value in totals.items()})


def _push_compression(config: ExperimentConfig, params: Any) -> tuple[Any, Any, int]:
    """How the workers compress pushes: ``(transform, codec, push_bytes)``.

    The transform (with ``worker.error_feedback``) is quantization for
    ``worker.bits``, with its codec, or PowerSGD for
    ``worker.compression='power_sgd'`` (its factors on the wire, no codec);
    ``None`` for float32 pushes or top-k, which the worker core applies;
    SparseLoCo's push (``worker.compression='sparseloco'``), DeMo's
    (``'demo'``) or Streaming DiLoCo's (``'streaming'``: the fragments' mean
    bytes a push), which real workers get as ``--push_transform``.
    ``push_bytes`` is one push's payload, what the profiling pass's link
    estimate uses: ``powersgd_nbytes`` per leaf for PowerSGD.
    """
    layout = str(jax.tree.map(lambda x: f"{np.shape(x)} {np.dtype(x.dtype)}", params))
    return build.reused(
        "push compression",
        (config.worker, int(config.seed), layout),
        lambda: _make_push_compression(config, params),
    )


def _make_push_compression(
    config: ExperimentConfig, params: Any
) -> tuple[Any, Any, int]:
    from hpsjax.profiling import tree_wire_nbytes
    from hpsjax.transforms import Codec, power_sgd, quantize

    worker = config.worker
    error_feedback = bool(worker.error_feedback)
    if worker.compression == "sparseloco":
        from hpsjax.transforms import sparseloco, sparseloco_nbytes

        ratio, bits = float(worker.compress_ratio), int(worker.sparseloco_bits)
        decay = float(worker.sparseloco_decay)
        transform = sparseloco(ratio, bits=bits, decay=decay)
        return transform, None, sparseloco_nbytes(params, ratio, bits)
    if worker.compression == "streaming":
        from hpsjax.transforms import last_streaming_nbytes, streaming_push

        transform = streaming_push(
            int(worker.streaming_fragments),
            _streaming_bits(worker),
            error_feedback=error_feedback,
            seed=int(config.seed),
            layout=str(worker.streaming_layout),
        )
        return transform, None, last_streaming_nbytes(transform.init(params))
    if worker.compression == "demo":
        from hpsjax.transforms import demo, demo_nbytes

        topk, chunk = int(worker.demo_topk), int(worker.demo_chunk)
        transform = demo(float(worker.demo_decay), topk, chunk)
        return transform, None, demo_nbytes(params, topk, chunk)
    if worker.compression == "power_sgd":
        rank = int(worker.powersgd_rank)
        transform = power_sgd(
            rank, error_feedback=error_feedback, seed=int(config.seed)
        )
        return transform, None, tree_wire_nbytes(params, powersgd_rank=rank)
    bits = worker.bits
    if bits is None:
        return None, None, tree_wire_nbytes(params)
    scheme = "sign" if bits == 1 else "uniform"
    codec = Codec(scheme, bits)
    transform = quantize(
        bits, scheme=scheme, error_feedback=error_feedback, seed=int(config.seed)
    )
    return transform, codec, tree_wire_nbytes(params, codec)


# ---------------------------------------------------------------------------
# The simulator.
# ---------------------------------------------------------------------------


def _replanner(
    config: ExperimentConfig,
    work_plan: Any,
    on_revision: Callable[[float, Any], None],
) -> Any:
    """The run's :class:`~hpsjax.profiling.Replanner` (``config.plan.replan_*``),
    or with ``work_plan=None`` its :class:`~hpsjax.profiling.Pilot`
    (``config.plan.pilot``), telling ``on_revision(now, plan)`` of every
    revision it makes."""
    from hpsjax.profiling import Pilot, Replanner

    base = Replanner if work_plan is not None else Pilot

    # A pilot without plan.replan plans once, from its fit, and keeps it.
    keep = work_plan is None and not config.plan.replan

    class Recorded(base):
        def observe(self, worker_id, batch_size, step_time, now):
            if keep and self.done:
                return None
            revised = super().observe(worker_id, batch_size, step_time, now)
            if revised is not None:
                on_revision(now, revised)
            return revised

    settings = {
        "threshold": float(config.plan.replan_threshold),
        "window": int(config.plan.replan_window),
        "cooldown": float(config.plan.replan_cooldown),
    }
    if work_plan is not None:
        return Recorded(work_plan, **settings)
    n = len(config.workers.slowdowns)
    # The pilot's plans scale the step size as build.work_plan's plan does.
    options = {
        "lr_scaling": registry.lookup("lr scaling", config.plan.lr_scaling),
        "local_steps": int(config.plan.local_steps),
        "max_local_steps": int(config.plan.max_local_steps),
    }
    return Recorded(
        range(n),
        int(config.batch_size) * n,
        str(config.plan.scheme),
        tolerance=float(config.plan.pilot_tolerance),
        max_rounds=int(config.plan.pilot_rounds),
        batch_sizes=_pilot_grid(config),
        plan_options=options,
        **settings,
    )


def _pilot_grid(config: ExperimentConfig) -> tuple[int, ...] | None:
    """The batch sizes a pilot plans on and its workers compile before
    joining (``plan.pilot_grid`` a doubling, up to the global batch), or
    ``None`` without a pilot or a grid."""
    from hpsjax.planning import batch_grid

    per_doubling = int(config.plan.pilot_grid)
    if not config.plan.pilot or per_doubling <= 0:
        return None
    return batch_grid(
        int(config.batch_size) * len(config.workers.slowdowns), per_doubling
    )


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
    # The workers' side as the processes backend gives it (_worker_settings).
    sim_config = SimConfig(
        policy=policy,
        policy_kwargs=policy_kwargs or None,
        server_optimizer=build.server_optimizer(config),
        local_optimizer=local_optimizer,
        push_transform=push_transform,
        codec=codec,
        worker=WorkerOptions(
            **{"compress_from_stage": None, **_worker_side(config, work_plan)}
        ),
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
            bar.update(round(profile_seconds + record["time"] - bar.n, 6))
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


# What the simulator records beside the evaluation's metrics.
_SIM_COLUMNS = ("time", "version", "gradients", "train_loss")


def _eval_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The task's metrics of a simulator's evaluation record (its columns
    ``time``, ``version``, ``gradients`` and ``train_loss`` left out)."""
    return {k: float(v) for k, v in record.items() if k not in _SIM_COLUMNS}


def _overlap(config: ExperimentConfig, work_plan: Any) -> str:
    """The workers' overlap: ``worker.overlap``, or where
    ``plan.overlap_link_share`` is set and there is a plan, the plan's choice
    (:func:`hpsjax.profiling.choose_overlap`)."""
    from hpsjax.profiling import choose_overlap

    share = config.plan.overlap_link_share
    if share is None or work_plan is None:
        return registry.lookup("overlap", config.worker.overlap)
    return choose_overlap(work_plan, float(share))


def _with_startup(config: ExperimentConfig, specs: list[Any]) -> list[Any]:
    """``specs`` with ``config.workers.startup_times`` as their start-up times
    (after the profiling pass, which measures warm workers)."""
    times = tuple(config.workers.startup_times or ())
    if not times:
        return specs
    if len(times) != len(specs):
        raise ValueError(
            f"workers.startup_times has {len(times)} entries for {len(specs)} "
            "workers; give one per worker or ()"
        )
    return [
        dataclasses.replace(spec, startup_time=float(t))
        for spec, t in zip(specs, times, strict=True)
    ]


def _worker_side(config: ExperimentConfig, work_plan: Any) -> dict[str, Any]:
    """The :class:`~hpsjax.worker.WorkerOptions` fields that ``config`` sets on
    every worker, simulated or real: the overlap, eager pulls, PS+'s staleness
    step rule and, with a plan to give the ratios, top-k from a stage on."""
    worker = config.worker
    side: dict[str, Any] = {"overlap": _overlap(config, work_plan)}
    if worker.staleness_lr is not None:
        registry.lookup("staleness policy", worker.staleness_lr)
        side["staleness_lr"] = worker.staleness_lr
    if side["overlap"] == "eager":
        side["eager_pulls"] = int(worker.eager_pulls)
    if work_plan is not None:
        value = config.stages.compress_from_stage
        side["compress_from_stage"] = None if value is None else int(value)
    return side


def _progress_bar(enabled: bool, total: float, unit: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} {unit} [{elapsed}{postfix}]",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------
# Real processes.
# ---------------------------------------------------------------------------


def run_config(
    config: ExperimentConfig, *, plan_file: pathlib.Path | None = None
) -> RunConfig:
    """The experiment's real processes as a :class:`hpsjax.config.RunConfig`:
    one worker per ``workers.slowdowns`` entry, worker ``i`` with id and data
    shard ``i`` (the server runs in this process: no server settings).

    The one place an experiment's config becomes the workers' settings; the
    workers' command lines are written from it.
    """
    n = len(config.workers.slowdowns)
    workers = []
    for index in range(n):
        command, settings = _worker_settings(config, index, plan_file=plan_file)
        workers.append(
            WorkerSettings(
                WorkerCommand(**command, shard_index=index, shard_count=n),
                WorkerConfig(**settings, worker_id=index),
            )
        )
    return RunConfig(workers=tuple(workers))


def _worker_flags(
    config: ExperimentConfig, index: int, *, plan_file: pathlib.Path | None
) -> list[str]:
    """The ``hpsjax-worker`` flags of worker ``index`` (without server flags)."""
    return run_config(config, plan_file=plan_file).worker_argv(index)


def _worker_settings(
    config: ExperimentConfig, index: int, *, plan_file: pathlib.Path | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Worker ``index``'s :class:`WorkerCommand` and :class:`WorkerConfig`
    fields set by ``config`` (its identity and server address left out)."""
    from experiments.build import dataset_kwargs, model_kwargs, slowdown_schedule
    from hpsjax.profiling import WorkPlan

    worker = config.worker
    command: dict[str, Any] = dict(
        task=str(config.task),
        model=config.model.name,
        model_seed=int(config.model.seed),
        dataset=config.data.name,
        test_fraction=float(config.data.test_fraction),
        model_arg={k: _plain(v) for k, v in model_kwargs(config).items()},
        dataset_arg={k: _plain(v) for k, v in dataset_kwargs(config).items()},
    )
    settings: dict[str, Any] = dict(
        batch_size=int(config.batch_size),
        local_steps=int(worker.local_steps),
        seed=int(config.seed) * 1000 + index,
        push_transform=_push_transform_spec(config, index),
    )
    if worker.local_optimizer != "none":
        command.update(
            local_optimizer=_local_optimizer(worker),
            local_learning_rate=float(worker.local_learning_rate),
            local_optimizer_arg=dict(worker.local_optimizer_args or {}),
        )
    power_sgd = worker.compression == "power_sgd"
    if worker.bits is not None:
        settings["bits"] = int(worker.bits)
    if power_sgd:
        settings["powersgd_rank"] = int(worker.powersgd_rank)
    if worker.bits is not None or power_sgd:
        settings["error_feedback"] = bool(worker.error_feedback)
    plan = None if plan_file is None else WorkPlan.from_json(plan_file.read_text())
    settings.update(_worker_side(config, plan))
    if (grid := _pilot_grid(config)) is not None:
        settings["precompile"] = ",".join(str(b) for b in grid)
    if plan_file is not None:
        command["work_plan"] = str(plan_file)
    schedule = slowdown_schedule(config, index)
    command["slowdown"] = ",".join(f"{t:g}:{k:g}" for t, k in schedule)
    if config.workers.bandwidth is not None:
        command["bandwidth"] = repr(float(config.workers.bandwidth))
    command["latency"] = float(config.workers.latency)
    return command, settings


def _local_optimizer(worker: ExperimentConfig) -> str:
    """``hpsjax-worker --local_optimizer``'s name for ``worker``'s."""
    registry.lookup("optimizer", worker.local_optimizer)
    if worker.local_optimizer != "sgd" or float(worker.local_momentum) <= 0:
        return worker.local_optimizer
    if float(worker.local_momentum) != 0.9:
        raise ValueError(
            "the processes backend runs local momentum 0.9 only "
            f"(hpsjax-worker --local_optimizer momentum), got "
            f"{worker.local_momentum}"
        )
    return "momentum"


def _streaming_bits(worker: ExperimentConfig) -> int | str | None:
    """``worker.streaming_bits``: an int, ``"e2m1"`` (4-bit floats) or None."""
    bits = worker.streaming_bits
    return bits if bits is None or isinstance(bits, str) else int(bits)


def _push_transform_spec(config: ExperimentConfig, index: int) -> str | None:
    """``hpsjax-worker --push_transform``'s JSON for SparseLoCo's, DeMo's and
    Streaming DiLoCo's pushes (the transforms ``_push_compression`` gives the
    simulator) of worker ``index``, or ``None``."""
    worker = config.worker
    compression = worker.compression
    if compression == "sparseloco":
        fields = {
            "name": "sparseloco",
            "ratio": float(worker.compress_ratio),
            "bits": int(worker.sparseloco_bits),
            "decay": float(worker.sparseloco_decay),
        }
        return json.dumps(fields)  # deterministic: no seed
    elif compression == "demo":
        fields = {
            "name": "demo",
            "decay": float(worker.demo_decay),
            "topk": int(worker.demo_topk),
            "chunk": int(worker.demo_chunk),
        }
        return json.dumps(fields)  # deterministic: no seed
    elif compression == "streaming":
        fields = {
            "name": "streaming_push",
            "fragments": int(worker.streaming_fragments),
            "bits": _streaming_bits(worker),
            "error_feedback": bool(worker.error_feedback),
            "layout": str(worker.streaming_layout),
        }
    else:
        return None
    # Each worker rounds with a key of its own.
    return json.dumps({**fields, "seed": int(config.seed) * 1000 + index})


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _placements(
    config: ExperimentConfig,
) -> tuple[list[Any] | None, tuple[int, ...], list[str]]:
    """Each worker's device and core set (``workers.devices``, see
    :mod:`experiments.placement`), the server's cores and what is not as
    asked; ``None`` for the workers when the config places none."""
    from experiments.placement import place

    devices = tuple(config.workers.devices)
    if not devices:
        return None, (), []
    n = len(config.workers.slowdowns)
    if len(devices) != n:
        raise ValueError(
            f"workers.devices names {len(devices)} devices for {n} workers"
        )
    return place(devices, server_cores=int(config.server.cores))


def _job(
    config: ExperimentConfig,
    *,
    plan_file: pathlib.Path | None,
    steps: int | None = None,
    shared: Sequence[str] = (),
) -> Any:
    """The run's :class:`hpsjax.launch.Job`: one ``hpsjax-worker`` per worker
    with its own flags (its server is this process's)."""
    from hpsjax.launch import Job

    run = run_config(config, plan_file=plan_file)
    return Job(
        num_workers=len(run.workers),
        policy=str(config.server.policy),
        steps=steps,
        server_args=[],
        shared=list(shared),
        flags=[run.worker_argv(i) for i in range(len(run.workers))],
        plan_server_args=[],
        server_shards=1,
        split_leaves=False,
    )


def _worker_places(config: ExperimentConfig) -> Any:
    """Each worker's :data:`hpsjax.launch.WorkerPlaces` entry (its device and
    core set, ``workers.devices``), or ``None`` where the config places none."""
    placements, _, _ = _placements(config)
    if placements is None:
        return None
    return [(p.wrap([sys.executable]), p.env()) for p in placements]


def _run_env(workdir: pathlib.Path) -> dict[str, str]:
    """The environment of a run's worker processes: the launcher's, with the
    run's compilation cache shared by the profiling pass, the warm-up, the
    workers and this process's server: ``JAX_COMPILATION_CACHE_DIR`` where the
    environment names one (a cache several runs share, as ``hpsjax-worker``
    takes it), otherwise ``jax_cache`` in ``workdir``."""
    from hpsjax._compile_cache import CACHE_ENV
    from hpsjax.launch import run_env

    return run_env(workdir, os.environ.get(CACHE_ENV) or None)


def _server(
    config: ExperimentConfig,
    setup: build.Setup,
    secret: bytes,
    policy: Any = "asp",
    core_kwargs: Mapping[str, Any] | None = None,
    policy_kwargs: Mapping[str, Any] | None = None,
    replanner: Any = None,
) -> Any:
    """A server of the run in this process, on loopback: the config's
    optimizer, holding the first pull until every worker joined."""
    from hpsjax.ps import Server

    return Server(
        setup.params,
        build.server_optimizer(config),
        policy,
        host="127.0.0.1",
        port=0,
        secret=secret,
        core_kwargs={
            **(core_kwargs or {}),
            "expected_workers": len(config.workers.slowdowns),
        },
        replanner=replanner,
        **(policy_kwargs or {}),
    )


@contextlib.contextmanager
def _serving_on_a_thread(make: Callable[[], Any], timeout: float) -> Any:
    """The server ``make()`` builds, serving on an event loop of a thread of
    its own while the block runs (for a pass of :mod:`hpsjax.launch` that
    watches its processes from this thread); yields it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="server", daemon=True)
    thread.start()

    async def start() -> Any:
        server = make()
        await server.start()
        return server

    try:
        server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
        try:
            yield server
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def _profile_in_place(
    config: ExperimentConfig,
    setup: build.Setup,
    workdir: pathlib.Path,
    env: Mapping[str, str],
    secret: bytes,
    secret_file: pathlib.Path,
) -> tuple[list[Any], float]:
    """The profiling pass in place, one profile per worker.

    :func:`hpsjax.launch.profile_in_place`: every worker is profiled in its
    own process with its own flags (slowdown, link, codec) and placement, all
    at once: its step is timed beside the others, under the run's contention,
    and its push and pull against a throwaway server of the model in this
    process, as the run's will be (the run's optimizer; ASP, holding the
    first pull until all joined), its injected link added. The
    pass is charged at what the slowest worker spends in it: its warm-up and
    timed steps, slowed, plus one round trip. Compiling is not charged, as no
    scheme's compiling is (the workers compile before the clock starts).
    The processes' output is in ``workers/profile.log``.
    """
    from hpsjax.launch import Console, LaunchError, profile_in_place

    logs = workdir / "workers"
    timeout = float(config.processes.start_timeout)
    sizes = sorted({int(b) for b in config.plan.profile_batch_sizes})
    repeats = int(config.plan.profile_repeats)
    log_path = logs / "profile.log"
    with (
        open(log_path, "w", encoding="utf-8") as log,
        _serving_on_a_thread(lambda: _server(config, setup, secret), timeout) as server,
    ):
        try:
            profiles = profile_in_place(
                _job(config, plan_file=None), logs, secret_file, None, Console(log),
                python=sys.executable, env=env, start_timeout=timeout,
                shutdown_timeout=float(config.processes.shutdown_timeout),
                places=_worker_places(config),
                profile_args=argv_of(
                    WorkerCommand,
                    profile_batch_sizes=",".join(map(str, sizes)),
                    profile_repeats=repeats,
                ),
                ports=[server.port],
            )  # fmt: skip
        except LaunchError as e:
            raise RuntimeError(f"{e}; see {log_path}") from None
    cost = max(
        sum((1 + repeats) * t for d in p.devices for t in d.step_times)
        + p.transfer_seconds
        for p in profiles
    )
    return profiles, cost


async def _watch(run: Any, end: float, done: Callable[[], bool] = lambda: False) -> str:
    """:meth:`hpsjax.launch.LocalRun.poll` until the workers end (why), ``done()``
    holds (``"done"``) or the monotonic time ``end`` passes (``"timeout"``),
    serving meanwhile."""
    while (reason := run.poll()) is None:
        if done():
            return "done"
        if time.monotonic() > end:
            return "timeout"
        await asyncio.sleep(0.02)
    return reason


async def _ended(workers: Sequence[Any], timeout: float) -> bool:
    """Waits up to ``timeout`` for every worker to exit; ``False`` if some
    are still running."""
    deadline = time.monotonic() + timeout
    while any(w.poll() is None for w in workers):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _serve_and_train(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    policy: Any,
    policy_kwargs: dict[str, Any],
    core_kwargs: dict[str, Any],
    plan_file: pathlib.Path | None,
    replan: bool,
    duration: float,
    offset: float,
    workdir: pathlib.Path,
    secret: bytes,
    secret_file: pathlib.Path,
    progress: bool,
) -> tuple[list[tuple[float, int, Any]], dict[str, Any]]:
    """Runs the server and the workers; returns parameter snapshots over time.

    The server is this process's, the workers a
    :class:`hpsjax.launch.LocalRun` against its port (their output in
    ``workers/run.log``). With ``replan``, the server re-plans from
    ``plan_file``'s plan; the revisions are in ``info["replans"]`` (run time
    since the workers started, without the profiling ``offset``).
    """
    from hpsjax.launch import Console, LocalRun

    logs = workdir / "workers"
    for stale in logs.glob("metrics_*.jsonl"):
        stale.unlink()
    env = _run_env(workdir)
    start_timeout = float(config.processes.start_timeout)
    if config.processes.warmup:
        await _warm_up(
            config,
            setup,
            plan_file,
            secret,
            secret_file,
            logs,
            env,
            server_args=(policy, core_kwargs, policy_kwargs),
        )
    replanned: list[tuple[float, Any]] = []
    replanner = None
    if replan:
        from hpsjax.profiling import WorkPlan

        replanner = _replanner(
            config,
            None if plan_file is None else WorkPlan.from_json(plan_file.read_text()),
            lambda now, revised: replanned.append((time.monotonic(), revised)),
        )
    server = _server(
        config, setup, secret, policy, core_kwargs, policy_kwargs, replanner
    )
    await server.start()
    log_path = logs / "run.log"
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
    run = None
    info: dict[str, Any] = {}
    snapshots: list[tuple[float, int, Any]] = []
    bar = None
    try:
        shared = argv_of(WorkerConfig, max_seconds=start_timeout + duration)
        run = LocalRun(
            _job(config, plan_file=plan_file, shared=shared),
            Console(log), sys.executable, 0, start_timeout, env,
            _worker_places(config),
        )  # fmt: skip
        run.start_workers(str(secret_file), logs, ports=[server.port])
        start_deadline = time.monotonic() + start_timeout
        while not server.core.started:
            reason = run.poll()
            if reason is not None:
                raise RuntimeError(f"{reason} before all joined; see {log_path}")
            if time.monotonic() > start_deadline:
                raise RuntimeError(
                    f"the workers did not all join within "
                    f"{config.processes.start_timeout}s; see {log_path}"
                )
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        bar = _progress_bar(progress, offset + duration, "s")
        every = float(config.eval.every_seconds)
        max_updates = config.max_updates
        snapshots.append((0.0, server.core.version, server.core.params))
        next_eval = every
        while True:
            elapsed = time.monotonic() - t0
            end = elapsed >= duration or (
                max_updates is not None and server.core.version >= max_updates
            )
            if elapsed >= next_eval or end:
                # Parameters are immutable arrays replaced at each update, so a
                # reference is a snapshot; evaluation waits until the end.
                snapshots.append(
                    (min(elapsed, duration), server.core.version, server.core.params)
                )
                next_eval += every
                if bar is not None:
                    bar.update(round(offset + min(elapsed, duration) - bar.n, 6))
                    bar.set_postfix(v=server.core.version)
            if end:
                break
            reason = run.poll()
            if reason is not None:
                diverged = [
                    i for i, w in enumerate(run.workers) if w.poll() == DIVERGED
                ]
                if not diverged:
                    raise RuntimeError(f"{reason} before the end; see {log_path}")
                # The run ends here: the table says when, not a traceback.
                info["diverged"] = {"worker": diverged[0], "time": offset + elapsed}
                snapshots.append((elapsed, server.core.version, server.core.params))
                break
            await asyncio.sleep(min(0.02, max(0.0, next_eval - elapsed)))
        for worker in run.workers:
            if worker.poll() is None:
                worker.signal(signal.SIGTERM)
        if not await _ended(run.workers, float(config.processes.shutdown_timeout)):
            # Workers blocked on a barrier end when the server says goodbye.
            await server.close()
            await _ended(run.workers, 5.0)
        info["worker_returncodes"] = [w.poll() for w in run.workers]
        info["final_version"] = server.core.version
        info["replans"] = [
            {
                "time": max(0.0, at - t0),
                "revision": revised.revision,
                "predicted_round_s": revised.round_time,
                "workers": [
                    {
                        "worker": w.worker_id,
                        "batch_size": w.batch_size,
                        "step_time": w.step_time,
                        "transfer_seconds": w.transfer_seconds,
                    }
                    for w in revised.workers
                ],
            }
            for at, revised in replanned
        ]
    finally:
        if bar is not None:
            bar.close()
        if run is not None:
            run.stop(0.0)
        log.close()
        await server.close()
    failed = [
        (i, code)
        for i, code in enumerate(info["worker_returncodes"])
        if code not in (0, -signal.SIGTERM, DIVERGED)
    ]
    if failed:
        raise RuntimeError(
            f"worker {failed[0][0]} exited with status {failed[0][1]}; see "
            f"{log_path} (its lines are [worker {failed[0][0]}])"
        )
    return snapshots, info


async def _warm_up(
    config: ExperimentConfig,
    setup: build.Setup,
    plan_file: pathlib.Path | None,
    secret: bytes,
    secret_file: pathlib.Path,
    logs: pathlib.Path,
    env: Mapping[str, str],
    server_args: tuple[Any, dict[str, Any], dict[str, Any]],
) -> None:
    """Runs every worker for two rounds against a throwaway server.

    The workers compile their train step in the first round; with the
    persistent compilation cache in ``env``, the timed run then loads it instead
    of compiling while the clock runs. The throwaway server has the timed
    one's optimizer, policy (a name; an ASP stand-in for a stateful policy
    object) and core settings, and this process uses the same cache, so the
    timed server loads its compiled steps too (compiled on its first apply
    they held every worker's first round by 4 to 5 s on proc4). It ends when
    every worker has left the throwaway server; a process still tearing down
    its JAX runtime then is stopped rather than awaited. The workers'
    output is in ``workers/warmup.log``, their metrics in ``workers/warmup/``.
    """
    from hpsjax._compile_cache import CACHE_ENV, use_compile_cache
    from hpsjax.launch import Console, LocalRun

    policy, core_kwargs, policy_kwargs = server_args
    if not isinstance(policy, str):
        policy, policy_kwargs = "asp", {}
    before = os.environ.get(CACHE_ENV)
    use_compile_cache(env[CACHE_ENV])
    # The children have the cache in their own environment; this process's
    # later children (another run's) get theirs.
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
    server = _server(config, setup, secret, policy, core_kwargs, policy_kwargs)
    await server.start()
    timeout = float(config.processes.start_timeout)
    log_path = logs / "warmup.log"
    (logs / "warmup").mkdir(exist_ok=True)
    run = None
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            run = LocalRun(
                _job(config, plan_file=plan_file, steps=2), Console(log),
                sys.executable, 0, timeout, env, _worker_places(config),
            )  # fmt: skip
            run.start_workers(str(secret_file), logs / "warmup", ports=[server.port])
            # Done when every worker has joined and left again: its rounds
            # are over and what it compiled is in the cache. A process that
            # used JAX then takes about a second to tear its runtime down,
            # which the timed run need not wait for: it is stopped below.
            reason = await _watch(
                run,
                time.monotonic() + timeout,
                lambda: server.core.started and not server.core.live,
            )
            reason = run.poll() or reason
            codes = [w.poll() for w in run.workers]
        finally:
            if run is not None:
                run.stop(0.0)
            await server.close()
    if reason == "timeout":
        raise RuntimeError(
            f"the warm-up workers did not finish within {timeout}s; see {log_path}"
        )
    # A warm-up only compiles: a run that diverges within its two rounds (a
    # step size far too large) says so in the timed run instead.
    if any(code not in (None, 0, DIVERGED) for code in codes):
        raise RuntimeError(f"a warm-up worker failed: {reason}; see {log_path}")


def _read_worker_records(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _worker_timeline(
    records: list[dict[str, Any]], offset: float
) -> tuple[dict[str, Any], list[tuple[float, float, str]]]:
    """Totals and a timeline from one worker's round records.

    A round computes from ``time`` to ``compute_end`` (compile, compute and the
    injected slowdown), then the worker is idle for ``wait_s`` until the
    parameters of the next round are there: the first ``link_delay_s`` of that
    is its link (transfer), the rest waiting for the server. Times are shifted so
    that the worker's first round starts at ``offset``: every worker is released
    at once when the last one joins, a few milliseconds before its first round.
    """
    rounds = [r for r in records if r.get("event") == "round"]
    totals = dict.fromkeys(
        ("compute_s", "compile_s", "transfer_s", "wait_s", "discarded_s"), 0.0
    )
    totals.update(bytes_sent=0, bytes_received=0, pushes=0, local_steps=0)
    spans: list[tuple[float, float, str]] = []
    if not rounds:
        return totals, spans
    shift = offset - float(rounds[0]["time"])
    for r in rounds:
        start = float(r["time"]) + shift
        busy = float(r["compute_end"]) + shift - start
        compile_s = min(max(float(r.get("compile_s") or 0.0), 0.0), busy)
        if compile_s > 0:
            spans.append((start, start + compile_s, "compile"))
            totals["compile_s"] += compile_s
        kind = "discarded" if r.get("discarded") else "compute"
        totals["discarded_s" if kind == "discarded" else "compute_s"] += (
            busy - compile_s
        )
        spans.append((start + compile_s, start + busy, kind))
        start += busy
        idle = max(float(r["wait_s"]), 0.0)
        link = min(idle, max(float(r.get("link_delay_s") or 0.0), 0.0))
        if link > 0:
            spans.append((start, start + link, "transfer"))
        if idle > link:
            spans.append((start + link, start + idle, "wait"))
        totals["transfer_s"] += link
        totals["wait_s"] += idle - link
        totals["local_steps"] += int(r.get("local_steps") or 0)
    for r in records:
        totals["bytes_sent"] += int(r.get("bytes_sent") or 0)
        totals["bytes_received"] += int(r.get("bytes_received") or 0)
        if r.get("status") is not None:
            totals["pushes"] += 1
    return totals, spans


def run_processes(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    workdir: pathlib.Path,
    progress: bool = True,
) -> RunOutput:
    """Runs ``config`` with a real server and one worker process per worker.

    The server (:class:`hpsjax.ps.Server`, so that any optax chain and policy
    object can be served) runs in this process on loopback; each worker is an
    ``hpsjax-worker`` process (``python -m hpsjax.worker._cli``) with its
    slowdown and link cap injected. The server holds every pull until all
    workers joined; time 0 is that moment. The parameters are snapshot every
    ``eval.every_seconds`` and evaluated on the test set after the run, so
    evaluation takes no time from training. After ``budget_seconds``, or once
    the server made ``max_updates`` versions (checked every 20 ms), the workers
    get SIGTERM, finish their round and push it.

    Schemes with a work plan are profiled first, in place (see
    :func:`_profile_in_place`); its cost is charged as in the simulator, and
    the plan's predicted round is reported beside the measured one
    (``info["predicted_round_s"]``, ``info["measured_round_s"]``). A worker
    that exits with the diverged status (:data:`hpsjax.launch.DIVERGED`)
    ends the run there (``info["diverged"]``: which worker, and when). With
    ``plan.replan`` the server re-plans as the workers' measured step times
    drift from the profile (a :class:`~hpsjax.profiling.Replanner` fed by every
    push, as ``hpsjax-server --work_plan`` does) and sends each worker its new
    batch; ASHL's stage switch is the server version.

    The workers are :mod:`hpsjax.launch`'s (:class:`~hpsjax.launch.LocalRun`,
    :func:`~hpsjax.launch.profile_in_place`): their command lines, process
    groups, exit-status rules and shutdown are a launch's; the server stays
    here for what no ``hpsjax-server`` flag carries (any optax chain, a
    policy object read after the run, parameter snapshots at the evaluation
    times).

    Outputs besides the returned ones, in ``workdir``: ``workers/run.log``
    (the workers' output, ``[worker i]`` lines; ``profile.log`` and
    ``warmup.log`` beside it for the passes before) and
    ``workers/metrics_<i>.jsonl`` (the workers' own round records).

    Returns:
      The :class:`RunOutput`; times are wall seconds.

    Raises:
      ValueError: a setting the processes backend cannot run.
      RuntimeError: a worker failed or did not join in time (its log is named).
    """
    if config.stages.enabled and config.stages.switch == "plateau":
        raise ValueError(
            "the processes backend switches ASHL's stages at a server version "
            "or on the server's training loss only; stages.switch='plateau' "
            "runs in the simulator"
        )
    info: dict[str, Any] = {"backend": "processes"}
    placements, server_cores, notes = _placements(config)
    if placements is not None:
        info["placement"] = [p.describe() for p in placements]
        info["server_cores"] = list(server_cores)
        info["placement_notes"] = notes
        for note in notes:
            logging.warning("workers.devices: %s", note)
    affinity = os.sched_getaffinity(0)
    if server_cores:
        # The server runs on this process's main thread.
        os.sched_setaffinity(0, server_cores)
    try:
        return _run_processes(
            config, setup, workdir=workdir, progress=progress, info=info
        )
    finally:
        if server_cores:
            os.sched_setaffinity(0, affinity)


def _run_processes(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    workdir: pathlib.Path,
    progress: bool,
    info: dict[str, Any],
) -> RunOutput:
    """:func:`run_processes` once the server's cores are set."""
    from hpsjax.launch import write_secret

    plan_scheme = registry.lookup("plan scheme", config.plan.scheme)
    offset = 0.0
    plan_file = None
    stage_plans: list[Any] = []
    plans: list[Any] = []
    (workdir / "workers").mkdir(parents=True, exist_ok=True)
    secret, secret_file = write_secret(workdir)
    pilot = plan_scheme != "none" and bool(config.plan.pilot)
    if pilot:
        info["pilot"] = True
    elif plan_scheme != "none":
        profiles, offset = _profile_in_place(
            config, setup, workdir, _run_env(workdir), secret, secret_file
        )
        info["profile_seconds"] = offset
        first, stage_plans = build.plans(config, profiles)
        plans = [first]
        plan_file = workdir / "plan.json"
        plan_file.write_text(plans[0].to_json())
        info["plans"] = [build.plan_to_dict(p) for p in plans]
        if stage_plans:
            info["stage_plans"] = [build.plan_to_dict(p) for p in stage_plans]
    duration = float(config.budget_seconds) - offset
    if duration <= 0:
        raise ValueError(
            f"the profiling pass takes {offset:.3g}s of the "
            f"{config.budget_seconds}s budget; raise budget_seconds"
        )
    policy, policy_kwargs = build.policy(config, stage_plans)
    wall = time.perf_counter()
    coroutine = _serve_and_train(
        config,
        setup,
        policy=policy,
        policy_kwargs=policy_kwargs,
        core_kwargs=build.core_kwargs(config, plans[0] if plans else None),
        plan_file=plan_file,
        replan=pilot or (bool(plans) and bool(config.plan.replan)),
        duration=duration,
        offset=offset,
        workdir=workdir,
        secret=secret,
        secret_file=secret_file,
        progress=progress,
    )
    try:
        import uvloop

        snapshots, run_info = uvloop.run(coroutine)
    except ImportError:
        snapshots, run_info = asyncio.run(coroutine)
    info.update(run_info)
    info["wall_seconds"] = time.perf_counter() - wall
    if config.stages.enabled:
        info["final_stage"] = int(policy.stage)
        info["switched_at"] = getattr(policy, "switched_at", None)

    evals, seen = [], {}
    for t, version, params in snapshots:
        if version not in seen:
            seen[version] = _evaluate(setup, params, int(config.eval.batch_size))
        evals.append({"time": offset + t, "version": version, **seen[version]})

    workers, timelines, records = {}, {}, []
    for i in range(len(config.workers.slowdowns)):
        own = _read_worker_records(workdir / "workers" / f"metrics_{i}.jsonl")
        totals, spans = _worker_timeline(own, offset)
        total = offset + sum(
            totals[k]
            for k in ("compute_s", "compile_s", "transfer_s", "wait_s", "discarded_s")
        )
        totals["profile_s"] = offset
        totals["idle_fraction"] = 0.0 if total <= 0 else 1 - totals["compute_s"] / total
        # Idle for neither the wire nor the server, from the round telemetry.
        totals["other_idle_fraction"] = telemetry.idle_fraction(
            [{**r, "worker": i} for r in own if r.get("event") == "round"]
        ).get(str(i))
        workers[i] = totals
        timelines[i] = ([(0.0, offset, "profile")] if offset > 0 else []) + spans
        records.extend({**r, "worker": i} for r in own)
    records.extend(
        {"event": "replan", **r, "time": offset + r["time"]}
        for r in info.pop("replans", [])
    )
    info["num_updates"] = run_info["final_version"]
    if pilot:
        _pilot_rounds(info, records)
    if plans:
        info["predicted_round_s"] = plans[0].round_time
        own = [
            _read_worker_records(workdir / "workers" / f"metrics_{i}.jsonl")
            for i in range(len(config.workers.slowdowns))
        ]
        info["measured_round_s"] = measured_round(own)
        # The plan predicts the expected round (a barrier's expected slowest
        # worker), which the mean, not the median, measures.
        info["measured_mean_round_s"] = measured_round(own, statistic="mean")
    return RunOutput(evals, workers, timelines, records, info)


def _pilot_rounds(info: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A piloted run's plan against its rounds: the last revision's predicted
    round, and the mean measured round of the rounds that started after it at
    each worker's batch of the plan (its last; before it, the new batch's
    step compiles beside rounds at the old one), each worker's first two there
    left out, as the pilot does."""
    revisions = [r for r in records if r.get("event") == "replan"]
    if not revisions:
        return
    last = revisions[-1]
    info["predicted_round_s"] = last["predicted_round_s"]
    info["pilot_seconds"] = last["time"]
    after: dict[Any, list[tuple[Any, float]]] = {}
    for r in records:
        if r.get("event") == "round" and float(r.get("time", 0.0)) >= last["time"]:
            batch = (r.get("batch_size"), float(r["round_s"]))
            after.setdefault(r["worker"], []).append(batch)
    kept = [
        t
        for rounds in after.values()
        for t in [t for b, t in rounds if b == rounds[-1][0]][2:]
    ]
    if kept:
        info["measured_mean_round_s"] = sum(kept) / len(kept)


def measured_round(
    records: list[list[dict[str, Any]]], skip: int = 3, statistic: str = "median"
) -> float | None:
    """The median (or ``statistic="mean"``) seconds from one round's start to
    the next, over every worker's rounds after its first ``skip`` (compiles,
    joining), or ``None`` when there are none."""
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic must be 'median' or 'mean', got {statistic!r}")
    gaps = []
    for own in records:
        starts = [float(r["time"]) for r in own if r.get("event") == "round"]
        gaps += np.diff(starts[skip:]).tolist()
    if not gaps:
        return None
    return float(np.median(gaps) if statistic == "median" else np.mean(gaps))


BACKENDS: Mapping[str, Callable[..., RunOutput]] = {
    "sim": run_sim,
    "processes": run_processes,
}
