"""Tests of the bf16 path (autocast over fp32 weights), run on a CPU through CPU autocast: the
value head in fp32, the supervised last state of the BCE heads, a reference that computes as
the policy does, chunked log-probs, fork buffers in one dtype and their gather variant."""
import copy
import gc
import json
import math
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import batching
import bench
import fork
import ppo
import rollout
import value
from engineering import models
from test_vine import SMALL  # the tiny settings of test_vine's smoke runs

HERE = os.path.dirname(os.path.abspath(__file__))
CPU = torch.device("cpu")


def bf16():
    return models.autocast(CPU, "bf16")


def llama(tied=False, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return llama()


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]


# ---- A. the precision setting -------------------------------------------------------------

def test_autocast_context_and_defaults():
    with models.autocast(CPU, "bf16"):
        assert (torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    with models.autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    assert models.default_precision(torch.device("cuda")) == "bf16"
    assert models.default_precision(CPU) == "fp32"
    with pytest.raises(AssertionError):
        models.autocast(CPU, "fp16")


def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_of(monkeypatch, capsys):
    """The warning comes exactly when bf16 is asked on a CPU that lacks the instructions."""
    for has, precision, device, warned in [(False, "bf16", CPU, True), (True, "bf16", CPU, False),
                                           (False, "fp32", CPU, False),
                                           (False, "bf16", torch.device("cuda"), False)]:
        monkeypatch.setattr(models, "cpu_has_bf16", lambda: has)
        models.warn_if_bf16_is_emulated(device, precision)
        assert ("--precision bf16: this CPU has neither" in capsys.readouterr().out) == warned


def test_the_bf16_check_agrees_with_the_cpus_own_flags():
    """On Linux, torch's answer agrees with /proc/cpuinfo: yes with AVX512-BF16 or AMX, no
    without AVX-512."""
    if not os.path.exists("/proc/cpuinfo") or platform.machine() != "x86_64":
        pytest.skip("reads the x86 flags of Linux's /proc/cpuinfo")
    flags = set(open("/proc/cpuinfo").read().split())
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert models.cpu_has_bf16()
    if not flags & {"avx512bw", "amx_bf16"}:
        assert not models.cpu_has_bf16()


# ---- B. the value head in fp32 --------------------------------------------------------------

@pytest.mark.parametrize("head", value.HEADS)
def test_critic_head_runs_in_fp32_under_autocast(model, head):
    critic = value.Critic(copy.deepcopy(model.base_model), head)
    # the tracking head starts at zero: make it non-trivial
    torch.nn.init.normal_(critic.head.weight)
    ids = torch.tensor(random_seqs([12, 12]))
    mask, prompt_lens = torch.ones_like(ids), torch.tensor([4, 6])
    with torch.no_grad(), bf16():
        out = critic(ids, mask, prompt_lens)
        values = critic.values(ids, mask, prompt_lens)
        hidden = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    if head == "scalar":
        # sliced before the head, as the critic does: the same kernels, bit for bit
        hidden = hidden[:, :-1]
    # fp32, no autocast
    expected = F.linear(hidden.float(), critic.head.weight, critic.head.bias).squeeze(-1)
    if head == "tracking":
        expected = value.tracking_logits(expected, prompt_lens)
    if head == "scalar":  # [B, L] like the other heads: 0 in column L-1, where no action follows
        expected = F.pad(expected, (0, 1))
    assert out.shape == ids.shape
    assert out.dtype == values.dtype == torch.float32 and torch.equal(out, expected)
    # what train.py's GAE does with them: fp32 rewards into a zeros_like(values)
    # (bf16 values raised)
    rewards = torch.tensor([1.0, 0.0])
    torch.zeros_like(values).index_put_((torch.arange(2), torch.tensor([10, 10])), rewards)


# ---- C. the BCE heads supervise the whole response too ---------------------------------------

def test_response_states_add_the_state_after_the_last_action():
    act = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert value.response_states(act).tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]


@pytest.mark.parametrize("head", ["tracking", "bce"])
def test_bce_gradient_reaches_the_head_output_at_the_last_response_token(model, head):
    """Zero head: z = 0 at every state, so dBCE/dz_t = (sigmoid(0) - y) / N = -+1/16 at each of the
    N = (4 + 1) + (2 + 1) = 8 states. A tracking increment h_i collects the states t >= i."""
    critic = value.Critic(copy.deepcopy(model.base_model), head)
    torch.nn.init.zeros_(critic.head.weight)
    outputs = []  # the head's output [B, L, 1], kept with its gradient
    critic.head.register_forward_hook(
        lambda module, inputs, out: outputs.append(out) or out.retain_grad())
    seqs = random_seqs([3 + 4, 2 + 2])  # prompt + response: 3 + 4 and 2 + 2 tokens
    ids, mask = rollout.pad_right(seqs, 0)
    prompt_lens, rewards = torch.tensor([3, 2]), torch.tensor([1.0, 0.0])
    act = torch.zeros(2, 6)
    act[0, 2:6], act[1, 1:3] = 1, 1  # actions: columns P-1 .. P+T-2
    loss, _ = critic.loss(critic(ids, mask, prompt_lens), None, None, rewards, act)
    loss.backward()
    grad = outputs[0].grad.squeeze(-1) * 16
    if head == "tracking":  # b at P-1 takes every state; the last token (columns 6 and 3) only s_T
        expected = [[0, 0, -5, -4, -3, -2, -1], [0, 3, 2, 1, 0, 0, 0]]
    else:  # each state's own output; the whole response's state is at the last token
        expected = [[0, 0, -1, -1, -1, -1, -1], [0, 1, 1, 1, 0, 0, 0]]
    assert grad.tolist() == expected


# ---- D. the reference computes as the policy does -------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_reference_logprobs_equal_the_policy_under_autocast(tied):
    policy = llama(tied)
    ref = models.cast_linear_weights(copy.deepcopy(policy), "bf16")
    seqs = random_seqs([200, 150], seed=4)  # long: RoPE's angles at late positions matter
    ids, mask = rollout.pad_right(seqs, 0)
    with torch.no_grad(), bf16():
        logp, _ = rollout.token_logprobs(policy, ids, mask, 0.6)
        ref_logp, _ = rollout.token_logprobs(ref, ids, mask, 0.6)
        whole_bf16, _ = rollout.token_logprobs(copy.deepcopy(policy).to(torch.bfloat16),
                                               ids, mask, 0.6)
    assert torch.equal(logp, ref_logp) and ppo.k3_kl(logp, ref_logp).abs().max().item() == 0.0
    assert ppo.k3_kl(logp, whole_bf16).max().item() > 0  # casting everything (the old way) does not
    assert (ref.model.rotary_emb.inv_freq.dtype == ref.model.embed_tokens.weight.dtype
            == torch.float32)
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert ref.lm_head.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    policy_bytes, ref_bytes = (sum(p.nbytes for p in m.parameters()) for m in (policy, ref))
    assert ref_bytes < 0.6 * policy_bytes if not tied else ref_bytes < 0.75 * policy_bytes


def test_fp32_leaves_the_reference_alone(model):
    ref = models.cast_linear_weights(copy.deepcopy(model), "fp32")
    assert all(p.dtype == torch.float32 for p in ref.parameters())


# ---- E. log-probs a few positions at a time -------------------------------------------------

def test_chosen_logprobs_hand_example():
    # temperature 1.5: softmax of [0, 2] and [2/3, 2/3]
    logits = torch.tensor([[[0.0, 3.0], [1.0, 1.0]]])
    logp = rollout.chosen_logprobs(logits, torch.tensor([[1, 0]]), 1.5, chunk_tokens=1)
    assert logp[0].tolist() == pytest.approx([-math.log(1 + math.exp(-2)), math.log(0.5)], abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 1024])
def test_chosen_logprobs_equal_the_whole_formula(dtype, chunk_tokens):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 37, 50, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 50, (3, 37), generator=g)
    whole = (logits.float() / 0.6).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    chunked = rollout.chosen_logprobs(logits, targets, 0.6, chunk_tokens)
    assert chunked.dtype == torch.float32 and torch.allclose(chunked, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chosen_logprobs_transient_memory(dtype):
    """The whole formula holds two vocabulary-sized fp32 copies at once beside the logits; chunks
    of 128 positions out of 1024 hold a small fraction of that."""
    logits, targets = torch.randn(2, 512, 1000).to(dtype), torch.randint(0, 1000, (2, 512))

    def extra_peak(fn):
        gc.collect()
        with bench.LiveTensorBytes() as counter:
            fn()
        return counter.peak - logits.nbytes

    whole = extra_peak(
        lambda: (logits.float() / 0.6).log_softmax(-1).gather(-1, targets[..., None]))
    chunked = extra_peak(lambda: rollout.chosen_logprobs(logits, targets, 0.6, chunk_tokens=128))
    assert whole >= 2 * 4 * logits.numel() and chunked < whole / 4


# ---- F. fork buffers in one dtype; one batch of them alive at a time ------------------------

def test_fork_buffers_take_the_autocast_dtype(model):
    seqs = random_seqs([30, 17])
    ids, mask = rollout.pad_right(seqs, 0)
    for context, dtype in [(bf16, torch.bfloat16),
                           (lambda: models.autocast(CPU, "fp32"), torch.float32)]:
        with torch.no_grad(), context():
            _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
            _, _, forked = fork.fork(cache, [seqs[0][:9], seqs[1][:17]], [0, 1], 2, 5,
                                           pad_id=0)
        assert {x.dtype for layer in forked.layers for x in (layer.keys, layer.values)} == {dtype}
    # the source cache: what the fork converts from
    assert cache.layers[0].keys.dtype == torch.float32


def test_forked_logprobs_under_autocast_match_the_full_forward(model):
    """The test_vine check (a fork's log-probs over three steps equal the full pass's) under bf16
    autocast with bf16 buffers: equal to bf16 rounding, and the same greedy token."""
    seqs = random_seqs([20, 9, 14], seed=2)
    ids, mask = rollout.pad_right(seqs, 0)
    rows, ends = [0, 2, 1, 0], [7, 11, 6, 16]
    with torch.no_grad(), bf16():
        full, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        prefixes = [seqs[r][:e] for r, e in zip(rows, ends)]
        fork_ids, attn, forked = fork.fork(cache, prefixes, rows, 1, 3, pad_id=0)
        for step in range(3):  # feed the true next tokens one at a time
            last = torch.tensor([seqs[r][e - 1 + step] for r, e in zip(rows, ends)])[:, None]
            positions = torch.tensor(ends)[:, None] - 1 + step
            out = model(input_ids=last, attention_mask=attn, cache=forked, position_ids=positions)
            out = out.logits[:, -1]
            logp = out.float().log_softmax(-1)
            for i, (r, e) in enumerate(zip(rows, ends)):
                expected = full[r, e - 1 + step].item()
                assert logp[i, seqs[r][e + step]].item() == pytest.approx(expected, abs=0.05)
                assert out[i].argmax() == logits[r, e - 1 + step].argmax()
            attn = torch.cat([attn, torch.ones(4, 1, dtype=attn.dtype)], 1)


def test_forked_greedy_under_autocast_matches_reencoding(model):
    seqs = random_seqs([30, 17, 25])
    ids, mask = rollout.pad_right(seqs, 0)
    prefixes, rows = [seqs[0][:12], seqs[1][:5], seqs[2][:25]], [0, 1, 2]
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=12, eos_id=2, pad_id=0)
    with torch.no_grad(), bf16():
        _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
        forked, _ = fork.continue_from_cache(model, prefixes, 2, [12] * 3, greedy,
                                                   cache=cache, rows=rows)
        for prefix, forks in zip(prefixes, forked):
            # HF's own cache
            alone = model.generate(torch.tensor([prefix]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=2, pad_token_id=0)[0, len(prefix):].tolist()
            alone = alone[: alone.index(2) + 1] if 2 in alone else alone
            assert forks == [alone, alone] and len(set(alone)) > 1


def sampling_peak(model, cache, n_prefixes, max_batch_tokens):
    """Peak bytes of sampling 4 x 60 tokens from each of n_prefixes 18-token prefixes of
    cache's 4 rows."""
    seqs, rows = random_seqs([20] * 4), [i % 4 for i in range(n_prefixes)]
    prefixes = [seqs[r][:18] for r in rows]
    gc.collect()
    # EOS out of the vocabulary: every row runs its full budget
    with bench.LiveTensorBytes() as counter:
        sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=60, eos_id=40,
                                    pad_id=0, max_batch_tokens=max_batch_tokens)
        fork.continue_from_cache(model, prefixes, 4, [60] * n_prefixes, sampling, cache=cache,
                                       rows=rows)
    return counter.peak


@pytest.mark.slow
def test_two_batches_of_forks_peak_like_one(model):
    """4 prefixes x k=4 x (18 + 60) tokens fill one batch; 8 prefixes make two such batches, whose
    fork buffers (most of the memory here) must not be alive at once."""
    ids, mask = rollout.pad_right(random_seqs([20] * 4), 0)
    with torch.no_grad():
        _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
    one = sampling_peak(model, cache, 4, 4 * 4 * 78)
    two = sampling_peak(model, cache, 8, 4 * 4 * 78)
    # layers, (k, v), rows, kv heads, columns, head dim, fp32
    buffers = 2 * 2 * 16 * 2 * (17 + 60) * 16 * 4
    assert one > buffers and two < one + buffers / 4


def test_batches_of_one_call_fork_into_one_buffer_each(model, monkeypatch):
    """Three batches of forks (prefixes 10 and 13 left-padded to 13, 19 and 22 to 22, 26 alone; 22
    with a budget of 2, the others 6) write into one flat tensor per layer's keys and values, made
    once for the largest batch (22 - 1 + 6 columns: the longest prefix and the largest budget);
    poisoned with NaN before each fork, they sample what fresh buffers do (T = 1, same seed): no
    column is read that this batch did not write, its padding included."""
    seqs = random_seqs([30, 24, 26])
    ids, mask = rollout.pad_right(seqs, 0)
    rows, ends = [1, 2, 0, 1, 0], [10, 13, 19, 22, 26]
    prefixes = [seqs[r][:e] for r, e in zip(rows, ends)]
    with torch.no_grad():
        cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)[1]
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=6, eos_id=40, pad_id=0,
                                # two prefixes x k = 3 rows, at most 31 columns
                                max_batch_tokens=6 * 31)
    monkeypatch.setattr(batching, "batch_overhead", lambda _: 10 ** 6)  # the fewest batches: three

    def draw(reused_buffers):
        monkeypatch.setattr(fork, "reused_buffers", reused_buffers)
        torch.manual_seed(0)
        return fork.continue_from_cache(model, prefixes, 3, [6, 6, 6, 2, 6], sampling,
                                              cache=cache, rows=rows)

    made, storage, reuse = [], set(), fork.reused_buffers

    def poisoned(positions):
        assert positions == 6 * (22 - 1 + 6)  # the largest batch: 6 rows x (prefix - 1 + budget)
        allocate = reuse(positions)

        def traced(slot, shape, dtype, device):
            buf = allocate(slot, shape, dtype, device).fill_(float("nan"))
            made.append(shape[0] * shape[2]), storage.add((slot, buf.untyped_storage().data_ptr()))
            return buf
        return traced

    fresh, poison = draw(lambda positions: None), draw(poisoned)
    assert poison == fresh and len({tuple(c) for cs in fresh[0] for c in cs}) > 10  # of 15 draws
    # three batches
    assert len(made) == 3 * 2 * model.config.num_hidden_layers and len(set(made)) == 3
    # one storage per slot, whatever the batch
    assert len(storage) == 2 * model.config.num_hidden_layers


# ---- G. the gather fork equals the copying one ----------------------------------------------

@pytest.mark.parametrize("autocast", [False, True])
def test_gather_fork_equals_copy_fork(model, autocast, monkeypatch):
    seqs = random_seqs([20, 9, 14], seed=2)
    ids, mask = rollout.pad_right(seqs, 0)
    rows, ends = [0, 2, 1, 0, 1], [7, 11, 6, 16, 9]
    prefixes = [seqs[r][:e] for r, e in zip(rows, ends)]
    with torch.no_grad(), (bf16() if autocast else models.autocast(CPU, "fp32")):
        _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
        copied = fork.fork(cache, prefixes, rows, 3, 4, pad_id=0, method="copy")
        gathered = fork.fork(cache, prefixes, rows, 3, 4, pad_id=0, method="gather")
        greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=6, eos_id=2, pad_id=0)
        samples, gathers = [], []
        gather = fork.gather_columns
        monkeypatch.setattr(fork, "gather_columns",
                            lambda *args: gathers.append(1) or gather(*args))
        for method in fork.FORK_METHODS:  # bench's way to pick the method
            with bench.forking_by(method):
                samples.append(fork.continue_from_cache(model, prefixes, 2, [6] * 5, greedy,
                                                              cache=cache, rows=rows))
            assert bool(gathers) == (method == "gather")  # the method asked for ran
    assert samples[0] == samples[1]
    assert torch.equal(copied[0], gathered[0]) and torch.equal(copied[1], gathered[1])
    # the W-1 cached columns (decoding fills the rest)
    for a, b in zip(copied[2].layers, gathered[2].layers):
        assert a.keys.shape == b.keys.shape == (15, 2, 15, 16)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.key_buffer.shape == b.key_buffer.shape and a.keys.dtype == b.keys.dtype


# ---- the whole run in bf16 --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("algo, extra", [("vineppo", []), ("ppo", []), ("tppo", []), ("grpo", []),
                                         ("ppo", ["--value-head", "bce"])],
                         ids=["vineppo", "ppo", "tppo", "grpo", "ppo-bce"])
def test_each_algo_runs_in_bf16_on_cpu(tmp_path, algo, extra):
    args = ["--precision", "bf16", "--algo", algo, "--out", str(tmp_path), *SMALL, *extra]
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args], cwd=HERE,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["nonfinite_skips"] == 0 and "policy_loss" in row and row["kl"] >= 0
        assert ("value_loss" in row) == (algo in ("ppo", "tppo"))
        assert (row["mc_states"] > 0) == (algo == "vineppo")
    # the run's settings
    assert json.loads((tmp_path / "config.json").read_text())["precision"] == "bf16"


# ---- the GPU report (bench.py --gpu-report), rehearsed on a CPU --------------------------------

@pytest.mark.slow
def test_gpu_report_smoke_fills_every_field(tmp_path, capsys, monkeypatch):
    """The GPU report's code at a tiny shape on this CPU (< 1 minute on a quiet one): every part
    ran, every field holds what it says, memory by the CPU counter, labelled as such. The budgets
    are widened tenfold: a busy machine must not fail the code for its speed
    (test_a_part_over_its_budget_fails_and_the_report_goes_on checks them)."""
    smoke = bench.MODES["smoke"]
    monkeypatch.setitem(bench.MODES, "smoke",
                        {**smoke, "budget_s": 10 * smoke["budget_s"],
                         "budgets": {k: 10 * v for k, v in smoke["budgets"].items()}})
    bench.main(["--gpu-report", str(tmp_path), "--smoke"])
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    mode, parts = bench.MODES["smoke"], report["parts"]
    assert (report["mode"] == "smoke"
            and report["device"] == ("cuda" if torch.cuda.is_available() else "cpu"))
    assert 0 < report["seconds"] <= report["budget_s"] == mode["budget_s"]
    iterations = [f"iteration_{algo}" for algo in bench.ALGOS]
    assert list(parts) == ["environment", "model_files", "generation"] + iterations + ["estimate"]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["error"] is None, (name, part["error"])
        assert (0 <= part["seconds"] <= part["budget_s"] + 1
                and part["budget_s"] <= mode["budgets"][name])
    env = parts["environment"]
    import platform
    import transformers
    assert (env["torch"] == torch.__version__ and env["cpu_count"] >= 1
            and env["torch_threads"] >= 1)
    assert (env["transformers"] == transformers.__version__
            and env["python"] == platform.python_version())
    assert (env["cuda"] == torch.version.cuda
            and (env["bf16_supported"] is None) == (not torch.cuda.is_available()))
    assert report["command"] == f"python bench.py --gpu-report {tmp_path} --smoke"
    assert report["shape"] == mode["shape"]
    train = report["settings"]["train"]
    assert (2 <= train["max_new_tokens"] <= mode["train"]["max_new_tokens"]
            and train["predicted_generation_s"] > 0)
    assert ((env["gpu_name"] is None) == (env["gpu_memory_bytes"] is None)
            == (not torch.cuda.is_available()))
    # 2 layers of 64 wide (16-wide heads, 2 KV heads: 32-wide k, v), 128 intermediate,
    # 2048 untied vocabulary
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert parts["model_files"]["params"] == 2 * layer + 2 * 2048 * 64 + 64
    assert parts["model_files"]["vocab"] == mode["shape"]["vocab"]
    assert parts["model_files"]["mean_prompt_tokens"] > 10
    check_generation(parts["generation"], mode)
    for algo in bench.ALGOS:
        check_iteration(parts[f"iteration_{algo}"], algo, report["settings"]["train"])
    hours = parts["estimate"]["hours"]
    assert (set(hours) == set(bench.ALGOS)
            and parts["estimate"]["tokens_per_iteration"] == bench.GSM8K_TOKENS)
    assert (parts["estimate"]["missing"] == []
            and all(v > 0 for v in parts["estimate"]["tokens_per_s"].values()))
    assert parts["estimate"]["iterations"] == 650 and "arithmetic" in parts["estimate"]["label"]
    for h in hours.values():
        assert (0 < h["eight_gpus"] < h["one_gpu"] < h["one_gpu_stragglers"]
                and h["eight_gpus_as_measured"] > 0)
        assert h["eight_gpus"] < h["eight_gpus_stragglers"] < h["one_gpu_stragglers"]
    assert hours["vineppo"]["one_gpu"] > hours["grpo"]["one_gpu"]  # the MC tokens
    table = (tmp_path / "gpu-report.md").read_text()
    assert table.strip() == bench.markdown(report).strip()
    assert "smoke run" in table and "LiveTensorBytes" in table
    for heading in ("## Generation", "## Memory and seconds", "## Estimate", "## What ran",
                    "## Parts"):
        assert heading in table
    assert table in capsys.readouterr().out


def check_generation(generation: dict, mode: dict):
    train, plain, fork = mode["train"], mode["plain"], mode["fork"]
    rows = train["prompts"] * train["samples"]  # a GPU's share of eight, one GPU's batch (twice)
    assert [p["rows"] for p in generation["plain"]] == [rows, 8 * rows, 8 * rows]
    assert [p["precision"] for p in generation["plain"]] == ["autocast", "autocast", "bf16 weights"]
    for p in generation["plain"]:
        assert p["tokens"] == p["rows"] * plain["new_tokens"] and p["seconds"] > 0
        assert math.isclose(p["tokens_per_s"], p["tokens"] / p["seconds"])
    forks = generation["fork"]
    assert forks["rows"] == fork["trajectories"] * fork["states"] * fork["k"]
    assert forks["continuation_tokens"] == forks["rows"] * fork["new_tokens"]
    assert set(forks["median_s"]) == {"fork-batch", "fork-gather", "decode-only", "forward"}
    assert set(forks["tokens_per_s"]) == {"fork-batch", "fork-gather", "decode-only"}
    assert all(v > 0 for v in forks["tokens_per_s"].values()) and forks["gather_vs_copy"] > 0
    assert forks["default_method"] == ("fork-gather" if torch.cuda.is_available() else "fork-batch")
    assert generation["attention_implementation"] in ("sdpa", "eager", "flash_attention_2")
    assert "autocast over fp32 weights" in generation["precision"]


def check_iteration(run: dict, algo: str, train: dict):
    from engineering.parallel import PHASES
    critic = algo in ("ppo", "tppo")
    assert run["model_state_bytes_arithmetic"] == bench.model_state_bytes(
        bench.MODES["smoke"]["shape"], critic)
    # the whole run's peak holds at least the model state: weights, gradients, AdamW moments,
    # the reference
    assert run["peak_memory_bytes"] >= run["model_state_bytes_arithmetic"]
    assert ("LiveTensorBytes" in run["peak_memory_kind"]) == (not torch.cuda.is_available())
    assert f"--algo {algo}" in run["argv"] and "MODEL" in run["argv"]
    assert (set(run["time"]) == set(PHASES) | {"seconds"}
            and all(v >= 0 for v in run["time"].values()))
    assert sum(run["time"][p] for p in PHASES) <= run["time"]["seconds"] + 0.01
    assert ((run["time"]["time_mc_values"] > 0) == (algo == "vineppo")
            == (run["metrics"]["mc_tokens"] > 0))
    assert (run["time"]["time_critic_values"] > 0) == critic
    assert run["metrics"]["episodes"] == train["prompts"] * train["samples"]
    assert 0 < run["metrics"]["response_tokens"] <= train["max_new_tokens"]


def test_model_state_arithmetic_at_rho_shape():
    """The docs' model-state figures: 19.9 GB for VinePPO (policy 17.6 GB, reference 2.33 GB); PPO's
    critic is the backbone without the LM head, 16.55 GB more."""
    vine, ppo_ = bench.model_state_bytes(bench.RHO, False), bench.model_state_bytes(bench.RHO, True)
    assert round(vine / 1e9, 2) == 19.93 and round(ppo_ / 1e9, 2) == 36.48
    params = (22 * (2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048)
              + 2 * 32000 * 2048 + 2048)
    assert (16 * params + 2 * (params - 32000 * 2048 - 45 * 2048)
            + 4 * (32000 * 2048 + 45 * 2048) == vine)


def test_a_part_over_its_budget_fails_and_the_report_goes_on(tmp_path):
    import time as clock
    ctx = bench.argparse.Namespace(out=str(tmp_path), device="cpu",
                                   report={"parts": {}, "settings": {}},
                                   mode={"budgets": {"slow": 1, "next": 5}},
                                   deadline=clock.perf_counter() + 60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "markdown", lambda report: "table")
        bench.run_part(ctx, "slow", lambda ctx, result: (result.update(done=1), clock.sleep(5)))
        bench.run_part(ctx, "next", lambda ctx, result: result.update(value=2))
    slow, after = ctx.report["parts"]["slow"], ctx.report["parts"]["next"]
    assert slow["status"] == "failed" and slow["error"] == "OutOfTime: over its budget of 1 s"
    assert slow["done"] == 1  # what it did before the alarm stays
    assert 1 <= slow["seconds"] < 3 and after["status"] == "ok" and after["value"] == 2
    assert json.loads((tmp_path / "gpu-report.json").read_text())["parts"]["next"]["value"] == 2


def test_mc_token_count_hand_case(tmp_path):
    """One problem, response '\\na\\nb\\n#### 1\\n' + EOS (13 char tokens), steps at tokens 0, 3
    and 5: per iteration 2 responses of 13; MC 3 x (13 from the prompt, once, + 2 x (10 + 8)
    from steps 1 and 2)."""
    from transformers import AutoTokenizer
    models.build_tiny_model(str(tmp_path), seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    problems = [{"question": "Q?", "answer": "a\nb\n#### 1"}]
    counted = bench.mc_token_count(tok, problems, prompts=1, samples=2, k=3)
    assert counted["response_tokens"] == 13 and counted["steps"] == 3
    assert (counted["response_tokens_per_iteration"] == 26
            and counted["mc_tokens_per_iteration"] == 147)
    assert counted["straggler"] == 1.0
    # BOS + the prompt's 34 characters
    assert counted["rows_per_generate_call"] == 524288 // (35 + 1024)
    # and '\n#### 1\n' + EOS, 9 tokens, one step: means 11 tokens and 9 after the first step; the
    # longest of 495 rows drawn from both is (surely) 13
    problems.append({"question": "Q?", "answer": "#### 1"})
    both = bench.mc_token_count(tok, problems, prompts=1, samples=2, k=3)
    assert both["mc_tokens_per_iteration"] == 3 * (11 + 2 * 9) and both["straggler"] == 13 / 11
    capped = bench.mc_token_count(tok, problems[:1], prompts=1, samples=2, k=3, max_states=1)
    assert capped["mc_tokens_per_iteration"] == 3 * 13  # the prompt's state only


def test_response_budget_fits_the_vineppo_part():
    """L = 16 predicts 4 x 16 / 16 + 3 x (2 + 4 x 4) x 8 / 120 = 7.6 s (rollout, then K = 3
    continuations of the prompt and 4 lines a response, half of L each) > 20 / 4;
    L = 8: 2 + 3 x (2 + 4 x 2) x 4 / 120 = 3 s."""
    mode = {"train": dict(prompts=2, samples=2, max_new_tokens=16, newline_every=4),
            "fork": dict(k=3), "budgets": {"iteration_vineppo": 20}}
    fork = dict(default_method="fork-batch", tokens_per_s={"fork-batch": 120.0})
    plain = [dict(rows=4, precision="autocast", tokens_per_s=16.0)]
    report = {"parts": {"generation": {"plain": plain, "fork": fork}}}
    chosen = bench.choose_new_tokens(bench.argparse.Namespace(mode=mode, report=report))
    assert chosen == {"max_new_tokens": 8, "predicted_generation_s": 3.0}
    report["parts"]["generation"] = {}  # no rates: the preset's budget
    assert bench.choose_new_tokens(
        bench.argparse.Namespace(mode=mode, report=report))["max_new_tokens"] == 16


# ---- bench.py's options: one line and exit 2 -------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["--k", "0"], "--k 0: expected >= 1"),
    (["--heads", "3"], "--heads 3"),
    (["--repeats", "0"], "--repeats 0: expected >= 1"),
    (["--threads", "-1"], "--threads -1: expected >= 0"),
    (["--states", "0"], "--states 0: expected >= 1"),
    (["--states", "600"], "expected fewer than --traj-len 600"),
    (["--vocab", "3"], "--vocab 3: expected >= 4"),
    (["--memory-model", "/nonexistent"], "--memory-model '/nonexistent': no such directory"),
    (["--device", "tpu"], "expected 'cpu', 'cuda' or 'cuda:N'"),
    (["--smoke"], "--smoke: only with --gpu-report OUT"),
    (["--gpu-report", "OUT", "--smoke", "--k", "3"], "--gpu-report takes only"),
    (["--train-args", "--lr x"], "argument --lr: invalid float value"),
])
def test_bench_bad_options_end_in_one_line(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(args)
    err = capsys.readouterr().err
    assert (exit_.value.code == 2 and err.startswith("error: ") and expected in err
            and err.count("\n") == 1)


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="a CUDA device is here: the command would run")


@NO_CUDA
@pytest.mark.parametrize("args, expected", [
    (["--device", "cuda"], "--device cuda: no CUDA device is available here"),
    (["--gpu-report", "OUT"],
     "--gpu-report at rho-math-1.1b's shape needs a GPU (--device cpu); --smoke"),
])
def test_bench_without_cuda_ends_in_one_line(args, expected, capsys):
    test_bench_bad_options_end_in_one_line(args, expected, capsys)


@pytest.mark.slow
@NO_CUDA
def test_the_gpu_command_is_refused_in_one_line_without_cuda(tmp_path):
    """The exact command the GPU will get (docs/gpu.md), rehearsed on a CPU-only torch."""
    command = [sys.executable, os.path.join(HERE, "bench.py"), "--gpu-report", "gpu-report",
               "--device", "cuda"]
    r = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (r.returncode == 2 and r.stderr.count("\n") == 1
            and not (tmp_path / "gpu-report").exists())
    assert r.stderr.startswith("error: --device cuda: no CUDA device is available here")
    assert "--smoke" in r.stderr  # and what to run instead


def test_the_gpu_reports_32k_tokenizer():
    """The GPU's tokenizer (the smoke run makes a 2,048 one): 32,000 entries, Llama's specials
    first, the fixture's text round-trips, and one filler in 25 ends in a newline (a step for a
    random model)."""
    problems = bench.tasks.read_jsonl(bench.FIXTURE)
    texts = [bench.reward.PROMPT.format(question=p["question"]) for p in problems]
    tok = bench.tokenizer_32k(texts, 32000, 25)
    vocab = tok.get_vocab()
    assert len(tok) == len(vocab) == 32000 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    fillers = [t for t in vocab if t.startswith("▁w") and t.rstrip("\n")[2:].isdigit()]
    assert (sum(t.endswith("\n") for t in fillers) == (len(fillers) + 24) // 25
            and len(fillers) > 25000)
    ids = tok(texts[0], add_special_tokens=False).input_ids
    assert tok.decode(ids) == texts[0] and len(ids) < len(texts[0]) / 3  # words, not characters


# ---- issue 36: a failed part shows no figure; the speed ratios from paired repeats ---------

def test_a_failed_iteration_shows_no_figure_in_the_report(tmp_path, monkeypatch):
    """Issue 36 item 13: ppo runs out of time and grpo fails after their peaks were recorded.

    The .md says so in their rows, with no measured figure; vineppo's row keeps its own.
    """
    from engineering.parallel import PHASES
    for name in ("environment", "model_files", "generation_speed"):
        monkeypatch.setattr(bench, name, lambda ctx, result: None)
    monkeypatch.setattr(bench, "choose_new_tokens", lambda ctx: {})

    def fake_iteration(ctx, result, algo):
        result.update(peak_memory_bytes=(3 + bench.ALGOS.index(algo)) * 2**20,
                      peak_memory_kind="CPU", model_state_bytes_arithmetic=2**20)
        if algo == "ppo":
            raise bench.math_grader.OutOfTime
        if algo == "grpo":
            raise RuntimeError("boom")
        result.update(time=dict.fromkeys(PHASES + ("seconds",), 1.5),
                      metrics=dict(episodes=4, mc_states=2, mc_tokens=8))

    import contextlib
    import io
    monkeypatch.setattr(bench, "iteration", fake_iteration)
    with contextlib.redirect_stdout(io.StringIO()):
        bench.main(["--gpu-report", str(tmp_path), "--smoke"])
    parts = json.loads((tmp_path / "gpu-report.json").read_text())["parts"]
    statuses = [parts[f"iteration_{a}"]["status"] for a in bench.ALGOS]
    assert statuses == ["ok", "failed", "failed", "ok"]
    table = (tmp_path / "gpu-report.md").read_text().split("## Memory")[1].split("## Estimate")[0]
    rows = {line.split(" | ")[0][2:]: line for line in table.split("\n")
            if line.startswith(tuple(f"| {a} |" for a in bench.ALGOS))}
    blank = " | ".join(["—"] * (len(PHASES) + 4))
    assert rows["ppo"] == f"| ppo | failed: out of time | 1.0 MiB | {blank} |"
    assert rows["grpo"] == f"| grpo | failed: RuntimeError | 1.0 MiB | {blank} |"
    assert rows["vineppo"].startswith("| vineppo | 3.0 MiB | 1.0 MiB | 1.50 |")
    assert rows["tppo"].startswith("| tppo | 6.0 MiB | 1.0 MiB | 1.50 |")


def test_speed_repeats_are_pairs_in_alternating_order():
    """Issue 36 item 18: each ratio's two side by side, the order reversed every other repeat."""
    everything = ["naive", "fork-each", "fork-batch", "fork-gather", "decode-only", "forward"]
    order = bench.repeat_order(everything)
    assert order == ["fork-each", "forward", "naive", "fork-batch", "decode-only", "fork-gather",
                     "fork-batch"]
    report = bench.repeat_order(["fork-batch", "fork-gather", "decode-only", "forward"])
    assert report == ["forward", "fork-gather", "fork-batch", "decode-only"]  # one fork-batch
    assert bench.repeat_order(["fork-each", "forward"]) == ["fork-each", "forward"]
    calls = []
    runs = bench.paired_runs(order, 3, lambda name, r: calls.append((r, name)) or float(len(calls)))
    backwards = [(1, n) for n in order[::-1]]
    assert calls == [(0, n) for n in order] + backwards + [(2, n) for n in order]
    assert runs[1] == [14.0, 13.0, 12.0, 11.0, 10.0, 9.0, 8.0]  # by position in order
    for r in range(3):  # x right before y (fork-batch, then decode-only); y first in repeat 1
        timed = [name for rr, name in calls if rr == r]
        for x, y in bench.RATIOS.values():
            assert ((x, y) if r % 2 == 0 else (y, x)) in zip(timed, timed[1:])


def test_speed_ratios_are_medians_of_pairs_with_their_spread():
    """Hand numbers: x / y of each repeat's pair; the median and the min-max of those."""
    order = ["forward", "decode-only", "fork-batch", "fork-gather"]
    runs = [[9.0, 2.0, 3.0, 6.0], [9.0, 1.0, 4.0, 2.0], [9.0, 4.0, 2.0, 3.0]]
    ratios = bench.paired_ratios(order, runs)
    assert ratios["overhead_vs_decode_only"] == (1.5, 0.5, 4.0)  # 3/2, 4/1, 2/4
    assert ratios["gather_vs_copy"] == (1.5, 0.5, 2.0)  # 6/3, 2/4, 3/2
    assert ratios["speedup_vs_naive"] is None  # naive did not run


def test_speed_json_line_carries_each_ratio_and_its_spread(monkeypatch, capsys):
    """bench.py --only speed at the smallest shape, a fake timer: the n-th method timed, n s."""
    clock = iter(range(1, 100))
    monkeypatch.setattr(bench, "timed", lambda fn, device, setup: float(next(clock)))
    bench.main(["--only", "speed", "--layers", "1", "--hidden", "8", "--heads", "2",
                "--kv-heads", "2", "--intermediate", "8", "--vocab", "8", "--trajectories", "1",
                "--traj-len", "4", "--states", "1", "--k", "1", "--new-tokens", "1",
                "--repeats", "3"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().split("\n")[-1])
    # order: fork-each forward naive fork-batch decode-only fork-gather fork-batch;
    # repeat 1 reversed
    assert result["speedup_vs_naive"] == 17 / 18  # naive / fork-batch: 3/4, 12/11, 17/18
    assert result["speedup_vs_naive_spread"] == [3 / 4, 12 / 11]
    assert result["overhead_vs_decode_only"] == 18 / 19  # 4/5, 11/10, 18/19
    assert result["overhead_vs_decode_only_spread"] == [4 / 5, 11 / 10]
    assert result["gather_vs_copy"] == 20 / 21  # 6/7, 9/8, 20/21
    assert result["gather_vs_copy_spread"] == [6 / 7, 9 / 8]
    assert result["median_s"]["fork-batch"] == (8 + 11) / 2  # of 4, 7, 11, 8, 18, 21
    assert "overhead_vs_decode_only: fork-batch / decode-only 0.95 (min-max 0.80-1.10" in out
