#!/usr/bin/env bash
# tcp warm updates, this tree against another one (e.g. the commit before session-scoped transports),
# alternating on the same machine: tensorxfer-bench --json in each, ROUNDS times.
# Usage: bash benchmarks/tcp_ab.sh OLD_TREE OUT_DIR [SIZE] [DEVICE] [ROUNDS]
# Both trees must be built (python3 setup.py build_ext --inplace).  The report compares warm medians
# with setup excluded (the new tree's first update of a session connects its streams; the old tree
# connected on every update, so all of its runs count).
set -uo pipefail
old=$1 out=$2 size=${3:-8e9} dev=${4:-cpu} rounds=${5:-2}
new=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for r in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    name=$( [ "$tree" = "$new" ] && echo new || echo old )
    (cd /tmp && PYTHONPATH="$tree${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" python3 -c \
      "import sys; from tensorxfer.cli.bench import main; sys.exit(main(sys.argv[1:]))" \
      --size "$size" --repeat 5 --no-iperf --device "$dev" --json > "$out/tcp-ab-$name-$dev-$r.json")
  done
done
python3 - "$out" "$dev" <<'PY'
import glob, json, statistics, sys
out, dev = sys.argv[1], sys.argv[2]
res = {}
for name in ("old", "new"):
    warm = []
    for f in sorted(glob.glob(f"{out}/tcp-ab-{name}-{dev}-*.json")):
        d = json.load(open(f))
        warm += [r["gbps"] for r in d["runs"] if not r.get("setup")]
    res[name] = {"warm_gbps": warm, "median": statistics.median(warm) if warm else None}
res["new/old"] = res["new"]["median"] / res["old"]["median"] if res["old"]["median"] else None
print(json.dumps(res, indent=1))
json.dump(res, open(f"{out}/tcp-ab-{dev}-summary.json", "w"), indent=1)
PY
