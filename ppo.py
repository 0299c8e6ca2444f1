"""The PPO update that every method shares, and the advantages that differ between them.

Each method gives every response token an advantage A_t, in its own way. VinePPO takes it from
MC values (vine.py). PPO and TPPO run GAE on a critic's values. GRPO uses the rewards of the
response's group. The update is then the same for all: clipped PPO with a KL penalty
(ppo_loss), on whitened advantages, by AdamW.

Read in order: the estimators (masked_whiten, gae, group_advantages, k3_kl), ppo_loss,
assign_advantages, then the update (Learner, ppo_update, minibatch_step, collate).
The update's tensors are [B, L-1], with one column per action. Column t holds token t+1's
log-prob, advantage and so on, as in rollout.py's figure.
Below the first separator line: why micro-batches and processes change no gradient.
Below the second: the optimizer step, with its guard against a non-finite gradient.
"""
import math
from dataclasses import dataclass

import torch

import rollout
import vine
import vine_cheaper
from engineering import parallel

ALGOS = ("vineppo", "ppo", "tppo", "grpo")  # the advantages assign_advantages knows


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, eps: float = 1e-8, all_reduce=lambda t: t):
    """Whiten the masked entries: (x - mean) / sqrt(var + eps), with the unbiased variance.

    With several processes, all_reduce sums the mean's and the variance's terms over them all."""
    total, n = all_reduce(torch.stack([(x * mask).sum(), mask.sum()]))
    mean = total / n.clamp(min=1)
    var = all_reduce(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """Return the advantages A of [B, T] rows by generalized advantage estimation, and A + V.

    GAE (Schulman et al. 2016, eq. 16), with V(s_T) = 0 after the last token:
        delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = delta_t + gamma lam A_{t+1}"""
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = (rewards + gamma * next_values - values) * mask
    adv, running = torch.zeros_like(values), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        running = deltas[:, t] + gamma * lam * running * mask[:, t]
        adv[:, t] = running
    return adv * mask, (adv + values) * mask


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6):
    """Return GRPO's advantage for each of N responses: its reward, normalised within its group.

    GRPO (Shao et al. 2024, arXiv 2402.03300, §4.1.2), with the population std:
        A = (R - mean of its group) / (std of its group + eps)
    The loss is ppo_loss's, a token mean over the minibatch. That is DAPO's token-level loss
    (Yu et al. 2025, arXiv 2503.14476, §3.3), not DeepSeekMath's per-response mean (§4.1,
    eq. 3). docs/reference.md says where this differs from other GRPO code."""
    adv = torch.empty_like(rewards)
    for g in group.unique():
        r = rewards[group == g]
        adv[group == g] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv


def explained_variance(values, returns, mask) -> float:
    """How much of the returns' variance the critic explains: 1 - Var(R - V) / Var(R)."""
    var = lambda x: masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    return (1 - var(returns - values) / var(returns).clamp(min=1e-8)).item()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimate of KL(pi || pi_ref) at each sampled token (never negative).

        k3 = exp(d) - d - 1,   d = log pi_ref - log pi       (DeepSeekMath, eq. 4)
    Its value estimates KL(pi || pi_ref). But as a loss on sampled tokens, its expected gradient
    is that of KL(pi_ref || pi), which is sum_x (pi - pi_ref) grad log pi. The reference and
    GRPO use k3 the same way."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def ppo_loss(logp, old_logp, ref_logp, adv, mask, clip: float = 0.2, kl_coef: float = 1e-4,
             max_ratio: float = 10.0, *, over=None):
    """Return the clipped PPO loss plus a KL penalty on the N responses given, and its stats.

    logp, old_logp, ref_logp, adv and mask are [N, L-1]. mask is 1 on the response's tokens.
    The loss is clipped PPO (Schulman et al. 2017, eq. 7) with r_t = pi / pi_old, plus the KL
    penalty of VinePPO (arXiv 2410.01679v1, §5):

        L = 1/n sum_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps)) + beta/N sum_seq sum_t k3_t

    n is the number of response tokens. Each k3_t is clamped to [0, 10].
    When the mean ratio passes max_ratio, the batch is skipped: its loss is multiplied by 0.
    A micro-batch passes `over`, the whole minibatch's (n, N), so its loss is its part of the
    minibatch's loss. On one process with no micro-batches, `over` is left out. The block below
    minibatch_step says more."""
    n_tokens, n_responses = (mask.sum().clamp(min=1), mask.shape[0]) if over is None else over
    mean = lambda x: (x * mask).sum() / n_tokens  # the token mean (of a micro-batch: its part)
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    policy_loss = mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)))
    # k3 of the response's tokens only. Elsewhere ref_logp is 0, not a log-prob, so exp(d)
    # could overflow to inf there, and inf times the mask's 0 is NaN
    k3 = (k3_kl(torch.where(mask > 0, logp, ref_logp), ref_logp) * mask).clamp(0, 10)
    kl = k3.sum(-1).sum() / n_responses
    loss = policy_loss + kl_coef * kl
    skipped = bool(masked_mean(ratio, mask) > max_ratio)
    loss = loss * 0.0 if skipped else loss
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.item(), "kl": kl.item(), "ratio": mean(ratio).item(),
                 "clipfrac": mean(((ratio - 1).abs() > clip).float()).item(),
                 "approx_kl": mean(ratio - 1 - log_ratio).item(), "skipped": float(skipped)}
    return loss, stats


def assign_advantages(algo: str, episodes, gamma: float, lam: float, lam_critic: float,
                      reuse: bool = False) -> dict:
    """Give each episode its advantages, ep.advantages [T], as `algo` computes them.

    PPO and TPPO also set ep.returns, the scalar critic's targets.
    reuse is True when the MC values were estimated with --mc-reuse.
    Returns diagnostics for the log."""
    rewards = torch.tensor([ep.reward for ep in episodes])
    if algo == "vineppo":  # step advantages broadcast to the step's tokens (VinePPO §4)
        for ep in episodes:  # --mc-reuse: the response is one more sample of V(s_{i+1})
            ep.advantages = (vine_cheaper.reuse_advantages(ep) if reuse
                             else vine.episode_advantages(ep))
        return {}
    if algo == "grpo":  # one group-normalised outcome advantage per response, on all its tokens
        adv = group_advantages(rewards, torch.tensor([ep.group for ep in episodes]))
        for ep, a in zip(episodes, adv):
            ep.advantages = torch.full((len(ep.response_ids),), a.item())
        return {}
    # ppo / tppo: GAE on the critic's values, with the reward on the last token.
    # The rows are [N, T], right-padded.
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    values = pad([ep.critic_values for ep in episodes])
    mask = pad([torch.ones(len(ep.critic_values)) for ep in episodes])
    last = mask.sum(1).long() - 1
    token_rewards = torch.zeros_like(values).index_put_((torch.arange(len(episodes)), last),
                                                        rewards)
    adv, _ = gae(token_rewards, values, mask, gamma, lam)
    _, returns = gae(token_rewards, values, mask, gamma, lam_critic)
    for i, ep in enumerate(episodes):
        ep.advantages, ep.returns = (adv[i, : len(ep.response_ids)],
                                     returns[i, : len(ep.response_ids)])
    return {"explained_variance": explained_variance(values, returns, mask)}


class Learner:
    """A model being trained, with its AdamW state and LR schedule.

    Both are kept across iterations, as in the reference, so no iteration starts afresh."""

    def __init__(self, model, lr: float, total_steps: int, warmup_steps: int, fsdp: bool, device):
        self.model = model  # the weights (saved, evaluated)
        # what the update's forward passes call. In one process it is the model itself, else
        # the DDP or FSDP wrapper. FSDP shards the model before AdamW is built.
        self.wrapped = parallel.wrap(model, fsdp, device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        schedule = lambda step: lr_factor(step, total_steps, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """The learning rate's factor at a step: a log-shaped warm-up, then linear decay to 0.

    This is DeepSpeed's WarmupDecayLR, the reference's schedule. The warm-up's first
    step is at lr x log 1 = 0. The warm-up's log is taken to base max(2, warmup)."""
    if step < warmup:
        return math.log(step + 1) / math.log(max(2, warmup))
    return max(0.0, (total - step) / max(1, total - warmup))


@dataclass(frozen=True)
class PPOSettings:
    """The update's hyper-parameters (train.py's flags of the same names)."""
    epochs: int          # passes over the iteration's episodes
    minibatch: int       # responses per optimizer step (this process's share)
    micro_batch: int     # responses per forward pass: changes no gradient
    temperature: float   # the log-probs' softmax(logits / T), as sampled
    clip: float          # PPO's epsilon
    kl_coef: float       # beta, the KL penalty's weight
    value_clip: float    # the scalar critic's value clip
    whiten: bool = True  # advantages whitened per minibatch (GRPO's are normalised already)


def ppo_update(episodes, policy: Learner, critic: Learner | None, hp: PPOSettings, *,
               move_policy: bool, pad_id: int, device, autocast) -> dict:
    """Train on the iteration's episodes: hp.epochs passes over shuffled minibatches.

    Each minibatch gives one optimizer step of the policy, and of the critic if there is one.
    With move_policy False (--critic-warmup) only the critic learns.
    Returns the minibatches' mean statistics."""
    log = parallel.UpdateLog()  # each minibatch's statistics, merged over the processes
    learners = [policy] + ([critic] if critic is not None else [])
    for learner in learners:
        learner.model.train()
    for _ in range(hp.epochs):
        order = torch.randperm(len(episodes)).tolist()
        for lo in range(0, len(order), hp.minibatch):
            batch = [episodes[i] for i in order[lo: lo + hp.minibatch]]
            minibatch_step(batch, policy if move_policy else None, critic, hp, pad_id, device,
                           autocast, log)
    for learner in learners:
        learner.model.eval()  # sampling and scoring see no dropout
    return log.summary()


def minibatch_step(batch, policy, critic, hp: PPOSettings, pad_id: int, device, autocast,
                   log) -> None:
    """One minibatch: the loss's backward pass, then a step of each learner.

    The minibatch runs as micro-batches of hp.micro_batch responses. Their gradients add up to
    the whole minibatch's gradient, as the block below explains. With policy None, the policy
    does not move."""
    ids, mask, fields = collate(batch, pad_id, device)
    if hp.whiten:  # with the statistics of the whole minibatch, all processes' rows together
        fields["advantages"] = masked_whiten(fields["advantages"], fields["action_mask"],
                                             all_reduce=parallel.all_reduce_sum)
    counts = minibatch_counts(fields, critic)
    policy_parts, critic_parts = [], []
    for m in range(0, len(batch), hp.micro_batch):
        rows = slice(m, m + hp.micro_batch)
        micro = {key: value[rows] for key, value in fields.items()}
        if policy is not None:
            with autocast:
                logp, _ = rollout.token_logprobs(policy.wrapped, ids[rows], mask[rows],
                                                 hp.temperature)
            loss, stats = ppo_loss(logp, micro["old_logp"], micro["ref_logp"],
                                   micro["advantages"], micro["action_mask"], hp.clip,
                                   hp.kl_coef, over=counts["policy"])
            log.skipped_batches += stats["skipped"]
            backward_part(loss, stats, policy_parts)
        if critic is not None:
            with autocast:
                out = critic.wrapped(ids[rows], mask[rows], micro["prompt_lens"])
            loss, stats = critic.model.loss(out, micro["critic_values"], micro["returns"],
                                            micro["reward"], micro["action_mask"], hp.value_clip,
                                            n=counts["critic"])
            backward_part(loss, stats, critic_parts)
    log.minibatch(policy_parts, critic_parts, device)
    for learner in [x for x in (policy, critic) if x is not None]:
        log.stepped(optimizer_step(learner.model, learner.optimizer, learner.scheduler),
                    learner is policy)


def collate(episodes, pad_id, device):
    """Pad the episodes into one batch: ids [B, L], their mask, and per-token fields [B, L-1].

    Column t of a field belongs to token t+1, the token whose log-prob is there.
    Response token j is at column P-1+j, as in rollout.py's figure. action_mask is 1 there.
    old_logp, ref_logp, advantages, ... hold the episode's [T] values there, and 0 elsewhere."""
    ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in episodes],
                                  pad_id, device)
    names = ("old_logp", "ref_logp", "advantages", "critic_values", "returns")
    out = {k: torch.zeros(len(episodes), ids.shape[1] - 1, device=device)
           for k in ("action_mask", *names)}
    for i, ep in enumerate(episodes):
        actions = rollout.response_columns(ep)
        out["action_mask"][i, actions] = 1
        for name in names:
            if getattr(ep, name) is not None:
                out[name][i, actions] = getattr(ep, name).to(device)
    out["reward"] = torch.tensor([ep.reward for ep in episodes], device=device)
    out["prompt_lens"] = torch.tensor([len(ep.prompt_ids) for ep in episodes], device=device)
    return ids, mask, out


# ---- micro-batches and processes change no gradient (a first reading may skip this) ------------
# The losses are means over the whole minibatch. The minibatch may run as micro-batches
# (--micro-batch), and on W processes (torchrun), each process with its own rows. Then:
# - Each micro-batch's loss is its part of the mean: its sum, divided by the whole minibatch's
#   counts over all processes (minibatch_counts). ppo_loss gets them as `over`, Critic.loss as `n`.
# - Over the micro-batches, the parts' gradients add up to the minibatch's gradient.
# - DDP and FSDP average the W processes' gradients. So each part's backward is of W x the part.
# So --micro-batch and W change no gradient. The one exception: ppo_loss skips rows whose mean
# ratio passes max_ratio, decided per micro-batch. Checked to 6 digits by test_precision.py.

def minibatch_counts(fields: dict, critic) -> dict:
    """The counts the minibatch's losses divide by, summed over the processes.

    "policy" holds ppo_loss's (n, N), its response tokens and responses.
    "critic" holds the number of the critic's loss terms (Critic.loss_mask)."""
    act = fields["action_mask"]
    terms = critic.model.loss_mask(act).sum() if critic is not None else act.new_zeros(())
    total = parallel.all_reduce_sum(torch.stack([act.sum(), act.new_tensor(float(act.shape[0])),
                                                 terms]))
    tokens, responses, critic_terms = total.clamp(min=1)
    return {"policy": (tokens, responses), "critic": critic_terms}


def backward_part(loss, stats: dict, into: list):
    """Run backward on a micro-batch's part of the minibatch's loss, times the process count.

    Its stats are kept when the loss is finite. A non-finite loss runs backward too, because
    under DDP every process must. The gradient norm then turns non-finite, and optimizer_step
    skips the step."""
    if torch.isfinite(loss):
        into.append(stats)
    (loss * parallel.world_size()).backward()


# ---- engineering: the optimizer step (skip on a first reading) ---------------------------------

def optimizer_step(model, optim, scheduler=None, max_norm: float = 1.0) -> float | None:
    """Clip the gradient norm and step.

    Returns the norm, or None when it is not finite and the step is skipped."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    if math.isfinite(norm):
        optim.step()
        if scheduler is not None:
            scheduler.step()
    optim.zero_grad()
    return norm if math.isfinite(norm) else None
