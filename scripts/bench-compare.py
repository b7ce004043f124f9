#!/usr/bin/env python3
"""Runs two builds of one benchmark alternately and prints, per configuration, the median value
of each and their ratio (new / old) as JSON lines, so a change is judged against the previous
commit's binary measured in the same run on the same machine.

  python3 scripts/bench-compare.py OLD_BINARY NEW_BINARY [--rounds 3] -- [benchmark args]

Both binaries must print one JSON object per result line with "bench", "config" and "value"
(the benchmarks' convention). Lower values are better for times; the ratio is new / old (null
where the old value is 0, and left out of the summary's median).
"""
import json
import statistics
import subprocess
import sys


def run(binary, args):
    out = subprocess.run([binary] + args, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        key = json.dumps({"bench": row["bench"], "config": row["config"]}, sort_keys=True)
        rows[key] = (row["value"], row.get("unit", ""))
    return rows


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i:i + 2]
    if len(argv) != 2:
        sys.exit(__doc__)
    old, new = argv
    values = {"old": {}, "new": {}}
    for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
        for name, binary in (("old", old), ("new", new)):
            for key, (value, unit) in run(binary, extra).items():
                values[name].setdefault(key, []).append((value, unit))
    ratios = []
    for key in values["old"]:
        if key not in values["new"]:
            continue
        o = statistics.median(v for v, _ in values["old"][key])
        n = statistics.median(v for v, _ in values["new"][key])
        unit = values["old"][key][0][1]
        # No ratio to a baseline of 0: null in the line (NaN is not JSON) and out of the median.
        ratio = n / o if o else None
        if ratio is not None:
            ratios.append(ratio)
        print(json.dumps({**json.loads(key), "old": o, "new": n, "unit": unit,
                          "ratio_new_over_old": None if ratio is None else round(ratio, 3),
                          "rounds": rounds}))
    if ratios:
        print(json.dumps({"bench": "summary", "median_ratio_new_over_old":
                          round(statistics.median(ratios), 3), "configs": len(ratios)}))


if __name__ == "__main__":
    main()
