"""VinePPO, PPO, TPPO and GRPO side by side on the built-in task: one SFT start, same seeds.

    python compare.py --iterations 16                  # 4 methods x 3 seeds: the README's table
    python compare.py --seeds 0 --iterations 8         # a quick look

Each run is `train.py` with the demo's settings, started from one shared SFT checkpoint, so
the methods differ only in how they assign credit. Prints, per method: final held-out accuracy
(mean and spread over seeds), wall-clock seconds, and the first evaluated iteration at which
the seed-averaged accuracy reached PPO's best.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import config

HERE = os.path.dirname(os.path.abspath(__file__))


def run(out: str, *args) -> float:
    """Run train.py to completion (or reuse a finished run in `out`); returns wall-clock seconds."""
    done = os.path.join(out, "seconds.txt")
    if not os.path.exists(done):
        start = time.time()
        # no seconds.txt: the run never finished, so whatever it left in `out` is replaced
        subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--out", out, "--overwrite", *args],
                       check=True)
        with open(done, "w") as f:
            f.write(str(time.time() - start))
    return float(open(done).read())


def accuracy_curve(out: str) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["iteration"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="compare", help="directory for all runs (finished runs are reused)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    p.add_argument("--algos", default="vineppo,ppo,tppo,grpo")
    p.add_argument("--iterations", type=int, default=config.DEMO["iterations"])
    p.add_argument("--eval-every", type=int, default=4)
    args = p.parse_args()
    seeds, algos = [int(s) for s in args.seeds.split(",")], args.algos.split(",")

    run(os.path.join(args.out, "sft"), "--iterations", "0")  # the demo's SFT warm start, once
    start = os.path.join(args.out, "sft", "checkpoint")
    settings = {**config.DEMO, "iterations": args.iterations, "sft_steps": 0, "eval_every": args.eval_every}
    flags = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    curves, seconds = {}, {}
    for algo in algos:
        for seed in seeds:
            out = os.path.join(args.out, f"{algo}-seed{seed}")
            seconds[algo, seed] = run(out, "--model", start, "--algo", algo, "--seed", str(seed), *flags)
            curves[algo, seed] = accuracy_curve(out)

    mean_curve = {a: {it: statistics.mean(curves[a, s][it] for s in seeds) for it in curves[a, seeds[0]]} for a in algos}
    target = max(mean_curve["ppo"].values()) if "ppo" in algos else None
    print(f"\n{len(seeds)} seeds, {args.iterations} iterations, SFT start: accuracy {mean_curve[algos[0]][0]:.3f}")
    print(f"{'method':8} {'final acc':>10} {'spread':>8} {'seconds':>8} {'reached PPO best at':>20}")
    for a in algos:
        finals = [curves[a, s][args.iterations] for s in seeds]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        reached = next((it for it, acc in sorted(mean_curve[a].items()) if target is not None and acc >= target), None)
        wall = statistics.mean(seconds[a, s] for s in seeds)
        print(f"{a:8} {statistics.mean(finals):>10.3f} {spread:>8.3f} {wall:>8.0f} "
              f"{'never' if reached is None else f'iteration {reached}':>20}")


if __name__ == "__main__":
    main()
