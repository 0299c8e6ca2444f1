"""Everything before the first iteration: process, precision, output directory, data, models (SFT warm
start, frozen reference, critic) and optimizers; on --resume, all of it as the last checkpoint left it.
--precision bf16 is autocast over fp32 master weights (the reference's bf16 DeepSpeed setup), on CPUs too."""
import copy
import math
import os
import random
from contextlib import nullcontext

import torch
from torch import nn
from tqdm import tqdm

import checkpoint
import parallel
import ppo
import reward
import rollout
import value
from reward import DataError

PRECISIONS = ("fp32", "bf16")
RECOMPUTE = dict(activation_checkpointing_kwargs={"use_reentrant": False})  # so DDP and FSDP take it


def default_precision(device: torch.device) -> str:
    """bf16 on CUDA (the reference's); fp32 elsewhere: the CPU demo keeps its exact numbers."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str):
    assert precision in PRECISIONS, precision
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def cast_linear_weights(model, precision: str):
    """bf16: a frozen model's nn.Linear weights in bf16, which autocast casts anyway: the same numbers (KL 0
    at equal weights) in half the memory. Not model.to(bf16): norms and RoPE would round too."""
    if precision == "bf16":
        embedding = model.get_input_embeddings().weight
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight is not embedding:  # a tied one is read uncast
                module.to(torch.bfloat16)
    return model


def start_process(cfg):
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world, device = parallel.init(torch.device(auto if cfg.device == "auto" else cfg.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {cfg.device}: no CUDA device is available here (use --device cpu)")
    for name in ("prompts_per_iter", "minibatch"):  # torchrun: each process takes an equal share
        if getattr(cfg, name) % world:
            raise DataError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: "
                            f"must be divisible by the {world} processes")
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)  # processes sample different responses
    cfg.precision = cfg.precision or default_precision(device)
    return rank, world, device, autocast(device, cfg.precision)  # every forward pass


def start_run(cfg, device, autocast):
    """Data, models, learners (ppo.Learner) and the last iteration done (None for a fresh run)."""
    prepare_out(cfg)
    task = dict(steps=cfg.arith_steps, traps=cfg.arith_traps, hold_out=not cfg.eval_data)  # .jsonl: no overlap
    train_set = reward.load_problems(cfg.data, "train", slip=cfg.arith_slip, **task)
    eval_set = reward.load_problems(cfg.eval_data or cfg.data, "test", **task)
    eval_set = eval_set[: cfg.eval_problems or None]
    resume_from, state = checkpoint.find_resume(cfg)
    tok, policy, ref = load_policy_and_reference(cfg, resume_from, device)
    if cfg.gradient_checkpointing:
        policy.activation_checkpointing_enable(**RECOMPUTE)
    for problem in train_set + eval_set:
        problem["prompt_ids"] = reward.encode_prompt(tok, problem["prompt"])
    train_set, eval_set = (drop_long_prompts(problems, cfg.max_prompt_tokens, split)
                           for problems, split in ((train_set, "training"), (eval_set, "held-out")))
    if cfg.sft_steps and not resume_from:  # the KL reference and the critic start from the SFT policy
        sft_warm_start(policy, tok, train_set, cfg, device, autocast)
        ref.load_state_dict(parallel.full_state_dict(policy))
        if parallel.rank() == 0:
            checkpoint.save_checkpoint(cfg.out, ref, tok, name="reference")  # resumed runs reload it
    critic = None  # PPO / TPPO: a copy of the starting policy's backbone with a value head (value.py)
    if cfg.algo in ("ppo", "tppo"):
        critic = checkpoint.load_critic(resume_from, device) if resume_from else \
            value.Critic(copy.deepcopy(ref.base_model), cfg.value_head).to(device)
        if cfg.gradient_checkpointing:  # a reloaded critic does not carry the setting
            critic.backbone.activation_checkpointing_enable(**RECOMPUTE)
    ref.eval().requires_grad_(False)
    cast_linear_weights(ref, cfg.precision)  # computes as the policy does: KL 0 at equal weights
    steps_per_iteration = cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt / cfg.minibatch)
    total = cfg.iterations * steps_per_iteration
    learners = [ppo.Learner(model, lr, total, int(cfg.warmup * total), cfg.fsdp, device)
                for model, lr in [(policy, cfg.lr), (critic, cfg.critic_lr)] if model is not None]
    done = checkpoint.restore_training_state(cfg, state, learners)
    return tok, train_set, eval_set, ref, learners[0], (learners[1] if critic is not None else None), done


def drop_long_prompts(problems: list[dict], max_tokens: int, split: str) -> list[dict]:
    kept = [p for p in problems if len(p["prompt_ids"]) <= max_tokens]
    if not kept:
        raise DataError(f"--max-prompt-tokens {max_tokens}: every {split} problem's prompt is longer")
    if len(kept) < len(problems) and parallel.rank() == 0:
        tqdm.write(f"skipped {len(problems) - len(kept)} of {len(problems)} {split} problems: "
                   f"prompt over --max-prompt-tokens {max_tokens}")
    return kept


def prepare_out(cfg):
    found = [name for name in checkpoint.RESULTS if os.path.exists(os.path.join(cfg.out, name))]
    if found and not cfg.resume and not cfg.overwrite:
        raise DataError(f"--out {cfg.out!r} holds an earlier run ({', '.join(found)}): "
                        "pass --resume to continue it or --overwrite to replace it")
    try:
        os.makedirs(cfg.out, exist_ok=True)
        probe = os.path.join(cfg.out, f".writable{parallel.rank()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise DataError(f"--out {cfg.out!r}: not writable ({e.strerror})") from None


def load_policy_and_reference(cfg, resume_from: str | None, device):
    """(tokenizer, policy, reference): on resume the reference is OUT/reference (after SFT) or the start."""
    name = checkpoint.ALIASES.get(cfg.model, cfg.model)
    if name == "tiny":
        name = os.path.join(cfg.out, "tiny-init")
        if not resume_from and parallel.rank() == 0:
            checkpoint.build_tiny_model(name, cfg.seed)
        parallel.barrier()  # the other processes wait until it is written
    tok, policy = checkpoint.load_model(resume_from or name, device, cfg.trust_remote_code)
    if not resume_from:
        return tok, policy, copy.deepcopy(policy)
    ref_path = os.path.join(cfg.out, "reference") if cfg.sft_steps else name
    return tok, policy, checkpoint.load_model(ref_path, device, cfg.trust_remote_code)[1]


def sft_warm_start(policy, tok, problems: list[dict], cfg, device, autocast):
    """Supervised warm start (reference §3.3) on the gold (or demonstration) solutions' response tokens."""
    rank, world, steps, lr = parallel.rank(), parallel.world_size(), cfg.sft_steps, cfg.sft_lr
    rng, model = random.Random(cfg.seed), parallel.wrap(policy, cfg.fsdp, device)
    policy.train()
    optim = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    for step in tqdm(range(steps), desc="sft", disable=rank != 0):
        batch = rng.sample(problems, min(cfg.sft_batch, len(problems)))[rank::world]
        examples = [reward.sft_example(tok, p["prompt"], p.get("demonstration", p["answer"])) for p in batch]
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
