"""Optimizers by name: the one registry the CLIs and the experiments share.

:func:`make_optimizer` turns a name, a step size and keyword arguments into an
optax ``GradientTransformation``. A name is one of hpsjax's own
(:data:`OPTIMIZERS`: ``sgd``, ``momentum``, ``adam``, and the outer optimizers
``nesterov`` and ``delayed_nesterov``) or **any optax optimizer**: a function
of ``optax`` or ``optax.contrib`` whose first argument is ``learning_rate``
(``adamw``, ``lion``, ``muon``, ``lamb``, ``schedule_free_adamw``, ...). The
keyword arguments go to that function as they are (``hpsjax-server
--optimizer_arg weight_decay=0.01``, ``hpsjax-worker --local_optimizer_arg``,
``config.server.optimizer_args`` in the experiments).

Bad input is one ``ValueError`` line: an unknown name lists the closest names,
an unknown argument the function's arguments.

Examples:
  >>> from hpsjax._optimizers import make_optimizer
  >>> make_optimizer("adamw", 1e-3, weight_decay=0.01) is not None
  True
  >>> make_optimizer("muon", 0.02) is not None  # optax.contrib.muon
  True
  >>> make_optimizer("adamm", 1e-3)
  Traceback (most recent call last):
  ...
  ValueError: unknown optimizer 'adamm'; valid names: adam, delayed_nesterov, \
demo_outer, gradient_table, lookahead_momentum, momentum, nesterov, \
ordered_momentum, sgd, streaming_local, streaming_nesterov or any optimizer of \
optax or optax.contrib (closest: adam, radam, nadam)
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optax

from hpsjax._checks import check_number
from hpsjax.transforms import (
    delayed_nesterov,
    demo_outer,
    diloco_outer,
    gradient_table,
    lookahead_momentum,
    ordered_momentum,
    streaming_local,
    streaming_outer,
)

__all__ = [
    "OPTIMIZERS",
    "OptimizerRegistry",
    "check_optimizer",
    "make_optimizer",
    "optimizer_names",
    "resolve_optimizer",
]


def _sgd(learning_rate, *, momentum=None, **kwargs):
    if momentum:
        check_number("momentum", momentum, low=0, high=1, high_inclusive=False)
    return optax.sgd(learning_rate, momentum=momentum or None, **kwargs)


def _momentum(learning_rate, *, momentum=None, **kwargs):
    momentum = 0.9 if momentum is None else momentum
    check_number("momentum", momentum, low=0, high=1, high_inclusive=False)
    return optax.sgd(learning_rate, momentum=momentum or None, **kwargs)


def _adam(learning_rate, *, momentum=None, **kwargs):
    del momentum  # Adam's first moment is b1, an argument of its own.
    return optax.adam(learning_rate, **kwargs)


def _nesterov(learning_rate, *, momentum=None, **kwargs):
    return diloco_outer(
        learning_rate, momentum=0.9 if momentum is None else momentum, **kwargs
    )


def _delayed_nesterov(learning_rate, *, momentum=None, **kwargs):
    return delayed_nesterov(
        learning_rate, momentum=0.9 if momentum is None else momentum, **kwargs
    )


def _lookahead_momentum(learning_rate, *, momentum=None, **kwargs):
    return lookahead_momentum(
        learning_rate, momentum=0.9 if momentum is None else momentum, **kwargs
    )


def _gradient_table(learning_rate, *, momentum=None, num_slots):
    del momentum  # Ringleader ASGD's step is plain SGD on the table's average.
    return gradient_table(learning_rate, num_slots)


def _ordered_momentum(learning_rate, *, momentum=None, **kwargs):
    return ordered_momentum(
        learning_rate, momentum=0.9 if momentum is None else momentum, **kwargs
    )


_EAGER_ARGS = (
    "eager",
    "fragments",
    "outer_learning_rate",
    "outer_momentum",
    "workers",
    "delay",
    "layout",
)


def _streaming_local(learning_rate, *, momentum=None, inner="adam", mixing=0.0, **kw):
    if inner == "streaming_local":
        raise ValueError("streaming_local cannot wrap itself")
    eager = {k: kw.pop(k) for k in _EAGER_ARGS if k in kw}
    inner_tx = make_optimizer(inner, learning_rate, momentum=momentum, **kw)
    return streaming_local(inner_tx, mixing=mixing, **eager)


def _streaming_nesterov(
    learning_rate, *, momentum=None, fragments=1, layout="contiguous"
):
    return streaming_outer(
        learning_rate,
        momentum=0.9 if momentum is None else momentum,
        fragments=fragments,
        layout=layout,
    )


def _demo_outer(learning_rate, *, momentum=None, chunk=64, sign=True):
    del momentum  # DeMo's momentum is the workers' (hpsjax.transforms.demo).
    return demo_outer(learning_rate, chunk=chunk, sign=sign)


OPTIMIZERS: Mapping[str, Callable[..., optax.GradientTransformation]] = {
    "sgd": _sgd,
    "momentum": _momentum,
    "adam": _adam,
    "nesterov": _nesterov,
    "delayed_nesterov": _delayed_nesterov,
    "demo_outer": _demo_outer,
    "gradient_table": _gradient_table,
    "lookahead_momentum": _lookahead_momentum,
    "ordered_momentum": _ordered_momentum,
    "streaming_local": _streaming_local,
    "streaming_nesterov": _streaming_nesterov,
}
"""hpsjax's own names: ``f(learning_rate, *, momentum=None, **kwargs)``.

``sgd`` is plain SGD (heavy-ball momentum only where ``momentum`` is given and
not 0), ``momentum`` SGD with heavy-ball momentum 0.9 (or ``momentum``),
``adam`` optax's Adam (``momentum`` unused), ``nesterov`` DiLoCo's outer
optimizer (``hpsjax.transforms.diloco_outer``) and ``delayed_nesterov`` the
outer optimizer of asynchronous local SGD (``hpsjax.transforms.delayed_nesterov``,
keyword ``delay``), ``demo_outer`` the server's step on DeMo's pushes
(``hpsjax.transforms.demo_outer``: decode the chunked DCT coefficients, sign,
SGD; keywords ``chunk``, the workers' ``demo`` chunk, and ``sign``; no
momentum, the workers keep it), ``lookahead_momentum`` heavy-ball momentum whose
parameters run ahead by each update's staleness
(``hpsjax.transforms.lookahead_momentum``, momentum 0.9 unless given, keyword
``gamma``: the step's factor per version of staleness), ``gradient_table``
Ringleader ASGD's step on its table of the workers' gradients
(``hpsjax.transforms.gradient_table``, keyword ``num_slots``: the workers),
``ordered_momentum``
OrMo's server momentum
(``hpsjax.transforms.ordered_momentum``, momentum 0.9 unless given);
``streaming_local`` Streaming DiLoCo's inner optimizer
(``hpsjax.transforms.streaming_local`` around the optimizer named by keyword
``inner``, default ``adam``, which takes the other keywords; ``mixing``: the
merge's alpha; ``delay``: the merge's tau; ``eager``, ``fragments``,
``outer_learning_rate``, ``outer_momentum``, ``workers``, ``layout``: its eager
updates) and ``streaming_nesterov`` its outer step
(``hpsjax.transforms.streaming_outer``, keywords ``fragments``, ``layout``).
Any other name is looked up in optax."""


def _positive(value: Any) -> bool:
    """A finite real number > 0 (Python, numpy or a 0-d array; not a bool)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number > 0


def _is_constructor(obj: Any) -> bool:
    """An optax optimizer: a function whose first argument is ``learning_rate``."""
    if isinstance(obj, type) or not callable(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "learning_rate"


@functools.cache
def _optax_constructors() -> dict[str, Callable[..., Any]]:
    """``name -> function`` for optax's optimizers, then optax.contrib's (a name
    in both is optax's)."""
    found: dict[str, Callable[..., Any]] = {}
    for module in (optax.contrib, optax):  # optax's own win
        for name in dir(module):
            if name.startswith("_") or name.startswith("scale_by"):
                continue
            obj = getattr(module, name, None)
            if _is_constructor(obj):
                found[name] = obj
    return found


def optimizer_names() -> list[str]:
    """Every name :func:`make_optimizer` accepts, sorted."""
    return sorted({*OPTIMIZERS, *_optax_constructors()})


def _unknown(name: Any) -> ValueError:
    closest = difflib.get_close_matches(str(name), optimizer_names(), n=3, cutoff=0.5)
    hint = f" (closest: {', '.join(closest)})" if closest else ""
    return ValueError(
        f"unknown optimizer {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))} "
        f"or any optimizer of optax or optax.contrib{hint}"
    )


def resolve_optimizer(name: Any) -> Callable[..., optax.GradientTransformation]:
    """The function behind ``name``: hpsjax's own, else optax's or
    optax.contrib's (``"contrib.muon"`` and ``"optax.adamw"`` also work).

    Raises:
      ValueError: an unknown name (the message lists the closest names).
    """
    if not isinstance(name, str):
        raise _unknown(name)
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    key = name
    for prefix in ("optax.contrib.", "contrib.", "optax."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key in _optax_constructors():
        return _optax_constructors()[key]
    raise _unknown(name)


def check_optimizer(name: Any) -> None:
    """Raises the one-line ``ValueError`` of an unknown name; else nothing."""
    resolve_optimizer(name)


def _check_arguments(name: str, fn: Callable[..., Any], kwargs: Mapping[str, Any]):
    """An argument ``fn`` does not take is a one-line error naming its arguments."""
    if fn in OPTIMIZERS.values():
        return  # hpsjax's own forward their keywords to optax, which checks them
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p != "learning_rate"]
    for key in kwargs:
        if key not in params or key == "learning_rate":
            closest = difflib.get_close_matches(key, accepted, n=1)
            hint = f" (did you mean {closest[0]}?)" if closest else ""
            raise ValueError(
                f"optimizer {name!r} has no argument {key!r}{hint}; its arguments: "
                f"{', '.join(accepted)}"
            )


def make_optimizer(
    name: str,
    learning_rate: Any,
    *,
    momentum: float | None = None,
    **kwargs: Any,
) -> optax.GradientTransformation:
    """The optimizer ``name`` with step size ``learning_rate``.

    Args:
      name: a name of :data:`OPTIMIZERS`, or of an optax optimizer
        (``optax.<name>`` or ``optax.contrib.<name>``, e.g. ``"adamw"``,
        ``"lion"``, ``"muon"``).
      learning_rate: the step size, a number > 0 (or an optax schedule).
      momentum: the momentum of hpsjax's own names (see :data:`OPTIMIZERS`);
        for an optax optimizer it is passed on only where the function takes
        ``momentum`` (``rmsprop``, ``lars``, ...) and it is given.
      **kwargs: keyword arguments of the optimizer's function.

    Returns:
      An optax ``GradientTransformation``.

    Raises:
      ValueError: an unknown name (with the closest names), an argument the
        optimizer does not take (with its arguments), a learning rate that is
        not > 0, or a value the optimizer refuses; each in one line.
    """
    fn = resolve_optimizer(name)
    if not (callable(learning_rate) or _positive(learning_rate)):
        raise ValueError(f"learning rate must be > 0, got {learning_rate!r}")
    _check_arguments(name, fn, kwargs)
    if fn in OPTIMIZERS.values():
        call = functools.partial(fn, momentum=momentum)
    else:
        call = fn
        if momentum is not None and "momentum" in inspect.signature(fn).parameters:
            kwargs = {"momentum": momentum, **kwargs}
    try:
        optimizer = call(learning_rate, **kwargs)
    except (TypeError, ValueError) as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise ValueError(f"bad arguments for optimizer {name!r}: {detail}") from None
    return optimizer


class OptimizerRegistry(Mapping):
    """:func:`make_optimizer` as a mapping ``name -> f(learning_rate, **kw)``,
    for registries that look names up with ``in`` and ``[]``: every name of
    :func:`optimizer_names` is in it; iterating gives hpsjax's own names."""

    def __getitem__(self, name: str) -> Callable[..., optax.GradientTransformation]:
        resolve_optimizer(name)
        return functools.partial(make_optimizer, name)

    def __contains__(self, name: object) -> bool:
        try:
            resolve_optimizer(name)
        except ValueError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(OPTIMIZERS)

    def __len__(self) -> int:
        return len(OPTIMIZERS)

    def error(self, name: Any) -> ValueError:
        """The one-line error of an unknown ``name``."""
        return _unknown(name)
