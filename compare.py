"""Does step-level credit assignment matter more on longer chains? VinePPO, GRPO and PPO side by side.

    python compare.py                                    # the README's experiment (81 min of 1-thread runs)
    python compare.py --chains 2-5 --seeds 0 --iterations 4 --algos vineppo,grpo   # a quick look

For each chain length (`--arith-steps` of the built-in task): one SFT start (`train.py
--iterations 0`), then every method and seed from that checkpoint with the demo's settings, so
the methods differ only in how they assign credit. Finished runs in --out are reused. Prints, per
chain length and method: held-out accuracy at the start and at the end (mean and standard error
over seeds), training seconds, and the accuracy each method had reached when the fastest one
finished (equal wall-clock); then VinePPO's lead over each other method on each chain length.
With matplotlib installed, also writes the learning curves to OUT/curves.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import train

HERE = os.path.dirname(os.path.abspath(__file__))


def run(out: str, *args):
    """Run train.py to completion, unless `out` holds a finished run (its `finished` file)."""
    if not os.path.exists(os.path.join(out, "finished")):  # leftovers of an unfinished run are replaced
        subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--out", out, "--overwrite", *args],
                       check=True)
        open(os.path.join(out, "finished"), "w").close()


def curve(out: str) -> list[tuple[int, float, float]]:
    """(iteration, training seconds so far, held-out accuracy) at every evaluation of a run; the
    seconds are train.py's per-iteration times, evaluation excluded."""
    points, seconds = [], 0.0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        seconds += row.get("seconds", 0.0)
        if "eval_accuracy" in row:
            points.append((row["iteration"], seconds, row["eval_accuracy"]))
    return points


def accuracy_at(points, seconds: float) -> float:
    """The accuracy of the last evaluation done within `seconds` of training."""
    return [acc for _, t, acc in points if t <= seconds + 1e-9][-1]


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return statistics.mean(values), se


def summarize(curves: dict) -> dict:
    """curves[algo] = one curve per seed -> per algo: start, final, seconds, accuracy at equal time."""
    budget = min(statistics.mean(c[-1][1] for c in runs) for runs in curves.values())
    return {algo: {"start": mean_se([c[0][2] for c in runs]), "final": mean_se([c[-1][2] for c in runs]),
                   "seconds": statistics.mean(c[-1][1] for c in runs), "budget": budget,
                   "at_budget": mean_se([accuracy_at(c, budget) for c in runs])}
            for algo, runs in curves.items()}


def report(results: dict):
    cell = lambda m_se: f"{m_se[0]:.3f} ± {m_se[1]:.3f}"
    for chains, summary in results.items():
        print(f"\nchains of {chains} steps (mean ± s.e. over seeds)")
        print(f"{'method':8} {'start':>12} {'final':>12} {'seconds':>8} {'at equal time':>16}")
        for algo, s in summary.items():
            print(f"{algo:8} {cell(s['start']):>12} {cell(s['final']):>12} {s['seconds']:>8.0f} "
                  f"{cell(s['at_budget']):>16}  (at {s['budget']:.0f} s)")
    for other in [a for a in next(iter(results.values())) if a != "vineppo"]:
        leads = []
        for chains, summary in results.items():
            if "vineppo" in summary:
                (v, v_se), (o, o_se) = summary["vineppo"]["final"], summary[other]["final"]
                leads.append(f"{chains}: {v - o:+.3f} ± {(v_se ** 2 + o_se ** 2) ** 0.5:.3f}")
        print(f"VinePPO's final lead over {other}: " + ", ".join(leads))


def plot(curves: dict, path: str):
    """Held-out accuracy against iteration and against training seconds: a row per chain length,
    a line per method (the mean over seeds) with the seeds' range shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(curves), 2, figsize=(9, 3.2 * len(curves)), squeeze=False)
    for row, (chains, by_algo) in zip(axes, curves.items()):
        for algo, runs in by_algo.items():
            accs = list(zip(*[[acc for _, _, acc in c] for c in runs]))  # per evaluation, one per seed
            mean = [statistics.mean(a) for a in accs]
            for ax, x in zip(row, ([it for it, _, _ in runs[0]],
                                   [statistics.mean(c[i][1] for c in runs) for i in range(len(accs))])):
                line, = ax.plot(x, mean, marker="o", markersize=3, label=algo)
                ax.fill_between(x, [min(a) for a in accs], [max(a) for a in accs], alpha=0.2,
                                color=line.get_color())
        row[0].set(xlabel="iteration", ylabel=f"held-out accuracy\nchains of {chains} steps")
        row[1].set(xlabel="training seconds")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="compare", help="directory for all runs (finished runs are reused)")
    p.add_argument("--chains", default="2-3,6-8", help="comma-separated --arith-steps settings")
    p.add_argument("--algos", default="vineppo,grpo,ppo")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    p.add_argument("--iterations", type=int, default=train.DEMO["iterations"])
    p.add_argument("--eval-every", type=int, default=2)
    args = p.parse_args()
    seeds, algos = [int(s) for s in args.seeds.split(",")], args.algos.split(",")

    curves = {}
    for chains in args.chains.split(","):
        base = os.path.join(args.out, f"chains{chains}")
        run(os.path.join(base, "sft"), "--iterations", "0", "--arith-steps", chains)  # the demo's SFT, once
        settings = {**train.DEMO, "iterations": args.iterations, "sft_steps": 0, "eval_every": args.eval_every,
                    "arith_steps": chains}
        flags = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        curves[chains] = {algo: [] for algo in algos}
        for seed in seeds:  # methods interleaved, so a machine's changing load touches all of them alike
            for algo in algos:
                out = os.path.join(base, f"{algo}-seed{seed}")
                run(out, "--model", os.path.join(base, "sft", "checkpoint"), "--algo", algo, "--seed", str(seed),
                    *flags)
                curves[chains][algo].append(curve(out))
    report({chains: summarize(by_algo) for chains, by_algo in curves.items()})
    try:
        plot(curves, os.path.join(args.out, "curves.png"))
        print(f"\nlearning curves: {os.path.join(args.out, 'curves.png')}")
    except ImportError:
        print("\n(pip install matplotlib for the learning-curve figure)")


if __name__ == "__main__":
    main()
