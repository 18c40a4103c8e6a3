#!/usr/bin/env bash
# Traces one process of the bench's fresh mode with `perf trace` and tells, for its first run
# and for each warm run: the syncs of the write-ahead log (count, per step, median and p90
# time, by thread and call), the log writes that extend the file (past its end) against those
# that rewrite it, the log's size, and the database file's syncs (checkpoints).
# The process marks the start of each run with a getppid call.
#
#   scripts/fresh-trace.sh [BENCH] [a|b] [WARM]
set -euo pipefail
bin=${1:-target/release/examples/bench} workload=${2:-a} warm=${3:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
perf trace -e openat,close,getppid,pwrite64,pwritev,fdatasync,fsync,ftruncate -o "$out/trace" -- \
    "$bin" --fresh-child "$workload" --warm "$warm"
python3 - "$out/trace" <<'PY'
import re, statistics, sys
line_re = re.compile(r'^\s*([\d.]+) \(\s*([\d.]+) ms\): (\S+)/(\d+) (\w+)\((.*)\)\s+=\s*(-?\d*)')
paths, ends, rounds, round_ = {}, {}, {}, None
for line in open(sys.argv[1]):
    m = line_re.match(line)
    if not m:
        continue
    at, took, thread, tid, call, args, ret = m.groups()
    took, ret = float(took) * 1000, int(ret or 0)
    if call == 'getppid':
        round_ = 0 if round_ is None else round_ + 1
        continue
    fd = re.match(r'fd: (\d+)(?:<([^>]*)>)?', args)
    if not fd:
        continue
    if fd.group(2):
        paths[fd.group(1)] = fd.group(2)
    if call == 'close':
        paths.pop(fd.group(1), None)
        continue
    path = paths.get(fd.group(1), '?')
    kind = 'log' if path.endswith('fresh.db-wal') else 'db' if path.endswith('fresh.db') else None
    if kind is None:
        continue
    if round_ is None:
        # Before the first run (the store's open): only the log's size, which the open may
        # have extended.
        if call.startswith('pwrite') and kind == 'log':
            pos = re.search(r'pos: (\d+)', args)
            ends['log'] = max(ends.get('log', 0), (int(pos.group(1)) if pos else 0) + ret)
        continue
    s = rounds.setdefault(round_, dict(syncs={}, writes=0, extending=0, bytes=0, start=None))
    if call in ('fdatasync', 'fsync'):
        s['syncs'].setdefault((kind, call, thread), []).append(took)
    elif call.startswith('pwrite') and kind == 'log':
        pos = re.search(r'pos: (\d+)', args)
        end = (int(pos.group(1)) if pos else 0) + ret
        s['writes'] += 1
        s['bytes'] += ret
        if s['start'] is None:
            s['start'] = ends.get('log', 0)
        if end > ends.get('log', 0):
            s['extending'] += 1
            ends['log'] = end
        s['end'] = ends.get('log', 0)
    elif call == 'ftruncate' and kind == 'log':
        ends['log'] = int(re.search(r'length: (\d+)', args).group(1))
for r, s in sorted(rounds.items()):
    print(f"{'first' if r == 0 else f'warm {r}'} run: log writes {s['writes']} "
          f"({s['extending']} past the end of the file), {s['bytes'] / 4120:.0f} frames; "
          f"log size {s['start']} -> {s.get('end')} bytes")
    for (kind, call, thread), times in sorted(s['syncs'].items()):
        times.sort()
        print(f"  {kind} {call} on {thread}: {len(times)}, median {statistics.median(times):.0f} us, "
              f"p90 {times[int(0.9 * (len(times) - 1))]:.0f} us")
PY
