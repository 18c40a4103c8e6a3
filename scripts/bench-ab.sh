#!/usr/bin/env bash
# Compares two builds of the bench, process by process: for each round, each build runs
# workload (a) (one run) and workload (b) (concurrent runs) at synchronous=FULL as a fresh
# process on a fresh database, the order of the builds alternating from round to round.
# Prints one line per measurement, then the medians and spreads of each build.
#
#   scripts/bench-ab.sh OLD_BENCH NEW_BENCH [ROUNDS] [STEPS] [RUNS]
#
# OLD_BENCH and NEW_BENCH are release binaries of examples/bench.rs, e.g. built with
# `cargo build --release --example bench` in a `git worktree` of the older commit and here.
set -euo pipefail
old=$1 new=$2 rounds=${3:-7} steps=${4:-500} runs=${5:-50}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

measure() { # build-label binary
    local label=$1 bin=$2
    "$bin" --only a --rounds 1 --steps "$steps" --sync full |
        grep '"a_one_run"' | sed "s/^/$label a /" >>"$out"
    "$bin" --only b --rounds 1 --runs "$runs" --sync full |
        grep '"b_concurrent"' | sed "s/^/$label b /" >>"$out"
}

for round in $(seq 1 "$rounds"); do
    if ((round % 2)); then
        measure old "$old"
        measure new "$new"
    else
        measure new "$new"
        measure old "$old"
    fi
    echo "round $round done" >&2
done
cat "$out"
python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    label, workload, doc = line.split(" ", 2)
    doc = json.loads(doc)
    if workload == "a":
        value, ratio = doc["agentrt_steps_per_s"], doc["ratio"]
    else:
        value, ratio = doc["group_commit_steps_per_s"], doc["ratio"]
    rows.setdefault((workload, label), []).append((value, ratio))
for workload in ("a", "b"):
    for label in ("old", "new"):
        values = rows.get((workload, label), [])
        steps = [v for v, _ in values]
        ratios = [r for _, r in values]
        print(f"{workload} {label}: steps/s median {statistics.median(steps):.0f} "
              f"({min(steps):.0f} to {max(steps):.0f}); ratio to the in-process baseline "
              f"median {statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})")
PY
