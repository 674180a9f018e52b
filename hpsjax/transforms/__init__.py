"""optax gradient transformations for training through a parameter server.

All are ``optax.GradientTransformationExtraArgs``: pure, jittable, chainable with
any optax optimizer.

* :func:`quantize`: compress an update before it is pushed (uniform b-bit, QSGD,
  scaled sign), with stochastic rounding and error feedback; :func:`encode` /
  :func:`decode` are the same code packed into the bytes the wire sends.
* :func:`scale_by_staleness`: damp an update by its staleness (keyword extra
  argument ``staleness``); :func:`staleness_factor` is the same rule as a function.
* :func:`delay_compensation`: DC-ASGD's correction (extra argument
  ``stale_params``).
* :func:`local_steps`: accumulate k local updates and say when a push is due.
* :func:`hybrid_stages`: ASHL's stage machine (async, then semi-async, ...).
"""

from hpsjax.transforms._local_steps import (
    LocalStepsState,
    local_steps,
    pending_update,
    push_due,
)
from hpsjax.transforms._quantize import (
    SCHEMES,
    Codec,
    Encoded,
    QuantizeState,
    decode,
    decode_tree,
    encode,
    encode_tree,
    encoded_nbytes,
    last_encoded,
    quantize,
)
from hpsjax.transforms._stages import (
    STAGE_MODES,
    HybridStagesState,
    Stage,
    StageInfo,
    current_stage,
    hybrid_stages,
    stage_settings,
)
from hpsjax.transforms._staleness import (
    STALENESS_POLICIES,
    DelayCompensationState,
    ScaleByStalenessState,
    delay_compensation,
    scale_by_staleness,
    staleness_factor,
)

__all__ = [
    "SCHEMES",
    "STAGE_MODES",
    "STALENESS_POLICIES",
    "Codec",
    "DelayCompensationState",
    "Encoded",
    "HybridStagesState",
    "LocalStepsState",
    "QuantizeState",
    "ScaleByStalenessState",
    "Stage",
    "StageInfo",
    "current_stage",
    "decode",
    "decode_tree",
    "delay_compensation",
    "encode",
    "encode_tree",
    "encoded_nbytes",
    "hybrid_stages",
    "last_encoded",
    "local_steps",
    "pending_update",
    "push_due",
    "quantize",
    "scale_by_staleness",
    "stage_settings",
    "staleness_factor",
]
