"""Ringmaster ASGD with calculation stops: a computation R versions behind stops.

Ringmaster ASGD (``ringmaster.py``: a gradient delayed R versions or more is
ignored) in the paper's second form: each time the server applies a version
k, every worker still computing on version k - R or older is told to stop
(``hpsjax.ps.Ringmaster(stop_stale=True)``; the decision is the policy's
``stops``, carried out as a forced pull by the server and the simulator
alike). It drops that round and pulls x_k, so no time goes into a gradient
that would be ignored. In the simulator the computation stops at once; a
real worker cannot interrupt a compiled step, so it drops the step's result
when the step ends instead of pushing it. R and the step size are tuned as
for ``ringmaster`` (``experiments.frontier``).

Launch::

  python -m experiments.run --config=experiments/configs/ringmaster_stop.py:sim8 \\
      --workdir=/tmp/hpsjax/ringmaster_stop

References:
  Maranjyan, Tyurin, Richtarik, "Ringmaster ASGD: The First Asynchronous SGD
  with Optimal Time Complexity", ICML 2025, https://arxiv.org/abs/2501.16168
  (Ringmaster ASGD with calculation stops)
"""

from experiments.configs import ringmaster


def get_config(arg=None):
    """Ringmaster ASGD with calculation stops for setting ``arg``."""
    config = ringmaster.get_config(arg)
    config.scheme = "ringmaster_stop"
    config.server.policy_kwargs.stop_stale = True
    return config
