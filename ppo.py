"""The PPO update every method shares (clipped surrogate, k3 KL, whitening) and the advantages that differ:
GAE for a critic, group normalisation for GRPO, VinePPO's MC values (vine.py). Tensors are [B, L-1],
aligned with the actions: position t holds token t+1's log-prob, advantage, ... (reference pitfall 6).

Needs: vine.py (VinePPO's step advantages), rollout.py (padding, log-probs), parallel.py (the minibatch's
statistics over processes). Algorithm: everything up to ppo_update; its helpers after the engineering line."""
import math

import torch

import parallel
import rollout
import vine

ALGOS = ("vineppo", "ppo", "tppo", "grpo")  # the advantages assign_advantages knows


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, eps: float = 1e-8, all_reduce=lambda t: t):
    """(x - mean) / sqrt(var + eps) over the masked entries of all processes (reference §2.6), unbiased var."""
    total, n = all_reduce(torch.stack([(x * mask).sum(), mask.sum()]))
    mean = total / n.clamp(min=1)
    var = all_reduce(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """GAE (Schulman et al. 2016, eq. 16) on [B, T], V(s_T) = 0: -> (advantages, returns = A + V)
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
    """GRPO (Shao et al. 2024, §4.1.2): A = (R - mean of its group) / (std of its group + eps); [N]."""
    adv = torch.empty_like(rewards)
    for g in group.unique():
        r = rewards[group == g]
        adv[group == g] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv


def explained_variance(values, returns, mask) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked entries (CleanRL's diagnostic)."""
    var = lambda x: masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    return (1 - var(returns - values) / var(returns).clamp(min=1e-8)).item()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def ppo_loss(logp, old_logp, ref_logp, adv, mask, clip: float = 0.2, kl_coef: float = 1e-4,
             max_ratio: float = 10.0):
    """Clipped PPO (Schulman et al. 2017, eq. 7) plus the KL penalty (VinePPO §5), r_t = pi / pi_old:
        L = mean_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps)) + beta * mean_seq sum_t clamp(k3_t, 0, 10)
    A batch whose mean ratio exceeds max_ratio is skipped (loss x 0), as in the reference. -> (loss, stats)"""
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)), mask)
    kl = (k3_kl(logp, ref_logp) * mask).clamp(0, 10).sum(-1).mean()
    loss = pg_loss + kl_coef * kl
    mean_ratio = masked_mean(ratio, mask)
    skipped = bool(mean_ratio > max_ratio)
    loss = loss * 0.0 if skipped else loss
    with torch.no_grad():
        stats = {"policy_loss": pg_loss.item(), "kl": kl.item(), "ratio": mean_ratio.item(),
                 "clipfrac": masked_mean(((ratio - 1).abs() > clip).float(), mask).item(),
                 "approx_kl": masked_mean(ratio - 1 - log_ratio, mask).item(), "skipped": float(skipped)}
    return loss, stats


def assign_advantages(algo: str, episodes, gamma: float, lam: float, lam_critic: float) -> dict:
    """Set ep.advantages ([T]) as `algo` computes them and, for a critic, ep.returns; returns diagnostics."""
    rewards = torch.tensor([ep.reward for ep in episodes])
    if algo == "vineppo":  # step advantages broadcast to the step's tokens (VinePPO §4)
        for ep in episodes:
            ep.advantages = vine.episode_advantages(ep)
        return {}
    if algo == "grpo":  # one group-normalised outcome advantage per response, on all its tokens
        adv = group_advantages(rewards, torch.tensor([ep.group for ep in episodes]))
        for ep, a in zip(episodes, adv):
            ep.advantages = torch.full((len(ep.response_ids),), a.item())
        return {}
    # ppo / tppo: GAE on the critic's values, the reward on the last token
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [N, T], right-padded
    values = pad([ep.critic_values for ep in episodes])
    mask = pad([torch.ones(len(ep.critic_values)) for ep in episodes])
    last = mask.sum(1).long() - 1
    token_rewards = torch.zeros_like(values).index_put_((torch.arange(len(episodes)), last), rewards)
    adv, _ = gae(token_rewards, values, mask, gamma, lam)
    _, returns = gae(token_rewards, values, mask, gamma, lam_critic)
    for i, ep in enumerate(episodes):
        ep.advantages, ep.returns = adv[i, : len(ep.response_ids)], returns[i, : len(ep.response_ids)]
    return {"explained_variance": explained_variance(values, returns, mask)}


class Learner:
    """A trained model, with the AdamW state and LR schedule it keeps across iterations (ref. pitfall 12)."""

    def __init__(self, model, lr: float, total_steps: int, warmup_steps: int, fsdp: bool, device):
        self.model = model  # the weights (saved, evaluated)
        self.module = parallel.wrap(model, fsdp, device)  # what the update calls (DDP); FSDP: before AdamW
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        schedule = lambda step: lr_factor(step, total_steps, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """DeepSpeed's WarmupDecayLR (the reference's): log-shaped warm-up over >= 2 steps, linear decay to 0."""
    if step < warmup:
        return math.log(step + 1) / math.log(max(2, warmup))
    return max(0.0, (total - step) / max(1, total - warmup))


def ppo_update(episodes, policy: Learner, critic: Learner | None, *, epochs: int, minibatch: int,
               micro_batch: int, temperature: float, clip: float, kl_coef: float, value_clip: float,
               move_policy: bool, whiten: bool, pad_id: int, device, autocast) -> dict:
    """`epochs` passes over shuffled minibatches, a step per minibatch and learner; returns mean statistics."""
    policy_stats, critic_stats, grad_norms, nonfinite = [], [], [], 0
    learners = [policy] + ([critic] if critic is not None else [])
    for learner in learners:
        learner.model.train()
    for _ in range(epochs):
        order = torch.randperm(len(episodes)).tolist()
        for lo in range(0, len(order), minibatch):
            batch = [episodes[i] for i in order[lo: lo + minibatch]]
            ids, mask, fields = collate(batch, pad_id, device)
            if whiten:  # with the statistics of the whole minibatch, all processes' shares together
                fields["adv"] = masked_whiten(fields["adv"], fields["act"], all_reduce=parallel.all_reduce_sum)
            for m in range(0, len(batch), micro_batch):
                rows, share = slice(m, m + micro_batch), ids[m: m + micro_batch].shape[0] / len(batch)
                micro = {k: v[rows] for k, v in fields.items()}
                if move_policy:
                    with autocast:
                        logp, _ = rollout.token_logprobs(policy.module, ids[rows], mask[rows], temperature)
                    loss, stats = ppo_loss(logp, micro["old"], micro["ref"], micro["adv"], micro["act"],
                                           clip, kl_coef)
                    nonfinite += backward_if_finite(loss * share, stats, policy_stats)
                if critic is not None:
                    with autocast:
                        out = critic.module(ids[rows], mask[rows], micro["prompt_lens"])
                    loss, stats = critic.model.loss(out, micro["val"], micro["ret"], micro["reward"],
                                                    micro["act"], value_clip)
                    nonfinite += backward_if_finite(loss * share, stats, critic_stats)
            for learner in learners if move_policy else learners[1:]:  # --critic-warmup: the critic only
                norm = optimizer_step(learner.model, learner.optimizer, learner.scheduler)
                nonfinite += norm is None
                if learner is policy and norm is not None:
                    grad_norms.append(norm)
    for learner in learners:
        learner.model.eval()  # sampling and scoring see no dropout
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    out = {k: mean(policy_stats, k) for k in ("kl", "policy_loss", "clipfrac", "approx_kl", "ratio")
           if policy_stats}
    out.update({k: mean(critic_stats, k) for k in ("value_loss", "value_clipfrac") if critic_stats})
    return {**out, "skipped_batches": int(sum(s["skipped"] for s in policy_stats)),
            "nonfinite_skips": nonfinite, "grad_norm": sum(grad_norms) / max(1, len(grad_norms))}


# ---- engineering: non-finite guards, batching, the optimizer step (skip on a first reading) ------------

def backward_if_finite(loss, stats: dict, into: list) -> bool:
    """Backward of a finite loss (its stats kept), else True; under DDP it runs: a NaN norm skips the step."""
    finite = bool(torch.isfinite(loss))
    if finite:
        into.append(stats)
    if finite or parallel.world_size() > 1:
        loss.backward()
    return not finite


def collate(episodes, pad_id, device):
    """Padded ids [B, L], mask, and [B, L-1] action mask "act" and per-token arrays of the episodes."""
    ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in episodes], pad_id, device)
    names = {"old": "old_logp", "ref": "ref_logp", "adv": "advantages", "val": "critic_values",
             "ret": "returns"}
    out = {k: torch.zeros(len(episodes), ids.shape[1] - 1, device=device) for k in ["act", *names]}
    for i, ep in enumerate(episodes):
        actions = slice(len(ep.prompt_ids) - 1, len(ep.prompt_ids) - 1 + len(ep.response_ids))
        out["act"][i, actions] = 1
        for k, name in names.items():
            if getattr(ep, name) is not None:
                out[k][i, actions] = getattr(ep, name).to(device)
    out["reward"] = torch.tensor([ep.reward for ep in episodes], device=device)
    out["prompt_lens"] = torch.tensor([len(ep.prompt_ids) for ep in episodes], device=device)
    return ids, mask, out


def optimizer_step(model, optim, scheduler=None, max_norm: float = 1.0) -> float | None:
    """Clip the gradient norm and step; the norm, or None when it is not finite and the step is skipped."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    if math.isfinite(norm):
        optim.step()
        if scheduler is not None:
            scheduler.step()
    optim.zero_grad()
    return norm if math.isfinite(norm) else None
