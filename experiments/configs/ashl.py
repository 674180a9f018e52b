"""ASHL: profiling, then AHL (async, many local steps), then SHL (semi-async).

A profiling pass measures every worker; ``hpsjax.profiling.plan(scheme="ashl")``
gives worker ``i`` local steps ``H_i`` so that ``H_i t_i + T_i`` is the same for
all (a fast worker takes more local steps per push). Stage AHL is asynchronous
with ``ahl_local_steps`` for the slowest worker and a loose staleness bound
(rare, coarse communication); once the server reaches ``switch_version``
(``stages.switch="version"``) or the loss flattens (``"plateau"``), stage SHL is
semi-asynchronous with few local steps and a tight bound (frequent, fine
communication). Pushes are quantized to 8 bits with error feedback throughout.

Launch::

  python -m experiments.run --config=experiments/configs/ashl.py:sim8 \\
      --workdir=/tmp/hpsjax/ashl

References:
  Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
  Distributed Deep Learning Training Scheme for Heterogeneous Environments",
  IEEE Trans. Computers 73(1), 2024, https://doi.org/10.1109/TC.2023.3315847
"""

from experiments.configs import common


def get_config(arg=None):
    """ASHL for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ashl"
    config.server.policy = "hybrid"
    config.server.optimizer = "sgd"
    # Pushes are applied as they come (async and semi-async stages), so each
    # moves the server by a quarter of the worker's local progress.
    config.server.learning_rate = 0.25
    config.worker.local_optimizer = "sgd"
    config.worker.local_learning_rate = common.pick(config, {"default": 0.4})
    config.worker.bits = 8
    config.worker.error_feedback = True
    config.plan.scheme = "ashl"
    config.plan.lr_scaling = "none"
    config.plan.max_local_steps = 8
    config.stages.enabled = True
    config.stages.switch = "version"
    config.stages.switch_version = common.pick(config, {"quick": 20, "default": 100})
    config.stages.ahl_local_steps = 4
    config.stages.ahl_max_staleness = 32
    config.stages.shl_local_steps = 2
    config.stages.shl_max_staleness = 4
    return config
