"""How much do KV-cache forks save when sampling VinePPO's Monte Carlo continuations?

    python bench.py                        # ~60M-param random Llama, 8 x 600-token trajectories
    python bench.py --dtype bfloat16 --layers 16 --hidden 1024
    python bench.py --threads 1            # on a CPU shared with another job (else threads spin)

VinePPO estimates V(s) at several states (prefixes) of every sampled trajectory by sampling
K continuations from each. This script times four ways to produce all of them, with the same
token counts (trajectories x states x K continuations of exactly --new-tokens tokens each):

  1. naive        every state on its own: re-encode its prefix, sample K continuations;
  2. fork-each    one forward pass over the whole trajectories (kept KV cache, timed too),
                  then one fork + sample call per state;
  3. fork-batch   the same forward pass, then ONE sample call over all states (what training does);
  4. decode-only  the floor: one already-encoded prefix of the mean state length (encoded outside
                  the timer), forked into as many rows and decoded in one batch; only decoding
                  is timed, so no way of producing MC continuations can beat it.

The model is random-init (speed does not depend on the weights) and the trajectories are random
tokens. Methods are interleaved, each repeat in a rotated order, and the median of the repeats
is reported. The last printed line is one JSON object with the medians and the settings.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rollout

PAD = 0


def build_model(a):
    torch.manual_seed(a.seed)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         max_position_embeddings=a.traj_len + a.new_tokens + 8, pad_token_id=PAD)
    return LlamaForCausalLM(config).to(a.device, getattr(torch, a.dtype)).eval()


def timed(fn, device):
    """Seconds taken by fn(), waiting for queued GPU work before and after."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("layers", 8), ("hidden", 512), ("heads", 8), ("kv-heads", 8), ("intermediate", 1376),
                          ("vocab", 32000), ("trajectories", 8), ("traj-len", 600), ("states", 6), ("k", 4),
                          ("new-tokens", 16), ("repeats", 3), ("max-batch-tokens", 32768), ("seed", 0),
                          ("threads", 0)]:  # threads: CPU threads for torch, 0 = torch's default
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    if a.threads:  # on a CPU shared with other jobs, fewer threads than cores avoids spinning threads
        torch.set_num_threads(a.threads)

    model = build_model(a)
    n_params = sum(t.numel() for t in model.parameters())
    g = torch.Generator().manual_seed(a.seed)
    trajs = torch.randint(3, a.vocab, (a.trajectories, a.traj_len), generator=g).tolist()
    # States evenly spaced inside each trajectory: prefix lengths L/(S+1), 2L/(S+1), ..., SL/(S+1).
    ends = [a.traj_len * (i + 1) // (a.states + 1) for i in range(a.states)]
    prefixes = [t[:e] for t in trajs for e in ends]
    rows = [r for r in range(a.trajectories) for _ in ends]
    budgets = [a.new_tokens] * len(prefixes)
    n_tokens = len(prefixes) * a.k * a.new_tokens  # continuation tokens produced by every method
    # Sampling never stops early: the EOS id is `vocab`, one past the last token id the model can
    # sample, so no sampled token ever equals it and every continuation runs its full budget.
    gen = dict(temperature=1.0, top_p=1.0, eos_id=a.vocab, pad_id=PAD)

    def encode():  # the one forward pass over whole trajectories that training does anyway
        ids, mask = rollout.pad_right(trajs, PAD, a.device)
        return rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1]

    def naive():
        for prefix in prefixes:
            rollout.sample(model, [prefix], a.k, [a.new_tokens], **gen)

    def fork_each():
        cache = encode()
        for prefix, row in zip(prefixes, rows):
            rollout.sample(model, [prefix], a.k, [a.new_tokens], cache=cache, rows=[row], **gen)

    def fork_batch():
        cache = encode()
        out, done = rollout.sample(model, prefixes, a.k, budgets, cache=cache, rows=rows,
                                   max_batch_tokens=a.max_batch_tokens, **gen)
        assert sum(len(c) for cs in out for c in cs) == n_tokens and not any(map(any, done))

    mean_len = round(sum(map(len, prefixes)) / len(prefixes))
    floor_prefix = trajs[0][:mean_len]
    with torch.no_grad():  # encoded once, outside every timer
        ids, mask = rollout.pad_right([floor_prefix], PAD, a.device)
        floor_cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1]

    def decode_only():  # every row forks row 0 of floor_cache; one batch, whatever its size
        rollout.sample(model, [floor_prefix] * len(prefixes), a.k, budgets, cache=floor_cache,
                       rows=[0] * len(prefixes), max_batch_tokens=1 << 62, **gen)

    methods = {"naive": naive, "fork-each": fork_each, "fork-batch": fork_batch, "decode-only": decode_only}
    names = list(methods)
    times = {name: [] for name in names}
    start = time.perf_counter()
    with torch.no_grad():
        rollout.sample(model, [floor_prefix], a.k, [a.new_tokens], cache=floor_cache, rows=[0], **gen)  # warm-up
        for r in range(a.repeats):
            for name in names[r % 4:] + names[: r % 4]:  # rotate so no method is always first
                torch.manual_seed(a.seed + r)
                times[name].append(timed(methods[name], a.device))
                print(f"  repeat {r + 1}/{a.repeats} {name:<12} {times[name][-1]:8.2f} s", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"\n{n_params / 1e6:.1f}M params, {a.dtype} on {a.device}, torch threads {torch.get_num_threads()}; "
          f"{len(prefixes)} states x {a.k} continuations x {a.new_tokens} tokens = {n_tokens} tokens; "
          f"mean state length {mean_len}")
    print(f"{'method':<12} {'median s':>10} {'tokens/s':>10} {'x fork-batch':>13}")
    for name in names:
        print(f"{name:<12} {med[name]:>10.3f} {n_tokens / med[name]:>10.1f} {med[name] / med['fork-batch']:>13.2f}")
    print(f"total benchmark time {time.perf_counter() - start:.1f} s")
    print(json.dumps({
        "speedup_vs_naive": med["naive"] / med["fork-batch"],
        "overhead_vs_decode_only": med["fork-batch"] / med["decode-only"],
        "median_s": med, "continuation_tokens": n_tokens, "params": n_params, "mean_state_len": mean_len,
        "torch_threads": torch.get_num_threads(), "args": vars(a),
    }))


if __name__ == "__main__":
    main()
