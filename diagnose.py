"""How accurate are the value estimates? The paper's analysis (VinePPO §6.4-6.5) at laptop scale.

    python diagnose.py --checkpoint out/checkpoint                  # the built-in task, CPU
    python diagnose.py --checkpoint runs/rho/checkpoint --data gsm8k --gt-rollouts 256
    python diagnose.py --trace --checkpoint out/checkpoint          # one wrong answer, step by step
    python diagnose.py --mc-settings --checkpoint out/checkpoint    # cheaper MC settings
    python diagnose.py --newline-odds --checkpoint out/checkpoint   # how sure a line's end is

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

--trace: the credit each method gives the steps of one wrong answer. The first held-out problem
(of --tries) one of whose --group samples is wrong; that response's steps (as training splits
them), V_hat(s_i) of each state from --trace-k continuations with its standard error, VinePPO's
A_i, GRPO's group-normalised advantage (the same on every step) and a critic's V(s_i) with the
mean of the GAE (lambda = 1) advantages R - V(s_t) over the step's tokens, all before the
update's whitening. Rows go to OUT/trace.json; OUT/trace.png when matplotlib exists.

--mc-settings: what each way of spending MC continuations (vine_cheaper.py) buys, on one
batch shaped like training's (--trajectories problems x --group samples, the states deduplicated as
training does). Every distinct state gets a ground truth from --gt-rollouts continuations; then each
setting (fixed K = --mc-k, K/2 and 2K; adaptive; reuse; reuse with top-up) estimates the values,
--repeats times with fresh samples, and is reported with its continuations per state, MC tokens,
seconds of vine.mc_values, value MAE (each episode's V_hat(s_i), as its baseline, against the
truth) and advantage MAE (its A_i against r_i + V(s_{i+1}) - V(s_i) of the truth). Last: the
setting with the fewest MC tokens whose value MAE is within 0.02 of fixed K's. Rows go to
OUT/mc_settings.json.

--newline-odds: the policy's probability of each token that closes a step's line, given the text
before it (docs/reference.md, Steps: the reference's rule makes that text a state only when this
token follows). Printed: count, mean, 5th percentile; all of them go to OUT/newline_odds.json.
"""
import argparse
import collections
import copy
import itertools
import json
import math
import os
import random
import statistics
import sys
import time

import torch

import batching
import ppo
import rollout
import train
import value
import vine
import vine_cheaper
from engineering import outputs, settings
from engineering.checkpoint import load_critic
from engineering.models import load_model
from engineering.prompts import encode_prompt
from engineering.tasks import HELD_OUT, DataError, first_line, load_problems
from reward import STOP, grade


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
    by_pos = {p: [abs(r[name] - r["gt"]) for r in rows if third(r) == i]
              for i, p in enumerate(("early", "middle", "late"))}
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


def mc_rewards(policy, prompt, prefix, gold, n, sampling, question="",
               is_math=False) -> list[float]:
    """Rewards of n fresh continuations of prompt + prefix (the full solution is graded, as
    training does)."""
    tok = sampling.tokenizer
    if prefix and prefix[-1] == sampling.eos_id:  # a finished response: its value is its reward
        return [grade(tok.decode(prefix, skip_special_tokens=True), gold, question, is_math)] * n
    if len(prefix) >= sampling.max_new_tokens:  # no budget left: unfinished
        return [0.0] * n
    budget = sampling.max_new_tokens - len(prefix)
    conts, done = rollout.sample(policy, [prompt + prefix], n, [budget], sampling)
    texts = [tok.decode(prefix + c, skip_special_tokens=True) for c in conts[0]]
    return [grade(t, gold, question, is_math) if f else 0.0 for t, f in zip(texts, done[0])]


def critic_value(critic, prompt, prefix, pad) -> float:
    """The critic's V at the last token of prompt + prefix."""
    device = next(critic.parameters()).device
    ids = torch.tensor([prompt + prefix + [pad]], device=device)  # the pad is never read
    with torch.no_grad():
        values = critic.values(ids, torch.ones_like(ids),
                               torch.tensor([len(prompt)], device=device))
    return values[0, -1].item()


def count(low: int):
    """An argparse type: an integer of at least `low`, else one line that says so."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}")
        return n
    return parse


def counts(text: str) -> list[int]:
    """--k: comma-separated integers >= 1, each once (a duplicate would print its row twice)."""
    ks = [count(1)(k) for k in text.split(",")]
    twice = sorted({k for k in ks if ks.count(k) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(map(str, twice))} given twice; "
                                         "expected each K once")
    return ks


def rule(test, expected: str):
    """An argparse type from one of train.py's rules: the text if it passes, else one line."""
    def parse(text: str) -> str:
        if not test(text):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return text
    return parse


def real(test, expected: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = None
        if v is None or not test(v):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return v
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # one line, no usage
    p.error = lambda message: sys.exit(print(f"error: {message}", file=sys.stderr) or 2)
    p.add_argument("--checkpoint", required=True,
                   help="a train.py checkpoint (critic/ inside is used)")
    p.add_argument("--data", default="arith",
                   help="'arith', 'gsm8k', 'math' (their test splits) or a .jsonl (its held-out "
                        "split, as train.py's without --eval-data: one question in "
                        f"{HELD_OUT}, by a hash of its text)")
    p.add_argument("--arith-steps", default="2-5", type=rule(*train.STEPS),
                   help="arith only: steps per chain, MIN-MAX, as in training")
    p.add_argument("--arith-traps", default="", type=rule(*train.TRAPS),
                   help="arith only: traps per chain, MIN-MAX, as in training")
    p.add_argument("--out", default=None,
                   help="where the outputs go (default: the checkpoint's parent); empty, or "
                        "holding only this project's files")
    p.add_argument("--overwrite", action="store_true",
                   help="replace this mode's outputs of an earlier diagnose.py in --out")
    p.add_argument("--trajectories", type=count(1), default=32,
                   help="held-out trajectories, one per problem (at most the held-out problems)")
    p.add_argument("--gt-rollouts", type=count(1), default=256,
                   help="continuations per ground-truth value")
    p.add_argument("--k", type=counts, default=[1, 3, 9],
                   help="comma-separated K of the MC estimators")
    p.add_argument("--alternatives", type=count(1), default=5,
                   help="next steps sampled per state for ranking")
    p.add_argument("--ranking-states", type=count(0), default=32)
    p.add_argument("--trace", action="store_true",
                   help="trace one wrong answer instead (see above)")
    p.add_argument("--trace-k", type=count(1), default=9,
                   help="--trace: continuations per state (the paper's K)")
    p.add_argument("--group", type=count(1), default=8,
                   help="--trace: samples of the problem (GRPO's group)")
    p.add_argument("--tries", type=count(1), default=50,
                   help="--trace: held-out problems tried for a wrong answer")
    p.add_argument("--critic-checkpoint", default=None,
                   help="--trace: a ppo/tppo checkpoint whose critic is shown "
                        "(default: --checkpoint's)")
    p.add_argument("--mc-settings", action="store_true",
                   help="compare MC settings' cost and accuracy (above)")
    p.add_argument("--newline-odds", action="store_true",
                   help="the policy's probability of each token that closes a step's line, on "
                        "--trajectories x --group responses: how much the reference's rule, a "
                        "state before its newline, depends on the next token")
    p.add_argument("--mc-k", type=count(1), default=4,
                   help="--mc-settings: K of fixed K (the demo's 4)")
    p.add_argument("--repeats", type=count(1), default=2,
                   help="--mc-settings: estimates per setting")
    p.add_argument("--temperature",
                   type=real(lambda v: 1e-3 <= v <= settings.FLOAT32_MAX, ">= 0.001"), default=0.6)
    p.add_argument("--top-p", type=real(lambda v: 0 < v <= 1, "in (0, 1]"), default=0.9)
    p.add_argument("--max-new-tokens", type=count(1), default=64)
    p.add_argument("--seed", type=count(0), default=0)
    a = p.parse_args(argv)
    # as train.py: totals 0-9 without wrapping
    if not a.arith_traps and int(a.arith_steps.split("-")[1]) > 8:
        p.error(f"--arith-steps {a.arith_steps}: at most 8 steps without --arith-traps")
    if a.seed >= 2**63:
        p.error(f"--seed {a.seed}: expected 0 <= SEED < 2**63 (torch's seeds)")
    if a.trace and a.group == 1:  # as train.py refuses --algo grpo --samples-per-prompt 1
        p.error("--group 1: GRPO's advantage is a reward less its group's mean, always 0 in a "
                "group of one; give at least 2")
    return a


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    for flag, path in (("--checkpoint", a.checkpoint),
                       ("--critic-checkpoint", a.critic_checkpoint)):
        if path is not None and not os.path.isdir(path):
            raise DataError(f"{flag} {path!r}: no such directory")
    problems = load_problems(a.data, "test", steps=a.arith_steps, traps=a.arith_traps,
                             hold_out=True)
    if a.trajectories > len(problems) and not a.trace:
        raise DataError(f"--trajectories {a.trajectories}: the held-out set has "
                        f"{len(problems)} problems")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok, policy = load_model(a.checkpoint, device, flag="--checkpoint")
    out = a.out or os.path.dirname(os.path.abspath(a.checkpoint))
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is a file, not a directory")
    mode = ("trace" if a.trace else "mc_settings" if a.mc_settings
            else "newline_odds" if a.newline_odds else "values")
    outputs.claim(out, "--out", outputs.DIAGNOSE[mode], a.overwrite,
                  "an earlier diagnose.py's results")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:  # no permission, a file on the way
        raise DataError(f"--out {out!r}: not writable ({first_line(e)})") from None
    sampling = rollout.Sampling(temperature=a.temperature, top_p=a.top_p,
                                max_new_tokens=a.max_new_tokens, eos_id=tok.eos_token_id,
                                pad_id=rollout.pad_id(tok), stop=STOP, tokenizer=tok)
    if a.trace:
        trace(a, tok, policy, sampling, problems, out)
    elif a.newline_odds:
        newline_odds(a, tok, policy, sampling,
                     random.Random(a.seed).sample(problems, a.trajectories), out)
    elif a.mc_settings:
        mc_settings(a, tok, policy, sampling,
                    random.Random(a.seed).sample(problems, a.trajectories), out)
    else:
        value_accuracy(a, tok, policy, sampling,
                       random.Random(a.seed).sample(problems, a.trajectories), out)


def value_accuracy(a, tok, policy, sampling, problems, out):
    """Every state of one sampled trajectory per problem, against the ground truth; printed and
    saved."""
    critic = load_critic(a.checkpoint, next(policy.parameters()).device)
    ks = a.k
    mc = lambda prompt, prefix, prob, n: sum(mc_rewards(policy, prompt, prefix, prob["answer"], n,
                                                        sampling, prob["question"],
                                                        prob.get("math", False))) / n
    estimators = [f"mc{k}" for k in ks] + ([f"critic_{critic.head_type}"] if critic else [])

    def estimate(prompt, resp_prefix, prob) -> dict:
        row = {"gt": mc(prompt, resp_prefix, prob, a.gt_rollouts)}
        row.update({f"mc{k}": mc(prompt, resp_prefix, prob, k) for k in ks})
        if critic:
            row[f"critic_{critic.head_type}"] = critic_value(critic, prompt, resp_prefix,
                                                             sampling.pad_id)
        return row

    rows, ranking = [], {name: [] for name in estimators}
    for t, prob in enumerate(problems):
        prompt = encode_prompt(tok, prob["prompt"])
        resp = rollout.sample(policy, [prompt], 1, [a.max_new_tokens], sampling)[0][0][0]
        starts = vine.response_step_starts(tok, resp, math=prob.get("math", False))
        for i, b in enumerate(starts):
            rows.append({"trajectory": t, "step": i, "n_steps": len(starts),
                         **estimate(prompt, resp[:b], prob)})
            if len(ranking[estimators[0]]) >= a.ranking_states:
                continue
            # alternatives: sample next steps from this state, keep the distinct ones (>= 2)
            conts = rollout.sample(policy, [prompt + resp[:b]], a.alternatives,
                                   [a.max_new_tokens - b], sampling)[0][0]
            actions = set()
            for c in conts:
                cut = vine.response_step_starts(tok, resp[:b] + c, math=prob.get("math", False))
                nxt = [s for s in cut if s > b]
                actions.add(tuple((resp[:b] + c)[b: nxt[0]] if nxt else c))
            if len(actions) < 2:
                continue
            q = [estimate(prompt, resp[:b] + list(act), prob) for act in actions]
            for name in estimators:
                ranking[name].append(([r["gt"] for r in q], [r[name] for r in q]))

    with open(os.path.join(out, "diagnose.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    noise = {k: statistics.mean(math.sqrt(r["gt"] * (1 - r["gt"]) / k) for r in rows)
             for k in ks + [a.gt_rollouts]}
    print(f"{len(rows)} states of {len(problems)} trajectories, ground truth from "
          f"{a.gt_rollouts} rollouts (its own standard error about {noise[a.gt_rollouts]:.3f}); "
          f"{len(next(iter(ranking.values())))} states with >= 2 distinct next steps for ranking")
    print(f"{'estimator':16} {'MAE':>6} {'<=0.05':>7} {'early':>6} {'middle':>7} {'late':>6} "
          f"{'ranking':>8} {'dV corr':>8} {'MC s.e.':>8}")
    for name in estimators:
        s = summarize(rows, name)
        se = f"{noise[int(name[2:])]:.3f}" if name.startswith("mc") else "-"
        print(f"{name:16} {s['mae']:6.3f} {s['within_0.05']:7.2f} {s['mae_early']:6.3f} "
              f"{s['mae_middle']:7.3f} {s['mae_late']:6.3f} "
              f"{pairwise_accuracy(ranking[name]):8.2f} "
              f"{delta_correlation(rows, name):8.2f} {se:>8}")
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


# ---- --mc-settings: what each way of spending MC continuations buys ------------------------------

def settings_to_compare(k: int) -> dict:
    """name -> K (vine.MCSettings) and vine_cheaper.CheaperSettings' fields, around K = k."""
    half = max(1, k // 2)
    return {f"fixed K={k}": dict(k=k), f"fixed K={half}": dict(k=half),
            f"fixed K={2 * k}": dict(k=2 * k),
            f"adaptive {half},+{half},<={2 * k}": dict(k=half, max_k=2 * k, increment=half),
            f"adaptive {k},+{k},<={3 * k}": dict(k=k, max_k=3 * k, increment=k),
            f"reuse K={k}": dict(k=k, reuse=True),
            f"reuse+top-up K={k}": dict(k=k, reuse=True, top_up=True),
            f"reuse+top-up K={2 * k}": dict(k=2 * k, reuse=True, top_up=True),
            f"adaptive {half},+{half},<={2 * k} + reuse": dict(k=half, max_k=2 * k, increment=half,
                                                                 reuse=True)}


def sampled_episodes(a, tok, policy, sampling, problems) -> list:
    """--group responses to each problem, from --seed, cut into steps as training cuts them."""
    torch.manual_seed(a.seed)
    batch = [{**p, "prompt_ids": encode_prompt(tok, p["prompt"])} for p in problems]
    episodes = rollout.sample_episodes(policy, batch, a.group, sampling)
    vine.split_steps(episodes, tok)
    return episodes


def newline_odds(a, tok, policy, sampling, problems, out):
    """pi(token | the text before it) of each token that ends a step with its '\\n' (every step
    but the last, the answer's), at the sampling temperature: under the reference's rule the
    state is the text before that token, and it is a state only when that token follows.
    Printed: their count, mean and 5th percentile; OUT/newline_odds.json holds them all."""
    episodes = sampled_episodes(a, tok, policy, sampling, problems)
    rollout.old_logprobs(policy, episodes, sampling.temperature, sampling.pad_id)
    odds = sorted(math.exp(ep.old_logp[b - 1]) for ep in episodes for b in ep.step_starts[1:])
    if not odds:
        raise DataError("no sampled response has more than one step: no line end to measure")
    summary = {"line_ends": len(odds), "mean": sum(odds) / len(odds),
               "p5": odds[int(0.05 * (len(odds) - 1))], "episodes": len(episodes)}
    print(f"pi(the token closing a line | the text before it), T = {sampling.temperature}: "
          f"{summary['line_ends']} line ends of {len(episodes)} responses, mean "
          f"{summary['mean']:.4f}, 5th percentile {summary['p5']:.4f}")
    with open(os.path.join(out, "newline_odds.json"), "w") as f:
        json.dump({**summary, "odds": odds}, f)


def mc_settings(a, tok, policy, sampling, problems, out):
    episodes = sampled_episodes(a, tok, policy, sampling, problems)
    key = lambda ep, b: tuple(ep.prompt_ids + ep.response_ids[:b])
    states = vine.distinct_states(episodes)
    rewards = vine.continuation_rewards(policy, episodes, None, states, list(states),
                                        a.gt_rollouts, sampling)[0]
    truth = {state: sum(r) / len(r) for state, r in zip(states, rewards)}
    true_values = [[truth[key(ep, b)] for b in ep.step_starts] for ep in episodes]
    true_advantages = [vine.step_advantages(v, ep.reward) for v, ep in zip(true_values, episodes)]
    print(f"{len(episodes)} episodes of {len(problems)} problems, {len(states)} distinct states, "
          f"ground truth from {a.gt_rollouts} continuations each; "
          f"{a.repeats} estimates per setting")
    print(f"{'setting':28} {'per state':>9} {'MC tokens':>10} {'seconds':>8} {'value MAE':>10} "
          f"{'adv. MAE':>9}")
    # the log-prob pass's KV cache of each batch, once: forks only read it
    logprob_pass = lambda chunk: rollout.old_logprobs(policy, chunk, sampling.temperature,
                                                      sampling.pad_id, keep_cache=True)
    caches = [(chunk, logprob_pass(chunk)) for chunk in batching.group_chunks(episodes, 32768)]
    rows = {}
    for name, options in settings_to_compare(a.mc_k).items():
        mc = vine.MCSettings(options["k"])
        cheaper = vine_cheaper.CheaperSettings(**{o: v for o, v in options.items() if o != "k"})
        runs = []
        for repeat in range(a.repeats):
            torch.manual_seed(a.seed + 1 + repeat)
            counts, seconds = collections.Counter(), 0.0
            for chunk, cache in caches:
                began = time.perf_counter()
                counts += train.value_with_mc(policy, chunk, cache, sampling, mc, cheaper)
                seconds += time.perf_counter() - began
            advantages = [vine_cheaper.episode_step_advantages(ep, cheaper.reuse)
                          for ep in episodes]
            errors = [(abs(v - t), abs(adv - true_adv))
                      for ep, advs, tv, ta in zip(episodes, advantages, true_values,
                                                  true_advantages)
                      for v, t, adv, true_adv in zip(ep.step_values, tv, advs, ta)]
            runs.append([counts["mc_continuations"] / counts["mc_states"], counts["mc_tokens"],
                         seconds, *map(statistics.mean, zip(*errors))])
        rows[name] = dict(zip(("per_state", "mc_tokens", "seconds", "value_mae", "advantage_mae"),
                              map(statistics.mean, zip(*runs))), options=options)
        r = rows[name]
        print(f"{name:28} {r['per_state']:9.2f} {r['mc_tokens']:10.0f} {r['seconds']:8.2f} "
              f"{r['value_mae']:10.4f} {r['advantage_mae']:9.4f}")
    fixed = rows[f"fixed K={a.mc_k}"]["value_mae"]
    cheapest = min((r["mc_tokens"], name) for name, r in rows.items()
                   if r["value_mae"] <= fixed + 0.02)[1]
    print(f"fewest MC tokens with a value MAE within 0.02 of fixed K={a.mc_k}'s ({fixed:.4f}): "
          f"{cheapest}")
    with open(os.path.join(out, "mc_settings.json"), "w") as f:
        json.dump({"settings": rows, "cheapest_within_0.02": cheapest, "states": len(states),
                   "episodes": len(episodes), "gt_rollouts": a.gt_rollouts}, f, indent=1)


# ---- --trace: the credit each method gives the steps of one wrong answer -----------------------

def trace(a, tok, policy, sampling, problems, out):
    """Find a wrong answer, compute its steps' values and advantages; print, save, plot."""
    found = first_wrong_answer(policy, problems[: a.tries], a.group, sampling)
    if found is None:
        print(f"no wrong answer: all {a.group} samples of each of the first {a.tries} held-out "
              "problems are right")
        return
    index, group, wrong = found
    critic, critic_name = trace_critic(a, policy)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)
    ep = group[wrong]
    result = {"problem": index, "question": problems[index]["question"], "gold": ep.gold,
              "sample": wrong, "response": text(ep.response_ids), "reward": ep.reward,
              "group_rewards": [e.reward for e in group], "k": a.trace_k, "critic": critic_name,
              "steps": trace_steps(policy, critic, group, wrong, a.trace_k, sampling)}
    with open(os.path.join(out, "trace.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_trace(result)
    try:
        plot_trace(result, os.path.join(out, "trace.png"))
        print(f"rows: {os.path.join(out, 'trace.json')}, figure: {os.path.join(out, 'trace.png')}")
    except ImportError:
        print(f"rows: {os.path.join(out, 'trace.json')} (pip install matplotlib for the figure)")


def first_wrong_answer(policy, problems, group, sampling):
    """(index, the problem's group of samples, which sample) of the first problem with a wrong one,
    or None."""
    for index, prob in enumerate(problems):
        prob = {**prob, "prompt_ids": encode_prompt(sampling.tokenizer, prob["prompt"])}
        episodes = rollout.sample_episodes(policy, [prob], group, sampling)
        wrong = [i for i, ep in enumerate(episodes) if ep.reward == 0]
        if wrong:
            return index, episodes, wrong[0]
    return None


def trace_critic(a, policy):
    """(critic, what it is): --critic-checkpoint's, else --checkpoint's, else the kind PPO starts
    from."""
    device = next(policy.parameters()).device
    for path in filter(None, (a.critic_checkpoint, a.checkpoint)):
        critic = load_critic(path, device)
        if critic is not None:
            return critic, f"the {critic.head_type} critic saved in {path}"
        if path == a.critic_checkpoint:
            raise DataError(f"--critic-checkpoint {path}: no critic/ inside (a ppo or tppo run's "
                            "checkpoint has one)")
    return value.Critic(copy.deepcopy(policy.base_model), "scalar").to(device), (
        "UNTRAINED: a copy of this policy with a fresh scalar head, as PPO's critic starts "
        "(--critic-checkpoint shows a trained one)")


def trace_steps(policy, critic, group, wrong, k, sampling) -> list[dict]:
    """A row per step of group[wrong]: its text, V_hat(s_i) +- s.e. and the advantages, by
    training's code."""
    tok, ep = sampling.tokenizer, group[wrong]
    vine.split_steps([ep], tok)
    rewards = [mc_rewards(policy, ep.prompt_ids, ep.response_ids[:b], ep.gold, k, sampling,
                          ep.question, ep.math) for b in ep.step_starts]  # K rewards per state s_i
    ep.step_values = [sum(r) / k for r in rewards]
    vine_adv = vine.step_advantages(ep.step_values, ep.reward)
    ppo.assign_advantages("grpo", group, 1.0, 1.0, 1.0)  # normalised within the problem's group
    grpo_adv = ep.advantages[0].item()
    value.critic_values(critic, [ep], sampling.pad_id, forward_batch_tokens=2 ** 20)
    # ep.critic_values: V(s_t) before each response token;
    # GAE with gamma = lambda = 1 gives A_t = R - V(s_t)
    ppo.assign_advantages("ppo", [ep], 1.0, 1.0, 1.0)
    pieces, ends = (vine.token_texts(tok, ep.response_ids),
                    ep.step_starts[1:] + [len(ep.response_ids)])
    return [{"step": i, "text": "".join(pieces[lo:hi]), "tokens": hi - lo, "rewards": r,
             "value": ep.step_values[i],
             "se": statistics.pstdev(r) / math.sqrt(k), "vineppo": vine_adv[i], "grpo": grpo_adv,
             "critic_value": ep.critic_values[lo].item(), "ppo": ep.advantages[lo:hi].mean().item()}
            for i, (lo, hi, r) in enumerate(zip(ep.step_starts, ends, rewards))]


def print_trace(t):
    right = sum(r == 1 for r in t["group_rewards"])
    print(f"held-out problem {t['problem']}: {t['question']}   gold solution: {t['gold']!r}")
    print(f"sample {t['sample']} of its group of {len(t['group_rewards'])} ({right} right): "
          f"{t['response']!r}, reward R = {t['reward']:g}")
    print(f"V_hat(s_i): mean reward of K = {t['k']} continuations from the state before step i, "
          "± sqrt(p(1-p)/K)\ncritic: " + t["critic"])
    print(f"{'step':>4}  {'text':22} {'V_hat(s_i)':>11} {'VinePPO A_i':>12} {'GRPO':>6} "
          f"{'critic V(s_i)':>14} {'PPO R-V(s_t)':>13}")
    for r in t["steps"]:
        print(f"{r['step']:4}  {r['text']!r:22} {r['value']:5.2f} ± {r['se']:.2f} "
              f"{r['vineppo']:12.2f} {r['grpo']:6.2f} {r['critic_value']:14.2f} {r['ppo']:13.2f}")
    print(f"sum of A_i = {sum(r['vineppo'] for r in t['steps']):.2f} = R - V_hat(s_0); "
          "PPO R-V(s_t): GAE (lambda = 1), the mean over the step's tokens\n"
          "advantages before the update whitens them (vineppo, ppo; GRPO's are used as they are)")


def plot_trace(t, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, x = t["steps"], range(len(t["steps"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.errorbar(x, [r["value"] for r in steps], yerr=[r["se"] for r in steps], marker="o",
                  capsize=3, label=f"MC V_hat(s_i), K = {t['k']}, ± s.e.")
    left.plot(x, [r["critic_value"] for r in steps], marker="s", color="C2", label="critic V(s_i)")
    left.plot([len(steps)], [t["reward"]], "k*", markersize=10, label="reward R (at the end)")
    left.set(xlabel="state s_i (before step i)", ylabel="value", xticks=range(len(steps) + 1))
    left.legend(fontsize=8, loc="best")
    methods = [("vineppo", "VinePPO A_i"), ("grpo", "GRPO"), ("ppo", "PPO: mean R - V(s_t)")]
    for j, (key, name) in enumerate(methods):
        right.bar([i + 0.27 * (j - 1) for i in x], [r[key] for r in steps], width=0.27, label=name,
                  color=f"C{j}")
    right.axhline(0, color="k", lw=0.5)
    labels = [r["text"].strip().replace("\n", " ") for r in steps]
    right.set(ylabel="advantage (before whitening)", xticks=list(x), xticklabels=labels)
    right.tick_params(axis="x", labelsize=8, rotation=20)
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{t['question']}  (sampled answer: reward {t['reward']:g})", fontsize=10)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # one line, exit status 2, as train.py
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
