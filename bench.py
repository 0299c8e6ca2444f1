"""How much do KV-cache forks save when sampling VinePPO's Monte Carlo continuations?

    python bench.py                        # ~60M-param random Llama, 8 x 600-token trajectories
    python bench.py --dtype bfloat16 --layers 16 --hidden 1024
    python bench.py --threads 1            # on a CPU shared with another job (else threads spin)

VinePPO estimates V(s) at several states (prefixes) of every sampled trajectory by sampling
K continuations from each. This script times five ways to produce all of them, with the same
token counts (trajectories x states x K continuations of exactly --new-tokens tokens each):

  1. naive        every state on its own: re-encode its prefix, sample K continuations;
  2. fork-each    one fork + sample call per state, from the KV cache of the log-prob forward
                  pass over the whole trajectories;
  3. fork-batch   the same cache, ONE sample call over all states (what training does);
     fork-gather  the same, the forks built by one indexed read per layer (fork method "gather",
                  meant for GPUs) instead of block copies per row; its "x fork-batch" column is
                  the ratio of the two;
  4. decode-only  the floor: one prefix of the mean state length, encoded outside the timer, copied
                  into as many cache rows (HF attention needs one per sequence) and decoded in
                  one batch: no way of producing the continuations with HF generate can beat it.

The log-prob forward pass (keeping its cache) is timed on its own line and left out of 2 and 3:
every method, naive included, needs those log-probs for the PPO loss, so it is not a cost of
the MC values. The model is random-init (speed does not depend on the weights) and the
trajectories are random tokens. Methods are interleaved, each repeat in a rotated order, and
the median of the repeats is reported. The last printed line is one JSON object.
"""
import argparse
import dataclasses
import contextlib
import io
import json
import statistics
import tempfile
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

import rollout

PAD = 0


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once, for CPUs (whose allocator keeps no statistics):
    every storage an op reads or writes is counted once, and a weak reference to it takes its
    bytes off again when it is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.refs = 0, 0, {}

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.refs:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key:
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    self.refs[key] = weakref.ref(storage, lambda _, key=key, n=nbytes: self._free(key, n))
        return out


def peak_memory(a) -> dict:
    """Peak memory of a one-iteration train.py run per algorithm (same model, data and budgets):
    torch.cuda.max_memory_allocated on a GPU, LiveTensorBytes on a CPU."""
    import train
    peaks = {}
    for algo in ("vineppo", "ppo"):
        with tempfile.TemporaryDirectory() as out:
            argv = ["--algo", algo, "--iterations", "1", "--out", out, "--model", a.memory_model,
                    "--device", a.device] + a.train_args.split()
            print(f"  memory: train.py {' '.join(argv)}", flush=True)
            cfg = train.parse_args(argv)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if a.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                    train.main(cfg)
                    peaks[algo] = torch.cuda.max_memory_allocated()
                else:
                    with LiveTensorBytes() as counter:
                        train.main(cfg)
                    peaks[algo] = counter.peak
    return peaks


def build_model(a):
    torch.manual_seed(a.seed)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         max_position_embeddings=a.traj_len + a.new_tokens + 8, pad_token_id=PAD)
    return LlamaForCausalLM(config).to(a.device, getattr(torch, a.dtype)).eval()


def timed(fn, device, setup=lambda: ()):
    """Seconds taken by fn(*setup()), setup untimed, waiting for queued GPU work before and after."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    args = setup()
    sync()
    t0 = time.perf_counter()
    fn(*args)
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
    p.add_argument("--only", choices=["speed", "memory"], help="run one of the two measurements (default: both)")
    p.add_argument("--memory-model", default="tiny", help="train.py --model for the memory measurement")
    p.add_argument("--train-args", default="--sft-steps 100 --eval-problems 16 --eval-samples 1",
                   help="further train.py options for the memory measurement")
    a = p.parse_args()
    if a.threads:  # on a CPU shared with other jobs, fewer threads than cores avoids spinning threads
        torch.set_num_threads(a.threads)
    result = {}
    if a.only != "memory":
        result.update(speed(a))
    if a.only != "speed":
        peaks = peak_memory(a)
        print(f"\npeak memory of a 1-iteration run of --model {a.memory_model}: "
              + ", ".join(f"{algo} {b / 2**20:.1f} MiB" for algo, b in peaks.items()))
        result.update(memory_ratio_vineppo_vs_ppo=peaks["vineppo"] / peaks["ppo"], peak_memory_bytes=peaks)
    result.update(torch_threads=torch.get_num_threads(), args=vars(a))
    print(json.dumps(result))


def speed(a) -> dict:
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
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=a.new_tokens, eos_id=a.vocab,
                                pad_id=PAD)

    def forward():  # the log-prob pass over whole trajectories that training does anyway
        ids, mask = rollout.pad_right(trajs, PAD, a.device)
        return (rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1],)

    def naive():
        for prefix in prefixes:
            rollout.sample(model, [prefix], a.k, [a.new_tokens], sampling)

    def fork_each(cache):
        for prefix, row in zip(prefixes, rows):
            rollout.sample(model, [prefix], a.k, [a.new_tokens], sampling, cache=cache, rows=[row])

    def fork_batch(cache, method="copy"):
        batched = dataclasses.replace(sampling, max_batch_tokens=a.max_batch_tokens)
        out, done = rollout.sample(model, prefixes, a.k, budgets, batched, cache=cache, rows=rows,
                                   fork_method=method)
        assert sum(len(c) for cs in out for c in cs) == n_tokens and not any(map(any, done))

    mean_len = round(sum(map(len, prefixes)) / len(prefixes))
    floor_prefix = trajs[0][:mean_len]
    with torch.no_grad():
        ids, mask = rollout.pad_right([floor_prefix], PAD, a.device)
        floor_cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1]

    def decode_only():  # every row forks row 0 of floor_cache; one batch, whatever its size
        rollout.sample(model, [floor_prefix] * len(prefixes), a.k, budgets,
                       dataclasses.replace(sampling, max_batch_tokens=1 << 62), cache=floor_cache,
                       rows=[0] * len(prefixes))

    methods = {"naive": (naive, lambda: ()), "fork-each": (fork_each, forward), "fork-batch": (fork_batch, forward),
               "fork-gather": (lambda cache: fork_batch(cache, "gather"), forward),
               "decode-only": (decode_only, lambda: ()), "forward": (forward, lambda: ())}

    names = list(methods)
    times = {name: [] for name in names}
    start = time.perf_counter()
    with torch.no_grad():
        # warm-up
        rollout.sample(model, [floor_prefix], a.k, [a.new_tokens], sampling, cache=floor_cache, rows=[0])
        for r in range(a.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate so no method is always first
                torch.manual_seed(a.seed + r)
                fn, setup = methods[name]
                times[name].append(timed(fn, a.device, setup))
                print(f"  repeat {r + 1}/{a.repeats} {name:<12} {times[name][-1]:8.2f} s", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"\n{n_params / 1e6:.1f}M params, {a.dtype} on {a.device}, torch threads {torch.get_num_threads()}; "
          f"{len(prefixes)} states x {a.k} continuations x {a.new_tokens} tokens = {n_tokens} tokens; "
          f"mean state length {mean_len}")
    print(f"{'method':<12} {'median s':>10} {'tokens/s':>10} {'x fork-batch':>13}")
    for name in names:
        rate = f"{n_tokens / med[name]:>10.1f}" if name != "forward" else f"{'':>10}"
        print(f"{name:<12} {med[name]:>10.3f} {rate} {med[name] / med['fork-batch']:>13.2f}")
    print(f"(forward: the log-prob pass over {a.trajectories} x {a.traj_len} tokens that every method needs anyway)")
    cuts = rollout.least_padding(list(map(len, prefixes)), budgets, [a.k] * len(prefixes), a.max_batch_tokens,
                                 rollout.batch_overhead(model))
    padding = rollout.padding_fraction(cuts, list(map(len, prefixes)), budgets, [a.k] * len(prefixes))
    print(f"padding: fork-batch and fork-gather {padding:.1%} of the tokens of their {len(cuts)} batches; "
          "naive, fork-each and decode-only none (one prefix length per batch)")
    print(f"total benchmark time {time.perf_counter() - start:.1f} s")
    return {"speedup_vs_naive": med["naive"] / med["fork-batch"],
            "overhead_vs_decode_only": med["fork-batch"] / med["decode-only"],
            "gather_vs_copy": med["fork-gather"] / med["fork-batch"],
            "fork_batch_padding": padding, "fork_batches": len(cuts),
            "median_s": med, "continuation_tokens": n_tokens, "params": n_params, "mean_state_len": mean_len}


if __name__ == "__main__":
    main()
