r"""The virtual-clock simulator's entry point, :func:`simulate`.

:func:`simulate` trains one model with simulated workers of unequal speed
through the same server core, policies, optimizers and worker core as real
runs: the gradients are real JAX computations, only the clock is simulated
(the docs' simulator notes describe the rounds, the overlap modes, the
worker-side transforms, speed and determinism).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from hpsjax.planning import Replanner, WorkPlan
from hpsjax.sim._config import SimConfig
from hpsjax.sim._results import (
    ApplyRecord,
    Divergence,
    Interval,
    PushRecord,
    SendRecord,
    SimResult,
)
from hpsjax.sim._simulation import _Simulation
from hpsjax.sim._workers import WorkerSpec
from hpsjax.worker import OVERLAP_MODES

__all__ = [
    "OVERLAP_MODES",
    "ApplyRecord",
    "Divergence",
    "Interval",
    "PushRecord",
    "SendRecord",
    "SimConfig",
    "SimResult",
    "simulate",
]


def simulate(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    train_data: Any,
    workers: Sequence[WorkerSpec] | int,
    config: SimConfig,
    *,
    eval_data: Any = None,
    eval_fn: Callable[[Any, Any], Mapping[str, jax.Array]] | None = None,
    work_plan: WorkPlan | Replanner | None = None,
    callback: Callable[[dict], bool | None] | None = None,
) -> SimResult:
    r"""Simulates parameter-server training of one model on unequal workers.

    The server is a :class:`~hpsjax.ps.ServerCore` driven with a virtual clock;
    the workers compute real gradients of ``loss_fn`` on their own batches and
    spend the virtual time their :class:`~hpsjax.sim.WorkerSpec` gives. With
    worker :math:`i` pulling version :math:`v_i` and the server at :math:`V` when
    its push arrives, the push has staleness :math:`\tau = V - v_i` and the server
    applies (per its policy's aggregation)

    .. math::

       w \leftarrow w + \operatorname{opt}\big(\bar u;\ \tau\big), \qquad
       u_i = \begin{cases}
         s_i\, f(\hat\tau_i)\, \nabla \ell(w_{v_i}; B_i) & \text{(gradients)} \\
         f(\hat\tau_i)\,\big(w_{v_i} - w_i^{(H_i)}\big) & \text{(local steps)}
       \end{cases}

    where :math:`s_i` is the worker's step-size scale (it also scales each local
    step), :math:`w_i^{(H_i)}` its parameters after :math:`H_i` local steps with
    ``local_optimizer``, :math:`f(\hat\tau_i)` PS+'s modulation (1 without
    ``staleness_lr``) and :math:`\bar u` the sample-weighted average of the
    buffered updates (``num_samples`` = batch size times local steps), after the
    worker's ``push_transform`` (e.g. quantization) where one is given.

    Args:
      loss_fn: ``(params, batch) -> scalar``, the mean training loss of a batch
        (``batch`` has the structure of ``train_data``: a
        :class:`hpsjax.data.Batch` for a :class:`hpsjax.data.Dataset`).
      params: the initial parameters, a pytree of floating arrays.
      train_data: a :class:`hpsjax.data.Dataset`, or a pytree of arrays with a
        common leading example axis.
      workers: a list of :class:`~hpsjax.sim.WorkerSpec`, or a number of default
        workers.
      config: the :class:`SimConfig`.
      eval_data: held-out data like ``train_data``, or ``None`` (no evaluation).
      eval_fn: ``(params, batch) -> {name: scalar}``, metrics averaged over the
        held-out set; ``None`` uses ``{"loss": loss_fn}``.
      work_plan: a :class:`~hpsjax.planning.WorkPlan` (per worker batch size,
        local steps and step-size scale; its worker ids are the workers'), or a
        :class:`~hpsjax.planning.Replanner` that is fed every round's measured
        step time and revises the plan as speeds drift, or ``None``.
      callback: called with each evaluation's record (a dict of the metric
        columns' values); returning ``True`` stops the simulation.

    Returns:
      A :class:`SimResult`.

    Raises:
      ValueError: for bad arguments (nothing runs), or when a worker is asked for
        local steps without a ``local_optimizer``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
      >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
      >>> data = (x, x @ np.arange(1.0, 5.0, dtype=np.float32))
      >>> def loss(w, batch):
      ...     return jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> workers = [WorkerSpec(ComputeModel(step_time=t)) for t in (1.0, 4.0)]
      >>> result = simulate(loss, jnp.zeros(4), data, workers,
      ...                   SimConfig(policy="asp", learning_rate=0.05,
      ...                             duration=40.0))
      >>> [result.bytes_sent[i] // 16 for i in (0, 1)]   # pushes of 16 bytes
      [40, 10]
      >>> result.metrics == {}   # no eval_data
      True

    References:
      Ho, Cipar, Cui, Lee, Kim, Gibbons, Gibson, Ganger, Xing, `More Effective
      Distributed ML via a Stale Synchronous Parallel Parameter Server
      <https://papers.nips.cc/paper/4894>`_, NIPS 2013.

      Yu et al., `Accelerating Distributed Training in Heterogeneous Clusters via
      a Straggler-Aware Parameter Server
      <https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042>`_ (SaPS), IEEE HPCC
      2019.

      Xian, Li, Liu, Guo, Du, `H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training
      <https://doi.org/10.1109/ACCESS.2021.3060154>`_, IEEE Access, 2021.

      Jin et al., `PS+: A Simple yet Effective Framework for Fast Training on
      Parameter Server <https://doi.org/10.1109/TPDS.2022.3200518>`_, IEEE TPDS
      33(12), 2022.

      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 73(1),
      2024.

      Hu, Wang, Wu, `Distributed Machine Learning through Heterogeneous Edge
      Systems <https://arxiv.org/abs/1911.06949>`_ (ADSP), AAAI 2020.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    if not isinstance(config, SimConfig):
        raise ValueError(f"config must be a SimConfig, got {type(config).__name__}.")
    if eval_fn is not None and not callable(eval_fn):
        raise ValueError(f"eval_fn must be callable, got {type(eval_fn).__name__}.")
    if callback is not None and not callable(callback):
        raise ValueError(f"callback must be callable, got {type(callback).__name__}.")
    return _Simulation(
        loss_fn,
        params,
        train_data,
        workers,
        config,
        eval_data,
        eval_fn,
        work_plan,
        callback,
    ).run()
