"""Does step-level credit assignment matter more on longer chains? VinePPO, GRPO, PPO side by side.

    python compare.py  # the experiment: chains of 6-8 and 10-12 steps, vineppo, grpo, ppo x 3 seeds
    # a quick look:
    python compare.py --chains 6-8 --seeds 0 --iterations 2 --algos vineppo,grpo --jobs 1

For each chain length (`--arith-steps` of the built-in task, with `--arith-traps`): one SFT start
(`train.py --iterations 0`), then every method and seed from that checkpoint with the demo's
settings, so the methods differ only in how they assign credit; the chain lengths run side by
side, one process and one torch thread each (--jobs). A finished run in --out is reused when
its config.json is what would run now; one of other settings is refused (--overwrite reruns it).
Prints,
per chain length, method and accuracy (at T = 0.35 and greedy): held-out accuracy at the start
and at the end (mean and standard error over seeds), training seconds, and the accuracy each
method had reached when the fastest one finished (equal wall-clock); then VinePPO's lead over
each other method at equal iterations and at equal wall-clock, and its change with the chain length.
With --seconds, every run trains for that many seconds instead (--iterations is then a cap), and the
methods are compared at equal wall-clock only, at half, three quarters and all of the budget.
With matplotlib installed, also writes the learning curves to OUT/curves.png.
"""
import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

import torch

import ppo
import train
from engineering import checkpoint, models, outputs, settings

HERE = os.path.dirname(os.path.abspath(__file__))


def run(out: str, *args, seconds: float = 0.0):
    """Run train.py to completion, unless `out` holds a finished run of the same settings
    (its `finished` mark; one of other settings is run again: --overwrite, check_reuse).
    With `seconds`, stop it (SIGTERM) once its logged training seconds reach them
    (--eval-every 1: that row is evaluated)."""
    mark = os.path.join(out, outputs.FINISHED)
    if os.path.exists(mark):
        if not difference(out, args, seconds):
            return
        os.remove(mark)  # not finished until it has run again
    # leftovers of an unfinished run are replaced
    train_py = os.path.join(HERE, "train.py")
    child = subprocess.Popen([sys.executable, train_py, *train_argv(out, *args)])
    while child.poll() is None:
        if seconds and training_seconds(out) >= seconds:
            child.terminate()  # train.py exits 143 on SIGTERM, its metrics so far logged
            child.wait()
            break
        time.sleep(2)
    else:
        if child.returncode:  # the run has said why in its own line: stop with its exit status
            sys.exit(child.returncode)
    if not os.path.isdir(out):  # train.py ended well but wrote no run: nothing to mark finished
        sys.exit(print(f"error: train.py ended without writing its run to {out!r}",
                       file=sys.stderr) or 1)
    with open(mark, "w") as f:
        json.dump({"seconds": seconds}, f)


def difference(out: str, args, seconds: float) -> str:
    """How the finished run in `out` differs from train.py `args` run for `seconds` now ('' if
    it does not): the first setting its config.json, or its mark (--seconds), records otherwise."""
    written = outputs.run_settings(out)
    if written is None:
        return "no config.json of a run's settings"
    if "history" in written:
        return "settings changed on --resume (its config.json's history)"
    with contextlib.redirect_stderr(io.StringIO()):  # what the run ignores: said by the run
        cfg = train.parse_args(train_argv(out, *args))
    auto = "cuda" if torch.cuda.is_available() else "cpu"  # as train.py resolves them
    device = torch.device(auto if cfg.device == "auto" else cfg.device)
    now = {**vars(cfg), "data_files": checkpoint.data_files(cfg), "seconds": seconds,
           "precision": cfg.precision or models.default_precision(device)}
    try:
        with open(os.path.join(out, outputs.FINISHED)) as f:
            written["seconds"] = json.load(f)["seconds"]
    except (ValueError, TypeError, KeyError):
        return "a finished mark of an older compare.py, without its --seconds"
    for key in sorted(set(now) | set(written)):
        if key not in ("out", "overwrite", "resume") and written.get(key) != now.get(key):
            return f"--{key.replace('_', '-')} {written.get(key)!r}, not {now.get(key)!r}"
    return ""


def check_reuse(runs: list, overwrite: bool):
    """Every finished run in `runs` ((out, train.py flags, seconds)) has the settings it would
    be run with now, or --overwrite runs it again; else one line and exit 2, before any run."""
    for out, args, seconds in runs:
        differs = os.path.exists(os.path.join(out, outputs.FINISHED)) and difference(out, args,
                                                                                     seconds)
        if differs and not overwrite:
            sys.exit(print(f"error: {out} holds a finished run of other settings ({differs}): "
                           "pass --overwrite to run it again, or choose another --out",
                           file=sys.stderr) or 2)


def planned(args, chains: str, seeds: list[int], methods: dict) -> list[tuple]:
    """A chain length's runs, in order: (method or '' for its SFT start, out, train.py flags,
    seconds). Methods interleaved, so a machine's changing load touches all of them alike."""
    base = os.path.join(args.out, f"chains{chains}")
    sft = ("", os.path.join(base, "sft"),
           ["--iterations", "0", *as_flags(task_settings(args, chains))], 0.0)  # the demo's SFT
    return [sft] + [(name, os.path.join(base, f"{name}-seed{seed}"),
                     rl_flags(args, chains, seed, flags), args.seconds)
                    for seed in seeds for name, flags in methods.items()]


def train_argv(out: str, *args) -> list[str]:
    """train.py's command line for a run in `out`: every run replaces an unfinished one there."""
    return ["--out", out, "--overwrite", *args]


def training_seconds(out: str) -> float:
    """The training seconds (evaluation excluded) of a run's complete metrics.jsonl rows so far."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            # a last line without its newline is still being written
            lines = f.read().split("\n")[:-1]
    except FileNotFoundError:
        return 0.0
    return sum(json.loads(line).get("seconds", 0.0) for line in lines if line)


def curve(out: str, metric: str = "eval_accuracy") -> list[tuple[int, float, float]]:
    """(iteration, training seconds so far, held-out accuracy) at every evaluation of a run; the
    seconds are train.py's per-iteration times, evaluation excluded. metric: eval_accuracy (at
    T = 0.35) or eval_greedy_accuracy."""
    points, seconds = [], 0.0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        seconds += row.get("seconds", 0.0)
        if metric in row:
            points.append((row["iteration"], seconds, row[metric]))
    return points


def accuracy_at(points, seconds: float) -> float:
    """The accuracy of the last evaluation done within `seconds` of training."""
    return [acc for _, t, acc in points if t <= seconds + 1e-9][-1]


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return statistics.mean(values), se


def summarize(curves: dict, budget: float = 0.0) -> dict:
    """curves[algo] = one curve per seed -> per algo: start, final, seconds, accuracy at equal
    time (at `budget` seconds; 0: when the fastest method finished) and its lag: the most that
    budget is ahead of the evaluation it takes, as a fraction of the budget."""
    budget = budget or min(statistics.mean(c[-1][1] for c in runs) for runs in curves.values())
    lag = lambda c: ((budget - [t for _, t, _ in c if t <= budget + 1e-9][-1]) / budget
                     if budget else 0.0)
    return {algo: {"start": mean_se([c[0][2] for c in runs]),
                   "final": mean_se([c[-1][2] for c in runs]),
                   "seconds": statistics.mean(c[-1][1] for c in runs), "budget": budget,
                   "iterations": statistics.mean(c[-1][0] for c in runs),
                   "at_budget": mean_se([accuracy_at(c, budget) for c in runs]),
                   "lag": max(map(lag, runs))}
            for algo, runs in curves.items()}


def lead(summary: dict, mine: str, other: str, key: str) -> tuple[float, float]:
    """`mine`'s lead over `other` in summary[..][key] (final or at_budget), ± the standard errors
    combined."""
    (v, v_se), (o, o_se) = summary[mine][key], summary[other][key]
    return v - o, (v_se ** 2 + o_se ** 2) ** 0.5


def verdict(m_se: tuple[float, float]) -> str:
    """The counting rule fixed before the experiments.
    A difference counts beyond twice its standard error."""
    m, se = m_se
    return "counts" if m > 2 * se else "counts against" if m < -2 * se else "within noise"


def report(results: dict, metric: str, equal_time_only: bool = False):
    cell = lambda m_se: f"{m_se[0]:.3f} ± {m_se[1]:.3f}"
    for chains, summary in results.items():
        print(f"\n{metric}, chains of {chains} steps (mean ± s.e. over seeds)")
        print(f"{'method':8} {'start':>12} {'final':>12} {'seconds':>8} {'iterations':>10} "
              f"{'at equal time':>16}")
        for algo, s in summary.items():
            print(f"{algo:8} {cell(s['start']):>12} {cell(s['final']):>12} {s['seconds']:>8.0f} "
                  f"{s['iterations']:>10.1f} "
                  f"{cell(s['at_budget']):>16}  (at {s['budget']:.0f} s, "
                  f"evaluated up to {s['lag']:.0%} before)")
    first, last = list(results)[0], list(results)[-1]
    methods = list(results[first])
    vine = [m for m in methods if m.startswith("vineppo")]  # VinePPO and its variant (--variant)
    pairs = [(m, o) for i, m in enumerate(vine) for o in methods if o != m and o not in vine[:i]]
    for mine, other in pairs:
        for key, words in (("final", "at equal iterations"),
                           ("at_budget", "at equal wall-clock"))[equal_time_only:]:
            leads = {chains: lead(summary, mine, other, key) for chains, summary in results.items()}
            growth = (leads[last][0] - leads[first][0],
                      (leads[last][1] ** 2 + leads[first][1] ** 2) ** 0.5)
            print(f"{metric}: {mine}'s lead over {other} {words}: "
                  + ", ".join(f"{c}: {cell(m_se)} ({verdict(m_se)})" for c, m_se in leads.items())
                  + (f"; growth {cell(growth)} ({verdict(growth)})" if first != last else ""))


def on_grid(runs: list, points: int = 60) -> tuple[list, list, list, list]:
    """Seconds 0 .. the shortest run's last evaluation in `points` steps, and at each the accuracy
    of every seed's last evaluation by then: (seconds, mean, least, most) over the seeds."""
    end = min(c[-1][1] for c in runs)
    grid = [end * i / (points - 1) for i in range(points)]
    accs = [[accuracy_at(c, t) for c in runs] for t in grid]
    return grid, [statistics.mean(a) for a in accs], [min(a) for a in accs], [max(a) for a in accs]


def plot(curves: dict, path: str):
    """Held-out accuracy (at T = 0.35 and greedy) against iteration and against training seconds
    (each seed's last evaluation by then): a row per chain length, a line per method (the mean
    over seeds) with the seeds' range shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    chain_lengths = list(next(iter(curves.values())))
    fig, axes = plt.subplots(len(chain_lengths), 4, figsize=(16, 3.2 * len(chain_lengths)),
                             squeeze=False)
    for row, chains in zip(axes, chain_lengths):
        for (by_iteration, by_seconds), (metric, by_chains) in zip(
                (row[:2], row[2:]), curves.items()):
            for algo, runs in by_chains[chains].items():
                # per evaluation, one per seed
                accs = list(zip(*[[acc for _, _, acc in c] for c in runs]))
                line, = by_iteration.plot([it for it, _, _ in runs[0]][:len(accs)],
                                          [statistics.mean(a) for a in accs], marker="o",
                                          markersize=3, label=algo)
                by_iteration.fill_between([it for it, _, _ in runs[0]][:len(accs)],
                                          [min(a) for a in accs], [max(a) for a in accs],
                                          alpha=0.2, color=line.get_color())
                grid, mean, least, most = on_grid(runs)
                by_seconds.plot(grid, mean, color=line.get_color(), label=algo)
                by_seconds.fill_between(grid, least, most, alpha=0.2, color=line.get_color())
            by_iteration.set(xlabel="iteration",
                             ylabel=f"{METRICS[metric]}\nchains of {chains} steps")
            by_seconds.set(xlabel="training seconds")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


METRICS = {"eval_accuracy": "accuracy at T = 0.35", "eval_greedy_accuracy": "greedy accuracy"}


def as_flags(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def task_settings(args, chains: str) -> dict:
    """The task of a chain length, the same for its SFT start and for every RL run from it."""
    return {"arith_steps": chains, "arith_traps": args.traps, "arith_slip": args.slip,
            "max_new_tokens": max(train.DEMO["max_new_tokens"], 7 * int(chains.split("-")[1]) + 16)}


def rl_flags(args, chains: str, seed: int, flags: list[str]) -> list[str]:
    """One RL run's train.py flags, from its chain length's SFT checkpoint.
    The demo's settings first, then the method's own flags, which override them.
    """
    settings = {**train.DEMO, **task_settings(args, chains), "iterations": args.iterations,
                "sft_steps": 0, "eval_every": args.eval_every, "eval_problems": args.eval_problems}
    sft = os.path.join(args.out, f"chains{chains}", "sft", "checkpoint")
    return ["--model", sft, "--seed", str(seed), *as_flags(settings), *flags]


# compare.py gives every run these: a variant that gave one would lose, mix or mislabel runs
OWNED = ("--out", "--seed", "--algo", "--overwrite", "--resume")


def train_refusal(argv: list[str]) -> str:
    """Why train.py would refuse this command line at once ('' if it would not).
    Its own parse_args decides; what it prints is kept, not shown.
    """
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            train.parse_args(argv)
    except SystemExit as stop:
        lines = said.getvalue().strip().splitlines()
        if stop.code == 0 or not lines:  # --help: train.py would print it and exit
            return "FLAGS would make train.py print its help, not run"
        return lines[-1].removeprefix("error: ")
    return ""


def variant(text: str, methods: dict, error) -> tuple[str, list[str]]:
    """A --variant NAME=FLAGS: (NAME, its train.py flags), or one line and exit 2.
    NAME is a folder name under --out; it begins with its algorithm (NAME-...).
    FLAGS are split as a shell splits them; compare.py's own flags are refused.
    """
    name, _, flags = text.partition("=")
    algo = name.split("-")[0]
    if algo not in ppo.ALGOS or not flags.strip():
        error(f"--variant {text!r}: expected NAME=FLAGS with NAME beginning with one of "
              + ", ".join(ppo.ALGOS) + " (not one of --algos), FLAGS train.py's")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
        error(f"--variant {text!r}: NAME {name!r} names the runs' folders in --out: "
              "letters, digits, '-', '_' and '.' only, no '..'")
    if name in methods:
        error(f"--variant {text!r}: expected a NAME of its own, {name!r} is a duplicate "
              "(of --algos or an earlier --variant)")
    try:
        words = shlex.split(flags)
    except ValueError as e:  # "No closing quotation"
        error(f"--variant {text!r}: FLAGS, split as a shell does: {e}")
    owned = [flag for flag in settings.given_flags(train.Config, words) if flag in OWNED]
    if owned:
        error(f"--variant {text!r}: {', '.join(owned)}: compare.py's own; it gives every run "
              "its --out, --seed, --algo (NAME's) and --overwrite")
    return name, ["--algo", algo, *words]


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="compare",
                   help="directory for all runs (a finished run is reused when its settings are "
                        "those of this command)")
    p.add_argument("--overwrite", action="store_true",
                   help="run again a finished run of other settings (else refused)")
    p.add_argument("--chains", default="6-8,10-12", help="comma-separated --arith-steps settings")
    p.add_argument("--traps", default="0-2", help="--arith-traps of every run ('': the plain task)")
    p.add_argument("--slip", type=float, default=0.7, help="--arith-slip of the SFT demonstrations")
    p.add_argument("--algos", default="vineppo,grpo,ppo")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=FLAGS, repeatable: one more method, the algorithm NAME begins with "
                   "(NAME-...) with these train.py flags (they override the shared settings), "
                   "e.g. 'vineppo-reuse=--mc-reuse --mc-top-up' or "
                   "'grpo-16=--samples-per-prompt 16'; quoted as in a shell; "
                   "--out, --seed, --algo, --overwrite and --resume are compare.py's")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    p.add_argument("--iterations", type=int, default=12,
                   help="iterations per run (with --seconds: at most)")
    p.add_argument("--seconds", type=float, default=0,
                   help="training seconds per run (evaluation excluded): each stops at the first "
                   "iteration that reaches them; compared at them (0: iterations)")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-problems", type=int, default=200,
                   help="held-out problems per evaluation")
    p.add_argument("--jobs", type=int, default=2,
                   help="chain lengths run side by side, one torch thread each")
    return p


def parse_args(argv=None):
    """(args, seeds, chain lengths, {method: its train.py flags}), each checked: one line and
    exit 2 if not."""
    p = command_line()
    # one line, no usage
    p.error = lambda message: sys.exit(print(f"error: {message}", file=sys.stderr) or 2)
    args = p.parse_args(argv)
    if not all(s.isdigit() for s in args.seeds.split(",")):
        p.error(f"--seeds {args.seeds!r}: expected comma-separated integers >= 0")
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(set(seeds)) < len(seeds):  # one run counted twice, as if two seeds agreed
        p.error(f"--seeds {args.seeds!r}: a seed given twice; expected distinct seeds")
    chain_lengths = args.chains.split(",")
    # train.py's own rules for --arith-steps, once here rather than in each run
    for chains in chain_lengths:
        (test, expected), most = train.STEPS, 8 if not args.traps else float("inf")
        if not test(chains) or int(chains.split("-")[1]) > most:
            p.error(f"--chains {args.chains!r}: expected comma-separated {expected}"
                    + (", at most 8 steps without --traps" if not args.traps else ""))
    if not train.TRAPS[0](args.traps):
        p.error(f"--traps {args.traps!r}: expected {train.TRAPS[1]}")
    if not 0 <= args.slip <= 1:
        p.error(f"--slip {args.slip}: expected between 0 and 1")
    if not (math.isfinite(args.seconds) and args.seconds >= 0):
        p.error(f"--seconds {args.seconds}: expected a number of seconds >= 0")
    for name in ("iterations", "eval_every", "eval_problems", "jobs"):
        if getattr(args, name) < (1 if name == "jobs" else 0):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: "
                    f"expected >= {1 if name == 'jobs' else 0}")
    algos = args.algos.split(",")
    if not all(algo in ppo.ALGOS for algo in algos) or len(set(algos)) < len(algos):
        p.error(f"--algos {args.algos!r}: expected distinct names of {', '.join(ppo.ALGOS)}, "
                "comma-separated")
    methods = {algo: ["--algo", algo] for algo in algos}  # name -> its train.py flags
    for text in args.variant:  # each checked in full here, before the SFT start runs
        name, flags = variant(text, methods, p.error)
        for chains in chain_lengths:  # train.py's own check of the variant's runs
            out = os.path.join(args.out, f"chains{chains}", f"{name}-seed{seeds[0]}")
            refused = train_refusal(train_argv(out, *rl_flags(args, chains, seeds[0], flags)))
            if refused:
                p.error(f"--variant {text!r}: {refused}")
        methods[name] = flags
    return args, seeds, chain_lengths, methods


def main():
    args, seeds, chain_lengths, methods = parse_args()
    plans = {chains: planned(args, chains, seeds, methods) for chains in chain_lengths}
    check_reuse([plan[1:] for runs in plans.values() for plan in runs], args.overwrite)
    # one process per chain length; then report from their runs
    if args.jobs > 1 and len(chain_lengths) > 1:
        os.makedirs(args.out, exist_ok=True)
        logs = [open(os.path.join(args.out, f"chains{c}.log"), "w") for c in chain_lengths]
        children = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:],
                                      "--chains", c, "--jobs", "1"],
                                     env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     stdout=log, stderr=log)
                    for c, log in zip(chain_lengths, logs)]
        if any(child.wait() for child in children):
            sys.exit(f"a chain length's runs failed: see {args.out}/chains*.log")
        print(f"runs done (logs: {args.out}/chains*.log)")

    curves = {metric: {} for metric in METRICS}
    for chains in chain_lengths:
        runs = {name: [] for name in methods}
        for name, out, flags, seconds in plans[chains]:
            run(out, *flags, seconds=seconds)
            if name:  # not the SFT start
                runs[name].append(out)
        for metric in METRICS:
            curves[metric][chains] = {algo: [curve(out, metric) for out in outs]
                                      for algo, outs in runs.items()}
    # --seconds: 3 points
    for budget in [args.seconds * f for f in (0.5, 0.75, 1)] if args.seconds else [0]:
        for metric, by_chains in curves.items():
            report({chains: summarize(by_algo, budget) for chains, by_algo in by_chains.items()},
                   METRICS[metric], equal_time_only=budget > 0)
    try:
        plot(curves, os.path.join(args.out, "curves.png"))
        print(f"\nlearning curves: {os.path.join(args.out, 'curves.png')}")
    except ImportError:
        print("\n(pip install matplotlib for the learning-curve figure)")


if __name__ == "__main__":
    main()
