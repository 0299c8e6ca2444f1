"""This file computes VinePPO's MC values from fewer continuations: adaptive K, reuse, top-up.

vine.mc_values is the paper's estimator, K continuations of every state. The settings here,
all off by default, change how many continuations a state gets and which rewards its mean
takes. With any of them on, train.value_with_mc calls mc_values below instead, and with reuse
ppo.assign_advantages takes reuse_advantages.

- adaptive K (--mc-max-rollouts) samples more continuations while a value's 95% interval is
  wide, by the reference's rule (more_rollouts; docs/reference.md);
- reuse (--mc-reuse) counts each sampled response as one more continuation of every state it
  passes through, never in the baseline of its own steps (reuse_step_advantages). Under
  GSM8K's rule this stays exactly unbiased, as a state is decided by its own tokens
  (vine.split_steps); MATH's rule looks ahead, so there it is not;
- top-up (--mc-top-up, with reuse) gives a state only what brings it to K samples.
docs/experiments.md measures what each buys.
"""
from collections import Counter
from dataclasses import dataclass

import torch

import rollout
import vine


@dataclass(frozen=True)
class CheaperSettings:
    """The cheaper settings (train.py's --mc-* flags); vine.MCSettings holds K and the cap."""
    max_k: int = 0           # adaptive K up to max_k (0 = off)
    increment: int = 4       # adaptive K: continuations added per round
    ci_width: float = 0.05   # adaptive K: stop when the 95% interval of V_hat is this narrow
    reuse: bool = False      # each response is one more sample of the states it passes
    top_up: bool = False     # with reuse: a state gets only what brings it to K samples

    def on(self) -> bool:
        return bool(self.max_k or self.reuse or self.top_up)


def mc_values(model, episodes: list[rollout.Episode], cache, sampling: rollout.Sampling,
              mc: vine.MCSettings, cheaper: CheaperSettings) -> Counter:
    """vine.mc_values with the cheaper settings: set ep.step_values, and with reuse ep.step_counts.

    - adaptive K (max_k > 0) samples K first, then `increment` more while the 95% interval of
      the mean is wider than ci_width, up to max_k (more_rollouts);
    - with reuse, each sampled response is one more continuation of every state it passes
      through and joins their values, except as the baseline of its own steps (ep.step_counts;
      see reuse_step_advantages). Under GSM8K's rule the advantage stays exactly unbiased,
      as states are decided by their own tokens
      (test_every_newline_closing_its_step_is_exactly_unbiased);
    - with top_up (and reuse), a state gets only the continuations that bring its baselines to
      K samples, K minus the other responses through it (0 for the prompt of a group of K + 1)."""
    if cheaper.top_up and (cheaper.max_k or not cheaper.reuse):
        raise ValueError("top_up needs reuse, and counts the responses as continuations: "
                         "not with max_k")
    states = vine.distinct_states(episodes, mc.max_states)
    through = responses_through(states, episodes) if cheaper.reuse else {}
    # K each, or with top-up what brings the state's baselines to K samples. A response's
    # baseline of a state holds the other responses through it (value_samples), and `through`
    # counts the response itself too
    others = lambda key: len(through[key]) - 1
    wanted = {key: max(0, mc.k - others(key)) if cheaper.top_up else mc.k for key in states}
    more = None  # how many more continuations a state gets after a round (adaptive K)
    if cheaper.max_k:
        more = lambda rewards: more_rollouts(rewards, cheaper.increment, cheaper.max_k,
                                             cheaper.ci_width)
    rewards, tokens = sampling_rounds(model, episodes, cache, states, wanted, sampling, more)
    for e, ep in enumerate(episodes):
        samples = [value_samples(key, e, rewards, through, episodes)
                   for key in vine.state_keys(ep, mc.max_states)]
        ep.step_values = [None if s is None else sum(s) / len(s) for s in samples]
        ep.step_counts = [None if s is None else len(s) for s in samples] if cheaper.reuse else []
    return Counter(mc_states=len(states), mc_continuations=sum(map(len, rewards.values())),
                   mc_tokens=tokens)


def reuse_step_advantages(values: list, outcome: float, counts: list) -> list[float]:
    """vine.step_advantages when the response is one more sample of V(s_{i+1}).
    With m = counts[i+1], the number of samples behind V_hat(s_{i+1}),

        A_i = r_i + (m V_hat(s_{i+1}) + R) / (m + 1) - V_hat(s_i),

    so E[A_i | s_i, a_i] = Q(s_i, a_i) - V(s_i) still. The response never joins V(s_i), the
    baseline of the step whose action it continues: that would shrink E[A_i] by m / (m + 1)."""
    v = [outcome if x is None else x for x in values]
    # V_hat(s_i) with the response joined as one more sample: (m V_hat + R) / (m + 1)
    joined = lambda i: (v[i] if values[i] is None
                        else (counts[i] * v[i] + outcome) / (counts[i] + 1))
    return [joined(i + 1) - v[i] for i in range(len(v) - 1)] + [outcome - v[-1]]


def episode_step_advantages(ep: rollout.Episode, reuse: bool) -> list[float]:
    """ep's A_i, one per step, by vine.step_advantages or, with reuse, reuse_step_advantages."""
    if reuse:
        return reuse_step_advantages(ep.step_values, ep.reward, ep.step_counts)
    return vine.step_advantages(ep.step_values, ep.reward)


def reuse_advantages(ep: rollout.Episode) -> torch.Tensor:
    """vine.episode_advantages with reuse: the [T] advantages, each step's on its tokens."""
    step_adv = reuse_step_advantages(ep.step_values, ep.reward, ep.step_counts)
    return torch.tensor(vine.token_advantages(ep.step_starts, step_adv, len(ep.response_ids)))


def value_samples(key, e: int, rewards: dict, through: dict, episodes) -> list[float] | None:
    """The rewards behind episode e's V_hat of state `key` (None past the cap): its
    continuations' and, with reuse, those of the other responses through it (never e's own,
    which continues this state's action)."""
    if key is None:
        return None
    return rewards[key] + [episodes[o].reward for o in through.get(key, ()) if o != e]


def more_rollouts(rewards: list[float], increment: int, max_k: int, ci_width: float) -> int:
    """How many more continuations a state gets, by the reference's adaptive rule
    (docs/reference.md).

    - `increment` at a time while n < max_k and the 95% interval of the mean p of n rewards
      in [0, 1], 2 * 1.96 * sqrt(p (1 - p) / n), is wider than ci_width;
    - the last round is cut to end at max_k;
    - rounds after which no outcome could stop are taken at once (same counts, fewer calls).
    Sequential stopping biases the mean toward the ends, as a state stops early only when its
    first rewards agree (test_vine.py's test_adaptive_bias_and_cost_enumerated_exactly)."""
    width = lambda total, n: 2 * 1.96 * (max(0.0, total / n * (1 - total / n)) / n) ** 0.5
    n, total = len(rewards), sum(rewards)
    if n >= max_k or width(total, n) <= ci_width:
        return 0
    m = n + increment
    # p (1 - p) is concave in the new total, in [total, total + m - n]: least width at an end
    while m < max_k and min(width(total, m), width(total + m - n, m)) > ci_width:
        m += increment
    return min(m, max_k) - n


def responses_through(states: dict, episodes: list[rollout.Episode]) -> dict:
    """Map each state's tokens to the episodes of its prompt whose prompt + response begins
    with them. A response through a state is a continuation of it sampled by the policy."""
    seqs = [tuple(ep.prompt_ids + ep.response_ids) for ep in episodes]
    groups = {}  # prompt -> its episodes; a state is matched against its own prompt's only
    for o, ep in enumerate(episodes):
        groups.setdefault(ep.group, []).append(o)
    return {key: [o for o in groups[episodes[e].group] if seqs[o][:len(key)] == key]
            for key, (e, _) in states.items()}


def sampling_rounds(model, episodes, cache, states: dict, wanted: dict, sampling, more=None):
    """Sample wanted[state] continuations of each state, then more(rewards) more while positive;
    return {state: its continuations' rewards} and their token count. Each round is one call
    of vine.state_rewards."""
    rewards, tokens = {key: [] for key in states}, 0
    todo = {key: n for key, n in wanted.items() if n > 0}
    while todo:
        got, new_tokens = vine.state_rewards(model, episodes, cache, states, todo, sampling)
        for key in todo:
            rewards[key] += got[key]
        tokens += new_tokens
        todo = {key: more(rewards[key]) for key in todo} if more else {}
        todo = {key: n for key, n in todo.items() if n > 0}
    return rewards, tokens
