"""Registries: the strings in experiment configs and the code they pick.

Every string a config holds that selects code (a scheme, a backend, an
optimizer, a worker setting, a stage switch rule, a suite) is looked up here with
:func:`lookup`, which raises one clear ``ValueError`` that lists the valid names.
Configs are checked with :func:`check_config` before anything runs, so a typo
fails in a second rather than after a compile.

Examples:
  >>> lookup("optimizer", "sgd")(0.1, momentum=0.0) is not None
  True
  >>> lookup("optimizer", "sgdd")
  Traceback (most recent call last):
  ...
  ValueError: unknown optimizer 'sgdd'; valid names: adam, delayed_nesterov, \
demo_outer, lookahead_momentum, momentum, nesterov, ordered_momentum, sgd, \
streaming_local, streaming_nesterov or any optimizer of optax or optax.contrib \
(closest: sgd, dpsgd, amsgrad)
"""

from __future__ import annotations

import importlib
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import optax

from experiments.configs import SCHEMES, SIM_ONLY_SCHEMES
from experiments.configs.schema import ExperimentConfig
from experiments.target import target
from hpsjax._checks import check_choice, check_fraction, check_int, check_number
from hpsjax._optimizers import OptimizerRegistry
from hpsjax.worker import OVERLAP_MODES

__all__ = [
    "BACKENDS",
    "OPTIMIZERS",
    "OVERLAPS",
    "SCHEMES",
    "SIM_ONLY_SCHEMES",
    "STAGE_SWITCHES",
    "check_config",
    "load_config",
    "lookup",
]


OPTIMIZERS: Mapping[str, Callable[..., optax.GradientTransformation]] = (
    OptimizerRegistry()
)
"""Server and local optimizers by name: ``f(learning_rate, *, momentum, **kw)``.

The one registry of ``hpsjax._optimizers``: hpsjax's own names (``sgd``,
``momentum``, ``adam``; ``nesterov``, DiLoCo's outer optimizer, and
``delayed_nesterov``, that of asynchronous local SGD, its ``delay`` from
``server.outer_delay``) and any optax or optax.contrib optimizer by name
(``adamw``, ``lion``, ``muon``, ...), its keyword arguments from
``server.optimizer_args`` or ``worker.local_optimizer_args``."""

BACKENDS: tuple[str, ...] = ("sim", "processes")
"""``sim``: the virtual-clock simulator; ``processes``: a real server and workers."""

OVERLAPS: tuple[str, ...] = OVERLAP_MODES
"""How workers overlap communication with compute (``hpsjax.worker.OVERLAP_MODES``)."""

STAGE_SWITCHES: tuple[str, ...] = ("version", "plateau", "loss")
"""ASHL's rule to leave the AHL stage: a server version, a flat loss on the
workers (``plateau``), or the server's training loss below a threshold
(``loss``, as ASHL's reference code decides it)."""

PLAN_SCHEMES: tuple[str, ...] = (
    "none",
    "hps",
    "ashl",
    "adsp",
    "equal",
    "ashl_reference",
    "dylu",
)
"""Work plans (``hpsjax.profiling.SCHEMES``) or ``none`` for equal batches."""

LR_SCALINGS: tuple[str, ...] = ("linear", "sqrt", "none")
"""Step-size scale of a planned batch (``hpsjax.profiling.LR_SCALINGS``)."""

COMPRESSIONS: tuple[str, ...] = (
    "none",
    "top_k",
    "power_sgd",
    "sparseloco",
    "streaming",
    "demo",
)
"""Push compressors besides quantization (``worker.compression``): ``top_k``
(``hpsjax.top_k``, error feedback) through the worker core's top-k pushes,
``power_sgd`` (``hpsjax.power_sgd`` of rank ``worker.powersgd_rank``, error
feedback) as the push transform of the simulator and ``hpsjax-worker
--powersgd_rank`` on processes, both sending or counting its factors;
``sparseloco`` (``hpsjax.sparseloco``: decayed error feedback, top-k at
``worker.compress_ratio``, values on ``worker.sparseloco_bits`` bits) as the
push transform of the simulator, which counts ``sparseloco_nbytes`` per push;
``streaming`` (Streaming DiLoCo's
``hpsjax.streaming_push``: one of ``worker.streaming_fragments`` fragments a
push, in turn, on ``worker.streaming_bits`` bits) as the push transform of the
simulator, which counts the fragments' mean bytes per push; ``demo`` (DeMo's
``hpsjax.transforms.demo``: the top ``worker.demo_topk`` DCT coefficients per
chunk of ``worker.demo_chunk`` of a momentum decayed by ``worker.demo_decay``;
the server's ``demo_outer``) as the push transform of the simulator, which
counts ``demo_nbytes`` per push. On processes all three go through
``hpsjax-worker --push_transform`` and travel as top-k leaves at float32
(``hpsjax.transforms.sparse_encoded``: no few-bit sparse codec yet)."""

_REGISTRIES: dict[str, Any] = {
    "optimizer": OPTIMIZERS,
    "scheme": SCHEMES,
    "backend": BACKENDS,
    "overlap": OVERLAPS,
    "stage switch": STAGE_SWITCHES,
    "plan scheme": PLAN_SCHEMES,
    "lr scaling": LR_SCALINGS,
    "compression": COMPRESSIONS,
}


def _registry(kind: str) -> Any:
    if kind == "policy":
        from hpsjax.ps import POLICIES

        return POLICIES
    if kind == "model":
        from hpsjax.models import MODELS

        return MODELS
    if kind == "dataset":
        from hpsjax.data import DATASETS

        return DATASETS
    if kind == "staleness policy":
        from hpsjax.transforms import STALENESS_POLICIES

        return STALENESS_POLICIES
    if kind == "suite":
        from experiments.configs.suites import SUITES

        return SUITES
    if kind == "setting":
        from experiments.configs.common import SETTINGS

        return SETTINGS
    try:
        return _REGISTRIES[kind]
    except KeyError:
        raise ValueError(
            f"unknown registry {kind!r}; valid registries: "
            f"{', '.join(sorted([*_REGISTRIES, *_LAZY]))}"
        ) from None


_LAZY = ("policy", "model", "dataset", "staleness policy", "suite", "setting")
_BITS = (1, 2, 4, 8, 16)


def lookup(kind: str, name: Any) -> Any:
    """Returns the entry ``name`` of the registry ``kind``.

    Args:
      kind: ``"optimizer"``, ``"scheme"``, ``"backend"``, ``"overlap"``,
        ``"stage switch"``, ``"plan scheme"``, ``"lr scaling"``,
        ``"compression"``, ``"policy"``,
        ``"model"``, ``"dataset"``, ``"staleness policy"``, ``"suite"`` or
        ``"setting"``.
      name: the name to look up.

    Returns:
      The registered object (for name-only registries, the name itself).

    Raises:
      ValueError: an unknown name; the message lists the valid ones.
    """
    registry = _registry(kind)
    if isinstance(registry, OptimizerRegistry) and name not in registry:
        raise registry.error(name)
    if not isinstance(name, str) or name not in registry:
        raise ValueError(
            f"unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}"
        )
    if isinstance(registry, Mapping):
        return registry[name]
    return name


def load_config(scheme: str, variant: str | None = None) -> ExperimentConfig:
    """The config of ``experiments/configs/<scheme>.py`` for ``variant``.

    Args:
      scheme: a name of :data:`SCHEMES`.
      variant: the part after ``:`` on the command line (``"quick"``,
        ``"sim8"``, ...), or ``None`` for the default.

    Returns:
      The scheme's :class:`~experiments.configs.schema.ExperimentConfig`
      (not frozen: a caller may change it before :func:`check_config`).

    Raises:
      ValueError: an unknown scheme or variant (the message lists the valid
        names).
    """
    lookup("scheme", scheme)
    module = importlib.import_module(f"experiments.configs.{scheme}")
    return module.get_config(variant)


def _check_worker_count(config: ExperimentConfig) -> None:
    """A policy's ``num_workers`` and an optimizer's ``num_slots`` (Ringleader's
    table) are the run's number of workers: a table waiting on workers that do
    not exist never steps."""
    n = len(config.workers.slowdowns)
    given = (
        ("server.policy_kwargs.num_workers", config.server.policy_kwargs or {},
         "num_workers"),
        ("server.optimizer_args.num_slots", config.server.optimizer_args or {},
         "num_slots"),
    )  # fmt: skip
    for name, kwargs, key in given:
        if key in kwargs and kwargs[key] != n:
            raise ValueError(
                f"{name}={kwargs[key]} but the run has {n} workers "
                "(workers.slowdowns): set it to the number of workers"
            )


def check_config(config: ExperimentConfig) -> None:
    """Checks every registry name in a config, before anything runs.

    Raises:
      ValueError: the first unknown name (the message lists the valid ones), an
        unknown task or a target on a metric it does not report, or a setting
        that cannot run (e.g. local steps without a local optimizer).
    """
    lookup("scheme", config.scheme)
    lookup("backend", config.backend)
    target(config)  # the task, and a target on a metric it reports
    lookup("dataset", config.data.name)
    if ":" not in config.model.name:  # else a factory, "package.module:make"
        lookup("model", config.model.name)
    lookup("policy", config.server.policy)
    if config.server.policy == "halos" and config.backend != "sim":
        raise ValueError(
            "server.policy='halos' (local servers per region under a global "
            "one) runs in the simulator only: backend='sim'"
        )
    lookup("optimizer", config.server.optimizer)
    _check_worker_count(config)
    lookup("overlap", config.worker.overlap)
    lookup("plan scheme", config.plan.scheme)
    lookup("lr scaling", config.plan.lr_scaling)
    if config.plan.pilot:
        if config.plan.scheme == "none":
            raise ValueError("plan.pilot needs a plan.scheme")
        if config.backend != "processes":
            raise ValueError("plan.pilot runs on real processes (backend='processes')")
    if config.plan.overlap_link_share is not None:
        check_fraction("plan.overlap_link_share", config.plan.overlap_link_share)
        if config.plan.scheme == "none":
            raise ValueError("plan.overlap_link_share needs a plan.scheme")
    if config.worker.local_optimizer != "none":
        lookup("optimizer", config.worker.local_optimizer)
    elif config.worker.local_steps != 1:
        raise ValueError(
            f"worker.local_steps={config.worker.local_steps} needs a "
            "worker.local_optimizer (the worker pushes one gradient per round "
            "without one)"
        )
    for side in (config.server, config.worker):
        if side.staleness_lr is not None:
            lookup("staleness policy", side.staleness_lr)
    if config.stages.enabled:
        lookup("stage switch", config.stages.switch)
    if config.worker.bits is not None and config.worker.bits not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"worker.bits must be one of 1, 2, 4, 8, 16 or None, got "
            f"{config.worker.bits!r}"
        )
    _check_compression(config)
    if config.data.name == "npz" and not config.data.path:
        raise ValueError("data.name='npz' needs data.path (the .npz file)")
    if config.data.name == "npz" and not pathlib.Path(config.data.path).is_file():
        raise FileNotFoundError(f"data.path: no .npz file at {config.data.path!r}")
    check_int("max_updates", config.max_updates, low=1, allow_none=True)
    speeds = tuple(config.workers.slowdowns)
    if not speeds or any(not s >= 1 for s in speeds):
        raise ValueError(
            f"workers.slowdowns must be a non-empty list of factors >= 1, got {speeds}"
        )


def _check_compression(config: ExperimentConfig) -> None:
    """``worker.compression`` and what it needs (one-line errors)."""
    worker = config.worker
    compression = lookup("compression", worker.compression)
    if compression == "none":
        return
    if worker.bits is not None:
        raise ValueError(
            f"worker.compression={compression!r} replaces quantization: set "
            "worker.bits=None"
        )
    if compression == "power_sgd":
        _check_power_sgd(config)
        return
    if compression == "sparseloco":
        _check_sparseloco(config)
        return
    if compression == "streaming":
        _check_streaming(config)
        return
    if compression == "demo":
        _check_demo(config)
        return
    check_fraction("worker.compress_ratio", worker.compress_ratio)
    if config.plan.scheme in ("none", "ashl_reference"):
        raise ValueError(
            "worker.compression='top_k' needs a plan scheme other than "
            f"'ashl_reference' (it sets every worker's compress_ratio), got "
            f"plan.scheme={config.plan.scheme!r}"
        )
    if config.plan.replan:
        raise ValueError(
            "worker.compression='top_k' needs plan.replan=False (a re-plan "
            "resets the workers' compress_ratio)"
        )
    if config.stages.compress_from_stage != 0:
        raise ValueError(
            "worker.compression='top_k' needs stages.compress_from_stage=0 "
            "(every push sparsified from the start)"
        )


def _check_sparseloco(config: ExperimentConfig) -> None:
    """What ``worker.compression='sparseloco'`` needs (one-line errors)."""
    worker = config.worker
    check_fraction("worker.compress_ratio", worker.compress_ratio)
    check_choice("worker.sparseloco_bits", worker.sparseloco_bits, (1, 2, 4, 8, 32))
    check_int("worker.sparseloco_chunk", worker.sparseloco_chunk, low=1)
    check_number("worker.sparseloco_decay", worker.sparseloco_decay, low=0, high=1)
    if config.stages.compress_from_stage is not None:
        raise ValueError(
            "worker.compression='sparseloco' compresses every push: set "
            "stages.compress_from_stage=None"
        )


def _check_streaming(config: ExperimentConfig) -> None:
    """What ``worker.compression='streaming'`` needs (one-line errors)."""
    worker = config.worker
    fragments = worker.streaming_fragments
    check_int("worker.streaming_fragments", fragments, low=1)
    bits = worker.streaming_bits
    check_choice("worker.streaming_bits", bits, (*_BITS, "e2m1"), allow_none=True)
    layout = worker.streaming_layout
    check_choice("worker.streaming_layout", layout, ("contiguous", "strided"))
    server_args = config.server.optimizer_args or {}
    server_layout = server_args.get("layout", "contiguous")
    if server_layout != layout:
        raise ValueError(
            f"worker.streaming_layout={layout!r} needs server.optimizer_args.layout "
            f"= {layout!r} (the server steps the same fragments), got {server_layout!r}"
        )
    if worker.local_optimizer != "streaming_local":
        raise ValueError(
            "worker.compression='streaming' needs worker.local_optimizer="
            f"'streaming_local' (workers keep their own parameters), got "
            f"{worker.local_optimizer!r}"
        )
    if config.plan.scheme != "none":
        raise ValueError(
            "worker.compression='streaming' needs plan.scheme='none' (a plan's "
            "step-size scale hides the workers' own parameters from them)"
        )
    if config.stages.compress_from_stage is not None:
        raise ValueError(
            "worker.compression='streaming' compresses every push: set "
            "stages.compress_from_stage=None"
        )
    args = worker.local_optimizer_args or {}
    delay = check_int("worker.local_optimizer_args.delay", args.get("delay", 0), low=0)
    if delay and delay >= int(worker.local_steps) - 1:
        raise ValueError(
            f"worker.local_optimizer_args.delay (tau = {delay}) must be below a "
            f"round's inner steps ({int(worker.local_steps) - 1}), as torchft's "
            "fragment_sync_delay < sync_every / fragments"
        )
    if args.get("eager"):
        # Eager updates mirror the server's outer step: the same numbers.
        for key, want in (
            ("fragments", fragments),
            ("outer_learning_rate", config.server.learning_rate),
            ("outer_momentum", config.server.momentum),
        ):
            if args.get(key) != want:
                raise ValueError(
                    f"eager updates need worker.local_optimizer_args.{key} = "
                    f"{want!r} (the server's), got {args.get(key)!r}"
                )


def _check_demo(config: ExperimentConfig) -> None:
    """What ``worker.compression='demo'`` needs (one-line errors)."""
    worker = config.worker
    check_int("worker.demo_topk", worker.demo_topk, low=1)
    chunk = check_int("worker.demo_chunk", worker.demo_chunk, low=1)
    check_number("worker.demo_decay", worker.demo_decay, low=0, high=1,
                 high_inclusive=False)  # fmt: skip
    if config.stages.compress_from_stage is not None:
        raise ValueError(
            "worker.compression='demo' compresses every push: set "
            "stages.compress_from_stage=None"
        )
    args = config.server.optimizer_args or {}
    if config.server.optimizer != "demo_outer" or args.get("chunk") != chunk:
        raise ValueError(
            "worker.compression='demo' needs server.optimizer='demo_outer' with "
            f"server.optimizer_args.chunk = worker.demo_chunk ({chunk}), got "
            f"{config.server.optimizer!r} with chunk {args.get('chunk')!r}"
        )


def _check_power_sgd(config: ExperimentConfig) -> None:
    """What ``worker.compression='power_sgd'`` needs (one-line errors)."""
    check_int("worker.powersgd_rank", config.worker.powersgd_rank, low=1)
    if config.stages.compress_from_stage is not None:
        raise ValueError(
            "worker.compression='power_sgd' compresses every push: set "
            "stages.compress_from_stage=None (it top-k sparsifies pushes instead "
            "from that stage on)"
        )
