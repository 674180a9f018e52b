#!/usr/bin/env bash
# hpsjax on a GPU machine, in one command and one table (about 15 minutes):
#
#   1. the real-device suite: BSP, H-PS, ASP and ASHL (the reference's) with
#      workers on gpu:0, cpu:4, cpu:2, cpu:1 and the server on 3 cores
#      (python -m experiments.compare --suite=devices), the MLP of digits;
#   2. the same on the language model (--suite=lm_devices);
#   3. the 30M-parameter language model's train step on the GPU and on 8 CPU
#      cores, and the H-PS plan of one GPU and two CPU workers
#      (benchmarks/bench_lm_devices.py);
#   4. the fast test suite with JAX on the GPU (pytest -m 'not slow'; the
#      docs' tests, which need the docs' tools and no GPU, left out);
#   5. the codec benchmark on the GPU (benchmarks/bench_quantize.py, 256 MiB);
#   6. the server benchmark (benchmarks/bench_ps.py --only small,fan_in) with
#      the server's state on the host CPU and on the GPU (hpsjax-server
#      --device cpu / gpu), side by side.
#
# Usage, from anywhere:
#
#   benchmarks/gpu_check.sh [OUTDIR]
#
# OUTDIR (default: a new directory under /tmp) keeps every step's log, the
# suites' tables and the benchmarks' JSON. PYTHON picks the interpreter
# (default: python3), DEVICES the suites' worker spec, DEVICE_BUDGET their
# seconds per run (default 20), WHEELS the wheel directory below, DEADLINE
# the seconds the whole check may take (default: no limit): a step is cut to
# the time left, and steps that would start with less than 20 s left are
# skipped, each marked in the table. STEPS picks the steps, by name and in the
# order below (default: all of them: devices lm_devices lm_step tests codecs
# ps); TESTS the fast suite's pytest selection (default: tests, the docs'
# tests left out) and TESTS_LIMIT its seconds (default 150).
#
# The packages the GPU image may lack (msgspec, tensorboardX,
# ...) are installed first from wheels carried in a local directory, never
# from the network: WHEELS (default: wheels/ in the repository). Fill it on a
# machine with the internet:
#
#   pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d wheels msgspec \
#       tensorboardX
#
# Without a GPU the script says so, measures nothing and exits with status 1:
# there are no GPU figures to report. A step that fails, runs past its time
# limit or is skipped is marked in the table; the exit status is then 1 too.

set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
OUT="${1:-$(mktemp -d /tmp/hpsjax-gpu-check.XXXXXX)}"
WHEELS="${WHEELS:-$REPO/wheels}"
DEVICES="${DEVICES:-gpu:0, cpu:4, cpu:2, cpu:1}"
DEVICE_BUDGET="${DEVICE_BUDGET:-20}"
DEADLINE="${DEADLINE:-0}"
ALL_STEPS="devices lm_devices lm_step tests codecs ps"
STEPS=" ${STEPS:-$ALL_STEPS} "
TESTS="${TESTS:-tests}"
TESTS_LIMIT="${TESTS_LIMIT:-150}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

say() { echo "gpu_check: $*"; }

for step_name in $STEPS; do
    if [[ " $ALL_STEPS " != *" $step_name "* ]]; then
        say "STEPS: unknown step '$step_name'; valid: $ALL_STEPS"
        exit 2
    fi
done
mkdir -p "$OUT" || exit 2

# --- 0. Dependencies: installed from local wheels only. ---------------------
# module:package pairs hpsjax, its tests and the suite import.
NEEDED="msgspec:msgspec tensorboardX:tensorboardX
msgpack:msgpack absl:absl-py prometheus_client:prometheus-client pytest:pytest
matplotlib:matplotlib optax:optax flax:flax tensorstore:tensorstore"
missing=()
for pair in $NEEDED; do
    "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ ! -d "$WHEELS" ]; then
        say "missing ${missing[*]}; put their wheels in $WHEELS (see the top of" \
            "this script) or set WHEELS"
        exit 2
    fi
    say "installing ${missing[*]} from $WHEELS (no network)"
    if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" \
        "${missing[@]}" >"$OUT/pip.log" 2>&1; then
        say "cannot install ${missing[*]} from $WHEELS; see $OUT/pip.log"
        exit 2
    fi
fi

# --- 1. Is there a GPU? ------------------------------------------------------
GPU="$("$PY" - 2>"$OUT/gpu_probe.log" <<'EOF'
import jax
try:
    gpus = jax.devices("gpu")
except RuntimeError:
    gpus = []
print(gpus[0].device_kind if gpus else "")
EOF
)"
if [ -z "$GPU" ]; then
    PLATFORMS="$("$PY" -c 'import jax; print(sorted({d.platform for d in jax.devices()}))' 2>/dev/null)"
    say "no GPU found (JAX sees ${PLATFORMS:-nothing}; JAX_PLATFORMS=${JAX_PLATFORMS:-unset});" \
        "nothing was measured and no GPU figure is written"
    exit 1
fi
say "GPU: $GPU; outputs in $OUT"
# hpsjax's commands (hpsjax-server, hpsjax-worker, ...), which some tests run:
# an editable install of this checkout, nothing fetched.
if ! command -v hpsjax-worker >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-deps --no-index --no-build-isolation \
        -e "$REPO" >"$OUT/install.log" 2>&1 ||
        say "hpsjax's commands not installed; see $OUT/install.log"
fi
# Each process takes the GPU memory it uses, not 75% of it at its start.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
XDIST=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then
    XDIST=(-n 8)
fi

status=0
rows=()
row() { rows+=("| $1 | $2 |"); }
want() { [[ "$STEPS" == *" $1 "* ]]; }

# Runs "$@" with a time limit of $1 seconds (cut to what DEADLINE leaves),
# its output in $OUT/$2.log; status 125 when too little time is left to start.
step() {
    local limit=$1 name=$2
    shift 2
    if [ "$DEADLINE" -gt 0 ]; then
        local left=$((DEADLINE - ($(date +%s) - START) - 10))
        if [ "$left" -lt 20 ]; then
            say "$name skipped: the check's DEADLINE (${DEADLINE}s) is near"
            echo "skipped" >"$OUT/$name.time"
            return 125
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$((SECONDS - t0))s" >"$OUT/$name.time"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "$name ran past ${limit}s; see $OUT/$name.log"
    elif [ "$rc" -ne 0 ]; then
        say "$name failed (status $rc); see $OUT/$name.log"
    fi
    return $rc
}

# The rows of a real-device suite's table, from its results.json.
suite_rows() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
from experiments.compare import diverged_at
from experiments.target import Target
import glob, os
path = sys.argv[1]
if os.path.isfile(path):
    summaries = json.load(open(path))["summaries"]
else:  # a suite cut at its limit: the runs it finished
    summaries = [json.load(open(p)) for p in sorted(glob.glob(
        os.path.join(os.path.dirname(path), "*", "summary.json")))]
for s in summaries:
    info = s["info"]
    when = diverged_at(s)
    target = Target.of_summary(s)
    reached = (
        f"diverged at t = {when:.1f} s" if when is not None
        else "not reached" if s["time_to_target"] is None
        else f"{s['time_to_target']:.1f} s"
    )
    rnd = ""
    if info.get("predicted_round_s") and info.get("measured_round_s"):
        rnd = (f", round predicted {info['predicted_round_s'] * 1e3:.0f} ms, "
               f"measured {info['measured_round_s'] * 1e3:.0f} ms")
    print(f"| {sys.argv[2]}: {s['scheme']} ({', '.join(info.get('placement', []))}) | "
          f"to {target.metric} {target.value:g}: {reached}, {s['updates']} versions, "
          f"idle {s['idle_fraction']:.2f}{rnd} |")
EOF
}

# One real-device suite (devices or lm_devices) and its rows.
run_suite() {
    local suite=$1
    # About 60 s of wall time a run of 15 s on one H200 machine (BENCHMARKS.md).
    step 300 "$suite" "$PY" -m experiments.compare --suite="$suite" \
        --workdir="$OUT/$suite" --devices="$DEVICES" \
        --budget="$DEVICE_BUDGET" --overwrite --formats=png
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    if [ -f "$OUT/$suite/results.json" ] || ls "$OUT/$suite"/*/summary.json >/dev/null 2>&1; then
        while IFS= read -r line; do rows+=("$line"); done \
            < <(suite_rows "$OUT/$suite/results.json" "$suite suite")
        [ -f "$OUT/$suite/results.json" ] || row "$suite suite" "cut at its limit: the runs above finished"
    else
        row "$suite suite" "no results ($(cat "$OUT/$suite.time"), status $rc)"
    fi
}

# --- 2. The real-device suites. ---------------------------------------------
want devices && run_suite devices
want lm_devices && run_suite lm_devices

# --- 3. The language model's step on the GPU and on CPU cores. --------------
if want lm_step; then
step 150 lm_step "$PY" benchmarks/bench_lm_devices.py --json "$OUT/lm_step.json"
rc=$?
[ "$rc" -eq 0 ] || status=1
if [ -f "$OUT/lm_step.json" ]; then
    while IFS= read -r line; do rows+=("$line"); done < <("$PY" - "$OUT/lm_step.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["rows"]:
    print(f"| {r['model']} step, {x['platform']} ({x['device_kind']}), batch "
          f"{x['batch']} x {r['seq_len']} | {x['step_ms']:.1f} ms, "
          f"{x['tokens_per_s']:.0f} tokens/s, {x['tflops']:.2f} TFLOP/s (6N) |")
if "gpu_over_cpu" in r:
    print(f"| {r['model']}: GPU over 8 CPU cores; H-PS plan of 1 GPU + 2 CPU "
          f"workers | {r['gpu_over_cpu']:.1f}x tokens/s at a common batch "
          f"({r['gpu_over_cpu_best']:.1f}x at each one's best); batches "
          f"{r['hps_batches']}, round {r['hps_round_s'] * 1e3:.0f} ms, idle "
          f"{r['hps_idle']:.2f} |")
EOF
)
else
    row "language model step" "no results ($(cat "$OUT/lm_step.time"), status $rc)"
fi
fi

# --- 4. The fast suite on the GPU. ------------------------------------------
# The project's addopts may ask for pytest-xdist, which the image may lack.
if want tests; then
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
step "$TESTS_LIMIT" tests "$PY" -m pytest -q -o "addopts=-ra --strict-markers" \
    -m "not slow" -rf -p no:cacheprovider -p no:benchmark "${XDIST[@]}" \
    --ignore=tests/docs $TESTS
rc=$?
summary="$(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1 | sed 's/=//g; s/^ *//')"
row "fast tests on $GPU" "${summary:-no summary (status $rc)} ($(cat "$OUT/tests.time"))"
while IFS= read -r line; do row "fast test failed on $GPU" "${line#FAILED }"; done \
    < <(grep -E '^(FAILED|ERROR) ' "$OUT/tests.log")
[ "$rc" -eq 0 ] || status=1
fi

# --- 5. The codec benchmark on the GPU. -------------------------------------
if want codecs; then
step 60 codecs "$PY" benchmarks/bench_quantize.py --size $((64 * 2**20)) --repeats 5
rc=$?
[ "$rc" -eq 0 ] || status=1
while IFS= read -r line; do rows+=("$line"); done < <("$PY" - "$OUT/codecs.log" <<'EOF'
import re, sys
# Encode then decode, against a jitted copy of the same 256 MiB.
names = r"uniform\s+8b stoch leaf|top-k 1%|powersgd rank 4 \(\S+\)"
for line in open(sys.argv[1]):
    m = re.match(rf"^({names})\s+(.*)$", line.strip())
    if m:
        cols = m.group(2).split()
        print(f"| codec {' '.join(m.group(1).split())}, 256 MiB | encode+decode "
              f"{cols[5]}x a jitted copy, {cols[6]}x fewer bytes |")
EOF
)
fi

# --- 6. The server benchmark, its state on the CPU and on the GPU. ----------
want ps && for where in cpu gpu; do
    step 60 "ps_$where" "$PY" benchmarks/bench_ps.py --only small,fan_in --quick \
        --json "$OUT/ps_$where.json" --server_args "--device $where"
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    if [ -f "$OUT/ps_$where.json" ]; then
        rows+=("$("$PY" - "$OUT/ps_$where.json" "$where" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
s, f = r["small"], r["fan_in"]
print(f"| server on {sys.argv[2]}: 1 KiB push_pull p50; 1 MiB pushes/s from 1 "
      f"client, from {f['clients']} | {s['push_pull_p50_us']:.0f} us "
      f"({s['push_pull_p50_vs_echo']:.1f}x an asyncio echo); "
      f"{f['pushes_per_s_1']:.0f}/s, {f['pushes_per_s_n']:.0f}/s |")
EOF
)")
    else
        row "server on $where" "no results (status $rc)"
    fi
done

# --- The table. -------------------------------------------------------------
echo
echo "hpsjax gpu_check on $GPU, $(date -u +%Y-%m-%d), $(nproc) CPU cores," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg), $(( $(date +%s) - START )) s"
echo
echo "| check | result |"
echo "|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
