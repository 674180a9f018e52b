"""Suites for ``python -m experiments.compare``: schemes run in one setting.

A suite is a list of schemes (each ``experiments/configs/<scheme>.py``) and one
heterogeneity setting of ``common.SETTINGS``; every scheme of a suite gets the
same data, model, workers, target accuracy and time budget. A suite of all
schemes is named after its setting.

* ``demo``: the README quick start: all schemes, 4 simulated workers with
  speeds 1:1:2:4 (setting ``demo``); a few minutes on 2 CPU cores.
* ``sim8``: all schemes, 8 simulated workers, step times spread 6x, transient
  and one slowing-down straggler (setting ``sim8``).
* ``sim8_slowlink``: ``sim8`` behind links 8 times slower.
* ``proc4``: all schemes but the simulator-only ones
  (``registry.SIM_ONLY_SCHEMES``), 4 real worker processes with speeds 1:1:2:4 and a
  real server on loopback (setting ``proc4``).
* ``sim32``: the research schemes on 32 simulated workers whose step times
  follow the single-GPU ResNet-50 v1.5 training throughputs that NVIDIA
  publishes for its DeepLearningExamples (``PyTorch/Classification/ConvNets/
  resnet50v1.5/README.md``, "Training performance results", pytorch-21.03 NGC
  container, 1 GPU): A100 80GB mixed precision 2470 img/s, V100 16GB mixed
  precision 1200, A100 80GB TF32 938, V100 16GB FP32 367. Eight workers of each
  of these four accelerator configurations (two GPU generations at two
  precisions) get slowdowns 2470 / throughput: 1, 2.06, 2.63, 6.73 (setting
  ``sim32`` of ``common.SETTINGS``).
* ``quick``: all schemes at smoke-test size (setting ``quick``), seconds each.
* ``lm_sim8``, ``lm_sim32``, ``lm_proc4``: every scheme training the byte-level
  transformer language model (task ``lm``, to a validation loss) on sim8's and
  sim32's simulated workers and on proc4's four real processes (settings
  ``lm_sim8``, ``lm_sim32``, ``lm_proc4`` of ``common.SETTINGS``).
* ``devices``: BSP, H-PS, ASP and ASHL (the reference's) on real devices:
  worker processes on ``gpu:0, cpu:4, cpu:2, cpu:1`` (CPU core sets only on a
  machine without a GPU), the server on cores of its own (setting
  ``devices``).
"""

from __future__ import annotations

import dataclasses

from experiments.configs import SCHEMES, SIM_ONLY_SCHEMES

__all__ = ["RESEARCH_SCHEMES", "SUITES", "Suite"]

RESEARCH_SCHEMES: tuple[str, ...] = (
    "bsp",
    "asp",
    "hps",
    "adsp",
    "ashl",
    "ashl_reference",
    "diloco",
    "async_diloco",
)
"""The schemes of the research comparison (RESULTS.md, "Research fidelity")."""


@dataclasses.dataclass(frozen=True)
class Suite:
    """Schemes compared in one setting.

    Attributes:
      setting: a name of ``experiments.configs.common.SETTINGS``.
      schemes: scheme names (``experiments.registry.SCHEMES``), in table order;
        ``"bsp"`` among them gives the speedup column its baseline.
      backend: ``"sim"`` or ``"processes"`` to override the setting's backend,
        or ``None``.
      description: one line for the results file.
    """

    setting: str
    schemes: tuple[str, ...] = SCHEMES
    backend: str | None = None
    description: str = ""


SUITES: dict[str, Suite] = {
    "demo": Suite(
        "demo",
        description="4 simulated workers, speeds 1:1:2:4, transient stragglers",
    ),
    "sim8": Suite(
        "sim8",
        description=(
            "8 simulated workers, step times 1, 1, 1.5, 2, 2, 3, 4, 6, 2% "
            "transient 4x stragglers, worker 1 3x slower from t = 20 s"
        ),
    ),
    "sim8_slowlink": Suite(
        "sim8_slowlink",
        description=(
            "sim8's workers behind links 8 times slower (0.5 MB/s, 10 ms "
            "latency), the hyperparameters tuned on sim8 unchanged"
        ),
    ),
    "proc4": Suite(
        "proc4",
        schemes=tuple(s for s in SCHEMES if s not in SIM_ONLY_SCHEMES),
        description="4 worker processes, speeds 1:1:2:4, a real server on loopback",
    ),
    "proc3_hidden": Suite(
        "proc3_hidden",
        schemes=tuple(s for s in SCHEMES if s not in SIM_ONLY_SCHEMES),
        description="proc4's CNN on 3 worker processes, slowdowns 1, 2.5, 6, 20 MB/s",
    ),
    "proc3_mlp": Suite(
        "proc3_mlp",
        schemes=tuple(s for s in SCHEMES if s not in SIM_ONLY_SCHEMES),
        description="an MLP on 3 worker processes, slowdowns 1, 2, 4, 5 MB/s, 2 ms",
    ),
    "sim32": Suite(
        "sim32",
        schemes=RESEARCH_SCHEMES,
        description=(
            "32 simulated workers, 8 each at slowdowns 1, 2.06, 2.63, 6.73 (the "
            "ResNet-50 training throughputs of A100 AMP, V100 AMP, A100 TF32 "
            "and V100 FP32 in NVIDIA's DeepLearningExamples), sim8's links"
        ),
    ),
    "quick": Suite("quick", description="every scheme at smoke-test size"),
    "lm_sim8": Suite(
        "lm_sim8",
        description=(
            "a byte-level transformer language model on sim8's 8 simulated "
            "workers (step times 1, 1, 1.5, 2, 2, 3, 4, 6, stragglers, 4 MB/s links)"
        ),
    ),
    "lm_sim32": Suite(
        "lm_sim32",
        description=(
            "a byte-level transformer language model on sim32's 32 simulated "
            "workers (8 each at slowdowns 1, 2.06, 2.63, 6.73)"
        ),
    ),
    "lm_proc4": Suite(
        "lm_proc4",
        schemes=tuple(s for s in SCHEMES if s not in SIM_ONLY_SCHEMES),
        description=(
            "a byte-level transformer language model on 4 worker processes, "
            "speeds 1:1:2:4, a real server on loopback"
        ),
    ),
    "devices": Suite(
        "devices",
        schemes=("bsp", "hps", "asp", "ashl_reference"),
        description=(
            "4 worker processes on gpu:0, cpu:4, cpu:2, cpu:1 (core sets only "
            "without a GPU), the server on 3 cores of its own"
        ),
    ),
    "lm_devices": Suite(
        "lm_devices",
        schemes=("bsp", "hps", "asp", "ashl_reference"),
        description=(
            "the byte-level transformer language model on the devices suite's "
            "4 worker processes (gpu:0, cpu:4, cpu:2, cpu:1) and server cores"
        ),
    ),
}
"""Suites by name."""
