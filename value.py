"""This file holds the critics of PPO and TPPO: the policy's backbone with an fp32 value head.

Column c values the state ending at token c: s_j, the prompt and j response tokens, is at
column P-1+j (rollout.py's figure). The three heads:
  - "scalar":   V_t = w.H_t + c, trained by MSE with value clipping (the PPO baseline, as the
                reference's; docs/reference.md).
  - "tracking": TPPO's, V_t = sigmoid(z_t), z_t the prior b (at P-1) plus a running sum of
                increments h_i, a Bayes step per token (tracking_logits); its loss is
                BCE-with-logits against the outcome at every state s_0..s_T (s_T trains h at EOS).
  - "bce":      z_t = w.H_t + c, the same BCE loss without the sum: the control for the loss alone.

TPPO is "TPPO: Tracking-Value PPO For Language Model Reasoning" (2026), known here from its
abstract only. The abstract gives the running sum, the sigmoid and the BCE against the outcome;
the rest (where b sits, training at every state) is this project's reading.

Needs rollout.py (padding) and batching.py (forward batches); none of it is engineering."""
import torch
import torch.nn.functional as F
from torch import nn

import batching
import rollout

HEADS = ("scalar", "tracking", "bce")


class Critic(nn.Module):
    def __init__(self, backbone, head: str):
        super().__init__()
        assert head in HEADS, head
        self.backbone, self.head_type = backbone, head
        hidden = backbone.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        if head == "tracking":  # zero increments and prior: every V starts at sigmoid(0) = 0.5
            nn.init.zeros_(self.head.weight)
        else:  # N(0, 1/sqrt(H+1)), bias 0, as the reference initializes it (docs/reference.md)
            nn.init.normal_(self.head.weight, std=1 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids, mask, prompt_lens: torch.Tensor):
        """The head's output [B, L] in fp32, column c for the state ending at token c: the
        values V for "scalar", the value logits z for the BCE heads."""
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.head_type == "scalar":  # no action follows column L-1: GAE takes no value there
            hidden = hidden[:, :-1]
        # autocast would recast the head to bf16
        with torch.autocast(hidden.device.type, enabled=False):
            out = self.head(hidden.float()).squeeze(-1)
        if self.head_type == "scalar":
            return F.pad(out, (0, 1))  # [B, L] like the other heads, 0 in column L-1
        return tracking_logits(out, prompt_lens) if self.head_type == "tracking" else out

    def values(self, ids, mask, prompt_lens):
        """V(s_t) before each action, [B, L-1], the values GAE takes."""
        out = self(ids, mask, prompt_lens)[:, : ids.shape[1] - 1]
        return out if self.head_type == "scalar" else torch.sigmoid(out)

    def loss_mask(self, action_mask):
        """The mask of the entries the loss averages: the actions' states for "scalar", or
        s_0..s_T ([B, L]) for the BCE heads."""
        return action_mask if self.head_type == "scalar" else response_states(action_mask)

    def loss(self, out, old_values, returns, rewards, mask, clip: float = 0.2, n=None):
        """The critic's loss on forward's output `out` [B, L], and its stats. The scalar head's
        targets are `returns` [B, L-1], the BCE heads' are `rewards` [B], the outcome R
        (--lam-critic shapes only the scalar head's). The loss is a mean over the n entries of
        the minibatch's loss_mask in all micro-batches and processes (by default these rows'
        alone), so it is these rows' share of that mean."""
        terms = self.loss_mask(mask)
        n = terms.sum().clamp(min=1) if n is None else n
        total = lambda x: (x * terms).sum() / n
        if self.head_type == "scalar":
            out = out[:, :-1]  # the actions' states, [B, L-1]
            # 0.5 * mean max((V - R)^2, (clip(V, V_old +- eps) - R)^2)
            clipped = old_values + (out - old_values).clamp(-clip, clip)
            loss = 0.5 * total(torch.max((out - returns) ** 2, (clipped - returns) ** 2))
            clipfrac = total(((out - old_values).abs() > clip).float()).item()
            return loss, {"value_loss": loss.item(), "value_clipfrac": clipfrac}
        # BCE-with-logits against the outcome (clamped into [0, 1])
        # at every state of the response, s_T too
        target = rewards.clamp(0.0, 1.0)[:, None].expand_as(out)
        loss = total(F.binary_cross_entropy_with_logits(out, target, reduction="none"))
        return loss, {"value_loss": loss.item(), "value_clipfrac": 0.0}


@torch.no_grad()
def critic_values(critic: Critic, episodes: list[rollout.Episode], pad_id: int,
                  forward_batch_tokens: int):
    """Set each ep.critic_values ([T]) to V(s_t) before each response token, one forward pass
    per batch of episodes."""
    device = next(critic.parameters()).device
    for chunk in batching.group_chunks(episodes, forward_batch_tokens):
        ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in chunk],
                                      pad_id, device)
        prompt_lens = torch.tensor([len(ep.prompt_ids) for ep in chunk], device=device)
        for ep, v in zip(chunk, rollout.per_response(critic.values(ids, mask, prompt_lens), chunk)):
            ep.critic_values = v


def tracking_logits(o, prompt_lens):
    """TPPO's value logits z_t = b + sum_{P <= i <= t} h_i in fp32, where b and h_i are the
    head's outputs o [B, L] at P-1 and at i >= P."""
    pos = torch.arange(o.shape[1], device=o.device)[None, :]
    start = (prompt_lens - 1)[:, None]
    prior = o.gather(1, start)                                  # b: [B, 1]
    increments = torch.where(pos >= prompt_lens[:, None], o, 0.0).float()
    return torch.where(pos >= start, prior + increments.cumsum(1), 0.0)


def response_states(action_mask):
    """Turn a [B, L-1] action mask into the [B, L] mask of the response's states s_0..s_T."""
    return torch.maximum(F.pad(action_mask, (0, 1)), F.pad(action_mask, (1, 0)))
