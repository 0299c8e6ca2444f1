"""The supervised warm start (--sft-steps) before RL: demonstrations in --answer's style, and a
loss on their response tokens only (the reference's trainers/mle_trainer.py).

Needs: prompts.py (the prompt, the id that ends a turn), ppo.py (the optimizer step), rollout.py
(padding), parallel.py. Engineering around the algorithm: a first reading may skip this file."""
import random
import re

import torch
from tqdm import tqdm

import ppo
import rollout
from engineering import parallel
from engineering.prompts import encode_prompt, stop_ids
from engineering.tasks import DataError


def sft_target(answer: str, style: str = "hash", chat: bool = False) -> str:
    """The SFT response of the reference: '\\n' + answer without <<calculator>> notes + '\\n'; its
    final '#### N' written 'The answer is \\boxed{N}.' in the boxed style; a chat turn without the
    newlines."""
    text = re.sub(r"<<[^>]*>>", "", answer)
    if style == "boxed" and "####" in text:
        head, _, number = text.rpartition("####")
        text = head + f"The answer is \\boxed{{{number.strip()}}}."
    return text.strip("\n") if chat else "\n" + text + "\n"


def sft_example(tok, prompt: str, answer: str, style: str = "hash", chat: bool = False,
                prompt_ids: list[int] | None = None,
                end_id: int | None = None) -> tuple[list[int], int]:
    """(prompt + response + end-of-turn ids, prompt length: SFT's loss is on the response, as the
    reference's MLEDataCollator in trainers/mle_trainer.py masks the query), the response
    tokenized after the prompt (alone, SentencePiece would start it with a '▁'), or alone where
    the two merge (BPE).
    prompt_ids: the prompt as sampling starts from it (default: encode_prompt);
    end_id: default EOS."""
    prompt_ids = encode_prompt(tok, prompt) if prompt_ids is None else prompt_ids
    target = sft_target(answer, style, chat)
    prompt_text_ids = tok(prompt, add_special_tokens=False).input_ids
    joint = tok(prompt + target, add_special_tokens=False).input_ids
    if joint[: len(prompt_text_ids)] == prompt_text_ids:
        response = joint[len(prompt_text_ids):]
    else:
        response = tok(target, add_special_tokens=False).input_ids
    return prompt_ids + response + [tok.eos_token_id if end_id is None else end_id], len(prompt_ids)


RL_LONGEST = "--max-prompt-tokens + --max-new-tokens"  # the longest sequence RL holds


def sft_examples(tok, problems: list[dict], max_tokens: int, chat: bool = False,
                 limit: str = RL_LONGEST) -> list[tuple[list[int], int]]:
    """(ids, prompt length) of the SFT examples no longer than the longest sequence RL holds,
    max_tokens = --max-prompt-tokens + --max-new-tokens or the model's context if less (`limit`
    names which): SFT never needs more memory than RL for one, nor a position past the context."""
    end = stop_ids(tok, None, chat)[0]  # the id a turn ends in, as sampling stops at it
    examples = [sft_example(tok, p["prompt"], p.get("demonstration", p["answer"]),
                            p.get("style", "hash"), chat, p["prompt_ids"], end)
                for p in problems]
    kept = [(ids, n_prompt) for ids, n_prompt in examples if len(ids) <= max_tokens]
    if not kept:
        raise DataError(f"{limit} = {max_tokens}: every training problem's SFT example (prompt "
                        "and solution) is longer")
    if len(kept) < len(examples) and parallel.rank() == 0:
        tqdm.write(f"sft: skipped {len(examples) - len(kept)} of {len(examples)} training "
                   f"problems: prompt and solution over {limit} = {max_tokens} tokens")
    return kept


def sft_warm_start(policy, tok, problems: list[dict], cfg, device, autocast):
    """Supervised warm start on the gold (or demonstration) solutions: a loss on their response
    tokens only."""
    rank, world, steps, lr = parallel.rank(), parallel.world_size(), cfg.sft_steps, cfg.sft_lr
    rng, model = random.Random(cfg.seed), parallel.wrap(policy, cfg.fsdp, device)
    max_tokens, limit = cfg.max_prompt_tokens + cfg.max_new_tokens, RL_LONGEST
    context = getattr(policy.config, "max_position_embeddings", None)
    if context and context < max_tokens:
        max_tokens, limit = context, "the model's context (max_position_embeddings)"
    examples, skipped = sft_examples(tok, problems, max_tokens, cfg.chat, limit), 0
    policy.train()
    optim = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    for step in tqdm(range(steps), desc="sft", disable=rank != 0):
        batch = rng.sample(examples, min(cfg.sft_batch, len(examples)))[rank::world]
        ids, mask = rollout.pad_right([seq for seq, _ in batch], rollout.pad_id(tok), device)
        labels = ids.masked_fill(mask == 0, -100)
        for i, (_, n_prompt) in enumerate(batch):
            labels[i, :n_prompt] = -100  # the loss covers the response only
        for group in optim.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        # the token mean of the whole batch: each process's token sum over the global count,
        # times the processes, since DDP averages their gradients (a mean of per-process means
        # would not be)
        n_tokens = parallel.all_reduce_sum((labels[:, 1:] != -100).sum())
        with autocast:
            out = model(input_ids=ids, attention_mask=mask, labels=labels,
                        num_items_in_batch=n_tokens)
            loss = out.loss * world
        # a non-finite loss makes a non-finite gradient norm: the step is skipped, as in RL
        loss.backward()
        # also leaves no gradient for the first RL step
        skipped += ppo.optimizer_step(policy, optim) is None
    policy.eval()  # training mode (dropout) only inside an update
    if skipped and rank == 0:
        tqdm.write(f"warning: sft: {skipped} of {steps} steps skipped: non-finite loss or gradient")
