"""Decoding and validating a push's metadata and an acknowledgement.

Compares the typed messages of :mod:`hpsjax.wire._messages` (msgspec structs,
validated in C) with the same checks written in Python (the checks the server,
the core and the client made before the messages were typed), in the two places
a message becomes an object:

* ``from dict``: the frame decoder has already unpacked the metadata (a push's
  tree description is needed before its payload is read, so the server always
  has the map); the typed message is made from it. This is what the server and
  the client do.
* ``from bytes``: the metadata's msgpack bytes decoded straight into the typed
  message (msgspec's own decoder) against msgpack's unpacker plus the checks.

Run: ``python benchmarks/bench_messages.py``.
"""

from __future__ import annotations

import math
import timeit
from typing import Any

import msgpack
import msgspec

from hpsjax.wire._errors import MalformedMetadata
from hpsjax.wire._messages import PushAck, PushMeta, _AckWire

_PUSH_FIELDS = {
    "step_time": (float, 0.0),
    "num_samples": (int, 1),
    "local_steps": (int, 1),
    "loss": (float, None),
    "stage": (int, 0),
}


def hand_push(meta: dict[str, Any]) -> dict[str, Any]:
    """A push's fields checked in Python: types, finiteness and bounds."""
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise MalformedMetadata("a push needs a non-negative int 'version'")
    fields = {"version": version}
    for name, (kind, low) in _PUSH_FIELDS.items():
        value = meta.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or (kind is int and not isinstance(value, int))
            or (low is not None and value < low)
        ):
            raise MalformedMetadata(f"bad {name!r}: {value!r}")
        fields[name] = kind(value)
    return fields


def hand_ack(meta: dict[str, Any]) -> dict[str, Any]:
    """An acknowledgement checked in Python."""
    try:
        version, staleness = meta["version"], meta["staleness"]
    except KeyError as e:
        raise MalformedMetadata(f"missing {e}") from None
    for name, value in (("version", version), ("staleness", staleness)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise MalformedMetadata(f"bad {name!r}")
    if meta.get("status") not in ("applied", "buffered", "dropped"):
        raise MalformedMetadata("bad status")
    weight = meta.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise MalformedMetadata("bad weight")
    for name in ("local_steps", "stage"):
        value = meta.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int)
        ):
            raise MalformedMetadata(f"bad {name!r}")
    reason = meta.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise MalformedMetadata("bad reason")
    if not isinstance(meta.get("force_pull", False), bool):
        raise MalformedMetadata("bad force_pull")
    return dict(meta)


def _time(fn, number: int = 200_000) -> float:
    """Best of 5, in microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    push = {
        "version": 1234,
        "step_time": 0.0123,
        "num_samples": 256,
        "local_steps": 4,
        "loss": 0.693,
        "stage": 1,
    }
    # A push's metadata as it travels: the tree description of a 4-leaf model.
    full = push | {
        "tree": ["d", {"b": 0, "w": 1, "b2": 2, "w2": 3}],
        "leaves": [
            ["float32", [64], 0, 256],
            ["float32", [784, 64], 256, 200704],
            ["float32", [10], 200960, 40],
            ["float32", [64, 10], 201000, 2560],
        ],
        "codec": None,
    }
    ack = PushAck("w0", 1235, 1, "applied", 1.0, 4, None, False, 1).to_wire()
    push_bytes = msgpack.packb(full, use_bin_type=True)
    ack_bytes = msgpack.packb(ack, use_bin_type=True)
    push_dec = msgspec.msgpack.Decoder(PushMeta)
    ack_dec = msgspec.msgpack.Decoder(_AckWire)
    assert push_dec.decode(push_bytes).stage == hand_push(full)["stage"]
    assert ack_dec.decode(ack_bytes).version == hand_ack(ack)["version"]

    def unpack(b):
        return msgpack.unpackb(b, raw=False)

    rows = [
        ("push, from dict", lambda: hand_push(full), lambda: PushMeta.from_wire(full)),
        (
            "push, from bytes",
            lambda: hand_push(unpack(push_bytes)),
            lambda: push_dec.decode(push_bytes),
        ),
        ("ack, from dict", lambda: hand_ack(ack), lambda: PushAck.from_wire(ack)),
        (
            "ack, from bytes",
            lambda: hand_ack(unpack(ack_bytes)),
            lambda: ack_dec.decode(ack_bytes),
        ),
    ]
    print(f"msgspec {msgspec.__version__}, msgpack {msgpack.version}")
    print(f"{'message':<18} {'hand-written us':>16} {'msgspec us':>11} {'ratio':>6}")
    for name, hand, spec in rows:
        h, s = _time(hand), _time(spec)
        print(f"{name:<18} {h:16.2f} {s:11.2f} {h / s:6.2f}")


if __name__ == "__main__":
    main()
