"""Streaming DiLoCo with eager updates.

``streaming_diloco.py`` (P = 2 fragments, 4-bit outer gradients, BSP with
pipelined pushes) whose workers take eager updates
(``hpsjax.transforms.streaming_local(eager=True)``): while a fragment's outer
gradient travels, the worker steps that fragment from its global value with
the server's Nesterov rule on a stand-in for the average (its own fresh outer
gradient in place of its share of the others' last average, M = the setting's
workers), and when the server's step arrives replaces its estimate by it,
keeping the inner steps taken since. Without eager updates those steps are
overwritten by the merge. The workers' ``outer_learning_rate``,
``outer_momentum`` and ``fragments`` must be the server's (checked).

The outer step is a quarter of Streaming DiLoCo's: 0.175, tuned on sim8's
seed 0 among 0.7, 0.35 and 0.175 (RESULTS.md, "The frontier"). With eager
updates a fragment's outer gradient spans all H inner steps, not the H / P
since its merge, and at 0.7 the runs diverge.

Launch::

  python -m experiments.run \\
      --config=experiments/configs/streaming_diloco_eager.py:sim8 \\
      --workdir=/tmp/hpsjax/streaming_diloco_eager

References:
  Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and
  Computation in DiLoCo", 2025, https://arxiv.org/abs/2502.12996
"""

from experiments.configs import streaming_diloco


def get_config(arg=None):
    """Streaming DiLoCo with eager updates for setting ``arg``."""
    config = streaming_diloco.get_config(arg)
    config.scheme = "streaming_diloco_eager"
    config.server.learning_rate = 0.175
    args = config.worker.local_optimizer_args
    args.eager = True
    args.fragments = config.worker.streaming_fragments
    args.outer_learning_rate = config.server.learning_rate
    args.outer_momentum = config.server.momentum
    args.workers = len(config.workers.slowdowns)
    args.layout = config.worker.streaming_layout
    del args["delay"]  # eager updates merge at once
    return config
