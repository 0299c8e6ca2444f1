"""VinePPO fine-tuning of a causal LM on a verifiable reasoning task. The only entry point.

    python train.py                                        # offline demo: tiny model, arithmetic chains
    python train.py --model rho-math-1.1b --data gsm8k     # the paper's setting (GPU, hub access)
    torchrun --nproc_per_node 8 train.py --model rho-math-1.1b --data gsm8k   # 8 GPUs, DDP

One iteration (VinePPO, Algorithm 1): draw prompts -> sample and grade responses -> old log-probs,
and from the same forward pass the MC values of every step boundary -> step advantages ->
reference log-probs -> epochs of clipped PPO on minibatches -> log, evaluate, checkpoint.
"""
import json
import os
import sys
import time

from tqdm import tqdm

import checkpoint
import parallel
import ppo
import reward
import rollout
import start
import vine
from config import Config, parse_args
from reward import STOP, DataError, gsm8k_reward


def main(cfg: Config):
    rank, world, device, autocast = start.start_process(cfg)  # torchrun: one process per GPU; else 0 of 1
    # data, models (SFT warm start, frozen reference, critic), optimizers; or all from --out's checkpoint
    tok, train_set, eval_set, ref, policy, critic, done = start.start_run(cfg, device, autocast)
    # sampling settings shared by rollouts, MC continuations and evaluation; the reference's stop string
    gen = dict(top_p=cfg.top_p, eos_id=tok.eos_token_id, pad_id=rollout.pad_id(tok), tokenizer=tok, stop=STOP,
               max_batch_tokens=cfg.max_batch_tokens, max_new_tokens=cfg.max_new_tokens,
               fork_method="gather" if device.type == "cuda" else "copy")  # see kv_fork.fork
    grade = lambda response_ids, ep: gsm8k_reward(tok.decode(response_ids, skip_special_tokens=True), ep.gold)
    evaluate = lambda it: rollout.evaluate(policy.model, eval_set, cfg, tok, gen, grade, autocast, it)
    critic_model = critic and critic.model
    if done is None:  # a fresh run: evaluate the starting policy (iteration 0)
        log(cfg.out, {"iteration": 0, "eval_accuracy": evaluate(0)})
        if cfg.iterations == 0:  # an SFT-only run still leaves a checkpoint
            checkpoint.save_training_state(cfg, 0, tok, policy, critic)
    elif done >= cfg.iterations and rank == 0:
        tqdm.write(f"--resume: the checkpoint is at iteration {done}, --iterations {cfg.iterations}: "
                   "nothing to train")

    for it in range((done or 0) + 1, cfg.iterations + 1):
        clock = [time.time()]  # when each phase ends, for the time_* metrics
        # 1-3. prompts (the reference shuffles with seed + iteration), responses, rewards, step boundaries
        problems = reward.draw_problems(train_set, cfg.prompts_per_iter, cfg.seed + it, rank, world)
        with autocast, parallel.whole(policy.model):  # FSDP: full weights while processes sample apart
            episodes = rollout.sample_episodes(policy.model, problems, cfg.samples_per_prompt, grade,
                                               temperature=cfg.temperature, **gen)
        for ep in episodes:
            ep.step_starts = vine.response_step_starts(tok, ep.response_ids)
        clock.append(time.time())
        # 4-5. old log-probs and, from the same forward pass, the values (its KV cache holds every state the
        #      MC rollouts fork: no state is encoded twice); then the advantages
        with parallel.whole(policy.model, critic_model):
            mc_counts = vine.old_logprobs_and_values(
                policy.model, critic_model, episodes, grade, algo=cfg.algo, temperature=cfg.temperature,
                mc_rollouts=cfg.mc_rollouts, max_value_states=cfg.max_value_states,
                forward_batch_tokens=cfg.forward_batch_tokens, autocast=autocast, **gen)
        diagnostics = ppo.assign_advantages(cfg.algo, episodes, cfg.gamma, cfg.lam, cfg.lam_critic)
        clock.append(time.time())
        # 6. reference log-probs, once per iteration
        rollout.reference_logprobs(ref, episodes, temperature=cfg.temperature, pad_id=gen["pad_id"],
                                   forward_batch_tokens=cfg.forward_batch_tokens, autocast=autocast)
        clock.append(time.time())
        # 7. epochs of clipped PPO on shuffled minibatches (during --critic-warmup only the critic learns);
        #    GRPO's advantages are already normalised per group: whitening again would re-centre them
        stats = ppo.ppo_update(episodes, policy, critic, epochs=cfg.epochs, minibatch=cfg.minibatch // world,
                               micro_batch=cfg.micro_batch, temperature=cfg.temperature, clip=cfg.clip,
                               kl_coef=cfg.kl_coef, value_clip=cfg.value_clip,
                               move_policy=it > cfg.critic_warmup, whiten=cfg.algo != "grpo",
                               pad_id=gen["pad_id"], device=device, autocast=autocast)
        clock.append(time.time())
        # 8. log, evaluate, checkpoint: every N iterations (N = 0: never) and at the last one
        due = lambda every: it == cfg.iterations or (every > 0 and it % every == 0)
        row = {"iteration": it, **iteration_metrics(episodes, stats, diagnostics, mc_counts, policy, clock)}
        if due(cfg.eval_every):
            row["eval_accuracy"] = evaluate(it)
        log(cfg.out, row)
        if due(cfg.save_every):
            checkpoint.save_training_state(cfg, it, tok, policy, critic)
    return policy.model


def iteration_metrics(episodes, stats: dict, diagnostics: dict, mc_counts: dict, policy, clock: list) -> dict:
    """One metrics row: counts summed over processes, means averaged, times of the slowest process."""
    n_tokens = sum(len(ep.response_ids) for ep in episodes)
    counts = {k: stats.pop(k) for k in ("skipped_batches", "nonfinite_skips")}
    counts.update(prompts=len({ep.group for ep in episodes}), episodes=len(episodes),
                  mc_states=mc_counts["mc_states"], tokens_generated=n_tokens + mc_counts["mc_tokens"])
    means = {"train_reward": sum(ep.reward for ep in episodes) / len(episodes), **stats,
             "response_tokens": n_tokens / len(episodes), "lr": policy.scheduler.get_last_lr()[0],
             **diagnostics}
    phases = ("time_rollout", "time_values", "time_logprobs", "time_update")
    times = {**{name: end - begin for name, begin, end in zip(phases, clock, clock[1:])},
             "seconds": clock[-1] - clock[0]}
    return parallel.merge_metrics(parallel.gather((counts, means, times)))


def log(out: str, row: dict):
    if parallel.rank() == 0:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if row.get("nonfinite_skips"):
            tqdm.write(f"warning: iteration {row['iteration']}: {row['nonfinite_skips']} non-finite losses "
                       "skipped")


if __name__ == "__main__":
    try:
        main(parse_args(description=__doc__))
        parallel.close()
    except DataError as e:
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)
