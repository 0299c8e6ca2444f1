"""How much do KV-cache forks save when sampling VinePPO's Monte Carlo continuations?

    python bench.py                        # ~60M-param random Llama, 8 x 600-token trajectories
    python bench.py --dtype bfloat16 --layers 16 --hidden 1024
    python bench.py --threads 1            # on a CPU shared with another job (else threads spin)
    python bench.py --gpu-report OUT --device cuda   # the GPU report (8 minutes, see below)
    python bench.py --gpu-report OUT --smoke         # the same code, tiny, any device (< 1 min)
    python bench.py --count-mc-tokens DATA.jsonl --tokenizer DIR   # tokens an iteration generates

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
trajectories are random tokens. Each repeat times every method once (fork-batch twice when
naive, decode-only and fork-gather all run): the two of each ratio back to back, which of them
goes first alternating from repeat to repeat. Reported: each method's median seconds, and each
ratio's median over the repeats' pairs with its min-max (machine drift between pairs does not
enter a pair's ratio). The last printed line is one JSON object.

--gpu-report OUT measures, in one time-boxed run, what no GPU has measured yet: tokens/s of sampling
and of MC continuations at rho-math-1.1b's shape, the peak memory and seconds per phase of one
train.py iteration of each --algo, and from them the hours of the paper's run (the section "the GPU
report" below; docs/speed-and-memory.md). --count-mc-tokens counts the tokens one iteration of the
paper's GSM8K run generates, with gold solutions as the responses. Every option has a rule: a bad
one ends in one line and exit status 2.
"""
import argparse
import contextlib
import dataclasses
import functools
import gc
import io
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import weakref
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

import batching
import fork
import math_grader
import reward
import rollout
import vine
from engineering import outputs, parallel, settings, tasks
from engineering.prompts import encode_prompt
from engineering.sft import sft_example, sft_target
from engineering.tasks import DataError, first_line

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
                    self.refs[key] = weakref.ref(storage,
                                                 lambda _, key=key, n=nbytes: self._free(key, n))
        return out


def peak_memory(a) -> dict:
    """Peak memory of a one-iteration train.py run per algorithm (same model, data and budgets):
    torch.cuda.max_memory_allocated on a GPU, LiveTensorBytes on a CPU."""
    import train
    peaks = {}
    for algo in ("vineppo", "ppo"):
        with tempfile.TemporaryDirectory() as out:
            argv = memory_argv(a, algo, out)
            print(f"  memory: train.py {' '.join(argv)}", flush=True)
            cfg = train.parse_args(argv)
            with (contextlib.redirect_stdout(io.StringIO()),
                  contextlib.redirect_stderr(io.StringIO())):
                if a.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                    train.main(cfg)
                    peaks[algo] = torch.cuda.max_memory_allocated()
                else:
                    with LiveTensorBytes() as counter:
                        train.main(cfg)
                    peaks[algo] = counter.peak
    return peaks


def memory_argv(a, algo: str, out: str) -> list[str]:
    return ["--algo", algo, "--iterations", "1", "--out", out, "--model", a.memory_model,
            "--device", a.device] + a.train_args.split()


def build_model(a):
    torch.manual_seed(a.seed)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads,
                         max_position_embeddings=a.traj_len + a.new_tokens + 8, pad_token_id=PAD)
    # initialised where it runs: a 1.1B model's init on a CPU takes a while
    with torch.device(a.device):
        model = LlamaForCausalLM(config)
    return model.to(a.device, getattr(torch, a.dtype)).eval()


def timed(fn, device, setup=lambda: ()):
    """Seconds taken by fn(*setup()), setup untimed, waiting for queued GPU work before and
    after."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    args = setup()
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - t0


INTS = [("layers", 8), ("hidden", 512), ("heads", 8), ("kv-heads", 8), ("intermediate", 1376),
        ("vocab", 32000), ("trajectories", 8), ("traj-len", 600), ("states", 6), ("k", 4),
        ("new-tokens", 16), ("repeats", 3), ("max-batch-tokens", 32768), ("seed", 0),
        ("threads", 0)]  # threads: CPU threads for torch, 0 = torch's
# what --gpu-report takes
REPORT_OPTIONS = {"--gpu-report", "--smoke", "--overwrite", "--device", "--threads"}
# bench.py gives each run of the memory measurement these: --train-args may not
OWNED = ("--out", "--overwrite", "--resume", "--algo")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # one line, no usage
    p.error = lambda message: sys.exit(print(f"error: {message}", file=sys.stderr) or 2)
    for name, default in INTS:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["speed", "memory"],
                   help="run one of the two measurements (default: both)")
    p.add_argument("--memory-model", default="tiny",
                   help="train.py --model for the memory measurement")
    p.add_argument("--train-args", default="--sft-steps 100 --eval-problems 16 --eval-samples 1",
                   help="further train.py options for the memory measurement "
                        "(--out, --overwrite, --resume and --algo are bench.py's)")
    p.add_argument("--gpu-report", metavar="OUT",
                   help="write OUT/gpu-report.json and .md (the GPU report) into an empty OUT")
    p.add_argument("--overwrite", action="store_true",
                   help="with --gpu-report: replace an earlier report in OUT")
    p.add_argument("--smoke", action="store_true",
                   help="with --gpu-report: a tiny shape, any device, < 1 minute")
    p.add_argument("--count-mc-tokens", metavar="DATA",
                   help="a GSM8K .jsonl: tokens an iteration generates")
    p.add_argument("--tokenizer", default="realtreetune/rho-1b-sft-GSM8K",
                   help="for --count-mc-tokens")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    a.command = "python bench.py " + " ".join(argv)
    check_args(a, p.error, {word.split("=")[0] for word in argv if word.startswith("--")})
    return a


def check_args(a, error, given: set):
    """Each option against its rule, before any work (one line and exit 2 otherwise)."""
    for name, _ in INTS:
        v, low = getattr(a, name.replace("-", "_")), 0 if name in ("seed", "threads") else 1
        if v < low or (name == "vocab" and v < 4):
            error(f"--{name} {v}: expected >= {4 if name == 'vocab' else low}")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2 or a.heads % a.kv_heads:
        error(f"--hidden {a.hidden}, --heads {a.heads}, --kv-heads {a.kv_heads}: expected heads "
              "dividing hidden into an even head size, and kv-heads dividing heads")
    if a.states >= a.traj_len:
        error(f"--states {a.states}: expected fewer than --traj-len {a.traj_len} "
              "(distinct prefixes)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", a.device):
        error(f"--device {a.device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        error(f"--device {a.device}: no CUDA device is available here (torch {torch.__version__}); "
              + ("--smoke rehearses the report on this CPU" if a.gpu_report
                 else "use --device cpu"))
    if a.device.startswith("cuda:") and int(a.device[5:]) >= torch.cuda.device_count():
        error(f"--device {a.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    if a.gpu_report is not None:
        if given - REPORT_OPTIONS:
            error("--gpu-report takes only "
                  f"{', '.join(sorted(REPORT_OPTIONS - {'--gpu-report'}))}; "
                  f"not {', '.join(sorted(given - REPORT_OPTIONS))}")
        if not a.smoke and not a.device.startswith("cuda"):
            error(f"--gpu-report at rho-math-1.1b's shape needs a GPU (--device {a.device}); "
                  "--smoke runs the same code at a tiny shape here")
        if os.path.exists(a.gpu_report) and not os.path.isdir(a.gpu_report):
            error(f"--gpu-report {a.gpu_report!r}: a file, expected a folder")
        try:
            outputs.claim(a.gpu_report, "--gpu-report", outputs.REPORT, a.overwrite,
                          "an earlier report")
        except DataError as e:
            error(str(e))
    elif a.smoke or a.overwrite:
        error(f"{'--smoke' if a.smoke else '--overwrite'}: only with --gpu-report OUT")
    import train  # its settings, which --train-args gives
    owned = [flag for flag in settings.given_flags(train.Config, a.train_args.split())
             if flag in OWNED]
    if owned:
        error(f"--train-args {a.train_args!r}: {', '.join(owned)}: bench.py's own; it gives each "
              "run of the memory measurement its --algo and a temporary --out")
    model = a.memory_model
    if (a.only != "speed" and model.startswith((".", "/", "~"))  # not a hub id
            and not os.path.isdir(model)):
        error(f"--memory-model {model!r}: no such directory")


def main(argv=None):
    a = parse_args(argv)
    # on a CPU shared with other jobs, fewer threads than cores avoids spinning threads
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        if a.gpu_report is not None:
            return gpu_report(a)
        if a.count_mc_tokens:
            return print(json.dumps(count_mc_tokens(a.count_mc_tokens, a.tokenizer)))
        memory_and_speed(a)
    except DataError as e:
        # a setting of the memory measurement's train.py run, its model or its data
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)


def memory_and_speed(a):
    result = {}
    if a.only != "speed":
        import train
        # its settings' errors before the speed run
        train.parse_args(memory_argv(a, "vineppo", "out"))
    if a.only != "memory":
        result.update(speed(a))
    if a.only != "speed":
        peaks = peak_memory(a)
        print(f"\npeak memory of a 1-iteration run of --model {a.memory_model}: "
              + ", ".join(f"{algo} {b / 2**20:.1f} MiB" for algo, b in peaks.items()))
        result.update(memory_ratio_vineppo_vs_ppo=peaks["vineppo"] / peaks["ppo"],
                      peak_memory_bytes=peaks)
    result.update(torch_threads=torch.get_num_threads(), args=vars(a))
    print(json.dumps(result))


def forking_by(method: str):
    """fork.fork with its method ("copy" or "gather") fixed, where continue_from_cache
    calls it (its default: by the device)."""
    return mock.patch.object(fork, "fork", functools.partial(fork.fork, method=method))


def speed(a, model=None, only=None, autocast=contextlib.nullcontext()) -> dict:
    """The fork benchmark: a random model built from `a` (or `model`), the methods in `only`
    (default: all)."""
    model = build_model(a) if model is None else model
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
    sampling = rollout.Sampling(temperature=getattr(a, "temperature", 1.0),
                                top_p=getattr(a, "top_p", 1.0),
                                max_new_tokens=a.new_tokens, eos_id=a.vocab, pad_id=PAD)

    def forward():  # the log-prob pass over whole trajectories that training does anyway
        ids, mask = rollout.pad_right(trajs, PAD, a.device)
        return (rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1],)

    def naive():
        for prefix in prefixes:
            rollout.sample(model, [prefix], a.k, [a.new_tokens], sampling)

    def fork_each(cache):
        for prefix, row in zip(prefixes, rows):
            fork.continue_from_cache(model, [prefix], a.k, [a.new_tokens], sampling,
                                           cache=cache, rows=[row])

    def fork_batch(cache, method="copy"):
        batched = dataclasses.replace(sampling, max_batch_tokens=a.max_batch_tokens)
        with forking_by(method):
            out, done = fork.continue_from_cache(model, prefixes, a.k, budgets, batched,
                                                       cache=cache, rows=rows)
        assert sum(len(c) for cs in out for c in cs) == n_tokens and not any(map(any, done))

    mean_len = round(sum(map(len, prefixes)) / len(prefixes))
    floor_prefix = trajs[0][:mean_len]
    with torch.no_grad(), autocast:
        ids, mask = rollout.pad_right([floor_prefix], PAD, a.device)
        floor_cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1]

    def decode_only():  # every row forks row 0 of floor_cache; one batch, whatever its size
        fork.continue_from_cache(model, [floor_prefix] * len(prefixes), a.k, budgets,
                                       dataclasses.replace(sampling, max_batch_tokens=1 << 62),
                                       cache=floor_cache, rows=[0] * len(prefixes))

    methods = {"naive": (naive, lambda: ()), "fork-each": (fork_each, forward),
               "fork-batch": (fork_batch, forward),
               "fork-gather": (lambda cache: fork_batch(cache, "gather"), forward),
               "decode-only": (decode_only, lambda: ()), "forward": (forward, lambda: ())}

    order = repeat_order([name for name in methods if only is None or name in only])
    names = [name for name in methods if name in order]

    def time_one(name, r):
        torch.manual_seed(a.seed + r)
        fn, setup = methods[name]
        seconds = timed(fn, a.device, setup)
        print(f"  repeat {r + 1}/{a.repeats} {name:<12} {seconds:8.2f} s", flush=True)
        return seconds

    start = time.perf_counter()
    with torch.no_grad(), autocast:
        # warm-up
        fork.continue_from_cache(model, [floor_prefix], a.k, [a.new_tokens], sampling,
                                       cache=floor_cache, rows=[0])
        runs = paired_runs(order, a.repeats, time_one)
    med = {name: statistics.median(s[i] for s in runs for i, n in enumerate(order) if n == name)
           for name in names}

    print(f"\n{n_params / 1e6:.1f}M params, {a.dtype} on {a.device}, torch threads "
          f"{torch.get_num_threads()}; {len(prefixes)} states x {a.k} continuations x "
          f"{a.new_tokens} tokens = {n_tokens} tokens; mean state length {mean_len}")
    print(f"{'method':<12} {'median s':>10} {'tokens/s':>10} {'x fork-batch':>13}")
    for name in names:
        rate = f"{n_tokens / med[name]:>10.1f}" if name != "forward" else f"{'':>10}"
        print(f"{name:<12} {med[name]:>10.3f} {rate} "
              f"{med[name] / med.get('fork-batch', med[name]):>13.2f}")
    print(f"(forward: the log-prob pass over {a.trajectories} x {a.traj_len} tokens that every "
          "method needs anyway)")
    cuts = batching.least_padding(list(map(len, prefixes)), budgets, [a.k] * len(prefixes),
                                  a.max_batch_tokens, batching.batch_overhead(model))
    padding = batching.padding_fraction(cuts, list(map(len, prefixes)), budgets,
                                        [a.k] * len(prefixes))
    print(f"padding: fork-batch and fork-gather {padding:.1%} of the tokens of their {len(cuts)} "
          "batches; naive, fork-each and decode-only none (one prefix length per batch)")
    ratios = paired_ratios(order, runs, print_as=f"{a.repeats} pairs")
    print(f"total benchmark time {time.perf_counter() - start:.1f} s")
    return {**{key: r and r[0] for key, r in ratios.items()},
            **{key + "_spread": r and [r[1], r[2]] for key, r in ratios.items()},
            "fork_batch_padding": padding, "fork_batches": len(cuts),
            "median_s": med, "continuation_tokens": n_tokens, "params": n_params,
            "mean_state_len": mean_len}


# The headline ratios: key -> (x, y), x and y timed back to back (either first) in every repeat.
RATIOS = {"speedup_vs_naive": ("naive", "fork-batch"),
          "overhead_vs_decode_only": ("fork-batch", "decode-only"),
          "gather_vs_copy": ("fork-gather", "fork-batch")}


def repeat_order(names: list[str]) -> list[str]:
    """One repeat's methods: those of no ratio first, then each ratio's x right before its y.

    fork-batch sits between two partners; a third gets a second fork-batch.
    """
    if "fork-batch" not in names:
        return list(names)
    before = [x for x in ("naive", "fork-gather") if x in names]  # x of a ratio over fork-batch
    chain = before[:1] + ["fork-batch"] + (["decode-only"] if "decode-only" in names else [])
    if len(before) == 2:
        chain += ["fork-gather", "fork-batch"]
    if chain == ["fork-batch"]:
        return list(names)
    return [name for name in names if name not in chain] + chain


def paired_runs(order: list[str], repeats: int, time_one) -> list[list[float]]:
    """Seconds of order[i] in each repeat: order forward in even repeats, reversed in odd ones.

    So every side-by-side pair alternates which of its two goes first; time_one(name, r) times one.
    """
    runs = []
    for r in range(repeats):
        seconds = [0.0] * len(order)
        for i in range(len(order)) if r % 2 == 0 else reversed(range(len(order))):
            seconds[i] = time_one(order[i], r)
        runs.append(seconds)
    return runs


def paired_ratios(order: list[str], runs: list[list[float]], print_as: str = "") -> dict:
    """RATIOS' key -> (median, min, max) over the repeats of x / y timed side by side, or None.

    With print_as ("3 pairs"), each is also printed on a line of its own.
    """
    result = dict.fromkeys(RATIOS)
    for key, (x, y) in RATIOS.items():
        i = next((i for i in range(len(order) - 1) if {order[i], order[i + 1]} == {x, y}), None)
        if i is not None:
            top, bottom = (i, i + 1) if order[i] == x else (i + 1, i)
            ratios = [seconds[top] / seconds[bottom] for seconds in runs]
            result[key] = median, low, high = statistics.median(ratios), min(ratios), max(ratios)
            if print_as:
                print(f"{key}: {x} / {y} {median:.2f} (min-max {low:.2f}-{high:.2f}; median of "
                      f"{print_as} timed back to back, which first alternating)")
    return result


# ---- the GPU report (--gpu-report OUT): what no GPU has measured yet, in one 8-minute command ----
# Parts run in order, each time-boxed and each written to OUT at once: a part that fails or runs out
# of time records its one-line error, and the report goes on.
# --smoke runs the same code at a tiny shape.

RHO = dict(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000,
           context=2048)
MODES = {
    "gpu": dict(shape=RHO, budget_s=450,  # and about 30 s to start and end the process: 8 minutes
                budgets=dict(environment=10, model_files=60, generation=120, iteration_vineppo=110,
                             iteration_ppo=60, iteration_grpo=40, iteration_tppo=45, estimate=5),
                # plain sampling: GSM8K-long prompts (~80 tokens),
                # the iteration's prompts x samples: the rollout of one GPU of eight (8 prompts)
                # and of one GPU alone (64 prompts)
                plain=dict(prompt_tokens=80, new_tokens=128),
                # fork benchmark: 32 trajectories of prompt + response, 4 states each, K 9,
                # in generate calls of 468 rows: what train.py's 524,288-token budget holds
                # at its 1,024-token response budget
                fork=dict(trajectories=32, traj_len=192, states=4, k=9, new_tokens=64, repeats=2,
                          max_batch_tokens=106496),
                # train.py: a GPU's share of the paper's 64 x 8 over 8 GPUs, the reference's
                # per-device batch 8 with gradient checkpointing
                # (McGill-NLP/VinePPO configs/trainers/ppo_MATH.jsonnet)
                train=dict(prompts=8, samples=8, minibatch=8, micro_batch=8, max_new_tokens=128,
                           newline_every=25)),
    "smoke": dict(shape=dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=2048,
                             context=512),
                  budget_s=55,
                  budgets=dict(environment=5, model_files=10, generation=12, iteration_vineppo=15,
                               iteration_ppo=10, iteration_grpo=8, iteration_tppo=10, estimate=5),
                  plain=dict(prompt_tokens=16, new_tokens=8),
                  fork=dict(trajectories=4, traj_len=40, states=2, k=3, new_tokens=8, repeats=1,
                            max_batch_tokens=256),
                  train=dict(prompts=2, samples=2, minibatch=4, micro_batch=2, max_new_tokens=12,
                             newline_every=4)),
}
# in order of importance: tppo is the first to lose its time
ALGOS = ("vineppo", "ppo", "grpo", "tppo")
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gsm8k_sample.jsonl")
# Tokens an iteration of the paper's GSM8K run generates (64 prompts x 8 samples, K 9, <= 26
# states), counted by `--count-mc-tokens` on GSM8K's 7,473 training solutions (the SFT targets the
# policy imitates) with a Llama 2 tokenizer (rho-math-1.1b's): a count on stand-in responses, not a
# measurement of a policy; its MC tokens are an upper bound (a policy's samples share states, each
# estimated once).
# straggler: a generate call decodes its 474 rows until the longest stops, 3.0x the mean response.
GSM8K_TOKENS = dict(response=50825, mc=805769, straggler=3.01)


def gpu_report(a):
    """Every part in turn, each within its budget and the time left; OUT/gpu-report.json and .md
    after each."""
    mode = MODES["smoke" if a.smoke else "gpu"]
    # nothing here needs the hub; a GPU machine may have no network
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        os.makedirs(a.gpu_report, exist_ok=True)
    except OSError as e:
        raise DataError(f"--gpu-report {a.gpu_report!r}: cannot make it "
                        f"({first_line(e)})") from None
    began = time.perf_counter()
    report = {"command": a.command, "mode": "smoke" if a.smoke else "gpu", "device": a.device,
              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "budget_s": mode["budget_s"], "seconds": None, "shape": mode["shape"],
              "settings": json.loads(json.dumps({k: mode[k] for k in ("plain", "fork", "train")})),
              "parts": {}}
    with tempfile.TemporaryDirectory() as tmp:  # the random model's files (2.2 GB at 1.1B)
        ctx = argparse.Namespace(out=a.gpu_report, device=a.device, mode=mode, report=report,
                                 model_dir=os.path.join(tmp, "model"),
                                 deadline=began + mode["budget_s"])
        run_part(ctx, "environment", environment)
        run_part(ctx, "model_files", model_files)
        run_part(ctx, "generation", generation_speed)
        report["settings"]["train"].update(choose_new_tokens(ctx))
        for algo in ALGOS:
            run_part(ctx, f"iteration_{algo}",
                     lambda ctx, result, algo=algo: iteration(ctx, result, algo))
        run_part(ctx, "estimate", estimate)
        report["seconds"] = round(time.perf_counter() - began, 2)
        write_report(ctx)
    print(markdown(report))


def run_part(ctx, name: str, fn):
    """fn(ctx, result) within min(its budget, the time left): result, seconds and status (or
    one-line error)."""
    budget = max(0.0, min(ctx.mode["budgets"][name], ctx.deadline - time.perf_counter()))
    part = ctx.report["parts"][name] = {"status": "running", "budget_s": round(budget, 1),
                                        "seconds": 0.0, "error": None}
    result, t0 = {}, time.perf_counter()
    print(f"gpu-report: {name} (budget {budget:.0f} s)", flush=True)
    try:
        if budget < 1:
            part.update(status="skipped", error="the report's time was spent")
        else:
            with math_grader.time_limit(budget):  # SIGALRM, as MATH's grader bounds sympy
                fn(ctx, result)
            part["status"] = "ok"
    # a partial report is still a report: the error, in one line
    except (Exception, math_grader.OutOfTime) as e:
        # not an Exception: no `except Exception` swallows it
        late = isinstance(e, math_grader.OutOfTime)
        part.update(status="failed", error=f"{type(e).__name__}: " +
                    (f"over its budget of {budget:.0f} s" if late else first_line(e)))
        print(f"gpu-report: {name} failed: {part['error']}", flush=True)
    part.update(result, seconds=round(time.perf_counter() - t0, 2))
    del result
    gc.collect()  # what a failed part held
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    write_report(ctx)


def environment(ctx, result):
    import platform
    import transformers
    cuda = ctx.device.startswith("cuda")
    props = torch.cuda.get_device_properties(torch.device(ctx.device)) if cuda else None
    result.update(python=platform.python_version(), torch=torch.__version__,
                  transformers=transformers.__version__,
                  cuda=torch.version.cuda, gpu_name=props.name if cuda else None,
                  gpu_memory_bytes=props.total_memory if cuda else None,
                  bf16_supported=torch.cuda.is_bf16_supported() if cuda else None,
                  torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count())


def tokenizer_32k(texts: list[str], size: int, newline_every: int):
    """A Llama-style tokenizer of `size` entries, made offline: <unk>, <s>, </s>, 256 byte tokens
    and a BPE learnt on `texts` (as test_realpath's), then unused filler tokens up to `size`, one in
    `newline_every` ending in a newline. A random model samples all entries about alike, so its text
    opens a line, a step, about every `newline_every` tokens: GSM8K's solutions have a line per 28
    tokens of Llama 2's."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as token_models
    from transformers import LlamaTokenizer
    bpe = Tokenizer(token_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    lines = [line for text in texts for line in text.split("\n")]
    trainer = trainers.BpeTrainer(vocab_size=size // 2, limit_alphabet=70, show_progress=False)
    bpe.train_from_iterator(lines, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += sorted(trained["vocab"], key=trained["vocab"].get)
    known, i = set(tokens), 0
    while len(tokens) < size:
        filler = f"▁w{i}" + ("\n" if i % newline_every == 0 else "")
        if filler not in known:
            tokens.append(filler)
        i += 1
    return LlamaTokenizer(vocab={t: n for n, t in enumerate(tokens)},
                          merges=[tuple(m) for m in trained["merges"]])


def model_files(ctx, result):
    """The 32k tokenizer and a random Llama of the report's shape, saved as a hub model (bf16 on
    disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    shape, train = ctx.mode["shape"], ctx.mode["train"]
    problems = tasks.read_jsonl(FIXTURE)
    texts = [reward.PROMPT.format(question=p["question"]) for p in problems]
    tok = tokenizer_32k(texts + [sft_target(p["answer"]) for p in problems], shape["vocab"],
                        train["newline_every"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=shape["context"], bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(ctx.model_dir)  # train.py loads it in fp32
    tok.save_pretrained(ctx.model_dir)
    prompt_tokens = [len(encode_prompt(tok, text)) for text in texts]
    result.update(params=sum(t.numel() for t in model.parameters()), vocab=len(tok),
                  attention_implementation=model.config._attn_implementation,
                  mean_prompt_tokens=round(statistics.mean(prompt_tokens), 1),
                  data=os.path.relpath(FIXTURE))


def generation_speed(ctx, result):
    """Tokens/s of plain sampling and of the fork benchmark, in train.py's precision (bf16 autocast
    over fp32 weights); plain sampling once more with the weights themselves in bf16."""
    shape, fork_mode, train = ctx.mode["shape"], ctx.mode["fork"], ctx.mode["train"]
    sizes = {k: shape[k]
             for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")}
    a = argparse.Namespace(**sizes, **fork_mode, seed=0, dtype="float32", device=ctx.device,
                           temperature=0.6, top_p=0.9)
    model = build_model(a)
    autocast = torch.autocast(torch.device(ctx.device).type, dtype=torch.bfloat16)
    result.update(attention_implementation=model.config._attn_implementation,
                  precision="bf16 autocast over fp32 weights (train.py's --precision bf16)",
                  plain=[])
    plain = dict(ctx.mode["plain"], samples=train["samples"])
    # a GPU's share of eight; one GPU's whole batch
    for n_prompts in (train["prompts"], 8 * train["prompts"]):
        result["plain"].append(plain_sampling(model, shape["vocab"], plain, n_prompts, ctx.device,
                                              autocast, "autocast"))
    with contextlib.redirect_stdout(io.StringIO()):
        forks = speed(a, model, only=("fork-batch", "fork-gather", "decode-only", "forward"),
                      autocast=autocast)
    n = forks["continuation_tokens"]
    result["fork"] = dict(rows=fork_mode["trajectories"] * fork_mode["states"]
                          * fork_mode["k"],
                          continuation_tokens=n,
                          mean_state_len=forks["mean_state_len"], median_s=forks["median_s"],
                          tokens_per_s={k: n / s for k, s in forks["median_s"].items()
                                        if k != "forward"},
                          gather_vs_copy=forks["gather_vs_copy"],
                          overhead_vs_decode_only=forks["overhead_vs_decode_only"],
                          gather_vs_copy_spread=forks["gather_vs_copy_spread"],
                          overhead_vs_decode_only_spread=forks["overhead_vs_decode_only_spread"],
                          default_method=("fork-gather" if ctx.device.startswith("cuda")
                                          else "fork-batch"))
    model.to(torch.bfloat16)
    result["plain"].append(plain_sampling(model, shape["vocab"], plain, 8 * train["prompts"],
                                          ctx.device, contextlib.nullcontext(), "bf16 weights"))


def plain_sampling(model, vocab: int, plain: dict, prompts: int, device: str, autocast,
                   precision: str) -> dict:
    """Responses sampled from random prompts as the rollout samples them (T 0.6, top-p 0.9), never
    stopping."""
    g = torch.Generator().manual_seed(prompts)
    ids = torch.randint(3, vocab, (prompts, plain["prompt_tokens"]), generator=g).tolist()
    sampling = rollout.Sampling(temperature=0.6, top_p=0.9, max_new_tokens=plain["new_tokens"],
                                eos_id=vocab, pad_id=PAD, max_batch_tokens=524288)
    budgets = [plain["new_tokens"]] * prompts
    with torch.no_grad(), autocast:
        rollout.sample(model, ids[:1], 1, [2], sampling)  # warm-up
        seconds = timed(lambda: rollout.sample(model, ids, plain["samples"], budgets, sampling),
                        device)
    tokens = prompts * plain["samples"] * plain["new_tokens"]
    return dict(precision=precision, rows=prompts * plain["samples"],
                prompt_tokens=plain["prompt_tokens"], new_tokens=plain["new_tokens"], tokens=tokens,
                seconds=seconds, tokens_per_s=tokens / seconds)


def rate(report: dict, rows: int | None = None, precision: str = "autocast") -> float | None:
    """Measured tokens/s: plain sampling at `rows` rows, or (rows None) the fork benchmark's default
    method."""
    generation = report["parts"].get("generation", {})
    if rows is None:
        fork_result = generation.get("fork") or {}
        return (fork_result.get("tokens_per_s") or {}).get(fork_result.get("default_method"))
    return next((p["tokens_per_s"] for p in generation.get("plain", []) if p["rows"] == rows
                 and p["precision"] == precision), None)


def choose_new_tokens(ctx) -> dict:
    """The response budget of the iterations: the largest of L, L/2, L/4, ... whose VinePPO
    generation, predicted from the measured rates, takes at most a quarter of the VinePPO part's
    budget (it runs two iterations); L without rates."""
    train, fork_mode = ctx.mode["train"], ctx.mode["fork"]
    rows = train["prompts"] * train["samples"]
    plain_rate, fork_rate = rate(ctx.report, rows), rate(ctx.report)
    chosen = {"max_new_tokens": train["max_new_tokens"], "predicted_generation_s": None}
    if not plain_rate or not fork_rate:
        return chosen
    for budget in (train["max_new_tokens"] >> i for i in range(8)):
        # the prompt, then a line per newline_every tokens
        states = 1 + budget // train["newline_every"]
        # each runs the rest, L/2 on average
        mc = fork_mode["k"] * (train["prompts"] + rows * (states - 1)) * budget / 2
        predicted = rows * budget / plain_rate + mc / fork_rate
        chosen = {"max_new_tokens": max(budget, 2), "predicted_generation_s": round(predicted, 2)}
        if predicted <= ctx.mode["budgets"]["iteration_vineppo"] / 4:
            break
    return chosen


def train_argv(ctx, algo: str, out: str) -> list[str]:
    """Two iterations (the second's phases; the peak over both: only from the second on are AdamW's
    moments alive while sampling), no evaluation; train.py's generation budget, so its buffers are a
    real run's."""
    train = ctx.report["settings"]["train"]
    return ["--model", ctx.model_dir, "--data", FIXTURE, "--algo", algo, "--out", out,
            "--device", ctx.device, "--iterations", "2", "--precision", "bf16",
            "--prompts-per-iter", str(train["prompts"]),
            "--samples-per-prompt", str(train["samples"]), "--minibatch", str(train["minibatch"]),
            "--micro-batch", str(train["micro_batch"]),
            "--max-new-tokens", str(train["max_new_tokens"]),
            "--gradient-checkpointing", "--eval-every", "0", "--save-every", "0"]


@contextlib.contextmanager
def peak_meter(device: str, into: dict):
    """into['peak_memory_bytes']: torch.cuda.max_memory_allocated on a GPU, live tensor bytes on a
    CPU; also on the way out of an error or a timeout (the peak until then)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        into.update(peak_memory_kind="torch.cuda.max_memory_allocated",
                    allocated_before_bytes=torch.cuda.memory_allocated(device))
        try:
            yield
        finally:
            into["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        return
    into.update(peak_memory_kind="CPU: peak live tensor bytes (bench.LiveTensorBytes), "
                                 "not a CUDA allocator's",
                allocated_before_bytes=0)
    counter = LiveTensorBytes()
    try:
        with counter:
            yield
    finally:
        into["peak_memory_bytes"] = counter.peak


def iteration(ctx, result: dict, algo: str):
    """train.py in this process (train_argv): peak memory, seconds per phase, what its last
    iteration generated. Evaluation and the checkpoint write are no phases of an iteration: no-ops
    here (a checkpoint of a 1.1B policy and its AdamW state is 13 GB, PPO's twice that)."""
    from engineering import checkpoint
    import train
    shape = ctx.mode["shape"]
    result["model_state_bytes_arithmetic"] = model_state_bytes(shape,
                                                               critic=algo in ("ppo", "tppo"))
    with tempfile.TemporaryDirectory() as out:
        argv = train_argv(ctx, algo, out)
        result["argv"] = " ".join(argv).replace(ctx.model_dir, "MODEL").replace(out, "OUT")
        cfg = train.parse_args(argv)
        quiet = contextlib.ExitStack()
        for context in (contextlib.redirect_stdout(io.StringIO()),
                        contextlib.redirect_stderr(io.StringIO()),
                        mock.patch.object(train, "evaluate", lambda *args, **kwargs: {}),
                        mock.patch.object(checkpoint, "save_training_state",
                                          lambda *args, **kwargs: None)):
            quiet.enter_context(context)
        with quiet, peak_meter(ctx.device, result):
            train.main(cfg)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            row = [json.loads(line) for line in f][-1]
    result["time"] = {k: round(row[k], 3) for k in parallel.PHASES + ("seconds",)}
    result["metrics"] = {k: row[k] for k in ("episodes", "response_tokens", "mc_states",
                                             "mc_continuations", "mc_tokens", "tokens_generated")}


def model_state_bytes(shape: dict, critic: bool) -> int:
    """Arithmetic, no measurement: 16 bytes a trained parameter (fp32 weight, gradient, two AdamW
    moments) for the policy and PPO's critic (the policy's backbone without its LM head; the head's
    2049 left out), and the frozen reference with its Linear weights in bf16
    (models.cast_linear_weights)."""
    h, layers, vocab = shape["hidden"], shape["layers"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    # the decoder layers' Linears
    backbone = layers * (2 * h * h + 2 * h * kv + 3 * h * shape["intermediate"])
    # the embedding and the norms, fp32 in the reference too
    other = vocab * h + (2 * layers + 1) * h
    policy = backbone + vocab * h + other  # the LM head is untied (rho-math-1.1b's)
    reference = 2 * (backbone + vocab * h) + 4 * other
    return 16 * policy + (16 * (backbone + other) if critic else 0) + reference


def estimate(ctx, result):
    """Hours of the paper's 650 GSM8K iterations, arithmetic on measured rates: the tokens an
    iteration generates (GSM8K_TOKENS) over the measured tokens/s, plus the measured seconds of the
    iteration's other phases (8 GPUs: each GPU an eighth of the tokens at its share's rates;
    communication not counted).
    *_stragglers: the generation x GSM8K_TOKENS["straggler"], a generate call running to its
    longest row."""
    parts, train = ctx.report["parts"], ctx.report["settings"]["train"]
    rows = train["prompts"] * train["samples"]
    rates = {"plain_one_gpu": rate(ctx.report, 8 * rows),
             "plain_eight_gpus": rate(ctx.report, rows), "fork": rate(ctx.report)}
    result.update(iterations=650, tokens_per_iteration=GSM8K_TOKENS, tokens_per_s=rates, hours={},
                  label="arithmetic on measured rates and counted tokens, not a measured run",
                  # without them: the last figure only
                  missing=[name for name, r in rates.items() if not r])
    hours = lambda seconds: None if seconds is None else round(650 * seconds / 3600, 2)
    for algo in ALGOS:
        measured = parts.get(f"iteration_{algo}", {}).get("time")
        if not measured:
            continue
        figures = result["hours"][algo] = dict.fromkeys(("one_gpu", "one_gpu_stragglers",
                                                         "eight_gpus", "eight_gpus_stragglers"))
        figures["eight_gpus_as_measured"] = hours(measured["seconds"])
        if result["missing"]:
            continue
        other = measured["seconds"] - measured["time_rollout"] - measured["time_mc_values"]
        mc = GSM8K_TOKENS["mc"] / rates["fork"] if algo == "vineppo" else 0.0
        one = GSM8K_TOKENS["response"] / rates["plain_one_gpu"] + mc
        eight = (GSM8K_TOKENS["response"] / rates["plain_eight_gpus"] + mc) / 8
        slower = GSM8K_TOKENS["straggler"]
        figures.update(one_gpu=hours(one + 8 * other),
                       one_gpu_stragglers=hours(slower * one + 8 * other),
                       eight_gpus=hours(eight + other),
                       eight_gpus_stragglers=hours(slower * eight + other))


def write_report(ctx):
    """OUT/gpu-report.json and OUT/gpu-report.md, each replaced whole (a kill leaves the last
    complete pair)."""
    files = (("gpu-report.json", json.dumps(ctx.report, indent=1)),
             ("gpu-report.md", markdown(ctx.report)))
    for name, text in files:
        path = os.path.join(ctx.out, name)
        try:
            with open(path + ".tmp", "w") as f:
                f.write(text + "\n")
            os.replace(path + ".tmp", path)
        except OSError as e:
            raise DataError(f"--gpu-report: cannot write {path} ({first_line(e)})") from None


def cell(value, spec: str = ".3g") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else format(value, spec)


def size(nbytes) -> str:
    if nbytes is None:
        return "—"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def markdown(report: dict) -> str:
    """The report as tables: generation, memory and phases, the estimate, what ran, the parts and
    budgets."""
    parts = report["parts"]
    title = "GPU report" + ("" if report["mode"] == "gpu"
                            else ", smoke run (a tiny shape: not the GPU's numbers)")
    lines = [f"# {title}", "",
             f"`{report['command']}` on {report['device']}, {report['started_utc']} UTC: "
             f"{cell(report['seconds'], '.0f')} s of a {report['budget_s']} s budget. "
             f"Shape: {report['shape']}; "
             "random weights, GSM8K's format (fixtures/gsm8k_sample.jsonl), a tokenizer of "
             f"{report['shape']['vocab']:,} entries made here.", ""]
    lines += generation_table(parts.get("generation", {}))
    lines += iteration_table(report)
    lines += estimate_table(parts.get("estimate", {}))
    env = {**parts.get("environment", {}), **parts.get("model_files", {})}
    env["gpu_memory"] = size(env.get("gpu_memory_bytes")) if env.get("gpu_memory_bytes") else None
    lines += ["## What ran", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {cell(env.get(k))} |"
              for k in ("gpu_name", "gpu_memory", "bf16_supported", "cuda", "torch", "transformers",
                        "python", "attention_implementation", "params", "vocab",
                        "mean_prompt_tokens", "torch_threads")]
    lines += ["", "## Parts", "", "| part | status | seconds | budget s | error |",
              "| --- " * 5 + "|"]
    lines += [f"| {name} | {p['status']} | {p['seconds']:.1f} | {p['budget_s']:.0f} | "
              f"{cell(p['error'])} |"
              for name, p in parts.items()]
    return "\n".join(lines)


def generation_table(generation: dict) -> list[str]:
    lines = ["## Generation: tokens/s (no row stops early)", "",
             f"{generation.get('precision', '—')}, "
             f"attention {generation.get('attention_implementation', '—')}; T 0.6, top-p 0.9.", "",
             "| what | rows | tokens | seconds | tokens/s |", "| --- " * 5 + "|"]
    for p in generation.get("plain", []):
        lines.append(f"| plain sampling ({p['precision']}): {p['prompt_tokens']}-token prompts, "
                     f"{p['new_tokens']} new tokens | {p['rows']} | {p['tokens']:,} | "
                     f"{p['seconds']:.2f} | {p['tokens_per_s']:,.0f} |")
    fork_result = generation.get("fork")
    for name, seconds in (fork_result or {}).get("median_s", {}).items():
        tokens_per_s = fork_result["tokens_per_s"].get(name)
        what = (f"{name}: MC continuations, states of {fork_result['mean_state_len']} tokens "
                "on average"
                if tokens_per_s
                else "forward: the log-prob pass that keeps the cache (not generation)")
        lines.append(f"| {what} | {fork_result['rows'] if tokens_per_s else '—'} | "
                     f"{cell(fork_result['continuation_tokens'] if tokens_per_s else None)} | "
                     f"{seconds:.2f} | {cell(tokens_per_s, ',.0f')} |")
    if fork_result:
        def ratio(key):  # the median of the pairs, and their min-max where the report has it
            spread = fork_result.get(key + "_spread")
            return cell(fork_result[key], ".2f") + (
                f" (min-max {spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
        lines += ["", f"fork-gather / fork-batch (copy) {ratio('gather_vs_copy')}; fork-batch / "
                      f"decode-only {ratio('overhead_vs_decode_only')}, medians of pairs timed "
                      f"back to back; train.py forks here by {fork_result['default_method']}."]
    return lines + [""]


def iteration_table(report: dict) -> list[str]:
    from engineering.parallel import PHASES
    runs = {algo: report["parts"].get(f"iteration_{algo}", {}) for algo in ALGOS}
    train = report["settings"]["train"]
    kinds = {run.get("peak_memory_kind") for run in runs.values()} - {None}
    lines = ["## Memory and seconds per phase of a train.py iteration", "",
             f"{train['prompts']} prompts x {train['samples']} samples, "
             f"minibatch {train['minibatch']}, micro-batch {train['micro_batch']}, "
             f"gradient checkpointing, --max-new-tokens {train['max_new_tokens']}, bf16; "
             "two iterations: the peak over both (AdamW's moments exist while sampling from the "
             "second on), the phases of the second. Peak memory: "
             f"{', '.join(sorted(kinds)) or '—'}; model state: arithmetic (16 bytes a trained "
             "parameter, the reference's bf16 Linears).", "",
             "| --algo | peak memory | model state | " + " | ".join(p[5:] for p in PHASES)
             + " | seconds | episodes | mc_states | mc_tokens |",
             "| --- " * (len(PHASES) + 7) + "|"]
    for algo, run in runs.items():
        failed = failure(run)  # a failed part shows no measured figure (its JSON keeps what it had)
        time_, metrics = ({}, {}) if failed else (run.get("time", {}), run.get("metrics", {}))
        peak = failed or size(run.get("peak_memory_bytes"))
        memory = f"{peak} | {size(run.get('model_state_bytes_arithmetic'))}"
        seconds = " | ".join(cell(time_.get(p), ".2f") for p in PHASES + ("seconds",))
        counts = " | ".join(cell(metrics.get(k)) for k in ("episodes", "mc_states", "mc_tokens"))
        lines.append(f"| {algo} | {memory} | {seconds} | {counts} |")
    return lines + [""]


def failure(part: dict) -> str | None:
    """A table's word for a part that did not finish ("failed: out of time"), else None."""
    if part.get("status") in (None, "ok"):
        return None
    error = part.get("error") or ""
    if part["status"] == "failed":
        late = error.startswith("OutOfTime")
        return "failed: " + ("out of time" if late else error.split(":")[0])
    return part["status"]


def estimate_table(estimate: dict) -> list[str]:
    if not estimate.get("hours"):
        return ["## Estimate: 650 GSM8K iterations", "",
                f"not made: {cell(estimate.get('error'))}", ""]
    tokens, rates = estimate["tokens_per_iteration"], estimate["tokens_per_s"]
    lines = ["## Estimate: hours of the paper's 650 GSM8K iterations "
             "(arithmetic on the rates above)", "",
             f"{tokens['response']:,} response and {tokens['mc']:,} MC tokens an iteration "
             f"(counted on GSM8K's solutions, bench.py --count-mc-tokens) at plain "
             f"{cell(rates['plain_one_gpu'], ',.0f')} tokens/s (one GPU's batch) or "
             f"{cell(rates['plain_eight_gpus'], ',.0f')} (a GPU's share of 8) and MC "
             f"{cell(rates['fork'], ',.0f')}, plus the other phases measured above "
             f"(x 8 on one GPU); communication between GPUs not counted. The second figure: "
             f"generation x {tokens['straggler']}, a generate call running until its longest row "
             "stops." + (f" Missing rates: {', '.join(estimate['missing'])}."
                         if estimate["missing"] else ""), "",
             "| --algo | 1 GPU, hours | 8 GPUs, hours | 8 GPUs: the iteration above x 650 |",
             "| --- " * 4 + "|"]
    span = lambda low, high: "—" if low is None else f"{low:.1f}-{high:.1f}"
    lines += [f"| {algo} | {span(h['one_gpu'], h['one_gpu_stragglers'])} | "
              f"{span(h['eight_gpus'], h['eight_gpus_stragglers'])} | "
              f"{h['eight_gpus_as_measured']:.1f} |"
              for algo, h in estimate["hours"].items()]
    return lines + [""]


# ---- the tokens an iteration generates (--count-mc-tokens) ---------------------------------------

def mc_token_count(tok, problems: list[dict], prompts: int = 64, samples: int = 8, k: int = 9,
                   max_states: int = 26, max_new_tokens: int = 1024,
                   max_batch_tokens: int = 524288) -> dict:
    """Tokens one iteration generates at these settings if the policy's responses were the gold
    solutions (the SFT targets it imitates): prompts x samples responses of the mean length; MC, k
    continuations of each state (the prompt once per prompt, the later states of different responses
    distinct), each as long as the rest of the response it continues. A generate call decodes until
    its longest row stops: `straggler` is the longest of a call's rows (as many as max_batch_tokens
    holds at the full token budget) over the mean, drawn from these lengths: how much more decoding
    than tokens there is, at most."""
    lengths, rests, steps, prompt_lengths = [], [], [], []
    for p in problems:
        ids, n_prompt = sft_example(tok, reward.PROMPT.format(question=p["question"].strip()),
                                    p["answer"])
        response = ids[n_prompt:]
        starts = vine.response_step_starts(tok, response)
        lengths.append(len(response))
        prompt_lengths.append(n_prompt)
        steps.append(len(starts))
        rests.append(sum(len(response) - b for b in starts[1:max_states or None]))
    mean, rng = statistics.mean, random.Random(0)
    rows = max(1, max_batch_tokens // round(mean(prompt_lengths) + max_new_tokens))
    longest = mean(max(rng.choices(lengths, k=rows)) for _ in range(200))
    return {"problems": len(problems), "response_tokens": mean(lengths), "steps": mean(steps),
            "response_tokens_per_iteration": prompts * samples * mean(lengths),
            "mc_tokens_per_iteration": k * (prompts * mean(lengths)
                                            + prompts * samples * mean(rests)),
            "rows_per_generate_call": rows, "straggler": longest / mean(lengths)}


def count_mc_tokens(data: str, tokenizer: str) -> dict:
    from transformers import AutoTokenizer
    problems = tasks.read_jsonl(data)
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:  # hub, network and format errors: one line
        raise DataError(f"--tokenizer {tokenizer!r}: cannot load it ({first_line(e)})") from None
    return mc_token_count(tok, problems)


if __name__ == "__main__":
    main()
