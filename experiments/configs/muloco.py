"""MuLoCo: DiLoCo with Muon as the inner optimizer and quantized deltas.

Each round every worker starts from the global parameters, takes
``worker.local_steps`` inner steps with Muon (``optax.contrib.muon`` by name
through the optimizer registry: orthogonalised momentum on the weight
matrices, Adam on the rest) and pushes its pseudo-gradient quantized to 4 bits
with error feedback (``worker.bits``). The server waits for all (BSP),
averages the pushes and takes DiLoCo's outer Nesterov step (outer learning
rate 0.7, momentum 0.9). The two ablations that tell Muon's share from the
4-bit compression's are ``diloco_ef4.py`` (DiLoCo with these same 4-bit
error-feedback pushes) and ``muloco_f32.py`` (MuLoCo with float32 pushes).

Launch::

  python -m experiments.run --config=experiments/configs/muloco.py:sim8 \\
      --workdir=/tmp/hpsjax/muloco

References:
  Therien, Huang, Defazio, Rish, Belilovsky, "MuLoCo: Muon is a practical
  inner optimizer for DiLoCo", 2025, https://arxiv.org/abs/2505.23725
"""

from experiments.configs import common


def get_config(arg=None):
    """MuLoCo for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "muloco"
    config.server.policy = "bsp"
    config.server.optimizer = "nesterov"
    config.server.learning_rate = common.pick(config, {"default": 0.7})
    config.server.momentum = 0.9
    config.worker.local_optimizer = "muon"
    # Muon's usual step size (not tuned here).
    config.worker.local_learning_rate = common.pick(
        config, {"default": 0.02, "quick": 0.005}
    )
    config.worker.local_steps = common.pick(config, {"default": 8})
    config.worker.bits = 4
    config.worker.error_feedback = True
    return config
