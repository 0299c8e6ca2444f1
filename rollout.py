"""This file samples responses to prompts and computes their log-probs (arXiv 2410.01679v1, §3).

Each prompt is encoded once. Its KV cache is then forked k times, and HF `generate` samples a
response from each fork (fork.py). VinePPO's MC continuations take the same path. They start
from the cache of the old-log-prob pass, which holds every state of a response (vine.py).

The notation is shared with vine.py, value.py and ppo.py. A sequence is a prompt of P tokens
followed by a response of T tokens. s_i is the state before reasoning step i. The figure shows
which column holds what, for the prompt <s> q1 q2 (P = 3) and the response a b </s> (T = 3):

    column c      0     1     2     3     4     5
    ids           <s>   q1    q2    a     b     </s>   right-padded: column c holds token c
    logp          q1    q2    a     b     </s>         [B, L-1]: column c predicts token c+1
    action_mask   0     0     1     1     1            ppo.collate: the response's tokens
    critic                    V_0   V_1   V_2   V_3    value.py: the state ending at token c,
                                                       [B, L]

Every [B, L-1] tensor, such as the log-probs or the advantages, holds response token j's entry
at column P-1+j (response_columns). The critic's V_j, the value of the state before token j, is
at the same column.

Reading order: Sampling, Episode, sample_episodes, sample, old_logprobs, reference_logprobs,
response_logprobs, pad_right, token_logprobs, response_columns, per_response; helpers below.
"""
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

import batching
import fork
import generation
import reward

LOGPROB_CHUNK_TOKENS = 1024  # positions per log-softmax (a 32k vocabulary: 128 MiB per fp32 copy)


@dataclass(frozen=True)
class Sampling:
    """The settings for sampling responses, MC continuations and evaluation answers.

    They come from train.py's --temperature, --top-p, --max-new-tokens and --max-batch-tokens.
    Evaluation replaces the temperature with its own."""
    temperature: float   # T: sample softmax(logits / T). Every log-prob divides by T too. 0: greedy
    top_p: float         # nucleus sampling, which the log-probs do not model (exact at 1.0)
    max_new_tokens: int  # a response's token budget. An MC continuation's is this minus its prefix
    eos_id: int          # the id a finished response ends in (the stop string's cut appends it)
    pad_id: int
    stop: str | None = None        # a string that ends a response and is cut off (reward.STOP)
    tokenizer: object = None       # decodes text, for the stop string and for grading
    max_batch_tokens: int = 65536  # one generate call's budget, rows x (prefix + new tokens)
    eos_ids: tuple[int, ...] = ()  # more ids that end a response (generation config, chat turn)
    fork: bool = True              # False (--no-fork): sample everything by sample_by_definition

    @property
    def stops(self) -> tuple[int, ...]:
        """Every id that ends a response, eos_id first."""
        return tuple(dict.fromkeys((self.eos_id, *self.eos_ids)))


@dataclass
class Episode:
    """One sampled response and everything computed from it, in token space.

    T is len(response_ids), and n is the number of steps. For each field, the table gives the
    function that sets it, with its phase of train.py's loop in parentheses, and who reads it:

    field          shape / type  set by (phase)                          read by
    prompt_ids     list [P]      sample_episodes (2), the problem's      every forward pass
    response_ids   list [T]      sample_episodes (2); EOS if it stopped  every forward pass
                                 (a stop string's EOS is appended, not sampled, yet trained on)
    gold, question str           sample_episodes (2), the problem's      grading
    math           bool          sample_episodes (2): a MATH problem     grading, split_steps
    group          int           sample_episodes (2): its prompt's index GRPO, group_chunks
    finished       bool          sample_episodes (2): stopped in budget  its reward (else 0)
    reward         float         sample_episodes (2): reward.py          advantages, critic
    step_starts    list [n]      vine.split_steps (3)                    mc_values, advantages
    old_logp       tensor [T]    old_logprobs (4)                        ppo.ppo_update (ratio)
    step_values    list [n]      vine.mc_values (5); None past the cap   episode_advantages
    step_counts    list [n]      vine_cheaper.mc_values (5, reuse)       reuse_advantages
    critic_values  tensor [T]    value.critic_values (5, PPO/TPPO)       ppo.gae, critic loss
    advantages     tensor [T]    ppo.assign_advantages (6)               ppo.ppo_update
    returns        tensor [T]    ppo.assign_advantages (6, PPO/TPPO)     the critic's loss
    ref_logp       tensor [T]    reference_logprobs (7)                  ppo.ppo_update (KL)
    """
    prompt_ids: list[int]    # BOS + prompt tokens
    response_ids: list[int]  # sampled tokens, EOS included when the policy stopped
    gold: str                # the problem's answer field, for grading
    group: int               # index of the prompt in this iteration's batch
    finished: bool           # stopped (EOS or the stop string) within the token budget
    reward: float = 0.0
    step_starts: list[int] = field(default_factory=list)    # token index of each step's start
    step_values: list[float] = field(default_factory=list)  # V_hat(s_0..s_{n-1}), s_0 = prompt
    step_counts: list[int] = field(default_factory=list)    # the samples behind each (reuse)
    advantages: torch.Tensor | None = None     # [T] one per response token
    old_logp: torch.Tensor | None = None       # [T] log-probs under the sampling policy
    ref_logp: torch.Tensor | None = None       # [T] log-probs under the reference model
    critic_values: torch.Tensor | None = None  # [T] the critic's V before each response token
    returns: torch.Tensor | None = None        # [T] the critic's regression targets
    question: str = ""                         # the problem (MATH's grader reads it)
    math: bool = False                         # a MATH problem: MATH's grader and steps
    style: str = "hash"                        # GSM8K's answer style (--answer): hash | boxed


def sample_episodes(model, problems: list[dict], k: int, sampling: Sampling) -> list[Episode]:
    """Sample k responses to each problem and grade them. An unfinished response scores 0."""
    prompts = [p["prompt_ids"] for p in problems]
    conts, finished = sample(model, prompts, k, [sampling.max_new_tokens] * len(prompts),
                             sampling)
    episodes = [Episode(p["prompt_ids"], c, p["answer"], group, f, question=p["question"],
                        math=p.get("math", False), style=p.get("style", "hash"))
                for group, (p, cs, fs) in enumerate(zip(problems, conts, finished))
                for c, f in zip(cs, fs)]
    for ep in episodes:
        ep.reward = 0.0
        if ep.finished:
            ep.reward = reward.response_reward(ep, ep.response_ids, sampling.tokenizer)
    return episodes


@torch.no_grad()
def sample_by_definition(model, states: list[list[int]], k: int, budgets: list[int],
                         sampling):
    """Sample k continuations of each state by definition, with a finished flag for each.

    Both results are [n][k]. A state is a prompt, or in VinePPO a prompt + response prefix.
    Each state is encoded afresh, and `generate` samples k rows of what follows it.
    First each budget is cut to what the model's context leaves (generation.within_context).
    Then generation.finish cuts each row after its end id, to its budget, and before the stop
    string. A row is finished when it stopped by itself."""
    budgets = generation.within_context(model, states, budgets)
    device, conts, finished = next(model.parameters()).device, [], []
    for state, budget in zip(states, budgets):
        ids = torch.tensor([state] * k, device=device)  # [k, len(state)]
        new = [[] for _ in range(k)]
        if budget > 0:
            new = generation.generate(model, sampling, input_ids=ids, max_new_tokens=budget,
                                      attention_mask=torch.ones_like(ids))[:, len(state):].tolist()
        rows = [generation.finish(row, budget, sampling.stops, sampling.tokenizer,
                                  sampling.stop, state) for row in new]
        conts.append([row for row, _ in rows])
        finished.append([done for _, done in rows])
    return conts, finished


@torch.no_grad()
def sample(model, prefixes: list[list[int]], k: int, budgets: list[int], sampling: Sampling):
    """Sample k continuations of each prefix, with a finished flag for each ([n][k]).

    By definition this is sample_by_definition, which it runs under --no-fork. Otherwise it
    samples the same distribution faster. Each prefix is encoded once, in the batch it will
    decode in. Then that batch's cache is forked k times (fork.continue_from_cache)."""
    if not prefixes:  # e.g. a process whose share of a small evaluation set is empty
        return [], []
    if not sampling.fork:
        return sample_by_definition(model, prefixes, k, budgets, sampling)
    budgets = generation.within_context(model, prefixes, budgets)
    device = next(model.parameters()).device
    conts, finished = [None] * len(prefixes), [None] * len(prefixes)
    for part in batching.least_padding(list(map(len, prefixes)), budgets, [k] * len(prefixes),
                                       sampling.max_batch_tokens, batching.batch_overhead(model)):
        ids, mask = pad_right([prefixes[j] for j in part], sampling.pad_id, device)
        # `cache` is the pass's KV cache, what transformers 4 called past_key_values
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1).cache
        c, f = fork.continue_from_cache(model, [prefixes[j] for j in part], k,
                                        [budgets[j] for j in part], sampling, cache=cache,
                                        rows=list(range(len(part))))
        for j, cj, fj in zip(part, c, f):
            conts[j], finished[j] = cj, fj
    return conts, finished


@torch.no_grad()
def old_logprobs(model, episodes: list[Episode], temperature: float, pad_id: int,
                 keep_cache: bool = False):
    """Set each ep.old_logp ([T]) with one forward pass over the episodes.

    With keep_cache it returns the pass's KV cache, for VinePPO to fork. Otherwise it returns
    None. Row e of the cache holds episodes[e]. Attention is causal, so the keys and values of a
    state's tokens in this pass are those the state would have alone. Hence every state of a
    response is already in the response's row."""
    logps, cache = response_logprobs(model, episodes, temperature, pad_id, keep_cache)
    for ep, lp in zip(episodes, logps):
        ep.old_logp = lp
    return cache


def reference_logprobs(ref, episodes: list[Episode], temperature: float, pad_id: int,
                       batch_tokens: int):
    """Set each ep.ref_logp ([T]) under the frozen reference model, once per iteration.

    It runs before the epochs, so the KL's target stays put during the update.
    See docs/reference.md."""
    for chunk in batching.group_chunks(episodes, batch_tokens):
        for ep, lp in zip(chunk, response_logprobs(ref, chunk, temperature, pad_id)[0]):
            ep.ref_logp = lp


@torch.no_grad()
def response_logprobs(model, episodes: list[Episode], temperature: float, pad_id: int,
                      keep_cache=False):
    """Log-probs of each episode's response tokens ([T] each), and the KV cache or None."""
    ids, mask = pad_right([ep.prompt_ids + ep.response_ids for ep in episodes], pad_id,
                          next(model.parameters()).device)
    logp, cache = token_logprobs(model, ids, mask, temperature, keep_cache)
    return per_response(logp, episodes), cache


def pad_right(seqs: list[list[int]], pad_id: int, device=None):
    """Right-pad the sequences into ids [B, L] and a mask.

    Each row's token t is in column t. fork.fork relies on this."""
    rows = [torch.tensor(s, dtype=torch.long) for s in seqs]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True)
    return ids.to(device), mask.to(device)


def token_logprobs(model, ids, mask, temperature: float, keep_cache: bool = False):
    """Compute log pi(x_{t+1} | x_<=t) under softmax(logits / T), [B, L-1], and the KV cache.

    Column t predicts token t+1, as in the figure at the top. The logits are divided by the
    sampling temperature T, as the reference does (docs/reference.md)."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=keep_cache)
    logp = chosen_logprobs(out.logits[:, :-1], ids[:, 1:], temperature)
    # out.cache: transformers 5's name for what transformers 4 called past_key_values
    return logp, (out.cache if keep_cache else None)


def response_columns(ep) -> slice:
    """The columns of ep's response tokens in a [B, L-1] tensor, token j at column P-1+j."""
    return slice(len(ep.prompt_ids) - 1, len(ep.prompt_ids) - 1 + len(ep.response_ids))


def per_response(logp, episodes):
    """Cut a [B, L-1] tensor into one [T] tensor per episode, its response tokens' entries."""
    return [logp[i, response_columns(ep)].cpu() for i, ep in enumerate(episodes)]


# ---- engineering: the pad id, log-softmax in pieces (skip on a first reading) ---------------


def pad_id(tok) -> int:
    """Return the tokenizer's pad id, or its EOS id when it has none (Llama).

    Padding is masked anyway."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def chosen_logprobs(logits, targets, temperature: float, chunk_tokens: int = LOGPROB_CHUNK_TOKENS):
    """Return log_softmax(logits / T) at each target, in fp32 or wider.

    It works a few positions at a time, so two fp32 copies of all the logits never exist at once."""
    step = max(1, chunk_tokens // logits.shape[0])
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32 (float64 stays)
    pieces = []
    for lo in range(0, logits.shape[1], step):
        scaled = logits[:, lo: lo + step].to(dtype) / temperature
        chosen = scaled.log_softmax(-1).gather(-1, targets[:, lo: lo + step, None])
        pieces.append(chosen.squeeze(-1))
    return torch.cat(pieces, 1)
