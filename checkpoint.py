"""The start of a run and its checkpoints: models to and from disk (hub id, local path, the tiny
offline model), the setup before the first iteration (data, SFT warm start, reference, critic,
optimizers), atomic checkpoints, and what --resume needs to continue exactly (optimizers,
schedules, random streams)."""
import copy
import dataclasses
import json
import math
import os
import random
import shutil

import torch
from tqdm import tqdm

import parallel
import ppo
import reward
import sft
import value
from reward import DataError

ALIASES = {"rho-math-1.1b": "realtreetune/rho-1b-sft-GSM8K"}  # the reference's SFT checkpoint

def build_tiny_model(path: str, seed: int):
    """A 4-layer, 128-wide Llama with random weights and a character-level tokenizer built in
    code, saved with save_pretrained so that it loads through the same path as a hub model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per char
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def load_model(name: str, device, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, trust_remote_code=trust_remote_code)
        model.to(device)
    except Exception as e:  # hub, network and format errors all end here: one line, not a traceback
        raise DataError(f"--model {name!r}: cannot load it ({str(e).splitlines()[0]}); expected 'tiny', "
                        f"one of {sorted(ALIASES)}, a local directory or a reachable hub id") from None
    return tok, model


def save_checkpoint(out: str, policy, tok, state: dict | None = None, critic=None, name: str = "checkpoint",
                    policy_weights: dict | None = None, critic_weights: dict | None = None):
    """Write OUT/name atomically: build it in a temporary directory, then swap it in; the previous
    one is removed only once the new one is complete. safetensors weights (save_pretrained), the
    critic in name/critic (backbone + value_head.pt), and trainer_state.pt for --resume.
    *_weights: full state dicts, for models sharded over processes (FSDP)."""
    final, tmp, old = (os.path.join(out, name + suffix) for suffix in ("", ".tmp", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=policy_weights)
    tok.save_pretrained(tmp)
    if critic is not None:
        critic_weights = critic_weights or critic.state_dict()
        part = lambda prefix: {k[len(prefix):]: v for k, v in critic_weights.items() if k.startswith(prefix)}
        critic.backbone.save_pretrained(os.path.join(tmp, "critic"), state_dict=part("backbone."))
        torch.save({"head": critic.head_type, "state": part("head.")}, os.path.join(tmp, "critic", "value_head.pt"))
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_critic(checkpoint: str, device):
    """The critic saved by save_checkpoint in checkpoint/critic, or None when there is none."""
    path = os.path.join(checkpoint, "critic")
    if not os.path.exists(os.path.join(path, "value_head.pt")):
        return None
    from transformers import AutoModel
    head = torch.load(os.path.join(path, "value_head.pt"), map_location="cpu", weights_only=True)
    critic = value.Critic(AutoModel.from_pretrained(path), head["head"])
    critic.head.load_state_dict(head["state"])
    return critic.to(device)


def last_checkpoint(out: str) -> str | None:
    """checkpoint/, or checkpoint.old/ when a kill fell between the two renames of a save."""
    for name in ("checkpoint", "checkpoint.old"):
        if os.path.exists(os.path.join(out, name, "trainer_state.pt")):
            return os.path.join(out, name)
    return None


def truncate_jsonl(path: str, last_iteration: int):
    """Drop the rows written after the checkpoint, so a resumed run neither repeats nor skips one."""
    if os.path.exists(path):
        rows = [line for line in open(path) if json.loads(line)["iteration"] <= last_iteration]
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)


def rng_state() -> dict:
    """This process's random streams; CUDA: its own device only (touching every GPU from every
    process of a torchrun job would open a context on each)."""
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state(state["cuda"][0])


# ---- a run's start and its checkpoints (what --resume needs to continue exactly) ----

RESUME_MUST_MATCH = ("model", "data", "algo", "value_head", "fsdp")


def prepare_out(out: str):
    """Create --out and check that this process can write there."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".writable{parallel.rank()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise DataError(f"--out {out!r}: not writable ({e.strerror})") from None


def find_resume(cfg) -> tuple[str | None, dict | None]:
    """With --resume: the last complete checkpoint in --out and its trainer state, checked against
    the settings a run cannot change midway. (None, None) for a fresh start."""
    path = last_checkpoint(cfg.out) if cfg.resume else None
    if path is None:
        if cfg.resume:
            tqdm.write(f"--resume: no complete checkpoint in {cfg.out}, starting from scratch")
        return None, None
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    for key in RESUME_MUST_MATCH:
        if state["config"][key] != getattr(cfg, key):
            raise DataError(f"--resume: {path} was written with --{key.replace('_', '-')} "
                            f"{state['config'][key]!r}, not {getattr(cfg, key)!r}")
    return path, state


def load_policy_and_reference(cfg, resume_from: str | None, device):
    """(tokenizer, policy, frozen reference). The tiny demo model is built once in OUT/tiny-init.
    A resumed run reloads the policy from its checkpoint and the reference from OUT/reference
    (written after SFT) or from the starting model; otherwise the reference is a copy of the
    policy, which SFT (if any) then overwrites."""
    name = ALIASES.get(cfg.model, cfg.model)
    if name == "tiny":
        name = os.path.join(cfg.out, "tiny-init")
        if not resume_from and parallel.rank() == 0:
            build_tiny_model(name, cfg.seed)
        parallel.barrier()  # the other processes wait until it is written
    tok, policy = load_model(resume_from or name, device, cfg.trust_remote_code)
    if not resume_from:
        return tok, policy, copy.deepcopy(policy)
    ref_path = os.path.join(cfg.out, "reference") if cfg.sft_steps else name
    return tok, policy, load_model(ref_path, device, cfg.trust_remote_code)[1]


def save_training_state(cfg, iteration: int, tok, policy, critic):
    """Checkpoint the run after `iteration`: weights, optimizers, schedules and every process's
    random state. policy, critic: ppo.Learner (critic may be None). Called on every process
    (sharded states are gathered); the first one writes."""
    learners = [policy] + ([critic] if critic is not None else [])
    optimizers = [{"optimizer": parallel.optimizer_state(learner.model, learner.optimizer),
                   "scheduler": learner.scheduler.state_dict()} for learner in learners]
    policy_weights = parallel.full_state_dict(policy.model)
    critic_weights = parallel.full_state_dict(critic.model) if critic is not None else None
    rngs = parallel.gather(rng_state())
    if parallel.rank() == 0:
        state = {"iteration": iteration, "config": dataclasses.asdict(cfg), "optimizers": optimizers, "rng": rngs}
        save_checkpoint(cfg.out, policy.model, tok, state, critic and critic.model, policy_weights=policy_weights,
                        critic_weights=critic_weights)


def restore_training_state(cfg, state: dict | None, learners: list) -> int:
    """The first iteration to run. On resume: optimizer and schedule states, this process's random
    streams, and the metrics/samples files cut back to the checkpoint. Else the files start empty."""
    paths = [os.path.join(cfg.out, name) for name in ("metrics.jsonl", "samples.jsonl")]
    if state is None:
        if parallel.rank() == 0:
            for path in paths:
                open(path, "w").close()
        return 1
    for learner, saved in zip(learners, state["optimizers"]):
        parallel.load_optimizer_state(learner.model, learner.optimizer, saved["optimizer"])
        learner.scheduler.load_state_dict(saved["scheduler"])
    start = state["iteration"] + 1
    if len(state["rng"]) == parallel.world_size():  # one random state per process
        set_rng_state(state["rng"][parallel.rank()])
    else:
        tqdm.write(f"--resume: written by {len(state['rng'])} processes, now {parallel.world_size()}: "
                   "random streams reseeded")
        torch.manual_seed(cfg.seed + parallel.rank() + 1000 * start)
    if parallel.rank() == 0:
        for path in paths:
            truncate_jsonl(path, state["iteration"])
    return start


def start_run(cfg, device, autocast):
    """Data, models (SFT warm start, frozen reference, critic) and optimizers; on --resume, all of
    it as the last checkpoint left it. Returns the learners (ppo.Learner) and the first iteration."""
    prepare_out(cfg.out)
    train_set = reward.load_problems(cfg.data, "train", seed=cfg.seed, slip=cfg.arith_slip)
    eval_set = reward.load_problems(cfg.eval_data or cfg.data, "test", seed=cfg.seed)[: cfg.eval_problems or None]
    resume_from, state = find_resume(cfg)
    tok, policy, ref = load_policy_and_reference(cfg, resume_from, device)
    if cfg.gradient_checkpointing:  # non-reentrant, so DDP and FSDP take it
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for problem in train_set + eval_set:
        problem["prompt_ids"] = reward.encode_prompt(tok, problem["question"])
    train_set = [p for p in train_set if len(p["prompt_ids"]) <= cfg.max_prompt_tokens]
    if cfg.sft_steps and not resume_from:  # the KL reference and the critic start from the SFT policy
        sft.sft_warm_start(policy, tok, train_set, steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch,
                       seed=cfg.seed, fsdp=cfg.fsdp, device=device, autocast=autocast)
        ref.load_state_dict(parallel.full_state_dict(policy))
        if parallel.rank() == 0:
            save_checkpoint(cfg.out, ref, tok, name="reference")  # resumed runs reload it
    critic = None  # PPO / TPPO: a copy of the starting policy's backbone with a value head (value.py)
    if cfg.algo in ("ppo", "tppo"):
        critic = load_critic(resume_from, device) if resume_from else \
            value.Critic(copy.deepcopy(ref.base_model), cfg.value_head).to(device)
        if cfg.gradient_checkpointing:  # a reloaded critic does not carry the setting
            critic.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ref.eval().requires_grad_(False)
    if device.type == "cuda":
        ref.to(torch.bfloat16)
    # one AdamW state and LR schedule per trained model, kept across iterations (reference pitfall 12)
    total = cfg.iterations * cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt / cfg.minibatch)
    learners = [ppo.make_learner(model, lr, total, int(cfg.warmup * total), cfg.fsdp, device)
                for model, lr in [(policy, cfg.lr), (critic, cfg.critic_lr)] if model is not None]
    start = restore_training_state(cfg, state, learners)
    return tok, train_set, eval_set, ref, learners[0], (learners[1] if critic is not None else None), start
