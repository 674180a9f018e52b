"""The settings of ``hpsjax-launch`` itself: :class:`LaunchOptions`.

Each field declares one of the launcher's own flags (name, type, default,
help, group), once: ``hpsjax-launch``'s parser is made from the fields
(:mod:`hpsjax._config_flags`), and a command that shows a launch (the
advisor's) writes it from them with :func:`hpsjax._config_flags.argv_of`. The
launch's arguments are checked where :func:`hpsjax.launch.launch` takes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpsjax.config import RUN_SCHEMES
from hpsjax.planning import SCHEMES

__all__ = ["LaunchOptions"]


def _flag(default: Any, help: str, group: str, **meta: Any) -> Any:
    factory = {"default_factory": tuple} if default == () else {"default": default}
    return dataclasses.field(**factory, metadata={"help": help, "group": group, **meta})


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """``hpsjax-launch``'s own flags (those before ``--server`` and ``--``)."""

    workers: int | None = _flag(
        None, "number of workers", "workers", type=int, required=True
    )
    model: str | None = _flag(
        None,
        "the workers' model (sets their --model): a built-in name or "
        "package.module:factory, importable from here or PYTHONPATH",
        "workers",
    )
    task: str | None = _flag(
        None,
        "what the workers learn (sets their --task): classification, lm, "
        "regression or package.module:make_task",
        "workers",
    )
    steps: int = _flag(100, "rounds per worker", "workers")
    worker_flags: tuple = _flag(
        (),
        "extra flags (one quoted string) for worker INDEX, repeatable",
        "workers",
        action="append",
        nargs=2,
        metavar=("INDEX", "FLAGS"),
    )
    policy: str = _flag(
        "bsp",
        f"the scheme: {', '.join(sorted(RUN_SCHEMES))} (a policy, or hps, "
        "ashl, ps_plus, local_sgd: a policy with worker flags and, for hps, a "
        "plan; printed at the start)",
        "server",
        metavar="SCHEME",
    )
    server_shards: int = _flag(
        1, "split the model by key range over this many server processes", "server"
    )
    split_leaves: bool = _flag(
        False, "with --server_shards: cut arrays by rows between shards too", "server"
    )
    plan: str | None = _flag(
        None,
        f"profile the workers in place and plan with this scheme: {', '.join(SCHEMES)}",
        "plan",
        choices=SCHEMES,
        metavar="SCHEME",
    )
    global_batch: int | None = _flag(None, "the plan's global batch", "plan")
    replan: float | None = _flag(
        None,
        "with --plan: the server re-plans when a worker's speed drifts by "
        "more than this fraction (hpsjax-server's --replan_threshold)",
        "plan",
        flag="--replan_threshold",
        dest="replan",
        aliases=("--replan",),
    )
    workdir: str | None = _flag(
        None, "directory for secret, init, plan, metrics", "run"
    )
    compile_cache: str | None = _flag(
        None,
        "the JAX compilation cache every process of the run shares "
        "(default: jax_cache in the work directory)",
        "run",
        metavar="DIR",
    )
    timeout: float | None = _flag(
        None,
        "seconds the whole run may take",
        "run",
        flag="--run_timeout",
        dest="timeout",
        aliases=("--timeout",),
    )
    progress: bool = _flag(True, "no progress bar", "run", flag="--no_progress")
    evaluate: bool = _flag(
        True,
        "no evaluation: by default worker 0 evaluates the pulled parameters on "
        "the held-out split (--test_fraction) every 60 s and at its end, "
        "unless the worker flags give --eval_every",
        "run",
        flag="--no_eval",
    )
    backend: str = _flag(
        "local",
        "local: processes on this machine; ray: actors placed by Ray",
        "backend",
        choices=("local", "ray"),
    )
    ray_address: str | None = _flag(
        None,
        "with --backend ray: the cluster to join (auto, host:6379, "
        "ray://host:10001); by default a local one is started",
        "backend",
    )
    worker_resources: tuple = _flag(
        (),
        "with --backend ray: resources for worker INDEX (or all), e.g. "
        "'num_gpus=1,accelerator_type:A100=1'; repeatable",
        "backend",
        action="append",
        nargs=2,
        metavar=("INDEX", "RESOURCES"),
    )
    server_resources: str | None = _flag(
        None,
        "with --backend ray: resources for each server shard, e.g. num_cpus=4",
        "backend",
    )
    max_restarts: int | None = _flag(
        None,
        "how often a crashed worker is restarted (default 3 with --backend "
        "ray, 0 locally); locally a crashed server too, from its checkpoints",
        "backend",
    )
