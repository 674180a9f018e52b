"""The protocol's typed messages: what a push says, how it is acknowledged, and
the notices a server sends unasked.

Each message is validated once, where bytes become objects: the server's
request handling turns a PUSH's metadata into a :class:`PushMeta`
(:meth:`PushMeta.from_wire`), the client turns a PUSH_ACK into a
:class:`PushAck` (:meth:`PushAck.from_wire`) and a NOTICE into a
:class:`PlanNotice`, :class:`StageNotice` or :class:`ForcePullNotice`
(:func:`notice_from_wire`); the handshake's HELLO, CHALLENGE and proofs become a
:class:`Hello`, a :class:`Challenge` and a :class:`Proof`, a server's
description (INFO, and the handshake's
``info``) becomes an :class:`InfoMessage`, a SUBSCRIBE a :class:`Subscribe`, a
PARAMS frame's fields a :class:`ParamsMeta`.
Everything past that point trusts the types. A
malformed field raises :class:`~hpsjax.ps.MalformedMetadata` naming it.

The messages are msgspec structs: msgspec validates a decoded map against the
types and bounds declared here in C, 1.4 (an acknowledgement) to 4 (a push's
fields) times faster than the same checks written in Python, and 10 times
faster from msgpack bytes (``benchmarks/bench_messages.py``). Constructing a struct
directly does not validate it: values from outside come through ``from_wire``.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from hpsjax.wire._errors import MalformedMetadata

__all__ = [
    "NONCE_BYTES",
    "Challenge",
    "ForcePullNotice",
    "Hello",
    "InfoMessage",
    "ParamsMeta",
    "Notice",
    "PlanNotice",
    "Proof",
    "PushAck",
    "PushMeta",
    "StageNotice",
    "Subscribe",
    "Subscribed",
    "notice_from_wire",
    "notice_to_wire",
]

NONCE_BYTES = 32
"""Bytes of each end's random nonce in the handshake (HELLO, CHALLENGE)."""

_MAX = sys.float_info.max
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# Bounds that NaN and the infinities fail: a finite float.
FiniteFloat = Annotated[float, msgspec.Meta(ge=-_MAX, le=_MAX)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=_MAX)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=_MAX)]


def _convert(meta: Any, kind: Any, what: str, error: type) -> Any:
    try:
        # bytes fields take msgpack's bin only, never a str read as base64.
        return msgspec.convert(meta, kind, builtin_types=(bytes,))
    except msgspec.ValidationError as e:
        raise error(f"malformed {what}: {e}"[:300]) from None


class PushMeta(msgspec.Struct, frozen=True):
    """What a PUSH (or PUSH_PULL) says besides its tree.

    Attributes:
      version: the version of the parameters the update was computed on.
      step_time: compute seconds the update took, or ``None``.
      num_samples: samples behind the update (its weight in an average), or
        ``None`` (1).
      local_steps: local steps behind the update, or ``None`` (1).
      loss: the worker's latest training loss, or ``None``.
      stage: the stage of the worker's staged optimizer after the round (ASHL),
        or ``None``; under the hybrid policy a stage beyond the server's moves
        the server to it.
    """

    version: NonNegInt
    step_time: NonNegFloat | None = None
    num_samples: PositiveInt | None = None
    local_steps: PositiveInt | None = None
    loss: FiniteFloat | None = None
    stage: NonNegInt | None = None

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], error: type = MalformedMetadata
    ) -> PushMeta:
        """Validates a push's fields (others are ignored); ``error`` names a bad one.

        Examples:
          >>> PushMeta.from_wire({"version": 3, "step_time": 0.5, "stage": 1})
          PushMeta(version=3, step_time=0.5, num_samples=None, local_steps=None, \
loss=None, stage=1)
          >>> PushMeta.from_wire({"version": -1})
          Traceback (most recent call last):
          ...
          hpsjax.wire._errors.MalformedMetadata: malformed push metadata: Expected \
`int` >= 0 - at `$.version`
        """
        return _convert(meta, cls, "push metadata", error)

    def to_wire(self) -> dict[str, Any]:
        """The fields as PUSH metadata (``None`` fields left out)."""
        return {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not None
        }


class _AckWire(msgspec.Struct, frozen=True):
    version: NonNegInt
    staleness: int
    status: Literal["applied", "buffered", "dropped"]
    weight: NonNegFloat = 1.0
    local_steps: PositiveInt | None = None
    reason: str | None = None
    force_pull: bool = False
    stage: NonNegInt | None = None


class PushAck(msgspec.Struct, frozen=True):
    """The answer to a push: the one acknowledgement from server to worker.

    The server's core returns it as an action (with ``worker_id``), the server
    sends it (PUSH_ACK, or ``ack`` in PARAMS), the client returns it from
    ``push`` and ``push_pull``, and the sharded client combines its shards'
    (``shards``).

    Attributes:
      worker_id: the worker that pushed (``None`` where the receiver is that
        worker).
      version: the server version after the push was handled.
      staleness: :math:`\\tau = V - v`, the server version when the push arrived
        minus the version it was computed on.
      status: ``"applied"`` (a new version includes it), ``"buffered"`` (waiting
        for other updates to be aggregated with) or ``"dropped"`` (discarded).
      weight: the damping factor the update was scaled by (0 when dropped).
      local_steps: hint: local steps to take before the next push, or ``None``.
      reason: why it was damped, dropped or a pull forced, else ``None``.
      force_pull: the server asks to discard local work and pull.
      stage: the stage the server's policy moved to while handling the push
        (a stage-changed notice), else ``None``.
      shards: a sharded push's per-shard acknowledgements (empty otherwise).
    """

    worker_id: Hashable | None
    version: int
    staleness: int
    status: Literal["applied", "buffered", "dropped"]
    weight: float = 1.0
    local_steps: int | None = None
    reason: str | None = None
    force_pull: bool = False
    stage: int | None = None
    shards: tuple[PushAck, ...] = ()

    @property
    def applied(self) -> bool:
        """Whether a new version includes the update."""
        return self.status == "applied"

    def to_wire(self) -> dict[str, Any]:
        """The PUSH_ACK metadata (``worker_id`` and ``shards`` do not travel)."""
        return {
            "version": self.version,
            "staleness": self.staleness,
            "status": self.status,
            "weight": float(self.weight),
            "local_steps": self.local_steps,
            "reason": self.reason,
            "force_pull": self.force_pull,
            "stage": self.stage,
        }

    @classmethod
    def from_wire(cls, meta: Any, worker_id: Hashable | None = None) -> PushAck:
        """Validates a PUSH_ACK's metadata (or PARAMS' ``ack``)."""
        w = _convert(meta, _AckWire, "push acknowledgement", MalformedMetadata)
        return cls(
            worker_id,
            w.version,
            w.staleness,
            w.status,
            w.weight,
            w.local_steps,
            w.reason,
            w.force_pull,
            w.stage,
        )


class PlanNotice(msgspec.Struct, frozen=True, tag_field="notice", tag="plan"):
    """A work plan for this worker (H-PS re-planning); ``None`` fields unset.

    Attributes:
      revision: a higher revision replaces a lower one.
      batch_size: samples per local step over all the worker's devices.
      device_batches: samples per local step on each local device.
      local_steps: local steps per push.
      lr_scale: the factor on the worker's step size.
    """

    revision: int
    batch_size: PositiveInt | None = None
    device_batches: tuple[PositiveInt, ...] | None = None
    local_steps: PositiveInt | None = None
    lr_scale: PositiveFloat | None = None

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> PlanNotice:
        """Validates a plan (a map; unknown keys are ignored)."""
        if isinstance(meta, Mapping):
            meta = {**meta, "notice": "plan"}
        return _convert(meta, cls, "plan", error)


class StageNotice(msgspec.Struct, frozen=True, tag_field="notice", tag="stage"):
    """The server's staged policy (hybrid, ASHL) moved to ``stage``."""

    stage: NonNegInt


class ForcePullNotice(
    msgspec.Struct, frozen=True, tag_field="notice", tag="force_pull"
):
    """Discard local work and pull fresh parameters, for ``reason``."""

    reason: str = "requested by the server"


Notice = PlanNotice | StageNotice | ForcePullNotice
"""A NOTICE frame's content."""


def notice_to_wire(notice: Notice) -> dict[str, Any]:
    """A notice as NOTICE metadata (``None`` fields left out).

    Examples:
      >>> notice_to_wire(StageNotice(1))
      {'notice': 'stage', 'stage': 1}
    """
    return {k: v for k, v in msgspec.to_builtins(notice).items() if v is not None}


def notice_from_wire(meta: Mapping[str, Any]) -> Notice:
    """Validates a NOTICE frame's metadata.

    Examples:
      >>> notice_from_wire({"notice": "stage", "stage": 1})
      StageNotice(stage=1)
    """
    return _convert(meta, Notice, "notice", MalformedMetadata)


class Hello(msgspec.Struct, frozen=True):
    """A client's HELLO, which opens the handshake (PROTOCOL.md, section 3).

    Attributes:
      worker_id: the worker's name, a ``str`` or an ``int``; ``None`` (left
        out on the wire, never ``nil``) asks the server to assign one, which
        its AUTH_OK names.
      nonce: the client's 32 random bytes for the proofs.
      client: the client's software (informative).
      instance: 8 to 64 bytes the client draws once and sends on each of its
        connections, so that the server tells its reconnect from another
        worker under the same id (``None``: not told apart).
    """

    worker_id: str | int | None
    nonce: Annotated[
        bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)
    ]
    client: str | None = None
    instance: Annotated[bytes, msgspec.Meta(min_length=8, max_length=64)] | None = None

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> Hello:
        """Validates a HELLO (one without a ``worker_id`` asks for one; a
        ``nil`` one is malformed); ``error`` names a bad field."""
        if isinstance(meta, Mapping):
            if "worker_id" in meta and meta["worker_id"] is None:
                raise error("malformed HELLO: worker_id is nil (leave it out to ask)")
            meta = {"worker_id": None, **meta}
        return _convert(meta, cls, "HELLO", error)

    def to_wire(self) -> dict[str, Any]:
        """The HELLO's metadata (``None`` fields left out)."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class Challenge(msgspec.Struct, frozen=True):
    """The server's CHALLENGE: its nonce, and the scheme it authenticates with
    (``None``: it does not)."""

    nonce: Annotated[
        bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)
    ]
    auth: str | None = None

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> Challenge:
        """Validates a CHALLENGE; ``error`` names a bad field."""
        return _convert(meta, cls, "CHALLENGE", error)

    def to_wire(self) -> dict[str, Any]:
        """The CHALLENGE's metadata."""
        return {"nonce": self.nonce, "auth": self.auth}


class Proof(msgspec.Struct, frozen=True):
    """An AUTH or AUTH_OK: one end's proof that it knows the secret (empty
    bytes where the server does not authenticate)."""

    proof: bytes

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> Proof:
        """Validates an AUTH or AUTH_OK; ``error`` names a bad field."""
        return _convert(meta, cls, "proof", error)

    def to_wire(self) -> dict[str, Any]:
        """The proof's metadata."""
        return {"proof": self.proof}


class InfoMessage(msgspec.Struct, frozen=True):
    """What a server says about itself: an INFO reply, and the ``info`` of the
    handshake's last step (PROTOCOL.md, INFO).

    Attributes:
      policy: the synchronization policy's name.
      version: the current parameter version.
      spec: the model: ``tree`` (the tree codec's structure) and ``leaves``, a
        ``[dtype, shape]`` per leaf.
      stage: the policy's stage index (0 unless the policy is staged).
      limits: the server's frame limits (``max_message_bytes``, ...,
        ``dtypes``).
      workers: live workers, where the server says.
      synchronous: the policy holds every round for every live worker (BSP).
    """

    policy: str
    version: NonNegInt
    spec: dict[str, Any]
    stage: NonNegInt = 0
    limits: dict[str, Any] = msgspec.field(default_factory=dict)
    workers: NonNegInt | None = None
    synchronous: bool = False

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> InfoMessage:
        """Validates a server's description; ``error`` names a bad field."""
        return _convert(meta, cls, "server info", error)

    def to_wire(self) -> dict[str, Any]:
        """The fields as metadata (``None`` fields left out)."""
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}


class ParamsMeta(msgspec.Struct, frozen=True):
    """What a PARAMS frame says besides its tree (PROTOCOL.md, PARAMS).

    Attributes:
      version: the parameters' version.
      local_steps: hint: local steps to take before the next push, or ``None``.
      held_s: the seconds the server held the answer (a barrier, an apply),
        where it held it.
      barrier_s: of ``held_s``, the seconds it waited for other workers' pushes.
      ack: a PUSH_PULL's acknowledgement (:meth:`PushAck.from_wire` reads it).
    """

    version: NonNegInt
    local_steps: NonNegInt | None = None
    held_s: NonNegFloat | None = None
    barrier_s: NonNegFloat | None = None
    ack: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> ParamsMeta:
        """Validates a PARAMS frame's fields; ``error`` names a bad one."""
        return _convert(meta, cls, "PARAMS", error)


class Subscribe(msgspec.Struct, frozen=True):
    """A SUBSCRIBE request: ``on`` starts the server's PARAMS after every
    applied update, ``off`` stops them."""

    on: bool

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> Subscribe:
        """Validates a SUBSCRIBE request; ``error`` names a bad field."""
        return _convert(meta, cls, "SUBSCRIBE", error)

    def to_wire(self) -> dict[str, Any]:
        """The request's metadata."""
        return {"on": self.on}


class Subscribed(msgspec.Struct, frozen=True):
    """The server's answer to a SUBSCRIBE: the subscription's state and the
    version the first PARAMS of a subscription hold."""

    on: bool
    version: NonNegInt

    @classmethod
    def from_wire(cls, meta: Any, error: type = MalformedMetadata) -> Subscribed:
        """Validates a SUBSCRIBE reply; ``error`` names a bad field."""
        return _convert(meta, cls, "SUBSCRIBE reply", error)

    def to_wire(self) -> dict[str, Any]:
        """The reply's metadata."""
        return {"on": self.on, "version": self.version}
