"""``hpsjax-launch``: the launcher's command line, either backend."""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import signal
import sys
from collections.abc import Sequence

from hpsjax._config_flags import add_flags, argv_of, flag_message
from hpsjax._flags import ArgumentParser, HelpFormatter
from hpsjax._logs import quiet_backend_probe
from hpsjax.config import get_scheme
from hpsjax.launch import _ray
from hpsjax.launch._job import LaunchError
from hpsjax.launch._local import launch
from hpsjax.launch._options import LaunchOptions
from hpsjax.launch._prepare import kept_params, with_export
from hpsjax.worker import WorkerCommand

_GROUPS = {
    "workers": "workers and model",
    "server": "server",
    "plan": "work plan",
    "run": "run",
    "backend": "backend",
}


# The names launch() checks its arguments under, as the flags that give them.
_CHECKED_AS = {
    "num_workers": "--workers",
    "worker_args": "--",
    "server_args": "--server",
}


# Seconds between worker 0's evaluations when the launcher turns them on.
EVAL_EVERY_S = 60.0


def default_eval(
    evaluate: bool, worker_args: Sequence[str], per_worker: dict[int, list[str]]
) -> bool:
    """Turns on worker 0's evaluation (``--eval_every``) where the run holds
    test data out and no flag says otherwise; returns whether it did."""
    given = [*worker_args, *(a for flags in per_worker.values() for a in flags)]
    if not evaluate or any(a.startswith("--eval_every") for a in given):
        return False
    for i, arg in enumerate(given):
        if arg.startswith("--test_fraction"):
            value = arg.partition("=")[2] or "".join(given[i + 1 : i + 2])
            with contextlib.suppress(ValueError):
                if float(value) == 0:
                    return False  # no test data
    per_worker.setdefault(0, []).extend(argv_of(WorkerCommand, eval_every=EVAL_EVERY_S))
    return True


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


def parse_args(own: Sequence[str]) -> argparse.Namespace:
    """Parses the launcher's own flags, made from :class:`LaunchOptions`."""
    p = ArgumentParser(
        prog="hpsjax-launch",
        formatter_class=HelpFormatter,
        description="Run a parameter server and N workers on this machine.",
        epilog="Flags after --server go to hpsjax-server, flags after -- to every "
        "hpsjax-worker.",
    )
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    add_flags(p, LaunchOptions, groups)
    return p.parse_args(own)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpsjax.launch``; returns the exit status.

    Usage: ``python -m hpsjax.launch [launcher flags] [--server SERVER FLAGS]
    [-- WORKER FLAGS]``.
    """
    quiet_backend_probe()
    argv = list(sys.argv[1:] if argv is None else argv)
    own, server_args, worker_args = _split_argv(argv)
    args = parse_args(own)

    def terminate(signum, frame):
        del signum, frame
        raise KeyboardInterrupt

    # SIGTERM (a scheduler stopping the job) shuts down like Ctrl-C.
    signal.signal(signal.SIGTERM, terminate)
    per_worker: dict[int, list[str]] = {}
    try:
        scheme = get_scheme(args.policy)
        plan = args.plan if args.plan is not None else scheme.plan
        if scheme.policy != args.policy.lower() or scheme.worker_flags:
            print(f"hpsjax-launch: {scheme.describe(args.policy)}", flush=True)
        given = {k: v for k, v in (("task", args.task), ("model", args.model)) if v}
        worker_args = [*argv_of(WorkerCommand, **given), *worker_args]
        for index, text in args.worker_flags:
            per_worker.setdefault(int(index), []).extend(shlex.split(text))
        if default_eval(not args.no_eval, worker_args, per_worker):
            print(
                f"hpsjax-launch: worker 0 evaluates every {EVAL_EVERY_S:g} s and "
                "at its end (--no_eval: no evaluation)",
                flush=True,
            )
        backend = _ray.backend_from_flags(args) or functools.partial(
            launch, max_restarts=args.max_restarts or 0
        )
        # Without a work directory, the final parameters are kept on this host
        # (the Ray backend brings them back from the server's node).
        kept = args.workdir is not None
        server_args, params = with_export(server_args, kept, args.server_shards)
        result = backend(
            args.workers,
            policy=args.policy,
            steps=args.steps,
            worker_args=worker_args,
            per_worker_args=per_worker,
            server_args=server_args,
            plan=plan,
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
        message = flag_message(str(e), LaunchOptions, names=_CHECKED_AS)
        print(f"hpsjax-launch: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if params is not None:
        print(f"hpsjax-launch: {kept_params(params)}", flush=True)
    return result.returncode
