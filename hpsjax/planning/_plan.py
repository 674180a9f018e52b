"""The plan from profiles: :func:`plan` checks its arguments and solves.

The schemes (H-PS, ASHL as we read it and as its reference plans it, ADSP,
DyLU, equal), the step-size scale and their papers are documented on
:func:`plan`; the arithmetic is in :mod:`hpsjax.planning._solve`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hpsjax._checks import check_int, check_positive, is_number
from hpsjax.planning._profiles import WorkerProfile
from hpsjax.planning._solve import _model_from_profile, _solve
from hpsjax.planning._workplan import (
    ASHL_STAGE_MULTIPLIERS,
    MIN_BATCH_SHARE,
    MIN_COMPRESS_RATIO,
    WorkPlan,
    _check_lr_scaling,
    _check_scheme,
)

__all__ = ["plan"]


def plan(
    profiles: Sequence[WorkerProfile],
    scheme: str = "hps",
    *,
    global_batch: int,
    lr_scaling: str = "none",
    reference_batch: float | None = None,
    local_steps: int = 1,
    min_device_batch: int = 1,
    min_batch: int | None = None,
    max_local_steps: int | None = None,
    check_period: float | None = None,
    commits_per_period: int | None = None,
    memory_fraction: float = 0.9,
    stage_multipliers: Sequence[int] | None = None,
    compress_ratio: float | None = None,
    server_seconds: float | None = None,
) -> WorkPlan:
    r"""Plans per-worker batches, local steps and step-size scales from profiles.

    **hps** (H-PS). Every device gets the batch with which all workers finish a
    round at the same time ``tau``:

    .. math::

      b_d = \mathrm{clip}\Big(t_d^{-1}\big((\tau - T_i)/H\big),\;
            b_\mathrm{min},\; b^\mathrm{mem}_d\Big), \qquad \sum_d b_d = B,

    solved exactly for ``tau``, where ``t_d(b) = max(a_d + c_d b, r_d b)`` is the
    device's profiled step time
    (:meth:`hpsjax.planning.DeviceProfile.step_time`; ``r_d`` the fewest
    seconds per sample measured); with no fixed cost (``a_d = T_i = 0``) this is
    ``b_d`` proportional to throughput ``1 / c_d``. ``b_min`` is the larger of
    ``min_device_batch`` and the device's part of ``min_batch``: where a step is
    mostly fixed cost (``a_d`` large against ``c_d b``), finishing together would
    hand a slow worker a batch of one or two, a worker that then costs a round but
    hardly adds samples; ``min_batch`` holds it up and a warning is logged.
    ``b^mem_d`` is the largest batch
    whose profiled peak memory fits ``memory_fraction`` of the device's capacity;
    where it binds, the rest goes to the other devices. Batches are rounded to
    integers by largest remainder, which keeps ``sum_d b_d = B`` exact. Each worker
    runs ``H = local_steps`` local steps.

    **ashl** (ASHL). Equal batches ``B / n`` per worker (split over its devices
    so that they finish together). The worker with the longest round at
    ``H_min = local_steps`` steps sets the round length, and every worker runs as
    many local steps as fit in it:

    .. math::

      L = \max_i (H_\mathrm{min} t_i + T_i), \qquad
      H_i = \max\big(H_\mathrm{min}, \mathrm{round}((L - T_i) / t_i)\big),

    so ``H_i t_i + T_i`` is about ``L`` for every worker. Plan the coarse AHL stage
    with a large ``local_steps`` and the fine SHL stage with a small one.

    **adsp** (ADSP). Equal batches as for ``ashl``. Time is cut into check
    periods ``Gamma`` in which every worker commits ``C`` times, so commits are
    ``I = Gamma / C`` seconds apart, and worker ``i`` runs

    .. math::

      H_i = \max\big(1, \mathrm{round}(I / t_i)\big)

    local steps per commit; commits go out in the background, so ``T_i`` is not
    part of ``I`` (a link slower than ``I`` stretches the worker's interval to
    ``T_i``). Given ``check_period`` and ``commits_per_period``, ``I`` follows;
    given only ``check_period``, ``C`` is the most commits per period at which the
    slowest worker still runs ``local_steps`` steps per commit; otherwise
    ``I = local_steps * max_i t_i`` and ``C`` is ``commits_per_period`` (1 when not
    given). ADSP searches the global commit rate online; plan again with the
    rate it settles on.

    **ashl_reference** (ASHL as its authors' public code plans it). Equal
    batches as for ``ashl``. For a multiplier ``k`` the plan is

    .. math::

      H_i(k) = \mathrm{round}\Big(\frac{\max_j (k\, c_j + m_j) - m_i}{c_i}\Big),

    ``c_i = t_i`` the worker's compute seconds per local step at its batch and
    ``m_i`` its communication seconds per round, so that ``H_i c_i + m_i`` is
    about the same for every worker. Two plans are made, one per stage of
    ``stage_multipliers`` (``(8, 2)`` by default, as in the reference): the
    AHL stage's with ``m_i = T_i``, its full round trip (AHL pushes in full
    precision), and the SHL stage's with ``m_i = rho P_i + (T_i - P_i)``,
    ``P_i`` the push's part of the round trip (half of it when only the round
    trip was profiled) and ``rho = compress_ratio`` (1 by default, as in the
    reference). Each worker gets ``stage_local_steps = (H_i(8), H_i(2))`` and
    ``local_steps = H_i(8)``. The shares ``p_i = H_i(2) / sum_j H_j(2)`` are
    each worker's ``data_share`` and its ``push_weight``. Its SHL top-k ratio
    is the share of its push that fits the longest SHL round ``M = max_j
    (H_j(2) c_j + m_j)`` after its compute and the rest of its transfer:

    .. math::

      \mathrm{ratio}_i = \mathrm{clip}\Big(
        \frac{M - H_i(2)\, c_i - (T_i - P_i)}{P_i},\;
        \mathrm{MIN\_COMPRESS\_RATIO},\; 1\Big),

    1 where ``P_i = 0``. The worker with the longest round gets ``rho`` and a
    faster one more, up to 1 (no sparsification). The reference also counts
    the seconds spent compressing in ``m_i``; the profile does not measure
    them, so they count as 0 here. ``local_steps`` does not
    apply; ``max_local_steps`` caps both stages before the shares are taken.
    The server decides the switch from AHL to SHL.

    **dylu** (Dynamic Local Updates, asynchronous local SGD). Equal batches
    as for ``ashl``; each worker's local steps are proportional to its speed
    ``1 / t_i``, so that all finish their compute of a round at about the same
    time, the fastest running ``H = local_steps``:

    .. math::

      H_i = \max\Big(1, \mathrm{round}\Big(H\, \frac{\min_j t_j}{t_i}\Big)\Big).

    The transfer does not enter, as in the paper, where workers push in the
    background of an asynchronous server. A :class:`Replanner` sets the steps
    again from the measured speeds.

    **equal**. ``B / n`` per worker and an equal split over its devices,
    ``local_steps`` everywhere: the baseline the others are measured against.

    **Step-size scale.** Batch weighting belongs to the server alone: it averages
    a round's pushes weighted by their samples, which gives the mean gradient of
    all ``B`` samples, ``sum_i (b_i / B) g_i``, however ``B`` is split. So
    ``lr_scale`` is one factor for every worker and depends only on the global
    batch: 1 (``"none"``, the default), ``B / b_ref`` (``"linear"``, the linear
    scaling rule) or ``sqrt(B / b_ref)`` (``"sqrt"``), ``b_ref`` the global batch
    the base step size was tuned for (``B / n`` by default: one worker's equal
    share). ``"linear"`` and ``"sqrt"`` are a deliberate change of the global step
    size; for equal gradients no plan changes the step. Local steps do not change
    the scale: each is an ordinary step on ``b_i`` samples.

    Args:
      profiles: one :class:`WorkerProfile` per worker.
      scheme: one of :data:`SCHEMES`.
      global_batch: ``B``, samples per step over all workers.
      lr_scaling: one of :data:`LR_SCALINGS`.
      reference_batch: the global batch with scale 1; ``B / n`` by default.
      local_steps: ``H`` for ``hps`` and ``equal``, ``H_min`` for ``ashl``, the
        slowest worker's steps per commit for ``adsp``, the fastest worker's
        steps for ``dylu``; not used by ``ashl_reference``.
      min_device_batch: the smallest batch any device gets.
      min_batch: the smallest batch any worker gets; by default
        :data:`MIN_BATCH_SHARE` of the equal share, ``max(1, floor(B / (8 n)))``.
        Pass 1 to let ``hps`` balance finish times alone.
      max_local_steps: a cap on any worker's local steps, ``None`` for none.
      check_period: ``adsp`` only: seconds per check period.
      commits_per_period: ``adsp`` only: commits per check period.
      memory_fraction: share of a device's memory capacity a step may use.
      stage_multipliers: ``ashl_reference`` only: ``(k_AHL, k_SHL)``, two ints
        >= 1; :data:`ASHL_STAGE_MULTIPLIERS` by default.
      compress_ratio: ``ashl_reference`` only: the SHL top-k ratio of the
        worker with the longest round, in ``[MIN_COMPRESS_RATIO, 1]``; 1 by
        default.
      server_seconds: the server's own seconds per push, ``s`` of the barrier
        round's queue (see ``docs/api/planning.md``); by default the median of the
        profiles' measured ``transfer.server_seconds``, 0 when none has one.
        Pass 0 to leave the queue out.

    Returns:
      The :class:`WorkPlan`.

    Raises:
      ValueError: no profiles, repeated worker ids, a non-positive speed, a
        global batch smaller than the devices times ``min_device_batch`` (the
        workers times ``min_batch``) or larger than their memory holds, an
        unknown scheme or ``lr_scaling``, or another argument out of range.

    Examples:
      >>> workers = [WorkerProfile.synthetic(i, s) for i, s in enumerate([1, 1, 2, 4])]
      >>> [w.batch_size for w in plan(workers, "hps", global_batch=256).workers]
      [32, 32, 64, 128]
      >>> p = plan(workers, "dylu", global_batch=256, local_steps=8)
      >>> [(w.batch_size, w.local_steps) for w in p.workers]
      [(64, 2), (64, 2), (64, 4), (64, 8)]

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154

      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
      Distributed Deep Learning Training Scheme for Heterogeneous Environments",
      IEEE Transactions on Computers, 2024,
      https://doi.org/10.1109/TC.2023.3315847

      Hu, Wang, Wu, "Distributed Machine Learning through Heterogeneous Edge
      Systems" (ADSP), AAAI, 2020, https://arxiv.org/abs/1911.06949

      Goyal, Dollar, Girshick, Noordhuis, Wesolowski, Kyrola, Tulloch, Jia, He,
      "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017,
      https://arxiv.org/abs/1706.02677

      Krizhevsky, "One weird trick for parallelizing convolutional neural
      networks" (square-root scaling), 2014, https://arxiv.org/abs/1404.5997

      ASHL's public reference implementation, the repository
      ``xiangunremarkable/ASHL`` on GitHub (its plan, shares and ratios).

      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato,
      "Asynchronous Local-SGD Training for Language Modeling" (Dynamic Local
      Updates), 2024, https://arxiv.org/abs/2401.09135
    """
    profiles = _checked_profiles(profiles)
    _check_scheme(scheme)
    _check_lr_scaling(lr_scaling)
    global_batch = check_int("global_batch", global_batch, low=1)
    local_steps = check_int("local_steps", local_steps, low=1)
    min_device_batch = check_int("min_device_batch", min_device_batch, low=1)
    if min_batch is None:
        min_batch = max(1, math.floor(global_batch * MIN_BATCH_SHARE / len(profiles)))
    min_batch = check_int("min_batch", min_batch, low=1)
    if max_local_steps is not None:
        max_local_steps = check_int("max_local_steps", max_local_steps, low=local_steps)
    if reference_batch is None:
        reference_batch = global_batch / len(profiles)
    reference_batch = check_positive("reference_batch", reference_batch)
    if check_period is not None:
        check_period = check_positive("check_period", check_period)
    if commits_per_period is not None:
        commits_per_period = check_int("commits_per_period", commits_per_period, low=1)
    if scheme != "adsp" and (check_period, commits_per_period) != (None, None):
        raise ValueError("check_period and commits_per_period apply to 'adsp' only")
    stage_multipliers, base_compress_ratio = _ashl_reference_options(
        scheme, stage_multipliers, compress_ratio
    )
    if not is_number(memory_fraction) or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    server_seconds = _server_seconds(profiles, server_seconds)
    models = [_model_from_profile(p, memory_fraction) for p in profiles]
    return _solve(
        models,
        scheme,
        global_batch=global_batch,
        lr_scaling=lr_scaling,
        reference_batch=reference_batch,
        local_steps=local_steps,
        min_device_batch=min_device_batch,
        min_batch=min_batch,
        max_local_steps=max_local_steps,
        check_period=check_period,
        commits_per_period=commits_per_period,
        revision=0,
        stage_multipliers=stage_multipliers,
        base_compress_ratio=base_compress_ratio,
        server_seconds=float(server_seconds),
    )


def _checked_profiles(profiles: Sequence[WorkerProfile]) -> list[WorkerProfile]:
    """The profiles as a list: at least one, all ``WorkerProfile``, ids unique."""
    profiles = list(profiles)
    if not profiles:
        raise ValueError("profiles is empty: plan needs at least one worker")
    if not all(isinstance(p, WorkerProfile) for p in profiles):
        raise ValueError("profiles must be WorkerProfile objects")
    ids = [p.worker_id for p in profiles]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids repeat: {ids}")
    return profiles


def _ashl_reference_options(
    scheme: str, stage_multipliers: Sequence[int] | None, compress_ratio: float | None
) -> tuple[tuple[int, ...], float]:
    """``ashl_reference``'s stage multipliers and base top-k ratio, checked
    (``()`` and 1 for the other schemes, which take neither)."""
    if scheme != "ashl_reference" and (stage_multipliers, compress_ratio) != (
        None,
        None,
    ):
        raise ValueError(
            "stage_multipliers and compress_ratio apply to 'ashl_reference' only"
        )
    base_compress_ratio = 1.0
    if scheme == "ashl_reference":
        if stage_multipliers is None:
            stage_multipliers = ASHL_STAGE_MULTIPLIERS
        if (
            isinstance(stage_multipliers, str)
            or not isinstance(stage_multipliers, Sequence)
            or len(stage_multipliers) != 2
        ):
            raise ValueError(
                "stage_multipliers must be two ints >= 1 (AHL, SHL), "
                f"got {stage_multipliers!r}"
            )
        stage_multipliers = tuple(
            check_int("stage_multipliers", k, low=1) for k in stage_multipliers
        )
        if compress_ratio is not None:
            if not (
                is_number(compress_ratio) and MIN_COMPRESS_RATIO <= compress_ratio <= 1
            ):
                raise ValueError(
                    f"compress_ratio must be in [{MIN_COMPRESS_RATIO}, 1], "
                    f"got {compress_ratio!r}"
                )
            base_compress_ratio = float(compress_ratio)
    else:
        stage_multipliers = ()
    return stage_multipliers, base_compress_ratio


def _server_seconds(profiles: Sequence[WorkerProfile], server_seconds) -> float:
    """The server's seconds per push: as given, else the profiles' median."""
    if server_seconds is None:
        measured = [
            p.transfer.server_seconds
            for p in profiles
            if p.transfer is not None and p.transfer.server_seconds is not None
        ]
        server_seconds = float(np.median(measured)) if measured else 0.0
    elif not (
        is_number(server_seconds)
        and math.isfinite(server_seconds)
        and server_seconds >= 0
    ):
        raise ValueError(
            f"server_seconds must be a finite number >= 0, got {server_seconds!r}"
        )
    return float(server_seconds)
