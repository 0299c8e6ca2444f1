"""VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679, §4): from every step boundary s_i
of a response, K more continuations; every token of step i takes A_i (the KL term lives in the loss):

    V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)                        (unbiased MC value)
    A_i        = r_i + V_hat(s_{i+1}) - V_hat(s_i),  r_i = R * [i = n-1],  V(s_n) = 0  (gamma = 1)
"""
from bisect import bisect_right
from itertools import accumulate

import torch
from tqdm import tqdm

import rollout


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


def response_step_starts(tok, response_ids: list[int]) -> list[int]:
    return step_starts(decoded_pieces(tok, response_ids))


def step_advantages(values: list[float], reward: float) -> list[float]:
    """A_i = r_i + V(s_{i+1}) - V(s_i) (VinePPO §4); a None value (past the cap) takes the realised return."""
    v = list(values) + [0.0]
    for i in reversed(range(len(values))):
        if v[i] is None:
            v[i] = (reward if i == len(values) - 1 else 0.0) + v[i + 1]
    n = len(values)
    return [(reward if i == n - 1 else 0.0) + v[i + 1] - v[i] for i in range(n)]


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    bounds = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, bounds) for _ in range(hi - lo)]


def mc_values(model, episodes: list[rollout.Episode], cache, rows: list[int], k: int,
              grade, *, max_new_tokens: int, max_states: int, **gen):
    """ep.values[i] = V_hat(s_i) of the first max_states states, forked from `cache` (row rows[e]), each
    distinct state once, graded with its prefix (reference pitfall 4); -> (states, tokens generated)."""
    unique = {}  # state tokens -> (episode, boundary)
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states]:
            unique.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    keys = list(unique)
    budgets = [max_new_tokens - unique[key][1] for key in keys]
    conts, finished = rollout.sample(model, [list(key) for key in keys], k, budgets, cache=cache,
                                     rows=[rows[unique[key][0]] for key in keys], **gen)
    value = {}
    for key, cs, fs in zip(keys, conts, finished):
        e, b = unique[key]
        ep = episodes[e]
        value[key] = sum(grade(ep.response_ids[:b] + c, ep) if f else 0.0 for c, f in zip(cs, fs)) / k
    for ep in episodes:
        ep.values = [value.get(tuple(ep.prompt_ids + ep.response_ids[:b])) if i < max_states else None
                     for i, b in enumerate(ep.step_starts)]
    return len(keys), sum(len(c) for cs in conts for c in cs)


def old_logprobs_and_values(policy, critic, episodes, grade, *, algo: str, temperature: float, mc_rollouts: int,
                            max_value_states: int, forward_batch_tokens: int, autocast, **gen) -> dict:
    """ep.old_logp, and MC values or a critic's V(s_t), from one forward pass per chunk (its cache forked)."""
    n_states = mc_tokens = 0
    device = next(policy.parameters()).device
    for chunk in tqdm(list(rollout.group_chunks(episodes, forward_batch_tokens)), desc="values", leave=False):
        ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in chunk], gen["pad_id"], device)
        with torch.no_grad(), autocast:
            logp, cache = rollout.token_logprobs(policy, ids, mask, temperature, keep_cache=algo == "vineppo")
            if algo == "vineppo":
                states, tokens = mc_values(policy, chunk, cache, list(range(len(chunk))), mc_rollouts, grade,
                                           max_states=max_value_states, temperature=temperature, **gen)
                n_states, mc_tokens = n_states + states, mc_tokens + tokens
            if critic is not None:
                prompt_lens = torch.tensor([len(ep.prompt_ids) for ep in chunk], device=device)
                for ep, v in zip(chunk, rollout.per_response(critic.values(ids, mask, prompt_lens), chunk)):
                    ep.old_values = v
        for ep, lp in zip(chunk, rollout.per_response(logp, chunk)):
            ep.old_logp = lp
        del cache  # before the next chunk's forward pass allocates its own
    return {"mc_states": n_states, "mc_tokens": mc_tokens}
