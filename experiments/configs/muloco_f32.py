"""MuLoCo's second ablation: MuLoCo with float32 pushes.

MuLoCo as ``muloco.py`` runs it (H inner Muon steps, outer Nesterov, BSP)
but its pseudo-gradients pushed in float32, uncompressed (``worker.bits``
None). Against DiLoCo it isolates what Muon does for the same bytes;
against MuLoCo, what its 4-bit error feedback costs in quality. Without it,
MuLoCo's "8x less communication" is the 4-bit quantizer's, built in.

Launch::

  python -m experiments.run --config=experiments/configs/muloco_f32.py:sim8 \\
      --workdir=/tmp/hpsjax/muloco_f32

References:
  Therien, Huang, Defazio, Rish, Belilovsky, "MuLoCo: Muon is a practical
  inner optimizer for DiLoCo", 2025, https://arxiv.org/abs/2505.23725
"""

from experiments.configs import muloco


def get_config(arg=None):
    """MuLoCo with float32 pushes for setting ``arg``."""
    config = muloco.get_config(arg)
    config.scheme = "muloco_f32"
    config.worker.bits = None
    return config
