"""This file computes VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679v1, §4).

Each response is cut into reasoning steps. From the start s_i of every step the policy samples
K more continuations; the mean of their rewards estimates V(s_i) (mc_values), and every token of
step i takes the advantage A_i, the change of that estimate over the step (step_advantages).
A continuation is what `generate` samples after the state is encoded afresh
(rollout.sample_by_definition; docs/mc-values-by-definition.md computes the values that way
alone); fork.py samples the same distribution faster, from the old-log-prob pass's KV cache.

The path of one MC value, as train.main runs it. Each line is a call, then what it sets:

  split_steps(episodes, tok)                 ep.step_starts [n]: the token where step i begins
  train.logprobs_and_values, for each chunk of episodes (a prompt's responses stay together):
    rollout.old_logprobs(model, chunk, ...)  ep.old_logp [T]; it returns the pass's KV cache,
                                             whose row e holds chunk[e]
    mc_values(model, chunk, cache, ...)      ep.step_values [n]: V_hat(s_i) for each step start
      distinct_states                          each distinct state once, as (e, b): chunk[e]
                                               with its response cut before token b
      state_rewards                            wanted[state] continuations of each, K by default
      continuation_rewards                     the continuations sampled and graded
        rollout.sample_by_definition             the plain path (--no-fork), read it first:
                                                 generate, then generation.finish cuts rows
        fork.continue_from_cache                 the default: the same, forked from row e
        reward.response_reward                   R of the response prefix + a continuation
  ppo.assign_advantages -> episode_advantages  ep.advantages [T]: A_i on each token of step i
  ppo.ppo_update -> minibatch_step             collate puts the fields in [B, L-1] columns;
    masked_whiten, ppo_loss                    the advantages, whitened, weight the ratio

The cheaper settings (adaptive K, reuse, top-up), off by default, are in vine_cheaper.py.
"""
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import torch

import fork
import math_grader
import reward
import rollout


def split_steps(episodes: list[rollout.Episode], tok):
    """Set ep.step_starts, the token index where each reasoning step of the response begins.

    Under GSM8K's rule a step is a line with the '\\n' that ends it, and the answer line is a
    step of its own. The response `7+2=9\\n9-5=4\\n#### 4`, one token a character, is cut into
        steps        '7+2=9\\n' | '9-5=4\\n' | '#### 4'
        step_starts  [0, 6, 12]
    so s_0 is the prompt, s_1 the prompt + '7+2=9\\n', s_2 the prompt + '7+2=9\\n9-5=4\\n'.
    Whether a prefix is a state depends only on its own tokens, which keeps A_i unbiased
    (line_step_offsets says why). A response without an answer line that ends in '\n' and EOS
    has one more step, the EOS alone. MATH's rule cuts at sentences and lines
    (math_grader.math_step_offsets; docs/math.md), and it looks ahead, so on MATH the
    advantage is not exactly unbiased."""
    for ep in episodes:
        ep.step_starts = response_step_starts(tok, ep.response_ids, math=ep.math,
                                              boxed=ep.style == "boxed")


def response_step_starts(tok, response_ids: list[int], math: bool = False,
                         boxed: bool = False) -> list[int]:
    """The token index where each step of the response starts. The step rule cuts the text
    (GSM8K's: line_step_offsets, the answer on the line with \\boxed when boxed; MATH's, with
    math: sentences and lines, LaTeX kept whole); a token joins its first character's step
    (token_steps)."""
    # the text each token adds; "".join(texts) is the response's (token_texts, below the line)
    texts = token_texts(tok, response_ids)
    text = "".join(texts)
    offsets = (math_grader.math_step_offsets(text)[1:-1] if math
               else line_step_offsets(text, boxed))
    return token_steps(texts, offsets)


def line_step_offsets(text: str, boxed: bool = False) -> list[int]:
    """The character offsets where steps 1, 2, ... start: every '\\n' closes its step, unless
    the text before it is blank (leading empty lines join the first line) or already holds the
    answer ('####', or '\\boxed' with boxed).

    To change how steps are cut, change this function. A new rule must decide each offset
    from the text before it alone, as this one does. Why: take a token y of step i and h, the
    response before it. A_i = V(s_{i+1}) - V(s_i) on y gives y's exact policy-gradient term,
    E[(Q(h, y) - b(h)) grad log pi(y | h)], when
      (1) s_i is decided by h, so that V(s_i) is a baseline b(h), blind to y; and
      (2) E[V(s_{i+1}) | h, y] = E[R | h, y] = Q(h, y), which holds when whether a prefix
          is s_{i+1} is decided by that prefix (then V(s_{i+1}) = E[R | s_{i+1}] averages to
          E[R | h, y]).
    A rule that looks past the offset breaks one of them (docs/reference.md, Steps, works a
    3-token example). token_steps, the MC values and the fork need no change.
    test_every_newline_closing_its_step_is_exactly_unbiased runs this function on toy
    responses of 'a', '\\n', '####' and two ends; add a token your rule reads to its texts.
    Cases (steps split at the offsets):
        '\\na\\nb\\n#### 1'         \\na\\n | b\\n | #### 1        leading empty lines join
        'a\\n\\nb\\n#### 1'         a\\n | \\n | b\\n | #### 1     an empty line between: a step
        'a\\nb\\n'                 a\\n | b\\n                no answer: every line is a step
        'a\\n#### 1\\nb\\n#### 2'   a\\n | #### 1\\nb\\n#### 2   after the answer: one step"""
    blank = len(text) - len(text.lstrip())  # the leading blank characters
    answer_at = text.find("\\boxed" if boxed else "####")
    answered = lambda c: 0 <= answer_at < c  # the text before c holds the answer
    return [c + 1 for c, char in enumerate(text) if char == "\n" and c > blank
            and not answered(c)]


def token_steps(texts: list[str], opens: list[int]) -> list[int]:
    """Map the steps from characters to tokens: the token index where each step starts.

    `opens` holds the character offsets where steps 1, 2, ... start; step 0 starts at token 0.
    A token belongs to the step of its first character. A token like '\n#' that holds a
    step's closing '\n' and more stays in the step that '\n' closes:
        texts    '7'  '+2'  '.\n'  '9'  '\n#'  '###'  ' 4'     text '7+2.\n9\n#### 4'
        firsts    0    1     3      5    6      8      11      opens [5, 7]
        steps     0    0     0      1    1      2      2       step starts [0, 3, 5]
    test_step_split_of_one_byte_level_bpe_response_by_hand follows a real BPE response."""
    # each token's first character
    firsts = list(accumulate((len(t) for t in texts), initial=0))[:-1]
    steps = [bisect_right(opens, char) for char in firsts]  # steps opened at or before it
    return [0] + [t for t in range(1, len(steps)) if steps[t] != steps[t - 1]]


@dataclass(frozen=True)
class MCSettings:
    """How many continuations the MC values take (train.py's --mc-rollouts, --max-value-states)."""
    k: int                   # K, continuations per state
    max_states: int = 0      # states valued per response from s_0 on (0 = all); later take R


def mc_values(model, episodes: list[rollout.Episode], cache, sampling: rollout.Sampling,
              mc: MCSettings) -> Counter:
    """Set ep.step_values[i] to the mean reward of K continuations of each state s_i (§4):

        V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)    (unbiased for V(s_i) of the sampler)

    A state is the prompt plus the response up to a step start; each distinct one is valued
    once. Its K continuations are forked from `cache`, the old-log-prob pass over exactly these
    episodes (train.main's chunk), whose row e holds episodes[e]; with cache None each state is
    encoded afresh (rollout.sample_by_definition). A continuation is graded as the state's
    response prefix plus the continuation. States past the first mc.max_states get None
    (step_advantages puts R there). Returns the counts of states, continuations and their tokens."""
    states = distinct_states(episodes, mc.max_states)  # state tokens -> (episode e, step start b)
    # How many continuations each state gets: K each, as in the paper. To give a state its own
    # count, change it here (vine_cheaper's settings do); every state needs at least one.
    wanted = {key: mc.k for key in states}
    rewards, tokens = state_rewards(model, episodes, cache, states, wanted, sampling)
    for ep in episodes:
        ep.step_values = [None if key is None else sum(rewards[key]) / len(rewards[key])
                          for key in state_keys(ep, mc.max_states)]
    return Counter(mc_states=len(states), mc_continuations=sum(map(len, rewards.values())),
                   mc_tokens=tokens)


def distinct_states(episodes: list[rollout.Episode], max_states: int = 0) -> dict:
    """Map each distinct state's tokens (prompt + response up to a step start) to its first
    holder, (episode e, step start b), over the first max_states of each episode (0 = all)."""
    states = {}
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states or None]:
            states.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    return states


def state_keys(ep: rollout.Episode, max_states: int = 0) -> list:
    """The tokens of each state s_i of ep (prompt + response up to step i), or None past the
    first max_states (0 = no cap)."""
    capped = lambda i: max_states and i >= max_states
    return [None if capped(i) else tuple(ep.prompt_ids + ep.response_ids[:b])
            for i, b in enumerate(ep.step_starts)]


def state_rewards(model, episodes, cache, states: dict, wanted: dict, sampling):
    """Sample and grade wanted[state] continuations of each state, in one call of
    continuation_rewards; return {state: their rewards} and their token count.

    continuation_rewards samples the same number of rows for every state it is given, so
    a state that wants n continuations is given n times, one row each. When all states want
    the same K, as in mc_values, each is given once, with K rows."""
    todo = {key: n for key, n in wanted.items() if n > 0}
    counts = set(todo.values())
    if len(counts) == 1:  # every state wants K: each state once, K rows
        keys, k = list(todo), counts.pop()
    else:  # each state n times, one row each
        keys, k = [key for key, n in todo.items() for _ in range(n)], 1
    got, tokens = continuation_rewards(model, episodes, cache, states, keys, k, sampling)
    rewards = {key: [] for key in states}
    for key, key_rewards in zip(keys, got):
        rewards[key] += key_rewards
    return rewards, tokens


def continuation_rewards(model, episodes, cache, states: dict, keys: list, k: int, sampling):
    """Sample and grade k continuations of each state in keys.

    Returns their rewards, [len(keys)][k], and their token count. A continuation is what the
    policy samples after the state is encoded afresh: by definition when cache is None
    (rollout.sample_by_definition, train.py --no-fork), otherwise the same distribution faster,
    forked from the old-log-prob pass's cache in one batched call (fork.continue_from_cache).
    A continuation that did not stop within its budget scores 0. keys may name a state twice
    (state_rewards does, when states want different counts)."""
    # (e, b): the state is episodes[e]'s prompt + response[:b], and row e of the cache holds it
    holders = [states[key] for key in keys]
    # a continuation may add what the response's budget leaves after its first b tokens
    budgets = [sampling.max_new_tokens - b for _, b in holders]
    prefixes = [list(key) for key in keys]  # prompt + response up to the step start
    if cache is None:
        conts, finished = rollout.sample_by_definition(model, prefixes, k, budgets, sampling)
    else:
        conts, finished = fork.continue_from_cache(model, prefixes, k, budgets, sampling,
                                                   cache=cache, rows=[e for e, _ in holders])
    rewards = []
    for (e, b), continuations, stopped in zip(holders, conts, finished):
        prefix = episodes[e].response_ids[:b]
        rewards.append([reward.response_reward(episodes[e], prefix + c, sampling.tokenizer)
                        if f else 0.0 for c, f in zip(continuations, stopped)])
    return rewards, sum(len(c) for continuations in conts for c in continuations)


def step_advantages(values: list[float | None], outcome: float) -> list[float]:
    """Each step's advantage, from the step values and the outcome R (§4, gamma = 1):

        A_i = r_i + V(s_{i+1}) - V(s_i),   r_i = R [i = n-1],   V(s_n) = 0,   R = outcome
        A = [V(s_1) - V(s_0), ..., V(s_{n-1}) - V(s_{n-2}), R - V(s_{n-1})]

    n is the number of steps. A value None (a state past the cap) takes the return R, so the
    step before the first such state gets R - V(s_i), and every step after it gets 0 (whitened
    in the update like the rest)."""
    v = [outcome if x is None else x for x in values]
    return [v[i + 1] - v[i] for i in range(len(v) - 1)] + [outcome - v[-1]]


def episode_advantages(ep: rollout.Episode) -> torch.Tensor:
    """ep's [T] advantages, each step's A_i on every token of it (the KL term lives in the loss)."""
    step_adv = step_advantages(ep.step_values, ep.reward)
    return torch.tensor(token_advantages(ep.step_starts, step_adv, len(ep.response_ids)))


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    """Step i's advantage on each of its tokens, from starts[i] up to the next step's start."""
    ends = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, ends) for _ in range(hi - lo)]


# ---- the text of each token, which the step rule reads ------------------------------------------

def token_texts(tok, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded text: "".join(texts) is the text.

    Token t's text is what decoding ids[:t+1] adds to the text decoded so far. Decoding a token
    alone would not do: a SentencePiece token drops its leading space ('▁9' gives '9'), and
    a byte token can be a part of a character. While the decoded text ends in half a character
    ('\ufffd'), a token adds '', and the character goes to the token that completes it. On
    'a €.' in a byte-level BPE, '€' three byte tokens:
        token  decoded ids[:t+1]  its text
        'a'    'a'                'a'
        'Ġ'    'a '               ' '
        'â'    'a �'              ''        half a character: wait
        'Ĥ'    'a �'              ''
        '¬'    'a €'              '€'
        '.'    'a €.'             '.'
    Every prefix is decoded whole: simple, and quick next to sampling the response."""
    decode = tok.backend_tokenizer.decode if hasattr(tok, "backend_tokenizer") else tok.decode
    texts, shown = [], ""  # shown: the text decoded up to the last token that added one
    for t in range(len(ids)):
        text = decode(ids[: t + 1], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            texts.append("")
        else:
            texts.append(text[len(shown):])
            shown = text
    return texts
