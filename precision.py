"""How the forward passes compute: --precision fp32, or bf16 autocast over fp32 master weights.

Under "bf16" every forward pass (sampling, log-probs, values, the update) runs in
torch.autocast(bf16): linear layers and attention compute in bf16, while the weights, norms,
softmax and the optimizer stay fp32, as in the reference's bf16 DeepSpeed setup. The same
autocast exists on CPUs, so the bf16 path can be run and tested without a GPU. Log-probs are
taken in fp32 from the bf16 logits (rollout.chosen_logprobs), the value head runs in fp32
(value.Critic), and the frozen reference computes exactly as the policy does
(cast_linear_weights), so that at equal weights their KL is 0, not rounding noise.
"""
from contextlib import nullcontext

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16")


def default_precision(device: torch.device) -> str:
    """bf16 on CUDA (the reference's setting). fp32 elsewhere: the CPU demo keeps its exact numbers,
    and bf16 speed on a CPU depends on its bf16 instructions (AMX, AVX512-BF16)."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str):
    """The context of every forward pass: bf16 autocast for "bf16", none for "fp32"."""
    assert precision in PRECISIONS, precision
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def cast_linear_weights(model, precision: str):
    """Store a frozen model's nn.Linear weights in bf16 under "bf16", and nothing else. Autocast
    casts exactly those to bf16 at every use anyway, so the model computes bit for bit as with
    its fp32 weights, in about half the memory. Casting the whole model (model.to(bf16)) would
    not: embeddings and norms would round too, and so would RoPE's inv_freq buffer (angles off by
    ~0.1 rad at position 256). A weight shared with the embedding (a tied lm_head) stays fp32:
    the embedding lookup reads it uncast. Returns the model."""
    if precision == "bf16":
        embedding = model.get_input_embeddings().weight
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight is not embedding:
                module.to(torch.bfloat16)
    return model
