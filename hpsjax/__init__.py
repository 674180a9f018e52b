"""hpsjax: train one JAX model on workers of unequal speed through a parameter server.

The optax transforms are re-exported here; the rest lives in subpackages:

* :mod:`hpsjax.transforms`: quantization, top-k and PowerSGD compression with
  error feedback, staleness damping, delay compensation, local steps, hybrid
  stages, outer optimizers (Delayed Nesterov, DiLoCo), OrMo's ordered momentum
  and SparseLoCo's push (optax transforms);
* :mod:`hpsjax.ps`: the sans-I/O server core, sync policies, asyncio server and
  client, wire codec and checkpoints;
* :mod:`hpsjax.planning`: work plans from profiles (pure arithmetic, no JAX);
* :mod:`hpsjax.profiling`: the profiling pass, the in-place profile, the pilot;
* :mod:`hpsjax.sim`: the virtual-clock simulator driving the same server core;
* :mod:`hpsjax.worker`: the worker runtime and heterogeneity injection;
* :mod:`hpsjax.tasks`: what is learned (classification, next-token language
  modelling, regression, or a user's task), :mod:`hpsjax.models` the flax
  models (an MLP, CNN, ResNet and a transformer language model, or any flax
  NNX module from a factory) and :mod:`hpsjax.data` the offline datasets.

``import hpsjax`` loads nothing more: the transforms (and JAX behind them)
are imported on first use of one of their names, so a module of the package
that needs no JAX (the launcher's process handling, flag parsing) can be
imported without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpsjax.transforms import (
        Codec,
        Stage,
        current_stage,
        decode,
        delay_compensation,
        delayed_nesterov,
        diloco_outer,
        encode,
        hybrid_stages,
        last_encoded,
        local_steps,
        ordered_momentum,
        pending_update,
        power_sgd,
        push_due,
        quantize,
        scale_by_staleness,
        sparseloco,
        stage_settings,
        staleness_factor,
        top_k,
    )

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "Stage",
    "current_stage",
    "decode",
    "delay_compensation",
    "delayed_nesterov",
    "diloco_outer",
    "encode",
    "hybrid_stages",
    "last_encoded",
    "local_steps",
    "ordered_momentum",
    "pending_update",
    "power_sgd",
    "push_due",
    "quantize",
    "scale_by_staleness",
    "sparseloco",
    "stage_settings",
    "staleness_factor",
    "top_k",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the transforms (and JAX behind them) load on first use.
    if name in __all__ or name == "transforms":
        transforms = importlib.import_module("hpsjax.transforms")
        value = transforms if name == "transforms" else getattr(transforms, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpsjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
