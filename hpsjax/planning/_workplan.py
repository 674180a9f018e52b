"""The work plan: what every worker and device does per round, and its JSON form.

:class:`WorkPlan` (one :class:`WorkerPlan` per worker, one :class:`DevicePlan`
per device) is what :func:`hpsjax.planning.plan` makes, a re-planner revises,
the server sends to its workers and a worker carries out; the names of the
schemes and step-size scalings a plan can have are here too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from hpsjax._checks import is_int, is_number

__all__ = [
    "ASHL_STAGE_MULTIPLIERS",
    "LR_SCALINGS",
    "MIN_BATCH_SHARE",
    "MIN_COMPRESS_RATIO",
    "PLAN_FORMAT",
    "PLAN_FORMAT_VERSION",
    "SCHEMES",
    "DevicePlan",
    "WorkPlan",
    "WorkerPlan",
]

SCHEMES = ("hps", "ashl", "adsp", "equal", "ashl_reference", "dylu")
LR_SCALINGS = ("linear", "sqrt", "none")
# The default smallest batch of a worker, as a share of the equal share B / n.
MIN_BATCH_SHARE = 1 / 8
# ``ashl_reference``: the multipliers k of its two stages, AHL then SHL.
ASHL_STAGE_MULTIPLIERS = (8, 2)
# The smallest top-k ratio a plan hands out: one value in a thousand.
MIN_COMPRESS_RATIO = 0.001
PLAN_FORMAT = "hpsjax.WorkPlan"
PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What one device of a worker does per step.

    Attributes:
      device_id: ``jax.Device.id`` of the device.
      batch_size: samples per step on this device.
      step_time: predicted seconds per step at ``batch_size``.
      time_intercept: ``a`` of the device's model
        ``t(b) = max(a + c b, r b)`` (seconds).
      time_slope: ``c`` of the model (seconds per sample), positive.
      best_time_per_sample: ``r`` of the model, the fewest seconds per sample
        measured, positive.
      max_batch: the largest batch that fits the device's memory, ``None`` for no
        limit. The model is kept so that a plan can be revised on its own.
      step_spread: the step time's coefficient of variation at ``batch_size``
        as profiled (:attr:`~hpsjax.planning.DeviceProfile.step_spread`), 0
        when not measured.
    """

    device_id: int
    batch_size: int
    step_time: float
    time_intercept: float
    time_slope: float
    best_time_per_sample: float
    max_batch: int | None
    step_spread: float = 0.0

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {self.batch_size}")
        if not (
            self.time_slope > 0
            and self.best_time_per_sample > 0
            and self.time_intercept >= 0
        ):
            raise ValueError(
                "a device's time model needs a slope and a time per sample > 0 "
                "and an intercept >= 0"
            )
        if self.max_batch is not None and self.batch_size > self.max_batch:
            raise ValueError(
                f"device {self.device_id}: batch {self.batch_size} exceeds its "
                f"memory limit of {self.max_batch}"
            )
        if not (math.isfinite(self.step_spread) and self.step_spread >= 0):
            raise ValueError(
                f"step_spread must be finite and >= 0, got {self.step_spread}"
            )


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """What one worker does per round.

    Attributes:
      worker_id: the worker's id.
      batch_size: samples per local step over all its devices.
      local_steps: local steps per round (per commit for ``adsp``).
      lr_scale: factor on the base step size (learning rate); the same for every
        worker of a plan (the server weights pushes by their samples).
      step_time: predicted seconds per local step (its slowest device).
      transfer_seconds: round-trip seconds to the server.
      round_time: predicted seconds per round, ``local_steps * step_time +
        transfer_seconds`` (for ``adsp``, the commit interval).
      devices: one plan per device.
      push_seconds: the push's part of ``transfer_seconds`` as profiled, ``None``
        when only the round trip was measured (a planner then counts half of
        it). Kept so that a plan can be revised on its own.
      stage_local_steps: local steps per round in each stage of training, in
        order; empty (the default) for a single stage of ``local_steps``.
        ``ashl_reference``: ``(H_i(8), H_i(2))``, the AHL and the SHL stage
        (``local_steps`` is the first). The worker runs the steps of the stage
        the server announces.
      data_share: the share of the training data this worker holds, ``None``
        (the default) when the plan leaves the data's split alone.
        ``ashl_reference``: ``p_i = H_i(2) / sum_j H_j(2)``; the data is
        re-partitioned by these shares before training.
      push_weight: the factor the server applies to this worker's pushes, 1
        (the default) for none. ``ashl_reference``: ``p_i``, the reference's
        rule of adding ``p_i`` times each worker's parameter delta to the
        global parameters.
      compress_ratio: the share of its update's values this worker sends when
        its pushes are top-k sparsified, in ``[MIN_COMPRESS_RATIO, 1]``; 1 (the
        default) for no sparsification. ``ashl_reference``: the ratio of its
        SHL pushes (AHL pushes go in full precision), see :func:`plan`.

    The fields after ``devices`` are the contract with the runtime: the worker
    applies its stage's local steps and its ``compress_ratio``, the server its
    ``push_weight`` and the data pipeline its ``data_share``; their defaults
    leave a worker as the schemes without them have it.
    """

    worker_id: int | str
    batch_size: int
    local_steps: int
    lr_scale: float
    step_time: float
    transfer_seconds: float
    round_time: float
    devices: tuple[DevicePlan, ...]
    push_seconds: float | None = None
    stage_local_steps: tuple[int, ...] = ()
    data_share: float | None = None
    push_weight: float = 1.0
    compress_ratio: float = 1.0

    def __post_init__(self):
        if isinstance(self.worker_id, bool) or not isinstance(
            self.worker_id, int | str
        ):
            raise ValueError(f"worker_id must be an int or a str: {self.worker_id!r}")
        if not self.devices:
            raise ValueError(f"worker {self.worker_id!r} has no devices")
        if self.batch_size != sum(d.batch_size for d in self.devices):
            raise ValueError(
                f"worker {self.worker_id!r}: batch_size {self.batch_size} is not the "
                "sum of its devices' batches"
            )
        if not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1: {self.local_steps}")
        if not self.lr_scale >= 0:
            raise ValueError(f"lr_scale must be >= 0, got {self.lr_scale}")
        who = f"worker {self.worker_id!r}"
        if self.push_seconds is not None and not (
            is_number(self.push_seconds)
            and math.isfinite(self.push_seconds)
            and 0 <= self.push_seconds <= self.transfer_seconds
        ):
            raise ValueError(
                f"{who}: push_seconds must be in [0, transfer_seconds], "
                f"got {self.push_seconds!r}"
            )
        if isinstance(self.stage_local_steps, str) or not isinstance(
            self.stage_local_steps, Sequence
        ):
            raise ValueError(
                f"{who}: stage_local_steps must be a sequence of ints >= 1, "
                f"got {self.stage_local_steps!r}"
            )
        stages = tuple(self.stage_local_steps)
        if not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in stages
        ):
            raise ValueError(
                f"{who}: stage_local_steps must be ints >= 1, got {list(stages)}"
            )
        object.__setattr__(self, "stage_local_steps", stages)
        if self.data_share is not None and not (
            is_number(self.data_share) and 0 <= self.data_share <= 1
        ):
            raise ValueError(
                f"{who}: data_share must be in [0, 1] or None, got {self.data_share!r}"
            )
        if not (
            is_number(self.push_weight)
            and math.isfinite(self.push_weight)
            and self.push_weight >= 0
        ):
            raise ValueError(
                f"{who}: push_weight must be a finite number >= 0, "
                f"got {self.push_weight!r}"
            )
        if not (
            is_number(self.compress_ratio)
            and MIN_COMPRESS_RATIO <= self.compress_ratio <= 1
        ):
            raise ValueError(
                f"{who}: compress_ratio must be in [{MIN_COMPRESS_RATIO}, 1], "
                f"got {self.compress_ratio!r}"
            )

    def stage_steps(self, stage: int) -> int:
        """Local steps per round in ``stage`` (0 for the first).

        A worker with a single stage runs ``local_steps`` in every stage.

        Examples:
          >>> w = WorkerProfile.synthetic(0, 1.0, transfer_seconds=0.5)
          >>> p = plan([w, WorkerProfile.synthetic(1, 2.0)], "ashl_reference",
          ...          global_batch=2)
          >>> [p.workers[1].stage_steps(s) for s in (0, 1)]
          [17, 5]
        """
        if not is_int(stage):
            raise ValueError(f"stage must be an int >= 0, got {stage!r}")
        if not self.stage_local_steps:
            if stage < 0:
                raise ValueError(f"stage must be an int >= 0, got {stage!r}")
            return self.local_steps
        if not 0 <= stage < len(self.stage_local_steps):
            raise ValueError(
                f"stage {stage} is not one of this plan's "
                f"{len(self.stage_local_steps)} stages"
            )
        return self.stage_local_steps[stage]


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    """Per-worker and per-device batch sizes, local steps and step-size scales.

    Attributes:
      scheme: one of :data:`SCHEMES`.
      global_batch: samples per round-step over all workers, the sum of the
        workers' batches.
      workers: one plan per worker.
      round_time: predicted seconds of the slowest worker's round.
      idle_fraction: predicted share of device time spent waiting at a barrier
        at the end of the round, in ``[0, 1)``.
      lr_scaling: how ``lr_scale`` follows the global batch, one of
        :data:`LR_SCALINGS`.
      reference_batch: the global batch with ``lr_scale == 1``.
      local_steps: the ``local_steps`` argument of :func:`plan`.
      min_device_batch: the smallest batch given to any device.
      min_batch: the smallest batch given to any worker.
      max_local_steps: the cap on local steps, ``None`` for none.
      commit_interval: ``adsp`` only: target seconds between commits.
      commits_per_period: ``adsp`` only: commits per check period.
      revision: 0 for a fresh plan, one more for each revision by a
        :class:`Replanner`.
      stage_multipliers: ``ashl_reference`` only: the multiplier ``k`` of each
        stage's plan, :data:`ASHL_STAGE_MULTIPLIERS` by default; empty for
        the other schemes.
      base_compress_ratio: ``ashl_reference`` only: the top-k ratio of the
        worker with the longest SHL round, which sets the others' ratios; 1
        for the other schemes.
      server_seconds: the server's own seconds per push the plan counted
        (see :func:`plan`); 0 for none.
      queue_seconds: the wait of the round's last push behind the others at
        the server, part of ``round_time`` (0 for schemes without a barrier).

    The plan's ``round_time`` and ``idle_fraction`` are those of the first
    stage when workers have several.
    """

    scheme: str
    global_batch: int
    workers: tuple[WorkerPlan, ...]
    round_time: float
    idle_fraction: float
    lr_scaling: str
    reference_batch: float
    local_steps: int = 1
    min_device_batch: int = 1
    min_batch: int = 1
    max_local_steps: int | None = None
    commit_interval: float | None = None
    commits_per_period: int | None = None
    revision: int = 0
    stage_multipliers: tuple[int, ...] = ()
    base_compress_ratio: float = 1.0
    server_seconds: float = 0.0
    queue_seconds: float = 0.0

    def __post_init__(self):
        _check_scheme(self.scheme)
        for name in ("server_seconds", "queue_seconds"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        _check_lr_scaling(self.lr_scaling)
        if not self.workers:
            raise ValueError("a WorkPlan needs at least one worker")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids repeat: {ids}")
        if sum(w.batch_size for w in self.workers) != self.global_batch:
            raise ValueError("the workers' batches do not sum to global_batch")
        if not 0 <= self.idle_fraction < 1:
            raise ValueError(f"idle_fraction must be in [0, 1): {self.idle_fraction}")
        scales = {w.lr_scale for w in self.workers}
        if len(scales) > 1:
            raise ValueError(
                f"the workers' lr_scale differ ({sorted(scales)}): the server "
                "already weights each push by its samples, so a per-worker scale "
                "would weight batches twice; plan again with this hpsjax"
            )
        if isinstance(self.stage_multipliers, str) or not isinstance(
            self.stage_multipliers, Sequence
        ):
            raise ValueError(
                "stage_multipliers must be a sequence of ints >= 1, "
                f"got {self.stage_multipliers!r}"
            )
        object.__setattr__(self, "stage_multipliers", tuple(self.stage_multipliers))
        if len({len(w.stage_local_steps) for w in self.workers}) > 1:
            raise ValueError("the workers' stage_local_steps differ in length")
        shares = [w.data_share for w in self.workers]
        if any(x is not None for x in shares) and (
            None in shares or abs(sum(shares) - 1.0) > 1e-6
        ):
            raise ValueError(
                f"the workers' data_share must all be given and sum to 1: {shares}"
            )

    @property
    def check_period(self) -> float | None:
        """``adsp`` only: seconds per check period, ``commit_interval * commits``."""
        if self.commit_interval is None or self.commits_per_period is None:
            return None
        return self.commit_interval * self.commits_per_period

    def worker(self, worker_id: int | str) -> WorkerPlan:
        """The plan of worker ``worker_id``."""
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        raise ValueError(f"no worker {worker_id!r} in this plan")

    def to_json(self) -> str:
        """Serialises the plan to a JSON string (see :meth:`from_json`)."""
        return json.dumps(
            {
                "format": PLAN_FORMAT,
                "version": PLAN_FORMAT_VERSION,
                **dataclasses.asdict(self),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> WorkPlan:
        """Reads a plan written by :meth:`to_json`.

        Raises:
          ValueError: the text is not a plan of a known format version, or the
            plan in it is inconsistent.
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON WorkPlan: {e}") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError("not a JSON WorkPlan (format key missing)")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"WorkPlan format version {data.get('version')!r} is not supported "
                f"(this hpsjax reads version {PLAN_FORMAT_VERSION})"
            )
        del data["format"], data["version"]
        try:
            workers = tuple(
                WorkerPlan(
                    **{
                        **w,
                        "devices": tuple(DevicePlan(**d) for d in w["devices"]),
                    }
                )
                for w in data.pop("workers")
            )
            return cls(workers=workers, **data)
        except KeyError as e:
            raise ValueError(
                f"malformed WorkPlan JSON: a worker or device entry has no {e}"
            ) from None
        except TypeError as e:
            raise ValueError(f"malformed WorkPlan JSON: {e}") from None


def _check_scheme(scheme: Any) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {SCHEMES}")


def _check_lr_scaling(lr_scaling: Any) -> None:
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(
            f"unknown lr_scaling {lr_scaling!r}; valid values: {LR_SCALINGS}"
        )
