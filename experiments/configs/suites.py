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
* ``proc4``: all schemes, 4 real worker processes with speeds 1:1:2:4 and a
  real server on loopback (setting ``proc4``).
* ``quick``: all schemes at smoke-test size (setting ``quick``), seconds each.
"""

from __future__ import annotations

import dataclasses

from experiments.registry import SCHEMES

__all__ = ["SUITES", "Suite"]


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
        description="4 worker processes, speeds 1:1:2:4, a real server on loopback",
    ),
    "quick": Suite("quick", description="every scheme at smoke-test size"),
}
"""Suites by name."""
