"""This file runs one iteration of VinePPO on the demo task, plain and slow, top to bottom.

It follows Kazemnejad et al. 2024, arXiv 2410.01679v1; train.py runs the same method fast, and
test_one_page.py checks that the two agree. `python vineppo_one_page.py` takes seconds on a CPU.
Each phase, the function here, and the project's function that does it fast:
    1. sample responses to a few prompts        generate         rollout.sample_episodes
    2. cut each response into steps, by lines   step_starts      vine.split_steps
    3. V_hat(s_i), the mean reward of K         mc_value         vine.mc_values (each state
       continuations of each step start (§4)                     once, forked from a KV cache)
    4. A_i, the change of V_hat across step i,  step_advantages, vine.step_advantages,
       on every token of the step (§4)          token_advantages vine.token_advantages
    5. the clipped PPO loss plus the k3 KL to   ppo_loss         ppo.ppo_update, ppo.ppo_loss
       a reference model (§5); one step                          (minibatches, micro-batches)
"""
import copy
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, logging

import reward  # R: 1 for a right final answer ('#### N'), else 0
from engineering import models, tasks  # the demo's tiny model and its problems


@torch.no_grad()
def generate(model, eos_id: int, ids: list[int], budget: int, temperature: float):
    """Sample what the policy writes after `ids`; say whether it ended (EOS) within `budget`.
    It samples the whole softmax; train.py cuts it to top-p 0.9 by default (--top-p)."""
    x = torch.tensor([ids])
    sample = dict(do_sample=True, temperature=temperature, top_k=0)
    how = sample if temperature > 0 else dict(do_sample=False)  # 0: greedy
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=budget,
                         eos_token_id=eos_id, pad_token_id=eos_id, **how)
    new = out[0, len(ids):].tolist()
    if eos_id in new:  # generate pads after the first EOS
        return new[: new.index(eos_id) + 1], True
    return new, False


def step_starts(tok, response: list[int]) -> list[int]:
    """The token index where each step starts. Every '\\n' closes its step, except while the
    text before it is blank or once that text holds the answer ('####'). One token a character,
    '\\n5-5=0\\n0+3=3\\n#### 3\\n</s>' is cut into '\\n5-5=0\\n' | '0+3=3\\n' | '#### 3\\n</s>'."""
    # The demo's tokenizer has one character a token (EOS none), so the token after a closing
    # '\n' starts a step (vine.token_steps handles tokens of several characters).
    texts = [tok.decode([i], skip_special_tokens=True) for i in response]
    starts, before = [0], ""  # before: the response's text before token t
    for t, char in enumerate(texts):
        if t > 0 and texts[t - 1] == "\n" and before[:-1].strip() and "####" not in before[:-1]:
            starts.append(t)
        before += char
    return starts


def mc_value(model, tok, prompt, response, start, gold, k, max_new_tokens, temperature):
    """V_hat(s_i) = 1/K sum_k R(s_i + continuation_k) (§4), for s_i = prompt + response[:start].
    The state is encoded afresh, with the budget the response leaves; an unfinished one scores 0."""
    prefix, total = response[:start], 0.0
    for _ in range(k):
        new, ended = generate(model, tok.eos_token_id, prompt + prefix, max_new_tokens - start,
                              temperature)
        text = tok.decode(prefix + new, skip_special_tokens=True)
        total += reward.grade(text, gold) if ended else 0.0
    return total / k


def step_advantages(values: list[float], outcome: float) -> list[float]:
    """A_i = V_hat(s_{i+1}) - V_hat(s_i), and A_{n-1} = R - V_hat(s_{n-1}) (§4, gamma = 1)."""
    return [values[i + 1] - values[i] for i in range(len(values) - 1)] + [outcome - values[-1]]


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> torch.Tensor:
    """Put A_i on every token of step i."""
    ends = starts[1:] + [n_tokens]
    return torch.tensor([a for a, lo, hi in zip(step_adv, starts, ends) for _ in range(hi - lo)])


def logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of each response token, under softmax(logits / T) as sampled."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1] / temperature
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)


def whiten(advs: list[torch.Tensor]) -> list[torch.Tensor]:
    """(A - mean) / sqrt(var + 1e-8) over all the batch's tokens, as ppo.ppo_update does."""
    flat = torch.cat(advs)
    mean, var = flat.mean(), flat.var()  # the unbiased variance, as ppo.masked_whiten's
    return [(a - mean) * torch.rsqrt(var + 1e-8) for a in advs]


def ppo_loss(logps, old_logps, ref_logps, advs, clip: float = 0.2, beta: float = 1e-4):
    """The loss of N responses, n tokens in all, given lists of [T] tensors, one per response.

    PPO (Schulman et al. 2017, eq. 7), r_t = pi / pi_old, written as a loss and a token mean:
        1/n sum_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps))
    plus the KL penalty (VinePPO §5), with k3_t = exp(d_t) - d_t - 1, d_t = log pi_ref - log pi:
        beta/N sum_seq sum_t clamp(k3_t, 0, 10)
    (ppo.ppo_loss also skips a batch whose mean ratio passes 10.)"""
    n_tokens, policy, kl = sum(len(lp) for lp in logps), 0.0, 0.0
    for logp, old, ref, adv in zip(logps, old_logps, ref_logps, advs):
        ratio = torch.exp(logp - old)
        policy = policy + torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).sum()
        d = ref - logp
        kl = kl + (torch.exp(d) - d - 1).clamp(0, 10).sum()
    return policy / n_tokens + beta * kl / len(logps)


def warm_start(model, tok, problems: list[dict], steps: int = 50):
    """Train a stand-in for an SFT model on these problems' answers in a second (not VinePPO)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    texts = [f"{tok.bos_token}{reward.ARITH_PROMPT.format(**p)}\n{p['answer']}\n{tok.eos_token}"
             for p in problems]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    for _ in range(steps):
        model(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
              ).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def main(prompts=3, samples=2, k=4, max_new_tokens=64, temperature=0.6, lr=1e-5, beta=1e-3):
    """Run one iteration; print one response's steps, values and advantages, and the loss."""
    torch.set_num_threads(1)  # a 0.86M model gains nothing from threads; on a busy CPU they wait
    torch.manual_seed(0)
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:  # the demo's tiny model, random weights
        models.build_tiny_model(folder, seed=0)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
    problems = tasks.arith_dataset(prompts, seed=0, steps=(2, 3))  # chains of 2-3 lines
    warm_start(model, tok, problems)
    ref = copy.deepcopy(model)  # pi_ref, the KL's target: the policy RL starts from
    batch = []
    for p in problems:
        text = reward.ARITH_PROMPT.format(**p)  # 'What is 5-5+3?\n'
        prompt = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
        for _ in range(samples):  # 1. a response and its reward, 2. its steps
            response, ended = generate(model, tok.eos_token_id, prompt, max_new_tokens, temperature)
            text = tok.decode(response, skip_special_tokens=True)
            r = dict(prompt=prompt, response=response, starts=step_starts(tok, response),
                     reward=reward.grade(text, p["answer"]) if ended else 0.0)
            r["values"] = [mc_value(model, tok, prompt, response, start, p["answer"], k,  # 3.
                                    max_new_tokens, temperature) for start in r["starts"]]
            r["step_adv"] = step_advantages(r["values"], r["reward"])  # 4.
            batch.append(r)
    r = max(batch, key=lambda r: max(map(abs, r["step_adv"])))  # show one response
    print(f"{tok.decode(r['prompt'], skip_special_tokens=True)!r}, R = {r['reward']}")
    for i, (lo, hi) in enumerate(zip(r["starts"], r["starts"][1:] + [len(r["response"])])):
        print(f"  step {i}  {tok.decode(r['response'][lo:hi])!r:18}  V(s_{i}) = "
              f"{r['values'][i]:.2f}  A_{i} = {r['step_adv'][i]:+.2f}")
    # 5. one PPO step. pi_old is the policy that sampled (r_t = 1 at the step), and the advantages
    # are whitened over the batch, as ppo.ppo_update whitens them over a minibatch
    advs = whiten([token_advantages(r["starts"], r["step_adv"], len(r["response"]))
                   for r in batch])
    new = lambda m: [logprobs(m, r["prompt"], r["response"], temperature) for r in batch]
    with torch.no_grad():
        old, refs = new(model), new(ref)
    loss = ppo_loss(new(model), old, refs, advs, beta=beta)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    after = ppo_loss(new(model), old, refs, advs, beta=beta).item()
    print(f"mean R {sum(r['reward'] for r in batch) / len(batch):.2f} over {len(batch)} "
          f"responses; loss {loss.item():+.6f} before the step, {after:+.6f} after it")


if __name__ == "__main__":
    main()
