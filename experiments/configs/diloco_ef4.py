"""MuLoCo's first ablation: DiLoCo with MuLoCo's 4-bit error-feedback pushes.

DiLoCo as ``diloco.py`` runs it (H inner Adam steps, outer Nesterov, BSP),
its pseudo-gradients pushed quantized to 4 bits with error feedback
(``worker.bits``, ``worker.error_feedback``) exactly as ``muloco.py`` pushes
them. Against MuLoCo it isolates what Muon adds (both compress alike);
against DiLoCo, what the compression costs. MuLoCo's paper compares its
compressed MuLoCo with compressed DiLoCo the same way.

Launch::

  python -m experiments.run --config=experiments/configs/diloco_ef4.py:sim8 \\
      --workdir=/tmp/hpsjax/diloco_ef4

References:
  Therien, Huang, Defazio, Rish, Belilovsky, "MuLoCo: Muon is a practical
  inner optimizer for DiLoCo", 2025, https://arxiv.org/abs/2505.23725
"""

from experiments.configs import diloco


def get_config(arg=None):
    """DiLoCo with 4-bit error-feedback pushes for setting ``arg``."""
    config = diloco.get_config(arg)
    config.scheme = "diloco_ef4"
    config.worker.bits = 4
    config.worker.error_feedback = True
    return config
