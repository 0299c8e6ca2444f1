"""Critics: a copy of the policy backbone with a value head on its last hidden states.

Three heads, selected by name. Output column t belongs to s_t, the state that ends at token t,
before action t+1; `values` gives GAE's [B, L-1] (s_0..s_{L-2}: the state after the last token
is terminal, V = 0 there). The head always computes in fp32, autocast or not:
  - "scalar":   V_t = w.H_t + c, MSE with value clipping (the PPO baseline; reference §2.7).
  - "tracking": the TPPO critic. Per-token increments h_i summed into value logits,
                    z_t = b + sum_{P <= i <= t} h_i,   V_t = sigmoid(z_t),
                with b read at the last prompt token (position P-1). Successive values then
                differ by additive log-odds updates, a Bayes step: logit V(s_t) = logit V(s_{t-1}) + h_t.
                Trained with BCE-with-logits against the final outcome at every state of the
                response, s_0 (prompt only) to s_T (the whole response): without s_T the last
                increment, h_T at the final (EOS) token, would never be trained.
  - "bce":      z_t = w.H_t + c, the same BCE loss, no cumulative sum: the control that tells
                a gain of the cumulative structure from a gain of the classification loss.
Rewards are mapped into [0, 1] for the BCE heads by clamping (`outcome_target`); the tasks here
score 0/1, so the map is the identity for them.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ppo import masked_mean

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
        else:  # reference: N(0, 1/sqrt(H+1)), bias 0
            nn.init.normal_(self.head.weight, std=1 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids, mask, prompt_lens: torch.Tensor):
        """fp32 outputs at the states each head trains on: values [B, L-1] for "scalar" (GAE's
        states), value logits z [B, L] for the BCE heads (one more: the whole sequence)."""
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.head_type == "scalar":
            hidden = hidden[:, :-1]  # the state after the last token is terminal: GAE takes V = 0 there
        with torch.autocast(hidden.device.type, enabled=False):  # autocast would recast the head to bf16
            out = self.head(hidden.float()).squeeze(-1)
        return tracking_logits(out, prompt_lens) if self.head_type == "tracking" else out

    def loss(self, out, old_values, returns, rewards, mask, clip: float = 0.2):
        return critic_loss(self, out, old_values, returns, rewards, mask, clip)

    def values(self, ids, mask, prompt_lens):
        """V(s_t) before each action, [B, L-1]: the values GAE takes."""
        out = self(ids, mask, prompt_lens)[:, : ids.shape[1] - 1]
        return out if self.head_type == "scalar" else torch.sigmoid(out)


def tracking_logits(o, prompt_lens):
    """z_t = b + sum_{P <= i <= t} h_i: b = o at position P-1, h_i = o at response positions.
    o: [B, L] per-position head outputs; prompt_lens: [B]. The sum runs in fp32."""
    pos = torch.arange(o.shape[1], device=o.device)[None, :]
    start = (prompt_lens - 1)[:, None]
    prior = o.gather(1, start)                                  # b: [B, 1]
    increments = torch.where(pos >= prompt_lens[:, None], o, 0.0).float()
    return torch.where(pos >= start, prior + increments.cumsum(1), 0.0)


def outcome_target(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards mapped into [0, 1] for the BCE heads: clamped (0/1 task rewards are unchanged)."""
    return rewards.clamp(0.0, 1.0)


def response_states(action_mask):
    """[B, L-1] action mask -> [B, L] mask of the response's states: s_0 before the first action
    to s_T after the last, the actions' own columns and one more."""
    return torch.maximum(F.pad(action_mask, (0, 1)), F.pad(action_mask, (1, 0)))


def critic_loss(critic: Critic, out, old_values, returns, rewards, mask, clip: float = 0.2):
    """Loss of one minibatch. out: from critic(...); mask: [B, L-1] action mask; returns: [B, L-1]
    targets of the scalar head; rewards: [B] final outcomes for the BCE heads. Returns (loss, stats)."""
    if critic.head_type == "scalar":
        # 0.5 * mean max((V - R)^2, (clip(V, V_old +- eps) - R)^2)   (reference §2.7)
        clipped = old_values + (out - old_values).clamp(-clip, clip)
        loss = 0.5 * masked_mean(torch.max((out - returns) ** 2, (clipped - returns) ** 2), mask)
        clipfrac = masked_mean(((out - old_values).abs() > clip).float(), mask).item()
        return loss, {"value_loss": loss.item(), "value_clipfrac": clipfrac}
    # BCE-with-logits against the outcome at every state of the response, s_T too (no value clipping)
    target = outcome_target(rewards)[:, None].expand_as(out)
    bce = F.binary_cross_entropy_with_logits(out, target, reduction="none")
    loss = masked_mean(bce, response_states(mask))
    return loss, {"value_loss": loss.item(), "value_clipfrac": 0.0}
