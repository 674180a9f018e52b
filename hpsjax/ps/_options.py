"""The configuration of one ``hpsjax-server``: :class:`ServerOptions`.

One frozen dataclass holds every setting of a server process, checked once,
here; ``hpsjax-server``'s flags are made from its fields
(:mod:`hpsjax._config_flags`), :func:`parse_server` reads them back into one,
and :func:`hpsjax._config_flags.to_argv` writes a configuration back as the
flags that make it, for a launcher that starts the server in another process.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from hpsjax import data, models
from hpsjax._checks import check_int, check_positive, is_int
from hpsjax._config_flags import add_flags, config_kwargs
from hpsjax._flags import ArgumentParser, check_kwargs
from hpsjax._logs import LOG_LEVELS, check_log_level
from hpsjax._optimizers import OPTIMIZERS
from hpsjax.decisions import DEFAULT_POLICY, POLICIES, ServerCore
from hpsjax.net import is_loopback
from hpsjax.planning import SCHEMES
from hpsjax.ps._schemes import RUN_SCHEMES, Scheme, get_scheme

__all__ = [
    "RUN_SCHEMES",
    "Scheme",
    "ServerOptions",
    "get_scheme",
    "parse_args",
    "parse_server",
    "server_options",
]

# What the server builds its core with itself: not ``--core_arg``'s to give.
_CORE_OWN = (
    "params",
    "optimizer",
    "policy",
    "policy_kwargs",
    "check_finite",
    "aggregator",
    "replanner",
)

_KEY_VALUES = ("model_arg", "dataset_arg", "policy_arg", "core_arg", "optimizer_arg")


def _option(default: Any, help: str, **flag: Any) -> Any:
    """A field that is a flag (``flag``: see :mod:`hpsjax._config_flags`)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def _key_values(help: str, group: str) -> Any:
    """A repeatable ``NAME=VALUE`` flag: a mapping, empty by default."""
    return dataclasses.field(
        default_factory=dict, metadata={"help": help, "group": group}
    )


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Settings of one parameter server process (``hpsjax-server``'s flags).

    Each field is the flag of its name (``init_from`` is ``--init_from``; see
    ``hpsjax-server --help`` for what each means); the ``*_arg`` fields are
    the repeatable ``NAME=VALUE`` flags, as mappings. What no later step
    checks is checked here, once, in one line naming the flags: the shard
    index and count, a TLS key without its certificate, a secret on a
    non-loopback address, ``--core_arg``'s names, and ``--export_params``
    with shards. The values the server itself takes (``--status_interval``,
    the checkpoint and re-plan settings, ...) are checked by it.

    Raises:
      ValueError: a bad or inconsistent setting, in one line.

    Examples:
      >>> from hpsjax._config_flags import to_argv
      >>> to_argv(ServerOptions(init="init.npz", policy="ssp",
      ...                       policy_arg={"staleness_bound": 2}))
      ['--init', 'init.npz', '--policy', 'ssp', '--policy_arg', 'staleness_bound=2']
      >>> ServerOptions(init="init.npz", server_shards=2)
      Traceback (most recent call last):
      ...
      ValueError: --server_shards 2 needs --server_shard
    """

    init: str | None = _option(None, ".npz file of initial params", group="init")
    init_from: str | None = _option(
        None,
        "build the initial params from this model instead: "
        f"{', '.join(sorted(models.MODELS))} or package.module:factory",
        metavar="MODEL",
        group="init",
    )
    model_arg: Mapping[str, Any] = _key_values(
        "with --init_from: model argument (JSON value), repeatable", "model"
    )
    model_seed: int = _option(
        0, "with --init_from: seed of the initial weights", group="model"
    )
    dataset: str = _option(
        "synthetic_digits",
        "with --init_from a built-in model: the dataset that sizes it: "
        f"{', '.join(sorted(data.DATASETS))}",
        group="model",
    )
    dataset_arg: Mapping[str, Any] = _key_values(
        "with --init_from: dataset argument (JSON value), repeatable", "model"
    )
    data_path: str | None = _option(
        None,
        "with --init_from and --dataset npz: the .npz file of arrays x and y "
        "(hpsjax-worker's --data_path)",
        metavar="FILE.npz",
        group="model",
    )

    server_shard: int | None = _option(
        None,
        "serve only this shard's key range of the model (0-based)",
        group="shards",
    )
    server_shards: int = _option(
        1,
        "number of server shards the model is split over by key range",
        group="shards",
    )
    split_leaves: bool = _option(
        False,
        "with --server_shards: cut arrays by rows to balance the shards "
        "(the workers need the same flag)",
        group="shards",
    )

    host: str = _option("127.0.0.1", "address to listen on", group="network")
    port: int = _option(0, "port (0: any free one)", group="network")
    secret_file: str | None = _option(
        None, "file holding the shared secret", group="network"
    )
    insecure: bool = _option(
        False,
        "allow serving without a secret on a non-loopback address",
        group="network",
    )
    certfile: str | None = _option(
        None, "TLS certificate (PEM); enables TLS", group="network"
    )
    keyfile: str | None = _option(None, "TLS private key (PEM)", group="network")

    policy: str = _option(
        DEFAULT_POLICY,
        "the scheme: a policy (" + ", ".join(sorted(POLICIES)) + ") or a scheme "
        "made of one and worker flags (hps: bsp with 8-bit pushes; ashl: hybrid "
        "with ASHL's stages; ps_plus; local_sgd), printed at the start (the "
        "default is hpsjax-launch's too)",
        group="policy",
    )
    policy_arg: Mapping[str, Any] = _key_values(
        "policy keyword argument (JSON value), repeatable: staleness_bound=2 "
        "(ssp), threshold=4 or on_straggler=drop (saps: a push more than "
        "threshold versions stale is damped or dropped and its worker forced to "
        'pull), and for hybrid stages=\'[{"mode": "async", "local_steps": '
        '8, "max_staleness": 16, "until_version": 100}, {"mode": '
        '"semi_async", "max_staleness": 2}]\' (mode async, semi_async or '
        "sync; local_steps, max_staleness, until_version optional; LAUNCH.md)",
        "policy",
    )
    core_arg: Mapping[str, Any] = _key_values(
        "ServerCore keyword argument (e.g. expected_workers=4), repeatable",
        "policy",
    )
    optimizer: str = _option(
        "sgd",
        f"server optimizer: {', '.join(OPTIMIZERS)}, or any optax optimizer "
        "by name (adamw, lion, muon, ...)",
        group="policy",
    )
    optimizer_arg: Mapping[str, Any] = _key_values(
        "keyword argument of the optimizer (JSON value), repeatable: "
        "weight_decay=0.01 (adamw), b1=0.95 (lion), delay=4 (delayed_nesterov)",
        "policy",
    )
    learning_rate: float = _option(0.1, "step size", group="policy")
    momentum: float | None = _option(
        None,
        "momentum of sgd and momentum (which defaults to 0.9), or of an "
        "optax optimizer that takes one",
        group="policy",
    )
    allow_nonfinite: bool = _option(
        False, "accept updates holding NaN or infinity", group="policy"
    )
    overlap_apply_bytes: int = _option(
        1 << 20,
        "apply pushes of at least this many raw bytes leaf by leaf as they "
        "arrive, where the optimizer allows it (-1: never)",
        group="policy",
    )

    work_plan: str | None = _option(
        None,
        "WorkPlan JSON (hpsjax.planning.plan): sent to the workers and "
        "re-planned as their measured speeds drift (H-PS)",
        group="plan",
    )
    replan_threshold: float = _option(
        0.2, "relative speed drift that triggers a re-plan", group="plan"
    )
    replan_cooldown: float = _option(
        30.0, "least seconds between two re-plans", group="plan"
    )
    replan_window: int = _option(10, "pushes the speed average spans", group="plan")
    pilot: str | None = _option(
        None,
        "plan from the run itself: a pilot of real rounds at two or more "
        "batches per worker fits each worker's step, then installs this "
        "scheme's plan (hps, ashl, adsp, equal, ashl_reference, dylu) and "
        "re-plans as speeds drift; needs --global_batch and --expected_workers "
        "(workers --worker_id 0 .. K-1)",
        metavar="SCHEME",
        group="plan",
    )
    global_batch: int | None = _option(
        None, "--pilot: samples per step over all workers", group="plan"
    )
    expected_workers: int | None = _option(
        None,
        "--pilot: the workers of the run, ids 0 .. K-1 (the server starts "
        "when all K are live)",
        metavar="K",
        group="plan",
    )
    pilot_tolerance: float = _option(
        0.05,
        "--pilot: the largest relative standard error of a worker's fitted "
        "step at its planned batch before the plan is made",
        group="plan",
    )
    pilot_grid: str | None = _option(
        None,
        "--pilot: the only batch sizes it plans (comma-separated, ascending), "
        "the ones the workers compile before joining with --precompile",
        metavar="SIZES",
        group="plan",
    )
    pilot_balance: int = _option(
        0,
        "--pilot: after its fit's plan, rounds of each worker at its planned "
        "batch between two checks that balance the plan on those steps (0: none)",
        metavar="ROUNDS",
        group="plan",
    )

    checkpoint_dir: str | None = _option(
        None, "checkpoint (and resume) directory", group="checkpoints"
    )
    checkpoint_every_s: float | None = _option(
        None, "seconds between checkpoints", group="checkpoints"
    )
    checkpoint_every_updates: int | None = _option(
        None, "updates between checkpoints", group="checkpoints"
    )
    checkpoint_keep: int = _option(3, "checkpoints kept on disk", group="checkpoints")
    export_params: str | None = _option(
        None,
        "when the server stops, write its parameters to this .npz (the "
        "--init format; load them into your flax module with "
        "hpsjax.export.load_params)",
        metavar="PATH",
        group="checkpoints",
    )

    metrics_port: int | None = _option(
        None,
        "serve Prometheus metrics on http://METRICS_HOST:PORT/metrics "
        "(0: any free port, printed)",
        group="metrics",
    )
    metrics_host: str = _option(
        "127.0.0.1", "address of the metrics server", group="metrics"
    )
    metrics: str | None = _option(
        None,
        "append one JSON line per model version here: its apply and serve "
        "seconds and pulls (hpsjax.telemetry.VersionTelemetry)",
        group="metrics",
        metavar="PATH",
    )
    tensorboard_dir: str | None = _option(
        None,
        "write the server's TensorBoard scalars (version, pushes/s, "
        "staleness, barrier wait, drops) under DIR/server, e.g. the workers' "
        "tensorboard directory",
        group="metrics",
    )
    status_interval: float = _option(
        10.0,
        "seconds between status lines (a bar on a terminal) and "
        "TensorBoard points (0: none)",
        group="metrics",
    )

    device: str = _option(
        "cpu",
        "where the parameters and optimizer state live and the optimizer "
        "runs: cpu (the host, where the sockets' bytes are) or a platform such "
        "as gpu, cuda or tpu, optionally :INDEX (e.g. gpu:1)",
        group="process",
    )
    loop: str = _option(
        "auto",
        "event loop (auto: uvloop when installed)",
        choices=("auto", "uvloop", "asyncio"),
        group="process",
    )
    malloc_tuning: bool = _option(
        True,
        "return freed memory to the system instead of keeping it for reuse "
        "(see keep_freed_memory)",
        flag="--no_malloc_tuning",
        aliases=("--no-malloc_tuning",),
        group="process",
    )
    log_level: str = _option(
        "INFO",
        f"{', '.join(LOG_LEVELS)} (DEBUG: also the libraries' INFO lines, and "
        "every checkpoint written)",
        type=check_log_level,
        group="process",
    )

    def __post_init__(self):
        for name in _KEY_VALUES:
            # NAME=VALUE pairs as they come from the flags, or a mapping.
            object.__setattr__(self, name, dict(getattr(self, name)))
        if (self.init is None) == (self.init_from is None):
            raise ValueError("give one of --init and --init_from")
        self.shard()
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("--keyfile needs --certfile")
        if self.secret_file is None and not (self.insecure or is_loopback(self.host)):
            raise ValueError(
                f"refusing to serve on {self.host!r} without a secret: anyone who "
                "can reach the port could push updates; pass --secret_file (or "
                "--insecure to accept that)"
            )
        self._check_policy()
        if self.data_path is not None and (
            self.dataset != "npz" or "path" in self.dataset_arg
        ):
            raise ValueError(
                "--data_path is the file of --dataset npz, given once (not "
                "with --dataset_arg path=...)"
            )
        check_kwargs(
            ServerCore,
            self.core_arg,
            "--core_arg",
            what="ServerCore",
            skip=_CORE_OWN,
        )
        self._check_pilot()
        if self.export_params is not None and self.server_shards > 1:
            raise ValueError(
                "--export_params writes a whole model, and each of the "
                f"{self.server_shards} shards holds a part: export the shards' "
                "checkpoints instead with python -m hpsjax.export CKPT_DIR OUT.npz"
            )

    def dataset_kwargs(self) -> dict[str, Any]:
        """The dataset's arguments: ``--dataset_arg``'s, with ``--data_path``."""
        path = {} if self.data_path is None else {"path": self.data_path}
        return {**self.dataset_arg, **path}

    def scheme(self) -> Scheme:
        """The :class:`Scheme` ``--policy`` names."""
        return get_scheme(self.policy)

    def policy_kwargs(self) -> dict[str, Any]:
        """The policy's keyword arguments: the scheme's, then ``--policy_arg``'s."""
        return {**self.scheme().policy_arg, **self.policy_arg}

    def _check_policy(self) -> None:
        """``--policy`` names a scheme, and ``--policy_arg`` its policy's
        arguments."""
        scheme = self.scheme()
        check_kwargs(
            POLICIES[scheme.policy],
            self.policy_arg,
            "--policy_arg",
            what=f"policy {scheme.policy!r}",
        )

    def _check_pilot(self) -> None:
        """``--pilot`` and the flags it needs, or none of them."""
        if self.pilot is None:
            for name in ("global_batch", "expected_workers", "pilot_grid"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name} needs --pilot")
            if self.pilot_balance != 0:
                raise ValueError("--pilot_balance needs --pilot")
            return
        if self.pilot not in SCHEMES:
            raise ValueError(
                f"unknown --pilot scheme {self.pilot!r}; valid schemes: "
                f"{', '.join(SCHEMES)}"
            )
        if self.work_plan is not None:
            raise ValueError("give one of --pilot and --work_plan")
        if self.expected_workers is None or self.global_batch is None:
            raise ValueError("--pilot needs --global_batch and --expected_workers")
        check_int("--expected_workers", self.expected_workers, low=1)
        if not (
            is_int(self.global_batch) and self.global_batch >= self.expected_workers
        ):
            raise ValueError(
                f"--global_batch must be an int >= --expected_workers "
                f"({self.expected_workers}), got {self.global_batch!r}"
            )
        check_positive("--pilot_tolerance", self.pilot_tolerance)
        check_int("--pilot_balance", self.pilot_balance, low=0)
        self.pilot_sizes()
        if "expected_workers" in self.core_arg:
            raise ValueError(
                "give the workers once: --expected_workers, not --core_arg "
                "expected_workers"
            )

    def pilot_sizes(self) -> tuple[int, ...] | None:
        """``--pilot_grid`` as batch sizes (``None``: any size).

        Raises:
          ValueError: not ascending sizes >= 1, comma-separated, in one line.
        """
        if self.pilot_grid is None:
            return None
        try:
            sizes = tuple(int(x) for x in str(self.pilot_grid).split(","))
        except ValueError:
            sizes = ()
        ascending = all(b < c for b, c in itertools.pairwise(sizes))
        if not (sizes and sizes[0] >= 1 and ascending):
            raise ValueError(
                "--pilot_grid must be batch sizes >= 1, ascending, comma-separated "
                f"(the workers' --precompile), got {self.pilot_grid!r}"
            )
        return sizes

    def shard(self) -> tuple[int, int]:
        """``(shard, num_shards)`` this server serves (``(0, 1)``: the whole
        model)."""
        shard, count = self.server_shard, self.server_shards
        if count < 1:
            raise ValueError(f"--server_shards must be >= 1, got {count}")
        if shard is None:
            if count > 1:
                raise ValueError(f"--server_shards {count} needs --server_shard")
            return 0, 1
        if not 0 <= shard < count:
            raise ValueError(f"--server_shard must be in [0, {count}), got {shard}")
        return shard, count


# The argument groups of --help, by the key the options' fields give.
_GROUPS = {
    "model": "model",
    "shards": "shards",
    "network": "network and security",
    "policy": "policy and optimizer",
    "plan": "work plan",
    "checkpoints": "checkpoints",
    "metrics": "metrics",
    "process": "process",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses ``hpsjax-server``'s command line (see :mod:`hpsjax.ps._cli`).

    The flags are :class:`ServerOptions`'s fields
    (:mod:`hpsjax._config_flags`); :func:`server_options` checks the result
    and makes it the configuration.
    """
    p = ArgumentParser(
        prog="hpsjax-server",
        description="Run an hpsjax parameter server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    groups["init"] = groups["model"].add_mutually_exclusive_group(required=True)
    add_flags(p, ServerOptions, groups)
    return p.parse_args(argv)


def server_options(args: argparse.Namespace | ServerOptions) -> ServerOptions:
    """The configuration of parsed flags (checked), or ``args`` if it is one.

    Raises:
      ValueError: a bad or inconsistent setting, in one line.
    """
    if isinstance(args, ServerOptions):
        return args
    return ServerOptions(**config_kwargs(ServerOptions, args))


def parse_server(argv: Sequence[str]) -> ServerOptions:
    """A server's settings from its ``hpsjax-server`` flags (checked).

    Raises:
      SystemExit: a flag the command does not take (argparse's message).
      ValueError: a bad setting, in one line.
    """
    return server_options(parse_args(list(argv)))
