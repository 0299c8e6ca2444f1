"""Tests of the bf16 path (autocast over fp32 weights), run on a CPU through CPU autocast: the
value head in fp32, the supervised last state of the BCE heads, a reference that computes as
the policy does, chunked log-probs, fork buffers in one dtype and their gather variant."""
import copy
import gc
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import bench
from test_vine import SMALL  # the tiny settings of test_vine's smoke runs
import ppo
import precision
import rollout
import value

HERE = os.path.dirname(os.path.abspath(__file__))
CPU = torch.device("cpu")


def bf16():
    return precision.autocast(CPU, "bf16")


def llama(tied=False, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return llama()


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]


# ---- A. the precision setting -------------------------------------------------------------

def test_autocast_context_and_defaults():
    with precision.autocast(CPU, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with precision.autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    assert precision.default_precision(torch.device("cuda")) == "bf16"
    assert precision.default_precision(CPU) == "fp32"
    with pytest.raises(AssertionError):
        precision.autocast(CPU, "fp16")


# ---- D. the reference computes as the policy does -------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_reference_logprobs_equal_the_policy_under_autocast(tied):
    policy = llama(tied)
    ref = precision.cast_linear_weights(copy.deepcopy(policy), "bf16")
    seqs = random_seqs([200, 150], seed=4)  # long: RoPE's angles at late positions matter
    ids, mask = rollout.pad_right(seqs, 0)
    with torch.no_grad(), bf16():
        logp, _ = rollout.token_logprobs(policy, ids, mask, 0.6)
        ref_logp, _ = rollout.token_logprobs(ref, ids, mask, 0.6)
        whole_bf16, _ = rollout.token_logprobs(copy.deepcopy(policy).to(torch.bfloat16), ids, mask, 0.6)
    assert torch.equal(logp, ref_logp) and ppo.k3_kl(logp, ref_logp).abs().max().item() == 0.0
    assert ppo.k3_kl(logp, whole_bf16).max().item() > 0  # casting everything (the old way) does not
    assert ref.model.rotary_emb.inv_freq.dtype == ref.model.embed_tokens.weight.dtype == torch.float32
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert ref.lm_head.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    policy_bytes, ref_bytes = (sum(p.nbytes for p in m.parameters()) for m in (policy, ref))
    assert ref_bytes < 0.6 * policy_bytes if not tied else ref_bytes < 0.75 * policy_bytes


def test_fp32_leaves_the_reference_alone(model):
    ref = precision.cast_linear_weights(copy.deepcopy(model), "fp32")
    assert all(p.dtype == torch.float32 for p in ref.parameters())
