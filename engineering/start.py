"""Everything before the first iteration, or on --resume all of it as the last checkpoint left it.

The process and its precision, the output directory and its lock, the data, the models (the SFT
warm start, the frozen reference, the critic) and their optimizers; at the end, how a run exits.
All engineering, skipped on a first reading; a run's life, step by step, and which function
does each: docs/runs-that-survive.md."""
import copy
import fcntl
import os
import random
import shutil
import signal
import socket
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

import ppo
import value
from engineering import checkpoint, models, outputs, parallel, prompts, settings, sft, tasks
from engineering.tasks import DataError, first_line

# so DDP and FSDP take it
RECOMPUTE = dict(activation_checkpointing_kwargs={"use_reentrant": False})


def start_process(cfg):
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world, device = parallel.init(torch.device(auto if cfg.device == "auto" else cfg.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {cfg.device}: no CUDA device is available here "
                        "(use --device cpu)")
    for name in ("prompts_per_iter", "minibatch"):  # torchrun: each process takes an equal share
        if getattr(cfg, name) % world:
            raise DataError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: "
                            f"must be divisible by the {world} processes")
    if cfg.fsdp and world == 1 and rank == 0:
        tqdm.write("warning: --fsdp: ignored (one process, nothing to shard: it shards under "
                   "torchrun)")
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)  # processes sample different responses
    cfg.precision = cfg.precision or models.default_precision(device)
    models.warn_if_bf16_is_emulated(device, cfg.precision)
    return rank, world, device, models.autocast(device, cfg.precision)  # every forward pass


@dataclass
class Run:
    """What start_run hands train.main: the data, the models and where the run stands."""
    tok: object                   # the tokenizer
    train_set: list               # problems, each with its prompt_ids (prompts.pose_problems)
    eval_set: list                # the held-out problems
    ref: nn.Module                # the frozen KL reference (the SFT policy)
    policy: ppo.Learner
    critic: ppo.Learner | None    # PPO and TPPO only
    iterations_done: int | None   # the last iteration of a resumed run; None: a fresh run


def start_run(cfg, device, autocast) -> Run:
    """Data, models, learners (ppo.Learner) and the last iteration done (None for a fresh run). All
    that can refuse the run comes first (load_run): a refused start changes nothing on disk, and
    --overwrite removes the earlier run only once nothing is left to fail (begin_writing)."""
    global tiny_in_progress
    try:
        tok, train_set, eval_set, ref, learners, state, rows = load_run(cfg, device, autocast)
    except BaseException:  # refused or stopped: the tiny model this run began to build goes too
        if tiny_in_progress is not None:  # only this run's: a refused run may not touch another's
            shutil.rmtree(tiny_in_progress, ignore_errors=True)
        raise
    finally:
        tiny_in_progress = None
    sft_reference = ref if cfg.sft_steps and state is None else None  # made by this run's SFT
    begin_writing(cfg, state, rows, sft_reference, tok)
    ref.eval().requires_grad_(False)
    # the reference computes as the policy does: KL 0 at equal weights
    models.cast_linear_weights(ref, cfg.precision)
    return Run(tok, train_set, eval_set, ref, learners[0],
               critic=learners[1] if len(learners) > 1 else None,
               iterations_done=None if state is None else state["iteration"])


def load_run(cfg, device, autocast):
    """Everything start_run needs, checked; nothing is written, so a refusal leaves --out as is."""
    check_out_apart_from_model(cfg)
    prepare_out(cfg)
    models.go_offline_without_hub(cfg)
    task = dict(steps=cfg.arith_steps, traps=cfg.arith_traps,
                hold_out=not cfg.eval_data)  # .jsonl: no overlap
    train_set = tasks.load_problems(cfg.data, "train", slip=cfg.arith_slip, **task)
    eval_set = tasks.load_problems(cfg.eval_data or cfg.data, "test",
                                    flag="--eval-data" if cfg.eval_data else "--data",
                                    **task)[: cfg.eval_problems or None]
    tasks.is_math(train_set + eval_set)  # one format for both: MATH's grader and steps, or GSM8K's
    warn_if_trained_on(train_set, eval_set)
    resume_from, state = checkpoint.find_resume(cfg)
    # a row that --resume cannot read refuses it here
    rows = checkpoint.rows_to_keep(cfg.out, state)
    tok, policy, ref = load_policy_and_reference(cfg, resume_from, device)
    if cfg.gradient_checkpointing:
        policy.activation_checkpointing_enable(**RECOMPUTE)
    context = getattr(policy.config, "max_position_embeddings", None)
    prompts.pose_problems(cfg, tok, train_set + eval_set, context)
    models.announce_fork(cfg, policy)
    models.announce_overridden_settings(policy, parallel.rank())
    train_set, eval_set = (
        prompts.drop_long_prompts(problems, cfg.max_prompt_tokens, split, context)
        for problems, split in ((train_set, "training"), (eval_set, "held-out")))
    fit_prompts_per_iter(cfg, len(train_set))
    # the KL reference and the critic start from the SFT policy
    if cfg.sft_steps and not resume_from:
        sft.sft_warm_start(policy, tok, train_set, cfg, device, autocast)
        ref.load_state_dict(parallel.full_state_dict(policy))
        if not all(torch.isfinite(w).all() for w in ref.state_dict().values()):
            raise DataError(f"--sft-lr {cfg.sft_lr}: the weights are no longer finite after SFT; "
                            "lower it")
    # PPO / TPPO: a copy of the starting policy's backbone with a value head (value.py)
    critic = None
    if cfg.algo in ("ppo", "tppo"):
        critic = checkpoint.load_critic(resume_from, device) if resume_from else \
            value.Critic(copy.deepcopy(ref.base_model), cfg.value_head).to(device)
        if critic is None:
            raise checkpoint.start_again(f"{resume_from} has no critic/")
        if cfg.gradient_checkpointing:  # a reloaded critic does not carry the setting
            critic.backbone.activation_checkpointing_enable(**RECOMPUTE)
    steps_per_iteration = settings.steps_per_iteration(vars(cfg))
    if state is not None:  # the restored LR schedules count them
        checkpoint.check_schedule(cfg, steps_per_iteration)
    total = cfg.iterations * steps_per_iteration
    # the policy does not step during --critic-warmup:
    # its schedule spans the iterations after it, down to 0
    policy_total = max(0, cfg.iterations - cfg.critic_warmup) * steps_per_iteration
    learners = [ppo.Learner(model, lr, steps, int(cfg.warmup * steps), cfg.fsdp, device)
                for model, lr, steps in [(policy, cfg.lr, policy_total),
                                         (critic, cfg.critic_lr, total)]
                if model is not None]
    checkpoint.restore_training_state(cfg, state, learners)
    return tok, train_set, eval_set, ref, learners, state, rows


def begin_writing(cfg, state, rows: dict, sft_reference, tok):
    """The run's first writes, once nothing can refuse it: --overwrite's removal of the earlier run,
    the tiny model built for it, the SFT reference (resumed runs reload it), the settings, the
    results so far."""
    if parallel.rank() == 0:
        if cfg.overwrite:
            remove_earlier_run(cfg.out)
        tiny = os.path.join(cfg.out, "tiny-init")
        # built for this run (build_tiny): a resumed run reloads it
        if cfg.model == "tiny" and state is None:
            shutil.rmtree(tiny, ignore_errors=True)
            os.replace(tiny + ".tmp", tiny)
        if sft_reference is not None:
            checkpoint.save_checkpoint(cfg.out, sft_reference, tok, name="reference")
        # a run that trains records what it runs with
        if state is None or state["iteration"] < cfg.iterations:
            checkpoint.record_settings(cfg, None if state is None else state["iteration"])
        checkpoint.write_rows(rows)
    parallel.barrier()


def check_out_apart_from_model(cfg):
    """--out may not be the --model directory nor inside it, nor hold it where the run writes or
    removes (OUT/checkpoint after --overwrite): the run would write over the model it starts from,
    or delete it."""
    model = models.ALIASES.get(cfg.model, cfg.model)
    if model == "tiny" or not os.path.isdir(model):
        return
    out, model = os.path.realpath(cfg.out), os.path.realpath(model)
    inside = lambda path, folder: path == folder or path.startswith(os.path.join(folder, ""))
    runs_own = any(inside(model, os.path.join(out, name))
                   for name in outputs.RESULTS + outputs.LEFTOVERS)
    if inside(out, model) or runs_own:
        where = ("is" if out == model else "is inside" if inside(out, model)
                 else "holds it as the run's own")
        raise DataError(f"--out {cfg.out!r} {where} --model {cfg.model!r}: the run would write "
                        "over the model it starts from; choose an --out apart from it")


def prepare_out(cfg):
    """--out checked for files that are not this project's (outputs.py), made, locked for this
    run, checked for an earlier run and writable; nothing removed yet."""
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise DataError(f"--out {cfg.out!r} is a file, not a directory")
    if os.path.islink(cfg.out) and not os.path.exists(cfg.out):
        raise DataError(f"--out {cfg.out!r} is a symbolic link to {os.readlink(cfg.out)!r}, "
                        "which does not exist")
    try:
        outputs.refuse_foreign(cfg.out, "--out")  # before the lock's file is made in it
        os.makedirs(cfg.out, exist_ok=True)
        if parallel.rank() == 0:
            lock_out(cfg.out)
        outputs.refuse_earlier(cfg.out, "--out", outputs.RESULTS, cfg.resume or cfg.overwrite,
                               "an earlier run",
                               "pass --resume to continue it or --overwrite to replace it")
        probe = os.path.join(cfg.out, f".writable{parallel.rank()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise DataError(f"--out {cfg.out!r}: not writable ({first_line(e)})") from None


def remove_earlier_run(out: str):
    """--overwrite: all of the earlier run, before anything of this run is written (of the files
    in --out, only the run's own: outputs.refuse_foreign refused any other)."""
    for name in outputs.RESULTS + outputs.LEFTOVERS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


held_lock = None  # OUT/.lock, open and locked while this process lives


def lock_out(out: str):
    """A second run into the same --out is refused. flock: the OS releases the lock when its process
    ends, however it ends, so a killed run's lock is taken over, never a reason to refuse."""
    global held_lock
    if held_lock is not None:  # a process that trained before (tests) runs one training at a time
        held_lock.close()
    lock = open(os.path.join(out, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise DataError(f"--out {out!r} is in use by a run that is still going ({holder}): wait "
                        "for it to end, or choose another --out") from None
    except OSError as e:  # a file system without locks
        tqdm.write(f"warning: --out {out!r} cannot be locked ({e.strerror}): nothing stops a "
                   "second run in it")
        return
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    held_lock = lock


def load_policy_and_reference(cfg, resume_from: str | None, device):
    """(tokenizer, policy, reference): on resume the reference is OUT/reference (after SFT) or the
    start."""
    name = models.ALIASES.get(cfg.model, cfg.model)
    if name == "tiny":
        name = os.path.join(cfg.out, "tiny-init")
        # built beside an earlier run's, which --overwrite replaces (begin_writing)
        if not resume_from:
            name = build_tiny(name + ".tmp", cfg.seed)
    tok, policy = models.load_model(resume_from or name, device, cfg.trust_remote_code,
                                        bool(resume_from))
    if not resume_from:
        return tok, policy, copy.deepcopy(policy)
    ref_path = os.path.join(cfg.out, "reference") if cfg.sft_steps else name
    # OUT/reference, OUT/tiny-init: the run's own
    in_out = ref_path.startswith(os.path.join(cfg.out, ""))
    return tok, policy, models.load_model(ref_path, device, cfg.trust_remote_code, in_out)[1]


tiny_in_progress = None  # OUT/tiny-init.tmp while this process builds it, until the run begins


def build_tiny(path: str, seed: int) -> str:
    """models.build_tiny_model at path, written by the first process; a failed write is one
    line."""
    global tiny_in_progress
    if parallel.rank() == 0:
        tiny_in_progress = path  # built under this run's lock of --out (prepare_out came first)
        try:
            shutil.rmtree(path, ignore_errors=True)  # a start that was stopped
            models.build_tiny_model(path, seed)
        except Exception as e:  # a full disk, no permission (safetensors raises its own error)
            shutil.rmtree(path, ignore_errors=True)
            raise OSError(f"cannot write {path} ({first_line(e)})") from None
    parallel.barrier()  # the other processes wait until it is written
    return path


def warn_if_trained_on(train_set: list[dict], eval_set: list[dict]):
    """One warning when held-out questions are training questions too (e.g. one file for both)."""
    trained = {p["question"].strip() for p in train_set}
    seen = sum(p["question"].strip() in trained for p in eval_set)
    if seen and parallel.rank() == 0:
        tqdm.write(f"warning: {seen} of the {len(eval_set)} held-out questions are training "
                   "questions too: the evaluation measures recall of them, not what the policy "
                   "learned (leave out --eval-data to hold out part of a .jsonl)")


def fit_prompts_per_iter(cfg, available: int):
    """More prompts an iteration than the training set holds: all of it, said once, and the LR
    schedule sized to what runs (draw_problems takes at most a multiple of the processes)."""
    fits = min(cfg.prompts_per_iter, available // parallel.world_size() * parallel.world_size())
    if fits < cfg.prompts_per_iter:
        if parallel.rank() == 0:
            tqdm.write(f"--prompts-per-iter {cfg.prompts_per_iter}: the training set has "
                       f"{available} problems; {fits} an iteration")
        cfg.prompts_per_iter = fits


def stop(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)  # SIGTERM unwinds as Ctrl-C, to below


def run_to_the_end(main, cfg):
    """main(cfg); a stop (Ctrl-C, SIGTERM) or an error ends in one line and an exit status:
    2 bad data, 1 a failed write, 128 + the signal's number a stop (where the run can go on)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    try:
        main(cfg)
        parallel.close()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a write that failed: a full disk, no permission
        print(f"error: {e}; {checkpoint.resume_hint(cfg.out)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C (SIGINT) or SIGTERM
        name = str(e) or "SIGINT"
        if parallel.rank() == 0:
            print(f"stopped by {name}; {checkpoint.resume_hint(cfg.out)}", file=sys.stderr)
        sys.exit(128 + signal.Signals[name])
