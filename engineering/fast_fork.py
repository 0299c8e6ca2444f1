"""The fork's speed-ups (generation.py calls them): batches of forks and their reused buffers,
and the GPU's gather.

- fork_batches: continue_from_cache's batches of least padding within --max-batch-tokens, and
  one set of fork buffers that every batch of the call reuses (reused_buffers);
- gather_columns: generation.copy_columns by one indexed read per layer, fork's default on a
  GPU; test_precision.py holds the two equal.
Figures: docs/speed-and-memory.md.
"""
import torch

import batching


def gather_columns(x, sources: list[int], ends: list[int], width: int, capacity: int, dtype):
    """generation.copy_columns by one indexed read and one fill: a few large GPU kernels per layer
    (the columns from W-1 on hold copies, overwritten as generate decodes)."""
    device = x.device
    starts = width - torch.tensor(ends, device=device)[:, None]  # [n*k, 1]
    cols = torch.arange(capacity, device=device)[None, :] - starts  # [n*k, capacity]: c - start
    rows = torch.tensor(sources, device=device)[:, None, None]  # [n*k, 1, 1]
    heads = torch.arange(x.shape[1], device=device)[None, :, None]  # [1, H, 1]
    # the three broadcast to [n*k, H, capacity]: buffer[i, h, c] = x[row i, h, c - start i]
    buffer = x[rows, heads, cols.clamp(0, x.shape[2] - 1)[:, None, :]].to(dtype)
    return buffer.masked_fill_((cols < 0)[:, None, :, None], 0)


def fork_batches(model, prefixes, budgets: list[int], k: int, max_tokens: int):
    """(batches of prefix indices, the allocator of their fork buffers) for one
    generation.continue_from_cache call.

    Least padding within max_tokens (batching.least_padding); one set of buffers reused."""
    chunks = batching.least_padding(list(map(len, prefixes)), budgets, [k] * len(prefixes),
                                    max_tokens, batching.batch_overhead(model))
    return chunks, reused_buffers(largest_fork(chunks, prefixes, budgets, k))


def largest_fork(chunks, prefixes, budgets, k: int) -> int:
    """The cached positions of the largest fork among the chunks:
    rows x (longest prefix - 1 + largest budget), fork's capacity."""
    return max(len(chunk) * k * (max(len(prefixes[j]) for j in chunk) - 1
                                 + max(budgets[j] for j in chunk)) for chunk in chunks)


def reused_buffers(positions: int):
    """fork's allocator for the batches of one continue_from_cache call.

    Buffer `slot` (a layer's keys or values) of each batch is a view of one flat tensor,
    made at the first fork for `positions` cached positions, the largest batch's. A CPU pays
    for a fresh page the first time it is touched, and buffers this large go back to the OS
    when freed, so each new batch would pay again (docs/speed-and-memory.md). Peak memory is
    unchanged: the largest batch's."""
    flat = {}

    def allocate(slot, shape, dtype, device):  # shape [rows, H, columns, D]
        size = shape[0] * shape[1] * shape[2] * shape[3]
        if slot not in flat or flat[slot].numel() < size or flat[slot].dtype != dtype:
            flat[slot] = torch.empty(max(size, positions * shape[1] * shape[3]), dtype=dtype,
                                     device=device)
        return flat[slot][:size].view(shape)
    return allocate
