"""Supervised warm start on the gold (or demonstration) solutions, before RL.

The reference starts RL from an SFT checkpoint (reference §3.3): prompt, then the response
'\\n' + solution + '\\n' + EOS, cross-entropy on the response tokens only. The frozen KL
reference and the critic's backbone are copies of the model this returns.
"""
import random

import torch
from tqdm import tqdm

import parallel
import rollout
from reward import sft_example


def sft_warm_start(policy, tok, problems: list[dict], *, steps: int, lr: float, batch_size: int, seed: int,
                   fsdp: bool, device, autocast):
    """`steps` AdamW steps on random batches of `problems` (each process a share of every batch),
    LR warm-up over 20 steps, then linear decay; gradients clipped to norm 1."""
    rank, world = parallel.rank(), parallel.world_size()
    rng, model = random.Random(seed), parallel.wrap(policy, fsdp, device)
    policy.train()
    optim = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    for step in tqdm(range(steps), desc="sft", disable=rank != 0):
        batch = rng.sample(problems, min(batch_size, len(problems)))[rank::world]
        examples = [sft_example(tok, p["prompt"], p.get("demonstration", p["answer"])) for p in batch]
        ids, mask = rollout.pad_right([seq for seq, _ in examples], rollout.pad_id(tok), device)
        labels = ids.masked_fill(mask == 0, -100)
        for i, (_, n_prompt) in enumerate(examples):
            labels[i, :n_prompt] = -100  # the loss covers the response only
        for group in optim.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        # the token mean of the whole batch: each process's token sum over the global count, times
        # the processes, since DDP averages their gradients (a mean of per-process means would not be)
        n_tokens = parallel.all_reduce_sum((labels[:, 1:] != -100).sum())
        with autocast:
            out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_tokens)
            loss = out.loss * world
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optim.step()
    optim.zero_grad()  # the first RL step must not add the last SFT gradient
    policy.eval()  # training mode (dropout) only inside an update
