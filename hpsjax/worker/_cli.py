"""``hpsjax-worker``: run one training worker from the command line.

The worker builds its model and its shard of the data from flags, pulls the
parameters from an ``hpsjax-server``, and trains until ``--max_steps``,
``--max_seconds`` or ``--until_version`` (or SIGINT/SIGTERM, after which it
finishes its round and pushes it). The server's initial parameters must be the
same model: ``--write_init`` writes them for ``hpsjax-server --init``::

    hpsjax-worker --model mlp --write_init init.npz
    hpsjax-server --init init.npz --secret_file secret.txt --policy bsp --port 5555
    hpsjax-worker --host 127.0.0.1 --port 5555 --secret_file secret.txt \\
        --worker_id 0 --shard_index 0 --shard_count 2 --batch_size 64 \\
        --max_steps 300 --metrics w0.jsonl

A model split over several server shards (``hpsjax-server --server_shard I
--server_shards N``) takes every shard's address, in shard order, instead of
``--host``/``--port``: ``--servers hostA:5555,hostB:5555`` (and
``--split_leaves`` when the servers have it). The worker then talks to all
shards at once through a :class:`hpsjax.ps.ShardedClient`.

Heterogeneity is injected with ``--slowdown 4`` (or a schedule
``--slowdown 0:1,60:4``: four times slower after a minute), ``--bandwidth 1e6``
(bytes/s) and ``--latency 0.002``. ``--profile_out`` runs the profiling pass
instead of training and writes the worker's profile (JSON, slowdown applied) for
:func:`hpsjax.profiling.plan`; ``--work_plan`` then reads the plan.

``--model`` takes a built-in name or any flax model's factory,
``my_pkg.my_module:make_model`` (importable from the working directory or
``PYTHONPATH``; the contract is :func:`hpsjax.models.resolve_model`'s), and
``--model_arg`` its keyword arguments. ``--metrics w0.jsonl`` also writes
TensorBoard event files (``tensorboard/worker<id>`` beside it, or
``--tensorboard_dir``), and ``--eval_every 30`` adds the test accuracy of the
last pulled parameters, on the dataset's held-out split, every 30 seconds
(``"eval"`` records).

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
import typing
from collections.abc import Callable, Sequence
from typing import Any

from hpsjax import data, models
from hpsjax._config_flags import add_flags, config_kwargs
from hpsjax._flags import HelpFormatter, add_key_value_flag, check_kwargs
from hpsjax._logs import LOG_LEVELS, check_log_level, setup_logging
from hpsjax._optimizers import OPTIMIZERS
from hpsjax.worker._runtime import Worker, WorkerConfig

__all__ = [
    "DIVERGED",
    "SERVER_GONE",
    "Evaluator",
    "build_worker",
    "main",
    "measure_step",
    "parse_args",
    "with_injection",
    "write_init",
    "write_profile",
]

#: Exit status of a worker whose run diverged (a non-finite loss or update);
#: ``hpsjax.launch.DIVERGED`` is the same, and never restarts such a worker.
DIVERGED = 3

#: Exit status of a worker whose server went away for longer than
#: ``--reconnect_timeout`` (said in one line).
SERVER_GONE = 4

# Model arguments the registry's factories set from the data, not from flags.
_MODEL_SHAPE_ARGS = (
    "self", "input_shape", "in_features", "in_channels", "image_size",
    "num_classes", "rngs",
)  # fmt: skip


def _addresses(text: str) -> list[tuple[str, int]]:
    """``"hostA:5555,[::1]:5556"`` as ``[("hostA", 5555), ("::1", 5556)]``."""
    out = []
    for item in text.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {item!r}")
        out.append((host, int(port)))
    return out


_GROUPS = {
    "server": "server",
    "data": "model and data",
    "work": "work",
    "faults": "heterogeneity and faults",
    "outputs": "outputs",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line (see the module docstring).

    The flags of :class:`~hpsjax.worker.WorkerConfig`'s fields (``--local_steps``,
    ``--overlap``, ``--ignore_hints``, ...) are made from the fields
    (:mod:`hpsjax._config_flags`); the others are the command's own.
    """
    p = argparse.ArgumentParser(
        prog="hpsjax-worker",
        description="Run an hpsjax training worker.",
        formatter_class=HelpFormatter,
    )
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    g = groups["server"]
    g.add_argument("--port", type=int, help="server port")
    g.add_argument(
        "--servers",
        type=_addresses,
        metavar="HOST:PORT,...",
        help="the server shards' addresses in shard order (instead of "
        "--host/--port): the model is split over them by key range",
    )
    g.add_argument(
        "--split_leaves",
        action="store_true",
        help="with --servers: the shards cut arrays by rows (as the servers' "
        "--split_leaves)",
    )
    g.add_argument("--secret_file", help="file holding the shared secret")
    g.add_argument("--cafile", help="CA certificates (PEM) to verify a TLS server")
    g.add_argument("--server_hostname", help="name to check the certificate for")
    g.add_argument(
        "--connect_timeout",
        type=float,
        default=30.0,
        help="seconds to keep retrying (with backoff) a server that is not up yet",
    )

    g = groups["data"]
    g.add_argument(
        "--model",
        default="mlp",
        help=f"model: {', '.join(sorted(models.MODELS))} or package.module:factory",
    )
    add_key_value_flag(g, "--model_arg", "model argument (JSON value)")
    g.add_argument(
        "--model_seed",
        type=int,
        default=0,
        help="seed of the initial weights (for --write_init)",
    )
    g.add_argument(
        "--dataset",
        default="synthetic_digits",
        help=f"dataset: {', '.join(sorted(data.DATASETS))}",
    )
    g.add_argument(
        "--data_path",
        metavar="FILE.npz",
        help="with --dataset npz: your data, an .npz file of arrays x (inputs, "
        "a leading example axis) and y (integer labels), e.g. written by "
        "np.savez(path, x=images, y=labels)",
    )
    add_key_value_flag(g, "--dataset_arg", "dataset argument (JSON value)")
    g.add_argument(
        "--test_fraction",
        type=float,
        default=0.2,
        help="share held out from training (same split on every worker)",
    )
    g.add_argument("--shard_index", type=int, help="this worker's shard")
    g.add_argument("--shard_count", type=int, default=1, help="number of shards")
    g.add_argument(
        "--data_seed",
        type=int,
        help="shuffle seed of this worker's batches (default: its shard index)",
    )

    g = groups["work"]
    g.add_argument("--work_plan", help="WorkPlan JSON file (sets batch, steps, lr)")
    g.add_argument(
        "--local_optimizer",
        default="none",
        help="optimizer of local steps: none (push gradients), or any optimizer "
        f"by name: {', '.join(OPTIMIZERS)}, or any optax optimizer (adamw, lion, "
        "muon, ...)",
    )
    add_key_value_flag(
        g,
        "--local_optimizer_arg",
        "keyword argument of the local optimizer (JSON value), repeatable: "
        "weight_decay=0.01 (adamw), momentum=0.5 (sgd)",
    )
    g.add_argument(
        "--local_learning_rate", type=float, default=0.1, help="local step size"
    )

    g = groups["faults"]
    g.add_argument(
        "--slowdown",
        default="1",
        help="slowdown factor k >= 1, or a schedule 't0:k0,t1:k1'",
    )
    g.add_argument(
        "--bandwidth",
        default="none",
        help="link cap in bytes/s (none: no cap), or a schedule",
    )
    g.add_argument("--latency", type=float, default=0.0, help="seconds per message")

    g = groups["outputs"]
    g.add_argument("--metrics", help="append per-round metrics (JSON lines) here")
    g.add_argument(
        "--tensorboard_dir",
        help="TensorBoard event files of the metrics (default: tensorboard/ "
        "beside --metrics; none: no event files)",
    )
    g.add_argument(
        "--eval_every",
        type=float,
        metavar="SECONDS",
        help="evaluate the pulled parameters on the held-out split this often "
        "(an eval record, and a line on stdout)",
    )
    g.add_argument(
        "--eval_batch_size", type=int, default=256, help="examples per eval batch"
    )
    g.add_argument(
        "--write_init",
        metavar="PATH",
        help="write the model's initial parameters (.npz) and exit",
    )
    g.add_argument(
        "--profile_out",
        metavar="PATH",
        help="run the profiling pass, write the profile JSON and exit",
    )
    g.add_argument(
        "--profile_batch_sizes",
        default="16,64,256",
        help="batch sizes the profiling pass measures",
    )
    g.add_argument(
        "--profile_repeats",
        type=int,
        default=10,
        help="timed steps per batch size (the median is kept)",
    )
    g.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="event loop (auto: uvloop when installed)",
    )
    g.add_argument(
        "--compile_cache_dir",
        metavar="PATH",
        help="JAX's persistent compilation cache, shared with the run's other "
        "processes so a step is compiled once (default: $JAX_COMPILATION_CACHE_DIR, "
        "which hpsjax-launch sets to <workdir>/jax_cache; unset: no cache; none: "
        "no cache)",
    )
    g.add_argument(
        "--log_level",
        default="INFO",
        type=check_log_level,
        help=f"{', '.join(LOG_LEVELS)} (DEBUG: also the libraries' INFO lines)",
    )
    g.add_argument(
        "--status_interval",
        type=float,
        default=10.0,
        help="seconds between status lines (step, rate, loss, staleness, time "
        "left; a bar on a terminal), 0: none",
    )
    add_flags(p, WorkerConfig, groups)
    return p.parse_args(argv)


def _dataset(args: argparse.Namespace, *, test: bool = False):
    """The training split, or the held-out split with ``test``."""
    kwargs = dict(args.dataset_arg)
    if args.data_path is not None:
        if args.dataset != "npz":
            raise ValueError(
                f"--data_path is the file of --dataset npz, not of --dataset "
                f"{args.dataset}"
            )
        if "path" in kwargs:
            raise ValueError("give --data_path or --dataset_arg path=..., not both")
        kwargs["path"] = args.data_path
    elif args.dataset == "npz" and "path" not in kwargs:
        raise ValueError(
            "--dataset npz needs --data_path FILE.npz (arrays x and y, as "
            "np.savez(path, x=inputs, y=labels) writes)"
        )
    if args.dataset in data.DATASETS:
        loader = data.DATASETS[args.dataset]
        check_kwargs(loader, kwargs, "--dataset_arg", what=f"dataset {args.dataset!r}")
    dataset = data.get_dataset(args.dataset, **kwargs)
    train, held_out = dataset.split(args.test_fraction, seed=0)
    return held_out if test else train


def _model(args: argparse.Namespace, train):
    if ":" in args.model:
        return models.resolve_model(
            args.model,
            input_shape=train.input_shape,
            seed=args.model_seed,
            **dict(args.model_arg),
        ).model
    if args.model in models.MODELS:
        # The registry's factories build a class from the data's shapes; the
        # flags give the class's other arguments.
        factory = models.MODELS[args.model]
        built = typing.get_type_hints(factory).get("return", factory)
        check_kwargs(
            built.__init__ if isinstance(built, type) else built,
            dict(args.model_arg),
            "--model_arg",
            what=f"model {args.model!r}",
            skip=_MODEL_SHAPE_ARGS,
        )
    return models.get_model(
        args.model,
        input_shape=train.input_shape,
        num_classes=train.num_classes,
        seed=args.model_seed,
        **dict(args.model_arg),
    )


def write_init(args: argparse.Namespace, path: str | pathlib.Path) -> None:
    """Writes the initial parameters of the flags' model for ``hpsjax-server``.

    The format of :func:`hpsjax.models.save_params_npz`, which
    ``hpsjax-server --init`` reads.
    """
    _, params, _ = models.split_trainable(_model(args, _dataset(args)))
    models.save_params_npz(path, params)


def _heterogeneity(args: argparse.Namespace):
    from hpsjax.worker._hetero import Heterogeneity

    return Heterogeneity(
        slowdown=args.slowdown, bandwidth=args.bandwidth, latency=args.latency
    )


def _secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    secret = pathlib.Path(path).read_bytes().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def _ssl(args: argparse.Namespace):
    if args.cafile is None:
        if args.server_hostname is not None:
            raise ValueError("--server_hostname needs --cafile (TLS)")
        return None
    import ssl

    return ssl.create_default_context(cafile=args.cafile)


def _local_optimizer(args: argparse.Namespace):
    from hpsjax._optimizers import make_optimizer

    lr = args.local_learning_rate
    if not lr > 0:
        raise ValueError(f"--local_learning_rate must be > 0, got {lr}")
    kwargs = dict(args.local_optimizer_arg)
    if args.local_optimizer == "none":
        if kwargs:
            raise ValueError("--local_optimizer_arg needs a --local_optimizer")
        return None
    return make_optimizer(args.local_optimizer, lr, **kwargs)


def _shard(args: argparse.Namespace) -> tuple[int, int]:
    index, count = args.shard_index, args.shard_count
    if count < 1:
        raise ValueError(f"--shard_count must be >= 1, got {count}")
    derived = index is None
    if derived:
        index = args.worker_id if isinstance(args.worker_id, int) else 0
    if not 0 <= index < count:
        source = " (taken from --worker_id; pass --shard_index)" if derived else ""
        raise ValueError(f"--shard_index must be in [0, {count}), got {index}{source}")
    return index, count


def _train_shard(args: argparse.Namespace, work_plan, index: int, count: int):
    """This worker's training data: its share of them where the plan gives
    every worker a ``data_share`` (ASHL's reference), else shard ``index`` of
    ``count``."""
    data = _dataset(args)
    if work_plan is not None and all(
        w.data_share is not None for w in work_plan.workers
    ):
        work_plan.worker(args.worker_id)  # raises for a worker not in it
        ids = [w.worker_id for w in work_plan.workers]
        position = ids.index(args.worker_id)
        shares = [w.data_share for w in work_plan.workers]
        return data.shard_by_shares(shares, position)
    return data.shard(count, index)


def build_worker(args: argparse.Namespace, *, metrics=None):
    """The :class:`~hpsjax.worker.Worker` the parsed flags describe.

    Its client (a :class:`~hpsjax.ps.Client`, or a
    :class:`~hpsjax.ps.ShardedClient` with ``--servers``) is built here, TLS
    name included, and not connected yet.

    Raises:
      ValueError: bad or inconsistent flags.
    """
    return _build(args, metrics=metrics)[0]


class _Watched:
    """A client that keeps the last parameters it pulled, for evaluation.

    Everything else goes to the client it wraps.
    """

    def __init__(self, client: Any):
        self._client = client
        self.latest: tuple[Any, int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def pull(self, **kwargs: Any):
        params, version = await self._client.pull(**kwargs)
        self.latest = (params, version)
        return params, version

    async def push_pull(self, *args: Any, **kwargs: Any):
        result, params, version = await self._client.push_pull(*args, **kwargs)
        self.latest = (params, version)
        return result, params, version


class Evaluator:
    """Test loss and accuracy of parameters on the dataset's held-out split.

    The split is the one every worker holds out (``--test_fraction``, seed 0),
    whole, not sharded.

    Args:
      args: the worker's parsed flags.
      graphdef: the model's graph (:func:`hpsjax.models.split_trainable`).
      batch_stats: for a model with BatchNorm, a callable returning this
        worker's current batch statistics, which evaluation normalises with
        (``Worker.state``); ``None`` for a model without.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        graphdef: Any,
        batch_stats: Callable[[], Any] | None = None,
    ):
        import jax

        if not args.eval_batch_size >= 1:
            raise ValueError(
                f"--eval_batch_size must be >= 1, got {args.eval_batch_size}"
            )
        self._test = _dataset(args, test=True)
        if not len(self._test):
            raise ValueError("--eval_every needs held-out examples (--test_fraction)")
        self._batch_size = args.eval_batch_size
        if batch_stats is not None:
            evaluate = models.make_stateful_train_functions(graphdef).evaluate

            def stateful(params, batch):
                result = evaluate(params, batch_stats(), (batch[0], batch[1]))
                return result["loss"], result["accuracy"]

            self._fn = stateful
            return

        def losses(params, batch):
            return (
                models.loss_fn(params, graphdef, batch),
                models.accuracy(params, graphdef, batch),
            )

        self._fn = jax.jit(losses)

    def __call__(self, params: Any) -> dict[str, float]:
        """``{"loss": ..., "accuracy": ..., "examples": n}`` of ``params``."""
        loss = accuracy = 0.0
        count = 0
        for batch in self._test.eval_batches(self._batch_size):
            batch_loss, batch_accuracy = self._fn(params, batch)
            n = len(batch.y)
            loss += float(batch_loss) * n
            accuracy += float(batch_accuracy) * n
            count += n
        return {"loss": loss / count, "accuracy": accuracy / count, "examples": count}


async def _evaluate(evaluator, watched, args, sink, t0: float, done: set) -> None:
    """Evaluates the last pulled parameters, once per new version."""
    import time

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
    if sink is not None:
        sink(record)
    print(
        f"hpsjax-worker eval: version {int(version)}, accuracy "
        f"{result['accuracy']:.4f}, loss {result['loss']:.4f}",
        flush=True,
    )


async def _evaluate_every(evaluator, watched, args, sink, t0, done) -> None:
    while True:
        await asyncio.sleep(args.eval_every)
        await _evaluate(evaluator, watched, args, sink, t0, done)


def _build(args: argparse.Namespace, *, metrics=None):
    """``(worker, client, params, graphdef)``: :func:`build_worker`, its client
    (which keeps the last pulled parameters with ``--eval_every``) and model."""
    from hpsjax.profiling import WorkPlan

    servers = args.servers
    if servers is not None and args.port is not None:
        raise ValueError("give --servers or --host/--port, not both")
    if servers is None:
        if args.port is None:
            raise ValueError("--port (or --servers) is required to train")
        servers = [(args.host, args.port)]
    if not args.connect_timeout >= 0:
        raise ValueError(f"--connect_timeout must be >= 0, got {args.connect_timeout}")
    if args.eager_pulls != 1 and args.overlap != "eager":
        raise ValueError("--eager_pulls needs --overlap eager")
    if args.split_leaves and len(servers) == 1:
        raise ValueError("--split_leaves needs several --servers")
    index, count = _shard(args)
    work_plan = None
    if args.work_plan is not None:
        work_plan = WorkPlan.from_json(pathlib.Path(args.work_plan).read_text())
    if args.compress_from_stage is not None and work_plan is None:
        raise ValueError("--compress_from_stage needs --work_plan (the ratio)")
    train = _train_shard(args, work_plan, index, count)
    graphdef, params, batch_stats = models.split_trainable(_model(args, train))
    if len(servers) > 1:
        client = _sharded_client(args, servers, params)
    else:
        client = _client(args, servers[0])
    if args.eval_every is not None:
        if not args.eval_every > 0:
            raise ValueError(f"--eval_every must be > 0, got {args.eval_every}")
        client = _Watched(client)
    config = WorkerConfig(
        **{
            **config_kwargs(WorkerConfig, args),
            "host": servers[0][0],
            "port": servers[0][1],
            "secret": _secret(args.secret_file),
            "work_plan": work_plan,
            "heterogeneity": _heterogeneity(args),
        }
    )
    _, batch_size, _, _ = config.planned()
    seed = index if args.data_seed is None else args.data_seed
    stream = train.batches(batch_size, seed=seed)

    if batch_stats is None:

        def loss_fn(params, batch):
            return models.per_example_loss(params, graphdef, batch)

    else:
        # BatchNorm's statistics stay on this worker (FedBN, see
        # models.split_with_batch_stats): the server sees only params.
        def loss_fn(params, stats, batch):
            return models.per_example_loss_with_stats(params, stats, graphdef, batch)

    worker = Worker(
        config,
        loss_fn=loss_fn,
        batches=stream.next,
        local_optimizer=_local_optimizer(args),
        metrics=metrics,
        ssl=_ssl(args),
        client=client,
        state=batch_stats,
        progress=_progress(args, config),
    )
    return worker, client, params, graphdef


def _progress(args: argparse.Namespace, config: Any) -> Any:
    """The status line of ``--status_interval``, or ``None``."""
    if args.status_interval < 0:
        raise ValueError(f"--status_interval must be >= 0, got {args.status_interval}")
    if not args.status_interval:
        return None
    from hpsjax._progress import Progress

    return Progress(
        f"worker {config.worker_id}",
        "step",
        total=config.max_steps,
        max_seconds=config.max_seconds,
        until_version=config.until_version,
        interval=args.status_interval,
        logger=logging.getLogger("hpsjax.worker"),
    )


def _server_tree(params):
    """``params`` in the structure ``hpsjax-server --init`` serves them in."""
    import jax

    from hpsjax._npz import nest_named_arrays

    return nest_named_arrays(
        {
            "/".join(str(getattr(k, "key", k)) for k in key_path): leaf
            for key_path, leaf in jax.tree_util.tree_leaves_with_path(params)
        }
    )


def _client(args: argparse.Namespace, server: tuple[str, int]):
    """The :class:`~hpsjax.ps.Client` of one server, TLS name included."""
    from hpsjax.ps import Client

    return Client(
        server[0],
        server[1],
        worker_id=args.worker_id,
        secret=_secret(args.secret_file),
        ssl=_ssl(args),
        server_hostname=args.server_hostname,
        timeout=args.timeout,
        seed=args.seed,
    )


def _path_name(key_path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def _leaf_specs(tree) -> dict[str, str]:
    """``{"a/b": "float32[784,256]"}`` of a tree of arrays or shape structs."""
    import jax
    import numpy as np

    return {
        _path_name(key_path): f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def spec_mismatch(params, server_spec) -> str | None:
    """The first leaf where this worker's model and the server's differ.

    Args:
      params: the worker's own parameters (its model as built from the flags).
      server_spec: the server's model, ``ServerInfo.spec``.

    Returns:
      ``None`` when paths, shapes and dtypes all agree; else one line naming
      the first differing leaf, with its shape and dtype on both sides.
    """
    mine = _leaf_specs(_server_tree(params))
    theirs = _leaf_specs(server_spec)
    for path in [*mine, *(p for p in theirs if p not in mine)]:
        here, there = mine.get(path, "nothing"), theirs.get(path, "nothing")
        if here != there:
            return (
                f"this worker's model does not match the server's at {path!r}: "
                f"the worker has {here}, the server has {there} (check --model, "
                "--model_arg and --dataset_arg against the server's --init)"
            )
    return None


def _sharded_client(args: argparse.Namespace, servers, params):
    """A :class:`~hpsjax.ps.ShardedClient` over the server shards."""
    import jax

    from hpsjax.ps import KeyRangePartition, ShardedClient

    spec = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _server_tree(params)
    )
    partition = KeyRangePartition.from_tree(
        spec, len(servers), split_leaves=args.split_leaves
    )
    # Each sends its pushes encoded as whole arrays (top-k from the stage on).
    for flag in ("bits", "powersgd_rank", "compress_from_stage"):
        if getattr(args, flag) is not None and partition.cuts_leaves:
            raise ValueError(
                f"--{flag} encodes whole arrays, but with --split_leaves the "
                "shards cut some by rows: drop one of the two"
            )
    return ShardedClient(
        servers,
        partition,
        worker_id=args.worker_id,
        secret=_secret(args.secret_file),
        ssl=_ssl(args),
        server_hostname=args.server_hostname,
        timeout=args.timeout,
        seed=args.seed,
    )


def measure_step(args: argparse.Namespace, *, pace=None):
    """Profiles the flags' train step on this machine, nothing injected.

    ``pace`` goes to :func:`hpsjax.profiling.profile` (a slowed-down worker
    profiled beside others sleeps after its steps as it will in the run).

    Returns:
      ``(profile, spec)``: the :class:`~hpsjax.profiling.WorkerProfile` (no
      transfer) and the parameters' shapes and dtypes.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from hpsjax.profiling import profile

    index, count = _shard(args)
    train = _dataset(args).shard(count, index)
    graphdef, params, stats = models.split_trainable(_model(args, train))
    stream = train.batches(1, seed=index)
    optimizer = _local_optimizer(args) or optax.sgd(1.0)

    def mean_loss(params, batch):
        if stats is None:
            return models.loss_fn(params, graphdef, batch)
        losses, _ = models.per_example_loss_with_stats(params, stats, graphdef, batch)
        return jnp.mean(losses)

    def step(params, batch):
        grads = jax.grad(lambda p: mean_loss(p, batch))(params)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    try:
        sizes = [int(s) for s in args.profile_batch_sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(
            f"--profile_batch_sizes must be integers, got {args.profile_batch_sizes!r}"
        ) from None
    measured = profile(
        step,
        params,
        lambda b: jax.tree.map(jnp.asarray, stream.next(b)),
        batch_sizes=sizes,
        repeats=args.profile_repeats,
        worker_id=args.worker_id,
        pace=pace,
    )
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return measured, spec


def with_injection(measured, args: argparse.Namespace, spec):
    """A measured profile as the flags' worker will train: slowed, linked.

    The slowdown in force at the start multiplies the step times
    (``WorkerProfile.with_slowdown``); an injected link cap or latency gives the
    transfer estimate, for pushes encoded with ``--bits`` or as the factors of
    ``--powersgd_rank`` (``powersgd_nbytes`` per leaf).

    Args:
      measured: a :class:`~hpsjax.profiling.WorkerProfile` from
        :func:`measure_step`.
      args: the worker's parsed flags.
      spec: the parameters' shapes and dtypes.

    Returns:
      The profile, with ``worker_id`` from the flags.
    """
    import dataclasses

    from hpsjax.profiling import Link, TransferProfile, tree_wire_nbytes
    from hpsjax.transforms import Codec

    het = _heterogeneity(args)
    codec = None
    if args.bits is not None:
        codec = Codec("sign" if args.bits == 1 else "uniform", args.bits)
    push_bytes = tree_wire_nbytes(spec, codec, powersgd_rank=args.powersgd_rank)
    pull_bytes = tree_wire_nbytes(spec)
    bandwidth = het.bandwidth_at(0.0)
    if bandwidth is not None:
        transfer = Link(bandwidth=bandwidth, latency=het.latency).estimate(
            push_bytes, pull_bytes
        )
    elif het.latency > 0:
        transfer = TransferProfile(
            round_trip_seconds=2 * het.latency,
            push_seconds=het.latency,
            pull_seconds=het.latency,
            push_bytes=push_bytes,
            pull_bytes=pull_bytes,
            method="estimated",
        )
    else:
        transfer = None
    return dataclasses.replace(
        measured.with_slowdown(het.slowdown_at(0.0)),
        worker_id=args.worker_id,
        transfer=transfer,
    )


def write_profile(args: argparse.Namespace, path: str | pathlib.Path) -> None:
    """Profiles the flags' worker on this machine and writes its profile (JSON)."""
    measured, spec = measure_step(args)
    pathlib.Path(path).write_text(with_injection(measured, args, spec).to_json())


class JoinError(Exception):
    """The worker could not join: the server is unreachable, refuses it, or
    serves another model (one line, for the user)."""


async def connect(client, params, *, connect_timeout: float, where: str) -> None:
    """Connects ``client``, retrying with backoff, and checks the server's model.

    Connection failures (refused, reset, timed out) are retried, 0.1 s apart
    doubling up to 2 s, for ``connect_timeout`` seconds; authentication
    failures are not. Cancelling is safe.

    Args:
      client: a :class:`~hpsjax.ps.Client` or :class:`~hpsjax.ps.ShardedClient`.
      params: this worker's own parameters, to compare with the server's model.
      connect_timeout: seconds to keep retrying.
      where: the server's address, for messages.

    Raises:
      JoinError: one line saying why the worker cannot join.
    """
    import ssl

    from hpsjax.ps import AuthError, ConnectionClosed, SpecMismatch

    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_timeout
    delay = 0.1
    while True:
        try:
            info = await client.connect()
            break
        except AuthError as e:
            raise JoinError(
                f"the server at {where} refused the secret ({e}); pass the "
                "server's --secret_file"
            ) from None
        except SpecMismatch as e:
            raise JoinError(str(e)) from None
        except ssl.SSLError as e:
            raise JoinError(f"TLS with the server at {where} failed: {e}") from None
        except (OSError, ConnectionClosed, TimeoutError) as e:
            if loop.time() + delay > deadline:
                reason = str(e) or type(e).__name__
                raise JoinError(
                    f"no server answered at {where} within --connect_timeout="
                    f"{connect_timeout:g}s ({reason})"
                ) from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)
    if hasattr(info, "spec"):  # a ShardedClient checks each shard itself
        problem = spec_mismatch(params, info.spec)
        if problem is not None:
            await client.close()
            raise JoinError(problem)


async def _serve(
    worker, client, params, args: argparse.Namespace, evaluator=None, sink=None
) -> Any:
    import time

    loop = asyncio.get_running_loop()
    await connect(
        client,
        params,
        connect_timeout=args.connect_timeout,
        where=_where(args),
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    if evaluator is None:
        return await worker.run()
    t0, done = time.monotonic(), set()
    task = asyncio.ensure_future(
        _evaluate_every(evaluator, client, args, sink, t0, done)
    )
    try:
        summary = await worker.run()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # The parameters the run ended on.
    await _evaluate(evaluator, client, args, sink, t0, done)
    return summary


def _metrics_sink(args: argparse.Namespace):
    """The sink of ``--metrics`` and ``--tensorboard_dir``, or None."""
    from hpsjax.metrics import MetricsWriter

    tensorboard = args.tensorboard_dir
    if tensorboard is None and args.metrics is not None:
        tensorboard = pathlib.Path(args.metrics).resolve().parent / "tensorboard"
    if tensorboard is not None and str(tensorboard).lower() == "none":
        tensorboard = None
    if args.metrics is None and tensorboard is None:
        return None
    return MetricsWriter(args.metrics, tensorboard_dir=tensorboard)


def _compile_cache(args: argparse.Namespace, log: logging.Logger) -> None:
    """Points JAX at ``--compile_cache_dir`` (or the inherited one), logged."""
    from hpsjax._compile_cache import use_compile_cache

    path = args.compile_cache_dir
    if path is not None and path.lower() == "none":
        return
    directory = use_compile_cache(path)
    if directory is not None:
        log.info("compilation cache: %s", directory)


def _where(args: argparse.Namespace) -> str:
    if args.servers is not None:
        return ",".join(f"{h}:{p}" for h, p in args.servers)
    return f"{args.host}:{args.port}"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``hpsjax-worker``; returns the exit status."""
    args = parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("hpsjax.worker")
    try:
        _compile_cache(args, log)
        if args.write_init is not None:
            write_init(args, args.write_init)
            print(
                f"hpsjax-worker: wrote the initial parameters to {args.write_init}",
                flush=True,
            )
            return 0
        if args.profile_out is not None:
            write_profile(args, args.profile_out)
            print(f"hpsjax-worker: wrote the profile to {args.profile_out}", flush=True)
            return 0
        sink = _metrics_sink(args)
        try:
            worker, client, params, graphdef = _build(args, metrics=sink)
            evaluator = None
            if args.eval_every is not None:
                stats = None if worker.state is None else (lambda: worker.state)
                evaluator = Evaluator(args, graphdef, stats)
        except BaseException:
            if sink is not None:
                sink.close()
            raise
    except (ValueError, OSError) as e:
        print(f"hpsjax-worker: {e}", file=sys.stderr)
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
        summary = runner(_serve(worker, client, params, args, evaluator, sink))
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
