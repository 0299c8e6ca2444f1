"""The PPO update every method shares (clipped surrogate, k3 KL, whitening) and the advantages that
differ: GAE for a critic, group normalisation for GRPO, VinePPO's MC values (vine.py). Tensors are
[B, L-1], aligned with the actions: position t holds token t+1's log-prob, advantage, ..., as in the
reference implementation (McGill-NLP/VinePPO, https://github.com/McGill-NLP/VinePPO:
src/treetune/trainers/ppo_trainer.py, PPOTrainer._training_step; "the reference" in the comments of
every file).

Needs: vine.py (VinePPO's step advantages), rollout.py (padding, log-probs), parallel.py (the
minibatch's statistics over processes). Algorithm: everything up to ppo_update; its helpers after
the engineering line."""
import collections
import math

import torch

import parallel
import rollout
import vine

ALGOS = ("vineppo", "ppo", "tppo", "grpo")  # the advantages assign_advantages knows
# logged per minibatch, then averaged
POLICY_STATS = ("kl", "policy_loss", "clipfrac", "approx_kl", "ratio")
CRITIC_STATS = ("value_loss", "value_clipfrac")


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, eps: float = 1e-8, all_reduce=lambda t: t):
    """(x - mean) / sqrt(var + eps) over the masked entries of all processes, unbiased var (the
    reference's masked_whiten in trainers/utils.py, as PPOTrainer._training_step calls it:
    distributed, unbiased)."""
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
    """GRPO (Shao et al. 2024, §4.1.2): A = (R - mean of its group) / (std of its group + eps); [N].
    Its loss here is ppo_loss's: a token mean over the minibatch under PPO's clip, DAPO's
    token-level loss (Yu et al. 2025, arXiv 2503.14476, §3.3), not DeepSeekMath's per-response mean
    1/G sum_i 1/|o_i| sum_t (arXiv 2402.03300, §4.1, eq. 3), which gives a short response's tokens
    more weight than a long one's."""
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
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1,
    d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def ppo_loss(logp, old_logp, ref_logp, adv, mask, clip: float = 0.2, kl_coef: float = 1e-4,
             max_ratio: float = 10.0, *, n_tokens=None, n_responses=None):
    """Clipped PPO (Schulman et al. 2017, eq. 7) plus the KL penalty (VinePPO §5),
    r_t = pi / pi_old, on a minibatch of N responses holding n response tokens:
        L = 1/n sum_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps))
            + beta/N sum_seq sum_t clamp(k3_t, 0, 10)
    The rows given may be a micro-batch (n_tokens, n_responses: the minibatch's n and N, over all
    processes; default: these rows' own): loss and stats are then its shares, which add up to the
    minibatch's whatever the split. Rows whose mean ratio exceeds max_ratio are skipped (loss x 0),
    as the reference's PPOTrainer._compute_actor_loss skips its batch. -> (loss, stats)"""
    n_tokens = mask.sum().clamp(min=1) if n_tokens is None else n_tokens
    n_responses = mask.shape[0] if n_responses is None else n_responses
    # this batch's share of the minibatch's token mean
    total = lambda x: (x * mask).sum() / n_tokens
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    pg_loss = total(torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)))
    kl = (k3_kl(logp, ref_logp) * mask).clamp(0, 10).sum(-1).sum() / n_responses
    loss = pg_loss + kl_coef * kl
    skipped = bool(masked_mean(ratio, mask) > max_ratio)
    loss = loss * 0.0 if skipped else loss
    with torch.no_grad():
        stats = {"policy_loss": pg_loss.item(), "kl": kl.item(), "ratio": total(ratio).item(),
                 "clipfrac": total(((ratio - 1).abs() > clip).float()).item(),
                 "approx_kl": total(ratio - 1 - log_ratio).item(), "skipped": float(skipped)}
    return loss, stats


def assign_advantages(algo: str, episodes, gamma: float, lam: float, lam_critic: float) -> dict:
    """Set ep.advantages ([T]) as `algo` computes them and, for a critic, ep.returns;
    returns diagnostics."""
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
    # [N, T], right-padded
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
    """A trained model, with the AdamW state and LR schedule it keeps across iterations (as the
    reference's PPOTrainer.step reloads its engines' checkpoint every iteration): never a fresh
    optimizer per iteration."""

    def __init__(self, model, lr: float, total_steps: int, warmup_steps: int, fsdp: bool, device):
        self.model = model  # the weights (saved, evaluated)
        # what the update calls (DDP); FSDP: before AdamW
        self.module = parallel.wrap(model, fsdp, device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        schedule = lambda step: lr_factor(step, total_steps, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """DeepSpeed's WarmupDecayLR (the reference's): log-shaped warm-up over >= 2 steps,
    linear decay to 0."""
    if step < warmup:
        return math.log(step + 1) / math.log(max(2, warmup))
    return max(0.0, (total - step) / max(1, total - warmup))


def ppo_update(episodes, policy: Learner, critic: Learner | None, *, epochs: int, minibatch: int,
               micro_batch: int, temperature: float, clip: float, kl_coef: float, value_clip: float,
               move_policy: bool, whiten: bool, pad_id: int, device, autocast) -> dict:
    """`epochs` passes over shuffled minibatches, a step per minibatch and learner; returns mean
    statistics. Each loss is a mean over the whole minibatch (all its micro-batches, all processes):
    a micro-batch adds its sum over the minibatch's count, so --micro-batch and the number of
    processes change no gradient."""
    policy_stats, critic_stats, grad_norms, counts = [], [], [], collections.Counter()
    learners = [policy] + ([critic] if critic is not None else [])
    for learner in learners:
        learner.model.train()
    for _ in range(epochs):
        order = torch.randperm(len(episodes)).tolist()
        for lo in range(0, len(order), minibatch):
            batch = [episodes[i] for i in order[lo: lo + minibatch]]
            ids, mask, fields = collate(batch, pad_id, device)
            if whiten:  # with the statistics of the whole minibatch, all processes' shares together
                fields["adv"] = masked_whiten(fields["adv"], fields["act"],
                                              all_reduce=parallel.all_reduce_sum)
            n = minibatch_counts(fields, critic)
            policy_shares, critic_shares = [], []
            for m in range(0, len(batch), micro_batch):
                rows = slice(m, m + micro_batch)
                micro = {k: v[rows] for k, v in fields.items()}
                if move_policy:
                    with autocast:
                        logp, _ = rollout.token_logprobs(policy.module, ids[rows], mask[rows],
                                                         temperature)
                    loss, stats = ppo_loss(logp, micro["old"], micro["ref"], micro["adv"],
                                           micro["act"], clip, kl_coef, n_tokens=n["tokens"],
                                           n_responses=n["responses"])
                    counts["nonfinite"] += backward_if_finite(loss, stats, policy_shares)
                    counts["skipped"] += stats["skipped"]
                if critic is not None:
                    with autocast:
                        out = critic.module(ids[rows], mask[rows], micro["prompt_lens"])
                    loss, stats = critic.model.loss(out, micro["val"], micro["ret"],
                                                    micro["reward"], micro["act"], value_clip,
                                                    n=n["critic"])
                    counts["nonfinite"] += backward_if_finite(loss, stats, critic_shares)
            if move_policy:
                policy_stats.append(minibatch_stats(policy_shares, POLICY_STATS, device))
            if critic is not None:
                critic_stats.append(minibatch_stats(critic_shares, CRITIC_STATS, device))
            # --critic-warmup: the critic only
            for learner in learners if move_policy else learners[1:]:
                norm = optimizer_step(learner.model, learner.optimizer, learner.scheduler)
                # every process holds the same norm: the first counts a skipped step
                counts["nonfinite"] += norm is None and parallel.rank() == 0
                if learner is policy and norm is not None:
                    grad_norms.append(norm)
    for learner in learners:
        learner.model.eval()  # sampling and scoring see no dropout
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    out = {k: mean(policy_stats, k) for k in POLICY_STATS if policy_stats}
    out.update({k: mean(critic_stats, k) for k in CRITIC_STATS if critic_stats})
    return {**out, "skipped_batches": int(counts["skipped"]),
            "nonfinite_skips": int(counts["nonfinite"]),
            "grad_norm": sum(grad_norms) / max(1, len(grad_norms))}


# ---- engineering: non-finite guards, batching, the optimizer step (skip on a first reading) ------

def minibatch_counts(fields: dict, critic) -> dict:
    """What the minibatch's losses average over, summed over the processes: its response tokens, its
    responses, and the critic's terms (its loss_mask: tokens, or the BCE heads' states s_0..s_T)."""
    act = fields["act"]
    terms = critic.model.loss_mask(act).sum() if critic is not None else act.new_zeros(())
    total = parallel.all_reduce_sum(torch.stack([act.sum(), act.new_tensor(float(act.shape[0])),
                                                 terms]))
    tokens, responses, critic_terms = total.clamp(min=1)
    return {"tokens": tokens, "responses": responses, "critic": critic_terms}


def minibatch_stats(shares: list[dict], keys, device) -> dict:
    """The minibatch's statistics: its micro-batches' shares summed, over all processes too, so
    every process logs the whole minibatch's (a non-finite micro-batch's share is left out)."""
    sums = torch.tensor([sum(s[k] for s in shares) for k in keys], dtype=torch.float64,
                        device=device)
    return dict(zip(keys, parallel.all_reduce_sum(sums).tolist()))


def backward_if_finite(loss, stats: dict, into: list) -> bool:
    """Backward of a finite loss (its stats kept); True for a non-finite loss skipped. Under DDP
    every process must run backward: it runs, the gradient norm turns NaN and ppo_update counts the
    skipped step once."""
    finite = bool(torch.isfinite(loss))
    if finite:
        into.append(stats)
    if finite or parallel.world_size() > 1:
        # DDP and FSDP average the processes' gradients:
        # x world size turns them into the minibatch's mean
        (loss * parallel.world_size()).backward()
    return not finite and parallel.world_size() == 1


def collate(episodes, pad_id, device):
    """Padded ids [B, L], mask, and [B, L-1] action mask "act"
    and per-token arrays of the episodes."""
    ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in episodes],
                                  pad_id, device)
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
    """Clip the gradient norm and step;
    the norm, or None when it is not finite and the step is skipped."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    if math.isfinite(norm):
        optim.step()
        if scheduler is not None:
            scheduler.step()
    optim.zero_grad()
    return norm if math.isfinite(norm) else None
