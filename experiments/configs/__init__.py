"""Experiment configs: one file per scheme, shared settings in ``common.py``.

Each ``<scheme>.py`` has ``get_config(arg=None)``; pick a setting with
``--config=experiments/configs/<scheme>.py:<setting>`` (see ``common.SETTINGS``).
Suites for ``python -m experiments.compare`` are in ``suites.py``.
"""
