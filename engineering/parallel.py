"""Several processes under torchrun (DDP, or FSDP2 with --fsdp); in one process, identities and
plain calls. Also the update's statistics (ppo.py: a minibatch's, merged over the processes)
and an iteration's metrics row, merged over the processes and logged by the first.
Needs no sibling. All engineering: a first reading may skip this file (and every line that
mentions it)."""
import json
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm


def init(device: torch.device):
    """(rank, world size, device); under torchrun, joins the process group
    (NCCL on GPUs, else gloo)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # others wait while the first writes a checkpoint (~26 GB for PPO at 1.1B):
        # 10 minutes can be too few
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(minutes=60),
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def close():
    if dist.is_initialized():
        # no process tears its connections down while another still writes its checkpoint
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def merge_metrics(rows: list[tuple[dict, dict, dict]]) -> dict:
    """One metrics row from every process's (counts, means, times):
    summed, averaged, the slowest's."""
    counts, means, times = rows[0]
    merged = {k: sum(r[0][k] for r in rows) for k in counts}
    for k in means:
        vals = [r[1][k] for r in rows]
        merged[k] = vals[0] if len(set(vals)) == 1 else sum(vals) / len(vals)
    merged.update({k: max(r[2][k] for r in rows) for k in times})
    return merged


def wrap(model, fsdp: bool, device):
    """What the update calls: DDP around the model, or the model sharded in place (fsdp);
    optimizers after."""
    if not dist.is_initialized() or isinstance(model, FSDPModule):
        return model
    if not fsdp:
        return DistributedDataParallel(model,
                                       device_ids=[device.index] if device.type == "cuda" else None)
    for layer in model.modules():
        if type(layer).__name__.endswith("DecoderLayer"):
            fully_shard(layer)
    fully_shard(model)
    return model


@contextmanager
def unsharded(*models):
    """FSDP: full weights while processes run different numbers of forward passes
    (no all-gathers)."""
    shards = [m for model in models if model is not None for m in model.modules()
              if isinstance(m, FSDPModule)]
    for m in shards:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in shards:
            m.reshard()
            m.set_reshard_after_forward(True)


def full_state_dict(model) -> dict:
    """The whole model's weights on every process (an FSDP model's shards gathered)."""
    if isinstance(model, FSDPModule):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return model.state_dict()


def optimizer_state(model, optim) -> dict:
    """What --resume needs of an optimizer; for FSDP the full state,
    gathered on the first process."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optim, options=options)
    return optim.state_dict()


def load_optimizer_state(model, optim, saved: dict):
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optim, saved, options=options)
    else:
        optim.load_state_dict(saved)


# ---- PPO's update: each minibatch's statistics, merged over the processes ----------------------


# logged per minibatch, then averaged over the iteration
POLICY_STATS = ("kl", "policy_loss", "clipfrac", "approx_kl", "ratio")
CRITIC_STATS = ("value_loss", "value_clipfrac")


@dataclass
class UpdateLog:
    """What ppo.ppo_update reports: each minibatch's statistics, and the steps it skipped."""
    policy: list = field(default_factory=list)  # one dict of POLICY_STATS per minibatch
    critic: list = field(default_factory=list)  # one dict of CRITIC_STATS per minibatch
    grad_norms: list = field(default_factory=list)  # the policy's, before clipping
    skipped_batches: float = 0  # micro-batches whose ratio exceeded max_ratio (ppo_loss)
    nonfinite_skips: int = 0    # steps skipped for a non-finite loss or gradient norm

    def minibatch(self, policy_parts: list[dict], critic_parts: list[dict], device):
        """Record a minibatch's statistics: its micro-batches' parts summed, over all processes
        too, so every process logs the whole minibatch's (a non-finite part is left out)."""
        for parts, keys, into in ((policy_parts, POLICY_STATS, self.policy),
                                  (critic_parts, CRITIC_STATS, self.critic)):
            if parts:
                sums = torch.tensor([sum(s[k] for s in parts) for k in keys],
                                    dtype=torch.float64, device=device)
                into.append(dict(zip(keys, all_reduce_sum(sums).tolist())))

    def stepped(self, norm: float | None, is_policy: bool):
        """Record a learner's step: its gradient norm, or None for a step skipped."""
        # every process holds the same norm: the first counts a skipped step
        self.nonfinite_skips += norm is None and rank() == 0
        if is_policy and norm is not None:
            self.grad_norms.append(norm)

    def summary(self) -> dict:
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
        out = {k: mean(self.policy, k) for k in POLICY_STATS if self.policy}
        out.update({k: mean(self.critic, k) for k in CRITIC_STATS if self.critic})
        return {**out, "skipped_batches": int(self.skipped_batches),
                "nonfinite_skips": int(self.nonfinite_skips),
                "grad_norm": sum(self.grad_norms) / max(1, len(self.grad_norms))}


# ---- an iteration's metrics row: merged over the processes, logged by the first ------------------

# their sum: `seconds`, what compare.py's equal wall-clock counts
TRAINING = ("time_rollout", "time_logprobs", "time_mc_values", "time_critic_values",
            "time_advantages", "time_reference", "time_update")
# time_save: the previous iteration's log and checkpoint
PHASES = (*TRAINING, "time_eval", "time_save")


class Stopwatch(dict):
    """The seconds of each phase of one iteration, the time_* metrics.

    A lap starts where the one before it ended (the first where the stopwatch started), and
    `with watch.lap(phase):` ends one with its block, adding its seconds to phase. So every
    second of the iteration counts to one phase. time_save holds the previous iteration's
    seconds after its last lap (its row and checkpoint)."""

    def __init__(self, previous=None, autocast=None):
        super().__init__(dict.fromkeys(PHASES, 0.0))
        self.autocast = autocast or nullcontext()  # bf16 autocast, or nothing
        self.began = self.last = time.time()
        if previous is not None:
            self["time_save"] = self.began - previous.last

    @contextmanager
    def lap(self, phase: str):
        yield
        now = time.time()
        self[phase] += now - self.last
        self.last = now

    @contextmanager
    def phase(self, name: str, *models):
        """A lap of train.main's loop. Given models, it runs them under autocast, and whole
        under FSDP (unsharded)."""
        with self.lap(name), (self.autocast if models else nullcontext()), unsharded(*models):
            yield


def iteration_metrics(episodes, stats: dict, diagnostics: dict, mc_counts: dict, policy,
                      watch) -> dict:
    """One metrics row: counts summed over processes, means averaged,
    times of the slowest process."""
    n_tokens = sum(len(ep.response_ids) for ep in episodes)
    counts = {k: stats.pop(k) for k in ("skipped_batches", "nonfinite_skips")}
    counts.update(prompts=len({ep.group for ep in episodes}), episodes=len(episodes),
                  mc_states=mc_counts["mc_states"], mc_continuations=mc_counts["mc_continuations"],
                  mc_tokens=mc_counts["mc_tokens"],
                  tokens_generated=n_tokens + mc_counts["mc_tokens"])
    means = {"train_reward": sum(ep.reward for ep in episodes) / len(episodes), **stats,
             "response_tokens": n_tokens / len(episodes), "lr": policy.scheduler.get_last_lr()[0],
             # the advantages' spread before the update whitens them (this process's tokens)
             "advantage_std":
                 torch.cat([ep.advantages for ep in episodes]).std(correction=0).item(),
             **diagnostics}
    times = {**watch, "seconds": sum(watch[phase] for phase in TRAINING)}
    return merge_metrics(gather((counts, means, times)))


def log(out: str, row: dict):
    """The first process appends the row to metrics.jsonl and prints it."""
    if rank() == 0:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
        tqdm.write(" ".join(shown))
        if row.get("nonfinite_skips"):
            tqdm.write(f"warning: iteration {row['iteration']}: {row['nonfinite_skips']} "
                       "steps skipped for a non-finite loss or gradient")

