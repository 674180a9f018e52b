r"""From a config to hpsjax objects: data, model, optimizers, policy, workers, plan.

Both backends (the simulator and real processes) build a scheme from the same
functions here, so a config means the same thing on either:

* :func:`setup`: the task (``config.task``, :mod:`hpsjax.tasks`) and the run's
  target (:class:`experiments.target.Target`), the dataset (split into train
  and test), the model's graph and initial parameters, and the task's loss and
  jitted evaluation functions;
* :func:`server_optimizer`: the server's optax chain, with
  ``scale_by_staleness`` (staleness-aware ASP) or ``delay_compensation``
  (DC-ASGD) ahead of the optimizer;
* :func:`local_optimizer`: the workers' optimizer of local steps, or ``None``
  for workers that push gradients;
* :func:`policy`: the server policy (by name, or ASHL's :class:`PlannedHybrid`);
* :func:`worker_specs` and :func:`simulated_profiles`: simulated workers and the
  profiling pass run on them;
* :func:`work_plan`: the plan of ``config.plan.scheme`` from profiles.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from experiments import registry
from experiments.configs.schema import Args, ExperimentConfig, Section
from experiments.target import Target, target, task_of
from hpsjax._lru import LruCache
from hpsjax.ps import Hybrid, HybridStage, PlannedHybrid

__all__ = [
    "PlannedHybrid",
    "Setup",
    "hybrid_stages",
    "local_optimizer",
    "plans",
    "policy",
    "server_optimizer",
    "setup",
    "simulated_profiles",
    "slowdown_schedule",
    "target",
    "task_of",
    "work_plan",
    "worker_specs",
]


class Setup(NamedTuple):
    """What every backend trains and evaluates.

    Attributes:
      train: the training set (workers shard it).
      test: the held-out set the evaluation metrics are measured on.
      graphdef: the model's graph (``hpsjax.models.split_model``).
      params: the initial parameters, a dict of arrays.
      loss_fn: ``(params, batch) -> scalar``: the mean of the task's
        per-example losses, what the workers train.
      eval_fn: ``(params, batch) -> {metric: scalar}``, the task's metrics of
        a batch (``"loss"`` and the task's others), jitted.
      task: the :class:`hpsjax.tasks.Task` of ``config.task``.
      target: the run's :class:`experiments.target.Target`.
    """

    train: Any
    test: Any
    graphdef: Any
    params: Any
    loss_fn: Any
    eval_fn: Any
    task: Any
    target: Target

    def summarize(self, means: Mapping[str, float]) -> dict[str, float]:
        """What an evaluation reports, from its metrics averaged over the
        held-out examples (``task.summarize``: a language model's
        perplexity)."""
        return {k: float(v) for k, v in self.task.summarize(dict(means)).items()}


_REUSED = LruCache(64)


def reused(kind: str, settings: Any, make: Callable[[], Any]) -> Any:
    """``make()``, or the object an earlier call of equal ``settings`` made.

    The simulator and the server keep their compiled programs per optimizer,
    transform and loss *object*; building equal settings into the same object
    lets every run in a process that repeats them (a comparison's seeds, a
    suite's schemes, a test session) reuse those programs instead of tracing
    and compiling them again. What is built here is pure (optax transforms,
    loss functions), so sharing it changes no result.

    Args:
      kind: what is built (part of the key).
      settings: everything ``make`` reads, as config dicts, numbers or strings;
        compared by value.
      make: builds the object.
    """
    key = (kind, json.dumps(_plain(settings), sort_keys=True, default=repr))
    return _REUSED.get(key, make)


def _plain(settings: Any) -> Any:
    if isinstance(settings, Section | Args):
        return settings.to_dict()
    if isinstance(settings, tuple | list):
        return [_plain(s) for s in settings]
    return settings


def dataset_kwargs(config: ExperimentConfig) -> dict[str, Any]:
    """Keyword arguments of ``hpsjax.data.get_dataset`` for the config's data:
    its own fields for ``npz`` and the generated datasets, then ``data.args``."""
    data = config.data
    kwargs: dict[str, Any] = {}
    if data.name == "npz":
        kwargs = {"path": data.path, "x_key": data.x_key, "y_key": data.y_key}
    elif data.name in ("synthetic_digits", "synthetic_regression"):
        kwargs = {"num_examples": int(data.num_examples), "seed": int(data.seed)}
        if data.name == "synthetic_digits":
            kwargs["image_size"] = int(data.image_size)
    return {**kwargs, **_plain(data.args or {})}


def model_kwargs(config: ExperimentConfig) -> dict[str, Any]:
    """Keyword arguments of ``hpsjax.models.get_model`` beyond shapes and seed:
    the MLP's ``model.hidden``, then ``model.args``."""
    kwargs: dict[str, Any] = {}
    if config.model.name == "mlp":
        kwargs = {"hidden": tuple(int(h) for h in config.model.hidden)}
    return {**kwargs, **_plain(config.model.args or {})}


def setup(config: ExperimentConfig) -> Setup:
    """Loads the data and builds the model and the task of ``config``.

    The train/test split uses seed 0, as the worker command line does, so both
    backends hold out the same examples.

    Raises:
      FileNotFoundError: ``data.name="npz"`` and no file at ``data.path``.
      ValueError: an unknown task, a target on a metric it does not report, an
        unreadable ``.npz`` file, or bad data or model settings.
    """
    from hpsjax import data, models

    task = task_of(config.task)
    goal = Target.of_config(config, task)
    dataset = data.get_dataset(config.data.name, **dataset_kwargs(config))
    train, test = dataset.split(float(config.data.test_fraction), seed=0)
    model = models.resolve_model(
        config.model.name,
        input_shape=train.input_shape,
        num_classes=None if ":" in config.model.name else train.num_classes,
        seed=int(config.model.seed),
        **model_kwargs(config),
    ).model
    graphdef, params = models.split_model(model)
    loss_fn, eval_fn = _task_functions(task, graphdef)
    return Setup(train, test, graphdef, params, loss_fn, eval_fn, task, goal)


@functools.lru_cache(maxsize=16)
def _task_functions(task: Any, graphdef: Any) -> tuple[Callable, Callable]:
    """The loss and the jitted evaluation of a task on a model graph, one pair
    per task and graph (equal graphs share them, and so their compiled
    programs)."""
    from hpsjax import tasks

    def loss_fn(params, batch):
        return jax.numpy.mean(tasks.per_example_loss(task, params, graphdef, batch))

    @jax.jit
    def eval_fn(params, batch):
        return tasks.evaluate(task, params, graphdef, batch)

    return loss_fn, eval_fn


def server_optimizer(config: ExperimentConfig) -> optax.GradientTransformation:
    r"""The server's optax chain for ``config.server``.

    ``[clip_by_global_norm(c)] + [scale_by_staleness(policy)] +
    [delay_compensation(lam)] + optimizer``: the clipping (``server.clip_norm``,
    Clipped ASGD), the damping and the compensation see the raw update, the
    optimizer the result.
    """
    return reused(
        "server optimizer",
        (config.server, len(config.workers.slowdowns)),
        lambda: _server_optimizer(config),
    )


def _server_optimizer(
    config: ExperimentConfig,
) -> optax.GradientTransformation:
    from hpsjax.transforms import delay_compensation, scale_by_staleness

    server = config.server
    make = registry.lookup("optimizer", server.optimizer)
    chain = []
    clip = server.clip_norm
    if clip is not None:
        # Clipped ASGD: each arriving update clipped to this global norm.
        if isinstance(clip, bool) or not (isinstance(clip, int | float) and clip > 0):
            raise ValueError(f"server.clip_norm must be a number > 0, got {clip!r}")
        chain.append(optax.clip_by_global_norm(float(clip)))
    if server.staleness_lr is not None:
        registry.lookup("staleness policy", server.staleness_lr)
        chain.append(scale_by_staleness(server.staleness_lr))
    if server.dc_lambda is not None:
        chain.append(
            delay_compensation(float(server.dc_lambda), adaptive=server.dc_adaptive)
        )
    extra: dict[str, Any] = {}
    if server.optimizer == "delayed_nesterov":
        # Liu et al. 2024 update the outer momentum once per N arrivals, N the
        # number of workers, unless the config names another delay.
        delay = server.outer_delay or len(config.workers.slowdowns)
        extra["delay"] = int(delay)
    extra.update(server.optimizer_args or {})
    # A momentum of 0 means "not given": each optimizer keeps its own default.
    chain.append(
        make(
            float(server.learning_rate),
            momentum=float(server.momentum) or None,
            **extra,
        )
    )
    return chain[0] if len(chain) == 1 else optax.chain(*chain)


def push_weights(work_plan: Any) -> dict[Any, float] | None:
    """The plan's per-worker ``push_weight`` (ASHL's reference ``p_i``), or
    ``None`` when every worker's is 1 (or there is no plan)."""
    if work_plan is None:
        return None
    weights = {w.worker_id: float(w.push_weight) for w in work_plan.workers}
    return None if all(v == 1.0 for v in weights.values()) else weights


def core_kwargs(config: ExperimentConfig, work_plan: Any = None) -> dict[str, Any]:
    """Keyword arguments of ``hpsjax.ps.ServerCore`` for the config and, where
    it gives push weights, the work plan."""
    kwargs: dict[str, Any] = {"deadline_factor": float(config.server.deadline_factor)}
    if config.server.dc_lambda is not None:
        # DC-ASGD needs the parameters each push was computed on.
        kwargs["keep_stale_params"] = True
    weights = push_weights(work_plan)
    if weights is not None:
        kwargs["push_weights"] = weights
    return kwargs


def local_optimizer(
    config: ExperimentConfig,
) -> optax.GradientTransformation | None:
    """The workers' optimizer of local steps, or ``None`` (push gradients)."""
    worker = config.worker
    if worker.local_optimizer == "none":
        return None
    make = registry.lookup("optimizer", worker.local_optimizer)
    return reused(
        "local optimizer",
        config.worker,
        lambda: make(
            float(worker.local_learning_rate),
            momentum=float(worker.local_momentum) or None,
            **(worker.local_optimizer_args or {}),
        ),
    )


def stage_list(config: ExperimentConfig, *, until_version: bool):
    """ASHL's two stages as ``hpsjax.ps.HybridStage`` (server side)."""
    stages = config.stages
    return [
        HybridStage(
            "async",
            local_steps=int(stages.ahl_local_steps),
            max_staleness=int(stages.ahl_max_staleness),
            until_version=int(stages.switch_version) if until_version else None,
        ),
        HybridStage(
            "semi_async",
            local_steps=int(stages.shl_local_steps),
            max_staleness=int(stages.shl_max_staleness),
        ),
    ]


def hybrid_stages(config: ExperimentConfig) -> optax.GradientTransformation:
    """The workers' staged optimizer for ASHL's plateau switch.

    Both stages step with the local optimizer; the first ends when the smoothed
    training loss has not improved by ``plateau_threshold`` for
    ``plateau_window`` local steps, and the worker's push then carries the new
    stage to the server.
    """
    from hpsjax.transforms import Stage
    from hpsjax.transforms import hybrid_stages as make_stages

    stages = config.stages
    inner = local_optimizer(config)
    if inner is None:
        raise ValueError("ASHL's stages need worker.local_optimizer (local steps)")
    return reused(
        "hybrid stages",
        (config.stages, config.worker),
        lambda: make_stages(
            [
                Stage(
                    inner,
                    mode="async",
                    local_steps=int(stages.ahl_local_steps),
                    max_staleness=int(stages.ahl_max_staleness),
                    plateau_window=int(stages.plateau_window),
                    plateau_threshold=float(stages.plateau_threshold),
                ),
                Stage(
                    inner,
                    mode="semi_async",
                    local_steps=int(stages.shl_local_steps),
                    max_staleness=int(stages.shl_max_staleness),
                ),
            ],
            loss_smoothing=0.9,
        ),
    )


class LossSwitchedHybrid(PlannedHybrid):
    r""":class:`PlannedHybrid` whose server leaves the first stage on its
    training loss, as ASHL's reference code decides the switch.

    The server's estimate of the training loss is a moving average of the
    losses the workers report with their pushes,
    :math:`\bar\ell \leftarrow \bar\ell + \alpha (\ell - \bar\ell)`;
    once :math:`\bar\ell` is below ``threshold`` (after at least
    ``min_pushes`` pushes) the policy moves to the next stage. Workers learn
    it from the next acknowledgement, which hints them their local steps of
    the new stage. A stage's ``until_version``, if any, still applies.

    The stages run as the reference runs them: an ``async`` stage applies
    every push at once, undamped (its ``max_staleness`` is not used); a
    ``semi_async`` stage bounds the workers' round counts (SSP's clocks: a
    worker more than ``max_staleness`` rounds ahead of the slowest waits),
    not the versions.

    Args:
      stages, local_steps, on_stale: as for :class:`PlannedHybrid`.
      threshold: the training loss below which the server switches.
      smoothing: :math:`\alpha`, the weight of a new loss, in (0, 1].
      min_pushes: pushes with a loss seen before a switch, >= 1.

    Examples:
      >>> from hpsjax.ps import HybridStage
      >>> policy = LossSwitchedHybrid(
      ...     [HybridStage("async", 8, None), HybridStage("semi_async", 2, 3)],
      ...     [{0: 8}, {0: 2}], threshold=0.5, smoothing=1.0, min_pushes=1)
      >>> policy.observe_loss(0.9), policy.observe_loss(0.4)
      (False, True)
    """

    def __init__(
        self,
        stages: Sequence[Any],
        local_steps: Sequence[Mapping[Any, int]],
        *,
        threshold: float,
        smoothing: float = 0.3,
        min_pushes: int = 1,
        on_stale: str = "damp",
    ):
        super().__init__(stages, local_steps, on_stale=on_stale)
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be a number > 0, got {threshold!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if int(min_pushes) < 1:
            raise ValueError(f"min_pushes must be >= 1, got {min_pushes!r}")
        self.threshold = float(threshold)
        self.smoothing = float(smoothing)
        self.min_pushes = int(min_pushes)
        self.train_loss: float | None = None
        self.losses_seen = 0
        self.switched_at: int | None = None  # the server version of the switch

    def _delegate(self, stage):
        from hpsjax.ps import ASP, SSP

        if stage.mode == "semi_async":
            return SSP(staleness_bound=stage.max_staleness)
        if stage.mode == "async":
            return ASP()
        return super()._delegate(stage)

    def observe_loss(self, loss: float | None) -> bool:
        """Takes one reported loss; ``True`` when it makes the server switch."""
        if loss is None or not math.isfinite(loss) or self.stage > 0:
            return False
        self.losses_seen += 1
        if self.train_loss is None:
            self.train_loss = float(loss)
        else:
            self.train_loss += self.smoothing * (float(loss) - self.train_loss)
        return self.losses_seen >= self.min_pushes and self.train_loss < self.threshold

    def on_push(self, core, worker_id, now):
        super().on_push(core, worker_id, now)
        if self.observe_loss(core.worker(worker_id).last_loss):
            self.switched_at = core.version
            self.set_stage(core, 1)


def policy(
    config: ExperimentConfig,
    plans: Sequence[Any] = (),
    *,
    until_version: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """The server policy and its keyword arguments.

    Args:
      config: the experiment config.
      plans: for ASHL, one ``WorkPlan`` per stage (AHL, SHL) whose local steps
        the policy hints per worker; empty otherwise.
      until_version: ASHL leaves AHL at ``stages.switch_version`` (else only
        when a worker reports a new stage).

    Returns:
      ``(policy, policy_kwargs)``: a name and its arguments, or a policy object
      and ``{}``.
    """
    registry.lookup("policy", config.server.policy)
    if not config.stages.enabled:
        return config.server.policy, config.server.policy_kwargs.to_dict()
    stages = stage_list(
        config, until_version=until_version and config.stages.switch == "version"
    )
    if plans:
        per_stage = stage_steps(plans, len(stages))
        if config.stages.switch == "loss":
            return (
                LossSwitchedHybrid(
                    stages, per_stage, threshold=float(config.stages.switch_loss)
                ),
                {},
            )
        return PlannedHybrid(stages, per_stage), {}
    return Hybrid(stages), {}


def stage_steps(plans: Sequence[Any], num_stages: int) -> list[dict[Any, int]]:
    """Per stage, each worker's planned local steps: from one plan per stage,
    or from one plan whose workers carry ``stage_local_steps``
    (``ashl_reference``)."""
    if len(plans) == 1 and plans[0].workers[0].stage_local_steps:
        return [
            {w.worker_id: w.stage_steps(s) for w in plans[0].workers}
            for s in range(num_stages)
        ]
    return [{w.worker_id: w.local_steps for w in p.workers} for p in plans]


def slowdown_schedule(
    config: ExperimentConfig, index: int
) -> tuple[tuple[float, float], ...]:
    """Worker ``index``'s slowdown over time: ``((0, k), (t, k * f), ...)``."""
    k = float(config.workers.slowdowns[index])
    schedule = [(0.0, k)]
    for worker, at, factor in sorted(
        (tuple(c) for c in config.workers.speed_changes), key=lambda c: c[1]
    ):
        if int(worker) == index:
            schedule.append((float(at), schedule[-1][1] * float(factor)))
    return tuple(schedule)


def _check_speed_changes(config: ExperimentConfig) -> None:
    n = len(config.workers.slowdowns)
    for change in config.workers.speed_changes:
        if len(change) != 3:
            raise ValueError(
                f"workers.speed_changes entries are (worker, seconds, factor), got "
                f"{change!r}"
            )
        worker, at, factor = change
        if not (isinstance(worker, int) and 0 <= worker < n):
            raise ValueError(f"speed change for worker {worker!r}, not in 0..{n - 1}")
        if not (at > 0 and factor >= 1 / float(config.workers.slowdowns[worker])):
            raise ValueError(
                f"speed change {change!r}: the time must be > 0 and the slowdown "
                "must stay >= 1"
            )


def worker_specs(config: ExperimentConfig) -> list[Any]:
    """The simulated workers of ``config.workers`` (ids ``0 .. n-1``)."""
    from hpsjax.sim import ComputeModel, WorkerSpec
    from hpsjax.worker import Heterogeneity

    _check_speed_changes(config)
    w = config.workers
    specs = []
    for i in range(len(w.slowdowns)):
        specs.append(
            WorkerSpec(
                compute=ComputeModel(
                    step_time=float(w.step_time),
                    reference_batch=int(config.batch_size),
                    overhead=float(w.step_overhead),
                    sigma=float(w.jitter),
                    straggle_probability=float(w.straggle_probability),
                    straggle_slowdown=float(w.straggle_slowdown),
                ),
                heterogeneity=Heterogeneity(
                    slowdown=slowdown_schedule(config, i),
                    bandwidth=None if w.bandwidth is None else float(w.bandwidth),
                    latency=float(w.latency),
                ),
                batch_size=int(config.batch_size),
                local_steps=int(config.worker.local_steps),
                worker_id=i,
            )
        )
    return specs


def transfer_profile(
    bandwidth: float | None, latency: float, push_bytes: int, pull_bytes: int
) -> Any:
    """The estimated push/pull time of a link (``None`` for an instant link)."""
    from hpsjax.profiling import Link, TransferProfile

    if bandwidth is not None:
        return Link(bandwidth=float(bandwidth), latency=float(latency)).estimate(
            push_bytes, pull_bytes
        )
    if latency > 0:
        return TransferProfile(
            round_trip_seconds=2 * latency,
            push_seconds=latency,
            pull_seconds=latency,
            push_bytes=int(push_bytes),
            pull_bytes=int(pull_bytes),
            method="estimated",
        )
    return None


def simulated_profiles(
    config: ExperimentConfig,
    specs: Sequence[Any],
    *,
    push_bytes: int,
    pull_bytes: int,
) -> tuple[list[Any], float]:
    """The profiling pass, run on simulated workers.

    Each worker times ``profile_repeats`` steps at each of
    ``plan.profile_batch_sizes`` (drawn from its compute model, jitter and
    stragglers included, at its slowdown at time 0) and keeps the median per
    batch size; its link is estimated from its bandwidth and latency. The pass
    costs each worker the time of the steps it ran plus one round trip; the
    workers profile at once, so it costs the slowest worker's time.

    Returns:
      ``(profiles, seconds)``: one ``WorkerProfile`` per worker, and the virtual
      seconds the pass took.
    """
    from hpsjax.profiling import DeviceProfile, WorkerProfile

    sizes = sorted({int(b) for b in config.plan.profile_batch_sizes})
    repeats = int(config.plan.profile_repeats)
    if not sizes or sizes[0] < 1 or repeats < 1:
        raise ValueError(
            "plan.profile_batch_sizes must hold positive sizes and "
            "plan.profile_repeats must be >= 1"
        )
    rng = np.random.default_rng([int(config.seed), 7])
    profiles, cost = [], 0.0
    for spec in specs:
        het = spec.heterogeneity
        k = 1.0 if het is None else float(het.slowdown_at(0.0))
        times, spent = [], 0.0
        for b in sizes:
            draws = spec.compute.draw(rng, b, repeats) * k
            times.append(float(np.median(draws)))
            spent += float(draws.sum())
        bandwidth = None if het is None else het.bandwidth_at(0.0)
        latency = 0.0 if het is None else float(het.latency)
        transfer = transfer_profile(bandwidth, latency, push_bytes, pull_bytes)
        if transfer is not None:
            spent += transfer.round_trip_seconds
        cost = max(cost, spent)
        profiles.append(
            WorkerProfile(
                worker_id=spec.worker_id,
                devices=(
                    DeviceProfile(
                        device_id=0,
                        platform="synthetic",
                        device_kind="simulated",
                        batch_sizes=tuple(sizes),
                        step_times=tuple(times),
                    ),
                ),
                transfer=transfer,
            )
        )
    return profiles, cost


def work_plan(
    config: ExperimentConfig,
    profiles: Sequence[Any],
    *,
    local_steps: int | None = None,
) -> Any:
    """The work plan of ``config.plan`` for these profiles.

    Args:
      config: the experiment config.
      profiles: one ``WorkerProfile`` per worker.
      local_steps: ``local_steps`` of the plan (``H`` for ``hps``/``equal``,
        the slowest worker's ``H`` for ``ashl``); ``plan.local_steps`` by default.

    Returns:
      A ``hpsjax.profiling.WorkPlan``.
    """
    from hpsjax.profiling import plan

    scheme = registry.lookup("plan scheme", config.plan.scheme)
    if scheme == "none":
        raise ValueError("plan.scheme is 'none': there is no plan to make")
    steps = int(config.plan.local_steps if local_steps is None else local_steps)
    extra: dict[str, Any] = {}
    if scheme == "ashl_reference":
        extra["compress_ratio"] = float(config.plan.compress_ratio)
        extra["stage_multipliers"] = (
            int(config.stages.ahl_local_steps),
            int(config.stages.shl_local_steps),
        )
    made = plan(
        profiles,
        scheme,
        global_batch=int(config.batch_size) * len(profiles),
        lr_scaling=registry.lookup("lr scaling", config.plan.lr_scaling),
        local_steps=steps,
        max_local_steps=int(config.plan.max_local_steps),
        **extra,
    )
    return with_push_compression(config, made)


def with_push_compression(config: ExperimentConfig, work_plan: Any) -> Any:
    """``work_plan`` with ``worker.compression`` applied to its workers.

    ``top_k``: every worker's ``compress_ratio`` is ``worker.compress_ratio``,
    so that with ``stages.compress_from_stage=0`` the worker core sparsifies
    each push with ``hpsjax.top_k`` (error feedback) and both backends send or
    count the top-k codec's bytes (``hpsjax.transforms.topk_nbytes``).
    ``power_sgd`` leaves the plan as it is: it compresses every push as the
    workers' push transform (the simulator's ``push_transform``,
    ``hpsjax-worker --powersgd_rank``), not through the plan.
    """
    import dataclasses

    compression = registry.lookup("compression", config.worker.compression)
    if compression != "top_k":
        return work_plan
    ratio = float(config.worker.compress_ratio)
    workers = tuple(
        dataclasses.replace(w, compress_ratio=ratio) for w in work_plan.workers
    )
    return dataclasses.replace(work_plan, workers=workers)


def plans(config: ExperimentConfig, profiles: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The work plan to start with, and for ASHL one plan per stage.

    Returns:
      ``(plan, stage_plans)``: without stages, the plan of ``plan.local_steps``
      and ``[]``; with stages, the AHL plan and ``[AHL plan, SHL plan]``, made
      with ``stages.ahl_local_steps`` and ``stages.shl_local_steps`` local steps
      for the slowest worker.
    """
    if not config.stages.enabled:
        return work_plan(config, profiles), []
    if config.plan.scheme == "ashl_reference":
        # One plan: each worker's stage_local_steps holds both stages' steps.
        first = work_plan(config, profiles)
        return first, [first]
    stage_plans = [
        work_plan(config, profiles, local_steps=int(steps))
        for steps in (config.stages.ahl_local_steps, config.stages.shl_local_steps)
    ]
    return stage_plans[0], stage_plans


def plan_to_dict(work_plan: Any) -> dict[str, Any]:
    """A compact, JSON-friendly summary of a work plan."""
    return {
        "scheme": work_plan.scheme,
        "revision": work_plan.revision,
        "batch_sizes": [w.batch_size for w in work_plan.workers],
        "local_steps": [w.local_steps for w in work_plan.workers],
        "lr_scales": [round(float(w.lr_scale), 6) for w in work_plan.workers],
        "round_time": float(work_plan.round_time),
        "idle_fraction": float(work_plan.idle_fraction),
        **_stage_fields(work_plan),
    }


def _stage_fields(work_plan: Any) -> dict[str, Any]:
    """``ashl_reference``'s per-worker fields, where the plan has them."""
    workers = work_plan.workers
    fields: dict[str, Any] = {}
    if workers and workers[0].stage_local_steps:
        fields["stage_local_steps"] = [list(w.stage_local_steps) for w in workers]
    if any(w.push_weight != 1.0 for w in workers):
        fields["push_weights"] = [round(float(w.push_weight), 6) for w in workers]
    if any(w.compress_ratio != 1.0 for w in workers):
        fields["compress_ratios"] = [round(float(w.compress_ratio), 6) for w in workers]
    return fields


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float, or ``None`` when it is not finite (for JSON)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
