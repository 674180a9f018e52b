r"""The frontier table: each recent method's claim against its baseline.

``python -m experiments.frontier --workdir=DIR`` runs, in each setting of
``--settings`` (sim8, sim8_slowlink and sim32 by default), every scheme of
:data:`CLAIMS` (the methods and their baselines) under the verdict protocol of
:mod:`experiments.protocol`:

1. **tuning**, on ``--tune_seed`` (0) only: every knob of :data:`KNOBS` (the
   step sizes the scheme's paper tunes, and its own knobs: Ringmaster's
   delay threshold R, Clipped ASGD's clip norm) from a grid of ``--factors``
   (0.5, 1, 2) times its config's value, by :func:`experiments.protocol.tune`:
   a coordinate search that extends a grid whose best value sits on an edge,
   within ``--tune_budget`` runs, **the same budget for a method and its
   baseline**;
2. **the table**: the chosen values on each of ``--seeds``
   (:data:`experiments.protocol.SEEDS`, five seeds that took no part in the
   tuning);
3. **the verdict** (:func:`verdict`): the ratio of mean times to the target,
   method over baseline, with its percentile bootstrap interval at
   :data:`experiments.protocol.LEVEL` (a run that never reached the target
   counts as its budget, a lower bound; mean times within one evaluation
   period of each other are level, as the evaluations cannot resolve them);
   bytes are counted both ways, pushed and pulled
   (:func:`experiments.protocol.total_bytes`).

Then it writes ``DIR/frontier.md`` (per claim and setting: the times, the
ratio and its interval, the megabytes moved both ways, the values chosen and
the verdict; then every tuning run) and ``DIR/frontier.json`` (every run's
summary, the tuning and the verdicts). Finished runs in ``DIR`` are kept (a
run is ``DIR/<setting>/<scheme>/<tag>/run.json``), so an interrupted table
resumes; ``--render_only`` rebuilds the table from them. Only the figures a
table needs are written per run (no plots, no per-round records). Example::

  python -m experiments.frontier --workdir=/tmp/hpsjax/frontier \
      --settings=sim8 --schemes=ringmaster,asp --seeds=1,2 --tune_budget=6

A claim these small simulated tasks cannot test says so in its ``untestable``
note, which the table prints beside the verdict.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from experiments import _cli, protocol, registry, sweep
from hpsjax._checks import check_int, check_number, check_positive
from hpsjax._logs import quiet_backend_probe

__all__ = [
    "CLAIMS",
    "KNOBS",
    "TIES",
    "Claim",
    "format_frontier",
    "point_config",
    "run_frontier",
    "scheme_stats",
    "searched_grids",
    "start_grid",
    "verdict",
]

_LR, _LOCAL_LR = "server.learning_rate", "worker.local_learning_rate"
_R = "server.policy_kwargs.delay_threshold"

KNOBS: dict[str, tuple[str, ...]] = {
    "asp": (_LR,),
    "ringmaster": (_LR, _R),
    "ringmaster_stop": (_LR, _R),
    "naive_optimal": (_LR, "server.policy_kwargs.noise_ratio"),
    "ringleader": (_LR,),
    "clipped_asgd": (_LR, "server.clip_norm"),
    "ormo": (_LR,),
    "ormo_da": (_LR,),
    "diloco": (_LOCAL_LR, _LR),
    "sparseloco": (_LOCAL_LR, _LR),
    "muloco": (_LOCAL_LR, _LR),
    "diloco_ef4": (_LOCAL_LR, _LR),
    "muloco_f32": (_LOCAL_LR, _LR),
    "streaming_diloco": (_LOCAL_LR, _LR),
    "asgd_momentum": (_LR,),
    "streaming_diloco_eager": (_LOCAL_LR, _LR),
    "adsp": (_LOCAL_LR,),
    "ashl_reference": (_LOCAL_LR,),
    "demo": (_LR,),
    "diloco_delayed": (_LOCAL_LR, _LR),
    "halos": (_LOCAL_LR, _LR, "server.policy_kwargs.global_learning_rate"),
    "bsp": (_LR,),
    "hps": (_LR,),
    "ps_plus": (_LR,),
    "saps": (_LR,),
}
"""The knobs tuned per scheme and setting (dotted config paths): the step
sizes its paper tunes (inner and outer for DiLoCo's family, SparseLoCo's outer
step among them), Ringmaster's delay threshold R and Clipped ASGD's clip
norm."""

TIES: dict[str, dict[str, tuple[str, ...]]] = {
    "streaming_diloco_eager": {
        _LR: ("worker.local_optimizer_args.outer_learning_rate",)
    },
}
"""Config paths that must follow a tuned knob (per scheme: knob -> paths set
to its value): eager updates mirror the server's outer step on the workers,
and the registry refuses a config where the two differ."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One paper's claim and the run that tests it.

    Attributes:
      method: the scheme of the method (``experiments/configs/<method>.py``).
      baseline: the scheme it is claimed against.
      paper: the reference, short.
      claim: the claim, in a line.
      rule: how the verdict is read (:func:`verdict`): ``"faster"`` (the
        interval of the ratio of times below 1), ``"faster_by:X"`` (below
        ``1 - X``), ``"fewer_bytes:X"`` (at least X times fewer bytes both
        ways to the target, and not slower), ``"not_slower_fewer_bytes"``
        (not slower and fewer bytes per push).
      untestable: what of the claim these runs cannot test, or ``""``.
    """

    method: str
    baseline: str
    paper: str
    claim: str
    rule: str
    untestable: str = ""


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "ringmaster",
        "asp",
        "Ringmaster ASGD, Maranjyan et al., ICML 2025",
        "optimal time complexity under arbitrary heterogeneous worker speeds",
        "faster",
        "the claim is a worst-case complexity bound; what runs here is its "
        "consequence, reaching the target no later than ASP with the slow "
        "workers' stale gradients cut (R tuned; the form that stops a "
        "computation that can no longer arrive in time: ringmaster_stop)",
    ),
    Claim(
        "ringmaster_stop",
        "ringmaster",
        "Ringmaster ASGD with calculation stops, Maranjyan et al., ICML 2025",
        "stopping computations R versions behind wastes no time on gradients "
        "that would be ignored",
        "faster",
        "the paper proves the same bound for both forms; the runs test whether "
        "the time a stopped worker saves shows (the simulator stops it at "
        "once; a real worker finishes its compiled step first)",
    ),
    Claim(
        "ringmaster",
        "naive_optimal",
        "Ringmaster ASGD, Maranjyan et al., ICML 2025",
        "as fast as naive optimal SGD (only the m fastest workers) without "
        "knowing the workers' speeds",
        "faster",
        "the claim is parity in the worst case (both optimal), so level agrees "
        "with it and only refuted (Ringmaster slower) contradicts it; here the "
        "m fastest come from measured times and S = sigma^2/eps is tuned",
    ),
    Claim(
        "ringleader",
        "ringmaster",
        "Ringleader ASGD, Maranjyan & Richtarik, arXiv 2509.22860",
        "optimal time with every worker's data in every step, where Ringmaster "
        "ignores the slow workers' gradients",
        "faster",
        "the claim is a complexity bound under data heterogeneity (each worker "
        "its own distribution); here every worker samples the same data, so the "
        "runs test only what the table costs or gains in time; its own "
        "baselines (Malenia SGD, IA2SGD) are not built",
    ),
    Claim(
        "clipped_asgd",
        "asp",
        "Clipped ASGD, Erickson & Johansson 2026",
        "clipping removes the maximum delay from the complexity: robust to stragglers",
        "faster",
        "a complexity bound; the runs test the consequence (no slower than ASP "
        "where delays are largest); the paper's threshold and step rules were "
        "not readable, so the clip norm and the step are tuned",
    ),
    Claim(
        "ormo",
        "asp",
        "OrMo, Shi et al., NeurIPS 2024",
        "momentum for ASGD that converges without the maximum-delay term",
        "faster",
        "a convergence bound; the runs test the consequence (ordered momentum "
        "no slower than ASP); against the paper's own baseline, naive "
        "momentum: the next claim",
    ),
    Claim(
        "ormo",
        "asgd_momentum",
        "OrMo, Shi et al., NeurIPS 2024",
        "ordered momentum converges faster than naive momentum in ASGD",
        "faster",
        "the paper's baseline: the same server momentum on the gradients in "
        "arrival order; both step sizes tuned",
    ),
    Claim(
        "ormo_da",
        "asgd_momentum",
        "OrMo-DA, Shi et al., NeurIPS 2024",
        "ordered momentum with a delay-adaptive step beats naive momentum in ASGD",
        "faster",
        "OrMo-DA's step rule is our reading (min(1, D/d), D = 1 iteration)",
    ),
    Claim(
        "streaming_diloco",
        "diloco",
        "Streaming DiLoCo, Douillard et al. 2025",
        "DiLoCo's quality with far less peak bandwidth and no stall for communication",
        "not_slower_fewer_bytes",
        "peak bandwidth is read as bytes per push (a fragment's), not measured "
        "on a link",
    ),
    Claim(
        "streaming_diloco_eager",
        "streaming_diloco",
        "Eager updates, Kale, Douillard & Donchev 2025",
        "eager updates recover what overlapping the outer gradients with the "
        "inner steps costs",
        "faster",
        "the paper's setting is DiLoCo on LLMs with the outer step on every "
        "worker; here Streaming DiLoCo's two fragments with a server, the "
        "eager step our reading of an abstract",
    ),
    Claim(
        "streaming_diloco_eager",
        "diloco",
        "Eager updates, Kale, Douillard & Donchev 2025",
        "overlapped outer gradients with eager updates match DiLoCo's quality "
        "(with Streaming DiLoCo's fewer bytes per push)",
        "not_slower_fewer_bytes",
        "the paper compares with DiLoCo on LLMs; here Streaming DiLoCo's two "
        "4-bit fragments with a server, read as no slower than DiLoCo with "
        "fewer bytes per push",
    ),
    Claim(
        "sparseloco",
        "diloco",
        "SparseLoCo, arXiv 2508.15706",
        "beats full-precision DiLoCo at 1-3% density",
        "faster",
        "the paper's claim is on LLM loss; here it is time to an accuracy on "
        "a small MLP",
    ),
    Claim(
        "muloco",
        "diloco",
        "MuLoCo, arXiv 2505.23725",
        "8x less communication than DiLoCo",
        "fewer_bytes:8",
        "Muon's gain is shown on LLMs; on a (64, 64) MLP its orthogonalised "
        "steps touch three small matrices; bytes both ways, so the dense "
        "pulls count",
    ),
    Claim(
        "muloco",
        "diloco_ef4",
        "MuLoCo, arXiv 2505.23725 (ablation)",
        "Muon beats AdamW as DiLoCo's inner optimizer under the same 4-bit "
        "error-feedback compression",
        "faster",
        "separates Muon from the compression: both push alike",
    ),
    Claim(
        "muloco_f32",
        "diloco",
        "MuLoCo, arXiv 2505.23725 (ablation)",
        "Muon beats AdamW as DiLoCo's inner optimizer, neither compressed",
        "faster",
        "separates Muon from the compression: both push float32",
    ),
    Claim(
        "demo",
        "bsp",
        "DeMo, Peng, Quesnelle & Kingma, arXiv 2411.19870",
        "comparable loss to all-reduce training with far fewer bytes",
        "fewer_bytes:10",
        "the paper's claim is on LLM loss against AdamW with all-reduce; here "
        "time to an accuracy against BSP's momentum SGD (a server's average "
        "for the all-reduce) on a small MLP",
    ),
    Claim(
        "diloco_delayed",
        "diloco",
        "async DiLoCo as PCCL runs it, Keiblinger et al., arXiv 2505.14065",
        "one-step-delayed outer updates hide the outer all-reduce",
        "faster",
        "PCCL states no convergence figure; what runs here is the consequence "
        "of hiding the link, reaching the target before DiLoCo",
    ),
    Claim(
        "halos",
        "diloco",
        "HALoS, Kim et al., ICML 2025, arXiv 2506.04531",
        "local servers per region and a global server reach the loss sooner "
        "than synchronous DiLoCo over slow inter-region links",
        "faster",
        "regions of the setting's workers behind a 100x faster intra-region "
        "link (the paper's premise); the paper times a 70M-parameter language "
        "model over measured inter-region bandwidths",
    ),
    Claim(
        "ashl_reference",
        "adsp",
        "ASHL (the authors' code), Shen et al., IEEE TC 2024",
        "more than 35% less time than ADSP to the same accuracy",
        "faster_by:0.35",
    ),
    Claim(
        "hps",
        "bsp",
        "H-PS, Xian et al., IEEE Access 2021",
        "1.4x-3.5x less training time than the synchronous parameter server "
        "on heterogeneous workers",
        "faster_by:0.286",
        "1.4x less time is a ratio of at most 1/1.4 = 0.714; the paper's "
        "pipelined transfer is off here (RESULTS.md, H-PS's pipelined "
        "transfer), its batches come from the simulator's profiling pass",
    ),
    Claim(
        "ps_plus",
        "bsp",
        "PS+, Jin et al., IEEE TPDS 2022",
        "up to 2.86x faster than common synchronous schemes",
        "faster",
        "an 'up to' figure: the runs test that PS+ is faster at all",
    ),
    Claim(
        "saps",
        "bsp",
        "SaPS, Yu et al., IEEE HPCC 2019",
        "faster than synchronous training with stragglers",
        "faster",
        "SaPS's rule is our reading of the paper (papers/NOTES.md)",
    ),
    Claim(
        "saps",
        "asp",
        "SaPS, Yu et al., IEEE HPCC 2019",
        "faster than asynchronous training with stragglers",
        "faster",
        "SaPS's rule is our reading of the paper (papers/NOTES.md)",
    ),
    Claim(
        "adsp",
        "bsp",
        "ADSP, Hu, Wang & Wu, AAAI 2020",
        "converges in less time than the existing synchronization models "
        "(BSP, SSP, ASP) on heterogeneous workers",
        "faster",
        "the paper's claim is against BSP, SSP and ASP together; here "
        "against BSP and ASP, one claim each",
    ),
    Claim(
        "adsp",
        "asp",
        "ADSP, Hu, Wang & Wu, AAAI 2020",
        "converges in less time than the existing synchronization models "
        "(BSP, SSP, ASP) on heterogeneous workers",
        "faster",
        "against ASP, whose stale gradients ADSP's commit rates bound",
    ),
)
"""The claims of the frontier table, in its order."""


def _get(config: Any, path: str) -> Any:
    node = config
    for key in path.split("."):
        node = node[key]
    return node


def _set(config: Any, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[leaf] = value


def start_grid(config: Any, path: str, factors: Sequence[float]) -> list[Any]:
    """A knob's first grid: ``factors`` times its config's value (an int knob
    stays int, at least 1; Ringmaster's R, ``None`` in its config, starts from
    the number of workers, the value ``None`` stands for).

    Examples:
      >>> from experiments import registry
      >>> config = registry.load_config("ringmaster", "sim8")
      >>> start_grid(config, "server.policy_kwargs.delay_threshold", (0.5, 1, 2))
      [4, 8, 16]
    """
    value = _get(config, path)
    if value is None and path == _R:
        value = len(config.workers.slowdowns)
    if value is None:
        raise ValueError(f"{path} is not set in {config.scheme}'s config: no grid")
    if isinstance(value, int) and not isinstance(value, bool):
        return sorted({max(1, round(value * f)) for f in factors})
    return sorted({float(value) * f for f in factors})


def point_config(
    scheme: str,
    setting: str,
    seed: int,
    point: dict[str, Any],
    budget_seconds: float | None = None,
) -> Any:
    """The config of ``scheme`` in ``setting`` at ``seed`` with the knobs of
    ``point`` set (and the paths :data:`TIES` binds to them), and every run's
    budget ``budget_seconds`` where given.

    Examples:
      >>> c = point_config("streaming_diloco_eager", "sim8", 1,
      ...                  {"server.learning_rate": 0.35})
      >>> c.worker.local_optimizer_args.outer_learning_rate
      0.35
    """
    config = registry.load_config(scheme, setting)
    config.seed = seed
    config.model.seed = seed
    if budget_seconds is not None:
        config.budget_seconds = float(budget_seconds)
    for path, value in point.items():
        _set(config, path, value)
        for tied in TIES.get(scheme, {}).get(path, ()):
            _set(config, tied, value)
    return config


def _censored(summaries: Sequence[dict[str, Any]], budget: float) -> list[float]:
    return protocol.censored_times(summaries, budget)


def _bytes_to_target(summary: dict[str, Any]) -> float:
    """Bytes moved both ways until the target, pro rata of the run's time (the
    whole run's where it never reached it: a lower bound)."""
    moved = protocol.total_bytes(summary)
    t, end = summary.get("time_to_target"), summary.get("end_time") or 0.0
    return moved * t / end if t is not None and end > 0 else float(moved)


def scheme_stats(
    summaries: Sequence[dict[str, Any]], budget: float, eval_every: float = 0.0
) -> dict[str, Any]:
    """A scheme's figures over its seeds: times (censored at ``budget``),
    reached count, megabytes both ways in the budget and to the target, bytes
    per push, best accuracy, divergences, and the runs' evaluation period
    ``eval_every`` (the resolution of their times)."""
    times = [s["time_to_target"] for s in summaries]
    reached = [t for t in times if t is not None]
    n = len(summaries)
    pushes = sum(s.get("pushes") or 0 for s in summaries)
    return {
        "runs": n,
        "reached": len(reached),
        "times": times,
        "censored": _censored(summaries, budget),
        "budget": budget,
        "eval_every": float(eval_every),
        "mean": sum(reached) / len(reached) if reached else None,
        "mb": sum(protocol.total_bytes(s) for s in summaries) / n / 1e6,
        "mb_to_target": sum(_bytes_to_target(s) for s in summaries) / n / 1e6,
        "bytes_per_push": sum(s["bytes_sent"] for s in summaries) / max(pushes, 1),
        "best_accuracy": sum(s["best_accuracy"] for s in summaries) / n,
        "target_metric": _target_metric(summaries),
        "best_metric": _mean_best(summaries),
        "diverged": sum(s.get("diverged_at") is not None for s in summaries),
    }


def _target_metric(summaries: Sequence[dict[str, Any]]) -> str:
    """The name of the metric the runs' target is on (``accuracy`` by default)."""
    if not summaries:
        return "accuracy"
    return summaries[0].get("target_metric") or "accuracy"


def _mean_best(summaries: Sequence[dict[str, Any]]) -> float | None:
    """The mean over runs of their best value of the target's metric (runs
    without a finite one left out; ``None`` if none has one)."""
    bests = [b for b in map(protocol.best_metric, summaries) if b is not None]
    return sum(bests) / len(bests) if bests else None


def _within_resolution(method: dict[str, Any], base: dict[str, Any]) -> bool:
    """Whether both schemes' times are within one evaluation period."""
    if method["reached"] < method["runs"] or base["reached"] < base["runs"]:
        return False
    every = max(method.get("eval_every", 0.0), base.get("eval_every", 0.0))
    return abs(method["mean"] - base["mean"]) <= every


def verdict(
    claim: Claim, method: dict[str, Any], base: dict[str, Any]
) -> tuple[str, tuple[float, float, float]]:
    """The claim's verdict in one setting and the interval it was read from:
    ``("reproduced" | "refuted" | "level" | "undecided", (ratio, low,
    high))``, the ratio of mean times to the target (method over baseline,
    censored at the budget) and its bootstrap interval at
    :data:`~experiments.protocol.LEVEL`.

    ``faster``: reproduced when the whole interval is below 1, refuted when
    above, level otherwise. ``faster_by:X``: reproduced when the interval is
    below ``1 - X``, refuted when above, level otherwise. ``fewer_bytes:X``:
    at least X times fewer bytes, both ways, to the target (a run that never
    reached it counts its whole run's bytes, a lower bound) and not slower.
    ``not_slower_fewer_bytes``: fewer bytes per push and not slower. Where
    every run of both reached the target and their mean times differ by no
    more than one evaluation period, the times cannot tell them apart: level,
    whatever the interval. With one seed of either scheme there is no spread
    to test: ``"too few seeds"``.

    A run cut at the budget counts its budget, less than its true time (and
    its whole run's bytes, fewer than to the target), so the budget, not the
    runs, would decide some readings: ``"undecided"`` when runs of both
    schemes were cut, when a method with cut runs would be reproduced (its
    counted time is a lower bound: it may be slower than it reads), and when
    a baseline with cut runs would refute the claim on time or bytes to the
    target (the baseline may be slower than it reads).
    """
    word, interval = _reading(claim, method, base)
    if word in ("too few seeds", "undecided"):
        return word, interval
    method_cut = method["reached"] < method["runs"]
    base_cut = base["reached"] < base["runs"]
    if method_cut and base_cut:
        return "undecided", interval
    if word == "reproduced" and method_cut:
        return "undecided", interval
    per_push = claim.rule == "not_slower_fewer_bytes" and not (
        method["bytes_per_push"] < base["bytes_per_push"]
    )  # a refutation by bytes per push, which no cut run changes
    if word == "refuted" and base_cut and not per_push:
        return "undecided", interval
    return word, interval


def _reading(
    claim: Claim, method: dict[str, Any], base: dict[str, Any]
) -> tuple[str, tuple[float, float, float]]:
    """:func:`verdict`'s reading of the counted times and bytes, before the
    check of runs cut at the budget."""
    speed, interval = protocol.time_verdict(method["censored"], base["censored"])
    if _within_resolution(method, base):
        speed = "level"
    if min(method["runs"], base["runs"]) < 2:
        return "too few seeds", interval  # one seed has no spread to test
    _, low, high = interval
    rule, _, arg = claim.rule.partition(":")
    if rule == "faster":
        word = {"faster": "reproduced", "slower": "refuted"}.get(speed, "level")
        return word, interval
    if rule == "faster_by":
        bound = 1.0 - float(arg)
        if high < bound:
            return "reproduced", interval
        return ("refuted" if low > bound else "level"), interval
    if rule == "fewer_bytes":
        mine, theirs = method["mb_to_target"], base["mb_to_target"]
        ratio = theirs / mine if mine > 0 else float("inf")
        ok = speed != "slower" and ratio >= float(arg)
        return ("reproduced" if ok else "refuted"), interval
    if rule == "not_slower_fewer_bytes":
        fewer = method["bytes_per_push"] < base["bytes_per_push"]
        ok = speed != "slower" and fewer
        return ("reproduced" if ok else "refuted"), interval
    raise ValueError(f"unknown claim rule {claim.rule!r}")


def _time_text(st: dict[str, Any]) -> str:
    if st["reached"] == 0:
        metric = st.get("target_metric", "accuracy")
        best = st.get("best_metric", st["best_accuracy"])
        shown = "-" if best is None else f"{best:.3f}"
        return f"not reached (0/{st['runs']}; best {metric} {shown})"
    reached = [t for t in st["times"] if t is not None]
    spread = f"{min(reached):.1f}-{max(reached):.1f}"
    if st["reached"] < st["runs"]:
        return f"{st['mean']:.1f} [{spread}] ({st['reached']}/{st['runs']})"
    return f"{st['mean']:.1f} [{spread}]"


def _point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v:g}" for k, v in sorted(point.items()))


def searched_grids(tuning: dict[str, Any]) -> dict[str, list[Any]]:
    """Each knob's values that a scheme's tuning ran (``tuning``: one entry
    of :func:`run_frontier`'s ``"tuning"``), sorted.

    Examples:
      >>> searched_grids({"trials": [{"point": {"lr": 0.2, "m": 4}},
      ...                            {"point": {"lr": 0.1, "m": 4}}]})
      {'lr': [0.1, 0.2], 'm': [4]}
    """
    grids: dict[str, set] = {}
    for trial in tuning["trials"]:
        for knob, value in trial["point"].items():
            grids.setdefault(knob, set()).add(value)
    return {knob: sorted(values) for knob, values in sorted(grids.items())}


def _grid_text(tuning: dict[str, Any]) -> str:
    """``knob: a, b, c`` per knob; a chosen value at an edge of a grid of two
    or more values is marked (the budget ran out before the grid passed it)."""
    parts = []
    for knob, grid in searched_grids(tuning).items():
        chosen = tuning["chosen"].get(knob)
        edge = len(grid) > 1 and protocol.on_edge(grid, chosen) is not None
        values = ", ".join(f"{v:g}" for v in grid)
        parts.append(
            f"{knob.rsplit('.', 1)[-1]}: {values}" + (" (edge)" if edge else "")
        )
    return "; ".join(parts)


def format_frontier(result: dict[str, Any]) -> str:
    """The markdown tables of :func:`run_frontier`'s result."""
    level = result.get("level", protocol.LEVEL)
    lines = [
        "| claim | setting | method: time to target (s) [range] | baseline: "
        f"time to target (s) [range] | time ratio [{level:.0%} CI] | MB both ways "
        "to the target (method / baseline) | chosen (method / baseline) | "
        "verdict |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for c in result["claims"]:
        for setting in result["settings"]:
            cell = c["settings"].get(setting)
            if cell is None:
                continue
            m, b = cell["method"], cell["baseline"]
            ratio, low, high = cell["interval"]
            lines.append(
                f"| {c['method']} vs {c['baseline']} | {setting} | "
                f"{_time_text(m)} | {_time_text(b)} | {ratio:.2f} "
                f"[{low:.2f}, {high:.2f}] | {m['mb_to_target']:.2f} / "
                f"{b['mb_to_target']:.2f} | {_point_text(cell['chosen_method'])} / "
                f"{_point_text(cell['chosen_baseline'])} | {cell['verdict']} |"
            )
    tuning = [
        "| setting | scheme | grid searched per knob | tried (knobs: time to "
        "target on the tuning seed, s) | chosen |",
        "|---|---|---|---|---|",
    ]
    for setting in result["settings"]:
        for scheme, t in result["tuning"].get(setting, {}).items():
            tried = "; ".join(
                f"{_point_text(trial['point'])}: "
                + (
                    "diverged"
                    if trial["diverged"]
                    else "-"
                    if trial["time"] is None
                    else f"{trial['time']:.1f}"
                )
                for trial in t["trials"]
            )
            tuning.append(
                f"| {setting} | {scheme} | {_grid_text(t)} | {tried} | "
                f"{_point_text(t['chosen'])} |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(tuning) + "\n"


class _Runner:
    """Runs configs in ``workdir``, ``jobs`` at a time in processes of their
    own, keeping finished runs (``render_only``: finished runs only)."""

    def __init__(self, jobs: int, render_only: bool):
        self.render_only = render_only
        self.pool = None
        if jobs > 1 and not render_only:
            context = multiprocessing.get_context("spawn")  # jax is not fork-safe
            self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def run(self, config: Any, where: pathlib.Path) -> dict[str, Any]:
        record = sweep.finished(config, where)
        if record is not None:
            return record
        if self.render_only:
            raise ValueError(f"no finished run of this config in {where}")
        if self.pool is None:
            return sweep.run_one(config, str(where))
        record = self.pool.submit(sweep.run_one, config, str(where)).result()
        logging.info(
            "%s: time to target %s, %.0f s of compute",
            where,
            record["summary"]["time_to_target"],
            record["compute_s"],
        )
        return record


def _tag(point: dict[str, Any]) -> str:
    return "tune_" + "_".join(
        f"{k.rsplit('.', 1)[-1]}{v:g}" for k, v in sorted(point.items())
    )


def _tune_scheme(scheme, setting, config_of, runner, workdir, factors, budget):
    """One scheme's tuning in one setting: ``(chosen, trials)``."""
    base = config_of(scheme, setting, 0, {})
    knobs = {path: start_grid(base, path, factors) for path in KNOBS[scheme]}

    def evaluate(point):
        where = workdir / setting / scheme / _tag(point)
        return runner.run(config_of(scheme, setting, None, point), where)["summary"]

    return protocol.tune(evaluate, knobs, budget=budget)


def _check_args(settings, seeds, tune_seed, factors, tune_budget, dashes="") -> None:
    """Checks :func:`run_frontier`'s arguments; ``dashes="--"`` names them as
    the command's flags in the messages."""
    from experiments.configs import common

    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"{dashes}seeds must be distinct ints >= 0, got {list(seeds)}")
    if tune_seed in seeds:
        raise ValueError(
            f"the tuning seed {tune_seed} ({dashes}tune_seed) must not be one of "
            f"the table's {dashes}seeds"
        )
    if not factors:
        raise ValueError(f"{dashes}factors must hold at least one value, got none")
    for f in factors:
        check_positive(f"{dashes}factors", f)
    check_int(f"{dashes}tune_budget", tune_budget, low=1)
    for s in settings:
        if s not in common.SETTINGS:
            raise ValueError(
                f"{dashes}settings: unknown setting {s!r}; valid names: "
                f"{', '.join(sorted(common.SETTINGS))}"
            )


def run_frontier(
    workdir: str | pathlib.Path,
    *,
    settings: Sequence[str] = ("sim8", "sim8_slowlink", "sim32"),
    seeds: Sequence[int] = protocol.SEEDS,
    tune_seed: int = 0,
    factors: Sequence[float] = (0.5, 1.0, 2.0),
    tune_budget: int = 8,
    claims: Sequence[Claim] | None = None,
    schemes_by_setting: dict[str, Sequence[str]] | None = None,
    jobs: int = 1,
    budget_seconds: float | None = None,
    render_only: bool = False,
    log: Callable[[str], None] = logging.info,
) -> dict[str, Any]:
    """Tunes, runs and judges every claim in every setting.

    Args:
      workdir: where the runs go (kept between calls).
      settings: names of ``experiments.configs.common.SETTINGS``.
      seeds: the seeds of the table.
      tune_seed: the seed of the tuning runs (not among ``seeds``).
      factors: each knob's first grid, as multiples of the config's value.
      tune_budget: the tuning runs allowed per scheme and setting, the same
        for every scheme.
      claims: the claims to test (``None``: :data:`CLAIMS` whose schemes have
        a config).
      schemes_by_setting: a subset of schemes per setting (claims whose method
        or baseline is missing there are skipped), or ``None`` for all.
      jobs: runs at once, each in a process of its own.
      budget_seconds: every run's budget instead of the setting's.
      render_only: use the finished runs only (a missing one is an error).
      log: where progress lines go.

    Returns:
      ``{"settings", "seeds", "tune_seed", "factors", "tune_budget", "level",
      "tuning", "claims", "runs"}``.

    Raises:
      ValueError: an unknown setting or scheme, ``tune_seed`` among ``seeds``,
        bad factors or budget, or (``render_only``) a run that is not there.
    """
    seeds = [int(s) for s in seeds]
    factors = [float(f) for f in factors]
    _check_args(settings, seeds, tune_seed, factors, tune_budget)
    if claims is None:
        claims = [
            c
            for c in CLAIMS
            if c.method in registry.SCHEMES and c.baseline in registry.SCHEMES
        ]
    workdir = pathlib.Path(workdir)

    def config_of(scheme, setting, seed, point):
        return point_config(
            scheme, setting, tune_seed if seed is None else seed, point, budget_seconds
        )

    runner = _Runner(jobs, render_only)
    tuning: dict[str, dict[str, Any]] = {}
    table: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        for setting in settings:
            wanted = {c.method for c in claims} | {c.baseline for c in claims}
            if schemes_by_setting is not None:
                wanted &= set(schemes_by_setting.get(setting, ()))
            schemes = [s for s in KNOBS if s in wanted]
            for scheme in schemes:
                registry.lookup("scheme", scheme)
            log(f"{setting}: tuning {len(schemes)} schemes, {tune_budget} runs each")
            tuning[setting] = _tune_all(
                schemes, setting, config_of, runner, workdir, factors, tune_budget, jobs
            )
            log(f"{setting}: {len(schemes)} schemes x {len(seeds)} seeds")
            for scheme in schemes:
                table[(setting, scheme)] = _seed_runs(
                    scheme, setting, seeds, tuning[setting][scheme]["chosen"],
                    config_of, runner, workdir, jobs,
                )  # fmt: skip
    finally:
        runner.close()
    return {
        "settings": list(settings),
        "seeds": seeds,
        "tune_seed": tune_seed,
        "factors": factors,
        "tune_budget": int(tune_budget),
        "level": protocol.LEVEL,
        "tuning": tuning,
        "claims": _judge(claims, settings, table, tuning),
        "runs": {f"{st}/{sc}": v["summaries"] for (st, sc), v in table.items()},
    }


def _tune_all(schemes, setting, config_of, runner, workdir, factors, budget, jobs):
    """Every scheme's tuning in one setting (schemes side by side when
    ``jobs`` > 1, each tuning's runs one after the other)."""

    def one(scheme):
        return _tune_scheme(
            scheme, setting, config_of, runner, workdir, factors, budget
        )

    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(schemes)))) as ex:
        results = dict(zip(schemes, ex.map(one, schemes), strict=True))
    return {
        scheme: {
            "chosen": chosen,
            "trials": [
                {
                    "point": point,
                    "time": s["time_to_target"],
                    "best_accuracy": s["best_accuracy"],
                    "diverged": s.get("diverged_at") is not None,
                }
                for point, s in trials
            ],
        }
        for scheme, (chosen, trials) in results.items()
    }


def _seed_runs(scheme, setting, seeds, chosen, config_of, runner, workdir, jobs):
    """The chosen point on every seed: ``{"stats", "summaries"}``."""
    configs = [config_of(scheme, setting, seed, chosen) for seed in seeds]
    wheres = [workdir / setting / scheme / f"seed_{seed}" for seed in seeds]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(seeds)))) as ex:
        records = list(ex.map(runner.run, configs, wheres))
    summaries = [r["summary"] for r in records]
    budget = float(configs[0].budget_seconds)
    every = float(configs[0].eval.every_seconds)
    return {"stats": scheme_stats(summaries, budget, every), "summaries": summaries}


def _judge(claims, settings, table, tuning) -> list[dict[str, Any]]:
    out = []
    for c in claims:
        entry = {**dataclasses.asdict(c), "settings": {}}
        for setting in settings:
            m, b = table.get((setting, c.method)), table.get((setting, c.baseline))
            if m is None or b is None:
                continue
            word, interval = verdict(c, m["stats"], b["stats"])
            entry["settings"][setting] = {
                "method": m["stats"],
                "baseline": b["stats"],
                "chosen_method": tuning[setting][c.method]["chosen"],
                "chosen_baseline": tuning[setting][c.baseline]["chosen"],
                "interval": list(interval),
                "verdict": word,
            }
        out.append(entry)
    return out


_PROG = "experiments.frontier"


def _scheme_entries(text: str) -> list[str]:
    """``--schemes``: scheme names, and ``SETTING=a+b+c`` entries naming one
    setting's schemes, each checked."""
    from experiments.configs import common

    entries = _cli.comma_list(text)
    for entry in entries:
        setting, _, names = entry.rpartition("=")
        if "=" in entry and setting not in common.SETTINGS:
            raise argparse.ArgumentTypeError(
                f"unknown setting {setting!r} in {entry!r}; valid names: "
                f"{', '.join(common.SETTINGS)}"
            )
        _cli.scheme_list(names.replace("+", ","))
    return entries


def _setting_list(text: str) -> list[str]:
    """``--settings``: comma-separated names of the settings."""
    from experiments.configs import common

    names = _cli.comma_list(text)
    for name in names:
        if name not in common.SETTINGS:
            raise argparse.ArgumentTypeError(
                f"unknown setting {name!r}; valid names: {', '.join(common.SETTINGS)}"
            )
    return names


def parser() -> _cli.Parser:
    """The command's flags."""
    from experiments.configs import common

    p = _cli.Parser(_PROG, description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--workdir", required=True, help="Where the runs go (kept between calls)."
    )
    p.add_argument(
        "--settings",
        type=_setting_list,
        default=["sim8", "sim8_slowlink", "sim32"],
        metavar="A,B",
        help=f"Settings, comma-separated: some of {', '.join(common.SETTINGS)}.",
    )
    p.add_argument(
        "--seeds",
        type=_cli.int_list,
        default=list(protocol.SEEDS),
        metavar="1,2",
        help="Seeds of the table (comma-separated distinct ints >= 0).",
    )
    p.add_argument(
        "--tune_seed",
        type=int,
        default=0,
        help="Seed of the tuning runs (not a table seed).",
    )
    p.add_argument(
        "--factors",
        type=_cli.float_list,
        default=[0.5, 1.0, 2.0],
        metavar="X,Y",
        help="Each knob's first grid, as multiples of its config's value (> 0).",
    )
    p.add_argument(
        "--tune_budget",
        type=int,
        default=8,
        help="Tuning runs per scheme and setting (the same for all).",
    )
    p.add_argument(
        "--schemes",
        type=_scheme_entries,
        default=None,
        metavar="A,B|SETTING=A+B",
        help="Schemes to run (claims missing one are left out); all by default. "
        "SETTING=a+b+c entries restrict one setting.",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="Runs at once, one process each."
    )
    _cli.add_budget_flag(p, "Every run's budget")
    p.add_argument(
        "--render_only",
        action="store_true",
        help="Rebuild the table from finished runs.",
    )
    p.add_argument("--out", default=None, help="Also write the JSON result here.")
    return p


def _check_flags(args: argparse.Namespace) -> None:
    """Checks the flags, naming them, before anything runs."""
    _check_args(
        args.settings, args.seeds, args.tune_seed, args.factors, args.tune_budget, "--"
    )
    check_int("--jobs", args.jobs, low=1)
    check_number("--budget", args.budget, low=0, low_inclusive=False, allow_none=True)


def _schemes_by_setting(values, settings) -> dict[str, list[str]] | None:
    if not values:
        return None
    plain = [v for v in values if "=" not in v]
    per = {}
    for v in values:
        if "=" in v:
            setting, _, names = v.partition("=")
            per[setting] = names.split("+")
    return {s: per.get(s, plain) for s in settings}


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse(argv)
    with _cli.usage_errors(_PROG):
        _check_flags(args)
    quiet_backend_probe()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with _cli.usage_errors(_PROG):
        result = run_frontier(
            args.workdir,
            settings=args.settings,
            seeds=args.seeds,
            tune_seed=args.tune_seed,
            factors=args.factors,
            tune_budget=args.tune_budget,
            schemes_by_setting=_schemes_by_setting(args.schemes, args.settings),
            jobs=args.jobs,
            budget_seconds=args.budget,
            render_only=args.render_only,
        )
    text = format_frontier(result)
    workdir = pathlib.Path(args.workdir)
    (workdir / "frontier.md").write_text(text)
    payload = json.dumps(result, indent=1) + "\n"
    (workdir / "frontier.json").write_text(payload)
    if args.out:
        pathlib.Path(args.out).write_text(payload)
    print(text)


if __name__ == "__main__":
    main()
