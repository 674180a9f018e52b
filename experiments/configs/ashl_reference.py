"""ASHL as its authors' public code runs it (``ashl.py`` is our reading).

A profiling pass measures every worker; ``hpsjax.profiling.plan(scheme=
"ashl_reference")`` gives worker ``i`` two local step counts, ``H_i(8)`` and
``H_i(2)``, so that ``H_i(k) c_i + m_i`` is the same for all workers (``c_i``
its seconds per step, ``m_i`` its communication), and a weight
``p_i = H_i(2) / sum_j H_j(2)``.

* **AHL** (stage 1): asynchronous; each worker runs ``H_i(8)`` local SGD steps
  and pushes its delta in full precision; the server adds ``p_i`` times it
  at once (``server.optimizer=sgd(1.0)`` on pushes weighted by the plan's
  ``push_weight``; no damping, no server momentum).
* **The switch**: the server keeps a moving average of the training losses
  the workers report with their pushes and moves to SHL once it is below
  ``stages.switch_loss``; each worker learns it from the acknowledgement of
  its next push, which hints its SHL local steps.
* **SHL** (stage 2): semi-asynchronous, a worker more than 3 rounds ahead of
  the slowest waits; ``H_i(2)`` local steps per push, weighted by ``p_i``.

* **Compression**: from the SHL stage on (``stages.compress_from_stage = 1``)
  each worker's pushes are top-k sparsified (with error feedback, the wire's
  top-k codec) at its plan's ``compress_ratio``: ``plan.compress_ratio = 0.1``
  for the worker with the longest round, larger ratios for the others, so that
  every worker's compressed transfer fits the slowest worker's round. 0.1, not
  1%: the synthetic digits' model is small, and 10% still cuts SHL's bytes
  tenfold.
* **Data**: worker ``i`` trains on a share ``p_i`` of the training set (the
  plan's ``data_share``; :func:`hpsjax.data.share_split`), cut once after the
  profiling pass, as the reference re-partitions it.

Launch::

  python -m experiments.run --config=experiments/configs/ashl_reference.py:sim8 \\
      --workdir=/tmp/hpsjax/ashl_reference

References:
  Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
  Distributed Deep Learning Training Scheme for Heterogeneous Environments",
  IEEE Trans. Computers 73(1), 2024, https://doi.org/10.1109/TC.2023.3315847
"""

from experiments.configs import common


def get_config(arg=None):
    """ASHL per the reference for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ashl_reference"
    config.server.policy = "hybrid"
    config.server.optimizer = "sgd"
    config.server.learning_rate = 1.0
    config.server.momentum = 0.0
    config.worker.local_optimizer = "sgd"
    config.worker.local_learning_rate = common.pick(config, {"default": 0.1})
    config.worker.local_momentum = 0.9
    config.plan.scheme = "ashl_reference"
    config.plan.lr_scaling = "none"
    config.plan.max_local_steps = 64
    # The SHL top-k ratio of the worker with the longest round.
    config.plan.compress_ratio = 0.1
    config.stages.enabled = True
    config.stages.switch = "loss"
    # The language model's loss (nats per byte) leaves its unigram plateau,
    # about 3.1, on its way to the target.
    config.stages.switch_loss = common.pick(
        config, {"quick": 1.5, "lm_sim8": 3.0, "default": 0.3}
    )
    # The multipliers k of the two plans (AHL 8, SHL 2), as in the reference.
    config.stages.ahl_local_steps = 8
    config.stages.shl_local_steps = 2
    config.stages.shl_max_staleness = 3
    # SHL (stage 1) pushes are top-k sparsified at each worker's plan ratio.
    config.stages.compress_from_stage = 1
    return config
