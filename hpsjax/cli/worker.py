"""``hpsjax-worker``: run one training worker from the command line.

The worker builds its model and its shard of the data from flags, pulls the
parameters from an ``hpsjax-server``, and trains until ``--steps``,
``--max_seconds`` or ``--until_version`` (or SIGINT/SIGTERM, after which it
finishes its round and pushes it). The server's initial parameters must be the
same model: ``--write_init`` writes them for ``hpsjax-server --init``::

    hpsjax-worker --model mlp --write_init init.npz
    hpsjax-server --init init.npz --secret_file secret.txt --policy bsp --port 5555
    hpsjax-worker --host 127.0.0.1 --port 5555 --secret_file secret.txt \\
        --worker_id 0 --shard_index 0 --shard_count 2 --batch_size 64 \\
        --steps 300 --metrics w0.jsonl

A model split over several server shards (``hpsjax-server --server_shard I
--server_shards N``) takes every shard's address, in shard order, instead of
``--host``/``--port``: ``--servers hostA:5555,hostB:5555`` (and
``--split_leaves`` when the servers have it). The worker then talks to all
shards at once through a :class:`hpsjax.ps.ShardedClient`.

Heterogeneity is injected with ``--slowdown 4`` (or a schedule
``--slowdown 0:1,60:4``: four times slower after a minute), ``--bandwidth 1e6``
(bytes/s) and ``--latency 0.002``. ``--profile_out`` runs the profiling pass
instead of training and writes the worker's profile (JSON, slowdown applied) for
:func:`hpsjax.planning.plan`; ``--work_plan`` then reads the plan.

``--task`` says what is learned: ``classification`` (the default), ``lm``
(next-token language modelling; by default a byte-level ``transformer`` on the
offline ``text``, evaluated by validation loss, next-token accuracy and
perplexity, with tokens per second in the round records), ``regression``
(mean squared error on ``synthetic_regression`` by default) or a user's
``my_pkg.my_module:make_task`` returning an :class:`hpsjax.tasks.Task`; it
sets the loss, the eval metrics and the direction of ``--target_value``,
which stops the worker once an eval reaches it.

``--model`` takes a built-in name or any flax model's factory,
``my_pkg.my_module:make_model`` (importable from the working directory or
``PYTHONPATH``; the contract is :func:`hpsjax.models.resolve_model`'s), and
``--model_arg`` its keyword arguments. ``--metrics w0.jsonl`` also writes
TensorBoard event files (``tensorboard/worker<id>`` beside it, or
``--tensorboard_dir``), ``--metrics_port 9101`` serves the rounds' parts
(:class:`hpsjax.metrics.RoundMetrics`) to Prometheus, and ``--eval_every 30``
adds the task's metrics (a
classifier's test accuracy and loss) of the last pulled parameters, on the
dataset's held-out split, every 30 seconds (``"eval"`` records).

A server that says goodbye or whose connection is lost (stopped, killed,
restarted) is reconnected to for ``--reconnect_timeout`` seconds (60 by
default, with backoff); the worker then joins again at the version the server
resumed at (its last checkpoint) and goes on, the rounds in flight thrown away
(never sent twice). Each event is one log line, never a traceback.

Exit status: 0 when the run ended normally (also when stopped by a signal),
1 when it failed, 2 for bad flags, :data:`DIVERGED` (3) when a round's loss or
update was not finite (one line says which worker, step, version and loss;
``--on_nonfinite skip`` drops such a round and goes on instead),
:data:`SERVER_GONE` (4) when the server stayed away longer than
``--reconnect_timeout`` (``0``: at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from hpsjax import tasks
from hpsjax._checks import check_int
from hpsjax._compile_cache import use_compile_cache
from hpsjax._config_flags import flag_message
from hpsjax._logs import setup_logging
from hpsjax.metrics import MetricsWriter, RoundMetrics
from hpsjax.profiling.in_place import write_worker_profile
from hpsjax.wire import ServerError
from hpsjax.worker import (
    JoinError,
    WorkerCommand,
    WorkerConfig,
    build,
    connect,
    given_or_assigned_id,
    load_dataset,
    server_address,
    worker_target,
    write_init,
)
from hpsjax.worker import parse_worker_args as parse_args

__all__ = ["DIVERGED", "SERVER_GONE", "Evaluator", "main"]

#: Exit status of a worker whose run diverged (a non-finite loss or update);
#: ``hpsjax.launch.DIVERGED`` is the same, and never restarts such a worker.
DIVERGED = 3

#: Exit status of a worker whose server went away for longer than
#: ``--reconnect_timeout`` (said in one line).
SERVER_GONE = 4


class Evaluator:
    """The task's metrics of parameters on the dataset's held-out split.

    The split is the one every worker holds out (``--test_fraction``, seed 0),
    whole, not sharded. The metrics are the task's (``task.metrics``, averaged
    over the examples, then ``task.summarize``): a classifier's loss and
    accuracy, a language model's loss, next-token accuracy and perplexity, a
    regression's loss.

    Args:
      args: the worker's parsed flags.
      graphdef: the model's graph (:func:`hpsjax.models.split_trainable`).
      batch_stats: for a model with BatchNorm, a callable returning this
        worker's current batch statistics, which evaluation normalises with
        (``Worker.state``); ``None`` for a model without.
      task: the :class:`hpsjax.tasks.Task`; ``--task``'s when omitted.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        graphdef: Any,
        batch_stats: Callable[[], Any] | None = None,
        task: tasks.Task | None = None,
    ):
        if not args.eval_batch_size >= 1:
            raise ValueError(
                f"--eval_batch_size must be >= 1, got {args.eval_batch_size}"
            )
        self._task = tasks.get_task(args.task) if task is None else task
        self._test = load_dataset(args, test=True)
        if not len(self._test):
            raise ValueError("--eval_every needs held-out examples (--test_fraction)")
        self._batch_size = args.eval_batch_size
        task = self._task
        if batch_stats is not None:

            @jax.jit
            def stateful(params, stats, batch):
                return tasks.evaluate(task, params, graphdef, batch, batch_stats=stats)

            self._fn = lambda params, batch: stateful(params, batch_stats(), batch)
            return

        @jax.jit
        def evaluate(params, batch):
            return tasks.evaluate(task, params, graphdef, batch)

        self._fn = evaluate

    @property
    def target_metric(self) -> str:
        """The task's target metric, the first an eval line shows."""
        return self._task.target_metric

    def __call__(self, params: Any) -> dict[str, float]:
        """The task's metrics of ``params`` (``{"loss": ..., "accuracy": ...}``
        for a classifier) and ``"examples"``, their count."""
        sums: dict[str, float] = {}
        count = 0
        for batch in self._test.eval_batches(self._batch_size):
            n = len(batch.y)
            for name, value in self._fn(params, (batch[0], batch[1])).items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            count += n
        means = {name: total / count for name, total in sums.items()}
        return {**self._task.summarize(means), "examples": count}


def _eval_line(result: dict[str, float], first: str) -> str:
    """``"accuracy 0.9012, loss 0.3101"``: the target's metric first."""
    names = [first, *(k for k in result if k not in (first, "examples"))]
    return ", ".join(f"{k} {result[k]:.4f}" for k in names if k in result)


async def _evaluate(
    evaluator, watched, args, sink, t0: float, done: set, target=None, stop=None
) -> None:
    """Evaluates the last pulled parameters, once per new version; calls
    ``stop`` once ``target`` is reached."""
    if watched.latest is None:
        return
    params, version = watched.latest
    if int(version) in done:
        return
    elapsed = time.monotonic() - t0
    result = await asyncio.to_thread(evaluator, params)
    # Marked done only once evaluated: an evaluation cancelled at the end of the
    # run is made again by the final one.
    done.add(int(version))
    record = {
        "event": "eval",
        "worker": args.worker_id,
        "time": elapsed,
        "version": int(version),
        **result,
    }
    reached = target is not None and target.reached(result)
    if target is not None:
        record["target_reached"] = reached
    if sink is not None:
        sink(record)
    first = target.metric if target is not None else evaluator.target_metric
    print(
        f"hpsjax-worker eval: version {int(version)}, {_eval_line(result, first)}",
        flush=True,
    )
    if reached and stop is not None:
        print(
            f"hpsjax-worker: {target.metric} {result[target.metric]:.4f} reached "
            f"the target {target.value:g}; stopping",
            flush=True,
        )
        stop()


async def _evaluate_every(evaluator, watched, args, sink, t0, done, target, stop):
    while True:
        await asyncio.sleep(args.eval_every)
        await _evaluate(evaluator, watched, args, sink, t0, done, target, stop)


async def _serve(
    worker,
    client,
    params,
    args: argparse.Namespace,
    evaluator=None,
    sink=None,
    target=None,
) -> Any:
    loop = asyncio.get_running_loop()
    try:
        await connect(
            client,
            params,
            connect_timeout=args.connect_timeout,
            where=server_address(args),
        )
    except ServerError as e:
        # Refused on joining (another live worker's id): said in one line.
        raise JoinError(f"the server refused this worker: {e.message}") from None
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    if evaluator is None:
        return await worker.run()
    t0, done = time.monotonic(), set()
    task = asyncio.ensure_future(
        _evaluate_every(evaluator, client, args, sink, t0, done, target, worker.stop)
    )
    try:
        summary = await worker.run()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # The parameters the run ended on.
    await _evaluate(evaluator, client, args, sink, t0, done, target)
    return summary


class _OpensLater:
    """The worker's metrics sink, set once it is open (after the worker is
    built, before it runs)."""

    def __init__(self) -> None:
        self.sink: Callable[[dict], None] | None = None

    def __call__(self, record: dict) -> None:
        if self.sink is not None:
            self.sink(record)


def _tensorboard_dir(args: argparse.Namespace) -> Any:
    """Where ``--tensorboard_dir`` (or its default beside ``--metrics``) puts
    the event files, or None."""
    tensorboard = args.tensorboard_dir
    if tensorboard is None and args.metrics is not None:
        tensorboard = pathlib.Path(args.metrics).resolve().parent / "tensorboard"
    if tensorboard is not None and str(tensorboard).lower() == "none":
        tensorboard = None
    return tensorboard


def _metrics_sink(args: argparse.Namespace):
    """The sink of ``--metrics``, ``--tensorboard_dir`` and
    ``--metrics_port`` (serving from here on), or None."""
    tensorboard = _tensorboard_dir(args)
    prometheus = None
    if args.metrics_port is not None:
        prometheus = RoundMetrics()
        port = prometheus.serve(args.metrics_port)
        print(
            f"hpsjax-worker: round metrics on http://127.0.0.1:{port}/metrics",
            flush=True,
        )
    if args.metrics is None and tensorboard is None and prometheus is None:
        return None
    return MetricsWriter(
        args.metrics, tensorboard_dir=tensorboard, prometheus=prometheus
    )


def _compile_cache(args: argparse.Namespace, log: logging.Logger) -> None:
    """Points JAX at ``--compile_cache`` (or the inherited one), logged."""
    path = args.compile_cache_dir
    if path is not None and path.lower() == "none":
        return
    directory = use_compile_cache(path)
    if directory is not None:
        log.info("compilation cache: %s", directory)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``hpsjax-worker``; returns the exit status."""
    args = parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("hpsjax.worker")
    try:
        if args.metrics_port is not None:
            check_int("--metrics_port", args.metrics_port, low=0, high=65535)
        task = tasks.get_task(args.task)
        target = worker_target(args, task)
        _compile_cache(args, log)
        if args.write_init is not None:
            write_init(args, args.write_init)
            print(
                f"hpsjax-worker: wrote the initial parameters to {args.write_init}",
                flush=True,
            )
            return 0
        if args.profile_out is not None:
            try:
                print(f"hpsjax-worker: {write_worker_profile(args)}", flush=True)
            except JoinError as e:
                print(f"hpsjax-worker: {e}", file=sys.stderr)
                return 1
            return 0
        # The sink opens once the worker is built: flags refused while
        # building leave no file behind.
        wanted = args.metrics is not None or _tensorboard_dir(args) is not None
        wanted = wanted or args.metrics_port is not None
        opens_later = _OpensLater() if wanted else None
        args.worker_id = given_or_assigned_id(args)  # asks the server if not given
        worker, client, params, graphdef = build(args, metrics=opens_later, task=task)
        evaluator = None
        if args.eval_every is not None:
            stats = None if worker.state is None else (lambda: worker.state)
            evaluator = Evaluator(args, graphdef, stats, task)
        sink = _metrics_sink(args)
        if opens_later is not None:
            opens_later.sink = sink
    except JoinError as e:  # no server to assign an id
        print(f"hpsjax-worker: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        message = flag_message(str(e), WorkerCommand, WorkerConfig)
        print(f"hpsjax-worker: {message}", file=sys.stderr)
        return 2
    runner = asyncio.run
    if args.loop in ("auto", "uvloop"):
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            if args.loop == "uvloop":
                print("hpsjax-worker: uvloop is not installed", file=sys.stderr)
                return 2
    try:
        summary = runner(_serve(worker, client, params, args, evaluator, sink, target))
    except JoinError as e:
        print(f"hpsjax-worker: {e}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("worker %s failed", args.worker_id)
        return 1
    finally:
        if sink is not None:
            sink.close()
    if summary.ended_by == "diverged":
        return DIVERGED  # the worker said so in one line
    if summary.ended_by == "server":
        return SERVER_GONE  # as it said
    print(f"hpsjax-worker done: {json.dumps(summary._asdict())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
