"""--precision: fp32, or bf16 autocast over fp32 master weights (as the reference's bf16 DeepSpeed setup):
linear layers and attention compute in bf16; weights, norms, softmax, log-probs (rollout.chosen_logprobs),
the value head and the optimizer stay fp32. CPUs have the same autocast, so the bf16 path runs anywhere."""
from contextlib import nullcontext

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16")


def default_precision(device: torch.device) -> str:
    """bf16 on CUDA (the reference's); fp32 elsewhere: the CPU demo keeps its exact numbers."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str):
    """The context of every forward pass: bf16 autocast for "bf16", none for "fp32"."""
    assert precision in PRECISIONS, precision
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def cast_linear_weights(model, precision: str):
    """bf16: a frozen model's nn.Linear weights in bf16, which autocast casts anyway: the same numbers (KL 0
    at equal weights) in half the memory. Not model.to(bf16): norms and RoPE would round too."""
    if precision == "bf16":
        embedding = model.get_input_embeddings().weight
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight is not embedding:
                module.to(torch.bfloat16)
    return model
