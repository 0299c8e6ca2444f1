"""Fine-tunes a causal LM on a verifiable reasoning task by VinePPO, PPO, TPPO or GRPO.

    python train.py                                     # offline demo: tiny model, arithmetic
    python train.py --model rho-math-1.1b --data gsm8k  # the paper's setting (GPU, hub access)
    python train.py --model rho-math-1.1b --data math   # the paper's MATH row (its SFT start)
    torchrun --nproc_per_node 8 train.py --model rho-math-1.1b --data gsm8k   # 8 GPUs, DDP

This file is the only entry point. The loop in main is Algorithm 1 of the VinePPO paper, with
one block per phase. The phases are 1. draw prompts, 2. sample and grade responses, 3. cut them
into steps, 4. old log-probs, 5. values (VinePPO's MC values, or a critic's), 6. advantages,
7. reference log-probs, 8. epochs of clipped PPO, 9. evaluate, log and save.
Read Config and its presets first, then main. The command line at the end can wait.
"""
import signal
import sys


def stop_starting(signum, frame):
    """Ctrl-C or SIGTERM before the run has begun (the imports take seconds): one line."""
    name = signal.Signals(signum).name
    print(f"stopped by {name} while starting; nothing was written", file=sys.stderr)
    sys.exit(128 + signum)


if __name__ == "__main__":  # before the heavy imports below
    signal.signal(signal.SIGINT, stop_starting)
    signal.signal(signal.SIGTERM, stop_starting)

import collections
import dataclasses
import json
import os

import torch

import batching
import ppo
import reward
import rollout
import value
import vine
import vine_cheaper
from engineering import checkpoint, models, parallel, prompts, settings, start, tasks
from engineering.settings import DEVICE, LR, STEPS, TRAPS, above, arg, at_least, between, one_of


# ---- the settings, which python train.py --help lists. Each one's rule (at_least(0), LR, ...)
# is a test plus the words for what it expects (engineering/settings.py)
@dataclasses.dataclass
class Config:
    """The defaults follow the reference's rho-1.1B GSM8K run. DEMO, below, overrides a
    few of them for --model tiny."""
    model: str = arg("tiny", "'tiny' (built offline), 'rho-math-1.1b', or "
                             "any HF model id / local path")
    data: str = arg("arith", "'arith' (built-in), 'gsm8k', 'math' (hub), or a .jsonl of "
                             "question/answer (GSM8K) or problem/solution (MATH)")
    eval_data: str = arg("", "held-out problems; default: the test split of --data "
                             "(for .jsonl: the same file)")
    prompt_template: str = arg("", "the prompt: a str.format string whose only field is {question} "
                                   "({{ and }} write a brace, as in \\boxed{{}}), or @FILE "
                                   "holding one (default: the data's own; with --chat the "
                                   "question alone)")  # checked by prompts.read_template_file
    chat: bool = arg(False, "the prompt as a user turn of the tokenizer's chat template "
                            "(an instruct model)")
    system: str = arg("", "with --chat: a system turn before it")
    answer: str = arg("hash", "GSM8K-format data, arith: the answer graded and written by SFT: "
                              "hash (a last '#### N') | boxed (the last \\boxed{N}, "
                              "up to equivalence)", one_of("hash", "boxed"))
    out: str = arg("out", "output directory, empty or a run's: metrics.jsonl, samples.jsonl, "
                          "checkpoint/")
    algo: str = arg("vineppo", "vineppo | ppo (critic) | tppo (tracking critic) | grpo",
                    one_of(*ppo.ALGOS))
    seed: int = arg(0, "random seed",
                    (lambda v: 0 <= v < 2**63, "0 <= SEED < 2**63 (torch's seeds)"))
    iterations: int = arg(650, "RL iterations (sample, estimate, update)", at_least(0))
    prompts_per_iter: int = arg(64, "problems sampled per iteration", at_least(1))
    samples_per_prompt: int = arg(8, "responses sampled per problem", at_least(1))
    mc_rollouts: int = arg(9, "K: continuations per state for the MC value", at_least(1))
    max_value_states: int = arg(26, "MC-valued states per response (s_0..s_25); "
                                    "later: the return; 0: all", at_least(0))
    no_fork: bool = arg(False, "every sample (responses, MC values) by its definition: each "
                               "prefix encoded afresh, not forked (slower; same distribution)")
    mc_max_rollouts: int = arg(0, "adaptive MC values (the reference's: 30): --mc-rollouts first, "
                                  "then more while V_hat's 95-percent interval > --mc-ci-width, "
                                  "never more than this in all (the last round is cut to fit); "
                                  "0: off", at_least(0))
    mc_increment: int = arg(4, "adaptive MC values: continuations added per round", at_least(1))
    mc_ci_width: float = arg(0.05, "adaptive MC values: a width of V_hat's 95-percent interval "
                                   "that is enough", above(0))
    mc_reuse: bool = arg(False, "each response is one more continuation of the states it passes "
                                "(unbiased)")
    mc_top_up: bool = arg(False, "with --mc-reuse: a state gets K minus the other responses "
                                 "through it")
    value_head: str = arg("", "ppo/tppo critic head: scalar | tracking | bce "
                              "(default: scalar, tppo: tracking)", one_of("", *value.HEADS))
    critic_lr: float = arg(1e-6, "critic learning rate (its own AdamW)", LR)
    critic_warmup: int = arg(0, "iterations that train only the critic before the policy moves "
                                "(its LR schedule spans the iterations after them)", at_least(0))
    gamma: float = arg(1.0, "GAE discount", between(0, 1))
    lam: float = arg(1.0, "GAE lambda of the policy's advantages", between(0, 1))
    lam_critic: float = arg(1.0, "GAE lambda of the scalar head's targets (the tracking and bce "
                                 "heads learn the outcome R, whatever it is)", between(0, 1))
    value_clip: float = arg(0.2, "clip range of the scalar critic around its old values", above(0))
    epochs: int = arg(2, "PPO epochs over each iteration's episodes", at_least(1))
    minibatch: int = arg(64, "episodes per optimizer step", at_least(1))
    micro_batch: int = arg(16, "episodes per forward/backward pass (gradient accumulation)",
                           at_least(1))
    lr: float = arg(1e-6, "policy learning rate (AdamW)", LR)
    warmup: float = arg(0.03, "fraction of steps in log-shaped warm-up, then linear decay to 0",
                        between(0, 1))
    clip: float = arg(0.2, "PPO clip range epsilon", above(0))
    kl_coef: float = arg(1e-4, "coefficient of the k3 KL to the reference model, in the loss",
                         at_least(0))
    temperature: float = arg(0.6, "sampling temperature "
                                  "(also divides the logits of every log-prob)",
                             at_least(1e-3))  # lower: logits / temperature overflow float32
    top_p: float = arg(0.9, "nucleus sampling "
                            "(the log-probs do not model it: 1.0 samples exactly the policy)",
                       (lambda v: 0 < v <= 1, "in (0, 1]"))
    max_new_tokens: int = arg(1024, "token budget of a response; an unfinished response scores 0",
                              at_least(1))
    max_prompt_tokens: int = arg(1512, "problems with longer prompts are skipped", at_least(1))
    eval_every: int = arg(10, "evaluate before RL, every N iterations and at the end (0: no N)",
                          at_least(0))
    eval_problems: int = arg(0, "held-out problems per evaluation (0 = all)", at_least(0))
    eval_samples: int = arg(16, "samples per held-out problem (accuracy = mean over them)",
                            at_least(1))
    eval_temperature: float = arg(0.35, "sampling temperature at evaluation (0 = greedy)",
                                  (lambda v: v == 0 or v >= 1e-3, "0 (greedy) or >= 0.001"))
    save_every: int = arg(10, "checkpoint every N iterations and at the end (0: only at the end)",
                          at_least(0))
    sft_steps: int = arg(0, "supervised warm-up steps on the gold solutions before RL", at_least(0))
    sft_lr: float = arg(1e-5, "SFT learning rate", LR)
    sft_batch: int = arg(64, "SFT batch size", at_least(1))
    arith_steps: str = arg("2-5", "arith only: steps per chain, MIN-MAX (the difficulty)", STEPS)
    arith_slip: float = arg(0.0, "arith only: chance that a step (with traps: a trap) "
                                 "of an SFT demo is wrong", between(0, 1))
    arith_traps: str = arg("", "arith only: the modulo-10 task, "
                               "MIN-MAX carry/borrow steps per chain", TRAPS)
    max_batch_tokens: int = arg(524288, "generation batch budget: rows x (prefix + new tokens); "
                                        "another changes a seed's samples", at_least(1))
    forward_batch_tokens: int = arg(32768, "token budget of one log-prob / value forward pass; "
                                           "another changes a seed's MC samples", at_least(1))
    device: str = arg("auto", "'cuda', 'cpu' or 'auto'", DEVICE)
    precision: str = arg("", "fp32 | bf16: bf16 autocast over fp32 weights "
                             "(default: bf16 on CUDA, else fp32)", one_of("", *models.PRECISIONS))
    resume: bool = arg(False, "continue from the last complete checkpoint in --out")
    overwrite: bool = arg(False, "start afresh in an --out that holds an earlier run, "
                                 "replacing its results")
    trust_remote_code: bool = arg(False, "allow model code from the hub "
                                         "(off: transformers' own architectures)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward: "
                                              "less memory, slower")
    fsdp: bool = arg(False, "under torchrun: shard policy and critic (weights, grads, AdamW) "
                            "with FSDP2")


# The offline demo (--model tiny), in one place: a 0.9M-parameter model, SFT from scratch on
# demonstrations with careless off-by-one slips, then VinePPO removes the slips. Sized for a
# 2-core CPU.
DEMO = dict(iterations=20, prompts_per_iter=32, samples_per_prompt=8, mc_rollouts=4, minibatch=64,
            micro_batch=64, lr=1e-4, warmup=0.0, kl_coef=1e-3, max_new_tokens=64, eval_every=5,
            eval_problems=400, eval_samples=2, save_every=10, sft_steps=1500,
            sft_batch=16, sft_lr=1e-3, arith_slip=0.25, max_batch_tokens=32768, critic_lr=1e-4)


# Where the reference's MATH run differs from its GSM8K run, for --data math or a .jsonl of MATH
MATH = dict(iterations=1000, max_value_states=0)
PRESETS = ((DEMO, "in the demo (--model tiny)"), (MATH, "with MATH data"))


def main(cfg: Config):
    rank, world, device, autocast = start.start_process(cfg)  # torchrun: GPU `rank` of `world`
    run = start.start_run(cfg, device, autocast)  # data, models, and where the run stands
    tok, policy, critic = run.tok, run.policy, run.critic
    sampling, mc, cheaper, hp = algorithm_settings(cfg, tok, policy.model, world)
    if run.iterations_done is None:  # a fresh run: evaluate the starting policy (iteration 0)
        scores = evaluate(policy.model, run.eval_set, cfg, sampling, autocast, 0)
        parallel.log(cfg.out, {"iteration": 0, **scores})
        if cfg.iterations == 0:  # an SFT-only run still leaves a checkpoint
            checkpoint.save_training_state(cfg, 0, tok, policy, critic)

    watch = None
    for it in range((run.iterations_done or 0) + 1, cfg.iterations + 1):
        # each phase's block is timed (time_rollout, ...), and runs its models under autocast
        watch = parallel.Stopwatch(watch, autocast)
        with watch.phase("time_rollout", policy.model):
            # 1. prompts, 2. responses and their rewards, 3. steps
            problems = tasks.draw_problems(run.train_set, cfg.prompts_per_iter, cfg.seed + it,
                                            rank, world)  # shuffled by seed + iteration
            episodes = rollout.sample_episodes(policy.model, problems, cfg.samples_per_prompt,
                                               sampling)
            prompts.warn_if_unread(episodes, tok, f"iteration {it}")
            vine.split_steps(episodes, tok)
        # 4. old log-probs, 5. VinePPO's MC values (or the critic's values)
        mc_counts = logprobs_and_values(cfg, episodes, policy, critic, sampling, mc, cheaper,
                                        watch)
        with watch.phase("time_advantages"):  # 6. advantages: VinePPO's, GAE's or GRPO's
            diagnostics = ppo.assign_advantages(cfg.algo, episodes, cfg.gamma, cfg.lam,
                                                cfg.lam_critic, reuse=cfg.mc_reuse)
        with watch.phase("time_reference", run.ref):  # 7. reference log-probs, once
            rollout.reference_logprobs(run.ref, episodes, cfg.temperature, sampling.pad_id,
                                       cfg.forward_batch_tokens)
        with watch.phase("time_update"):  # 8. epochs of clipped PPO
            stats = ppo.ppo_update(episodes, policy, critic, hp,
                                   move_policy=it > cfg.critic_warmup, pad_id=sampling.pad_id,
                                   device=device, autocast=autocast)
        with watch.phase("time_eval"):  # 9. evaluate, log, checkpoint
            scores = (evaluate(policy.model, run.eval_set, cfg, sampling, autocast, it)
                      if scheduled(it, cfg.eval_every, cfg.iterations) else {})
        row = parallel.iteration_metrics(episodes, stats, diagnostics, mc_counts, policy, watch)
        parallel.log(cfg.out, {"iteration": it, **row, **scores})
        if scheduled(it, cfg.save_every, cfg.iterations):
            checkpoint.save_training_state(cfg, it, tok, policy, critic)
    return policy.model


def algorithm_settings(cfg: Config, tok, model, world: int):
    """Reads from cfg the settings of sampling, of the MC values and of the update.

    Returns rollout.Sampling, vine.MCSettings, vine_cheaper.CheaperSettings and
    ppo.PPOSettings."""
    stops = prompts.stop_ids(tok, model, cfg.chat)  # every id that ends a response, SFT's first
    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, eos_id=stops[0], eos_ids=stops,
                                pad_id=rollout.pad_id(tok), stop=reward.STOP, tokenizer=tok,
                                max_batch_tokens=cfg.max_batch_tokens, fork=not cfg.no_fork)
    mc = vine.MCSettings(k=cfg.mc_rollouts, max_states=cfg.max_value_states)
    cheaper = vine_cheaper.CheaperSettings(max_k=cfg.mc_max_rollouts, increment=cfg.mc_increment,
                                           ci_width=cfg.mc_ci_width, reuse=cfg.mc_reuse,
                                           top_up=cfg.mc_top_up)
    # GRPO's advantages are already normalised per group: whitening again would re-centre them
    hp = ppo.PPOSettings(epochs=cfg.epochs, minibatch=cfg.minibatch // world,
                         micro_batch=cfg.micro_batch, temperature=cfg.temperature, clip=cfg.clip,
                         kl_coef=cfg.kl_coef, value_clip=cfg.value_clip,
                         whiten=cfg.algo != "grpo")
    return sampling, mc, cheaper, hp


def logprobs_and_values(cfg: Config, episodes, policy, critic, sampling, mc, cheaper,
                        watch) -> collections.Counter:
    """Phases 4 and 5: sets the old log-probs, then the values, and returns the MC counts.

    The log-prob pass runs one chunk of prompts at a time (batching.group_chunks). VinePPO forks
    that pass's KV cache, whose row e holds chunk[e], before the next chunk's pass.
    PPO and TPPO take the critic's V(s_t) before each token instead."""
    mc_counts, keep = collections.Counter(), cfg.algo == "vineppo" and sampling.fork
    with watch.autocast, parallel.unsharded(policy.model):
        for chunk in batching.group_chunks(episodes, cfg.forward_batch_tokens):
            with watch.lap("time_logprobs"):
                cache = rollout.old_logprobs(policy.model, chunk, cfg.temperature,
                                             sampling.pad_id, keep_cache=keep)
            if cfg.algo == "vineppo":
                with watch.lap("time_mc_values"):
                    mc_counts += value_with_mc(policy.model, chunk, cache, sampling, mc, cheaper)
            del cache  # before the next chunk's forward pass allocates its own
    if critic is not None:
        with watch.phase("time_critic_values", critic.model):
            value.critic_values(critic.model, episodes, sampling.pad_id, cfg.forward_batch_tokens)
    return mc_counts


def value_with_mc(model, chunk, cache, sampling, mc, cheaper) -> collections.Counter:
    """Estimates VinePPO's MC values of a chunk's states and returns their counts.

    vine.mc_values estimates them, or vine_cheaper.mc_values when a cheaper setting is on."""
    if cheaper.on():
        return vine_cheaper.mc_values(model, chunk, cache, sampling, mc, cheaper)
    return vine.mc_values(model, chunk, cache, sampling, mc)


def scheduled(it: int, every: int, last: int) -> bool:
    """Tells whether iteration it is due: every `every` iterations (never for 0), and the last."""
    return it == last or (every > 0 and it % every == 0)


def evaluate(policy, problems: list[dict], cfg: Config, sampling, autocast, iteration: int) -> dict:
    """Measures the policy's held-out accuracy, sampled and greedy.

    Each problem gets --eval-samples samples at --eval-temperature (the paper's 0.35).
    The greedy accuracy takes one greedy answer a problem.
    Samples of the first three problems go to samples.jsonl."""
    mine = problems[parallel.rank()::parallel.world_size()]
    with autocast, parallel.unsharded(policy):
        at_temperature = dataclasses.replace(sampling, temperature=cfg.eval_temperature)
        episodes = rollout.sample_episodes(policy, mine, cfg.eval_samples, at_temperature)
        greedy = rollout.sample_episodes(policy, mine, 1,
                                         dataclasses.replace(sampling, temperature=0.0))
    prompts.warn_if_unread(episodes + greedy, sampling.tokenizer,
                           f"evaluation at iteration {iteration}")
    if parallel.rank() == 0:
        tok = sampling.tokenizer
        with open(os.path.join(cfg.out, "samples.jsonl"), "a") as f:
            for ep in episodes[: 3 * cfg.eval_samples: cfg.eval_samples]:  # of the first 3 problems
                prompt = tok.decode(ep.prompt_ids, skip_special_tokens=True)
                response = tok.decode(ep.response_ids, skip_special_tokens=True)
                row = dict(iteration=iteration, prompt=prompt, response=response, gold=ep.gold,
                           reward=ep.reward)
                f.write(json.dumps(row) + "\n")
    totals = [sum(ep.reward for ep in episodes), sum(ep.reward for ep in greedy), len(mine)]
    totals = torch.tensor(totals, dtype=torch.float64, device=next(policy.parameters()).device)
    sampled, greedy_correct, count = parallel.all_reduce_sum(totals)
    return {"eval_accuracy": (sampled / (count * cfg.eval_samples)).item(),
            "eval_greedy_accuracy": (greedy_correct / count).item()}


# ---- engineering: the command line (skip on a first reading) ----------------------------------

def parse_args(argv=None) -> Config:
    p = settings.command_line(Config, PRESETS, __doc__)
    argv = settings.join_negative_numbers(sys.argv[1:] if argv is None else argv)
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    prompts.read_template_file(given, p.error)
    math_data = tasks.is_math_data(given.get("data", Config.data))
    tiny = given.get("model", Config.model) == "tiny"
    cfg = Config(**{**(MATH if math_data else {}), **(DEMO if tiny else {}), **given})
    if math_data:  # the reference's SFT checkpoint for MATH
        cfg.model = models.MATH_ALIASES.get(cfg.model, cfg.model)
    for f in dataclasses.fields(Config):  # every setting against its rule, once, before any work
        settings.check(f, getattr(cfg, f.name), p.error)
    settings.refuse_conflicts(cfg, p.error)  # pairs of settings that cannot go together
    cfg.value_head = cfg.value_head or {"ppo": "scalar", "tppo": "tracking"}.get(cfg.algo, "")
    if os.environ.get("RANK", "0") == "0":  # torchrun: one process says it
        settings.warn_ignored(cfg, given)
        tasks.warn_other_prompts(cfg)
    return cfg


if __name__ == "__main__":
    start.run_to_the_end(main, parse_args())  # a stop or an error: one line and an exit status
