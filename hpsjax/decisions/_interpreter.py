"""One action loop for every driver of the server's decisions.

:class:`ActionInterpreter` carries out the actions a
:class:`~hpsjax.decisions.ServerCore` returns, in order, handing each to the
driver's handler for its type; the asyncio server (:mod:`hpsjax.net`) and the
simulator (:mod:`hpsjax.sim`) each give a table of handlers and share the
loop. A driver names every action it takes, an ignored one with
:meth:`ActionInterpreter.ignore`; an action it has no handler for fails loudly
(``TypeError``) instead of passing unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hpsjax.decisions._actions import ACTIONS

__all__ = ["ActionInterpreter"]


class ActionInterpreter:
    """Carries out a core's actions through one handler per action type.

    Args:
      handlers: ``{action type: handler}``; each handler takes the action.

    Raises:
      ValueError: a key is not an action type.

    Examples:
      >>> from hpsjax.decisions import ActionInterpreter, Drop, Wait
      >>> dropped = []
      >>> carry_out = ActionInterpreter(
      ...     {Drop: dropped.append, Wait: ActionInterpreter.ignore}
      ... )
      >>> carry_out([Wait("a", None, "round"), Drop("b", "missed its deadline")])
      >>> dropped
      [Drop(worker_id='b', reason='missed its deadline')]
      >>> carry_out(["not an action"])
      Traceback (most recent call last):
      ...
      TypeError: no handler for the action 'not an action'
    """

    __slots__ = ("_handlers",)

    def __init__(self, handlers: Mapping[type, Callable[[Any], Any]]):
        unknown = [kind for kind in handlers if kind not in ACTIONS]
        if unknown:
            raise ValueError(
                f"not action types: {', '.join(map(repr, unknown))}; the actions "
                f"are {', '.join(kind.__name__ for kind in ACTIONS)}"
            )
        self._handlers = dict(handlers)

    @property
    def handled(self) -> frozenset:
        """The action types this interpreter carries out."""
        return frozenset(self._handlers)

    def __call__(self, actions: Iterable[Any]) -> None:
        """Carries out ``actions`` in order.

        Raises:
          TypeError: an action has no handler (the ones before it were
            carried out).
        """
        handlers = self._handlers
        for action in actions:
            handler = handlers.get(type(action))
            if handler is None:
                raise TypeError(f"no handler for the action {action!r}")
            handler(action)

    @staticmethod
    def ignore(action: Any) -> None:
        """The handler of an action a driver takes and needs do nothing for."""
        del action
