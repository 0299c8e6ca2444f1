"""KV-cache prefix forking, VinePPO's environment reset (§3): the pass over whole trajectories holds every
prefix's keys/values, so a state is forked by copying them, K times, into buffers with room to decode on."""
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

FORK_METHODS = ("copy", "gather")


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


def fork(cache, prefixes: list[list[int]], rows: list[int], k: int, new_tokens: int, pad_id: int,
         method: str = "copy"):
    """Reset to each prefix (row rows[j] of `cache`) k times: left-padded ids [n*k, W], mask, and a cache of
    W-1 columns (`generate` feeds the last), by "copy" (CPU) or "gather" (GPU): the same buffers."""
    assert method in FORK_METHODS, method
    device, width = cache.layers[0].keys.device, max(map(len, prefixes))
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

    def buffer(x):  # [n*k, H, capacity, D]: each fork's columns of x, zeros before them (masked, but finite)
        if method == "gather":  # one indexed read and one fill: a few large GPU kernels per layer
            heads = torch.arange(x.shape[1], device=device)[None, :, None]
            buf = x[source_rows, heads, cols.clamp(0, x.shape[2] - 1)[:, None, :]].to(dtype)
            return buf.masked_fill_((cols < 0)[:, None, :, None], 0)
        buf = x.new_empty(len(ends), x.shape[1], capacity, x.shape[3], dtype=dtype)
        for i, (row, e) in enumerate(zip(sources, ends)):  # block copies: on a CPU far faster than a gather
            buf[i, :, : width - e] = 0  # 0 * NaN would leak through the mask
            buf[i, :, width - e: width - 1] = x[row, :, : e - 1]
        return buf

    forked = DynamicCache()
    for keys, values, *_ in cache:  # each [B, H, L, D]
        forked.layers.append(PreallocatedLayer(buffer(keys), buffer(values), width - 1))
    return ids, mask, forked
