"""hpsjax: train one JAX model on workers of unequal speed through a parameter server.

The optax transforms are re-exported here; the rest lives in subpackages:

* :mod:`hpsjax.transforms`: quantization, top-k and PowerSGD compression with
  error feedback, staleness damping, delay compensation, local steps, hybrid
  stages, outer optimizers (Delayed Nesterov, DiLoCo), OrMo's ordered momentum
  and SparseLoCo's push (optax transforms);
* :mod:`hpsjax.ps`: the sans-I/O server core, sync policies, asyncio server and
  client, wire codec and checkpoints;
* :mod:`hpsjax.profiling`: the profiling pass and work plans;
* :mod:`hpsjax.sim`: the virtual-clock simulator driving the same server core;
* :mod:`hpsjax.worker`: the worker runtime and heterogeneity injection.
"""

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
