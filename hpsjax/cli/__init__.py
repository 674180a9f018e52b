"""The console commands that run what the layers below them hold.

:mod:`hpsjax.cli.worker` is ``hpsjax-worker`` (``python -m hpsjax.cli.worker``):
it trains one worker against a parameter server or, with ``--profile_out``,
measures it in place (:mod:`hpsjax.profiling.in_place`), so it stands above
both the worker and measurement.
"""

__all__: list[str] = []
