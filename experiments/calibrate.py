r"""Calibrate the simulator against real processes: ``python -m experiments.calibrate``.

For each scheme it runs a real-process setting (a server and one worker process
per worker on loopback, with the setting's injected slowdowns and link caps),
fits the simulator's models to that run's own round records, simulates the same
scheme in the same setting with the fitted models, and compares the two:

* **compute**, per worker: seconds per local step :math:`t_i(b) = a_i + c_i b`,
  fitted by least squares where a worker ran several batch sizes; where it ran
  one (every scheme here but re-planned ones), the level :math:`t_i(b_i)` is the
  run's mean and the shape :math:`a / (a + c b_i)` comes from a short profiling
  pass of the train step on this machine (:func:`hpsjax.profiling.profile`);
  the lognormal jitter is the spread of :math:`\log t`; the worker's
  bookkeeping between rounds (:func:`round_gap`) is added to :math:`a_i`;
* **link**: :math:`\ell + n / B` per message, fitted to the injected link delay
  of each round (``link_delay_s`` against messages and bytes); where every
  round moves the same bytes the two cannot be told apart and :math:`B` is the
  injected cap;
* **server service**: what a round's transfers took beyond its link delay
  (``transfer_s - link_delay_s``: encoding, the server decoding, applying and
  answering, and five processes sharing the cores) in the rounds whose push
  was applied at once (no barrier wait in them), the least of the workers'
  means, and the server core's own apply time per push, timed offline; the
  simulator charges it per push at one server handling one message at a
  time (:class:`hpsjax.sim.SimConfig`'s ``server_service_time``), so pushes
  queue behind one another as on processes;
* **start-up**, per worker (:func:`fit_startup`): what its first round's
  compute (loading the compiled step, the first steps slowed down,
  compiling) took beyond the fitted model, charged to the simulated worker's
  first round (``workers.startup_times``, :class:`hpsjax.sim.WorkerSpec`'s
  ``startup_time``).

:data:`MISSING_TERMS` names what the simulator still lacks.

Outputs in ``--workdir``: ``measured/<scheme>/seed_<s>`` and
``simulated/<scheme>/seed_<s>`` (each an :mod:`experiments.train` work
directory), and ``calibration_<label>.md`` (the table), ``.json`` (fits,
figures and verdicts) and ``.png`` (predicted against measured, one panel per
quantity). Finished runs in ``--workdir`` are kept. Example::

  python -m experiments.calibrate --setting=proc4 --schemes=bsp,asp,ssp,hps \
      --seeds=1 --workdir=/tmp/hpsjax/calibrate
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments import _cli, registry, train
from hpsjax._checks import check_number

__all__ = [
    "MISSING_TERMS",
    "ComputeFit",
    "LinkFit",
    "calibrate",
    "compare_runs",
    "fit_compute",
    "fit_link",
    "fit_service",
    "fit_startup",
    "first_round_seconds",
    "format_table",
    "plot_calibration",
    "round_gap",
    "simulated_config",
    "staleness_stats",
]

DEFAULT_SCHEMES = ("bsp", "asp", "ssp", "hps")
TOLERANCE = 0.15
"""Relative error within which a prediction counts as matching."""

MISSING_TERMS = {
    "server_startup": (
        "the simulated server is warm from its first push: on processes the "
        "server compiles its decode and apply on the first pushes it takes "
        "(the workers' warm-up does not warm it), and the workers whose first "
        "pushes arrive then wait for it in their first round's transfer "
        "(fits[scheme]['first_round_wait_s'] per worker, beyond a usual round's)."
    ),
}
"""What the simulator lacks to predict real processes, by option name."""

_QUANTITIES = (
    ("updates_per_s", "updates/s (all workers)"),
    ("worker_updates_per_s", "updates/s (per worker)"),
    ("idle_fraction", "idle fraction"),
    ("staleness_mean", "mean staleness"),
    ("staleness_p90", "p90 staleness"),
    ("time_to_target", "time to target (s)"),
)


# ---------------------------------------------------------------------------
# Fits from round records.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ComputeFit:
    """One worker's seconds per local step, ``intercept + slope * batch``.

    Attributes:
      intercept: seconds of a step independent of the batch.
      slope: seconds per sample.
      sigma: spread of the lognormal jitter of a step's time.
      batch_size: the batch the worker ran most.
      rounds: rounds the fit used.
      method: ``"batches"`` (fitted across batch sizes) or ``"profile shape"``.
    """

    intercept: float
    slope: float
    sigma: float
    batch_size: int
    rounds: int
    method: str

    def mean_step_time(self, batch_size: int) -> float:
        return self.intercept + self.slope * batch_size


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """A link's time per message, ``latency + bytes / bandwidth``.

    Attributes:
      latency: seconds per message.
      bandwidth: bytes per second.
      method: ``"fitted"`` or ``"latency only"`` (the bandwidth is the given
        one: the rounds' bytes did not vary independently of their messages).
      rounds: rounds the fit used.
    """

    latency: float
    bandwidth: float
    method: str
    rounds: int


def _rounds(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("event") == "round"]


def _step_seconds(r: Mapping[str, Any]) -> float:
    busy = float(r.get("compute_s") or 0.0) + float(r.get("slowdown_s") or 0.0)
    return busy / max(int(r.get("local_steps") or 1), 1)


def fit_compute(
    records: Sequence[Mapping[str, Any]],
    *,
    shape: float | None = None,
    compile_limit: float = 1e-3,
) -> ComputeFit:
    r"""Fits one worker's step time to its round records.

    Args:
      records: the worker's metrics records (``"round"`` events are used:
        ``compute_s`` + ``slowdown_s`` per local step, at ``batch_size``).
      shape: the share of a step's time at the worker's batch that does not
        grow with the batch, :math:`a / (a + c b)`, used when the worker ran a
        single batch size; ``None`` then puts it all in the slope.
      compile_limit: rounds that compiled for longer than this are left out.

    Returns:
      A :class:`ComputeFit`.

    Raises:
      ValueError: no round to fit.
    """
    rows = [
        r
        for r in _rounds(records)
        if float(r.get("compile_s") or 0.0) <= compile_limit and _step_seconds(r) > 0
    ]
    if not rows:
        raise ValueError("no round without compiling to fit a compute model to")
    t = np.array([_step_seconds(r) for r in rows])
    b = np.array([int(r["batch_size"]) for r in rows], dtype=float)
    values, counts = np.unique(b, return_counts=True)
    main = int(values[np.argmax(counts)])
    if len(values) > 1 and values.max() >= 1.5 * values.min():
        slope, intercept = np.polyfit(b, t, 1)
        if slope > 0 and intercept >= 0:
            sigma = float(np.std(np.log(t / (intercept + slope * b))))
            return ComputeFit(
                float(intercept), float(slope), sigma, main, len(rows), "batches"
            )
    level = float(np.mean(t[b == main]))
    sigma = float(np.std(np.log(t[b == main])))
    share = 0.0 if shape is None else min(max(float(shape), 0.0), 1.0)
    return ComputeFit(
        share * level,
        (1.0 - share) * level / main,
        sigma,
        main,
        len(rows),
        "profile shape" if shape is not None else "level only",
    )


def round_gap(records: Sequence[Mapping[str, Any]]) -> float:
    """Mean seconds between one round's end and the next one's start.

    The worker's own bookkeeping between rounds (records, hints, the loop),
    which no span of a round covers; the simulator charges it as part of a
    step's fixed cost.
    """
    rounds = sorted(_rounds(records), key=lambda r: float(r["time"]))
    gaps = [
        float(b["time"]) - float(a["time"]) - float(a["round_s"])
        for a, b in itertools.pairwise(rounds)
        if a.get("round_s") is not None
    ]
    return max(float(np.mean(gaps)), 0.0) if gaps else 0.0


def first_round_seconds(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Seconds from a worker's first round's start until its second could start."""
    rounds = [r for r in _rounds(records) if int(r.get("step", -1)) == 0]
    if not rounds or rounds[0].get("round_s") is None:
        return None
    return float(rounds[0]["round_s"])


def fit_startup(records: Sequence[Mapping[str, Any]], fit: ComputeFit) -> float:
    """Seconds a worker's first round computed beyond its fitted step time.

    The first round's ``compute_s + slowdown_s + compile_s`` (loading the
    compiled step, running its first steps slowed down, compiling what the
    warm-up did not) less ``local_steps`` fitted steps at its batch; 0 when
    the worker has no first round on record.
    """
    first = [r for r in _rounds(records) if int(r.get("step", -1)) == 0]
    if not first:
        return 0.0
    r = first[0]
    busy = sum(float(r.get(k) or 0.0) for k in ("compute_s", "slowdown_s", "compile_s"))
    usual = int(r.get("local_steps") or 1) * fit.mean_step_time(int(r["batch_size"]))
    return max(busy - usual, 0.0)


def first_round_wait(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Seconds the first round's transfers took beyond the median round's."""
    rounds = [r for r in _rounds(records) if r.get("transfer_s") is not None]
    first = [r for r in rounds if int(r.get("step", -1)) == 0]
    if not first or len(rounds) < 2:
        return None
    usual = float(np.median([float(r["transfer_s"]) for r in rounds]))
    return max(float(first[0]["transfer_s"]) - usual, 0.0)


def _messages(r: Mapping[str, Any]) -> int:
    pushed = 1 if r.get("status") is not None else 0
    return pushed + int(r.get("pulls") or 0)


def fit_link(
    records: Sequence[Mapping[str, Any]], *, bandwidth: float | None
) -> LinkFit:
    """Fits ``latency + bytes / bandwidth`` to the rounds' injected link delays.

    Args:
      records: one or more workers' metrics records (``link_delay_s``, the
        messages of the round and ``bytes_sent + bytes_received``).
      bandwidth: the injected cap (bytes/s), kept when the rounds cannot
        separate latency from bandwidth; ``None`` for an uncapped link.

    Returns:
      A :class:`LinkFit`.
    """
    rows = [
        r
        for r in records
        if r.get("event") in ("round", "final")
        and r.get("link_delay_s") is not None
        and _messages(r) > 0
    ]
    if not rows:
        return LinkFit(0.0, bandwidth or math.inf, "latency only", 0)
    delay = np.array([float(r["link_delay_s"]) for r in rows])
    n = np.array([_messages(r) for r in rows], dtype=float)
    nbytes = np.array(
        [
            int(r.get("bytes_sent") or 0) + int(r.get("bytes_received") or 0)
            for r in rows
        ],
        dtype=float,
    )
    per_message = nbytes / n
    design = np.stack([n, nbytes], axis=1)
    # Bytes per message must vary for the two terms to be told apart.
    if np.std(per_message) >= 0.1 * np.mean(per_message):
        (latency, per_byte), *_ = np.linalg.lstsq(design, delay, rcond=None)
        if latency >= 0 and per_byte > 0:
            return LinkFit(float(latency), float(1 / per_byte), "fitted", len(rows))
    per_byte = 0.0 if not bandwidth else 1.0 / bandwidth
    latency = float(np.mean((delay - nbytes * per_byte) / n))
    return LinkFit(
        max(latency, 0.0),
        bandwidth or math.inf,
        "latency only",
        len(rows),
    )


def fit_service(records_by_worker: Mapping[Any, Sequence[Mapping[str, Any]]]) -> dict:
    """Seconds a round's transfers took beyond their link delay.

    Only rounds whose push the server applied at once (``status ==
    "applied"``) count where there are any: a push that completes a barrier
    (BSP's last worker) or that the policy applies on arrival (ASP) waits for
    no other worker, so what its round spent beyond the link is the server's
    service and the sharing of the cores. Means, not medians: the service is
    heavy-tailed (pushes queue at one server) and a rate depends on the mean.

    Returns:
      ``{"per_worker": {worker: mean}, "round_s": least mean}``: the least
      mean is the service time of a round (a worker whose pull a policy held
      waits longer; the one held least is held hardly at all).
    """
    means = {}
    for w, records in records_by_worker.items():
        rounds = [r for r in _rounds(records) if r.get("transfer_s") is not None]
        applied = [r for r in rounds if r.get("status") == "applied"]
        extra = [
            float(r["transfer_s"]) - float(r.get("link_delay_s") or 0.0)
            for r in (applied or rounds)
        ]
        if extra:
            means[w] = max(float(np.mean(extra)), 0.0)
    return {
        "per_worker": means,
        "round_s": min(means.values()) if means else 0.0,
    }


def staleness_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Mean and 90th percentile staleness of the acknowledged pushes."""
    values = [
        int(r["staleness"])
        for r in records
        if r.get("staleness") is not None and r.get("status") is not None
    ]
    if not values:
        return {"staleness_mean": None, "staleness_p90": None}
    return {
        "staleness_mean": float(np.mean(values)),
        "staleness_p90": float(np.percentile(values, 90)),
    }


def profile_shape(config: Any, setup: Any) -> dict[str, float]:
    """A short profiling pass of the train step: intercept and slope at 1 core.

    Returns:
      ``{"intercept": a, "slope": c}`` of :math:`a + c b` seconds per step.
    """
    import jax
    import optax

    from experiments import build
    from hpsjax.profiling import profile

    optimizer = build.local_optimizer(config) or optax.sgd(1.0)
    stream = setup.train.batches(1, seed=0)

    def step(params, batch):
        grads = jax.grad(setup.loss_fn)(params, batch)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    base = profile(
        step,
        setup.params,
        lambda b: jax.tree.map(np.asarray, stream.next(b)),
        batch_sizes=(16, 64),
        repeats=5,
        warmup=1,
        devices=jax.local_devices()[:1],
    )
    fit = base.devices[0].time_fit
    return {"intercept": float(fit.intercept), "slope": float(fit.slope)}


def server_apply_seconds(config: Any, setup: Any, *, pushes: int = 30) -> float:
    """The server core's time to take and apply one push, timed offline."""
    import jax

    from experiments import build
    from hpsjax.ps import ServerCore

    core = ServerCore(setup.params, build.server_optimizer(config), "asp")
    core.join(0, 0.0)
    update = jax.tree.map(lambda p: np.full(p.shape, 1e-6, p.dtype), setup.params)
    times = []
    for i in range(pushes + 2):
        core.pull(0, float(i))
        start = time.perf_counter()
        core.push(0, update, version=core.version, now=float(i))
        jax.block_until_ready(core.params)
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


# ---------------------------------------------------------------------------
# The simulated twin of a measured run.
# ---------------------------------------------------------------------------


def simulated_config(
    config: Any,
    fits: Mapping[Any, ComputeFit],
    link: LinkFit,
    service_s: float,
    startup: Mapping[Any, float] | None = None,
) -> Any:
    r"""The simulator's config of ``config`` with the fitted models.

    The experiments' workers share one step time :math:`T` at ``batch_size``
    and one overhead share; each worker's fit becomes its slowdown
    :math:`k_i = t_i(b_0) / T`, :math:`T` that of the fastest worker, and the
    overhead share is the workers' mean (exact when their shapes agree, as
    they do when the shape comes from one profile). The link gets the fitted
    latency and bandwidth, the server ``service_s`` seconds per push
    (``server.service_time``), each worker its start-up (``startup``, seconds
    by worker; ``workers.startup_times``). Re-planning is off, as on
    processes.
    """
    sim = config.copy()
    b0 = int(config.batch_size)
    times = {w: fits[w].mean_step_time(b0) for w in sorted(fits)}
    fastest = min(times.values())
    share = float(np.mean([fits[w].intercept / times[w] for w in times]))
    sim.backend = "sim"
    sim.workers.step_time = fastest
    sim.workers.step_overhead = share * fastest
    sim.workers.slowdowns = tuple(max(times[w] / fastest, 1.0) for w in sorted(times))
    sim.workers.jitter = float(np.median([f.sigma for f in fits.values()]))
    sim.workers.straggle_probability = 0.0
    sim.workers.speed_changes = ()
    sim.workers.bandwidth = None if math.isinf(link.bandwidth) else link.bandwidth
    sim.workers.latency = link.latency
    sim.server.service_time = float(service_s)
    startup = startup or {}
    sim.workers.startup_times = tuple(float(startup.get(w, 0.0)) for w in sorted(times))
    sim.plan.replan = False
    return sim


# ---------------------------------------------------------------------------
# Measured against predicted.
# ---------------------------------------------------------------------------


def _read(workdir: pathlib.Path) -> dict[str, Any]:
    """Summary, records by worker and per-worker totals of a finished run."""
    summary, records, workers = None, {}, {}
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            event = r.get("event")
            if event == "summary":
                summary = r
            elif event == "worker":
                workers[str(r["worker"])] = r
            elif event in ("round", "final", "push"):
                records.setdefault(str(r["worker"]), []).append(r)
    if summary is None:
        raise ValueError(f"{workdir} holds no finished run")
    return {"summary": summary, "records": records, "workers": workers}


def run_figures(run: Mapping[str, Any]) -> dict[str, Any]:
    """Updates/s (total and per worker), idle fraction, staleness, time to target."""
    summary = run["summary"]
    start = float(summary["info"].get("profile_seconds") or 0.0)
    seconds = max(float(summary["end_time"]) - start, 1e-9)
    per_worker = {
        w: run["workers"][w]["pushes"] / seconds for w in sorted(run["workers"])
    }
    all_records = [r for rs in run["records"].values() for r in rs]
    return {
        "updates_per_s": sum(per_worker.values()),
        "worker_updates_per_s": per_worker,
        "versions_per_s": float(summary["updates"]) / seconds,
        "idle_fraction": float(summary["idle_fraction"]),
        **staleness_stats(all_records),
        "time_to_target": summary["time_to_target"],
    }


def _relative_error(measured: Any, predicted: Any) -> float | None:
    if measured is None or predicted is None or measured == 0:
        return None
    return (predicted - measured) / measured


def compare_runs(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict:
    """Relative errors (predicted - measured) / measured and 15% verdicts."""
    errors = {}
    for key, _ in _QUANTITIES:
        if key == "worker_updates_per_s":
            errors[key] = {
                w: _relative_error(v, predicted[key].get(w))
                for w, v in measured[key].items()
            }
        else:
            errors[key] = _relative_error(measured[key], predicted[key])
    within = {
        key: errors[key] is not None and abs(errors[key]) <= TOLERANCE
        for key in ("updates_per_s", "idle_fraction")
    }
    worker_errors = [
        e for e in errors["worker_updates_per_s"].values() if e is not None
    ]
    within["worker_updates_per_s"] = bool(worker_errors) and all(
        abs(e) <= TOLERANCE for e in worker_errors
    )
    return {"errors": errors, "within_15pct": within}


def _ranking(rows: Sequence[Mapping[str, Any]], side: str) -> list[str]:
    def key(row):
        t = row[side]["time_to_target"]
        return math.inf if t is None else t

    return [row["scheme"] for row in sorted(rows, key=key)]


def _cell(measured: Any, predicted: Any, digits: int = 2) -> str:
    def f(v):
        return "-" if v is None else f"{v:.{digits}f}"

    return f"{f(measured)} / {f(predicted)}"


def _pct(error: float | None) -> str:
    return "-" if error is None else f"{100 * error:+.0f}%"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per scheme, measured / predicted and the relative error."""
    lines = [
        "| scheme | updates/s | err | idle fraction | err | mean staleness "
        "| p90 staleness | time to target (s) | per-worker updates/s (err) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        m, p, e = row["measured"], row["predicted"], row["comparison"]["errors"]
        workers = ", ".join(
            f"{m['worker_updates_per_s'][w]:.1f}/"
            f"{p['worker_updates_per_s'].get(w, float('nan')):.1f} "
            f"({_pct(e['worker_updates_per_s'][w])})"
            for w in m["worker_updates_per_s"]
        )
        lines.append(
            f"| {row['scheme']} | {_cell(m['updates_per_s'], p['updates_per_s'], 1)} "
            f"| {_pct(e['updates_per_s'])} "
            f"| {_cell(m['idle_fraction'], p['idle_fraction'])} "
            f"| {_pct(e['idle_fraction'])} "
            f"| {_cell(m['staleness_mean'], p['staleness_mean'], 1)} "
            f"| {_cell(m['staleness_p90'], p['staleness_p90'], 1)} "
            f"| {_cell(m['time_to_target'], p['time_to_target'], 1)} "
            f"| {workers} |"
        )
    return "\n".join(lines)


def plot_calibration(
    rows: Sequence[Mapping[str, Any]], path: pathlib.Path, *, title: str
) -> pathlib.Path:
    """Predicted against measured, one panel per quantity, a 15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import display_name

    fig, axes = plt.subplots(2, 3, figsize=(13, 8))
    markers = "osD^vP*X"
    for ax, (key, label) in zip(axes.flat, _QUANTITIES, strict=True):
        values = []
        for j, row in enumerate(rows):
            m, p = row["measured"][key], row["predicted"][key]
            if key == "worker_updates_per_s":
                pairs = [(m[w], p.get(w)) for w in m]
            else:
                pairs = [(m, p)]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            if not pairs:
                continue
            xs, ys = zip(*pairs, strict=True)
            values += list(xs) + list(ys)
            ax.scatter(
                xs, ys, marker=markers[j % len(markers)], s=50,
                label=display_name(row["scheme"]), zorder=3, clip_on=False,
            )  # fmt: skip
        if values:
            hi = max(values) * 1.1 or 1.0
            line = np.linspace(0, hi, 50)
            ax.plot(line, line, "k--", lw=1, label="predicted = measured")
            ax.fill_between(
                line, line * (1 - TOLERANCE), line * (1 + TOLERANCE),
                color="0.85", zorder=0, label="within 15%",
            )  # fmt: skip
            ax.set_xlim(0, hi)
            ax.set_ylim(0, hi)
        ax.set_title(label)
        ax.set_xlabel("measured (processes)")
        ax.set_ylabel("predicted (simulator)")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# The whole loop.
# ---------------------------------------------------------------------------


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _same_run(saved: Mapping[str, Any], config: Mapping[str, Any]) -> bool:
    """Whether two configs agree on every field both have (a field added to the
    configs since a run was made does not make it another run)."""
    a, b = _flat(saved), _flat(config)
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _run_once(config: Any, where: pathlib.Path) -> dict[str, Any]:
    """Runs ``config`` into ``where`` unless the same run finished there."""
    saved = where / "config.json"
    finished = (where / "metrics.jsonl").is_file() and saved.is_file()
    if finished:
        try:
            _read(where)
        except ValueError:
            finished = False
    current = json.loads(config.to_json_best_effort())
    if not (finished and _same_run(json.loads(saved.read_text()), current)):
        train.train_and_evaluate(config, where, progress=False)
    return _read(where)


def _measured_config(
    scheme: str,
    setting: str,
    seed: int,
    overrides: Mapping[str, Any],
    budget_seconds: float | None = None,
) -> Any:
    config = registry.load_config(scheme, setting)
    config.backend = "processes"
    config.seed = seed
    config.model.seed = seed
    if budget_seconds is not None:
        config.budget_seconds = float(budget_seconds)
    for key, value in overrides.items():
        if value is not None:
            config.workers[key] = value
    registry.check_config(config)
    config.freeze()  # checked: the run reads it as it is
    return config


def calibrate(
    workdir: str | pathlib.Path,
    *,
    setting: str = "proc4",
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    seeds: Sequence[int] = (1,),
    label: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    budget_seconds: float | None = None,
) -> dict[str, Any]:
    """Measures, fits, simulates and compares every scheme; writes the outputs.

    Args:
      workdir: the output directory.
      setting: a setting of ``experiments.configs.common.SETTINGS`` (run on
        processes whatever its backend).
      schemes: scheme names.
      seeds: one measured and one simulated run per scheme and seed.
      label: names the outputs (``calibration_<label>.*``); the setting's
        name by default.
      overrides: ``config.workers`` fields to change (``slowdowns``,
        ``bandwidth``, ``latency``), ``None`` values ignored.
      budget_seconds: every run's budget instead of the setting's (the
        simulated runs take the measured ones'), or ``None``.

    Returns:
      ``{"rows": [...], "table": markdown, "paths": {...}, ...}``.

    Raises:
      ValueError: an unknown setting or scheme, or a budget that is not a
        positive number, before anything runs.
    """
    from experiments import build

    if budget_seconds is not None and (
        isinstance(budget_seconds, bool)
        or not isinstance(budget_seconds, int | float)
        or not budget_seconds > 0
    ):
        raise ValueError(f"budget_seconds must be > 0, got {budget_seconds!r}")
    workdir = pathlib.Path(workdir)
    label = label or setting
    overrides = dict(overrides or {})
    rows, fits_out = [], {}
    shape = None
    apply_s = None
    for scheme in schemes:
        for seed in seeds:
            config = _measured_config(scheme, setting, seed, overrides, budget_seconds)
            name = scheme if len(seeds) == 1 else f"{scheme} (seed {seed})"
            logging.info("%s: measuring on processes", name)
            measured = _run_once(config, workdir / "measured" / scheme / f"seed_{seed}")
            if shape is None:
                setup = build.setup(config)
                shape = profile_shape(config, setup)
                apply_s = server_apply_seconds(config, setup)
            records = measured["records"]
            fits, startup = {}, {}
            for w in sorted(records, key=int):
                b = max((int(r["batch_size"]) for r in _rounds(records[w])), default=32)
                share = shape["intercept"] / (shape["intercept"] + shape["slope"] * b)
                fit = fit_compute(records[w], shape=share)
                gap = round_gap(records[w]) / max(
                    np.mean([int(r["local_steps"]) for r in _rounds(records[w])]), 1
                )
                fits[int(w)] = dataclasses.replace(fit, intercept=fit.intercept + gap)
                startup[int(w)] = fit_startup(records[w], fit)
            link = fit_link(
                [r for rs in records.values() for r in rs],
                bandwidth=config.workers.bandwidth,
            )
            service = fit_service(records)
            sim = simulated_config(config, fits, link, service["round_s"], startup)
            logging.info("%s: simulating with the fitted models", name)
            predicted = _run_once(sim, workdir / "simulated" / scheme / f"seed_{seed}")
            m, p = run_figures(measured), run_figures(predicted)
            rows.append(
                {
                    "scheme": name,
                    "measured": m,
                    "predicted": p,
                    "comparison": compare_runs(m, p),
                }
            )
            fits_out[name] = {
                "compute": {w: dataclasses.asdict(f) for w, f in fits.items()},
                "link": dataclasses.asdict(link),
                "service": service,
                "first_round_s": {
                    w: first_round_seconds(rs) for w, rs in sorted(records.items())
                },
                "startup_s": startup,
                "first_round_wait_s": {
                    w: first_round_wait(rs) for w, rs in sorted(records.items())
                },
                "simulated_workers": {
                    "step_time": sim.workers.step_time,
                    "step_overhead": sim.workers.step_overhead,
                    "slowdowns": list(sim.workers.slowdowns),
                    "jitter": sim.workers.jitter,
                    "bandwidth": sim.workers.bandwidth,
                    "latency": sim.workers.latency,
                    "startup_times": list(sim.workers.startup_times),
                    "server_service_time": sim.server.service_time,
                },
            }
    ranking = {
        "measured": _ranking(rows, "measured"),
        "predicted": _ranking(rows, "predicted"),
    }
    table = format_table(rows)
    result = {
        "setting": setting,
        "label": label,
        "overrides": overrides,
        "budget_seconds": budget_seconds,
        "schemes": list(schemes),
        "seeds": list(seeds),
        "profile_shape": shape,
        "server_apply_s": apply_s,
        "missing_terms": MISSING_TERMS,
        "fits": fits_out,
        "rows": rows,
        "ranking_by_time_to_target": ranking,
        "ranking_agrees": ranking["measured"] == ranking["predicted"],
        "table": table,
    }
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {
        "table": workdir / f"calibration_{label}.md",
        "json": workdir / f"calibration_{label}.json",
        "plot": workdir / f"calibration_{label}.png",
    }
    paths["table"].write_text(
        f"Measured (processes) / predicted (simulator), setting {label}\n\n"
        + table
        + "\n\nRanking by time to target: measured "
        + " < ".join(ranking["measured"])
        + "; predicted "
        + " < ".join(ranking["predicted"])
        + "\n"
    )
    paths["json"].write_text(json.dumps(train._jsonable(result), indent=2) + "\n")
    plot_calibration(
        rows,
        paths["plot"],
        title=f"simulator against processes: {label} (measured / fitted models)",
    )
    result["paths"] = paths
    return result


# ---------------------------------------------------------------------------
# Flags.
# ---------------------------------------------------------------------------

_PROG = "experiments.calibrate"


def parser() -> _cli.Parser:
    """The command's flags."""
    p = _cli.Parser(_PROG, description=__doc__.split("\n\n", 1)[0])
    _cli.add_setting_flag(p, "proc4", "Setting to run on processes.")
    p.add_argument(
        "--schemes", type=_cli.scheme_list, default=list(DEFAULT_SCHEMES),
        metavar="A,B", help="Schemes to calibrate (comma-separated; default "
        f"{','.join(DEFAULT_SCHEMES)}).",
    )  # fmt: skip
    p.add_argument(
        "--seeds", type=_cli.int_list, default=[1], metavar="1,2",
        help="Seeds (comma-separated ints; default 1).",
    )  # fmt: skip
    p.add_argument("--workdir", required=True, help="Directory for every output.")
    p.add_argument("--label", help="Name of the outputs (default: the setting).")
    p.add_argument(
        "--slowdowns", type=_cli.float_list, default=None, metavar="S,S",
        help="The workers' slowdowns instead of the setting's.",
    )  # fmt: skip
    p.add_argument(
        "--bandwidth", type=float, default=None,
        help="The link cap (bytes/s) instead of the setting's.",
    )  # fmt: skip
    p.add_argument(
        "--latency", type=float, default=None,
        help="The link latency (s) instead of the setting's.",
    )  # fmt: skip
    _cli.add_budget_flag(p, "Every run's budget")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    from hpsjax._logs import quiet_backend_probe

    args = parser().parse(argv)
    with _cli.usage_errors(_PROG):
        check_number(
            "--budget", args.budget, low=0, low_inclusive=False, allow_none=True
        )
        check_number(
            "--bandwidth", args.bandwidth, low=0, low_inclusive=False, allow_none=True
        )
        check_number("--latency", args.latency, low=0, allow_none=True)
        if args.slowdowns is not None and (
            not args.slowdowns or min(args.slowdowns) <= 0
        ):
            raise ValueError(f"--slowdowns must be numbers > 0, got {args.slowdowns}")
    quiet_backend_probe()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    result = calibrate(
        args.workdir,
        setting=args.setting,
        schemes=args.schemes,
        seeds=args.seeds,
        label=args.label,
        overrides={
            "slowdowns": None if args.slowdowns is None else tuple(args.slowdowns),
            "bandwidth": args.bandwidth,
            "latency": args.latency,
        },
        budget_seconds=args.budget,
    )
    print(result["table"])
    print(
        "ranking by time to target agrees: "
        f"{result['ranking_agrees']} ({result['ranking_by_time_to_target']})"
    )
    for name, path in result["paths"].items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
