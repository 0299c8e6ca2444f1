"""VinePPO fine-tuning of a causal LM on a verifiable reasoning task. The only entry point.

    python train.py                                        # offline demo: tiny model, arithmetic chains
    python train.py --model rho-math-1.1b --data gsm8k     # the paper's setting (GPU, hub access)
    torchrun --nproc_per_node 8 train.py --model rho-math-1.1b --data gsm8k   # 8 GPUs, DDP

One iteration (VinePPO, Algorithm 1): sample prompts -> sample responses -> grade them -> MC values
from forked continuations at every step boundary -> step advantages -> old and reference
log-probs -> epochs of clipped PPO on minibatches -> log, evaluate, checkpoint.
"""
import argparse
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import parallel
import ppo
import precision
import rollout
import value
import vine
from checkpoint import (ALIASES, build_tiny_model, last_checkpoint, load_critic, load_model, rng_state,
                        save_checkpoint, set_rng_state, truncate_jsonl)
from reward import DataError, encode_prompt, gsm8k_reward, load_problems, sft_target


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Defaults follow the reference's rho-1.1B GSM8K run; DEMO below overrides a few for --model tiny."""
    model: str = arg("tiny", "'tiny' (built offline), 'rho-math-1.1b', or any HF model id / local path")
    data: str = arg("arith", "'arith' (built-in task), 'gsm8k' (hub), or a .jsonl file with question/answer")
    eval_data: str = arg("", "held-out problems; default: the test split of --data (the same file for .jsonl)")
    out: str = arg("out", "output directory: metrics.jsonl, samples.jsonl, checkpoint/")
    algo: str = arg("vineppo", "vineppo (MC values) | ppo (critic + GAE) | tppo (tracking critic + GAE) | grpo")
    seed: int = arg(0, "random seed")
    iterations: int = arg(650, "RL iterations (sample, estimate, update)")
    prompts_per_iter: int = arg(64, "problems sampled per iteration")
    samples_per_prompt: int = arg(8, "responses sampled per problem")
    mc_rollouts: int = arg(9, "K: continuations per state for the MC value")
    max_value_states: int = arg(25, "states past this step index take the realised return (reference cap)")
    value_head: str = arg("", "critic head for ppo/tppo: scalar | tracking | bce (default: scalar for ppo, tracking for tppo)")
    critic_lr: float = arg(1e-6, "critic learning rate (its own AdamW)")
    critic_warmup: int = arg(0, "iterations that train only the critic before the policy moves")
    gamma: float = arg(1.0, "GAE discount")
    lam: float = arg(1.0, "GAE lambda of the policy's advantages")
    lam_critic: float = arg(1.0, "GAE lambda of the critic's targets")
    value_clip: float = arg(0.2, "clip range of the scalar critic around its old values")
    epochs: int = arg(2, "PPO epochs over each iteration's episodes")
    minibatch: int = arg(64, "episodes per optimizer step")
    micro_batch: int = arg(16, "episodes per forward/backward pass (gradient accumulation)")
    lr: float = arg(1e-6, "policy learning rate (AdamW)")
    warmup: float = arg(0.03, "fraction of optimizer steps with log-shaped warm-up, then linear decay to 0")
    clip: float = arg(0.2, "PPO clip range epsilon")
    kl_coef: float = arg(1e-4, "coefficient of the k3 KL to the reference model, in the loss")
    temperature: float = arg(0.6, "sampling temperature (also divides the logits of every training log-prob)")
    top_p: float = arg(0.9, "nucleus sampling")
    max_new_tokens: int = arg(1024, "token budget of a response; an unfinished response scores 0")
    max_prompt_tokens: int = arg(1512, "problems with longer prompts are skipped")
    eval_every: int = arg(10, "evaluate every N iterations (iteration 0 = before RL)")
    eval_problems: int = arg(0, "held-out problems per evaluation (0 = all)")
    eval_samples: int = arg(16, "samples per held-out problem (accuracy = mean over them)")
    eval_temperature: float = arg(0.35, "sampling temperature at evaluation")
    save_every: int = arg(10, "write OUT/checkpoint every N iterations (and at the end)")
    sft_steps: int = arg(0, "supervised warm-up steps on the gold solutions before RL")
    sft_lr: float = arg(1e-5, "SFT learning rate")
    sft_batch: int = arg(64, "SFT batch size")
    arith_slip: float = arg(0.0, "arith only: chance that a step of an SFT demonstration is off by one")
    max_batch_tokens: int = arg(524288, "memory budget of one generation batch: rows x (prefix + new tokens)")
    forward_batch_tokens: int = arg(32768, "memory budget of one log-prob / value forward pass, in tokens")
    device: str = arg("auto", "'cuda', 'cpu' or 'auto'")
    precision: str = arg("", "fp32 | bf16 (bf16 autocast over fp32 weights); default: bf16 on CUDA, fp32 on CPU")
    resume: bool = arg(False, "continue from the last complete checkpoint in --out")
    trust_remote_code: bool = arg(False, "allow model code from the hub (off: only transformers' own architectures)")
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in backward: less memory, slower "
                                       "updates (the reference runs with it)")
    fsdp: bool = arg(False, "under torchrun: shard policy and critic (weights, gradients, AdamW) with FSDP2, not DDP")


# The offline demo (--model tiny), in one place: a 0.9M-parameter model, SFT from scratch on
# demonstrations with careless off-by-one slips, then VinePPO removes the slips. Sized for a 2-core CPU.
DEMO = dict(iterations=32, prompts_per_iter=32, samples_per_prompt=8, mc_rollouts=4, minibatch=64,
            micro_batch=64, lr=3e-5, warmup=0.0, kl_coef=1e-3, max_new_tokens=64, eval_every=8,
            eval_problems=200, eval_samples=4, eval_temperature=0.6, save_every=8, sft_steps=500,
            sft_lr=3e-3, arith_slip=0.25, max_batch_tokens=32768, critic_lr=1e-4)
ALGOS = ("vineppo", "ppo", "tppo", "grpo")


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        kind = dict(action="store_true") if f.type is bool else dict(type=f.type)
        p.add_argument("--" + f.name.replace("_", "-"), default=None, help=f"{f.metadata['help']} (default: {f.default})", **kind)
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    preset = DEMO if given.get("model", Config.model) == "tiny" else {}
    cfg = Config(**{**preset, **given})
    if cfg.algo not in ALGOS:
        p.error(f"--algo {cfg.algo!r}: expected one of {', '.join(ALGOS)}")
    cfg.value_head = cfg.value_head or {"ppo": "scalar", "tppo": "tracking"}.get(cfg.algo, "")
    if cfg.precision and cfg.precision not in precision.PRECISIONS:
        p.error(f"--precision {cfg.precision!r}: expected one of {', '.join(precision.PRECISIONS)}")
    if cfg.algo in ("ppo", "tppo") and cfg.value_head not in value.HEADS:
        p.error(f"--value-head {cfg.value_head!r}: expected one of {', '.join(value.HEADS)}")
    return cfg


# ---- main ---------------------------------------------------------------------------------

def main(cfg: Config):
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    on_gpu = device.type == "cuda"
    rank, world, device = parallel.init(device)  # torchrun: one process per GPU; else rank 0 of 1
    for name in ("prompts_per_iter", "minibatch"):
        if getattr(cfg, name) % world:
            raise DataError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be divisible by the {world} processes")
    main_process = rank == 0
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)  # processes sample different responses
    cfg.precision = cfg.precision or precision.default_precision(device)
    autocast = precision.autocast(device, cfg.precision)  # fp32 master weights
    try:
        os.makedirs(cfg.out, exist_ok=True)
        probe = os.path.join(cfg.out, f".writable{rank}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise DataError(f"--out {cfg.out!r}: not writable ({e.strerror})") from None
    metrics_path, samples_path = os.path.join(cfg.out, "metrics.jsonl"), os.path.join(cfg.out, "samples.jsonl")

    train_set = load_problems(cfg.data, "train", seed=cfg.seed, slip=cfg.arith_slip)
    eval_set = load_problems(cfg.eval_data or cfg.data, "test", seed=cfg.seed)
    if cfg.eval_problems:
        eval_set = eval_set[: cfg.eval_problems]
    resume_from, state = last_checkpoint(cfg.out) if cfg.resume else None, None
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), map_location="cpu", weights_only=True)
        for key in ("model", "data", "algo", "value_head", "fsdp"):
            if state["config"][key] != getattr(cfg, key):
                raise DataError(f"--resume: {resume_from} was written with --{key.replace('_', '-')} "
                                f"{state['config'][key]!r}, not {getattr(cfg, key)!r}")
    elif cfg.resume:
        tqdm.write(f"--resume: no complete checkpoint in {cfg.out}, starting from scratch")
    name = ALIASES.get(cfg.model, cfg.model)
    if name == "tiny":
        name = os.path.join(cfg.out, "tiny-init")
        if not resume_from and main_process:
            build_tiny_model(name, cfg.seed)
        parallel.barrier()  # the others wait until it is written
    tok, policy = load_model(resume_from or name, device, cfg.trust_remote_code)
    if cfg.gradient_checkpointing:  # non-reentrant, so DDP and FSDP take it
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pieces = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=True)  # token id -> text
    gen = dict(temperature=cfg.temperature, top_p=cfg.top_p, eos_id=eos, pad_id=pad, max_batch_tokens=cfg.max_batch_tokens,
               fork_method="gather" if on_gpu else "copy")
    for split in (train_set, eval_set):
        for p in split:
            p["prompt_ids"] = encode_prompt(tok, p["question"])
    train_set = [p for p in train_set if len(p["prompt_ids"]) <= cfg.max_prompt_tokens]

    def grade(response_ids, ep) -> float:
        return gsm8k_reward(tok.decode(response_ids, skip_special_tokens=True), ep.gold)

    def sample_episodes(problems, k, temperature):
        with autocast, parallel.whole(policy):
            conts, done = rollout.sample(policy, [p["prompt_ids"] for p in problems], k, [cfg.max_new_tokens] * len(problems),
                                         **{**gen, "temperature": temperature})
        eps = [rollout.Episode(p["prompt_ids"], c, p["answer"], g, f)
               for g, (p, cs, fs) in enumerate(zip(problems, conts, done)) for c, f in zip(cs, fs)]
        for ep in eps:
            ep.reward = grade(ep.response_ids, ep) if ep.finished else 0.0
        return eps

    def evaluate(iteration: int) -> float:  # each process a share of the held-out problems
        eps = sample_episodes(eval_set[rank::world], cfg.eval_samples, cfg.eval_temperature)
        if main_process:
            with open(samples_path, "a") as f:
                for ep in eps[: 3 * cfg.eval_samples: cfg.eval_samples]:
                    f.write(json.dumps({"iteration": iteration, "prompt": tok.decode(ep.prompt_ids, skip_special_tokens=True),
                                        "response": tok.decode(ep.response_ids, skip_special_tokens=True),
                                        "gold": ep.gold, "reward": ep.reward}) + "\n")
        correct, count = parallel.all_reduce_sum(torch.tensor([sum(ep.reward for ep in eps), len(eps)], dtype=torch.float64, device=device))
        return (correct / count).item()

    # frozen reference = the starting policy (after SFT, below); the critic (PPO / TPPO) = its backbone + a value head
    if resume_from:
        ref = load_model(os.path.join(cfg.out, "reference") if cfg.sft_steps else name, device, cfg.trust_remote_code)[1]
    else:
        ref = copy.deepcopy(policy)

    # ---- SFT warm start on the gold solutions (reference §3.3 format) ----
    if cfg.sft_steps and not resume_from:
        rng, sft_model = random.Random(cfg.seed), parallel.wrap(policy, cfg.fsdp, device)
        sft_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
        for step in tqdm(range(cfg.sft_steps), desc="sft", disable=not main_process):
            batch = rng.sample(train_set, min(cfg.sft_batch, len(train_set)))[rank::world]
            targets = [tok(sft_target(p.get("demonstration", p["answer"])), add_special_tokens=False).input_ids + [eos]
                       for p in batch]
            ids, mask = rollout.pad_right([p["prompt_ids"] + t for p, t in zip(batch, targets)], pad, device)
            labels = ids.masked_fill(mask == 0, -100)
            for i, p in enumerate(batch):
                labels[i, : len(p["prompt_ids"])] = -100
            for group in sft_opt.param_groups:
                group["lr"] = cfg.sft_lr * min(1.0, (step + 1) / 20) * (1 - step / cfg.sft_steps)
            # the token mean of the whole batch: each process's token sum over the global count, times
            # the processes, since DDP averages their gradients (a mean of per-process means would not be)
            n_tokens = parallel.all_reduce_sum((labels[:, 1:] != -100).sum())
            with autocast:
                loss = sft_model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_tokens).loss * world
            sft_opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            sft_opt.step()
        del sft_opt, sft_model
        ref.load_state_dict(parallel.full_state_dict(policy))
        if main_process:
            save_checkpoint(cfg.out, ref, tok, name="reference")  # resumed runs reload it
    critic = None
    if cfg.algo in ("ppo", "tppo"):
        critic = load_critic(resume_from, device) if resume_from else \
            value.Critic(copy.deepcopy(ref.base_model), cfg.value_head).to(device)
        if cfg.gradient_checkpointing:  # the critic's backbone too (a reloaded one does not carry it)
            critic.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ref.eval().requires_grad_(False)
    precision.cast_linear_weights(ref, cfg.precision)  # computes as the policy does: KL 0 at equal weights
    # the modules the update calls: DDP wrappers, or (--fsdp) policy and critic sharded in place
    train_policy, train_critic = parallel.wrap(policy, cfg.fsdp, device), (
        parallel.wrap(critic, cfg.fsdp, device) if critic is not None else None)
    steps_per_iter = cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt / cfg.minibatch)
    total = cfg.iterations * steps_per_iter
    warmup = int(cfg.warmup * total)
    steppers = []  # (model, optimizer, schedule): AdamW state and one LR schedule kept across iterations
    for model, lr in [(policy, cfg.lr)] + ([(critic, cfg.critic_lr)] if critic is not None else []):
        optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        steppers.append((model, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda s: ppo.lr_factor(s, total, warmup))))
    sched = steppers[0][2]
    start = 1
    if state is not None:  # continue exactly where the checkpoint left off
        for (model, optim, scheduler), saved in zip(steppers, state["optimizers"]):
            parallel.load_optimizer_state(model, optim, saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
        start = state["iteration"] + 1
        if len(state["rng"]) == world:  # one random state per process
            set_rng_state(state["rng"][rank])
        else:
            tqdm.write(f"--resume: written by {len(state['rng'])} processes, now {world}: random streams reseeded")
            torch.manual_seed(cfg.seed + rank + 1000 * start)
        if main_process:
            truncate_jsonl(metrics_path, state["iteration"])
            truncate_jsonl(samples_path, state["iteration"])
    elif main_process:
        for path in (metrics_path, samples_path):
            open(path, "w").close()

    def accumulate(loss, stats: dict, into: list) -> bool:
        """Backward of one micro-batch's loss, unless it is not finite (it would corrupt the weights):
        then returns True and drops its stats. Under DDP every process must take part in every
        backward, so it runs anyway, and the NaN gradient norm skips the step on all processes."""
        finite = bool(torch.isfinite(loss))
        if finite:
            into.append(stats)
        if finite or world > 1:
            loss.backward()
        return not finite

    def checkpoint(iteration: int):  # the same on every process; the first one writes
        optimizers = [{"optimizer": parallel.optimizer_state(m, o), "scheduler": s.state_dict()} for m, o, s in steppers]
        weights = [parallel.full_state_dict(m) if m is not None else None for m in (policy, critic)]
        rngs = parallel.gather(rng_state())
        if main_process:
            save_checkpoint(cfg.out, policy, tok, {"iteration": iteration, "config": dataclasses.asdict(cfg),
                                                   "optimizers": optimizers, "rng": rngs}, critic, weights=weights)

    def log(row: dict):
        if main_process:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    if start == 1:
        log({"iteration": 0, "eval_accuracy": evaluate(0)})
    if cfg.iterations == 0:  # an SFT-only run still leaves a checkpoint
        checkpoint(0)
    for it in range(start, cfg.iterations + 1):
        t0 = time.time()
        times, diagnostics = {}, {}
        # 1-3. sample prompts (reference: shuffle with seed + iteration; each process a share), responses, rewards
        n_prompts = min(cfg.prompts_per_iter, len(train_set) // world * world)  # equal shares: DDP runs in step
        picked = random.Random(cfg.seed + it).sample(range(len(train_set)), n_prompts)
        problems = [train_set[i] for i in picked[rank::world]]
        episodes = sample_episodes(problems, cfg.samples_per_prompt, cfg.temperature)
        for ep in episodes:
            ep.step_starts = vine.step_starts([pieces[i] for i in ep.response_ids])
        times["time_rollout"] = time.time() - t0

        # 4. old log-probs, and the values each method needs: VinePPO's MC values from forks of the
        #    same forward pass's KV cache, or the critic's V(s_t) for PPO/TPPO (GRPO needs none)
        t = time.time()
        n_states, mc_tokens = 0, 0
        with parallel.whole(policy, critic):  # processes run different numbers of passes here
            for chunk in tqdm(list(rollout.group_chunks(episodes, cfg.forward_batch_tokens)), desc=f"values {it}", leave=False,
                              disable=not main_process):
                ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in chunk], pad, device)
                with torch.no_grad(), autocast:
                    logp, cache = rollout.token_logprobs(policy, ids, mask, cfg.temperature, keep_cache=cfg.algo == "vineppo")
                    if cfg.algo == "vineppo":
                        s, n = vine.mc_values(policy, chunk, cache, list(range(len(chunk))), cfg.mc_rollouts, grade,
                                              max_new_tokens=cfg.max_new_tokens, max_states=cfg.max_value_states, **gen)
                        n_states, mc_tokens = n_states + s, mc_tokens + n
                    if critic is not None:
                        prompt_lens = torch.tensor([len(ep.prompt_ids) for ep in chunk], device=device)
                        for ep, v in zip(chunk, rollout.per_response(critic.values(ids, mask, prompt_lens), chunk)):
                            ep.old_values = v
                for ep, lp in zip(chunk, rollout.per_response(logp, chunk)):
                    ep.old_logp = lp
                del cache
        # 5. advantages
        rewards = torch.tensor([ep.reward for ep in episodes])
        if cfg.algo == "vineppo":  # step advantages broadcast to tokens (VinePPO §4)
            for ep in episodes:
                adv = vine.step_advantages(ep.values, ep.reward)
                ep.advantages = torch.tensor(vine.token_advantages(ep.step_starts, adv, len(ep.response_ids)))
        elif cfg.algo == "grpo":  # one group-normalised outcome advantage per response
            adv = ppo.group_advantages(rewards, torch.tensor([ep.group for ep in episodes]))
            for ep, a in zip(episodes, adv):
                ep.advantages = torch.full((len(ep.response_ids),), a.item())
        else:  # PPO / TPPO: GAE on the critic's values, the reward on the last token
            values, mask = ppo.padded([ep.old_values for ep in episodes])
            last = mask.sum(1).long() - 1
            token_rewards = torch.zeros_like(values).index_put_((torch.arange(len(episodes)), last), rewards)
            adv, _ = ppo.gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
            _, returns = ppo.gae(token_rewards, values, mask, cfg.gamma, cfg.lam_critic)
            for i, ep in enumerate(episodes):
                ep.advantages, ep.returns = adv[i, : len(ep.response_ids)], returns[i, : len(ep.response_ids)]
            diagnostics["explained_variance"] = ppo.explained_variance(values, returns, mask)
        times["time_values"] = time.time() - t

        # 6. reference log-probs, once per iteration
        t = time.time()
        for chunk in rollout.group_chunks(episodes, cfg.forward_batch_tokens):
            ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in chunk], pad, device)
            with torch.no_grad(), autocast:
                logp, _ = rollout.token_logprobs(ref, ids, mask, cfg.temperature)
            for ep, lp in zip(chunk, rollout.per_response(logp, chunk)):
                ep.ref_logp = lp
        times["time_logprobs"] = time.time() - t

        # 7. PPO epochs over shuffled minibatches; advantages whitened per minibatch (reference §2.6).
        #    The critic takes its own step on the same minibatch; during warm-up only the critic learns.
        t = time.time()
        stats, critic_stats, grad_norms, nonfinite = [], [], [], 0
        policy.train()
        move_policy = it > cfg.critic_warmup
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(episodes)).tolist()
            for lo in tqdm(range(0, len(order), cfg.minibatch // world), desc=f"update {it}.{epoch}", leave=False,
                           disable=not main_process):
                batch = [episodes[i] for i in order[lo: lo + cfg.minibatch // world]]
                ids, mask, b = ppo.collate(batch, pad, device)
                adv = ppo.masked_whiten(b["adv"], b["act"], all_reduce=parallel.all_reduce_sum)  # over all processes' shares
                for m in range(0, len(batch), cfg.micro_batch):
                    s, share = slice(m, m + cfg.micro_batch), ids[m: m + cfg.micro_batch].shape[0] / len(batch)
                    if move_policy:
                        with autocast:
                            logp, _ = rollout.token_logprobs(train_policy, ids[s], mask[s], cfg.temperature)
                        loss, st = ppo.ppo_loss(logp, b["old"][s], b["ref"][s], adv[s], b["act"][s], cfg.clip, cfg.kl_coef)
                        nonfinite += accumulate(loss * share, st, stats)
                    if critic is not None:
                        with autocast:
                            out = train_critic(ids[s], mask[s], b["prompt_lens"][s])
                        loss, st = value.critic_loss(critic, out, b["val"][s], b["ret"][s], b["reward"][s], b["act"][s], cfg.value_clip)
                        nonfinite += accumulate(loss * share, st, critic_stats)
                for model, optim, scheduler in steppers:
                    if model is policy and not move_policy:
                        continue
                    norm = ppo.optimizer_step(model, optim, scheduler)
                    nonfinite += norm is None
                    if model is policy and norm is not None:
                        grad_norms.append(norm)
        times["time_update"] = time.time() - t

        # 8. log, evaluate, checkpoint
        row = {"iteration": it, "train_reward": sum(ep.reward for ep in episodes) / len(episodes)}
        mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)
        row.update({k: mean(stats, k) for k in ("kl", "policy_loss", "clipfrac", "approx_kl", "ratio") if stats})
        row.update({k: mean(critic_stats, k) for k in ("value_loss", "value_clipfrac") if critic_stats})
        row["skipped_batches"] = int(sum(s["skipped"] for s in stats))
        row["nonfinite_skips"] = nonfinite
        row["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        row["prompts"], row["episodes"] = len(problems), len(episodes)  # this process's share; summed below
        row["response_tokens"] = sum(len(ep.response_ids) for ep in episodes) / len(episodes)
        row["mc_states"] = n_states
        row["tokens_generated"] = sum(len(ep.response_ids) for ep in episodes) + mc_tokens
        row["lr"] = sched.get_last_lr()[0]
        row.update(diagnostics)
        row.update(times)
        row["seconds"] = time.time() - t0
        row = parallel.merge_rows(parallel.gather(row))
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            row["eval_accuracy"] = evaluate(it)
        if row["nonfinite_skips"] and main_process:
            tqdm.write(f"warning: iteration {it}: skipped {row['nonfinite_skips']} non-finite losses or gradients")
        log(row)
        if it % cfg.save_every == 0 or it == cfg.iterations:
            checkpoint(it)
    return policy


if __name__ == "__main__":
    cfg = parse_args()
    try:
        main(cfg)
        parallel.close()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
