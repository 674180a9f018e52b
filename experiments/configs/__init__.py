"""Experiment configs: one file per scheme, shared settings in ``common.py``.

Each ``<scheme>.py`` has ``get_config(arg=None)``, returning a typed
:class:`~experiments.configs.schema.ExperimentConfig`; pick a setting with
``--config=experiments/configs/<scheme>.py:<setting>`` (see ``common.SETTINGS``).
Suites for ``python -m experiments.compare`` are in ``suites.py``.
"""

SCHEMES: tuple[str, ...] = (
    "bsp",
    "asp",
    "ssp",
    "staleness_aware_asp",
    "dc_asgd",
    "local_sgd",
    "saps",
    "hps",
    "adsp",
    "ashl",
    "ps_plus",
    "ashl_reference",
    "diloco",
    "async_diloco",
    "ringmaster",
    "ringmaster_stop",
    "clipped_asgd",
    "naive_optimal",
    "ringleader",
    "ormo",
    "ormo_da",
    "sparseloco",
    "muloco",
    "diloco_ef4",
    "muloco_f32",
    "streaming_diloco",
    "asgd_momentum",
    "streaming_diloco_eager",
    "demo",
    "diloco_delayed",
    "halos",
)
"""Schemes with a config file ``experiments/configs/<scheme>.py``, in table order."""

SIM_ONLY_SCHEMES: tuple[str, ...] = ("halos",)
"""Schemes left out of the processes suites and smoke runs: ``halos``, whose
local servers per region under a global one the simulator builds."""
