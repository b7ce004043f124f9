#!/usr/bin/env python3
"""Plots zero's JSONL metrics (train_gpt --metrics) as PNG figures.

Each input file is one run (a line per printed step: loss, lr, tokens_per_s, model_state_bytes,
and with the observability sections wall_clock and memory; other lines, such as the flops
profile's, are skipped). One figure holds four panels over steps: loss, learning rate,
tokens/s and memory (model states, activation peak and RSS when present); each run is a curve,
labelled by its file name or by --label.

  python3 scripts/plot_metrics.py run.jsonl [other.jsonl ...] -o metrics.png [--label a b]

Needs matplotlib (Debian: python3-matplotlib; scripts/install-deps.sh installs it).
"""
import argparse
import json
import os
import sys


def read_run(path):
    """The step lines of a JSONL file, as a list of dicts with a 'step' and a 'loss'."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"plot_metrics: {path}:{number}: not JSON ({e})")
            if "step" in row and "loss" in row:
                rows.append(row)
    if not rows:
        raise SystemExit(f"plot_metrics: {path}: no step lines with a loss")
    return rows


def series(rows, *keys):
    """(steps, values) of rows[key1][key2]..., skipping rows without it."""
    xs, ys = [], []
    for row in rows:
        value = row
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            xs.append(row["step"])
            ys.append(value)
    return xs, ys


def plot(runs, labels, output):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    (loss_ax, lr_ax), (speed_ax, mem_ax) = axes
    for rows, label in zip(runs, labels):
        loss_ax.plot(*series(rows, "loss"), label=label)
        lr_ax.plot(*series(rows, "lr"), label=label)
        speed_ax.plot(*series(rows, "tokens_per_s"), label=label)
        for keys, name in ((("model_state_bytes",), "model states"),
                           (("activation_peak_bytes",), "activations peak"),
                           (("memory", "rss"), "RSS")):
            xs, ys = series(rows, *keys)
            if xs:
                mem_ax.plot(xs, [y / 1e6 for y in ys], label=f"{label}: {name}")
    loss_ax.set(title="loss", xlabel="step", ylabel="loss")
    lr_ax.set(title="learning rate", xlabel="step", ylabel="lr")
    speed_ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    # RSS (the activation arena reserved up front) dwarfs the model states: a log scale shows both
    mem_ax.set(title="memory (rank 0)", xlabel="step", ylabel="MB (log scale)", yscale="log")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="JSONL metrics files, one per run")
    p.add_argument("-o", "--output", default="metrics.png", help="PNG to write")
    p.add_argument("--label", nargs="*", help="a label per file (default: file names)")
    args = p.parse_args(argv)
    labels = args.label or [os.path.splitext(os.path.basename(f))[0] for f in args.files]
    if len(labels) != len(args.files):
        raise SystemExit(f"plot_metrics: {len(labels)} labels for {len(args.files)} files")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("plot_metrics: needs matplotlib (Debian: apt-get install python3-matplotlib)")
    plot([read_run(f) for f in args.files], labels, args.output)
    print(f"plot_metrics: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
