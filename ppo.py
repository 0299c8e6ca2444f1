"""The PPO update shared by every method here (clipped surrogate, k3 KL to a reference,
whitening) and the advantage estimators that differ between them: GAE for a critic, group
normalisation for GRPO. VinePPO's Monte Carlo advantages are in vine.py.

Shapes: every tensor is [B, L-1], aligned with the actions: position t holds the log-prob,
advantage, ... of token t+1 (reference pitfall 6); `mask` is 1 on response tokens.
"""
import math

import torch

import rollout


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, eps: float = 1e-8, all_reduce=lambda t: t):
    """(x - mean) / sqrt(var + eps) over the masked entries, unbiased variance (reference §2.6).
    all_reduce sums a tensor over processes, so that several processes whiten their shares of
    one minibatch with its global statistics (as the reference does across GPUs)."""
    total, n = all_reduce(torch.stack([(x * mask).sum(), mask.sum()]))
    mean = total / n.clamp(min=1)
    var = all_reduce(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16); all [B, T] and
    right-padded. values[:, t] = V(s_t), the state before action t; the value after the last
    action is 0 (terminal):
        delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = delta_t + gamma lam A_{t+1}
    With gamma = lam = 1 and the reward R on the last token, A_t = R - V(s_t).
    Returns (advantages, returns = advantages + values, the critic's regression target)."""
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = (rewards + gamma * next_values - values) * mask
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        running = deltas[:, t] + gamma * lam * running * mask[:, t]
        adv[:, t] = running
    return adv * mask, (adv + values) * mask


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6):
    """GRPO (Shao et al. 2024, §4.1.2): A = (R - mean of its group) / (std of its group + eps),
    one scalar per response, the group being the samples of one prompt. rewards, group: [N]."""
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
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp.
    Unbiased for samples from pi, always >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def ppo_loss(logp, old_logp, ref_logp, adv, mask, clip: float = 0.2, kl_coef: float = 1e-4,
             max_ratio: float = 10.0):
    """Clipped PPO objective (Schulman et al. 2017, eq. 7) as a token-level masked mean, plus the
    KL penalty inside the loss (VinePPO §5 / reference §2.5):

        L = mean_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps)) + beta * mean_seq sum_t clamp(k3_t, 0, 10)

    with r_t = pi(a_t|s_t) / pi_old(a_t|s_t). When the mean ratio exceeds max_ratio the batch is
    skipped (loss x 0), as the reference does. Returns (loss, stats)."""
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    pg_loss = masked_mean(pg, mask)
    kl = (k3_kl(logp, ref_logp) * mask).clamp(0, 10).sum(-1).mean()
    loss = pg_loss + kl_coef * kl
    mean_ratio = masked_mean(ratio, mask)
    skipped = bool(mean_ratio > max_ratio)
    if skipped:
        loss = loss * 0.0
    with torch.no_grad():
        stats = {"policy_loss": pg_loss.item(), "kl": kl.item(), "ratio": mean_ratio.item(),
                 "clipfrac": masked_mean(((ratio - 1).abs() > clip).float(), mask).item(),
                 "approx_kl": masked_mean(ratio - 1 - log_ratio, mask).item(), "skipped": float(skipped)}
    return loss, stats


# ---- batching and stepping the update ----

def collate(episodes, pad_id, device):
    """Right-padded ids [B, L], attention mask, and [B, L-1] action-aligned tensors: action mask
    "act" and the episodes' per-token arrays (old/ref log-probs, advantages, critic values, returns)."""
    ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in episodes], pad_id, device)
    fields = {"old": "old_logp", "ref": "ref_logp", "adv": "advantages", "val": "old_values", "ret": "returns"}
    out = {k: torch.zeros(len(episodes), ids.shape[1] - 1, device=device) for k in ["act", *fields]}
    for i, ep in enumerate(episodes):
        s = slice(len(ep.prompt_ids) - 1, len(ep.prompt_ids) - 1 + len(ep.response_ids))
        out["act"][i, s] = 1
        for k, name in fields.items():
            if getattr(ep, name) is not None:
                out[k][i, s] = getattr(ep, name).to(device)
    out["reward"] = torch.tensor([ep.reward for ep in episodes], device=device)
    out["prompt_lens"] = torch.tensor([len(ep.prompt_ids) for ep in episodes], device=device)
    return ids, mask, out


def padded(rows: list[torch.Tensor]):
    """[N, T] right-padded stack of 1-D tensors and its mask."""
    mask = [torch.ones(len(r)) for r in rows]
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(rows, batch_first=True), pad(mask, batch_first=True)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """DeepSpeed WarmupDecayLR as the reference runs it: log-shaped warm-up, then linear decay to 0."""
    if step < warmup:
        return math.log(step + 1) / math.log(warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def optimizer_step(model, optim, scheduler, max_norm: float = 1.0) -> float | None:
    """Clip the gradient norm to max_norm and step. A non-finite gradient skips the step and
    keeps the weights as they were; returns the norm, or None when skipped."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    if math.isfinite(norm):
        optim.step()
        scheduler.step()
    optim.zero_grad()
    return norm if math.isfinite(norm) else None
