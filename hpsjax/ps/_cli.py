"""``hpsjax-server``: run a parameter server from the command line.

The server needs the model's initial parameters: pass them as an ``.npz`` file of
named arrays (:func:`hpsjax.models.save_params_npz` writes one; so does
``hpsjax-worker --write_init``). A name with ``/`` in it makes nested
dictionaries, so ``{"conv1/kernel": k, "conv1/bias": b, "dense/kernel": d}``
serves ``{"conv1": {"kernel": k, "bias": b}, "dense": {"kernel": d}}``, the
structure workers push and pull. Or build them from the model itself with
``--init_from MODEL`` (a built-in name, sized by ``--dataset``, or
``my_pkg.my_module:make_model``, see :func:`hpsjax.models.resolve_model`), with
the workers' ``--model_arg`` and ``--model_seed``. Example::

    python -c "import numpy as np; from hpsjax.models import save_params_npz; \\
        save_params_npz('init.npz', {'w': np.zeros(10, np.float32)})"
    head -c 32 /dev/urandom | base64 > secret.txt
    hpsjax-server --init init.npz --secret_file secret.txt --policy ssp \\
        --policy_arg staleness_bound=2 --optimizer sgd --learning_rate 0.1 \\
        --host 0.0.0.0 --port 5555 --checkpoint_dir ckpt --checkpoint_every_s 60

It prints ``hpsjax-server listening on HOST:PORT`` once it accepts connections
(with ``--port 0`` the port is picked by the system), and stops gracefully on
SIGINT or SIGTERM, writing a final checkpoint. With ``--checkpoint_dir`` it
resumes from the newest checkpoint there, so a restarted server continues where
the last committed checkpoint left off.

``--policy`` takes a policy or a scheme (:data:`hpsjax.config.RUN_SCHEMES`:
``hps`` is ``bsp`` with workers pushing 8 bits, ``ashl`` is ``hybrid`` with
ASHL's stages, ...); the server prints the policy and the worker flags a
scheme stands for. Policy options are ``--policy_arg KEY=JSON``, one keyword
argument of the policy each (given with a scheme, they replace its own). The
hybrid policy takes its stages as a JSON list of objects with ``mode``
(``async``, ``semi_async`` or ``sync``) and optional ``local_steps``,
``max_staleness`` and ``until_version`` (:class:`hpsjax.ps.HybridStage`)::

    hpsjax-server ... --policy hybrid --policy_arg 'stages=[
        {"mode": "async", "local_steps": 8, "max_staleness": 16, "until_version": 100},
        {"mode": "semi_async", "local_steps": 1, "max_staleness": 2}]'

SaPS (``--policy saps --policy_arg threshold=4``) damps or drops a push more
than ``threshold`` versions stale and forces its worker to pull (the
``force_pull`` of its PUSH_ACK).

With ``--work_plan plan.json`` (a :class:`hpsjax.planning.WorkPlan`) the server
sends each worker its share of the plan when it joins and re-plans (H-PS) when a
worker's reported step times drift from the plan by more than
``--replan_threshold``: a worker that slows down gets a smaller batch.

With ``--pilot SCHEME --global_batch N --expected_workers K`` the plan is made
from the run itself (:class:`hpsjax.profiling.Pilot`), with no profile: the
workers (``--worker_id 0`` to ``K-1``, on any host) start on an even split of
``N``, run real training rounds at two or more batches each while the server
fits each worker's step and link, and then get the scheme's plan, re-planned as
above.

A model too big for one server is split by key range over several server
processes (:class:`hpsjax.ps.KeyRangePartition`): start one per shard from the
same ``--init`` file with ``--server_shard I --server_shards N``; each reads only
its own arrays (or rows, with ``--split_leaves``), checkpoints under
``CHECKPOINT_DIR/shard_I_of_N``, and prints which keys it holds. Workers then
take every shard's address in order, ``hpsjax-worker --servers
hostA:5555,hostB:5555``. Give ``--work_plan`` to shard 0 only: its plan is the
one the workers follow.

``--metrics_port P`` serves the server's metrics to Prometheus on
``http://HOST:P/metrics`` (:class:`hpsjax.metrics.ServerMetrics`: version,
pushes and pulls, staleness histogram, barrier waits, live and dropped workers,
bytes in and out, apply time, checkpoint age).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import math
import os
import pathlib
import signal
import ssl
import sys
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import numpy.lib.format as npy_format

from hpsjax import data, models
from hpsjax._config_flags import flag_message
from hpsjax._devices import resolve_device
from hpsjax._logs import setup_logging
from hpsjax._npz import check_params_file, nest_named_arrays
from hpsjax._optimizers import make_optimizer
from hpsjax.decisions import HybridStage
from hpsjax.export import check_export_path, export_params
from hpsjax.metrics import ServerMetrics
from hpsjax.net import KeyRangePartition, Server, read_secret
from hpsjax.profiling import Pilot, Replanner, WorkPlan
from hpsjax.ps._options import ServerOptions, parse_args, server_options

__all__ = [
    "keep_freed_memory",
    "load_npz_shard",
    "initial_params",
    "load_npz_tree",
    "main",
    "make_optimizer",
    "nest_named_arrays",
    "parse_args",
    "server_options",
]


def load_npz_tree(path: str | pathlib.Path) -> dict[str, Any]:
    """Loads an ``.npz`` file of named arrays as a nested dict.

    :func:`hpsjax.models.load_params_npz`, with a hint on how to write such a
    file when ``path`` is not one. Object arrays are refused: loading never
    executes code.

    Raises:
      ValueError: not an ``.npz`` file, no arrays, two names that clash
        (``a`` and ``a/b``), or a file without the parameters' format marker
        (a data set, say: :func:`hpsjax._npz.check_params_file`).

    Examples:
      >>> import tempfile, os
      >>> from hpsjax.models import save_params_npz
      >>> with tempfile.TemporaryDirectory() as d:
      ...     f = os.path.join(d, "p.npz")
      ...     save_params_npz(f, {"conv": {"w": np.ones(2)}, "b": np.zeros(1)})
      ...     tree = load_npz_tree(f)
      >>> sorted(tree), sorted(tree["conv"])
      (['b', 'conv'], ['w'])
    """
    _check_is_npz(path)
    return models.load_params_npz(path)


def _check_is_npz(path: str | pathlib.Path) -> None:
    check_params_file(path)


class _NpzMember:
    """One array of an ``.npz`` file, read when asked: whole, or some rows.

    Has the ``shape`` and ``dtype`` a :class:`~hpsjax.ps.KeyRangePartition`
    reads, and slicing by rows, so a server shard reads only its rows.
    """

    def __init__(self, path, member, shape, dtype, fortran_order, offset):
        self._path = path
        self._member = member
        self.shape = shape
        self.dtype = dtype
        self._fortran_order = fortran_order
        self._offset = offset

    def load(self) -> np.ndarray:
        with np.load(self._path, allow_pickle=False) as data:
            return data[self._member[: -len(".npy")]]

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1 or self._fortran_order:
            return np.ascontiguousarray(self.load()[rows])
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        out = np.empty((max(stop - start, 0), *self.shape[1:]), self.dtype)
        view = memoryview(out).cast("B")
        with zipfile.ZipFile(self._path) as archive, archive.open(self._member) as f:
            f.seek(self._offset + start * row_bytes)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self._path}: {self._member} is truncated")
                done += n
        return out


def _read_npz_members(path: str | pathlib.Path) -> dict[str, _NpzMember]:
    members = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as f:
                version = npy_format.read_magic(f)
                if version == (1, 0):
                    header = npy_format.read_array_header_1_0(f)
                elif version == (2, 0):
                    header = npy_format.read_array_header_2_0(f)
                else:
                    raise ValueError(
                        f"{path}: {info.filename} has .npy version {version}; "
                        "write it with numpy.savez"
                    )
                shape, fortran_order, dtype = header
                if dtype.hasobject:
                    raise ValueError(
                        f"{path}: {info.filename} holds objects, which are never "
                        "unpickled (allow_pickle=False)"
                    )
                members[info.filename[: -len(".npy")]] = _NpzMember(
                    path, info.filename, shape, dtype, fortran_order, f.tell()
                )
    return members


def load_npz_shard(
    path: str | pathlib.Path,
    shard: int,
    num_shards: int,
    *,
    split_leaves: bool = False,
):
    """Loads one server shard's key range of an ``.npz`` file of named arrays.

    The partition (:class:`~hpsjax.ps.KeyRangePartition`) is computed from the
    arrays' names, shapes and dtypes alone (read from the file's headers), the
    same for every shard and every worker; then only the shard's arrays, or rows
    of them, are read.

    Args:
      path: the ``.npz`` file (as for :func:`load_npz_tree`).
      shard: this shard's index, in ``[0, num_shards)``.
      num_shards: the number of server shards.
      split_leaves: make rows the keys, so a big array may be cut by rows.

    Returns:
      ``(sub_tree, partition)``: the shard's nested dict of arrays and the
      :class:`~hpsjax.ps.KeyRangePartition`.

    Raises:
      ValueError: bad names (as :func:`load_npz_tree`), object arrays, a bad
        shard index, or more shards than arrays (or rows).
    """
    _check_is_npz(path)
    lazy = nest_named_arrays(_read_npz_members(path), path)
    partition = KeyRangePartition.from_tree(lazy, num_shards, split_leaves=split_leaves)
    if not 0 <= shard < num_shards:
        raise ValueError(f"--server_shard must be in [0, {num_shards}), got {shard}")
    sub_tree = partition.split(lazy)[shard]
    return _load_members(sub_tree), partition


def _load_members(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _load_members(child) for key, child in node.items()}
    return node.load() if isinstance(node, _NpzMember) else node


def initial_params(
    model: str,
    *,
    model_args: Mapping[str, Any] | None = None,
    seed: int = 0,
    dataset: str = "synthetic_digits",
    dataset_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The initial parameters of a model, as ``hpsjax-worker`` builds it.

    The same as ``hpsjax-worker --model MODEL --write_init`` writes, so a
    server started with ``--init_from`` serves the workers' model.

    Args:
      model: a built-in name (sized by ``dataset``'s examples and classes) or
        ``"package.module:factory"`` (:func:`hpsjax.models.resolve_model`).
      model_args: further arguments of the model or factory.
      seed: seed of the initial weights.
      dataset: the dataset that sizes a built-in model.
      dataset_args: its arguments.

    Returns:
      The nested dict of numpy arrays.

    Raises:
      ValueError: an unknown model or dataset, or bad arguments.
    """
    input_shape = num_classes = None
    if ":" not in model:
        loaded = data.get_dataset(dataset, **dict(dataset_args or {}))
        input_shape, num_classes = loaded.input_shape, loaded.num_classes
    resolved = models.resolve_model(
        model,
        input_shape=input_shape,
        num_classes=num_classes,
        seed=seed,
        **dict(model_args or {}),
    )
    _, params, _ = models.split_trainable(resolved.model)
    return jax.tree.map(np.asarray, params)


# mallopt parameters of glibc (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory for reuse instead of returning it.

    Every optimizer step allocates a new copy of the parameters; by default
    glibc serves big blocks with fresh pages from the kernel and hands freed ones
    back, so each step pays a page fault per 4 KiB of the model (on some virtual
    machines more than the step's arithmetic). One arena, no mmap for big
    blocks and no trimming let the next step reuse the memory the previous one
    freed. The price: the process keeps its peak memory. Must run before JAX
    starts its threads (their arenas are made on their first allocation).

    Returns:
      Whether the settings were applied (glibc on Linux only).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_ARENA_MAX, 1)
    ok &= mallopt(_M_MMAP_THRESHOLD, 2**30)
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**62)
    return bool(ok)


def _tls_context(certfile: str | None, keyfile: str | None):
    if certfile is None:
        return None  # a key without a certificate: refused by ServerOptions
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


def _params_and_checkpoints(options: ServerOptions) -> tuple[Any, str | None]:
    """This server's parameters (its shard's) and checkpoint directory."""
    shard, num_shards = options.shard()
    checkpoint_dir = options.checkpoint_dir
    if options.init_from is not None:
        params = initial_params(
            options.init_from,
            model_args=options.model_arg,
            seed=options.model_seed,
            dataset=options.dataset,
            dataset_args=options.dataset_kwargs(),
        )
    if num_shards == 1:
        if options.init is not None:
            params = load_npz_tree(options.init)
        return params, checkpoint_dir
    if options.init is not None:
        params, partition = load_npz_shard(
            options.init, shard, num_shards, split_leaves=options.split_leaves
        )
    else:
        partition = KeyRangePartition.from_tree(
            params, num_shards, split_leaves=options.split_leaves
        )
        params = partition.split(params)[shard]
    if checkpoint_dir is not None:
        # Shards may share a file system: each keeps its own checkpoints.
        checkpoint_dir = str(
            pathlib.Path(checkpoint_dir) / f"shard_{shard}_of_{num_shards}"
        )
    print(f"hpsjax-server {partition.describe(shard)}", flush=True)
    return params, checkpoint_dir


def _policy_kwargs(options: ServerOptions) -> dict[str, Any]:
    """The scheme's and ``--policy_arg``'s values, hybrid stages given as
    objects made stages."""
    policy_kwargs = options.policy_kwargs()
    if options.scheme().policy == "hybrid" and isinstance(
        policy_kwargs.get("stages"), list
    ):
        # JSON has no HybridStage: stages come as objects of its fields.
        try:
            policy_kwargs["stages"] = [
                s if not isinstance(s, dict) else HybridStage(**s)
                for s in policy_kwargs["stages"]
            ]
        except TypeError as e:
            raise ValueError(f"bad hybrid stage: {e}") from None
    return policy_kwargs


def _replanner(options: ServerOptions) -> Replanner | None:
    """The re-planner of ``--work_plan``, the pilot of ``--pilot``, or ``None``."""
    if options.pilot is not None:
        return Pilot(
            list(range(options.expected_workers)),
            options.global_batch,
            options.pilot,
            tolerance=options.pilot_tolerance,
            batch_sizes=options.pilot_sizes(),
            balance_rounds=options.pilot_balance,
            threshold=options.replan_threshold,
            window=options.replan_window,
            cooldown=options.replan_cooldown,
        )
    if options.work_plan is None:
        return None
    try:
        plan = WorkPlan.from_json(pathlib.Path(options.work_plan).read_text())
    except OSError as e:
        raise ValueError(f"--work_plan {options.work_plan}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"--work_plan {options.work_plan}: {e}") from None
    return Replanner(
        plan,
        threshold=options.replan_threshold,
        window=options.replan_window,
        cooldown=options.replan_cooldown,
    )


def _core_kwargs(options: ServerOptions) -> dict[str, Any]:
    """``--core_arg``'s, with ``--expected_workers``."""
    kwargs = dict(options.core_arg)
    if options.expected_workers is not None:
        kwargs["expected_workers"] = options.expected_workers
    return kwargs


def _make_server(options: ServerOptions) -> tuple[Server, ServerMetrics | None]:
    """The server of the options, not started, and its metrics (or ``None``)."""
    device = resolve_device(options.device, what="--device")
    params, checkpoint_dir = _params_and_checkpoints(options)
    policy_kwargs = _policy_kwargs(options)
    metrics = None
    if (
        options.metrics_port is not None
        or options.tensorboard_dir is not None
        or options.metrics is not None
    ):

        def state() -> dict[str, Any]:
            # Read at each scrape; the server exists before serving starts.
            return {"version": server.version, "live_workers": len(server.core.live)}

        try:
            metrics = ServerMetrics(
                jsonl=options.metrics,
                state=state,
                tensorboard_dir=(
                    None
                    if options.tensorboard_dir is None
                    else pathlib.Path(options.tensorboard_dir) / "server"
                ),
            )
        except OSError as e:
            raise ValueError(f"--metrics {options.metrics}: {e.strerror}") from None
    server = Server(
        params,
        make_optimizer(
            options.optimizer,
            options.learning_rate,
            momentum=options.momentum,
            **options.optimizer_arg,
        ),
        options.scheme().policy,
        host=options.host,
        port=options.port,
        secret=read_secret(options.secret_file),
        insecure=options.insecure,
        ssl=_tls_context(options.certfile, options.keyfile),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_s=options.checkpoint_every_s,
        checkpoint_every_updates=options.checkpoint_every_updates,
        checkpoint_keep=options.checkpoint_keep,
        check_finite=not options.allow_nonfinite,
        overlap_apply_bytes=(
            None if options.overlap_apply_bytes == -1 else options.overlap_apply_bytes
        ),
        core_kwargs=_core_kwargs(options),
        replanner=_replanner(options),
        status_interval=options.status_interval,
        metrics=metrics,
        device=device,
        **policy_kwargs,
    )
    return server, metrics


async def _serve_metrics(
    server: Server, metrics: ServerMetrics, options: ServerOptions
) -> None:
    """Serves ``/metrics`` for a started server (``--metrics_port``)."""
    host, port = options.metrics_host, options.metrics_port
    try:
        port = metrics.serve(port, host)
    except (OSError, ValueError) as e:
        await server.close()
        raise ValueError(f"cannot serve metrics on {host}:{port}: {e}") from None
    print(f"hpsjax-server metrics on http://{host}:{port}/metrics", flush=True)
    if server.resumed_from is not None:
        metrics.checkpoint_saved()


async def serve(args: argparse.Namespace | ServerOptions) -> None:
    """Builds the server of parsed flags (or options) and serves until a signal.

    Raises:
      ValueError: bad settings or files, in one line (:func:`server_options`).
    """
    options = server_options(args)
    if options.export_params is not None:
        # Refused at the start, not after the run.
        check_export_path(options.export_params)
    server, metrics = _make_server(options)
    scheme = options.scheme()
    if scheme.policy != options.policy.lower() or scheme.worker_flags:
        print(f"hpsjax-server {scheme.describe(options.policy)}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig)
    await server.start()
    if metrics is not None and options.metrics_port is not None:
        await _serve_metrics(server, metrics, options)
    print(f"hpsjax-server listening on {options.host}:{server.port}", flush=True)
    if server.resumed_from is not None:
        print(f"hpsjax-server resumed from step {server.resumed_from}", flush=True)
    try:
        await stop.wait()
        print(
            f"hpsjax-server: {received[0].name if received else 'asked to stop'}: "
            f"stopping at version {server.version} with "
            f"{len(server.core.live)} live workers (telling them goodbye"
            + (", writing a last checkpoint)" if options.checkpoint_dir else ")"),
            flush=True,
        )
    finally:
        try:
            await server.close()
        finally:
            if metrics is not None:
                metrics.close()
    print(f"hpsjax-server stopped at version {server.version}", flush=True)
    if options.export_params is not None:
        export_params(options.export_params, server.params)
        print(
            f"hpsjax-server wrote the parameters of version {server.version} to "
            f"{options.export_params}",
            flush=True,
        )


def _host_only(device: str) -> None:
    """With the state on the host, JAX starts only its CPU backend.

    Started, an accelerator's backend would reserve most of the device's memory
    for this process (JAX preallocates), memory the workers on that device
    need. ``JAX_PLATFORMS`` set by the user is left as it is.
    """
    if device.strip().lower().partition(":")[0] == "cpu" and not os.environ.get(
        "JAX_PLATFORMS"
    ):
        jax.config.update("jax_platforms", "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``hpsjax-server``; returns the exit status."""
    try:
        options = server_options(parse_args(argv))
    except ValueError as e:
        print(f"hpsjax-server: {flag_message(str(e), ServerOptions)}", file=sys.stderr)
        return 2
    if options.malloc_tuning:
        keep_freed_memory()
    setup_logging(options.log_level)
    if argv is None:
        # The command's own process (not a caller's, whose JAX is its own).
        _host_only(options.device)
    runner = asyncio.run
    if options.loop in ("auto", "uvloop"):
        try:
            # An optional dependency, tried only when asked for.
            import uvloop

            runner = uvloop.run
        except ImportError:
            if options.loop == "uvloop":
                print("hpsjax-server: uvloop is not installed", file=sys.stderr)
                return 2
    try:
        runner(serve(options))
    except (ValueError, OSError) as e:
        print(f"hpsjax-server: {flag_message(str(e), ServerOptions)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
