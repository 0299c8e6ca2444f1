"""Tests: vineppo_one_page.py, VinePPO by its definition on one page, gives the project's numbers.

On one fixed batch: the steps of vine.split_steps, the MC values and advantages of vine.mc_values
(forked from a KV cache) on a greedy policy, and the loss of ppo.ppo_loss on the same inputs.
Each fails if the page's step rule, values or loss drift from the project's."""
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo
import reward
import rollout
import vine
import vineppo_one_page as page
from engineering import models

HERE = os.path.dirname(os.path.abspath(__file__))
RIGHT = "\n2+3=5\n5-1=4\n#### 4"  # the answer to 'What is 2+3-1?' the model learns by heart


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from threads, and on a busy CPU they wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, the random tiny model, the same model trained to know one answer by heart)."""
    path = str(tmp_path_factory.mktemp("tiny"))
    models.build_tiny_model(path, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    random_model = AutoModelForCausalLM.from_pretrained(path).eval()
    by_heart = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([prompt_ids(tok, "2+3-1") + text_ids(tok, RIGHT) + [tok.eos_token_id]])
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(by_heart.parameters(), lr=3e-3)
    for _ in range(60):
        by_heart(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tok, random_model, by_heart.eval()


def prompt_ids(tok, question: str) -> list[int]:
    """BOS + the demo's prompt, 'What is 2+3-1?\n', as engineering.prompts.encode_prompt."""
    text = reward.ARITH_PROMPT.format(question=f"What is {question}?")
    return [tok.bos_token_id] + text_ids(tok, text)


def text_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def batch(tok) -> list[rollout.Episode]:
    """The fixed batch: a right answer, one with an empty line, a wrong one, an unfinished one,
    one that skips a line (the model would write it: 13 tokens after its first line), another
    prompt's."""
    end = [tok.eos_token_id]
    four, three = "2+3=5\n5-1=4\n#### 4", "2+3=5\n5-2=3\n#### 3"  # the gold answers
    rows = [("2+3-1", four, RIGHT + "</s>"), ("2+3-1", four, "\n2+3=5\n\n5-1=4\n#### 4</s>"),
            ("2+3-1", four, "\n2+3=6\n6-1=5\n#### 5</s>"), ("2+3-1", four, "\n2+3=5\n5-"),
            ("2+3-1", four, "\n2+3=5\n#### 4</s>"), ("2+3-2", three, "\n" + three + "</s>")]
    episodes = []
    for group, (question, gold, text) in enumerate(rows):
        finished = text.endswith("</s>")
        response = text_ids(tok, text.removesuffix("</s>")) + end * finished
        episodes.append(rollout.Episode(prompt_ids(tok, question), response, gold, group,
                                        finished))
    for ep in episodes:
        ep.reward = reward.response_reward(ep, ep.response_ids, tok) if ep.finished else 0.0
    return episodes


def test_the_page_cuts_the_steps_of_split_steps(tiny):
    """The page's plain loop and vine.split_steps (token_texts, line_step_offsets, token_steps)
    start the same steps: the batch, a leading '\\n', an empty line, an answer line, text after
    the answer, and 1,500 random responses of the characters that matter and special tokens."""
    tok = tiny[0]
    end = [tok.eos_token_id]
    assert (page.step_starts(tok, text_ids(tok, "\n2+3=5\n\n5-1=4\n#### 4\n") + end)
            == [0, 7, 8, 14])  # '\n2+3=5\n' | '\n' | '5-1=4\n' | '#### 4\n</s>'
    named = ["", "\n", "\n\n", "a\n", " \n a\n", "a\n#### 1\nb\n#### 2\n", "a\nb\n", "#### 1\n"]
    pieces = [text_ids(tok, piece) for piece in ("\n", "\n", " ", "a", "4", "####", "#")]
    pieces += [[tok.eos_token_id], [tok.unk_token_id], [tok.pad_token_id]]  # decoded: ''
    rng = random.Random(0)
    responses = [text_ids(tok, text) + tail for text in named for tail in ([], end)]
    responses += [sum(rng.choices(pieces, k=rng.randint(1, 10)), []) for _ in range(1500)]
    episodes = [rollout.Episode([tok.bos_token_id], r, "", 0, True) for r in responses]
    episodes += batch(tok)
    vine.split_steps(episodes, tok)
    for ep in episodes:
        assert page.step_starts(tok, ep.response_ids) == ep.step_starts, ep.response_ids


@pytest.mark.parametrize("max_new", [24, 19])
def test_the_page_gives_the_mc_values_and_advantages_of_mc_values(tiny, max_new):
    """Greedy, on the model that knows one answer by heart: the page's values (each state
    encoded afresh, K continuations by generate) are vine.mc_values' (forked from the old-log-prob
    pass's cache), and so are the step advantages and their tokens'.
    - 24 new tokens: values 1 and 0 (the other prompt's states lead to 4);
    - 19: the model writes its EOS as the 20th response token, so no continuation ends within
      its budget, and every value is 0 though the texts hold '#### 4'. The line skipper (14
      tokens) is one of the responses that fit: after its first line, 12 tokens are left and its
      continuation takes 13. (The batch is given, not sampled: the others are longer than 19.)"""
    tok, _, model = tiny
    episodes = batch(tok)
    vine.split_steps(episodes, tok)
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=max_new,
                              eos_id=tok.eos_token_id, pad_id=rollout.pad_id(tok), tokenizer=tok)
    cache = rollout.old_logprobs(model, episodes, 1.0, greedy.pad_id, keep_cache=True)
    vine.mc_values(model, episodes, cache, greedy, vine.MCSettings(k=2))
    for ep in episodes:
        values = [page.mc_value(model, tok, ep.prompt_ids, ep.response_ids, start, ep.gold, 2,
                                max_new, 0.0) for start in ep.step_starts]
        assert values == ep.step_values
        step_adv = page.step_advantages(values, ep.reward)
        assert step_adv == vine.step_advantages(ep.step_values, ep.reward)
        tokens = page.token_advantages(ep.step_starts, step_adv, len(ep.response_ids))
        assert torch.equal(tokens, vine.episode_advantages(ep))
    assert [ep.step_values for ep in episodes] == EXPECTED_VALUES[max_new]


# V_hat(s_i) of each episode's states: at 24 the wrong line's and the line skipper's states still
# lead to '#### 4' (1), the state after the empty line to '### 4' (0); at 19 none finishes
EXPECTED_VALUES = {24: [[1, 1, 1], [1, 1, 1, 0], [1, 1, 1], [1, 1], [1, 1], [0, 0, 0]],
                   19: [[0, 0, 0], [0, 0, 0, 0], [0, 0, 0], [0, 0], [0, 0], [0, 0, 0]]}


def test_the_page_gives_the_loss_of_ppo_loss(tiny):
    """The same log-probs, old and reference log-probs and advantages, through the page's whiten
    and ppo_loss and through ppo.masked_whiten and ppo.ppo_loss: the same loss (1e-6 relative),
    with and without the KL term, and the same gradient with respect to the log-probs. The
    inputs clip ratios on both sides and clamp k3 at 10. The page's log-probs are the project's."""
    tok, policy, ref = tiny
    episodes = batch(tok)
    torch.manual_seed(0)
    for ep in episodes:
        ep.advantages = torch.randn(len(ep.response_ids))
    rollout.reference_logprobs(ref, episodes, 0.6, rollout.pad_id(tok), 1 << 16)
    rollout.old_logprobs(policy, episodes, 0.6, rollout.pad_id(tok))
    for ep in episodes:  # pi_old a little away from pi: ratios of 0.5 to 2
        ep.old_logp = ep.old_logp + 0.3 * torch.randn(len(ep.response_ids))
    ids, mask, fields = ppo.collate(episodes, rollout.pad_id(tok), "cpu")
    logp = rollout.token_logprobs(policy, ids, mask, 0.6)[0].detach().requires_grad_()
    for ep, row in zip(episodes, rollout.per_response(logp.detach(), episodes)):
        assert torch.allclose(page.logprobs(policy, ep.prompt_ids, ep.response_ids, 0.6), row,
                              atol=1e-5)
    act = fields["action_mask"]
    ratio, k3 = (logp - fields["old_logp"]).exp(), ppo.k3_kl(logp, fields["ref_logp"])
    assert ((ratio > 1.2) & (act > 0)).any() and ((ratio < 0.8) & (act > 0)).any()
    assert ((k3 > 10) & (act > 0)).any()
    adv = ppo.masked_whiten(fields["advantages"], act)
    advs = page.whiten([ep.advantages for ep in episodes])
    for beta in (0.0, 0.1):
        project, stats = ppo.ppo_loss(logp, fields["old_logp"], fields["ref_logp"], adv, act,
                                      0.2, beta)
        assert stats["skipped"] == 0
        ours = page.ppo_loss(rollout.per_response(logp, episodes),
                             [ep.old_logp for ep in episodes], [ep.ref_logp for ep in episodes],
                             advs, 0.2, beta)
        assert ours.item() == pytest.approx(project.item(), rel=1e-6)
        grads = [torch.autograd.grad(loss, logp)[0] for loss in (project, ours)]
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_the_page_runs_in_under_a_minute():
    """`python vineppo_one_page.py` prints one response's steps, values and advantages, and the
    loss, within a minute on a CPU."""
    start = time.time()
    out = subprocess.run([sys.executable, "vineppo_one_page.py"], cwd=HERE, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.time() - start < 60
    assert "step 0" in out.stdout and "V(s_0)" in out.stdout and "A_0" in out.stdout
    assert "loss" in out.stdout
