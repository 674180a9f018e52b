"""Pushes whose transform leaves most entries zero, sent as top-k leaves.

DeMo's push (:func:`~hpsjax.transforms.demo`: the top DCT coefficients of
each chunk of its momentum), SparseLoCo's
(:func:`~hpsjax.transforms.sparseloco`: the top ``ratio`` of entries, their
values on a few bits) and Streaming DiLoCo's
(:func:`~hpsjax.transforms.streaming_push`: one fragment of the parameters)
output a tree that is zero but for the entries they send. A worker runs one of
them, named by a JSON spec (:func:`sparse_push_transform`), and sends its
output's nonzero entries as the wire's top-k leaves (:func:`sparse_encoded`:
indices, then values in the leaf's dtype), so the server decodes exactly the
tree the transform output.

The values travel at the leaf's width (float32), not at the transform's few
bits: the wire has no codec of few-bit values with indices yet, so a real push
moves ``k (4 + index bytes)`` a leaf where the simulator counts the few-bit
bytes (``sparseloco_nbytes``, ``streaming_fragment_nbytes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from hpsjax.transforms._topk import TopKEncoded, topk_index_dtype

__all__ = ["SPARSE_PUSHES", "sparse_encoded", "sparse_push_transform"]


def _sparseloco(**kwargs: Any) -> optax.GradientTransformation:
    from hpsjax.transforms._frontier import sparseloco

    return sparseloco(**kwargs)


def _demo(**kwargs: Any) -> optax.GradientTransformation:
    from hpsjax.transforms._demo import demo

    return demo(**kwargs)


def _streaming_push(**kwargs: Any) -> optax.GradientTransformation:
    from hpsjax.transforms._streaming import streaming_push

    return streaming_push(**kwargs)


SPARSE_PUSHES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "demo": _demo,
    "sparseloco": _sparseloco,
    "streaming_push": _streaming_push,
}
"""The push transforms a spec may name, by name."""


def sparse_push_transform(spec: str) -> optax.GradientTransformation:
    """The push transform of a JSON spec, ``{"name": ..., <its arguments>}``.

    Raises:
      ValueError: not a JSON object, an unknown name, or arguments the
        transform refuses; one line each.

    Examples:
      >>> from hpsjax.transforms import sparse_push_transform
      >>> tx = sparse_push_transform('{"name": "sparseloco", "ratio": 0.02}')
      >>> sparse_push_transform('{"name": "topk"}')  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: unknown push transform 'topk'; valid names: demo, sparseloco, ...
    """
    try:
        fields = json.loads(spec)
    except (TypeError, ValueError):
        fields = None
    if not isinstance(fields, dict) or not isinstance(fields.get("name"), str):
        raise ValueError(
            f'a push transform is a JSON object {{"name": ..., ...}}, got {spec!r}'
        )
    fields = dict(fields)
    name = fields.pop("name")
    make = SPARSE_PUSHES.get(name)
    if make is None:
        raise ValueError(
            f"unknown push transform {name!r}; valid names: "
            f"{', '.join(sorted(SPARSE_PUSHES))}"
        )
    try:
        return make(**fields)
    except TypeError as err:
        raise ValueError(f"bad arguments for push transform {name!r}: {err}") from None


def sparse_encoded(tree: Any) -> list[TopKEncoded]:
    """Each leaf's nonzero entries as the wire's top-k leaf: flat indices in
    increasing order (``uint16`` up to 65536 entries, else ``uint32``), then
    their values in the leaf's dtype.

    Examples:
      >>> import numpy as np
      >>> from hpsjax.transforms import sparse_encoded
      >>> [(e.indices.tolist(), e.values.tolist())
      ...  for e in sparse_encoded({"w": np.array([0.0, 2.0, 0.0, -1.0])})]
      [([1, 3], [2.0, -1.0])]
    """
    out = []
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        flat = np.asarray(leaf).reshape(-1)
        indices = np.flatnonzero(flat).astype(topk_index_dtype(flat.size))
        out.append(TopKEncoded(indices, flat[indices]))
    return out
