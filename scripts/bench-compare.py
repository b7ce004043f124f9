#!/usr/bin/env python3
"""Runs two builds of one benchmark alternately and prints, per configuration, the median value
of each and their ratio (new / old) as JSON lines, so a change is judged against the previous
commit's binary measured in the same run on the same machine.

  python3 scripts/bench-compare.py OLD_BINARY NEW_BINARY [--rounds 3] -- [benchmark args]

--rounds is at least 1. A benchmark that exits non-zero stops the comparison: its stderr is
shown and the script exits 1.

Both binaries must print one JSON object per result line with "bench", "config" and "value"
(the benchmarks' convention); a line that starts with '{' but is not such an object (printf's
"nan" or "inf" is not JSON) is skipped with a warning. Each line gives ratio_new_over_old (null
where the old value is 0) and, where the metric's direction is known, "better" (higher or lower)
and gain: the ratio turned so that > 1 means new is better (old / new for lower-is-better
metrics). The summary is the median gain over the configurations with a direction, so times and
rates do not pull it opposite ways. Directions by unit: rates (".../s": tokens/s, GB/s, TFLOP/s)
higher; times (ns, us, ms, s) lower; ratios ("x", "ratio") higher, except a bench named
"A_vs_B", which is A's time over B's, lower.
"""
import json
import math
import statistics
import subprocess
import sys

TIME_UNITS = ("ns", "us", "ms", "s")
RATIO_UNITS = ("x", "ratio")


def direction(bench, unit):
    """'higher' or 'lower' (which values are better), or None where the unit does not say."""
    if unit.endswith("/s"):
        return "higher"
    if unit in TIME_UNITS:
        return "lower"
    if unit in RATIO_UNITS:
        # gpu_step_stage3_vs_stage0, gpt_step_vs_peer: one time over another; the speed-ups
        # (flash_attention_forward_speedup, nvme_swap_read_ratio) are the other way up.
        return "lower" if "_vs_" in bench else "higher"
    return None


def warn(message):
    print(f"bench-compare: {message}", file=sys.stderr)


def run(binary, args):
    try:
        done = subprocess.run([binary] + args, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"bench-compare: cannot run {binary}: {e.strerror}")
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        sys.exit(f"bench-compare: {binary} {' '.join(args)} exited with status {done.returncode} "
                 "(its stderr is above); nothing compared")
    rows = {}
    for number, line in enumerate(done.stdout.splitlines(), 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
            key = json.dumps({"bench": row["bench"], "config": row["config"]}, sort_keys=True)
            value = float(row["value"])
        except (ValueError, KeyError, TypeError) as e:
            warn(f"{binary}: line {number} skipped ({type(e).__name__}: {e}): {line[:200]}")
            continue
        if not math.isfinite(value):
            warn(f"{binary}: line {number} skipped (value {value}): {line[:200]}")
            continue
        if key in rows:
            warn(f"{binary}: line {number} has the bench and config of an earlier line; "
                 "the later value is kept")
        rows[key] = (value, str(row.get("unit", "")))
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
        text = argv[i + 1] if i + 1 < len(argv) else ""
        if not text.isdigit() or int(text) < 1:
            sys.exit(f"bench-compare: --rounds expects an integer >= 1, got '{text}'")
        rounds = int(text)
        del argv[i:i + 2]
    if len(argv) != 2:
        sys.exit(__doc__)
    old, new = argv
    values = {"old": {}, "new": {}}
    for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
        for name, binary in (("old", old), ("new", new)):
            for key, (value, unit) in run(binary, extra).items():
                values[name].setdefault(key, []).append((value, unit))
    gains = []
    undirected = 0
    for key in values["old"]:
        if key not in values["new"]:
            continue
        o = statistics.median(v for v, _ in values["old"][key])
        n = statistics.median(v for v, _ in values["new"][key])
        unit = values["old"][key][0][1]
        better = direction(json.loads(key)["bench"], unit)
        # No ratio to a baseline of 0: null in the line (NaN is not JSON) and out of the median.
        ratio = n / o if o else None
        gain = None
        if ratio is not None and better is not None and (better == "higher" or n):
            gain = ratio if better == "higher" else o / n
        if gain is not None:
            gains.append(gain)
        elif better is None:
            undirected += 1
        print(json.dumps({**json.loads(key), "old": o, "new": n, "unit": unit,
                          "ratio_new_over_old": None if ratio is None else round(ratio, 3),
                          "better": better, "gain": None if gain is None else round(gain, 3),
                          "rounds": rounds}))
    if gains:
        print(json.dumps({"bench": "summary", "median_gain": round(statistics.median(gains), 3),
                          "meaning": "median over configurations of new over old for higher-"
                          "is-better metrics and old over new for lower-is-better ones: > 1 "
                          "means new is better", "configs": len(gains),
                          "configs_without_direction": undirected}))


if __name__ == "__main__":
    main()
