"""OrMo-DA: OrMo with its delay-adaptive step size.

OrMo as ``ormo.py`` runs it (ASP, momentum over iterations of K gradients,
each gradient placed by the iteration it was computed at), each gradient's
step scaled by min(1, D / d) for a gradient d iterations late
(``server.optimizer_args.delay_adaptive`` = D, 1 iteration here: a gradient
older than the last iteration weighs less the older it is). Our reading of
the paper's delay-adaptive variant (``hpsjax.transforms.ordered_momentum``
says what was read).

Launch::

  python -m experiments.run --config=experiments/configs/ormo_da.py:sim8 \\
      --workdir=/tmp/hpsjax/ormo_da

References:
  Shi, Yang, Li, "Ordered Momentum for Asynchronous SGD", NeurIPS 2024,
  https://arxiv.org/abs/2407.19234
"""

from experiments.configs import ormo


def get_config(arg=None):
    """OrMo-DA for setting ``arg`` (see ``common.SETTINGS``)."""
    config = ormo.get_config(arg)
    config.scheme = "ormo_da"
    config.server.optimizer_args = {
        **config.server.optimizer_args,
        "delay_adaptive": 1.0,
    }
    return config
