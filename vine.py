"""This file computes VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679v1, §4).

Each response is cut into reasoning steps. The state s_i is the prompt plus the response up
to the start of step i. From each state the policy samples K more continuations. The mean of
their rewards estimates V(s_i) (mc_values). Every token of step i then takes the advantage A_i,
the change of that estimate over the step (step_advantages).

A continuation is what `generate` samples after the state is encoded afresh. That is its
definition, and rollout.sample_by_definition samples it that way. fork.py samples the same
distribution faster, from the KV cache of the old-log-prob pass.
docs/mc-values-by-definition.md computes the values by the definition alone.

The path of one MC value, as train.main runs it. On each line, a call, then what it does:

  split_steps(episodes, tok)                 sets ep.step_starts [n], the token where step i begins
  train.logprobs_and_values                  runs the next two calls on each chunk of episodes
                                             (a chunk keeps a prompt's responses together)
    rollout.old_logprobs(model, chunk, ...)  sets ep.old_logp [T] and returns the pass's KV cache.
                                             Row e of the cache holds chunk[e]
    mc_values(model, chunk, cache, ...)      sets ep.step_values [n], V_hat(s_i) of each state
      distinct_states                          lists each distinct state once, by its holder (e, b):
                                               the state is chunk[e]'s prompt + response[:b]
      state_rewards                            asks for wanted[state] continuations, K by default
      continuation_rewards                     samples and grades the continuations, with:
        rollout.sample_by_definition             the plain path (--no-fork), to read first.
                                                 generate samples, and generation.finish cuts rows
        fork.continue_from_cache                 the default: the same, forked from cache row e
        reward.response_reward                   R of the response prefix + a continuation
  ppo.assign_advantages -> episode_advantages  sets ep.advantages [T], A_i on each token of step i
  ppo.ppo_update -> minibatch_step             collate puts the fields in [B, L-1] columns
    masked_whiten, ppo_loss                    the whitened advantages weight the ratio

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

    GSM8K's rule makes each line a step, with the '\\n' that ends it. The answer line is a step
    of its own. With one token per character, the response `7+2=9\\n9-5=4\\n#### 4` is cut into
        steps        '7+2=9\\n' | '9-5=4\\n' | '#### 4'
        step_starts  [0, 6, 12]
    So s_0 is the prompt, s_1 the prompt + '7+2=9\\n', and s_2 the prompt + '7+2=9\\n9-5=4\\n'.
    Whether a prefix is a state depends only on the prefix's own tokens. This keeps A_i
    unbiased, and line_step_offsets says why. A response that has no answer line and ends in
    '\\n' and EOS has one more step, the EOS alone.
    MATH's rule cuts at sentences and lines (math_grader.math_step_offsets). It looks ahead, so
    on MATH the advantage is not exactly unbiased. See docs/math.md."""
    for ep in episodes:
        ep.step_starts = response_step_starts(tok, ep.response_ids, math=ep.math,
                                              boxed=ep.style == "boxed")


def response_step_starts(tok, response_ids: list[int], math: bool = False,
                         boxed: bool = False) -> list[int]:
    """Return the token index where each step of the response starts.

    First a step rule cuts the response's text at character offsets. Without math it is GSM8K's
    rule, line_step_offsets; with boxed, the answer is the line with \\boxed. With math it is
    MATH's rule, which cuts at sentences and lines and keeps LaTeX whole. Then token_steps puts
    each token in the step of its first character."""
    # the text each token adds, so "".join(texts) is the response's text (token_texts, below)
    texts = token_texts(tok, response_ids)
    text = "".join(texts)
    offsets = (math_grader.math_step_offsets(text)[1:-1] if math
               else line_step_offsets(text, boxed))
    return token_steps(texts, offsets)


def line_step_offsets(text: str, boxed: bool = False) -> list[int]:
    """Return the character offsets where steps 1, 2, ... start.

    Every '\\n' closes its step, with two exceptions. A '\\n' with only blank text before it
    closes nothing, so leading empty lines join the first line. A '\\n' after the answer
    ('####', or '\\boxed' with boxed) closes nothing either.

    To change how steps are cut, change this function; token_steps, the MC values and the fork
    need no change. A new rule must decide each offset from the text before it alone, as this
    one does. Here is why. Take a token y of step i, and let h be the response before y.
    A_i = V(s_{i+1}) - V(s_i) on y gives y's exact policy-gradient term,
    E[(Q(h, y) - b(h)) grad log pi(y | h)], when both of these hold:
      (1) h decides s_i. Then V(s_i) is a baseline b(h), blind to y.
      (2) E[V(s_{i+1}) | h, y] = E[R | h, y] = Q(h, y). This holds when each prefix alone decides
          whether it is s_{i+1}, since then V(s_{i+1}) = E[R | s_{i+1}] averages to E[R | h, y].
    A rule that looks past the offset breaks one of them.
    Cases (steps split at the offsets):
        '\\na\\nb\\n#### 1'         \\na\\n | b\\n | #### 1        leading empty lines join
        'a\\n\\nb\\n#### 1'         a\\n | \\n | b\\n | #### 1     an empty line between: a step
        'a\\nb\\n'                 a\\n | b\\n                no answer: every line is a step
        'a\\n#### 1\\nb\\n#### 2'   a\\n | #### 1\\nb\\n#### 2   after the answer: one step
    That this rule is exactly unbiased is checked by
    test_every_newline_closing_its_step_is_exactly_unbiased, on toy responses made of the
    tokens 'a', '\\n', '####' and a right and a wrong ending. If your rule reads another token,
    add it there.
    docs/reference.md (Steps) works a 3-token example."""
    blank = len(text) - len(text.lstrip())  # the leading blank characters
    answer_at = text.find("\\boxed" if boxed else "####")
    answered = lambda c: 0 <= answer_at < c  # the text before c holds the answer
    return [c + 1 for c, char in enumerate(text) if char == "\n" and c > blank
            and not answered(c)]


def token_steps(texts: list[str], opens: list[int]) -> list[int]:
    """Map the steps from characters to tokens, and return the token index where each starts.

    `opens` holds the character offsets where steps 1, 2, ... start. Step 0 starts at token 0.
    A token belongs to the step of its first character. So a token like '\\n#', which holds a
    step's closing '\\n' and more, stays in the step that its '\\n' closes:
        texts    '7'  '+2'  '.\\n'  '9'  '\\n#'  '###'  ' 4'     text '7+2.\\n9\\n#### 4'
        firsts    0    1     3       5    6       8      11      opens [5, 7]
        steps     0    0     0       1    1       2      2       step starts [0, 3, 5]
    Checked on a real BPE response by test_step_split_of_one_byte_level_bpe_response_by_hand."""
    # each token's first character
    firsts = list(accumulate((len(t) for t in texts), initial=0))[:-1]
    steps = [bisect_right(opens, char) for char in firsts]  # steps opened at or before it
    return [0] + [t for t in range(1, len(steps)) if steps[t] != steps[t - 1]]


@dataclass(frozen=True)
class MCSettings:
    """How many continuations the MC values take (train.py's --mc-rollouts, --max-value-states)."""
    k: int                   # K, continuations per state
    max_states: int = 0      # MC-valued states per response, from s_0 on (0 = all); the rest: R


def mc_values(model, episodes: list[rollout.Episode], cache, sampling: rollout.Sampling,
              mc: MCSettings) -> Counter:
    """Set ep.step_values[i] to the mean reward of K continuations of state s_i (§4):

        V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)    (unbiased for V(s_i) of the sampler)

    A state is the prompt plus the response up to a step start. Each distinct state is valued
    once. `cache` is the KV cache of the old-log-prob pass over exactly these episodes (one chunk
    in train.main). Its row e holds episodes[e], and a state's K continuations are forked from
    it. With cache None, each state is encoded afresh (rollout.sample_by_definition).
    A continuation is graded as the state's response prefix followed by the continuation.
    States after the first mc.max_states get None, and step_advantages puts R there.
    Returns the counts of states, of continuations and of the continuations' tokens."""
    states = distinct_states(episodes, mc.max_states)  # state tokens -> (episode e, step start b)
    # How many continuations each state gets: K each, as in the paper. To give a state its own
    # count, change it here, as vine_cheaper's settings do. Every state needs at least one.
    wanted = {key: mc.k for key in states}
    rewards, tokens = state_rewards(model, episodes, cache, states, wanted, sampling)
    for ep in episodes:
        ep.step_values = [None if key is None else sum(rewards[key]) / len(rewards[key])
                          for key in state_keys(ep, mc.max_states)]
    return Counter(mc_states=len(states), mc_continuations=sum(map(len, rewards.values())),
                   mc_tokens=tokens)


def distinct_states(episodes: list[rollout.Episode], max_states: int = 0) -> dict:
    """Map each distinct state's tokens to its holder (e, b).

    A state's tokens are the prompt + the response up to a step start. Its holder is the first
    episode e that has the state, and the step start b there. So the state is episodes[e]'s
    prompt + response[:b]. Only the first max_states states of each episode count (0 = all)."""
    states = {}
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states or None]:
            states.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    return states


def state_keys(ep: rollout.Episode, max_states: int = 0) -> list:
    """Return the tokens of each state s_i of ep, the prompt + the response up to step i.

    States after the first max_states get None instead (0 = no cap)."""
    capped = lambda i: max_states and i >= max_states
    return [None if capped(i) else tuple(ep.prompt_ids + ep.response_ids[:b])
            for i, b in enumerate(ep.step_starts)]


def state_rewards(model, episodes, cache, states: dict, wanted: dict, sampling):
    """Sample and grade wanted[state] continuations of each state.

    Returns {state: the rewards of its continuations} and the continuations' token count.
    It makes one call of continuation_rewards, which samples the same number of rows for every
    state it is given. So a state that wants n continuations is given n times, one row each.
    When all states want the same K, as in mc_values, each is given once, with K rows."""
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

    Returns their rewards, [len(keys)][k], and their token count.
    A continuation is what the policy samples after the state is encoded afresh. With cache
    None it is sampled that way, by definition (rollout.sample_by_definition, --no-fork).
    Otherwise fork.continue_from_cache samples the same distribution faster, in one batched
    call, forked from the old-log-prob pass's cache.
    A continuation that did not stop within its budget scores 0.
    keys may name a state twice. state_rewards does so when states want different counts."""
    # each state's holder (e, b): the state is episodes[e]'s prompt + response[:b], and row e
    # of the cache holds episodes[e]
    holders = [states[key] for key in keys]
    # a continuation's budget: the response's budget, max_new_tokens, less the b tokens before
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
    """Return each step's advantage, from the step values and the outcome R (§4, gamma = 1):

        A_i = r_i + V(s_{i+1}) - V(s_i),   r_i = R [i = n-1],   V(s_n) = 0,   R = outcome
        A = [V(s_1) - V(s_0), ..., V(s_{n-1}) - V(s_{n-2}), R - V(s_{n-1})]

    n is the number of steps. A state past the cap has the value None, and it takes the return
    R instead. So the step before the first such state gets R - V(s_i), and every step after it
    gets 0. The update whitens these zeros like the other advantages."""
    v = [outcome if x is None else x for x in values]
    return [v[i + 1] - v[i] for i in range(len(v) - 1)] + [outcome - v[-1]]


def episode_advantages(ep: rollout.Episode) -> torch.Tensor:
    """Return ep's [T] advantages: each step's A_i, on every token of that step.

    The KL term is not here. It is part of the loss (ppo.ppo_loss)."""
    step_adv = step_advantages(ep.step_values, ep.reward)
    return torch.tensor(token_advantages(ep.step_starts, step_adv, len(ep.response_ids)))


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    """Put step i's advantage on each of its tokens, from starts[i] up to the next step's start."""
    ends = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, ends) for _ in range(hi - lo)]


# ---- the text of each token, which the step rule reads ------------------------------------------

def token_texts(tok, ids: list[int]) -> list[str]:
    """Return the text each token adds to the decoded text, so "".join(texts) is that text.

    Token t's text is what decoding ids[:t+1] adds to the text decoded so far. Decoding each
    token alone would not work, for two reasons. A SentencePiece token drops its leading space
    ('▁9' gives '9'). And a byte token can be a part of a character. While the decoded text
    ends in half a character ('\ufffd'), a token adds ''. The whole character goes to the token
    that completes it. Here is 'a €.' in a byte-level BPE, where '€' is three byte tokens:
        token  decoded ids[:t+1]  its text
        'a'    'a'                'a'
        'Ġ'    'a '               ' '
        'â'    'a �'              ''        half a character: wait
        'Ĥ'    'a �'              ''
        '¬'    'a €'              '€'
        '.'    'a €.'             '.'
    Decoding every prefix whole is simple, and quick next to sampling the response."""
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
