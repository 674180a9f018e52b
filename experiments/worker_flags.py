"""An experiment's real worker processes as one :class:`hpsjax.config.RunConfig`.

The one place an experiment's config becomes the workers' settings
(:func:`run_config`), their command lines written from it, and where each
worker process is placed (devices, CPU cores) and with what environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from experiments import build, registry
from experiments.build import dataset_kwargs, model_kwargs, slowdown_schedule
from experiments.configs.schema import ExperimentConfig
from experiments.run_output import _pilot_grid, _streaming_bits, _worker_side
from hpsjax.config import RunConfig, WorkerSettings
from hpsjax.profiling import WorkPlan
from hpsjax.wire import QuantizedCodec
from hpsjax.worker import WorkerCommand, WorkerConfig, push_compression

__all__ = ["run_config", "worker_config"]


def run_config(
    config: ExperimentConfig, *, plan_file: pathlib.Path | None = None
) -> RunConfig:
    """The experiment's real processes as a :class:`hpsjax.config.RunConfig`:
    one worker per ``workers.slowdowns`` entry, worker ``i`` with id and data
    shard ``i`` (the server runs in this process: no server settings).

    The one place an experiment's config becomes the workers' settings; the
    workers' command lines are written from it, and the simulator's workers
    take the same :func:`worker_config`.
    """
    n = len(config.workers.slowdowns)
    plan = None if plan_file is None else WorkPlan.from_json(plan_file.read_text())
    workers = []
    for index in range(n):
        command = _worker_command(config, index, plan_file=plan_file)
        workers.append(
            WorkerSettings(
                WorkerCommand(**command, shard_index=index, shard_count=n),
                worker_config(config, index, plan=plan),
            )
        )
    return RunConfig(workers=tuple(workers))


def _worker_flags(
    config: ExperimentConfig, index: int, *, plan_file: pathlib.Path | None
) -> list[str]:
    """The ``hpsjax-worker`` flags of worker ``index`` (without server flags)."""
    return run_config(config, plan_file=plan_file).worker_argv(index)


def worker_config(
    config: ExperimentConfig, index: int, *, plan: WorkPlan | None = None
) -> WorkerConfig:
    """Worker ``index``'s :class:`~hpsjax.worker.WorkerConfig`: its id, batch,
    local steps, seed, push compression (:func:`hpsjax.worker.push_compression`
    reads it), overlap, PS+'s step rule and, with ``plan``, top-k from a
    stage on; what the real worker runs with and the simulator's workers take
    (``SimConfig.worker``)."""
    worker = config.worker
    settings: dict[str, Any] = dict(
        worker_id=index,
        batch_size=int(config.batch_size),
        local_steps=int(worker.local_steps),
        seed=int(config.seed) * 1000 + index,
        push_transform=_push_transform_spec(config, index),
    )
    power_sgd = worker.compression == "power_sgd"
    if worker.bits is not None:
        settings["bits"] = int(worker.bits)
    if power_sgd:
        settings["powersgd_rank"] = int(worker.powersgd_rank)
    if worker.bits is not None or power_sgd:
        settings["error_feedback"] = bool(worker.error_feedback)
    settings.update(_worker_side(config, plan))
    if (grid := _pilot_grid(config)) is not None:
        settings["precompile"] = ",".join(str(b) for b in grid)
    return WorkerConfig(**settings)


def _worker_command(
    config: ExperimentConfig, index: int, *, plan_file: pathlib.Path | None
) -> dict[str, Any]:
    """Worker ``index``'s :class:`WorkerCommand` fields set by ``config`` (its
    data shard and server address left out)."""
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
    if worker.local_optimizer != "none":
        command.update(
            local_optimizer=_local_optimizer(worker),
            local_learning_rate=float(worker.local_learning_rate),
            local_optimizer_arg=dict(worker.local_optimizer_args or {}),
        )
    if plan_file is not None:
        command["work_plan"] = str(plan_file)
    schedule = slowdown_schedule(config, index)
    command["slowdown"] = ",".join(f"{t:g}:{k:g}" for t, k in schedule)
    if config.workers.bandwidth is not None:
        command["bandwidth"] = repr(float(config.workers.bandwidth))
    command["latency"] = float(config.workers.latency)
    return command


def _push_compression(config: ExperimentConfig, params: Any) -> tuple[Any, Any, int]:
    """How the simulated workers compress pushes: ``(transform, codec,
    push_bytes)``, the transform and codec those of the real workers
    (:func:`hpsjax.worker.push_compression` of :func:`worker_config`).

    The codec is the quantizer's ``hpsjax.transforms.Codec`` (``None`` for
    PowerSGD, SparseLoCo, DeMo and Streaming DiLoCo, whose bytes the
    simulator reads from the transform's state); ``None`` everywhere for
    float32 pushes. ``push_bytes`` is one push's payload, what the profiling
    pass's link estimate uses: ``powersgd_nbytes`` per leaf for PowerSGD,
    the fragments' mean for Streaming DiLoCo.
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
    from hpsjax.transforms import (
        demo_nbytes,
        last_streaming_nbytes,
        sparseloco_nbytes,
    )

    # The simulator keys its workers' rounding from the run's seed, folding
    # in each worker's index itself.
    settings = dataclasses.replace(worker_config(config, 0), seed=int(config.seed))
    made = push_compression(settings)
    if made is None:
        return None, None, tree_wire_nbytes(params)
    wire, transform = made
    worker = config.worker
    if isinstance(wire, QuantizedCodec):
        return transform, wire.codec, tree_wire_nbytes(params, wire.codec)
    if worker.compression == "power_sgd":
        rank = int(worker.powersgd_rank)
        return transform, None, tree_wire_nbytes(params, powersgd_rank=rank)
    if worker.compression == "sparseloco":
        ratio, bits = float(worker.compress_ratio), int(worker.sparseloco_bits)
        chunk = int(worker.sparseloco_chunk)
        return transform, None, sparseloco_nbytes(params, ratio, bits, chunk=chunk)
    if worker.compression == "streaming":
        return transform, None, last_streaming_nbytes(transform.init(params))
    topk, chunk = int(worker.demo_topk), int(worker.demo_chunk)
    return transform, None, demo_nbytes(params, topk, chunk)


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
            "chunk": int(worker.sparseloco_chunk),
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
