r"""The frontier table: each recent method's claim against its baseline.

``python -m experiments.frontier --workdir=DIR`` runs, in each setting of
``--settings`` (sim8, sim8_slowlink and sim32 by default), every scheme of
:data:`CLAIMS` (the methods and their baselines) in two steps:

1. **tuning**, on ``--tune_seed`` (0) only: the scheme's step size
   (:data:`KNOBS`: the one learning rate that sets the scheme's step) at
   ``--factors`` (0.5, 1, 2) times its config's value for the setting; the
   value that reaches the target accuracy soonest is chosen (the best
   accuracy decides between values that never reach it; a diverged run is
   never chosen);
2. **the table**: the chosen value on each of ``--seeds`` (1, 2, 3), seeds that
   took no part in the choice.

Then it writes ``DIR/frontier.md`` (per claim and setting: the time to the
target, mean ± standard deviation over the seeds, the megabytes pushed, and the
verdict of :func:`verdict`) and ``DIR/frontier.json`` (every run's summary, the
tuning and the verdicts). Finished runs in ``DIR`` are kept (a run is
``DIR/<setting>/<scheme>/<tag>/run.json``), so an interrupted table resumes;
``--render_only`` rebuilds the table from them. Only the figures a table needs
are written per run (no plots, no per-round records): a run of sim8 takes
about 5 s of compute. Example::

  python -m experiments.frontier --workdir=/tmp/hpsjax/frontier \
      --settings=sim8 --seeds=1 --factors=1 --budget=10

Verdicts compare means against the seeds' spread: a method is *faster* than
its baseline when its mean time to the target is below the baseline's by more
than the larger of the two standard deviations (and every seed reached the
target), *slower* in the mirror case, *level* otherwise; where neither reached
the target in any seed, the best accuracy decides the same way (higher beyond
the larger standard deviation is *faster*); each claim's rule in
:data:`CLAIMS` turns that (and the bytes) into *reproduced*, *refuted* or
*level*. A claim these small simulated tasks cannot test says so in its
``untestable`` note, which the table prints beside the verdict.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags, logging

from experiments import _cli, registry
from hpsjax._logs import quiet_backend_probe

__all__ = [
    "CLAIMS",
    "KNOBS",
    "Claim",
    "choose",
    "compare_times",
    "format_frontier",
    "run_frontier",
    "verdict",
]

KNOBS: dict[str, str] = {
    "asp": "server.learning_rate",
    "ringmaster": "server.learning_rate",
    "clipped_asgd": "server.learning_rate",
    "ormo": "server.learning_rate",
    "diloco": "worker.local_learning_rate",
    "sparseloco": "worker.local_learning_rate",
    "muloco": "worker.local_learning_rate",
    "streaming_diloco": "worker.local_learning_rate",
    "asgd_momentum": "server.learning_rate",
    "streaming_diloco_eager": "worker.local_learning_rate",
    "adsp": "worker.local_learning_rate",
    "ashl_reference": "worker.local_learning_rate",
    "demo": "server.learning_rate",
    "bsp": "server.learning_rate",
}
"""The step size tuned per scheme and setting (a dotted config path)."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One paper's claim and the run that tests it.

    Attributes:
      method: the scheme of the method (``experiments/configs/<method>.py``).
      baseline: the scheme it is claimed against.
      paper: the reference, short.
      claim: the claim, in a line.
      rule: how the verdict is read: ``"faster"`` (reproduced when the method
        reaches the target sooner than the baseline beyond the seeds'
        spread), ``"faster_by:X"`` (sooner by at least the fraction X of the
        baseline's time), ``"fewer_bytes:X"`` (at least X times fewer bytes
        pushed, and not slower), ``"not_slower_fewer_bytes"`` (not slower and
        fewer bytes).
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
        "workers' stale gradients cut",
    ),
    Claim(
        "clipped_asgd",
        "asp",
        "Clipped ASGD, Erickson & Johansson 2026",
        "clipping removes the maximum delay from the complexity: robust to stragglers",
        "faster",
        "a complexity bound; the runs test the consequence (no slower than ASP "
        "where delays are largest); the clip norm is not tuned",
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
        "steps touch three small matrices",
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
        "ashl_reference",
        "adsp",
        "ASHL (the authors' code), Shen et al., IEEE TC 2024",
        "more than 35% less time than ADSP to the same accuracy",
        "faster_by:0.35",
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


def _config_text(config: Any) -> str:
    return config.to_json_best_effort(indent=2) + "\n"


def _run(config: Any, where: str) -> dict[str, Any]:
    """One run: its summary and evaluations in ``where/run.json``.

    The body of a worker process; only what the table needs is written.
    """
    from experiments import backends, build, train

    registry.check_config(config)
    setup = build.setup(config)
    out = pathlib.Path(where)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    output = backends.BACKENDS[config.backend](
        config, setup, workdir=out, progress=False
    )
    output = output._replace(evals=train.with_initial_evaluation(output.evals))
    summary = train.summarize(config, output)
    record = {
        "config": _config_text(config),
        "summary": train._jsonable(summary),
        "evals": [[e["time"], e[setup.target.metric]] for e in output.evals],
        "compute_s": time.perf_counter() - start,
    }
    (out / "run.json").write_text(json.dumps(record) + "\n")
    return record


def _finished(config: Any, where: pathlib.Path) -> dict[str, Any] | None:
    path = where / "run.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("config") == _config_text(config) else None


def _run_many(
    todo: Sequence[tuple[Any, pathlib.Path]], jobs: int
) -> dict[pathlib.Path, dict[str, Any]]:
    """Runs ``(config, where)`` pairs not yet finished, ``jobs`` at a time."""
    done, missing = {}, []
    for config, where in todo:
        record = _finished(config, where)
        if record is None:
            missing.append((config, where))
        else:
            done[where] = record
    if not missing:
        return done
    logging.info("%d runs (%d kept), %d at a time", len(missing), len(done), jobs)
    if jobs == 1:
        for config, where in missing:
            done[where] = _run(config, str(where))
        return done
    context = multiprocessing.get_context("spawn")  # jax is not fork-safe
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_run, c, str(w)): w for c, w in missing}
        for future in concurrent.futures.as_completed(futures):
            where = futures[future]
            done[where] = future.result()
            s = done[where]["summary"]
            logging.info(
                "%s: time to target %s, %.0f s of compute",
                where,
                s["time_to_target"],
                done[where]["compute_s"],
            )
    return done


def choose(summaries: dict[float, dict[str, Any]]) -> float:
    """The tuned value: soonest to the target, else the best value of the
    target's metric (its direction: :class:`experiments.target.Target`).

    Args:
      summaries: one tuning run's summary per candidate value.

    Returns:
      The chosen value; a run that diverged is chosen only if all did.
    """

    def key(item):
        _, s = item
        diverged = s.get("diverged_at") is not None
        t = s["time_to_target"]
        return (diverged, t is None, t if t is not None else 0.0, _best_key(s))

    return min(summaries.items(), key=key)[0]


def _best_key(summary: dict[str, Any]) -> float:
    """Sorts a run's best value of its target's metric, better first (a
    summary of before targets had a metric: its best accuracy)."""
    from experiments.target import Target

    if summary.get("target_metric") is None:
        return -summary["best_accuracy"]
    return Target.of_summary(summary).sort_key(summary.get("best_metric"))


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def _stats(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    times = [s["time_to_target"] for s in summaries]
    reached = [t for t in times if t is not None]
    n = len(summaries)
    mean = sum(reached) / len(reached) if reached else None
    std = (
        (sum((t - mean) ** 2 for t in reached) / len(reached)) ** 0.5
        if reached
        else None
    )
    pushes = [s.get("pushes") or 0 for s in summaries]
    bytes_sent = [s["bytes_sent"] for s in summaries]
    # Bytes pushed until the target, pro rata of the run's time: the schemes
    # compared by bytes (DiLoCo's family) push at a steady rate.
    to_target = [
        s["bytes_sent"] * s["time_to_target"] / s["end_time"]
        for s in summaries
        if s["time_to_target"] is not None and s["end_time"] > 0
    ]
    return {
        "runs": n,
        "reached": len(reached),
        "times": times,
        "mean": mean,
        "std": std,
        "mb": sum(bytes_sent) / n / 1e6,
        "mb_to_target": sum(to_target) / len(to_target) / 1e6 if to_target else None,
        "bytes_per_push": sum(bytes_sent) / max(sum(pushes), 1),
        "best_accuracy": sum(s["best_accuracy"] for s in summaries) / n,
        "best_accuracy_std": _std([s["best_accuracy"] for s in summaries]),
        "diverged": sum(s.get("diverged_at") is not None for s in summaries),
    }


def compare_times(method: dict[str, Any], base: dict[str, Any]) -> str:
    """``"faster"``, ``"slower"`` or ``"level"``: the method's time to the
    target against the baseline's, beyond the larger standard deviation.

    A scheme that reached the target in fewer runs than the other is the
    slower; where neither ever reached it, the best accuracy decides (higher
    beyond the larger standard deviation is faster), level without it.
    """
    if method["reached"] != base["reached"]:
        return "faster" if method["reached"] > base["reached"] else "slower"
    if method["reached"] == 0:
        mine, theirs = method.get("best_accuracy"), base.get("best_accuracy")
        if mine is None or theirs is None:
            return "level"
        noise = max(
            method.get("best_accuracy_std", 0.0), base.get("best_accuracy_std", 0.0)
        )
        if mine > theirs + noise:
            return "faster"
        if mine < theirs - noise:
            return "slower"
        return "level"
    noise = max(method["std"], base["std"])
    if method["mean"] < base["mean"] - noise:
        return "faster"
    if method["mean"] > base["mean"] + noise:
        return "slower"
    return "level"


def verdict(claim: Claim, method: dict[str, Any], base: dict[str, Any]) -> str:
    """The claim's verdict in one setting: ``reproduced``, ``refuted`` or
    ``level`` (neither: the difference is within the seeds' spread)."""
    speed = compare_times(method, base)
    rule, _, arg = claim.rule.partition(":")
    if rule == "faster":
        return {"faster": "reproduced", "slower": "refuted"}.get(speed, "level")
    if rule == "faster_by":
        if speed != "faster":
            return "refuted" if speed == "slower" else "level"
        if base["mean"] is None:
            return "reproduced"  # the baseline never reached the target
        cut = 1.0 - method["mean"] / base["mean"]
        return "reproduced" if cut >= float(arg) else "refuted"
    if rule == "fewer_bytes":
        # Bytes to the same accuracy where both reach it; where only the
        # method does, the baseline's bytes in the whole budget (it needs
        # more); else the bytes in the budget.
        mine, theirs = method.get("mb_to_target"), base.get("mb_to_target")
        if mine is not None and theirs is None:
            theirs = base["mb"]
        elif mine is None or theirs is None:
            mine, theirs = method["mb"], base["mb"]
        ratio = theirs / mine if mine > 0 else float("inf")
        if speed == "slower" or ratio < float(arg):
            return "refuted"
        return "reproduced"
    if rule == "not_slower_fewer_bytes":
        fewer = method["bytes_per_push"] < base["bytes_per_push"]
        return "reproduced" if speed != "slower" and fewer else "refuted"
    raise ValueError(f"unknown claim rule {claim.rule!r}")


def _time_text(st: dict[str, Any]) -> str:
    if st["reached"] == 0:
        best = st.get("best_accuracy")
        if best is None:
            return f"not reached (0/{st['runs']})"
        spread = st.get("best_accuracy_std") or 0.0
        return f"not reached (0/{st['runs']}; best {best:.3f} ± {spread:.3f})"
    if st["reached"] < st["runs"]:
        return f"{st['mean']:.1f} ({st['reached']}/{st['runs']})"
    return f"{st['mean']:.1f} ± {st['std']:.1f}"


def _mb(st: dict[str, Any]) -> str:
    mb = st.get("mb_to_target")
    return "-" if mb is None else f"{mb:.2f}"


def format_frontier(result: dict[str, Any]) -> str:
    """The markdown tables of :func:`run_frontier`'s result."""
    settings = result["settings"]
    lines = [
        "| claim | setting | method: time to target (s) | baseline: time to "
        "target (s) | MB pushed in the budget (method / baseline) | MB pushed "
        "to the target | step size chosen (method / baseline) | verdict |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for c in result["claims"]:
        for setting in settings:
            cell = c["settings"].get(setting)
            if cell is None:
                continue
            m, b = cell["method"], cell["baseline"]
            lines.append(
                f"| {c['method']} vs {c['baseline']} | {setting} | "
                f"{_time_text(m)} | {_time_text(b)} | {m['mb']:.2f} / "
                f"{b['mb']:.2f} | {_mb(m)} / {_mb(b)} | {cell['chosen_method']:g} / "
                f"{cell['chosen_baseline']:g} | {cell['verdict']} |"
            )
    tuning = [
        "| setting | scheme | step size (path) | tried: time to target on the "
        "tuning seed (s) | chosen |",
        "|---|---|---|---|---:|",
    ]
    for setting in settings:
        for scheme, t in result["tuning"].get(setting, {}).items():
            tried = ", ".join(
                f"{v:g}: "
                + (
                    "diverged"
                    if s["diverged"]
                    else "-"
                    if s["time"] is None
                    else f"{s['time']:.1f}"
                )
                for v, s in sorted((float(k), s) for k, s in t["tried"].items())
            )
            tuning.append(
                f"| {setting} | {scheme} | {KNOBS[scheme]} | {tried} | "
                f"{t['chosen']:g} |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(tuning) + "\n"


def run_frontier(
    workdir: str | pathlib.Path,
    *,
    settings: Sequence[str] = ("sim8", "sim8_slowlink", "sim32"),
    seeds: Sequence[int] = (1, 2, 3),
    tune_seed: int = 0,
    factors: Sequence[float] = (0.5, 1.0, 2.0),
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
      factors: the step sizes tried, as multiples of the config's value.
      claims: the claims to test (``None``: :data:`CLAIMS` whose schemes have
        a config).
      schemes_by_setting: a subset of schemes per setting (claims whose method
        or baseline is missing there are skipped), or ``None`` for all.
      jobs: runs at once, each in a process of its own.
      budget_seconds: every run's budget instead of the setting's.
      render_only: use the finished runs only (a missing one is an error).
      log: where progress lines go.

    Returns:
      ``{"settings", "seeds", "tune_seed", "factors", "tuning", "claims"}``.

    Raises:
      ValueError: an unknown setting or scheme, ``tune_seed`` among ``seeds``,
        bad factors, or (``render_only``) a run that is not there.
    """
    from experiments.configs import common

    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds must be distinct ints >= 0, got {seeds}")
    if tune_seed in seeds:
        raise ValueError(f"the tuning seed {tune_seed} must not be a table seed")
    factors = [float(f) for f in factors]
    if not factors or min(factors) <= 0:
        raise ValueError(f"factors must be positive, got {factors}")
    for s in settings:
        if s not in common.SETTINGS:
            raise ValueError(
                f"unknown setting {s!r}; valid names: "
                f"{', '.join(sorted(common.SETTINGS))}"
            )
    if claims is None:
        claims = [
            c
            for c in CLAIMS
            if c.method in registry.SCHEMES and c.baseline in registry.SCHEMES
        ]
    workdir = pathlib.Path(workdir)

    def config_of(scheme, setting, seed, value):
        config = registry.load_config(scheme, setting)
        config.seed = seed
        config.model.seed = seed
        if budget_seconds is not None:
            config.budget_seconds = float(budget_seconds)
        if value is not None:
            _set(config, KNOBS[scheme], value)
        return config

    def runs(todo):
        if render_only:
            done = {}
            for config, where in todo:
                record = _finished(config, where)
                if record is None:
                    raise ValueError(f"no finished run of this config in {where}")
                done[where] = record
            return done
        return _run_many(todo, jobs)

    tuning: dict[str, dict[str, Any]] = {}
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for setting in settings:
        wanted = {c.method for c in claims} | {c.baseline for c in claims}
        if schemes_by_setting is not None:
            wanted &= set(schemes_by_setting.get(setting, ()))
        schemes = [s for s in KNOBS if s in wanted]
        for scheme in schemes:
            registry.lookup("scheme", scheme)
        base_values = {
            s: float(_get(registry.load_config(s, setting), KNOBS[s])) for s in schemes
        }
        todo, where_of = [], {}
        for scheme in schemes:
            for f in factors:
                value = base_values[scheme] * f
                where = workdir / setting / scheme / f"tune_{value:g}"
                todo.append((config_of(scheme, setting, tune_seed, value), where))
                where_of[(scheme, value)] = where
        log(f"{setting}: tuning {len(schemes)} schemes at {len(factors)} step sizes")
        done = runs(todo)
        tuning[setting] = {}
        for scheme in schemes:
            tried = {
                value: done[where]["summary"]
                for (s, value), where in where_of.items()
                if s == scheme
            }
            chosen = choose(tried)
            tuning[setting][scheme] = {
                "chosen": chosen,
                "tried": {
                    f"{v:g}": {
                        "time": s["time_to_target"],
                        "best_accuracy": s["best_accuracy"],
                        "diverged": s.get("diverged_at") is not None,
                    }
                    for v, s in tried.items()
                },
            }
        todo = []
        for scheme in schemes:
            value = tuning[setting][scheme]["chosen"]
            for seed in seeds:
                where = workdir / setting / scheme / f"seed_{seed}"
                todo.append((config_of(scheme, setting, seed, value), where))
        log(f"{setting}: {len(schemes)} schemes x {len(seeds)} seeds")
        done = runs(todo)
        for scheme in schemes:
            summaries = [
                done[workdir / setting / scheme / f"seed_{seed}"]["summary"]
                for seed in seeds
            ]
            table[(setting, scheme)] = {
                "stats": _stats(summaries),
                "summaries": summaries,
            }

    out_claims = []
    for c in claims:
        entry = {**dataclasses.asdict(c), "settings": {}}
        for setting in settings:
            m, b = table.get((setting, c.method)), table.get((setting, c.baseline))
            if m is None or b is None:
                continue
            entry["settings"][setting] = {
                "method": m["stats"],
                "baseline": b["stats"],
                "chosen_method": tuning[setting][c.method]["chosen"],
                "chosen_baseline": tuning[setting][c.baseline]["chosen"],
                "verdict": verdict(c, m["stats"], b["stats"]),
            }
        out_claims.append(entry)
    return {
        "settings": list(settings),
        "seeds": seeds,
        "tune_seed": tune_seed,
        "factors": factors,
        "tuning": tuning,
        "claims": out_claims,
        "runs": {
            f"{setting}/{scheme}": v["summaries"]
            for (setting, scheme), v in table.items()
        },
    }


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Where the runs go (kept between calls).")
    flags.DEFINE_list("settings", ["sim8", "sim8_slowlink", "sim32"], "Settings.")
    flags.DEFINE_list("seeds", ["1", "2", "3"], "Seeds of the table.")
    flags.DEFINE_integer("tune_seed", 0, "Seed of the tuning runs.")
    flags.DEFINE_list("factors", ["0.5", "1", "2"], "Step sizes tried (x config's).")
    flags.DEFINE_list(
        "schemes",
        None,
        "Schemes to run (claims missing one are left out); all by default. "
        "SETTING=a+b+c entries restrict one setting.",
    )
    flags.DEFINE_integer("jobs", 1, "Runs at once.")
    flags.DEFINE_float("budget", None, "Every run's budget instead of the setting's.")
    flags.DEFINE_bool("render_only", False, "Rebuild the table from finished runs.")
    flags.DEFINE_string("out", None, "Also write the JSON result here.")
    flags.mark_flag_as_required("workdir")


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


_PROG = "frontier"


def main(argv):
    if len(argv) > 1:
        _cli.fail(_PROG, f"unexpected arguments: {' '.join(argv[1:])}")
    quiet_backend_probe()
    logging.set_verbosity(logging.INFO)
    values = flags.FLAGS
    try:
        result = run_frontier(
            values.workdir,
            settings=values.settings,
            seeds=[int(s) for s in values.seeds],
            tune_seed=values.tune_seed,
            factors=[float(f) for f in values.factors],
            schemes_by_setting=_schemes_by_setting(values.schemes, values.settings),
            jobs=values.jobs,
            budget_seconds=values.budget,
            render_only=values.render_only,
        )
    except ValueError as e:
        _cli.fail(_PROG, str(e))
    text = format_frontier(result)
    workdir = pathlib.Path(values.workdir)
    (workdir / "frontier.md").write_text(text)
    payload = json.dumps(result, indent=1) + "\n"
    (workdir / "frontier.json").write_text(payload)
    if values.out:
        pathlib.Path(values.out).write_text(payload)
    print(text)


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=_cli.flags_parser(_PROG))
