"""How accurate are the value estimates? The paper's analysis (VinePPO §6.4-6.5) at laptop scale.

    python diagnose.py --checkpoint out/checkpoint                  # the built-in task, CPU
    python diagnose.py --checkpoint runs/rho/checkpoint --data gsm8k --gt-rollouts 256

For held-out trajectories of the checkpoint's policy, every state s_i (prompt, then each step
boundary) gets a ground-truth value from --gt-rollouts continuations, and is estimated by:
  - mc-K: VinePPO's estimator, the mean reward of K *independent* continuations (fresh samples,
    never a subset of the ground truth's, which would flatter MC);
  - the critic saved with the checkpoint (PPO's scalar head, TPPO's tracking head or the BCE
    control), read at the last token of the state.
Reported per estimator: mean absolute error, fraction within 0.05, MAE by step position
(early/middle/late third), pairwise ranking accuracy of alternative next steps (ties count as
wrong, as in the reference), and the correlation of value changes between consecutive states
with the ground truth's. Rows per state go to OUT/diagnose.jsonl; a plot when matplotlib exists.
"""
import argparse
import itertools
import json
import math
import os
import random
import statistics

import torch

import rollout
import vine
from checkpoint import load_critic, load_model
from reward import STOP, encode_prompt, gsm8k_reward, load_problems


def pairwise_accuracy(groups) -> float:
    """groups: [(gt values, predictions)] of the alternative actions at one state. A pair is
    right iff (gt_i - gt_j)(pred_i - pred_j) > 0, so ties (either side) count as wrong."""
    right = total = 0
    for gt, pred in groups:
        for i, j in itertools.combinations(range(len(gt)), 2):
            right += (gt[i] - gt[j]) * (pred[i] - pred[j]) > 0
            total += 1
    return right / total if total else float("nan")


def correlation(x, y) -> float:
    if len(x) < 2 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return float("nan")
    return statistics.correlation(x, y)


def summarize(rows, name) -> dict:
    """MAE, within-0.05 and MAE by position third of one estimator's rows."""
    err = [abs(r[name] - r["gt"]) for r in rows]
    third = lambda r: min(2, 3 * r["step"] // r["n_steps"])
    by_pos = {p: [abs(r[name] - r["gt"]) for r in rows if third(r) == i] for i, p in enumerate(("early", "middle", "late"))}
    return {"mae": statistics.mean(err), "within_0.05": statistics.mean(e <= 0.05 for e in err),
            **{f"mae_{p}": statistics.mean(e) if e else float("nan") for p, e in by_pos.items()}}


def delta_correlation(rows, name) -> float:
    """Correlation of V(s_{i+1}) - V(s_i) with the ground truth's, over consecutive states."""
    pred, gt = [], []
    for (a, b) in zip(rows, rows[1:]):
        if a["trajectory"] == b["trajectory"]:
            pred.append(b[name] - a[name])
            gt.append(b["gt"] - a["gt"])
    return correlation(pred, gt)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a train.py checkpoint directory (critic/ inside is used)")
    p.add_argument("--data", default="arith")
    p.add_argument("--arith-steps", default="2-5", help="arith only: steps per chain, MIN-MAX, as in training")
    p.add_argument("--out", default=None, help="where diagnose.jsonl goes (default: the checkpoint's parent)")
    p.add_argument("--trajectories", type=int, default=32, help="held-out trajectories, one per problem")
    p.add_argument("--gt-rollouts", type=int, default=256, help="continuations per ground-truth value")
    p.add_argument("--k", default="1,3,9", help="comma-separated K of the MC estimators")
    p.add_argument("--alternatives", type=int, default=5, help="next steps sampled per state for ranking")
    p.add_argument("--ranking-states", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok, policy = load_model(a.checkpoint, device)
    critic = load_critic(a.checkpoint, device)
    eos, pad = tok.eos_token_id, rollout.pad_id(tok)
    gen = dict(temperature=a.temperature, top_p=a.top_p, eos_id=eos, pad_id=pad, tokenizer=tok, stop=STOP)
    ks = [int(k) for k in a.k.split(",")]
    problems = random.Random(a.seed).sample(load_problems(a.data, "test", steps=a.arith_steps), a.trajectories)

    def mc(prompt, resp_prefix, gold, n):
        """Mean reward of n fresh continuations of prompt + resp_prefix (the full solution is graded)."""
        if resp_prefix and resp_prefix[-1] == eos:  # a finished response: its value is its reward
            return gsm8k_reward(tok.decode(resp_prefix, skip_special_tokens=True), gold)
        if len(resp_prefix) >= a.max_new_tokens:  # no budget left: unfinished
            return 0.0
        conts, done = rollout.sample(policy, [prompt + resp_prefix], n, [a.max_new_tokens - len(resp_prefix)], **gen)
        texts = [tok.decode(resp_prefix + c, skip_special_tokens=True) for c in conts[0]]
        return sum(gsm8k_reward(t, gold) if f else 0.0 for t, f in zip(texts, done[0])) / n

    def critic_value(prompt, resp_prefix):
        ids = torch.tensor([prompt + resp_prefix + [pad]], device=device)  # the pad is never read
        with torch.no_grad():
            return critic.values(ids, torch.ones_like(ids), torch.tensor([len(prompt)], device=device))[0, -1].item()

    estimators = [f"mc{k}" for k in ks] + ([f"critic_{critic.head_type}"] if critic else [])

    def estimate(prompt, resp_prefix, gold) -> dict:
        row = {"gt": mc(prompt, resp_prefix, gold, a.gt_rollouts)}
        row.update({f"mc{k}": mc(prompt, resp_prefix, gold, k) for k in ks})
        if critic:
            row[f"critic_{critic.head_type}"] = critic_value(prompt, resp_prefix)
        return row

    rows, ranking = [], {name: [] for name in estimators}
    for t, prob in enumerate(problems):
        prompt = encode_prompt(tok, prob["prompt"])
        resp = rollout.sample(policy, [prompt], 1, [a.max_new_tokens], **gen)[0][0][0]
        starts = vine.response_step_starts(tok, resp)
        for i, b in enumerate(starts):
            rows.append({"trajectory": t, "step": i, "n_steps": len(starts), **estimate(prompt, resp[:b], prob["answer"])})
            if len(ranking[estimators[0]]) >= a.ranking_states:
                continue
            # alternatives: sample next steps from this state, keep the distinct ones (>= 2)
            conts = rollout.sample(policy, [prompt + resp[:b]], a.alternatives, [a.max_new_tokens - b], **gen)[0][0]
            actions = set()
            for c in conts:
                cut = vine.response_step_starts(tok, resp[:b] + c)
                nxt = [s for s in cut if s > b]
                actions.add(tuple((resp[:b] + c)[b: nxt[0]] if nxt else c))
            if len(actions) < 2:
                continue
            q = [estimate(prompt, resp[:b] + list(act), prob["answer"]) for act in actions]
            for name in estimators:
                ranking[name].append(([r["gt"] for r in q], [r[name] for r in q]))

    out = a.out or os.path.dirname(os.path.abspath(a.checkpoint))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "diagnose.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    noise = {k: statistics.mean(math.sqrt(r["gt"] * (1 - r["gt"]) / k) for r in rows) for k in ks}
    print(f"{len(rows)} states of {len(problems)} trajectories, ground truth from {a.gt_rollouts} rollouts "
          f"(its own standard error about {statistics.mean(math.sqrt(r['gt'] * (1 - r['gt']) / a.gt_rollouts) for r in rows):.3f}); "
          f"{len(next(iter(ranking.values())))} states with >= 2 distinct next steps for ranking")
    print(f"{'estimator':16} {'MAE':>6} {'<=0.05':>7} {'early':>6} {'middle':>7} {'late':>6} {'ranking':>8} {'dV corr':>8} {'MC s.e.':>8}")
    for name in estimators:
        s = summarize(rows, name)
        se = f"{noise[int(name[2:])]:.3f}" if name.startswith("mc") else "-"
        print(f"{name:16} {s['mae']:6.3f} {s['within_0.05']:7.2f} {s['mae_early']:6.3f} {s['mae_middle']:7.3f} "
              f"{s['mae_late']:6.3f} {pairwise_accuracy(ranking[name]):8.2f} {delta_correlation(rows, name):8.2f} {se:>8}")
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(estimators), figsize=(4 * len(estimators), 4), squeeze=False)
    for ax, name in zip(axes[0], estimators):
        ax.scatter([r["gt"] for r in rows], [r[name] for r in rows], s=8)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(title=name, xlabel="ground truth", ylabel="estimate")
    fig.savefig(os.path.join(out, "diagnose.png"), dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main()
