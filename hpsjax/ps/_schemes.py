"""A run's scheme by one name: the server's policy and the workers' flags it means.

A scheme name (``hps``, ``ashl``, ``ps_plus``, ``local_sgd``, or any policy's
own name: ``bsp``, ``asp``, ``ssp``, ...) works wherever a scheme is chosen:
``hpsjax-server --policy``, ``hpsjax-launch --policy``, the experiments'
``config.scheme``. Each is one :class:`Scheme` of :data:`RUN_SCHEMES`: the
server policy it runs (with its ``--policy_arg`` defaults), the flags its
workers take, and the work-plan scheme it profiles for, if any; both commands
print what a name stands for when they start.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping
from typing import Any

from hpsjax.decisions import POLICIES

__all__ = ["RUN_SCHEMES", "Scheme", "get_scheme"]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """What one scheme name stands for.

    Attributes:
      policy: the server's policy, a key of :data:`hpsjax.decisions.POLICIES`.
      policy_arg: the policy's keyword arguments (a ``--policy_arg`` given
        with the scheme replaces the one of its name).
      worker_flags: the ``hpsjax-worker`` flags every worker of the scheme
        takes (``hpsjax-launch`` adds them before the user's own).
      plan: the work-plan scheme (:data:`hpsjax.planning.SCHEMES`) the
        launcher profiles and plans for, or ``None``.
    """

    policy: str
    policy_arg: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    worker_flags: tuple[str, ...] = ()
    plan: str | None = None

    def describe(self, name: str) -> str:
        """One line saying what ``name`` stands for."""
        server = f"--policy {self.policy}" + "".join(
            f" --policy_arg {shlex.quote(f'{k}={json.dumps(v)}')}"
            for k, v in self.policy_arg.items()
        )
        workers = shlex.join(self.worker_flags) or "no flags of their own"
        plan = f"; plan {self.plan} (hpsjax-launch)" if self.plan else ""
        return f"scheme {name}: server {server}; workers {workers}{plan}"


# ASHL's two stages (experiments/configs/ashl.py): asynchronous with four
# local steps and a loose bound until version 100, then semi-asynchronous.
_ASHL_STAGES = (
    {"mode": "async", "local_steps": 4, "max_staleness": 32, "until_version": 100},
    {"mode": "semi_async", "local_steps": 2, "max_staleness": 4},
)

_PS_PLUS_FLAGS = "--overlap eager --eager_pulls 3 --staleness_lr inverse_plus_one"

RUN_SCHEMES: dict[str, Scheme] = {
    **{name: Scheme(name) for name in POLICIES},
    "hps": Scheme("bsp", worker_flags=("--bits", "8"), plan="hps"),
    "ashl": Scheme(
        "hybrid",
        {"stages": list(_ASHL_STAGES)},
        worker_flags=("--bits", "8", "--local_optimizer", "sgd"),
    ),
    "ps_plus": Scheme(
        "asp",
        worker_flags=tuple(_PS_PLUS_FLAGS.split()),
    ),
    "local_sgd": Scheme(
        "bsp", worker_flags=("--local_steps", "4", "--local_optimizer", "sgd")
    ),
}
"""The schemes by name: every policy as itself, and the schemes made of a
policy and worker flags (H-PS, ASHL, PS+, Local SGD)."""


def get_scheme(name: str, flag: str = "--policy") -> Scheme:
    """The scheme of ``name`` (case-insensitive).

    Raises:
      ValueError: an unknown name, in one line listing the valid ones.

    Examples:
      >>> get_scheme("hps").policy
      'bsp'
      >>> get_scheme("nope")
      Traceback (most recent call last):
      ...
      ValueError: unknown --policy 'nope'; valid schemes: adsp, ashl, asp, bsp, \
hps, hybrid, local_sgd, ps_plus, ringmaster, saps, semi_async, ssp
    """
    scheme = RUN_SCHEMES.get(name.lower()) if isinstance(name, str) else None
    if scheme is None:
        raise ValueError(
            f"unknown {flag} {name!r}; valid schemes: {', '.join(sorted(RUN_SCHEMES))}"
        )
    return scheme
