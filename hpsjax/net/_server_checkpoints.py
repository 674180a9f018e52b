"""The asyncio server's checkpoints: resume at start, save when the core asks.

:class:`ServerCheckpoints` is the part of :class:`~hpsjax.net.Server` that
resumes from the newest orbax checkpoint, hands a checkpoint of the current
version to the manager's thread when the core returns a
:class:`~hpsjax.decisions.SaveCheckpoint` (the core keeps both cadences, by
versions and by seconds), and waits for the last one at close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging

import jax

from hpsjax.storage import SERVER_CHECKPOINT_FORMAT, SERVER_CHECKPOINT_FORMAT_VERSION

__all__ = ["ServerCheckpoints"]

# The server's one log, whichever of its modules writes the line.
logger = logging.getLogger("hpsjax.net._server")


class ServerCheckpoints:
    """Checkpoints of a :class:`~hpsjax.net.Server` (its base; its state is
    the server's)."""

    async def _resume(self) -> None:
        like = (self._core.params, self._core.opt_state)
        restored = await asyncio.to_thread(
            self._call_on_device, lambda: self._manager.restore_latest(like=like)
        )
        if restored is None:
            return
        meta = restored.metadata or {}
        if meta.get("format") != SERVER_CHECKPOINT_FORMAT:
            raise ValueError(
                f"{self._checkpoint_dir} holds checkpoints of another kind"
            )
        params, opt_state = restored.tree
        with jax.default_device(self._device):
            self._core.load_state_dict(meta["core"], params=params, opt_state=opt_state)
        self._saved_version = self._core.version
        self._resumed_from = restored.step
        logger.info(
            "resumed from checkpoint %s at version %d",
            self._manager.directory / f"ckpt_{restored.step}",
            self._core.version,
        )

    def _checkpoint_metadata(self) -> dict:
        return {
            "format": SERVER_CHECKPOINT_FORMAT,
            "format_version": SERVER_CHECKPOINT_FORMAT_VERSION,
            "core": self._core.state_dict(),
        }

    def _save_async(self) -> None:
        """Hands a checkpoint of the current version to the manager's thread.

        Parameters and optimizer state are immutable JAX arrays, so handing
        their references to the thread is a consistent snapshot; the
        bookkeeping is captured here, at the same moment. A save due while
        another is written is folded into the next (``save_async``).
        """
        version = self._core.version
        if self._manager is None or version == self._saved_version:
            return
        tree = (self._core.params, self._core.opt_state)
        try:
            future = self._manager.save_async(
                version, tree, self._checkpoint_metadata(), snapshot=False
            )
        except RuntimeError:  # an earlier save failed: _note_save kept it
            return
        self._saved_version = version
        if future not in self._checkpoint_futures:  # a folded save's is
            self._checkpoint_futures = [
                f for f in self._checkpoint_futures if not f.done()
            ] + [future]
            future.add_done_callback(self._note_save)

    def _note_save(self, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None:
            logger.error("checkpoint save failed: %s", error)
            self._checkpoint_error = error
        else:
            # At most one line a minute (every one at DEBUG), and the last.
            show, held = self._checkpoint_lines.ready()
            if show or self._closing:
                more = f" ({held} more since the last line)" if held else ""
                logger.info("checkpoint written: %s%s", future.result(), more)
            else:
                logger.debug("checkpoint written: %s", future.result())
            if self._metrics is not None:
                self._metrics.checkpoint_saved()

    async def _finish_checkpoints(self) -> None:
        self._save_async()
        for future in self._checkpoint_futures:
            with contextlib.suppress(Exception):  # recorded by _note_save
                await asyncio.wrap_future(future)
        with contextlib.suppress(RuntimeError):  # a failed save, kept above
            await asyncio.to_thread(self._manager.close)
