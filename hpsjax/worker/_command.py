"""The settings of the ``hpsjax-worker`` command beside :class:`WorkerConfig`.

:class:`WorkerCommand` declares, once, each flag of the command that is not a
:class:`~hpsjax.worker.WorkerConfig` field (where the server is, the model and
data, the work plan, injected heterogeneity, outputs): its name, type,
default, help and group. ``hpsjax-worker``'s parser is made from the two
dataclasses (:mod:`hpsjax._config_flags`), and :func:`worker_argv` writes a
worker's command line from them, the launchers' and the experiments' alike.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from hpsjax import data, models, tasks
from hpsjax._config_flags import to_argv
from hpsjax._logs import LOG_LEVELS, check_log_level
from hpsjax._optimizers import OPTIMIZERS
from hpsjax.worker._config import WorkerConfig

__all__ = ["WorkerCommand", "addresses", "worker_argv"]


def addresses(text: str) -> tuple[tuple[str, int], ...]:
    """``"hostA:5555,[::1]:5556"`` as ``(("hostA", 5555), ("::1", 5556))``."""
    out = []
    for item in text.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {item!r}")
        out.append((host, int(port)))
    return tuple(out)


def _address_text(pairs: Any) -> str:
    """The inverse of :func:`addresses`."""
    return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in pairs)


def _flag(default: Any, help: str, group: str, **meta: Any) -> Any:
    return dataclasses.field(
        default=default, metadata={"help": help, "group": group, **meta}
    )


def _key_values(help: str, group: str) -> Any:
    return dataclasses.field(
        default_factory=dict, metadata={"help": help, "group": group}
    )


@dataclasses.dataclass(frozen=True)
class WorkerCommand:
    """The ``hpsjax-worker`` flags that are not :class:`WorkerConfig` fields.

    Each field is the flag of its name; the ``*_arg`` fields are the repeatable
    ``NAME=VALUE`` flags, as mappings. ``model`` and ``dataset`` left at
    ``None`` are the task's (:func:`hpsjax.worker.parse_worker_args` fills them).
    """

    port: int | None = _flag(None, "server port", "server")
    servers: tuple | None = _flag(
        None,
        "the server shards' addresses in shard order (instead of --host/--port): "
        "the model is split over them by key range",
        "server",
        type=addresses,
        format=_address_text,
        metavar="HOST:PORT,...",
    )
    split_leaves: bool = _flag(
        False,
        "with --servers: the shards cut arrays by rows (as the servers' "
        "--split_leaves)",
        "server",
    )
    secret_file: str | None = _flag(None, "file holding the shared secret", "server")
    cafile: str | None = _flag(
        None, "CA certificates (PEM) to verify a TLS server", "server"
    )
    server_hostname: str | None = _flag(
        None, "name to check the certificate for", "server"
    )
    connect_timeout: float = _flag(
        30.0,
        "seconds to keep retrying (with backoff) a server that is not up yet",
        "server",
    )
    task: str = _flag(
        "classification",
        f"what is learned: {', '.join(sorted(tasks.TASKS))} or "
        "package.module:make_task (a function returning an hpsjax.tasks.Task); "
        "it sets the loss, the eval metrics and the defaults of --dataset and "
        "--model",
        "data",
    )
    model: str | None = _flag(
        None,
        f"model: {', '.join(sorted(models.MODELS))} or package.module:factory "
        "(default: the task's, transformer for lm, else mlp)",
        "data",
    )
    model_arg: Mapping[str, Any] = _key_values("model argument (JSON value)", "data")
    model_seed: int = _flag(0, "seed of the initial weights (for --write_init)", "data")
    dataset: str | None = _flag(
        None,
        f"dataset: {', '.join(sorted(data.DATASETS))} (default: the task's, "
        "text for lm, synthetic_regression for regression, else synthetic_digits)",
        "data",
    )
    data_path: str | None = _flag(
        None,
        "with --dataset npz: your data, an .npz file of arrays x (inputs, "
        "a leading example axis) and y (integer labels), e.g. written by "
        "np.savez(path, x=images, y=labels)",
        "data",
        metavar="FILE.npz",
    )
    dataset_arg: Mapping[str, Any] = _key_values(
        "dataset argument (JSON value)", "data"
    )
    test_fraction: float = _flag(
        0.2, "share held out from training (same split on every worker)", "data"
    )
    shard_index: int | None = _flag(None, "this worker's shard", "data")
    shard_count: int = _flag(1, "number of shards", "data")
    data_seed: int | None = _flag(
        None,
        "shuffle seed of this worker's batches (default: its shard index)",
        "data",
    )
    work_plan: str | None = _flag(
        None, "WorkPlan JSON file (sets batch, steps, lr)", "work"
    )
    local_optimizer: str = _flag(
        "none",
        "optimizer of local steps: none (push gradients), or any optimizer "
        f"by name: {', '.join(OPTIMIZERS)}, or any optax optimizer (adamw, lion, "
        "muon, ...)",
        "work",
    )
    local_optimizer_arg: Mapping[str, Any] = _key_values(
        "keyword argument of the local optimizer (JSON value), repeatable: "
        "weight_decay=0.01 (adamw), momentum=0.5 (sgd)",
        "work",
    )
    local_learning_rate: float = _flag(0.1, "local step size", "work")
    slowdown: str = _flag(
        "1", "slowdown factor k >= 1, or a schedule 't0:k0,t1:k1'", "faults"
    )
    bandwidth: str = _flag(
        "none", "link cap in bytes/s (none: no cap), or a schedule", "faults"
    )
    latency: float = _flag(0.0, "seconds per message", "faults")
    metrics: str | None = _flag(
        None, "append per-round metrics (JSON lines) here", "outputs"
    )
    tensorboard_dir: str | None = _flag(
        None,
        "TensorBoard event files of the metrics (default: tensorboard/ "
        "beside --metrics; none: no event files)",
        "outputs",
    )
    metrics_port: int | None = _flag(
        None,
        "serve the rounds' metrics to Prometheus on "
        "http://127.0.0.1:PORT/metrics (0: any free port, printed)",
        "outputs",
    )
    eval_every: float | None = _flag(
        None,
        "evaluate the pulled parameters on the held-out split this often "
        "(an eval record, and a line on stdout)",
        "outputs",
        metavar="SECONDS",
    )
    eval_batch_size: int = _flag(256, "examples per eval batch", "outputs")
    target_metric: str | None = _flag(
        None,
        "with --target_value: the eval metric of the target (default: the "
        "task's, accuracy for classification, loss for lm and regression)",
        "outputs",
    )
    target_value: float | None = _flag(
        None,
        "with --eval_every: stop once an eval reaches this value of "
        "--target_metric (in the task's direction: accuracy up, loss down)",
        "outputs",
    )
    write_init: str | None = _flag(
        None,
        "write the model's initial parameters (.npz) and exit",
        "outputs",
        metavar="PATH",
    )
    profile_out: str | None = _flag(
        None,
        "run the profiling pass, write the profile JSON and exit; with "
        "--port/--servers the push and pull are timed against that server",
        "outputs",
        metavar="PATH",
    )
    profile_link: str | None = _flag(
        None,
        "without a server: the link the profile counts",
        "outputs",
        metavar="BYTES_PER_S[,LATENCY_S]",
    )
    profile_batch_sizes: str = _flag(
        "16,64,256", "batch sizes the profiling pass measures", "outputs"
    )
    profile_repeats: int = _flag(
        10, "timed steps per batch size (the median is kept)", "outputs"
    )
    loop: str = _flag(
        "auto",
        "event loop (auto: uvloop when installed)",
        "outputs",
        choices=("auto", "uvloop", "asyncio"),
    )
    compile_cache_dir: str | None = _flag(
        None,
        "JAX's persistent compilation cache, shared with the run's other "
        "processes so a step is compiled once (default: $JAX_COMPILATION_CACHE_DIR, "
        "which hpsjax-launch sets to <workdir>/jax_cache; unset: no cache; none: "
        "no cache)",
        "outputs",
        metavar="PATH",
        flag="--compile_cache",
        dest="compile_cache_dir",
        aliases=("--compile_cache_dir",),
    )
    log_level: str = _flag(
        "INFO",
        f"{', '.join(LOG_LEVELS)} (DEBUG: also the libraries' INFO lines)",
        "outputs",
        type=check_log_level,
    )
    status_interval: float = _flag(
        10.0,
        "seconds between status lines (step, rate, loss, staleness, time "
        "left; a bar on a terminal), 0: none",
        "outputs",
    )


def worker_argv(
    command: WorkerCommand, config: WorkerConfig | None = None
) -> list[str]:
    """A worker's ``hpsjax-worker`` flags: ``command``'s then ``config``'s
    (each field away from its default, through its one declaration)."""
    return to_argv(command) + ([] if config is None else to_argv(config))
