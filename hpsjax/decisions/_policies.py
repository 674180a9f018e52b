r"""Synchronisation policies of the parameter server.

A policy answers five questions for :class:`~hpsjax.ps.ServerCore`, which keeps
all the bookkeeping and asks them at the right moments
(:class:`~hpsjax.decisions.Policy`):

* :meth:`Policy.admit`: may this worker's pull proceed now, or must it wait?
* :meth:`Policy.judge`: how much of a push of staleness :math:`\tau` is used
  (a weight; 0 drops it), and must the worker pull fresh parameters?
* :meth:`Policy.ready`: apply the buffered updates now (averaged)?
* :meth:`Policy.completes`: would one more push of this worker make it ready
  (asked before the push is recorded; ``None`` where it cannot tell)?
* :meth:`Policy.local_steps`: how many local steps should a worker take before its
  next push (a hint sent with each answer)?

and may keep state of its own through :meth:`Policy.on_push` and
:meth:`Policy.on_apply`. Notation: worker :math:`i` pushes an update computed on
parameters of version :math:`v_i` while the server is at version :math:`V`; its
staleness is :math:`\tau = V - v_i`; its clock :math:`c_i` counts its pushes.

Built-in policies, by name (:data:`POLICIES`, :func:`get_policy`):

=============== =============================================================
``"bsp"``       wait for every live worker each round, apply their average
``"asp"``       apply pushes at once (or every ``aggregate`` pushes: n-softsync)
``"ssp"``       bounded clock gap: proceed only if :math:`\min_j c_j \ge c_i - s`
``"saps"``      version-based straggler detection; damp or drop, force a pull
``"adsp"``      local-step hints so that all workers commit equally often
``"semi_async"`` bounded version staleness, stale pushes damped or dropped
``"hybrid"``    a sequence of stages, each async, semi-async or sync
``"ringmaster"`` ASP that ignores pushes delayed :math:`R` versions or more
``"naive_optimal"`` SGD over only the :math:`m` fastest workers
``"ringleader"`` rounds of updates over a table of every worker's gradients
``"halos"``     ASP local servers per region under a global one (simulator)
=============== =============================================================

Each family has its own module (:mod:`~hpsjax.decisions._policy` the base and
how to write your own, ``_policies_async``, ``_policies_sync``,
``_policies_staged``); this one names them.
"""

from __future__ import annotations

from typing import Any

from hpsjax.decisions._policies_async import ASP, Ringmaster, SaPS, SemiAsync
from hpsjax.decisions._policies_delay import NaiveOptimal, Ringleader
from hpsjax.decisions._policies_halos import HALoS
from hpsjax.decisions._policies_staged import (
    HYBRID_MODES,
    Hybrid,
    HybridStage,
    PlannedHybrid,
)
from hpsjax.decisions._policies_sync import ADSP, BSP, SSP
from hpsjax.decisions._policy import (
    STALE_ACTIONS,
    Policy,
    PolicyView,
    Verdict,
)

__all__ = [
    "ADSP",
    "ASP",
    "BSP",
    "DEFAULT_POLICY",
    "HYBRID_MODES",
    "HALoS",
    "POLICIES",
    "SSP",
    "STALE_ACTIONS",
    "Hybrid",
    "HybridStage",
    "NaiveOptimal",
    "PlannedHybrid",
    "Policy",
    "PolicyView",
    "Ringleader",
    "Ringmaster",
    "SaPS",
    "SemiAsync",
    "Verdict",
    "get_policy",
]


POLICIES: dict[str, type[Policy]] = {
    "asp": ASP,
    "bsp": BSP,
    "ssp": SSP,
    "saps": SaPS,
    "adsp": ADSP,
    "semi_async": SemiAsync,
    "hybrid": Hybrid,
    "ringmaster": Ringmaster,
    "naive_optimal": NaiveOptimal,
    "ringleader": Ringleader,
    "halos": HALoS,
}
"""Built-in policies by name."""

DEFAULT_POLICY = "bsp"
"""The policy of a server told none (:class:`hpsjax.ps.Server`,
``hpsjax-server``; ``hpsjax-launch`` has the same): synchronous rounds, the
baseline every other scheme is measured against."""


def get_policy(name_or_obj: str | Policy | type[Policy], **kwargs: Any) -> Policy:
    """Returns a policy from its name, its class or itself.

    Args:
      name_or_obj: a name in :data:`POLICIES` (case-insensitive), a
        :class:`Policy` subclass, or a :class:`Policy` object (returned as is).
      **kwargs: keyword arguments of the policy's constructor (none allowed with
        an object).

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: for an unknown name, bad or unknown keyword arguments, or
        keyword arguments given with an object.

    Examples:
      >>> from hpsjax.decisions._policies import get_policy
      >>> get_policy("ssp", staleness_bound=2)
      SSP(staleness_bound=2)
      >>> get_policy("nope")
      Traceback (most recent call last):
      ...
      ValueError: Unknown policy 'nope'; valid names are adsp, asp, bsp, halos, \
hybrid, naive_optimal, ringleader, ringmaster, saps, semi_async, ssp.
    """
    if isinstance(name_or_obj, Policy):
        if kwargs:
            raise ValueError(
                f"Keyword arguments {sorted(kwargs)} given with a policy object; "
                "pass them to its constructor instead."
            )
        return name_or_obj
    if isinstance(name_or_obj, type) and issubclass(name_or_obj, Policy):
        cls = name_or_obj
    elif isinstance(name_or_obj, str):
        cls = POLICIES.get(name_or_obj.lower())
        if cls is None:
            raise ValueError(
                f"Unknown policy {name_or_obj!r}; valid names are "
                f"{', '.join(sorted(POLICIES))}."
            )
    else:
        raise ValueError(
            "A policy must be a name, a Policy subclass or a Policy object, got "
            f"{type(name_or_obj).__name__}."
        )
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"Bad arguments for policy {cls.name!r}: {err}") from None
