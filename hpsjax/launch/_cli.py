"""``hpsjax-launch``: the launcher's command line, either backend."""

from __future__ import annotations

import argparse
import functools
import shlex
import signal
import sys
from collections.abc import Sequence

from hpsjax._config_flags import argv_of
from hpsjax._logs import quiet_backend_probe
from hpsjax.launch import _ray
from hpsjax.launch._job import LaunchError
from hpsjax.launch._local import launch
from hpsjax.profiling import SCHEMES
from hpsjax.ps import POLICIES
from hpsjax.worker._command import WorkerCommand


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Splits ``[own] [--server ...] [-- worker...]`` style command lines."""
    own, server, worker = [], [], []
    target = own
    for arg in argv:
        if arg == "--" and target is not worker:
            target = worker
        elif arg == "--server" and target is own:
            target = server
        else:
            target.append(arg)
    return own, server, worker


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpsjax.launch``; returns the exit status.

    Usage: ``python -m hpsjax.launch [launcher flags] [--server SERVER FLAGS]
    [-- WORKER FLAGS]``.
    """
    quiet_backend_probe()
    argv = list(sys.argv[1:] if argv is None else argv)
    own, server_args, worker_args = _split_argv(argv)
    p = argparse.ArgumentParser(
        prog="hpsjax-launch",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run a parameter server and N workers on this machine.",
        epilog="Flags after --server go to hpsjax-server, flags after -- to every "
        "hpsjax-worker.",
    )
    g = p.add_argument_group("workers and model")
    g.add_argument("--workers", type=int, required=True, help="number of workers")
    g.add_argument(
        "--model",
        help="the workers' model (sets their --model): a built-in name or "
        "package.module:factory, importable from here or PYTHONPATH",
    )
    g.add_argument(
        "--task",
        help="what the workers learn (sets their --task): classification, lm, "
        "regression or package.module:make_task",
    )
    g.add_argument("--steps", type=int, default=100, help="rounds per worker")
    g.add_argument(
        "--worker_flags",
        nargs=2,
        action="append",
        default=[],
        metavar=("INDEX", "FLAGS"),
        help="extra flags (one quoted string) for worker INDEX, repeatable",
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--policy",
        default="bsp",
        help=f"server synchronisation policy: {', '.join(sorted(POLICIES))}",
    )
    g.add_argument(
        "--server_shards",
        type=int,
        default=1,
        help="split the model by key range over this many server processes",
    )
    g.add_argument(
        "--split_leaves",
        action="store_true",
        help="with --server_shards: cut arrays by rows between shards too",
    )
    g = p.add_argument_group("work plan")
    g.add_argument(
        "--plan",
        choices=SCHEMES,
        metavar="SCHEME",
        help="profile the workers in place and plan with this scheme: "
        f"{', '.join(SCHEMES)}",
    )
    g.add_argument("--global_batch", type=int, help="the plan's global batch")
    g.add_argument(
        "--replan",
        type=float,
        help="with --plan: the server re-plans when a worker's speed drifts by "
        "more than this fraction",
    )
    g = p.add_argument_group("run")
    g.add_argument("--workdir", help="directory for secret, init, plan, metrics")
    g.add_argument(
        "--compile_cache",
        metavar="DIR",
        help="the JAX compilation cache every process of the run shares "
        "(default: jax_cache in the work directory)",
    )
    g.add_argument("--timeout", type=float, help="seconds the run may take")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    _ray.add_ray_flags(p)
    args = p.parse_args(own)

    def terminate(signum, frame):
        del signum, frame
        raise KeyboardInterrupt

    # SIGTERM (a scheduler stopping the job) shuts down like Ctrl-C.
    signal.signal(signal.SIGTERM, terminate)
    per_worker: dict[int, list[str]] = {}
    try:
        given = {k: v for k, v in (("task", args.task), ("model", args.model)) if v}
        worker_args = [*argv_of(WorkerCommand, **given), *worker_args]
        for index, text in args.worker_flags:
            per_worker.setdefault(int(index), []).extend(shlex.split(text))
        backend = _ray.backend_from_flags(args) or functools.partial(
            launch, max_restarts=args.max_restarts or 0
        )
        result = backend(
            args.workers,
            policy=args.policy,
            steps=args.steps,
            worker_args=worker_args,
            per_worker_args=per_worker,
            server_args=server_args,
            plan=args.plan,
            global_batch=args.global_batch,
            replan=args.replan,
            server_shards=args.server_shards,
            split_leaves=args.split_leaves,
            workdir=args.workdir,
            compile_cache=args.compile_cache,
            timeout=args.timeout,
            progress=not args.no_progress,
        )
    except (LaunchError, ValueError) as e:
        print(f"hpsjax.launch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result.returncode
