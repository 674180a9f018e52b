"""Backends: run one scheme's config and report what happened, in one shape.

* ``sim``: :func:`hpsjax.sim.simulate` on simulated workers (virtual time;
  :mod:`experiments.sim_backend`);
* ``processes``: a real :class:`hpsjax.ps.Server` in this process and one
  ``hpsjax-worker`` process per worker on loopback, started and watched by
  :mod:`hpsjax.launch` (wall time; :mod:`experiments.process_backend`, the
  workers' settings from :mod:`experiments.worker_flags`).

Both return a :class:`RunOutput` (:mod:`experiments.run_output`): evaluations over
time, per-worker totals, per-worker timelines (compute, transfer, wait,
discarded), and raw records. :data:`BACKENDS` picks one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from experiments.process_backend import _pilot_rounds as _pilot_rounds
from experiments.process_backend import _worker_timeline as _worker_timeline
from experiments.process_backend import measured_round, run_processes
from experiments.run_output import TIMELINE_KINDS, RunOutput
from experiments.run_output import _overlap as _overlap
from experiments.run_output import _replanner as _replanner
from experiments.sim_backend import run_sim
from experiments.worker_flags import _push_compression as _push_compression
from experiments.worker_flags import _worker_flags as _worker_flags
from experiments.worker_flags import run_config

__all__ = [
    "BACKENDS",
    "TIMELINE_KINDS",
    "RunOutput",
    "measured_round",
    "run_config",
    "run_processes",
    "run_sim",
]

BACKENDS: Mapping[str, Callable[..., RunOutput]] = {
    "sim": run_sim,
    "processes": run_processes,
}
"""Backends by name (``config.backend``)."""
