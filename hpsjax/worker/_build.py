"""Building a worker from its parsed ``hpsjax-worker`` flags.

One place turns the flags into what a worker is made of: its data set and
shard, its model (a built-in name or a factory), its local optimizer, its
injected heterogeneity, its client (one server or several shards, TLS and
secret included) and the :class:`~hpsjax.worker.Worker` itself.
``hpsjax-worker`` (:mod:`hpsjax.cli.worker`),
the launcher's checks and work directory (:mod:`hpsjax.launch`) and the
in-place profiler (:mod:`hpsjax.profiling.in_place`) all build from here, so
a flag means the same to each of them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import ssl
import typing
from typing import Any

import jax
import numpy as np
from flax import nnx

from hpsjax import data, models, tasks
from hpsjax._config_flags import config_kwargs
from hpsjax._flags import check_kwargs
from hpsjax._npz import nest_named_arrays
from hpsjax._optimizers import make_optimizer
from hpsjax._progress import Progress
from hpsjax.net import Client, KeyRangePartition, ShardedClient, read_secret
from hpsjax.planning import WorkPlan
from hpsjax.wire import AuthError, ConnectionClosed, SpecMismatch
from hpsjax.worker._config import WorkerConfig
from hpsjax.worker._hetero import Heterogeneity
from hpsjax.worker._runtime import Worker

__all__ = [
    "JoinError",
    "Watched",
    "build",
    "build_worker",
    "check_task_fits",
    "connect",
    "data_shard",
    "leaf_specs",
    "load_dataset",
    "make_client",
    "make_heterogeneity",
    "make_local_optimizer",
    "make_model",
    "make_progress",
    "make_sharded_client",
    "make_task",
    "model_structure",
    "read_secret",
    "server_address",
    "server_tree",
    "spec_mismatch",
    "task_loss",
    "tls_context",
    "train_shard",
    "training_servers",
    "write_init",
]

# Model arguments the registry's factories set from the data, not from flags.
_MODEL_SHAPE_ARGS = (
    "self", "input_shape", "in_features", "in_channels", "image_size",
    "num_classes", "vocab_size", "seq_len", "rngs",
)  # fmt: skip


def make_task(args: argparse.Namespace) -> tasks.Task:
    """The :class:`~hpsjax.tasks.Task` of ``--task``.

    Raises:
      ValueError: an unknown task, or a factory that is missing or returns
        something else than a task (one line each).
    """
    return tasks.get_task(args.task)


def task_loss(task: tasks.Task, graphdef, batch_stats) -> Any:
    """The worker's ``loss_fn``: ``task``'s per-example losses of the model,
    ``(params, batch)``, or ``(params, stats, batch) -> (losses, stats)`` for a
    model with batch statistics (they stay on this worker, FedBN, see
    :func:`hpsjax.models.split_with_batch_stats`: the server sees only
    params)."""
    if batch_stats is None:

        def loss_fn(params, batch):
            return tasks.per_example_loss(task, params, graphdef, batch)

        return loss_fn

    def loss_with_stats(params, stats, batch):
        return tasks.per_example_loss_with_stats(task, params, stats, graphdef, batch)

    return loss_with_stats


def check_task_fits(task: tasks.Task, loss_fn, params, batch_stats, batch) -> None:
    """Traces ``loss_fn`` on one batch for shapes only (nothing is compiled or
    run), so that a task that does not fit the data or the model is refused
    before the worker starts.

    Raises:
      ValueError: one line, from the error the trace raised.
    """
    args = (params, batch) if batch_stats is None else (params, batch_stats, batch)
    try:
        out = jax.eval_shape(loss_fn, *args)
    except Exception as e:  # any failure of the user's code, said in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"task {task.name!r} does not fit the data and model: {first}"
        ) from None
    losses = out if batch_stats is None else out[0]
    b = len(batch[1])
    if getattr(losses, "shape", None) != (b,):
        raise ValueError(
            f"task {task.name!r}'s loss must give one loss per example, shape "
            f"({b},), got {getattr(losses, 'shape', type(losses).__name__)}"
        )


def load_dataset(args: argparse.Namespace, *, test: bool = False):
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


def make_model(args: argparse.Namespace, train):
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


# What a model factory may raise when it is traced for shapes only (it looks at
# a value); it is then built for real.
_NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def model_structure(args: argparse.Namespace, train):
    """``(graphdef, params, batch_stats)`` of the flags' model, for training.

    A training worker takes its parameters' values from the server when it
    joins: its own are needed only for their paths, shapes and dtypes (the
    check against the server's model, a sharded client's partition). So the
    model is built for shapes only (``nnx.eval_shape``: ``params`` holds
    ``jax.ShapeDtypeStruct`` leaves), which runs none of the initializers'
    programs: each would be compiled, or loaded from the compilation cache,
    at every start. A model with batch statistics (they stay on the worker and
    start from the model's own values) or whose factory needs values is built
    for real.
    """
    try:
        abstract = nnx.eval_shape(lambda: make_model(args, train))
    except _NEEDS_VALUES:
        abstract = None
    if abstract is not None:
        graphdef, params, batch_stats = models.split_trainable(abstract)
        if batch_stats is None:
            return graphdef, params, None
    return models.split_trainable(make_model(args, train))


def write_init(args: argparse.Namespace, path: str | pathlib.Path) -> None:
    """Writes the initial parameters of the flags' model for ``hpsjax-server``.

    The format of :func:`hpsjax.models.save_params_npz`, which
    ``hpsjax-server --init`` reads.
    """
    _, params, _ = models.split_trainable(make_model(args, load_dataset(args)))
    models.save_params_npz(path, params)


def make_heterogeneity(args: argparse.Namespace):

    return Heterogeneity(
        slowdown=args.slowdown, bandwidth=args.bandwidth, latency=args.latency
    )


def tls_context(args: argparse.Namespace):
    if args.cafile is None:
        if args.server_hostname is not None:
            raise ValueError("--server_hostname needs --cafile (TLS)")
        return None

    return ssl.create_default_context(cafile=args.cafile)


def make_local_optimizer(args: argparse.Namespace):

    lr = args.local_learning_rate
    if not lr > 0:
        raise ValueError(f"--local_learning_rate must be > 0, got {lr}")
    kwargs = dict(args.local_optimizer_arg)
    if args.local_optimizer == "none":
        if kwargs:
            raise ValueError("--local_optimizer_arg needs a --local_optimizer")
        return None
    return make_optimizer(args.local_optimizer, lr, **kwargs)


def data_shard(args: argparse.Namespace) -> tuple[int, int]:
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


def train_shard(args: argparse.Namespace, work_plan, index: int, count: int):
    """This worker's training data: its share of them where the plan gives
    every worker a ``data_share`` (ASHL's reference), else shard ``index`` of
    ``count``."""
    data = load_dataset(args)
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

    Its client (a :class:`~hpsjax.net.Client`, or a
    :class:`~hpsjax.net.ShardedClient` with ``--servers``) is built here, TLS
    name included, and not connected yet.

    Raises:
      ValueError: bad or inconsistent flags.
    """
    return build(args, metrics=metrics)[0]


class Watched:
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


def training_servers(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The servers a training worker joins, its flags' combinations checked
    (those :func:`build` and an id request share: a mistake is reported
    before any server is asked).

    Raises:
      ValueError: no server, both ``--servers`` and ``--port``, or a flag
        that needs another.
    """
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
    if args.eval_every is not None and not args.eval_every > 0:
        raise ValueError(f"--eval_every must be > 0, got {args.eval_every}")
    return list(servers)


def build(args: argparse.Namespace, *, metrics=None, task=None):
    """``(worker, client, params, graphdef)``: :func:`build_worker`, its client
    (which keeps the last pulled parameters with ``--eval_every``) and model
    (``params`` as :func:`model_structure` gives them: shapes, unless the model
    has batch statistics). ``task`` is ``--task``'s, resolved when not given."""
    task = make_task(args) if task is None else task
    servers = training_servers(args)
    index, count = data_shard(args)
    work_plan = None
    if args.work_plan is not None:
        work_plan = WorkPlan.from_json(pathlib.Path(args.work_plan).read_text())
    if args.compress_from_stage is not None and work_plan is None:
        raise ValueError("--compress_from_stage needs --work_plan (the ratio)")
    train = train_shard(args, work_plan, index, count)
    graphdef, params, batch_stats = model_structure(args, train)
    if len(servers) > 1:
        client = make_sharded_client(args, servers, params)
    else:
        client = make_client(args, servers[0])
    if args.eval_every is not None:
        client = Watched(client)
    config = WorkerConfig(
        **{
            **config_kwargs(WorkerConfig, args),
            "host": servers[0][0],
            "port": servers[0][1],
            "secret": read_secret(args.secret_file),
            "work_plan": work_plan,
            "heterogeneity": make_heterogeneity(args),
        }
    )
    _, batch_size, _, _ = config.planned()
    seed = index if args.data_seed is None else args.data_seed
    stream = train.batches(batch_size, seed=seed)
    loss_fn = task_loss(task, graphdef, batch_stats)
    check_task_fits(task, loss_fn, params, batch_stats, train.batches(2, seed=0).next())
    worker = Worker(
        config,
        loss_fn=loss_fn,
        batches=stream.next,
        local_optimizer=make_local_optimizer(args),
        metrics=metrics,
        ssl=tls_context(args),
        client=client,
        state=batch_stats,
        progress=make_progress(args, config),
        tokens_per_example=task.tokens_per_example(train),
    )
    return worker, client, params, graphdef


def make_progress(args: argparse.Namespace, config: Any) -> Any:
    """The status line of ``--status_interval``, or ``None``."""
    if args.status_interval < 0:
        raise ValueError(f"--status_interval must be >= 0, got {args.status_interval}")
    if not args.status_interval:
        return None

    return Progress(
        f"worker {config.worker_id}",
        "step",
        total=config.max_steps,
        max_seconds=config.max_seconds,
        until_version=config.until_version,
        interval=args.status_interval,
        logger=logging.getLogger("hpsjax.worker"),
    )


def server_tree(params):
    """``params`` in the structure ``hpsjax-server --init`` serves them in."""

    return nest_named_arrays(
        {
            "/".join(str(getattr(k, "key", k)) for k in key_path): leaf
            for key_path, leaf in jax.tree_util.tree_leaves_with_path(params)
        }
    )


def make_client(args: argparse.Namespace, server: tuple[str, int]):
    """The :class:`~hpsjax.net.Client` of one server, TLS name included."""

    return Client(server[0], server[1], **_connection_kwargs(args))


def _connection_kwargs(args: argparse.Namespace) -> dict:
    """What every client of the flags connects with: identity, secret, TLS,
    timeout and its random seed."""
    return dict(
        worker_id=args.worker_id,
        secret=read_secret(args.secret_file),
        ssl=tls_context(args),
        server_hostname=args.server_hostname,
        timeout=args.timeout,
        seed=args.seed,
    )


def _path_name(key_path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def leaf_specs(tree) -> dict[str, str]:
    """``{"a/b": "float32[784,256]"}`` of a tree of arrays or shape structs."""

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
    mine = leaf_specs(server_tree(params))
    theirs = leaf_specs(server_spec)
    for path in [*mine, *(p for p in theirs if p not in mine)]:
        here, there = mine.get(path, "nothing"), theirs.get(path, "nothing")
        if here != there:
            return (
                f"this worker's model does not match the server's at {path!r}: "
                f"the worker has {here}, the server has {there} (check --model, "
                "--model_arg and --dataset_arg against the server's --init)"
            )
    return None


def make_sharded_client(args: argparse.Namespace, servers, params):
    """A :class:`~hpsjax.net.ShardedClient` over the server shards."""

    spec = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), server_tree(params)
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
    return ShardedClient(servers, partition, **_connection_kwargs(args))


class JoinError(Exception):
    """The worker could not join: the server is unreachable, refuses it, or
    serves another model (one line, for the user)."""


async def connect(client, params, *, connect_timeout: float, where: str) -> None:
    """Connects ``client``, retrying with backoff, and checks the server's model.

    Connection failures (refused, reset, timed out) are retried, 0.1 s apart
    doubling up to 2 s, for ``connect_timeout`` seconds; authentication
    failures are not. Cancelling is safe.

    Args:
      client: a :class:`~hpsjax.net.Client` or :class:`~hpsjax.net.ShardedClient`.
      params: this worker's own parameters, to compare with the server's
        model (``None``: not compared).
      connect_timeout: seconds to keep retrying.
      where: the server's address, for messages.

    Raises:
      JoinError: one line saying why the worker cannot join.
    """

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
    # A ShardedClient checks each shard itself.
    if params is not None and hasattr(info, "spec"):
        problem = spec_mismatch(params, info.spec)
        if problem is not None:
            await client.close()
            raise JoinError(problem)


def server_address(args: argparse.Namespace) -> str:
    if args.servers is not None:
        return ",".join(f"{h}:{p}" for h, p in args.servers)
    return f"{args.host}:{args.port}"
