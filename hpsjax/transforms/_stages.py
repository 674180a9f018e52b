r"""ASHL's stage machine: a sequence of training stages with their own settings.

ASHL trains in stages: first **AHL**, asynchronous with rare communication (many
local steps, large staleness tolerance), then **SHL**, semi-asynchronous with
frequent communication (few local steps, bounded staleness). :func:`hybrid_stages`
runs an ordered list of :class:`Stage`\ s as one optax transform: each stage has
its own inner transform, communication mode, local step count and staleness bound,
and a rule that ends it (a global step, a flat loss curve, or both). The state
records the current stage as an array, so the whole thing jits; the settings of
each stage are static Python values, which the worker and the server read back with
:func:`stage_settings`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hpsjax._checks import is_int, is_number
from hpsjax.transforms._common import find_one_state
from hpsjax.transforms._local_steps import (
    LocalStepsState,
    _accumulate,
    _init_local_steps,
)

__all__ = [
    "STAGE_MODES",
    "HybridStagesState",
    "Stage",
    "StageInfo",
    "current_stage",
    "hybrid_stages",
    "stage_settings",
]

STAGE_MODES = ("async", "semi_async", "sync")
"""Communication modes a :class:`Stage` may ask of the parameter server."""

# Stands for "never" in the per-stage tables of switch steps and windows.
_NEVER = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of :func:`hybrid_stages`; checked when built.

    Attributes:
      transform: the inner optax transform used while the stage lasts.
      mode: ``"async"`` (apply every push at once), ``"semi_async"`` (bounded
        staleness; needs ``max_staleness``) or ``"sync"`` (wait for all workers;
        staleness 0).
      local_steps: local updates per push in this stage, an int >= 1.
      max_staleness: staleness bound for the server, an int >= 0, or ``None``
        (unbounded; not allowed for ``"semi_async"``). ``"sync"`` allows only
        ``None`` or 0 and reports 0.
      until_step: leave the stage once this many updates were applied in all
        (a global step boundary, int >= 1), or ``None``.
      plateau_window: leave the stage once the loss has not improved on its best
        by more than ``plateau_threshold`` (relative) for this many consecutive
        updates (int >= 1), or ``None`` for no plateau rule.
      plateau_threshold: relative improvement that counts, in [0, 1).
    """

    transform: optax.GradientTransformation
    mode: str = "async"
    local_steps: int = 1
    max_staleness: int | None = None
    until_step: int | None = None
    plateau_window: int | None = None
    plateau_threshold: float = 1e-2

    def __post_init__(self):
        if not isinstance(self.transform, optax.GradientTransformation):
            raise ValueError(
                "Stage.transform must be an optax GradientTransformation, got "
                f"{type(self.transform).__name__} (for optax.MultiSteps pass "
                "`.gradient_transformation()`)."
            )
        if self.mode not in STAGE_MODES:
            raise ValueError(
                f"Unknown stage mode {self.mode!r}; valid modes are "
                f"{', '.join(STAGE_MODES)}."
            )
        if not is_int(self.local_steps) or self.local_steps < 1:
            raise ValueError(
                f"Stage.local_steps must be an int >= 1, got {self.local_steps!r}."
            )
        if self.max_staleness is not None and (
            not is_int(self.max_staleness) or self.max_staleness < 0
        ):
            raise ValueError(
                "Stage.max_staleness must be an int >= 0 or None, got "
                f"{self.max_staleness!r}."
            )
        if self.mode == "semi_async" and self.max_staleness is None:
            raise ValueError("A semi_async stage needs max_staleness (an int >= 0).")
        if self.mode == "sync" and self.max_staleness not in (None, 0):
            raise ValueError(
                "A sync stage has staleness 0; max_staleness must be None or 0, "
                f"got {self.max_staleness!r}."
            )
        for name in ("until_step", "plateau_window"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(
                    f"Stage.{name} must be an int >= 1 or None, got {value!r}."
                )
        threshold = self.plateau_threshold
        if not is_number(threshold) or not 0 <= threshold < 1:
            raise ValueError(
                f"Stage.plateau_threshold must lie in [0, 1), got {threshold!r}."
            )

    @property
    def ends(self) -> bool:
        """Whether the stage has a rule that ends it."""
        return self.until_step is not None or self.plateau_window is not None


class StageInfo(NamedTuple):
    """Settings of one stage, as static Python values.

    Attributes:
      index: position of the stage in the list.
      mode: one of :data:`STAGE_MODES`.
      local_steps: local updates per push.
      max_staleness: staleness bound, ``None`` for unbounded (0 for ``"sync"``).
    """

    index: int
    mode: str
    local_steps: int
    max_staleness: int | None


class HybridStagesState(NamedTuple):
    """State of :func:`hybrid_stages`.

    Attributes:
      stage: index of the stage the next update uses.
      step: updates applied so far, over all stages.
      stage_step: updates applied in the current stage.
      loss_average: exponential moving average of the loss in this stage (not
        bias-corrected).
      best_loss: best bias-corrected average loss of this stage (+inf at its start).
      plateau_count: updates since the last improvement on ``best_loss``.
      inner_states: the state of every stage's transform, in stage order.
      local_steps: accumulation of the updates for the next push.
    """

    stage: jax.Array  # shape=(), int32
    step: jax.Array  # shape=(), int32
    stage_step: jax.Array  # shape=(), int32
    loss_average: jax.Array  # shape=(), float32
    best_loss: jax.Array  # shape=(), float32
    plateau_count: jax.Array  # shape=(), int32
    inner_states: tuple[Any, ...]  # one optax state per stage
    local_steps: LocalStepsState


def _check_stages(stages: Any) -> tuple[Stage, ...]:
    if isinstance(stages, Stage) or not isinstance(stages, Sequence):
        raise ValueError(
            f"stages must be a list of Stage, got {type(stages).__name__}."
        )
    stages = tuple(stages)
    if not stages:
        raise ValueError("stages must hold at least one Stage.")
    for i, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise ValueError(
                f"stages[{i}] must be a Stage, got {type(stage).__name__}."
            )
        last = i == len(stages) - 1
        if last and stage.ends:
            raise ValueError(
                f"The last stage (stages[{i}]) never ends: drop its until_step "
                "and plateau_window."
            )
        if not last and not stage.ends:
            raise ValueError(
                f"stages[{i}] has no rule to end it (until_step or "
                "plateau_window), so the stages after it would never run."
            )
    untils = [s.until_step for s in stages if s.until_step is not None]
    if any(b <= a for a, b in itertools.pairwise(untils)):
        raise ValueError(f"until_step must increase from stage to stage, got {untils}.")
    return stages


def hybrid_stages(
    stages: Sequence[Stage], *, loss_smoothing: Any = 0.0
) -> optax.GradientTransformationExtraArgs:
    r"""Runs a list of stages, each with its own transform, as one transform.

    The update of global step :math:`t` goes through the transform of the current
    stage :math:`c` (``lax.switch`` over all stages, whose states are all kept), then
    into a local-steps accumulation with :math:`k = ` ``stages[c].local_steps``:
    :func:`~hpsjax.transforms._local_steps.push_due` and
    :func:`~hpsjax.transforms._local_steps.pending_update` read it as for
    :func:`~hpsjax.transforms._local_steps.local_steps`, so stage transforms should
    not contain ``local_steps`` themselves. The updates returned are the stage
    transform's (the accumulation does not change them), so all stage transforms
    must give updates of one dtype, as optax transforms do.

    After the update, stage :math:`c` ends when either rule it has fires:

    * **step boundary**: :math:`t + 1 \ge` ``until_step``: the stage's last update
      is the one of global step ``until_step - 1``;
    * **plateau**: with the loss :math:`L_t` (keyword extra argument ``loss``),
      :math:`\beta` = ``loss_smoothing`` and :math:`n` the updates so far in the
      stage, the bias-corrected average
      :math:`\bar L = m_n / (1 - \beta^n)`, :math:`m_n = \beta m_{n-1} +
      (1 - \beta) L_t`, :math:`m_0 = 0`, *improves* when
      :math:`\bar L < b - \theta |b|` for the stage's best :math:`b` (any finite
      :math:`\bar L` improves on the initial :math:`b = +\infty`; NaN never
      improves) and :math:`\theta` = ``plateau_threshold``. An improvement sets
      :math:`b = \bar L` and the counter to 0, anything else adds 1 to the counter;
      the stage ends when the counter reaches ``plateau_window``. A flat loss thus
      ends the stage after ``plateau_window + 1`` updates; a loss that keeps
      falling by more than :math:`\theta` per update never does.

    A stage that ends flushes the accumulation: that update's push is due, so every
    stage starts with a fresh sum. If the next stage's ``until_step`` has passed
    already, it is skipped. The last stage never ends. The new stage starts with a
    fresh loss average, best and counter (its inner state is kept from before).

    All extra arguments, ``loss`` included, are forwarded to the stage transforms
    (e.g. ``staleness`` for :func:`~hpsjax.transforms._staleness.scale_by_staleness`).
    A stage's ``mode`` and ``max_staleness`` are for the parameter server, read
    back with :func:`stage_settings`; to also damp or cut stale updates in the
    transform, put ``scale_by_staleness`` in the stage's transform.

    Args:
      stages: ordered, non-empty list of :class:`Stage`. Every stage but the last
        needs ``until_step`` or ``plateau_window``; the last may have neither;
        ``until_step`` increases from stage to stage.
      loss_smoothing: :math:`\beta \in [0, 1)`, smoothing of the loss before the
        plateau rule; 0 uses the raw loss.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`HybridStagesState`.
      ``update`` needs the keyword extra argument ``loss`` (a scalar) when any
      stage has a plateau rule.

    Raises:
      ValueError: at construction, for an empty list, a non-:class:`Stage` entry,
        a last stage with a switch rule, another stage without one, until_steps
        that do not increase, or ``loss_smoothing`` outside [0, 1). :class:`Stage`
        itself rejects bad modes, local steps and staleness bounds.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from hpsjax.transforms import (
      ...     Stage, current_stage, hybrid_stages, stage_settings)
      >>> stages = [
      ...     Stage(optax.sgd(0.1), mode="async", local_steps=8, until_step=2),
      ...     Stage(optax.sgd(0.01), mode="semi_async", local_steps=1,
      ...           max_staleness=2),
      ... ]
      >>> tx = hybrid_stages(stages)
      >>> params = jnp.zeros(3)
      >>> state = tx.init(params)
      >>> for _ in range(3):
      ...     updates, state = tx.update(jnp.ones(3), state, params)
      ...     print(stage_settings(stages, state))
      StageInfo(index=0, mode='async', local_steps=8, max_staleness=None)
      StageInfo(index=1, mode='semi_async', local_steps=1, max_staleness=2)
      StageInfo(index=1, mode='semi_async', local_steps=1, max_staleness=2)

    References:
      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, `ASHL: An Adaptive Multi-Stage
      Distributed Deep Learning Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 73(1),
      2024.

      Hu, Wang, Wu, `Distributed Machine Learning through Heterogeneous Edge
      Systems <https://arxiv.org/abs/1911.06949>`_ (ADSP), AAAI 2020.
    """
    stages = _check_stages(stages)
    if (
        isinstance(loss_smoothing, bool)
        or not isinstance(loss_smoothing, int | float | np.number | jax.Array)
        or jnp.ndim(loss_smoothing) != 0
    ):
        raise ValueError(
            f"loss_smoothing must be a scalar in [0, 1), got {loss_smoothing!r}."
        )
    if not isinstance(loss_smoothing, jax.core.Tracer) and not (
        0 <= float(loss_smoothing) < 1
    ):
        raise ValueError(
            f"loss_smoothing must lie in [0, 1), got {float(loss_smoothing)}."
        )

    transforms = [optax.with_extra_args_support(s.transform) for s in stages]
    uses_plateau = any(s.plateau_window is not None for s in stages)

    def table(values, dtype):
        return jnp.asarray(np.asarray(values, dtype=dtype))

    def init_fn(params):
        return HybridStagesState(
            stage=jnp.zeros([], jnp.int32),
            step=jnp.zeros([], jnp.int32),
            stage_step=jnp.zeros([], jnp.int32),
            loss_average=jnp.zeros([], jnp.float32),
            best_loss=jnp.full([], jnp.inf, jnp.float32),
            plateau_count=jnp.zeros([], jnp.int32),
            inner_states=tuple(t.init(params) for t in transforms),
            local_steps=_init_local_steps(params, None),
        )

    def update_fn(updates, state, params=None, *, loss=None, **extra_args):
        if loss is not None:
            if jnp.ndim(loss) != 0:
                raise ValueError(f"loss must be a scalar, got shape {jnp.shape(loss)}.")
            extra_args["loss"] = loss
        elif uses_plateau:
            raise ValueError(
                "Missing the keyword extra argument `loss`: a stage ends on a "
                "loss plateau, so update(updates, state, params, loss=...) needs "
                "the training loss of this step."
            )

        def branch(i):
            def run(operands):
                updates, inner_states = operands
                new_updates, new_state = transforms[i].update(
                    updates, inner_states[i], params, **extra_args
                )
                return new_updates, (
                    *inner_states[:i],
                    new_state,
                    *inner_states[i + 1 :],
                )

            return run

        operands = (updates, state.inner_states)
        if len(stages) == 1:
            updates, inner_states = branch(0)(operands)
        else:
            updates, inner_states = lax.switch(
                state.stage, [branch(i) for i in range(len(stages))], operands
            )

        stage = state.stage
        step = optax.safe_increment(state.step)
        stage_step = optax.safe_increment(state.stage_step)
        until = table(
            [_NEVER if s.until_step is None else s.until_step for s in stages],
            np.int32,
        )
        leave = step >= until[stage]

        loss_average, best_loss = state.loss_average, state.best_loss
        plateau_count = state.plateau_count
        if uses_plateau:
            windows = table(
                [
                    _NEVER if s.plateau_window is None else s.plateau_window
                    for s in stages
                ],
                np.int32,
            )
            thresholds = table([s.plateau_threshold for s in stages], np.float32)
            beta = jnp.asarray(loss_smoothing, jnp.float32)
            loss_average = beta * loss_average + (1 - beta) * jnp.asarray(
                loss, jnp.float32
            )
            smoothed = loss_average / (1 - beta**stage_step)
            improved = jnp.where(
                jnp.isfinite(best_loss),
                smoothed < best_loss - thresholds[stage] * jnp.abs(best_loss),
                jnp.isfinite(smoothed),
            )
            best_loss = jnp.where(improved, smoothed, best_loss)
            plateau_count = jnp.where(improved, 0, optax.safe_increment(plateau_count))
            leave = jnp.logical_or(leave, plateau_count >= windows[stage])

        last = len(stages) - 1
        new_stage = jnp.minimum(stage + leave.astype(jnp.int32), last)
        # A stage whose until_step has passed already is skipped; no more than
        # `last` hops are ever needed.
        for _ in range(last - 1):
            passed = jnp.logical_and(step >= until[new_stage], new_stage < last)
            new_stage = new_stage + passed.astype(jnp.int32)
        switched = new_stage != stage

        local = _accumulate(
            updates,
            state.local_steps,
            table([s.local_steps for s in stages], np.int32)[stage],
            flush=switched,
        )
        zero = jnp.zeros([], jnp.int32)
        new_state = HybridStagesState(
            stage=new_stage,
            step=step,
            stage_step=jnp.where(switched, zero, stage_step),
            loss_average=jnp.where(switched, 0.0, loss_average).astype(jnp.float32),
            best_loss=jnp.where(switched, jnp.inf, best_loss).astype(jnp.float32),
            plateau_count=jnp.where(switched, zero, plateau_count),
            inner_states=inner_states,
            local_steps=local,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_hybrid_state(state: Any) -> HybridStagesState:
    return find_one_state(
        state,
        HybridStagesState,
        error="Expected exactly one HybridStagesState in the optimizer state, "
        "found {found}.",
    )


def current_stage(state: Any) -> jax.Array:
    """Index of the stage the next update will use.

    Args:
      state: any optax state holding exactly one :class:`HybridStagesState`
        (alone or inside ``optax.chain``, ``inject_hyperparams``, ...).

    Returns:
      An int32 scalar array.

    Raises:
      ValueError: if the state holds no :class:`HybridStagesState`, or several.
    """
    return _find_hybrid_state(state).stage


def stage_settings(stages: Sequence[Stage], state_or_index: Any) -> StageInfo:
    """Settings of the current (or a given) stage, as static Python values.

    Args:
      stages: the list given to :func:`hybrid_stages`.
      state_or_index: a stage index (int or concrete int array), or an optax
        state holding a :class:`HybridStagesState`.

    Returns:
      A :class:`StageInfo`.

    Raises:
      ValueError: for an index out of range, a traced index (call it outside
        ``jit``), or a state without exactly one :class:`HybridStagesState`.

    Examples:
      >>> import optax
      >>> from hpsjax.transforms import Stage, stage_settings
      >>> stages = [Stage(optax.sgd(0.1), local_steps=4, until_step=100),
      ...           Stage(optax.sgd(0.1), mode="sync")]
      >>> stage_settings(stages, 1)
      StageInfo(index=1, mode='sync', local_steps=1, max_staleness=0)
    """
    stages = _check_stages(stages)
    is_index = is_int(state_or_index) or (
        isinstance(state_or_index, jax.Array | np.ndarray)
        and jnp.issubdtype(state_or_index.dtype, jnp.integer)
    )
    index = state_or_index if is_index else current_stage(state_or_index)
    if isinstance(index, jax.core.Tracer):
        raise ValueError(
            "stage_settings reads static settings and needs a concrete stage "
            "index: call it outside jit, on the returned state."
        )
    if np.ndim(index) != 0:
        raise ValueError(f"A stage index must be a scalar, got {index!r}.")
    index = int(index)
    if not 0 <= index < len(stages):
        raise ValueError(f"Stage index {index} out of range for {len(stages)} stages.")
    stage = stages[index]
    max_staleness = 0 if stage.mode == "sync" else stage.max_staleness
    return StageInfo(
        index=index,
        mode=stage.mode,
        local_steps=stage.local_steps,
        max_staleness=max_staleness,
    )
