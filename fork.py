"""This file samples continuations of a state without encoding it again, by forking a KV cache.

That is VinePPO's environment reset (arXiv 2410.01679v1, §3), made cheap. A continuation of a
state is, by definition, what `generate` samples after the state is encoded afresh
(rollout.sample_by_definition). The fork gets the same continuations faster: the state's
keys and values are copied out of the KV cache of the pass that already encoded it (the
old-log-prob pass, or rollout.sample's encoding of the prompts), k times, into buffers with room
to decode on, and `generate` samples on from there; many states go in one `generate` call.
With greedy decoding the two give the same tokens (test_vine.py's
test_mc_values_by_definition_equal_the_forks; test_your_model.py's
test_greedy_continuations_of_every_state_equal_a_fresh_encode, on 13 architectures).
Understanding VinePPO, or changing its steps or its K, does not need this file.

What the fork assumes of transformers 5 (read in the source of v5.25.0; each has a test)
----------------------------------------------------------------------------------------
- A forward pass with use_cache=True returns its KV cache in the output field `cache`.
  transformers 4 called it past_key_values. In 5 `out.past_key_values` is only a deprecated
  alias that returns `out.cache`, and `generate` takes the cache as `cache=` (it renames a
  past_key_values= argument to that, with a warning).
- That cache is a DynamicCache. Its list `layers` holds one layer per transformer block, and a
  layer's `keys` and `values` are tensors [B, H, L, D] (batch rows, key-value heads, one
  column per token, head size). Iterating the cache yields each layer's (keys, values, a third
  item fork ignores). test_vine.py's test_forked_logprobs_equal_full_forward forks states out
  of such a cache and checks the log-probs against a full forward pass.
- Given a cache of C columns, `generate` feeds the model only the ids from column C on. It
  numbers a row's positions by the cumulative sum of its attention mask, minus one (padded
  columns get 0; transformers 4 gave them 1), and each new token gets the previous position
  plus one.
  test_vine.py's test_what_the_fork_relies_on_in_generate shows the first two
  (docs/reference.md has the lines); the greedy tests above would catch the third.
- While decoding, `generate` and the forward passes it runs call three methods of each cache
  layer. `update` stores a new column's keys and values and returns all of them,
  `get_seq_length` gives C, and `get_mask_sizes` gives the attention mask's width. They also
  read the layer's keys, values, is_initialized, is_compileable and is_sliding.
  PreallocatedLayer overrides `update` alone and keeps `keys` and `values` current, so the
  get_seq_length and get_mask_sizes it inherits from DynamicLayer stay right.
  test_forked_logprobs_equal_full_forward decodes three steps through it.

Reading order: fork_one_state (the whole idea, for one state), fork, copy_columns; then
continue_from_cache, which does the same for many states at once (within_context_batches,
forkable, fresh_decode). Below the line are PreallocatedLayer (the cache layer fork fills),
the GPU's gather, the batches of least padding and their reused buffers.
"""
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import batching
import generation

FORK_METHODS = ("copy", "gather")


@torch.no_grad()
def fork_one_state(model, cache, row: int, state: list[int], k: int, budget: int, sampling):
    """Fork k continuations of one state from row `row` of `cache`; say whether each finished.

    This is the plain version of continue_from_cache, to read first: one state, no batches, no
    reused buffers, no fallback. The keys and values of the state's tokens but the last are
    copied k times (fork); `generate` feeds that last token, samples up to `budget` new ones,
    and each row is cut as continue_from_cache cuts it (generation.finish). With greedy decoding
    the two give the same tokens (test_vine.py's test_forked_greedy_equals_reencoded_greedy).
    fork's docstring follows a state of 4 tokens through it, column by column."""
    ids, mask, forked = fork(cache, [state], [row], k, budget, sampling.pad_id)  # ids [k, W]
    out = generation.generate(model, sampling, input_ids=ids, attention_mask=mask, cache=forked,
                              max_new_tokens=budget)
    rows = [generation.finish(new, budget, sampling.stops, sampling.tokenizer, sampling.stop,
                              state) for new in out[:, len(state):].tolist()]
    return [new for new, _ in rows], [done for _, done in rows]


@torch.no_grad()
def continue_from_cache(model, prefixes: list[list[int]], k: int, budgets: list[int], sampling,
                        *, cache, rows: list[int]):
    """Sample k continuations of each prefix from `cache`, and their finished flags ([n][k]).

    Prefix j is row rows[j] of `cache`, a right-padded forward pass (token t in column t). That
    pass is the old-log-prob pass, whose row e holds episodes[e] (VinePPO's states), or
    rollout.sample's encoding of the prompts. sampling is a rollout.Sampling.
    - the prefixes go to `generate` in batches of least padding (fork_batches); only one batch's
      buffers are alive at a time, as the next batch reuses them (allocate);
    - each batch is forked from the cache (fork) and decoded to its largest budget, or encoded
      afresh where fork cannot read the cache (forkable, fresh_decode); a batch where a row
      would pass the model's context is cut first (within_context_batches);
    - each row is cut to its own budget at an end id or the stop string (finish), and is
      finished only when it stopped by itself."""
    if not prefixes:
        return [], []
    budgets = generation.within_context(model, prefixes, budgets)
    conts, finished = [None] * len(prefixes), [None] * len(prefixes)
    parts, allocate = fork_batches(model, prefixes, budgets, k, sampling.max_batch_tokens)
    context = model.config.max_position_embeddings
    parts = [batch for part in parts for batch in within_context_batches(part, prefixes, budgets,
                                                                         context)]
    was_training = model.training
    model.eval()  # no dropout while sampling; restored on return, or on an error
    try:
        for part in parts:  # a list of prefix indices, one `generate` batch
            budget, batch = max(budgets[j] for j in part), [prefixes[j] for j in part]
            # new: [len(part) * k] rows of new ids, k per prefix
            if budget == 0:  # the response's budget or the context is used up: no tokens
                new = [[] for _ in range(len(part) * k)]
            elif forkable(cache):  # k forks of each prefix, decoded by `generate`
                ids, mask, forked = fork(cache, batch, [rows[j] for j in part], k, budget,
                                         sampling.pad_id, allocate=allocate)
                out = generation.generate(model, sampling, input_ids=ids, attention_mask=mask,
                                          cache=forked, max_new_tokens=budget)
                new = out[:, ids.shape[1]:].tolist()
            else:  # each prefix encoded afresh: right for any cache, slower
                new = fresh_decode(model, batch, k, budget, sampling)
            for i, j in enumerate(part):
                results = [generation.finish(seq, budgets[j], sampling.stops, sampling.tokenizer,
                                             sampling.stop, prefixes[j])
                           for seq in new[i * k:(i + 1) * k]]
                conts[j], finished[j] = [c for c, _ in results], [f for _, f in results]
    finally:
        model.train(was_training)
    return conts, finished


def within_context_batches(part: list[int], prefixes, budgets: list[int], context: int):
    """Cut `part` so that no row decodes past the context, or return [part] when every row has
    room, as almost always. A batch decodes every row to its largest budget, so each row needs
    room for that (GPT-2's and OPT's position tables end at the context)."""
    room = lambda j: context - len(prefixes[j])
    if max(budgets[j] for j in part) <= min(map(room, part)):
        return [part]
    batches = []
    for j in sorted(part, key=room, reverse=True):  # j: the least room of its batch so far
        if batches and max(budgets[i] for i in batches[-1] + [j]) <= room(j):
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def forkable(cache) -> bool:
    """Whether fork can read states out of this cache, i.e. every layer is a DynamicLayer that
    holds every position (a sliding-window layer keeps only the last window)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer
                                                   for layer in cache.layers)


def fresh_decode(model, prefixes, k: int, budget: int, sampling):
    """New ids of k continuations of each prefix, encoded afresh by `generate`. Prefixes of one
    length go together, so nothing is padded (a padded row can turn an eager sliding-window
    attention's output to NaN)."""
    device, new = next(model.parameters()).device, [None] * len(prefixes)
    for length in sorted(set(map(len, prefixes))):
        same = [j for j, p in enumerate(prefixes) if len(p) == length]
        ids = torch.tensor([prefixes[j] for j in same for _ in range(k)], device=device)
        out = generation.generate(model, sampling, input_ids=ids,
                                  attention_mask=torch.ones_like(ids),
                                  max_new_tokens=budget)[:, length:].tolist()
        for i, j in enumerate(same):
            new[j] = out[i * k:(i + 1) * k]
    return [row for rows in new for row in rows]


def fork(cache, prefixes: list[list[int]], rows: list[int], k: int, new_tokens: int, pad_id: int,
         method: str | None = None, allocate=None):
    """Reset to each prefix k times; return ids [n*k, W], their mask, and a cache to decode on.

    Prefix j is row rows[j] of `cache`, a right-padded pass (old_logprobs', or sample's
    encoding of the prompts), so its token t's keys and values are in column t. W is the
    longest prefix's length. Each fork's row of the new cache is a buffer of W-1 + new_tokens
    columns, and fork fills the first W-1. Two prefixes forked together, t = t0 t1 t2 t3 and the
    shorter u = u0 u1 (so W = 4), column by column:

        column          0    1    2    3    4    5 ...
        t's ids         t0   t1   t2   t3                (the ids given to generate)
        t's mask        1    1    1    1
        t's positions   0    1    2    3    4    5       (generate's, from the mask)
        t's buffer      t0   t1   t2   .    .    .       (t0: t0's keys and values)
        u's ids         pad  pad  u0   u1
        u's mask        0    0    1    1
        u's positions   0    0    0    1    2    3
        u's buffer      0    0    u0   .    .    .       (.: room that decoding fills)

    - Left padding makes every prefix end in column W-1, so all forks decode in step.
    - Only W-1 columns are cached, so `generate` feeds the model column W-1 alone (t3 at
      position 3, u1 at 1). That writes their keys and values into column W-1, and their
      logits pick the first new tokens, fed next in column W (at positions 4 and 2).
    - Positions come from the mask, so u0 is position 0 whatever its padding, as in the pass
      that made the cache. The copied keys keep the rotary positions that pass gave them, so
      the fed tokens see the keys a fresh encoding of the prefix makes (to rounding).
    - Padded columns are set to zero. The mask hides them, but a NaN left in fresh memory
      would leak through it (0 * NaN).
    `method` is "copy" (block copies, into buffers from `allocate` when given) or "gather" (one
    indexed read per layer, the default on a GPU); the two give equal buffers.
    docs/one-response.md, step 5, shows two demo states' forks column by column."""
    device, width = cache.layers[0].keys.device, max(map(len, prefixes))
    method = method or ("gather" if device.type == "cuda" else "copy")
    assert method in FORK_METHODS, method
    ends = [len(p) for p in prefixes for _ in range(k)]  # each fork's prefix length
    sources = [rows[i // k] for i in range(len(ends))]  # the cache row each fork reads
    ids = torch.full((len(ends), width), pad_id, device=device)  # [n*k, W]
    for j, p in enumerate(prefixes):
        ids[j * k:(j + 1) * k, width - len(p):] = torch.tensor(p, device=device)
    starts = width - torch.tensor(ends, device=device)[:, None]  # each fork's first column
    mask = (torch.arange(width, device=device)[None, :] >= starts).long()
    capacity = width - 1 + new_tokens
    dtype = fork_dtype(cache, device)
    forked = DynamicCache()
    for layer, (keys, values, *_) in enumerate(cache):  # a layer's keys, values: [B, H, L, D]
        if method == "gather":
            key_buffer = gather_columns(keys, sources, ends, width, capacity, dtype)
            value_buffer = gather_columns(values, sources, ends, width, capacity, dtype)
        else:
            key_buffer = copy_columns(keys, sources, ends, width, capacity, dtype,
                                      allocate, (layer, "keys"))
            value_buffer = copy_columns(values, sources, ends, width, capacity, dtype,
                                        allocate, (layer, "values"))
        # a DynamicLayer that writes each new column into the buffer's room (below the line)
        forked.layers.append(PreallocatedLayer(key_buffer, value_buffer, width - 1))
    return ids, mask, forked


def copy_columns(x, sources: list[int], ends: list[int], width: int, capacity: int, dtype,
                 allocate=None, slot=None):
    """The [n*k, H, capacity, D] buffer, row i fork i's row of x ([B, H, L, D]) as fork draws
    it, by block copies (on a CPU far faster than a gather); columns from W-1 on stay unwritten."""
    shape = (len(ends), x.shape[1], capacity, x.shape[3])
    buffer = allocate(slot, shape, dtype, x.device) if allocate else x.new_empty(shape, dtype=dtype)
    for i, (row, length) in enumerate(zip(sources, ends)):
        buffer[i, :, : width - length] = 0  # masked, but 0 * NaN would leak through the mask
        buffer[i, :, width - length: width - 1] = x[row, :, : length - 1]
    return buffer


# ---- engineering: the cache layer fork fills, the GPU's gather, the batches and their reused
# buffers (skip on a first reading)


class PreallocatedLayer(DynamicLayer):
    """A cache layer with buffers sized for the whole generation, written in place
    (DynamicLayer's torch.cat was slow)."""

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


def fork_dtype(cache, device):
    """The one dtype for keys and values: autocast's when it is on (attention casts both to it
    anyway), else the cache's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return cache.layers[0].values.dtype


def gather_columns(x, sources: list[int], ends: list[int], width: int, capacity: int, dtype):
    """copy_columns done by one indexed read and one fill, a few large GPU kernels per layer.
    The columns from W-1 on hold copies, which generate overwrites as it decodes."""
    device = x.device
    starts = width - torch.tensor(ends, device=device)[:, None]  # [n*k, 1]
    cols = torch.arange(capacity, device=device)[None, :] - starts  # [n*k, capacity]: c - start
    rows = torch.tensor(sources, device=device)[:, None, None]  # [n*k, 1, 1]
    heads = torch.arange(x.shape[1], device=device)[None, :, None]  # [1, H, 1]
    # the three broadcast to [n*k, H, capacity]: buffer[i, h, c] = x[row i, h, c - start i]
    buffer = x[rows, heads, cols.clamp(0, x.shape[2] - 1)[:, None, :]].to(dtype)
    return buffer.masked_fill_((cols < 0)[:, None, :, None], 0)


def fork_batches(model, prefixes, budgets: list[int], k: int, max_tokens: int):
    """Cut continue_from_cache's prefixes into batches of least padding within max_tokens
    (least_padding); return them and one allocator whose buffers every batch reuses."""
    parts = batching.least_padding(list(map(len, prefixes)), budgets, [k] * len(prefixes),
                                   max_tokens, batching.batch_overhead(model))
    return parts, reused_buffers(largest_fork(parts, prefixes, budgets, k))


def largest_fork(parts, prefixes, budgets, k: int) -> int:
    """The cached positions of the largest fork among the parts, its rows times fork's
    capacity (longest prefix - 1 + largest budget)."""
    return max(len(part) * k * (max(len(prefixes[j]) for j in part) - 1
                                + max(budgets[j] for j in part)) for part in parts)


def reused_buffers(positions: int):
    """fork's allocator for the batches of one continue_from_cache call.

    Buffer `slot` (a layer's keys or values) of each batch is a view of one flat tensor,
    made at the first fork for `positions` cached positions, the largest batch's. A CPU pays
    for a fresh page the first time it is touched, and buffers this large go back to the OS
    when freed, so each new batch would pay again (docs/speed-and-memory.md). Peak memory is
    unchanged, the largest batch's."""
    flat = {}

    def allocate(slot, shape, dtype, device):  # shape [rows, H, columns, D]
        size = shape[0] * shape[1] * shape[2] * shape[3]
        if slot not in flat or flat[slot].numel() < size or flat[slot].dtype != dtype:
            flat[slot] = torch.empty(max(size, positions * shape[1] * shape[3]), dtype=dtype,
                                     device=device)
        return flat[slot][:size].view(shape)
    return allocate
