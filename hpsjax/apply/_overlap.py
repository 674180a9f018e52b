"""The asyncio server's aggregator: a push applied leaf by leaf as it arrives.

PHub's aggregation and optimizer step fused per chunk. Where the server core
says a coming push completes a version at once (:meth:`ServerCore.completing_push
<hpsjax.ps.ServerCore.completing_push>`: BSP's last push of a round, ASP's
push), :meth:`OverlapAggregator.start` returns a
:class:`~hpsjax.apply._separable.LeafApply` that the server feeds each leaf of the
update as its bytes arrive; the server then hands it back
(:meth:`OverlapAggregator.prepare`) right before the core takes the push, and
:meth:`OverlapAggregator.candidate` takes its buffered mean and apply instead of
working them out on the whole tree after the last byte. Every decision is still
the core's: a result that no longer matches (another push came first, the policy
weighted this one otherwise than by its samples) is ignored, and the push is
aggregated whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpsjax.apply._aggregate import Aggregator, Pending
from hpsjax.apply._separable import LeafApply, LeafSteps, leaf_steps
from hpsjax.wire import NonFiniteUpdate

__all__ = ["OverlapAggregator"]


class OverlapAggregator(Aggregator):
    """An :class:`~hpsjax.apply._aggregate.Aggregator` that can take a push's
    apply worked out leaf by leaf (see the module docstring).

    Takes the arguments of :class:`~hpsjax.apply._aggregate.Aggregator`.

    Attributes:
      overlapped_applies: how many pushes were applied with the result of a
        :meth:`start`-ed apply.
    """

    def __init__(self, params: Any, optimizer: Any, **kwargs: Any):
        super().__init__(params, optimizer, **kwargs)
        self._leaf_steps: LeafSteps | bool | None = False
        self._prepared: LeafApply | None = None
        self.overlapped_applies = 0

    @property
    def leaf_steps(self) -> LeafSteps | None:
        """The optimizer's per-leaf step, or ``None`` where it is not separable.

        Decided on first use by running the whole-tree and the per-leaf steps
        on random inputs (see :mod:`hpsjax.apply._separable`); a tree of one leaf
        has no per-leaf step. Applies still run on the whole tree: this is the
        step an apply overlapped with receipt can run leaf by leaf.
        """
        if self._leaf_steps is False:
            steps = leaf_steps(
                self._optimizer, self._treedef, self._shapes, self._dtypes
            )
            self._leaf_steps = steps if steps.separable else None
        return self._leaf_steps

    @property
    def can_overlap(self) -> bool:
        """Whether this setup lets :meth:`start` ever start an apply: applies
        checked (``check_result``), no stale copies (``keep_stale_params``).
        Whether the optimizer is separable is :attr:`leaf_steps`'s question."""
        return self._check_result and not self.keep_stale_params

    def start(self, plan: tuple[float, int, int] | None) -> LeafApply | None:
        """An apply of a coming push to feed leaf by leaf, or ``None``.

        Args:
          plan: the core's ``(weight, samples, staleness)`` for a push that
            completes a version (:meth:`ServerCore.completing_push`), or
            ``None`` where it does not (or cannot be known yet).

        Returns:
          ``None`` where ``plan`` is ``None``, where this setup cannot overlap
          (:attr:`can_overlap`), or where the optimizer is not separable.
        """
        if plan is None or not self.can_overlap:
            return None
        steps = self.leaf_steps
        if steps is None:
            return None
        weight, samples, tau = plan
        keep, w = self.mean_weights(weight, samples)
        return LeafApply(
            steps,
            self._params,
            self._opt_state,
            self._buffer,
            keep,
            w,
            self.device_scalar(tau, np.int32),
            tau,
        )

    def prepare(self, apply: LeafApply | None) -> None:
        """The apply started for the push the core takes next (``None``: none).

        Used by the next :meth:`candidate` only where it is that push's apply,
        and forgotten after it.
        """
        self._prepared = apply

    def candidate(
        self,
        update,
        weight,
        samples,
        staleness,
        version,
        stale,
        *,
        completes,
        args=None,
    ):
        prepared, self._prepared = self._prepared, None
        if (
            prepared is not None
            and self._check_result
            and completes is not False
            and stale is None
            and not args
        ):
            keep, w = self.mean_weights(weight, samples)
            if prepared.matches(
                self._params, self._opt_state, self._buffer, keep, w, staleness
            ):
                # The mean and its apply, worked out leaf by leaf as they came.
                buffer, params, opt_state, flags = prepared.result()
                bad = self.non_finite(flags)
                if bad is not None:
                    raise NonFiniteUpdate(
                        f"update refused: applied, it would make {bad} non-finite "
                        "(NaN or infinity); nothing changed"
                    )
                self.overlapped_applies += 1
                first_version, _ = self._oldest(version, None)
                return Pending(
                    buffer, samples, first_version, None, (params, opt_state)
                )
        return super().candidate(
            update,
            weight,
            samples,
            staleness,
            version,
            stale,
            completes=completes,
            args=args,
        )
