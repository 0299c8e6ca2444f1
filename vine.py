"""VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679, §4): from every step boundary s_i
of a response, K more continuations; every token of step i takes A_i (the KL term lives in the loss):

    V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)                        (unbiased MC value)
    A_i        = r_i + V_hat(s_{i+1}) - V_hat(s_i),  r_i = R * [i = n-1],  V(s_n) = 0  (gamma = 1)

Needs: rollout.py (Episode, Sampling, sample: the forks), math_grader.py (where MATH's steps are cut).
Algorithm: split_steps, mc_values, step_advantages, episode_advantages; the text-to-token mapping after the
engineering line is what a first reading may skip.
"""
from bisect import bisect_right
from collections import Counter
from itertools import accumulate

import torch

import math_grader
import rollout


def split_steps(episodes: list[rollout.Episode], tok):
    """Set ep.step_starts: the token index where each reasoning step (state s_i) of the response begins."""
    for ep in episodes:
        ep.step_starts = response_step_starts(tok, ep.response_ids, math=ep.math)


def mc_values(model, episodes: list[rollout.Episode], cache, k: int, sampling: rollout.Sampling,
              max_states: int = 0) -> Counter:
    """ep.step_values[i] = V_hat(s_i): the mean reward of k continuations of each of the first max_states
    states (0: all), forked from `cache` (row e holds episodes[e], as rollout.old_logprobs leaves it); each
    distinct state once, graded with its prefix (reference pitfall 4). -> counts of states and tokens."""
    unique = {}  # state tokens -> (episode, boundary)
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states or None]:
            unique.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    keys = list(unique)
    budgets = [sampling.max_new_tokens - unique[key][1] for key in keys]
    conts, finished = rollout.sample(model, [list(key) for key in keys], k, budgets, sampling, cache=cache,
                                     rows=[unique[key][0] for key in keys])
    value = {}
    for key, cs, fs in zip(keys, conts, finished):
        e, b = unique[key]
        ep = episodes[e]
        value[key] = sum(rollout.grade(ep, ep.response_ids[:b] + c, sampling.tokenizer) if f else 0.0
                         for c, f in zip(cs, fs)) / k
    capped = lambda i: max_states and i >= max_states  # max_states 0: no cap
    for ep in episodes:
        ep.step_values = [None if capped(i) else value.get(tuple(ep.prompt_ids + ep.response_ids[:b]))
                          for i, b in enumerate(ep.step_starts)]
    return Counter(mc_states=len(keys), mc_tokens=sum(len(c) for cs in conts for c in cs))


def step_advantages(values: list[float], reward: float) -> list[float]:
    """A_i = r_i + V(s_{i+1}) - V(s_i) (VinePPO §4); a None value (past the cap) takes the realised return."""
    n, v = len(values), list(values) + [0.0]
    r = [0.0] * (n - 1) + [reward]  # r_i = R * [i = n-1]
    for i in reversed(range(n)):
        if v[i] is None:
            v[i] = r[i] + v[i + 1]
    return [r[i] + v[i + 1] - v[i] for i in range(n)]


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    bounds = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, bounds) for _ in range(hi - lo)]


def episode_advantages(ep: rollout.Episode) -> torch.Tensor:
    """[T]: each step's A_i on every token of the step (the KL term lives in the loss)."""
    return torch.tensor(token_advantages(ep.step_starts, step_advantages(ep.step_values, ep.reward),
                                         len(ep.response_ids)))


# ---- engineering: steps found in the text, mapped to tokens (skip on a first reading) --------------------

def step_starts(token_texts: list[str]) -> list[int]:
    """Token index where each step starts, by the reference's rule (tasks/gsm8k.py) on the tokens' text: a
    step opens at each line; leading empty lines join the first; the last non-empty line, empty lines after
    it and the answer ('\\n####') form one; a token is in its first character's step (reference pitfall 5)."""
    text = "".join(token_texts)
    answer_at = text.find("\n####")
    lines = (text if answer_at < 0 else text[:answer_at]).split("\n")
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    opens = []  # character positions of the '\n' that opens a step
    if nonempty:
        last = nonempty[-1] if answer_at >= 0 else len(lines) - 1
        opens = [sum(len(line) + 1 for line in lines[:i]) - 1 for i in range(nonempty[0] + 1, last + 1)]
    return token_steps(token_texts, opens)


def token_steps(token_texts: list[str], opens: list[int]) -> list[int]:
    """Token index where each step starts, given the character positions `opens` where steps 2.. start."""
    firsts = list(accumulate((len(piece) for piece in token_texts), initial=0))[:-1]  # each token's first char
    steps = [bisect_right(opens, char) for char in firsts]  # steps opened at or before it
    return [0] + [t for t in range(1, len(steps)) if steps[t] != steps[t - 1]]


def decoded_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence (alone, '▁' decodes to ''), as vLLM detokenizes."""
    decode = tok.backend_tokenizer.decode if hasattr(tok, "backend_tokenizer") else tok.decode
    pieces, start, read, shown = [], 0, 0, ""  # the window is ids[start:]; shown = its text up to read
    for t in range(len(ids)):
        text = decode(ids[start: t + 1], skip_special_tokens=True)
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            pieces.append(text[len(shown):])
            start, read = read, t + 1
            shown = decode(ids[start:read], skip_special_tokens=True)
        else:
            pieces.append("")
    return pieces


def response_step_starts(tok, response_ids: list[int], math: bool = False) -> list[int]:
    """By GSM8K's rule (one line a step), or by MATH's (math: sentences and lines, LaTeX kept whole)."""
    pieces = decoded_pieces(tok, response_ids)
    if math:
        return token_steps(pieces, math_grader.math_step_offsets("".join(pieces))[1:-1])
    return step_starts(pieces)
