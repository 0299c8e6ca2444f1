"""The PPO update every method shares, and the advantages that differ between them.

- the update: clipped surrogate + k3 KL (ppo_loss), whitened advantages, AdamW (ppo_update);
- the advantages: VinePPO's from MC values (vine.py), GAE's from a critic, GRPO's per group.
Tensors are [B, L-1], aligned with the actions: column t holds token t+1's log-prob,
advantage, ... (rollout.py's figure), as in the reference implementation, McGill-NLP/VinePPO's
trainers/ppo_trainer.py, PPOTrainer._training_step (docs/reference.md pins its commit).

Read in order: the estimators (masked_whiten, gae, group_advantages, k3_kl), ppo_loss,
assign_advantages, Learner, ppo_update, minibatch_step, collate (which position holds which
token's fields). Below the line: bookkeeping and the optimizer step.
"""
import math
from dataclasses import dataclass, field

import torch

import rollout
import vine
import vine_cheaper
from engineering import parallel

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
    """GRPO (Shao et al. 2024, arXiv 2402.03300, §4.1.2): [N] advantages

        A = (R - mean of its group) / (std of its group + eps).

    - the std is the population std (TRL's GRPOTrainer takes the sample std: x1.07 at G = 8);
    - the loss is ppo_loss's: a token mean over the minibatch under PPO's clip, DAPO's
      token-level loss (Yu et al. 2025, arXiv 2503.14476, §3.3), not DeepSeekMath's
      per-response mean 1/G sum_i 1/|o_i| sum_t (§4.1, eq. 3), which weighs a short response's
      tokens more than a long one's;
    - the KL term is ppo_loss's too, a per-response sum over the minibatch, not DeepSeekMath's
      per-token term inside that mean (eq. 3)."""
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
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 (>= 0),
    d = ref - logp. Its value estimates KL(pi || pi_ref); as a loss on sampled tokens, its
    expected gradient is that of KL(pi_ref || pi): sum_x (pi - pi_ref) grad log pi. So does the
    reference's, and GRPO's (DeepSeekMath, eq. 4)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def ppo_loss(logp, old_logp, ref_logp, adv, mask, clip: float = 0.2, kl_coef: float = 1e-4,
             max_ratio: float = 10.0, *, n_tokens=None, n_responses=None):
    """Clipped PPO (Schulman et al. 2017, eq. 7) plus the KL penalty (VinePPO, arXiv
    2410.01679v1, §5), with r_t = pi / pi_old, on a minibatch of N responses and n tokens:
        L = 1/n sum_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps))
            + beta/N sum_seq sum_t clamp(k3_t, 0, 10)
    The rows given may be a micro-batch (n_tokens, n_responses: the minibatch's n and N, over all
    processes; default: these rows' own): loss and stats are then its shares, which add up to the
    minibatch's whatever the split.
    When the mean ratio of the rows given exceeds max_ratio they are skipped (loss x 0), as
    the reference's PPOTrainer._compute_actor_loss skips its batch. The rows are a micro-batch,
    as in the reference, so --micro-batch can change which rows are skipped: the one exception
    to "--micro-batch changes no gradient". -> (loss, stats)"""
    n_tokens = mask.sum().clamp(min=1) if n_tokens is None else n_tokens
    n_responses = mask.shape[0] if n_responses is None else n_responses
    # this batch's share of the minibatch's token mean
    total = lambda x: (x * mask).sum() / n_tokens
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    pg_loss = total(torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)))
    # k3 of the response's tokens only: elsewhere ref_logp is 0, not a log-prob, and exp(d)
    # could overflow to inf there, which times the mask's 0 is NaN
    kl = (k3_kl(torch.where(mask > 0, logp, ref_logp), ref_logp) * mask).clamp(0, 10)
    kl = kl.sum(-1).sum() / n_responses
    loss = pg_loss + kl_coef * kl
    skipped = bool(masked_mean(ratio, mask) > max_ratio)
    loss = loss * 0.0 if skipped else loss
    with torch.no_grad():
        stats = {"policy_loss": pg_loss.item(), "kl": kl.item(), "ratio": total(ratio).item(),
                 "clipfrac": total(((ratio - 1).abs() > clip).float()).item(),
                 "approx_kl": total(ratio - 1 - log_ratio).item(), "skipped": float(skipped)}
    return loss, stats


def assign_advantages(algo: str, episodes, gamma: float, lam: float, lam_critic: float,
                      reuse: bool = False) -> dict:
    """Set ep.advantages ([T]) as `algo` computes them and, for a critic, ep.returns;
    returns diagnostics. reuse: the MC values were estimated with --mc-reuse."""
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
        # the DDP/FSDP wrapper the update's forward passes call (the model itself on one process;
        # FSDP: before AdamW)
        self.wrapped = parallel.wrap(model, fsdp, device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        schedule = lambda step: lr_factor(step, total_steps, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """DeepSpeed's WarmupDecayLR (the reference's): log-shaped warm-up over >= 2 steps (the
    first at lr x log 1 = 0, as DeepSpeed's), then linear decay to 0."""
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
    """`hp.epochs` passes over shuffled minibatches: one optimizer step per minibatch and learner.

    Each loss is a mean over the whole minibatch (all its micro-batches, all processes): a
    micro-batch adds its sum over the minibatch's count (its backward is scaled by the number
    of processes, which DDP averages: parallel.backward_share), so --micro-batch and the number
    of processes change no gradient. move_policy False (--critic-warmup): the critic alone learns.
    Returns the minibatches' mean statistics."""
    log = UpdateLog()
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
    """One minibatch: its micro-batches' backward passes, then a step of each learner.

    Each loss is a mean over the whole minibatch, all processes' rows (minibatch_counts), so
    neither --micro-batch nor the number of processes changes it:
    - a micro-batch's loss is its share, its sum over the minibatch's count (ppo_loss's n_tokens);
    - gradients add up over the micro-batches; DDP then averages the W processes' gradients, so
      each backward is of W x the share (parallel.backward_share): the shares' sum.
    policy None: the policy does not move (--critic-warmup)."""
    ids, mask, fields = collate(batch, pad_id, device)
    if hp.whiten:  # with the statistics of the whole minibatch, all processes' shares together
        fields["advantages"] = masked_whiten(fields["advantages"], fields["action_mask"],
                                             all_reduce=parallel.all_reduce_sum)
    counts = minibatch_counts(fields, critic)
    policy_shares, critic_shares = [], []
    for m in range(0, len(batch), hp.micro_batch):
        rows = slice(m, m + hp.micro_batch)
        micro = {key: value[rows] for key, value in fields.items()}
        if policy is not None:
            with autocast:
                logp, _ = rollout.token_logprobs(policy.wrapped, ids[rows], mask[rows],
                                                 hp.temperature)
            loss, stats = ppo_loss(logp, micro["old_logp"], micro["ref_logp"],
                                   micro["advantages"], micro["action_mask"], hp.clip,
                                   hp.kl_coef, n_tokens=counts["tokens"],
                                   n_responses=counts["responses"])
            log.skipped_batches += stats["skipped"]
            parallel.backward_share(loss, stats, policy_shares)
        if critic is not None:
            with autocast:
                out = critic.wrapped(ids[rows], mask[rows], micro["prompt_lens"])
            loss, stats = critic.model.loss(out, micro["critic_values"], micro["returns"],
                                            micro["reward"], micro["action_mask"], hp.value_clip,
                                            n=counts["critic"])
            parallel.backward_share(loss, stats, critic_shares)
    if policy is not None:
        log.policy.append(parallel.minibatch_stats(policy_shares, POLICY_STATS, device))
    if critic is not None:
        log.critic.append(parallel.minibatch_stats(critic_shares, CRITIC_STATS, device))
    for learner in [x for x in (policy, critic) if x is not None]:
        log.stepped(optimizer_step(learner.model, learner.optimizer, learner.scheduler),
                    learner is policy)


def collate(episodes, pad_id, device):
    """Padded ids [B, L], their mask, and the episodes' per-token fields, [B, L-1] each.

    Column t of a field belongs to token t+1, the token whose log-prob is there; response
    token j is at column P-1+j (rollout.py's figure): action_mask is 1 there, and
    old_logp, ref_logp, advantages, ... hold the episode's [T] values there, 0 elsewhere."""
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


# ---- engineering: statistics, non-finite guards, the step (skip on a first reading) ------------

@dataclass
class UpdateLog:
    """What ppo_update reports: each minibatch's statistics, and the steps it skipped."""
    policy: list = field(default_factory=list)  # one dict of POLICY_STATS per minibatch
    critic: list = field(default_factory=list)  # one dict of CRITIC_STATS per minibatch
    grad_norms: list = field(default_factory=list)  # the policy's, before clipping
    skipped_batches: float = 0  # micro-batches whose ratio exceeded max_ratio (ppo_loss)
    nonfinite_skips: int = 0    # steps skipped for a non-finite loss or gradient norm

    def stepped(self, norm: float | None, is_policy: bool):
        """Record a learner's step: its gradient norm, or None for a step skipped."""
        # every process holds the same norm: the first counts a skipped step
        self.nonfinite_skips += norm is None and parallel.rank() == 0
        if is_policy and norm is not None:
            self.grad_norms.append(norm)

    def summary(self) -> dict:
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
        out = {k: mean(self.policy, k) for k in POLICY_STATS if self.policy}
        out.update({k: mean(self.critic, k) for k in CRITIC_STATS if self.critic})
        return {**out, "skipped_batches": int(self.skipped_batches),
                "nonfinite_skips": int(self.nonfinite_skips),
                "grad_norm": sum(self.grad_norms) / max(1, len(self.grad_norms))}


def minibatch_counts(fields: dict, critic) -> dict:
    """What the minibatch's losses average over, summed over the processes: its response tokens, its
    responses, and the critic's terms (its loss_mask: tokens, or the BCE heads' states s_0..s_T)."""
    act = fields["action_mask"]
    terms = critic.model.loss_mask(act).sum() if critic is not None else act.new_zeros(())
    total = parallel.all_reduce_sum(torch.stack([act.sum(), act.new_tensor(float(act.shape[0])),
                                                 terms]))
    tokens, responses, critic_terms = total.clamp(min=1)
    return {"tokens": tokens, "responses": responses, "critic": critic_terms}


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
