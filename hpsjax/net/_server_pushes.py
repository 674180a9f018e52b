"""The asyncio server's pushes: received, checked as bytes, handed to the core.

:class:`ServerPushes` is the part of :class:`~hpsjax.net.Server` that takes a
push from its first frame to the core: it receives the leaves into reused
buffers, refuses NaN and infinity as each leaf arrives, tells the core a push
began (:class:`~hpsjax.decisions.PushBegun`, whose
:class:`~hpsjax.decisions.StartApply` starts the apply leaf by leaf as the
leaves arrive), decodes compressed pushes, and hands the whole push to the core
once (:class:`~hpsjax.decisions.WorkerPushed`), which checks it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
from typing import Any

import jax
import numpy as np

from hpsjax.decisions import Applied, PushAck, PushBegun, WorkerPushed
from hpsjax.net._session import HELD_REPORTED_S, Session, on_device
from hpsjax.wire import (
    Frame,
    Header,
    HpsError,
    MalformedMetadata,
    MsgType,
    NonFiniteUpdate,
    PushMeta,
    ServerError,
    UnexpectedMessage,
    WireTree,
    encode_frame,
)

__all__ = ["ServerPushes"]

# The server's one log, whichever of its modules writes the line.
logger = logging.getLogger("hpsjax.net._server")


# Decoders of quantized pushes of big models are compiled here, one at a time,
# while numpy decodes the pushes that arrive meanwhile (see DecoderCache).
_COMPILER = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="hpsjax-server-compile"
)


class ServerPushes:
    """The pushes of a :class:`~hpsjax.net.Server` (its base; its state is the
    server's)."""

    async def _decide_overlap(self) -> None:
        """Whether pushes can be applied as they arrive, decided and logged once
        (the separability test compiles, so off the event loop)."""
        if self._model.nbytes < self._overlap_min_bytes:
            return
        aggregator = self._core.aggregator
        if not aggregator.can_overlap:
            self._overlap_min_bytes = math.inf
            logger.info("applies: whole-tree (this core setup applies no push alone)")
            return
        steps = await self._loop.run_in_executor(
            _COMPILER, self._call_on_device, lambda: aggregator.leaf_steps
        )
        if steps is None:
            self._overlap_min_bytes = math.inf
            logger.info(
                "applies: whole-tree after each push's last byte (the optimizer "
                "is not leaf-separable)"
            )
        else:
            logger.info(
                "applies: leaf by leaf as pushes of %d bytes or more arrive (the "
                "optimizer is leaf-separable)",
                self._overlap_min_bytes,
            )

    @on_device
    def _allocate(self, session: Session, header: Header, meta: dict):
        if session.state != "ready":
            raise UnexpectedMessage(f"{header.msg_type.name} before authentication")
        if header.msg_type not in (MsgType.PUSH, MsgType.PUSH_PULL):
            raise UnexpectedMessage(f"clients do not send {header.msg_type.name}")
        layout = self._layouts.get(meta)
        if layout.nbytes != header.payload_length:
            raise MalformedMetadata(
                f"leaves hold {layout.nbytes} bytes, header says "
                f"{header.payload_length}"
            )
        arrays, buffers = layout.receive_buffers(self._pool)
        session.overlap = None
        owner = self._overlap_owner
        if (
            layout.codec is None
            and layout.nbytes >= self._overlap_min_bytes
            # One at a time: pushes received side by side would apply on each
            # other's parameters, and all but the first be done again.
            and (owner is None or owner.overlap is None or owner.closed)
        ):
            self._carry_out(
                self._core.handle(
                    PushBegun(
                        session.worker_id,
                        meta.get("version"),
                        meta.get("num_samples"),
                        self._now(),
                    )
                )
            )
        return buffers, WireTree(layout, arrays)

    def _note_refused(self, session: Session, error: BaseException) -> None:
        """Says, in one line at most every few seconds, that a worker sent a
        non-finite update (a diverging run), and counts it."""
        if not isinstance(error, NonFiniteUpdate):
            return
        if self._metrics is not None:
            self._metrics.nonfinite_update()
        show, held = self._nonfinite_lines.ready()
        if show:
            more = f"; {held} more refused since the last line" if held else ""
            logger.warning(
                "worker %r sent a non-finite update at version %d (refused: %s%s)",
                session.worker_id,
                self._core.version,
                error.message if isinstance(error, HpsError) else error,
                more,
            )

    def _push(self, session: Session, frame: Frame) -> None:
        arrived = self._loop.time()
        # The one place a push's fields are validated.
        meta = PushMeta.from_wire(frame.metadata)
        prepared, session.overlap = session.overlap, None
        codec = frame.payload.layout.wire
        if codec is not None and self._decoders.worth_compiling(codec):
            self._compile_decoder(codec)
        leaves = self._decode_update(frame.payload)
        if self._check_finite and codec is not None and codec.finite_decoded:
            # Raw leaves were checked as they arrived (_check_received), and
            # compressed parts, but decoding them may still overflow.
            self._require_finite(leaves)
        update = jax.tree.unflatten(self._treedef, leaves)
        # The layout was checked against the model before the payload was read
        # (a compressed one decodes to the model's shapes and dtypes), and the
        # values as they arrived: the core need not check them again.
        started = self._loop.time() if self._metrics is not None else 0.0
        aggregator = self._core.aggregator
        # The apply started as the push arrived serves this push only.
        aggregator.prepare(prepared)
        try:
            actions = self._core.handle(
                WorkerPushed(session.worker_id, update, meta, self._now())
            )
        finally:
            aggregator.prepare(None)
        self._pushes += 1
        if self._metrics is not None and any(isinstance(a, Applied) for a in actions):
            self._metrics.apply(self._loop.time() - started, version=self._core.version)
        ack = None
        for action in actions:
            if isinstance(action, PushAck) and action.worker_id == session.worker_id:
                ack = action
                break
        if ack is None:
            raise ServerError("the policy did not acknowledge the push")
        if self._metrics is not None:
            self._metrics.push(staleness=ack.staleness, received_bytes=frame.nbytes)
        if self._progress is not None:
            self._progress.observe(loss=meta.loss, staleness=ack.staleness)
        ack_meta = ack.to_wire()
        if frame.msg_type == MsgType.PUSH:
            held = self._loop.time() - arrived
            if held >= HELD_REPORTED_S:
                # The acknowledgement says how long decoding and applying took.
                ack_meta = {**ack_meta, "held_s": held}
            session.protocol.send(
                encode_frame(MsgType.PUSH_ACK, frame.request_id, ack_meta)
            )
            self._carry_out(actions, pusher=session.worker_id, arrived=arrived)
        else:
            self._carry_out(actions, pusher=session.worker_id, arrived=arrived)
            entry = (frame.request_id, ack_meta)
            session.pulls.append(entry)
            try:
                self._pull(session)
            except HpsError as e:
                # The push stands; only the pull half failed: report that.
                if entry in session.pulls:
                    session.pulls.remove(entry)
                raise type(e)(f"update applied, pull failed: {e.message}") from e

    def _compile_decoder(self, codec) -> None:
        """Compiles ``codec``'s decoder off the loop, once; keeps it when done.

        Pushes are not held meanwhile: numpy decodes them (same values).
        """
        if codec in self._compiling:
            return
        self._compiling.add(codec)
        future = self._loop.run_in_executor(
            _COMPILER, self._call_on_device, self._decoders.compile, codec
        )
        future.add_done_callback(functools.partial(self._compiled, codec))

    def _compiled(self, codec, future) -> None:
        self._compiling.discard(codec)
        if self._closing or future.cancelled():
            return
        if future.exception() is None:
            self._decoders.put(codec, future.result())
        else:
            # Numpy keeps decoding this codec's pushes.
            logger.warning(
                "cannot compile a decoder for %s: %s", codec, future.exception()
            )

    def _decode_update(self, payload: WireTree) -> list[Any]:
        """The update's leaves, in the parameters' leaf order."""
        layout = payload.layout
        if layout.codec is None:
            # Received 64-byte aligned, so JAX takes them without a copy when the
            # core's compiled steps are called on them (cheaper than device_put
            # for small leaves, as fast for big ones).
            return payload.arrays
        return self._decoders.decoder(layout.wire)(payload.arrays)

    @on_device
    def _on_filled(self, session: Session, payload: WireTree, index: int) -> None:
        """Leaf ``index`` of a push is in: checked, and its apply started."""
        self._check_received(payload, index)
        if session.overlap is not None:
            session.overlap.add(index, payload.arrays[index])

    def _check_received(self, payload: WireTree, index: int) -> None:
        """Refuses a raw push as soon as a leaf holding NaN or infinity is in
        (a compressed one as soon as its codec refuses a part: see
        ``check_part`` of :class:`~hpsjax.wire._codecs.WireCodec`).

        Called by the decoder for each buffer once its bytes have arrived, so
        the check overlaps the transfer of the following ones.
        """
        layout = payload.layout
        if layout.wire is None:
            leaf, array = index, payload.arrays[index]
        else:
            # Every compressed leaf sends two arrays.
            leaf, part = divmod(index, 2)
            size = math.prod(layout.leaves[leaf].shape)
            array = layout.wire.check_part(
                payload.arrays[leaf], part, size, finite=self._check_finite
            )
            if array is None:
                return
        if not self._check_finite:
            return
        if array.dtype.kind not in "biu" and not np.isfinite(array).all():
            raise NonFiniteUpdate(
                f"leaf {self._model.paths()[leaf]} holds NaN or infinity"
            )

    def _require_finite(self, leaves: list[Any]) -> None:
        paths = None
        for i, (leaf, spec) in enumerate(zip(leaves, self._model.leaves, strict=True)):
            if spec.dtype.kind in "biu":
                continue
            if not np.isfinite(np.asarray(leaf)).all():
                paths = paths or self._model.paths()
                raise NonFiniteUpdate(f"leaf {paths[i]} holds NaN or infinity")
