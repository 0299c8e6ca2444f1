"""This file cuts work into batches of least padding within a token budget.

rollout.sample and fork.fork_batches cut prompts and VinePPO's states into `generate` calls
with it, and the log-prob, value and reference passes cut episodes into forward passes. All of
it is engineering: a first reading may skip this file."""


def least_padding(lengths: list[int], budgets: list[int], copies: list[int], max_tokens: int,
                  overhead: int = 0):
    """Cut the items into batches (lists of indices) of least padding plus `overhead` per batch.

    - item j is copies[j] rows of lengths[j] tokens with room for budgets[j] new ones;
    - a batch costs its rows x (longest length + largest budget) tokens, at most max_tokens
      (an item over it goes alone); on a tie the fewest batches win;
    - a dynamic programme over the cut points of the items sorted by length: best[i], the
      cheapest batching of the first i, is best[j] plus the cost of batch j..i-1 at the best j."""
    order = sorted(range(len(lengths)), key=lambda j: (lengths[j], budgets[j]))
    best, cut = [(0, 0)] + [None] * len(order), [0] * (len(order) + 1)  # best[i]: (tokens, batches)
    for i in range(1, len(order) + 1):
        budget = n_rows = filled = 0
        for j in range(i - 1, -1, -1):  # the last batch is order[j:i]: it only grows as j falls
            item = order[j]
            budget, n_rows = max(budget, budgets[item]), n_rows + copies[item]
            filled += copies[item] * (lengths[item] + budgets[item])
            tokens = n_rows * (lengths[order[i - 1]] + budget)
            if tokens > max_tokens and j < i - 1:
                break
            cost = (best[j][0] + tokens - filled + overhead, best[j][1] + 1)
            if best[i] is None or cost < best[i]:
                best[i], cut[i] = cost, j
    batches, i = [], len(order)
    while i:
        batches.append(order[cut[i]:i])
        i = cut[i]
    return batches[::-1]


def padding_fraction(batches, lengths: list[int], budgets: list[int], copies: list[int]) -> float:
    """The share of padding in the tokens of least_padding's batches
    (a batch's rows x its widest)."""
    total = sum(sum(copies[j] for j in b) * (max(lengths[j] for j in b)
                                              + max(budgets[j] for j in b)) for b in batches)
    filled = sum(c * (n + b) for c, n, b in zip(copies, lengths, budgets))
    return 1 - filled / total if total else 0.0


def batch_overhead(model) -> int:
    """What one more generate batch costs, in padded positions. A decoding step reads every
    weight once per batch, and each cached position's keys and values once per row and layer,
    so a batch costs what params / (2 x layers x key/value width) padded positions do, the 2 for
    keys and values (docs/speed-and-memory.md measures it)."""
    config = model.config
    heads = config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * width
    return sum(p.numel() for p in model.parameters()) // (2 * config.num_hidden_layers * kv_width)


def group_chunks(episodes, max_tokens: int, overhead: int | None = None):
    """Yield the episodes in batches of at most max_tokens (rows x longest), in episode order.
    They have least padding plus `overhead` tokens per batch (least_padding), or with None the
    fewest batches, as each is a log-prob pass and, for VinePPO, its own MC sample calls. A
    prompt's samples are never split, so identical states meet in one batch."""
    members = {}  # group -> its episodes' indices
    for e, ep in enumerate(episodes):
        members.setdefault(ep.group, []).append(e)
    groups = list(members.values())
    lengths = [max(len(episodes[e].prompt_ids) + len(episodes[e].response_ids) for e in g)
               for g in groups]
    if overhead is None:  # more than any batching's padding: a batch fewer always wins
        overhead = 1 + max(lengths, default=0) * len(episodes)
    batches = least_padding(lengths, [0] * len(groups), list(map(len, groups)), max_tokens,
                            overhead)
    for indices in sorted(sorted(e for g in batch for e in groups[g]) for batch in batches):
        yield [episodes[e] for e in indices]
