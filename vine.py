"""VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679, §4): from every step
boundary s_i of a response, K more continuations; every token of step i takes A_i
(the KL term lives in the loss):

    V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)                        (unbiased MC value)
    A_i        = r_i + V_hat(s_{i+1}) - V_hat(s_i),  r_i = R * [i = n-1],  V(s_n) = 0  (gamma = 1)

n is the number of steps. Cheaper, each optional (mc_values): adaptive K (the reference's rule);
reuse, the response R as one more sample of V(s_{i+1}) in A_i, never of V(s_i): with m the samples
behind V_hat(s_{i+1}), A_i = r_i + (m V_hat(s_{i+1}) + R) / (m + 1) - V_hat(s_i).

Needs: rollout.py (Episode, Sampling, sample: the forks), math_grader.py
(where MATH's steps are cut).
Algorithm: split_steps, mc_values, step_advantages, episode_advantages (the functions between
mc_values and step_advantages serve it: the cheaper settings' rules, the states, the sampling
rounds); the text-to-token mapping after the engineering line may be skipped.
"""
from bisect import bisect_right
from collections import Counter
from itertools import accumulate

import torch

import math_grader
import rollout


def split_steps(episodes: list[rollout.Episode], tok):
    """Set ep.step_starts:
    the token index where each reasoning step (state s_i) of the response begins."""
    for ep in episodes:
        ep.step_starts = response_step_starts(tok, ep.response_ids, math=ep.math,
                                              boxed=ep.style == "boxed")


def mc_values(model, episodes: list[rollout.Episode], cache, k: int, sampling: rollout.Sampling,
              max_states: int = 0, *, max_k: int = 0, increment: int = 4, ci_width: float = 0.05,
              reuse: bool = False, top_up: bool = False) -> Counter:
    """VinePPO's MC value (§4): ep.step_values[i] = V_hat(s_i) = 1/K sum_k R(s_i + continuation_k),
    K = k, for the first max_states states of each response (0: all; past them None: the return
    stands in). Each distinct state once, its continuations forked from `cache` (row e holds
    episodes[e], as rollout.old_logprobs leaves it)
    and graded as the state's response prefix + the continuation.
    -> counts of states, continuations, tokens.
    The cheaper settings, all off by default (the paper's fixed K), change only how many
    continuations a state gets (continuations_wanted, more_rollouts) and which rewards its mean
    takes (value_samples):
    max_k > 0   adaptive, as the reference's ciAwre_10ir_4nr_ci0.05 config: k first, then
                `increment` more while the 95% interval of the mean is wider than ci_width, up to
                max_k (more_rollouts);
    reuse       each sampled response is one more continuation of every state it passes through: it
                joins those states' values, except as the baseline of its own steps (ep.step_counts,
                see step_advantages), so the advantage stays unbiased;
    top_up      (with reuse) a state gets only the continuations that bring its baselines to k
                samples: k minus the other responses through it (0 for the prompt of a group of
                k + 1 or more)."""
    if top_up and (max_k or not reuse):
        raise ValueError("top_up needs reuse, and counts the responses as continuations: "
                         "not with max_k")
    states = distinct_states(episodes, max_states)  # every distinct state s_i once
    through = responses_through(states, episodes) if reuse else {}
    # K each, at fixed K
    wanted = {key: continuations_wanted(k, through, key, top_up) for key in states}
    more = (lambda rewards: more_rollouts(rewards, increment, max_k, ci_width)) if max_k else None
    rewards, tokens = continuation_rewards(model, episodes, cache, states, wanted, sampling, more)
    for e, ep in enumerate(episodes):  # at fixed K: V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)
        samples = [value_samples(key, e, rewards, through, episodes)
                   for key in state_keys(ep, max_states)]
        ep.step_values = [None if s is None else sum(s) / len(s) for s in samples]
        ep.step_counts = [None if s is None else len(s) for s in samples] if reuse else []
    return Counter(mc_states=len(states), mc_continuations=sum(map(len, rewards.values())),
                   mc_tokens=tokens)


def state_keys(ep: rollout.Episode, max_states: int = 0) -> list:
    """The tokens of each state s_i of ep (prompt + response up to step i),
    None past the first max_states."""
    capped = lambda i: max_states and i >= max_states  # max_states 0: no cap
    return [None if capped(i) else tuple(ep.prompt_ids + ep.response_ids[:b])
            for i, b in enumerate(ep.step_starts)]


def continuations_wanted(k: int, through: dict, key, top_up: bool) -> int:
    """Continuations a state gets first: k,
    or with top_up k minus the other responses through it."""
    return max(0, k - len(through[key]) + 1) if top_up else k


def value_samples(key, e: int, rewards: dict, through: dict, episodes) -> list[float] | None:
    """The rewards behind episode e's V_hat of state `key`: its continuations', and with reuse those
    of the other responses through it (never e's own, which continues this state's action);
    None past the cap."""
    if key is None:
        return None
    return rewards[key] + [episodes[o].reward for o in through.get(key, ()) if o != e]


def more_rollouts(rewards: list[float], increment: int, max_k: int, ci_width: float) -> int:
    """How many more continuations a state gets by the reference's rule (treetune's
    ConfidenceIntervalAwareEfficientIIDExpander): `increment` at a time while n < max_k and the 95%
    interval of the mean p of n rewards in [0, 1], 2 * 1.96 * sqrt(p (1 - p) / n), is wider than
    ci_width; the last round is cut to end at max_k (the reference's rounds step past it: 2, +50,
    <= 3 drew 52). Rounds after which no outcome could stop are taken at once (the same counts,
    fewer generate calls).
    Sequential stopping biases the mean toward the ends: a state stops early only when its first
    rewards agree. With the reference's 10, +4, 30, 0.05 the expected V_hat of a state of value 0.9
    is 0.923 and of 0.1 is 0.077 (0.5: unbiased); test_vine enumerates it exactly."""
    width = lambda total, n: 2 * 1.96 * (max(0.0, total / n * (1 - total / n)) / n) ** 0.5
    n, total = len(rewards), sum(rewards)
    if n >= max_k or width(total, n) <= ci_width:
        return 0
    m = n + increment
    # p (1 - p) is concave in the new total, in [total, total + m - n]: its least width is at an end
    while m < max_k and min(width(total, m), width(total + m - n, m)) > ci_width:
        m += increment
    return min(m, max_k) - n


def distinct_states(episodes: list[rollout.Episode], max_states: int = 0) -> dict:
    """State tokens (prompt + response up to a step boundary) -> (episode, boundary) of its first
    holder: each distinct state of the first max_states of every episode (0: all) once."""
    states = {}
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states or None]:
            states.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    return states


def responses_through(states: dict, episodes: list[rollout.Episode]) -> dict:
    """State tokens -> the episodes (of its prompt) whose prompt + response begins with them: a
    response through a state is a continuation of it sampled by the policy, whatever came after."""
    seqs = [tuple(ep.prompt_ids + ep.response_ids) for ep in episodes]
    # group -> its episodes' indices, so a state is matched against its own prompt's only
    groups = {}
    for o, ep in enumerate(episodes):
        groups.setdefault(ep.group, []).append(o)
    return {key: [o for o in groups[episodes[e].group] if seqs[o][:len(key)] == key]
            for key, (e, _) in states.items()}


def continuation_rewards(model, episodes, cache, states: dict, wanted: dict, sampling, more=None):
    """({state: rewards of its continuations}, tokens): wanted[state] continuations of each, then
    while more(rewards) > 0 that many more; every round one batched `sample` call (n rows per state
    when all want n, else a state once per continuation it wants)."""
    rewards, tokens = {key: [] for key in states}, 0
    todo = {key: n for key, n in wanted.items() if n > 0}
    while todo:
        n = next(iter(todo.values())) if len(set(todo.values())) == 1 else 1
        keys = [key for key, want in todo.items() for _ in range(want // n)]
        budgets = [sampling.max_new_tokens - states[key][1] for key in keys]
        conts, finished = rollout.sample(model, [list(key) for key in keys], n, budgets, sampling,
                                         cache=cache, rows=[states[key][0] for key in keys])
        for key, cs, fs in zip(keys, conts, finished):
            e, b = states[key]
            ep, prefix = episodes[e], episodes[e].response_ids[:b]
            rewards[key] += [rollout.response_reward(ep, prefix + c, sampling.tokenizer)
                             if f else 0.0 for c, f in zip(cs, fs)]
            tokens += sum(map(len, cs))
        todo = {key: more(rewards[key]) for key in todo} if more else {}
        todo = {key: n for key, n in todo.items() if n > 0}
    return rewards, tokens


def step_advantages(values: list[float], reward: float,
                    counts: list[int] | None = None) -> list[float]:
    """A_i = r_i + V(s_{i+1}) - V(s_i) (VinePPO §4); a None value (past the cap) takes the realised
    return. counts (reuse): m, the samples behind each V(s_i). The response is one more continuation
    of s_{i+1}, so it joins V(s_{i+1}) in A_i, (m V + R) / (m + 1):
    E[A_i | s_i, a_i] = Q(s_i, a_i) - V(s_i) still. Never V(s_i), the baseline of the step whose
    action it continues: that would shrink E[A_i] by m / (m + 1)."""
    n, v = len(values), list(values) + [0.0]
    r = [0.0] * (n - 1) + [reward]  # r_i = R * [i = n-1]
    for i in reversed(range(n)):
        if v[i] is None:
            v[i] = r[i] + v[i + 1]
    nxt = v[1:]  # V(s_{i+1}) in A_i
    if counts:
        joined = lambda i: ((counts[i] * v[i] + reward) / (counts[i] + 1)
                            if values[i] is not None else v[i])
        nxt = [joined(i + 1) for i in range(n - 1)] + [0.0]
    return [r[i] + nxt[i] - v[i] for i in range(n)]


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    bounds = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, bounds) for _ in range(hi - lo)]


def episode_advantages(ep: rollout.Episode) -> torch.Tensor:
    """[T]: each step's A_i on every token of the step (the KL term lives in the loss)."""
    step_adv = step_advantages(ep.step_values, ep.reward, ep.step_counts)
    return torch.tensor(token_advantages(ep.step_starts, step_adv, len(ep.response_ids)))


# ---- engineering: steps found in the text, mapped to tokens (skip on a first reading) ------------

def step_starts(token_texts: list[str], boxed: bool = False) -> list[int]:
    """Token index where each step starts, by the reference's rule (tasks/gsm8k.py) on the tokens'
    text: a step opens at each line; leading empty lines join the first; the last non-empty line,
    empty lines after it and the answer ('\\n####'; boxed: the line of the first \\boxed, from its
    '\\n') form one; a token is in its first character's step, so a step's tokens are exactly those
    whose text begins inside it."""
    text = "".join(token_texts)
    answer_at = text.rfind("\n", 0, max(0, text.find("\\boxed"))) if boxed else text.find("\n####")
    lines = (text if answer_at < 0 else text[:answer_at]).split("\n")
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    opens = []  # character positions of the '\n' that opens a step
    if nonempty:
        last = nonempty[-1] if answer_at >= 0 else len(lines) - 1
        opens = [sum(len(line) + 1 for line in lines[:i]) - 1
                 for i in range(nonempty[0] + 1, last + 1)]
    return token_steps(token_texts, opens)


def token_steps(token_texts: list[str], opens: list[int]) -> list[int]:
    """Token index where each step starts,
    given the character positions `opens` where steps 2.. start."""
    # each token's first char
    firsts = list(accumulate((len(piece) for piece in token_texts), initial=0))[:-1]
    steps = [bisect_right(opens, char) for char in firsts]  # steps opened at or before it
    return [0] + [t for t in range(1, len(steps)) if steps[t] != steps[t - 1]]


def decoded_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence (alone, '▁' decodes to ''),
    as vLLM detokenizes."""
    decode = tok.backend_tokenizer.decode if hasattr(tok, "backend_tokenizer") else tok.decode
    # the window is ids[start:]; shown = its text up to read
    pieces, start, read, shown = [], 0, 0, ""
    for t in range(len(ids)):
        text = decode(ids[start: t + 1], skip_special_tokens=True)
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            pieces.append(text[len(shown):])
            start, read = read, t + 1
            shown = decode(ids[start:read], skip_special_tokens=True)
        else:
            pieces.append("")
    return pieces


def response_step_starts(tok, response_ids: list[int], math: bool = False,
                         boxed: bool = False) -> list[int]:
    """By GSM8K's rule (one line a step; boxed: --answer boxed's answer line), or by MATH's
    (math: sentences and lines, LaTeX kept whole)."""
    pieces = decoded_pieces(tok, response_ids)
    if math:
        return token_steps(pieces, math_grader.math_step_offsets("".join(pieces))[1:-1])
    return step_starts(pieces, boxed)
