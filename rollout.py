"""Sampling, and VinePPO's environment reset (§3): the forward pass over whole trajectories that gives the
old log-probs holds every prefix's keys and values, so a state s_i is reset to by copying its columns of
that KV cache, K times, into buffers with room to decode on (fork), and `generate` samples on from there.

Needs: reward.py (a text's reward), batching.py (batches of least padding). Algorithm: Sampling, Episode,
sample_episodes, sample, fork, old_logprobs, reference_logprobs; below the engineering line: the stop rule,
caches that cannot be forked, the cache buffers and log-softmax in pieces, which a first reading may skip."""
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

import batching
import reward

LOGPROB_CHUNK_TOKENS = 1024  # positions per log-softmax: at a 32k vocabulary, 128 MiB per fp32 copy
FORK_METHODS = ("copy", "gather")


@dataclass(frozen=True)
class Sampling:
    """How responses, MC continuations and evaluation answers are sampled (train.py's --temperature,
    --top-p, --max-new-tokens, --max-batch-tokens; evaluation replaces the temperature)."""
    temperature: float        # softmax(logits / T); every log-prob divides its logits by T too; 0: greedy
    top_p: float              # nucleus sampling; the log-probs do not model it (1.0 samples the policy exactly)
    max_new_tokens: int       # a response's token budget; an MC continuation has what its prefix leaves
    eos_id: int               # the id a finished response ends in (the stop string's cut appends it)
    pad_id: int
    stop: str | None = None   # a string that ends a response (reward.STOP), cut off with what follows it
    tokenizer: object = None  # decodes: for the stop string and for grading
    max_batch_tokens: int = 65536  # one generate call's budget: rows x (prefix + new tokens)
    eos_ids: tuple[int, ...] = ()  # more ids that end a response: the generation config's, a chat turn's end

    @property
    def stops(self) -> tuple[int, ...]:
        """Every id that ends a response, eos_id first."""
        return tuple(dict.fromkeys((self.eos_id, *self.eos_ids)))


@dataclass
class Episode:
    """One sampled response and everything computed from it, all in token space. T = len(response_ids),
    n = number of steps. Who fills what, in the order of train.py's loop:

    field          shape / type       set by (phase)                              read by
    prompt_ids     list [P]           sample_episodes (2), from the problem       every forward pass
    response_ids   list [T]           sample_episodes (2); EOS when it stopped    every forward pass
    gold, question str                sample_episodes (2), from the problem       response_reward
    math           bool               sample_episodes (2): a MATH problem          response_reward, split_steps
    group          int                sample_episodes (2): its prompt's index      GRPO, group_chunks
    finished       bool               sample_episodes (2): stopped within budget   its reward (else 0)
    reward         float              sample_episodes (2): response_reward         advantages, critic loss
    step_starts    list [n]           vine.split_steps (3)                        vine.mc_values, advantages
    old_logp       tensor [T]         old_logprobs (4)                            ppo.ppo_update (ratio)
    step_values    list [n]           vine.mc_values (5, VinePPO); None past cap  vine.episode_advantages
    step_counts    list [n]           vine.mc_values (5, with reuse): samples     vine.episode_advantages
    critic_values  tensor [T]         value.critic_values (5, PPO/TPPO)           ppo.gae, the critic's loss
    advantages     tensor [T]         ppo.assign_advantages (6)                   ppo.ppo_update
    returns        tensor [T]         ppo.assign_advantages (6, PPO/TPPO)         the critic's loss
    ref_logp       tensor [T]         reference_logprobs (7)                      ppo.ppo_update (KL)
    """
    prompt_ids: list[int]      # BOS + prompt tokens
    response_ids: list[int]    # sampled tokens, EOS included when the policy stopped
    gold: str                  # the problem's answer field, for grading
    group: int                 # index of the prompt in this iteration's batch
    finished: bool             # stopped (EOS or the stop string) within the token budget
    reward: float = 0.0
    step_starts: list[int] = field(default_factory=list)   # token index where each step starts
    step_values: list[float] = field(default_factory=list)  # V_hat(s_0..s_{n-1}) by MC, s_0 = prompt only
    step_counts: list[int] = field(default_factory=list)    # the samples behind each (reuse only)
    advantages: torch.Tensor | None = None                 # [T] one per response token
    old_logp: torch.Tensor | None = None                   # [T] log-probs under the sampling policy
    ref_logp: torch.Tensor | None = None                   # [T] log-probs under the reference
    critic_values: torch.Tensor | None = None              # [T] critic's V(s_t) before each token
    returns: torch.Tensor | None = None                    # [T] critic's regression targets
    question: str = ""                                     # the problem (MATH's grader reads it)
    math: bool = False                                     # a MATH problem: MATH's grader and steps
    style: str = "hash"                                    # GSM8K's answer style (--answer): hash | boxed


def response_reward(ep: Episode, response_ids: list[int], tokenizer) -> float:
    """R of a whole response (ep's own, or a prefix of it and a continuation) to ep's problem: reward.grade."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    return reward.grade(text, ep.gold, ep.question, ep.math, ep.style)


def sample_episodes(model, problems: list[dict], k: int, sampling: Sampling) -> list[Episode]:
    """k responses to each problem, graded (an unfinished response scores 0)."""
    prompts = [p["prompt_ids"] for p in problems]
    conts, done = sample(model, prompts, k, [sampling.max_new_tokens] * len(prompts), sampling)
    episodes = [Episode(p["prompt_ids"], c, p["answer"], group, f, question=p["question"],
                        math=p.get("math", False), style=p.get("style", "hash"))
                for group, (p, cs, fs) in enumerate(zip(problems, conts, done)) for c, f in zip(cs, fs)]
    for ep in episodes:
        ep.reward = response_reward(ep, ep.response_ids, sampling.tokenizer) if ep.finished else 0.0
    return episodes


@torch.no_grad()
def sample(model, prefixes: list[list[int]], k: int, budgets: list[int], sampling: Sampling, *, cache=None,
           rows: list[int] | None = None, fork_method: str | None = None):
    """k continuations and finished flags per prefix (lists [n][k]), forked from `cache` (prefix j is row
    rows[j] of it) or, without a cache, from one encoded here; each continuation stops at an end-of-turn id,
    the stop string or its budget (finish), and is finished only when it stopped by itself."""
    if not prefixes:  # e.g. a process whose share of a small evaluation set is empty
        return [], []
    device = next(model.parameters()).device
    context = model.config.max_position_embeddings
    budgets = [max(0, min(b, context - len(p))) for b, p in zip(budgets, prefixes)]
    if cache is None:  # encode the prefixes, once each, in the batches they will decode in; then fork
        conts, done = [None] * len(prefixes), [None] * len(prefixes)
        for part in batching.least_padding(list(map(len, prefixes)), budgets, [k] * len(prefixes),
                                           sampling.max_batch_tokens, batching.batch_overhead(model)):
            ids, mask = pad_right([prefixes[j] for j in part], sampling.pad_id, device)
            part_cache = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1).cache
            c, d = sample(model, [prefixes[j] for j in part], k, [budgets[j] for j in part], sampling,
                          cache=part_cache, rows=list(range(len(part))), fork_method=fork_method)
            for j, cj, dj in zip(part, c, d):
                conts[j], done[j] = cj, dj
        return conts, done
    was_training = model.training
    model.eval()  # no dropout while sampling; restored on return
    conts, done = [None] * len(prefixes), [None] * len(prefixes)
    chunks = batching.least_padding(list(map(len, prefixes)), budgets, [k] * len(prefixes),
                                    sampling.max_batch_tokens, batching.batch_overhead(model))
    # the largest fork's cached positions: rows x (longest prefix - 1 + largest budget), fork's capacity
    allocate = reused_buffers(max(len(chunk) * k * (max(len(prefixes[j]) for j in chunk) - 1
                                                    + max(budgets[j] for j in chunk)) for chunk in chunks))
    for chunk in chunks:
        budget = max(budgets[j] for j in chunk)
        new = fork_and_decode(model, cache, [prefixes[j] for j in chunk], [rows[j] for j in chunk], k, budget,
                              sampling, fork_method, allocate) if budget > 0 else [[]] * (len(chunk) * k)
        for i, j in enumerate(chunk):
            results = [finish(seq, budgets[j], sampling.stops, sampling.tokenizer, sampling.stop,
                              prefixes[j]) for seq in new[i * k:(i + 1) * k]]
            conts[j], done[j] = [c for c, _ in results], [f for _, f in results]
    model.train(was_training)
    return conts, done


def fork(cache, prefixes: list[list[int]], rows: list[int], k: int, new_tokens: int, pad_id: int,
         method: str | None = None, allocate=None):
    """Reset to each prefix (row rows[j] of `cache`) k times: ids [n*k, W], mask, and a cache of W-1 columns,
    by "copy" (into buffers from `allocate`, see reused_buffers, or new ones) or "gather" (default: gather on a
    GPU, whose caching allocator reuses memory itself; the two give equal buffers). What a reader needs:
    - left padding: every prefix ends in column W-1, so all forks decode their next token in the same column;
    - W-1 cached columns: `generate` feeds the last prefix token itself (its logits pick the first new token),
      so the cache holds the columns before it, each prefix's keys/values right-aligned, zeros to their left;
    - positions from the mask: `generate` numbers a row's tokens by the cumulative sum of its attention mask,
      so a prefix's first real token is position 0 whatever its padding, as in the pass that made the cache."""
    device, width = cache.layers[0].keys.device, max(map(len, prefixes))
    method = method or ("gather" if device.type == "cuda" else "copy")
    assert method in FORK_METHODS, method
    ends = [len(p) for p in prefixes for _ in range(k)]
    sources = [rows[i // k] for i in range(len(ends))]  # the cache row each fork reads
    ids = torch.full((len(ends), width), pad_id, device=device)  # [n*k, W]
    for j, p in enumerate(prefixes):
        ids[j * k:(j + 1) * k, width - len(p):] = torch.tensor(p, device=device)
    starts = width - torch.tensor(ends, device=device)[:, None]  # first column of each prefix
    mask = (torch.arange(width, device=device)[None, :] >= starts).long()
    capacity, autocast_on = width - 1 + new_tokens, torch.is_autocast_enabled(device.type)
    # one dtype for keys and values: autocast's when on (attention casts both to it anyway), else the cache's
    dtype = torch.get_autocast_dtype(device.type) if autocast_on else cache.layers[0].values.dtype
    cols = torch.arange(capacity, device=device)[None, :] - starts  # fork i's column c reads c - starts[i]
    source_rows = torch.tensor(sources, device=device)[:, None, None]

    def buffer(x, slot):  # [n*k, H, capacity, D]: each fork's columns of x, zeros before them (masked, but finite)
        if method == "gather":  # one indexed read and one fill: a few large GPU kernels per layer
            heads = torch.arange(x.shape[1], device=device)[None, :, None]
            buf = x[source_rows, heads, cols.clamp(0, x.shape[2] - 1)[:, None, :]].to(dtype)
            return buf.masked_fill_((cols < 0)[:, None, :, None], 0)
        shape = (len(ends), x.shape[1], capacity, x.shape[3])
        buf = allocate(slot, shape, dtype, device) if allocate else x.new_empty(shape, dtype=dtype)
        for i, (row, e) in enumerate(zip(sources, ends)):  # block copies: on a CPU far faster than a gather
            buf[i, :, : width - e] = 0  # 0 * NaN would leak through the mask
            buf[i, :, width - e: width - 1] = x[row, :, : e - 1]
        return buf

    forked = DynamicCache()
    for layer, (keys, values, *_) in enumerate(cache):  # each [B, H, L, D]
        forked.layers.append(PreallocatedLayer(buffer(keys, 2 * layer), buffer(values, 2 * layer + 1), width - 1))
    return ids, mask, forked


def fork_and_decode(model, cache, prefixes, rows, k: int, budget: int, sampling: Sampling,
                    fork_method: str | None = None, allocate=None):
    """New ids of k forks of each prefix by HF `generate` (one batch's buffers alive, reused by the next)."""
    if not forkable(cache):  # each prefix encoded afresh: correct for any cache, slower
        return fresh_decode(model, prefixes, k, budget, sampling)
    ids, mask, forked = fork(cache, prefixes, rows, k, budget, sampling.pad_id, fork_method, allocate)
    out = generate(model, sampling, input_ids=ids, attention_mask=mask, cache=forked,
                   max_new_tokens=budget)
    return out[:, ids.shape[1]:].tolist()


@torch.no_grad()
def old_logprobs(model, episodes: list[Episode], temperature: float, pad_id: int, keep_cache: bool = False):
    """Set ep.old_logp ([T]) by one forward pass over the episodes; -> its KV cache (keep_cache) or None."""
    logps, cache = response_logprobs(model, episodes, temperature, pad_id, keep_cache)
    for ep, lp in zip(episodes, logps):
        ep.old_logp = lp
    return cache


def reference_logprobs(ref, episodes: list[Episode], temperature: float, pad_id: int, batch_tokens: int):
    """Set ep.ref_logp ([T]) under the frozen reference model, once per iteration (as the reference's
    PPOTrainer.step does before its epochs): the KL term's target does not move within an iteration."""
    for chunk in batching.group_chunks(episodes, batch_tokens):
        for ep, lp in zip(chunk, response_logprobs(ref, chunk, temperature, pad_id)[0]):
            ep.ref_logp = lp


@torch.no_grad()
def response_logprobs(model, episodes: list[Episode], temperature: float, pad_id: int, keep_cache=False):
    """([T] log-probs of each episode's response tokens, the KV cache of the pass or None)."""
    ids, mask = pad_right([ep.prompt_ids + ep.response_ids for ep in episodes], pad_id,
                          next(model.parameters()).device)
    logp, cache = token_logprobs(model, ids, mask, temperature, keep_cache)
    return per_response(logp, episodes), cache


# ---- engineering: the stop rule, caches that cannot fork, buffers, log-softmax (skip on a first reading)

def finish(seq: list[int], budget: int, eos_id, tokenizer=None, stop: str | None = None, before=()):
    """(row cut after its first EOS, to its budget, and before `stop` then EOS, ends in EOS): text after the
    stop string is a next problem the model began inventing, never part of the answer.
    eos_id: an id, or several (Sampling.stops: any ends it; the stop string's cut appends the first).
    before: the row's prefix. HF stops at the token completing `stop` (the row's last):
    it lies in the last len(stop) tokens of prefix and row (each adds >= 1 char)."""
    ends = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    first = next((t for t, token in enumerate(seq) if token in ends), None)
    seq = (seq if first is None else seq[: first + 1])[:budget]
    body = seq[:-1] if seq and seq[-1] in ends else seq
    # the stop string counts where it ends in the row, even if it begins in the prefix (as generate
    # sees it): an MC continuation stops, and is cut, where the response it came from would have
    tail = list(before)[-len(stop):] if stop else []
    joined = tail + body
    text = lambda lo, hi=None: tokenizer.decode(joined[lo:hi], skip_special_tokens=True)
    window = max(0, len(joined) - len(stop)) if stop else 0
    if stop and stop in text(window) and stop not in text(window, len(tail)):  # not the prefix's
        start = len(joined) - 1
        while stop not in text(start):  # the last token whose text, with what follows, holds `stop`
            start -= 1
        seq = body[:max(0, start - len(tail))] + [ends[0]]  # begun in the prefix: EOS alone
    return seq, bool(seq) and seq[-1] in ends


def decoding(sampling: Sampling) -> dict:
    """`generate`'s settings for every sampling call: any stop id or the stop string ends a row; synced_gpus
    False: each process decodes on its own (with FSDP, HF would lock processes in step); top_k=0: generate's
    default top_k=50 would sample from a distribution the log-probs do not model."""
    stopping = dict(eos_token_id=list(sampling.stops), pad_token_id=sampling.eos_id, stop_strings=sampling.stop,
                    tokenizer=sampling.tokenizer, synced_gpus=False)
    if sampling.temperature > 0:
        return dict(stopping, do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    return dict(stopping, do_sample=False)


def generate(model, sampling: Sampling, **inputs):
    """HF `generate` with decoding's settings and no others: softmax(logits / T) with top-p
    (greedy: the argmax), the distribution the log-probs model.
    generate fills every setting a call leaves unset from model.generation_config, even when given a
    GenerationConfig (repetition_penalty, min_p, top_k, ...): it is set aside for the call."""
    own, model.generation_config = model.generation_config, GenerationConfig()  # all unset
    try:
        return model.generate(**inputs, **decoding(sampling))
    finally:
        model.generation_config = own


# generation settings a model may set, at values that leave softmax(logits / T) as is (None: unset)
NEUTRAL = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0,
               epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
               num_beams=1, min_length=0, length_penalty=1.0, use_cache=True,
               output_attentions=False, output_hidden_states=False)
NOT_SETTINGS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                "transformers_version")


def overridden_settings(model) -> dict:
    """The settings of model.generation_config that generate (above) sets aside: those not neutral.
    Its token ids are kept apart: its EOS ids end responses (prompts.stop_ids)."""
    own = sorted(model.generation_config.to_dict().items())
    return {key: value for key, value in own if value is not None and value != NEUTRAL.get(key)
            and key not in NOT_SETTINGS and not key.startswith("_")}


def announce_overridden_settings(model, rank: int):
    """One line, from the first process, naming the model's own generation settings
    that sampling does not use (overridden_settings); none: no line."""
    own = overridden_settings(model)
    if own and rank == 0:
        shown = ", ".join(f"{key}={value!r}" for key, value in own.items())
        tqdm.write(f"the model's generation_config sets {shown}: not used; responses, MC "
                   "continuations and evaluation sample softmax(logits / T) with --temperature "
                   "and --top-p (T = 0: greedy)")


def forkable(cache) -> bool:
    """Whether fork can read states out of this cache: every layer a DynamicLayer that holds every position
    (a sliding-window layer keeps only the last window; any other kind of layer the fork does not know)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def fresh_decode(model, prefixes, k: int, budget: int, sampling: Sampling):
    """New ids of k continuations of each prefix, the prefixes encoded afresh by `generate`, those of one
    length together: no padding (a padded row can turn an eager sliding-window attention's output to NaN)."""
    device, new = next(model.parameters()).device, [None] * len(prefixes)
    for length in sorted(set(map(len, prefixes))):
        same = [j for j, p in enumerate(prefixes) if len(p) == length]
        ids = torch.tensor([prefixes[j] for j in same for _ in range(k)], device=device)
        out = generate(model, sampling, input_ids=ids, attention_mask=torch.ones_like(ids),
                       max_new_tokens=budget)[:, length:].tolist()
        for i, j in enumerate(same):
            new[j] = out[i * k:(i + 1) * k]
    return [row for rows in new for row in rows]


def reused_buffers(positions: int):
    """fork's allocator for the batches of one `sample` call: buffer `slot` (a layer's keys or values) of each
    batch is a view of one flat tensor, made at the first fork for `positions` cached positions, the largest
    batch's. A CPU pays for a fresh page the first time it is touched (~0.5 s a GB here), and buffers this large
    go back to the OS when freed, so each new batch paid again: reuse took fork-batch from 1.17x to 1.08x
    decode-only in bench.py (docs/speed-and-memory.md). Peak memory is unchanged: the largest batch's."""
    flat = {}

    def allocate(slot, shape, dtype, device):  # shape [rows, H, columns, D]
        size = shape[0] * shape[1] * shape[2] * shape[3]
        if slot not in flat or flat[slot].numel() < size or flat[slot].dtype != dtype:
            flat[slot] = torch.empty(max(size, positions * shape[1] * shape[3]), dtype=dtype, device=device)
        return flat[slot][:size].view(shape)
    return allocate


class PreallocatedLayer(DynamicLayer):
    """Cache buffers sized for the whole generation, written in place (DynamicLayer's torch.cat was slow)."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int):
        super().__init__()
        self.key_buffer, self.value_buffer = key_buffer, value_buffer  # [B, H, capacity, D]
        self.keys, self.values = key_buffer[:, :, :length], value_buffer[:, :, :length]
        self.device, self.is_initialized = key_buffer.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def pad_id(tok) -> int:
    """The tokenizer's pad id, or EOS where it has none (Llama's): padding is masked anyway."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def pad_right(seqs: list[list[int]], pad_id: int, device=None):
    rows = [torch.tensor(s, dtype=torch.long) for s in seqs]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True)
    return ids.to(device), mask.to(device)


def token_logprobs(model, ids, mask, temperature: float, keep_cache: bool = False):
    """log pi(x_{t+1} | x_<=t) [B, L-1] under softmax(logits / T), the distribution sampled from (as the
    reference's PPOTrainer._forward_pass_actor divides by the temperature); the cache."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=keep_cache)
    logp = chosen_logprobs(out.logits[:, :-1], ids[:, 1:], temperature)
    return logp, (out.cache if keep_cache else None)


def chosen_logprobs(logits, targets, temperature: float, chunk_tokens: int = LOGPROB_CHUNK_TOKENS):
    """log_softmax(logits / T)[target] in >= fp32, a few positions at a time (not two fp32 copies of all)."""
    step = max(1, chunk_tokens // logits.shape[0])
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32 (float64 stays)
    pieces = []
    for lo in range(0, logits.shape[1], step):
        scaled = logits[:, lo: lo + step].to(dtype) / temperature
        pieces.append(scaled.log_softmax(-1).gather(-1, targets[:, lo: lo + step, None]).squeeze(-1))
    return torch.cat(pieces, 1)


def per_response(logp, episodes):
    """Row slices of a [B, L-1] tensor: one [T] tensor per episode (its response tokens)."""
    return [logp[i, len(ep.prompt_ids) - 1: len(ep.prompt_ids) - 1 + len(ep.response_ids)].cpu()
            for i, ep in enumerate(episodes)]
