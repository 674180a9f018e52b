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
* :func:`top_k`: top-k sparsification with error feedback (Deep Gradient
  Compression); :func:`topk_encode` / :func:`topk_decode` are its wire codec of
  indices and values.
* :func:`power_sgd`: PowerSGD's rank-r compression with warm start and error
  feedback; :func:`powersgd_encode` / :func:`powersgd_decode` send the factors.
* :func:`lookahead_momentum`: heavy-ball momentum whose parameters run ahead
  by the update's staleness (extra argument ``staleness``), for pipelined
  pushes' known one-round delay; :func:`lookahead_coefficient` its look-ahead.
* :func:`delayed_nesterov` and :func:`diloco_outer`: outer optimizers for the
  server's step on pseudo-gradients (async local SGD, DiLoCo).
* :func:`ordered_momentum`: OrMo, momentum for asynchronous SGD ordered by the
  iteration each gradient was computed at (extra argument ``staleness``).
* :func:`gradient_table`: Ringleader ASGD's server step on the average of every
  worker's gradients in a table (extra arguments ``slot`` and ``op``).
* :func:`sparseloco`: SparseLoCo's push (decayed error feedback, top-k per
  chunk, values on 2 bits decoded to their bins' centroids,
  :func:`centroid_quantize`); :func:`sparseloco_nbytes` its bytes.
* :func:`streaming_local`, :func:`streaming_push` and :func:`streaming_outer`:
  Streaming DiLoCo (fragments synchronised in turn, few-bit outer gradients;
  ``streaming_local(eager=True)``: its eager updates);
  :func:`streaming_fragment_nbytes` the bytes of each fragment.
* :func:`demo` and :func:`demo_outer`: DeMo, a worker's push of the top DCT
  coefficients of its momentum per chunk (the momentum is the error
  feedback) and the server's signed step on them; :func:`demo_nbytes` its
  bytes.
* :func:`sparse_push_transform` and :func:`sparse_encoded`: a worker's
  DeMo, SparseLoCo or Streaming DiLoCo push from a JSON spec, sent as top-k leaves.
"""

from hpsjax.transforms._demo import (
    DeMoState,
    block_dct,
    block_idct,
    demo,
    demo_chunk,
    demo_nbytes,
    demo_outer,
    last_demo_nbytes,
)
from hpsjax.transforms._frontier import (
    OrderedMomentumState,
    SparseLoCoState,
    centroid_quantize,
    last_sparseloco_nbytes,
    ordered_momentum,
    sparseloco,
    sparseloco_nbytes,
)
from hpsjax.transforms._local_steps import (
    LocalStepsState,
    local_steps,
    pending_update,
    push_due,
)
from hpsjax.transforms._lookahead import (
    LookaheadMomentumState,
    lookahead_coefficient,
    lookahead_momentum,
)
from hpsjax.transforms._outer import (
    DelayedNesterovState,
    delayed_nesterov,
    diloco_outer,
)
from hpsjax.transforms._powersgd import (
    PowerSGDEncoded,
    PowerSGDState,
    last_powersgd_encoded,
    power_sgd,
    powersgd_decode,
    powersgd_decode_tree,
    powersgd_encode,
    powersgd_matrix_shape,
    powersgd_nbytes,
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
from hpsjax.transforms._sparse_push import (
    SPARSE_PUSHES,
    sparse_encoded,
    sparse_push_transform,
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
from hpsjax.transforms._streaming import (
    E2M1_GRID,
    LAYOUTS,
    StreamingDelayState,
    StreamingEagerState,
    StreamingLocalState,
    StreamingOuterState,
    StreamingPushState,
    check_layout,
    e2m1_round,
    fragment_bounds,
    last_streaming_nbytes,
    leaf_blocks,
    streaming_fragment_nbytes,
    streaming_local,
    streaming_outer,
    streaming_push,
)
from hpsjax.transforms._table import TABLE_OPS, GradientTableState, gradient_table
from hpsjax.transforms._topk import (
    TopKEncoded,
    TopKState,
    last_topk_encoded,
    top_k,
    topk_count,
    topk_decode,
    topk_decode_tree,
    topk_encode,
    topk_encode_tree,
    topk_index_dtype,
    topk_nbytes,
)

__all__ = [
    "SCHEMES",
    "SPARSE_PUSHES",
    "STAGE_MODES",
    "STALENESS_POLICIES",
    "TABLE_OPS",
    "Codec",
    "DelayCompensationState",
    "DeMoState",
    "DelayedNesterovState",
    "Encoded",
    "GradientTableState",
    "HybridStagesState",
    "LocalStepsState",
    "LookaheadMomentumState",
    "OrderedMomentumState",
    "PowerSGDEncoded",
    "PowerSGDState",
    "QuantizeState",
    "ScaleByStalenessState",
    "SparseLoCoState",
    "Stage",
    "StageInfo",
    "E2M1_GRID",
    "LAYOUTS",
    "StreamingDelayState",
    "StreamingEagerState",
    "StreamingLocalState",
    "StreamingOuterState",
    "StreamingPushState",
    "TopKEncoded",
    "TopKState",
    "block_dct",
    "block_idct",
    "current_stage",
    "decode",
    "decode_tree",
    "delay_compensation",
    "delayed_nesterov",
    "demo",
    "demo_chunk",
    "demo_nbytes",
    "demo_outer",
    "diloco_outer",
    "centroid_quantize",
    "check_layout",
    "e2m1_round",
    "encode",
    "encode_tree",
    "encoded_nbytes",
    "fragment_bounds",
    "gradient_table",
    "hybrid_stages",
    "last_demo_nbytes",
    "last_encoded",
    "last_powersgd_encoded",
    "last_sparseloco_nbytes",
    "last_streaming_nbytes",
    "last_topk_encoded",
    "leaf_blocks",
    "local_steps",
    "lookahead_coefficient",
    "lookahead_momentum",
    "ordered_momentum",
    "pending_update",
    "power_sgd",
    "powersgd_decode",
    "powersgd_decode_tree",
    "powersgd_encode",
    "powersgd_matrix_shape",
    "powersgd_nbytes",
    "push_due",
    "quantize",
    "scale_by_staleness",
    "sparse_encoded",
    "sparse_push_transform",
    "sparseloco",
    "sparseloco_nbytes",
    "stage_settings",
    "staleness_factor",
    "streaming_fragment_nbytes",
    "streaming_local",
    "streaming_outer",
    "streaming_push",
    "top_k",
    "topk_count",
    "topk_decode",
    "topk_decode_tree",
    "topk_encode",
    "topk_encode_tree",
    "topk_index_dtype",
    "topk_nbytes",
]
