"""Tests of diagnose.py --trace: its numbers against hand computation on scripted samples, and the
command."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import diagnose
import rollout
import value
from engineering import checkpoint, models
from engineering.tasks import DataError, load_problems
from reward import STOP

PROMPT = "What is 1+2+4-1?\n"
GOLD = "1+2=3\n3+4=7\n7-1=6\n#### 6"
RIGHT, WRONG = "\n1+2=3\n3+4=7\n7-1=6\n#### 6", "\n1+2=3\n3+4=8\n8-1=7\n#### 7"  # the slip: 3+4=8
GROUP = [RIGHT, WRONG, RIGHT, "\n1+2=4\n4+4=8\n8-1=7\n#### 7", RIGHT]  # rewards 1 0 1 0 1
# K = 4 continuations of each state of WRONG, keyed by the response so far: rewards 1110, 1010,
# 0000, 0000
CONTINUATIONS = {"": [RIGHT, RIGHT, RIGHT, WRONG],
                 "\n1+2=3\n": ["3+4=7\n7-1=6\n#### 6", "3+4=8\n8-1=7\n#### 7"] * 2,
                 "\n1+2=3\n3+4=8\n": ["8-1=7\n#### 7"] * 4,
                 "\n1+2=3\n3+4=8\n8-1=7\n": ["#### 7"] * 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    models.build_tiny_model(path, seed=0)
    return (path, AutoTokenizer.from_pretrained(path),
            AutoModelForCausalLM.from_pretrained(path).eval())


def scripted(monkeypatch, tok, group=GROUP, continuations=CONTINUATIONS):
    """rollout.sample replaced: k = len(group) samples the group, else the continuations of the
    state."""
    prompt_len = len(diagnose.encode_prompt(tok, PROMPT))

    def fake_sample(model, prefixes, k, budgets, sampling, **kw):
        (prefix,) = prefixes
        texts = group if k == len(group) else continuations[tok.decode(prefix[prompt_len:])]
        conts = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
        assert len(conts) == k
        return [conts], [[True] * k]

    monkeypatch.setattr(rollout, "sample", fake_sample)
    return rollout.Sampling(temperature=0.6, top_p=0.9, max_new_tokens=64, eos_id=tok.eos_token_id,
                            pad_id=rollout.pad_id(tok), stop=STOP, tokenizer=tok)


def test_trace_numbers_match_hand_computation(tiny, monkeypatch):
    _, tok, policy = tiny
    sampling = scripted(monkeypatch, tok)
    problems = [{"question": PROMPT.strip(), "prompt": PROMPT, "answer": GOLD}]
    index, group, wrong = diagnose.first_wrong_answer(policy, problems, 5, sampling)
    assert (index, wrong) == (0, 1) and [ep.reward for ep in group] == [1, 0, 1, 0, 1]
    torch.manual_seed(0)
    critic = value.Critic(policy.base_model, "scalar")
    rows = diagnose.trace_steps(policy, critic, group, wrong, 4, sampling)
    # the steps as training splits them, and nothing lost: their texts make the response
    assert [r["text"] for r in rows] == ["\n1+2=3\n", "3+4=8\n", "8-1=7\n", "#### 7"]
    assert "".join(r["text"] for r in rows) == WRONG
    # V_hat(s_i) the mean of the K rewards, its standard error sqrt(p(1-p)/K) by hand
    assert [r["rewards"] for r in rows] == [[1, 1, 1, 0], [1, 0, 1, 0], [0] * 4, [0] * 4]
    assert [r["value"] for r in rows] == [0.75, 0.5, 0.0, 0.0]
    assert [r["se"] for r in rows] == pytest.approx([math.sqrt(0.75 * 0.25 / 4),
                                                     math.sqrt(0.5 * 0.5 / 4), 0.0, 0.0])
    # A_i = V_hat(s_{i+1}) - V_hat(s_i), + R at the last; the sum telescopes to R - V_hat(s_0)
    assert [r["vineppo"] for r in rows] == pytest.approx([0.5 - 0.75, 0.0 - 0.5, 0.0, 0.0 - 0.0])
    assert sum(r["vineppo"] for r in rows) == pytest.approx(0.0 - rows[0]["value"])
    # GRPO: (R - mean) / std of the group's rewards 1 0 1 0 1, on every step
    assert [r["grpo"] for r in rows] == pytest.approx([(0 - 0.6) / math.sqrt(0.6 * 0.4)] * 4,
                                                      abs=1e-5)
    # the critic read at each boundary, and the mean of R - V(s_t) over the step's tokens
    # (GAE, lambda = 1)
    prompt, response = group[wrong].prompt_ids, group[wrong].response_ids
    v = [diagnose.critic_value(critic, prompt, response[:t], 0) for t in range(len(response))]
    assert len(set(round(x, 3) for x in v)) > 3  # the check below can tell the states apart
    bounds = [0, 7, 13, 19, len(response)]
    assert [r["critic_value"] for r in rows] == pytest.approx([v[b] for b in bounds[:4]], abs=1e-5)
    assert [r["ppo"] for r in rows] == pytest.approx([0.0 - sum(v[lo:hi]) / (hi - lo)
                                                      for lo, hi in zip(bounds, bounds[1:])],
                                                     abs=1e-5)


def test_first_wrong_answer_skips_right_groups_and_says_none(tiny, monkeypatch):
    _, tok, policy = tiny
    sampling = scripted(monkeypatch, tok, group=[RIGHT, RIGHT])
    problems = [{"question": PROMPT.strip(), "prompt": PROMPT, "answer": a}
                for a in (GOLD, "#### 7")]
    index, group, wrong = diagnose.first_wrong_answer(policy, problems, 2, sampling)
    # all right on the first problem; wrong against the second's gold
    assert (index, wrong) == (1, 0)
    assert diagnose.first_wrong_answer(policy, problems[:1], 2, sampling) is None


def test_trace_command_end_to_end(tiny, tmp_path, capsys):
    path, tok, policy = tiny
    torch.manual_seed(1)
    critic = value.Critic(policy.base_model, "tracking")
    torch.nn.init.normal_(critic.head.weight, std=0.1)  # not the zero start: values that differ
    checkpoint.save_checkpoint(str(tmp_path), policy, tok, critic=critic, name="tppo")
    out = tmp_path / "out"
    args = ["--trace", "--checkpoint", path, "--out", str(out), "--trace-k", "2",
            "--group", "2", "--tries", "1", "--max-new-tokens", "12"]
    diagnose.main(args + ["--critic-checkpoint", str(tmp_path / "tppo")])
    printed = capsys.readouterr().out
    assert "the tracking critic saved in" in printed and "VinePPO A_i" in printed
    t = json.load(open(out / "trace.json"))
    steps = t["steps"]
    # random weights: wrong
    assert t["reward"] == 0 and "".join(r["text"] for r in steps) == t["response"]
    assert sum(r["vineppo"] for r in steps) == pytest.approx(t["reward"] - steps[0]["value"])
    # the critic shown is the saved one: its V(s_0), read here from the prompt alone
    saved = checkpoint.load_critic(str(tmp_path / "tppo"), "cpu")
    prompt = diagnose.encode_prompt(tok, load_problems("arith", "test")[t["problem"]]["prompt"])
    assert steps[0]["critic_value"] == pytest.approx(diagnose.critic_value(saved, prompt, [], 0),
                                                     abs=1e-5)
    # not the zero-initialised head's
    assert steps[0]["critic_value"] != pytest.approx(0.5, abs=1e-3)
    with pytest.raises(DataError, match="holds an earlier diagnose.py's results \\(trace.json"):
        diagnose.main(args)  # its trace.json is kept
    diagnose.main(args + ["--overwrite"])  # no critic anywhere: the untrained one, said so
    assert "UNTRAINED" in capsys.readouterr().out
    with pytest.raises(DataError, match="no critic/ inside"):
        diagnose.main(args + ["--overwrite", "--critic-checkpoint", path])


def test_newline_odds_by_hand(tiny, tmp_path, monkeypatch, capsys):
    """diagnose.py --newline-odds on the scripted group: each of its five responses has three
    lines before the answer, so 15 line ends; each odd is the policy's softmax(logits / T) of
    the '\\n' after the text before it, from a forward pass of its own."""
    path, tok, policy = tiny
    scripted(monkeypatch, tok)
    problem = load_problems("arith", "test", hold_out=True)[0]
    monkeypatch.setattr(diagnose, "load_problems", lambda *args, **kw: [problem])
    diagnose.main(["--newline-odds", "--checkpoint", path, "--out", str(tmp_path),
                   "--trajectories", "1", "--group", "5"])
    result = json.load(open(tmp_path / "newline_odds.json"))
    prompt = diagnose.encode_prompt(tok, problem["prompt"])
    newline = tok("\n", add_special_tokens=False).input_ids[-1]
    hand = []
    for text in GROUP:
        ids = tok(text, add_special_tokens=False).input_ids
        for end in [t for t, i in enumerate(ids) if i == newline][1:]:  # the leading one: blank
            with torch.no_grad():
                logits = policy(torch.tensor([prompt + ids[:end]])).logits[0, -1] / 0.6
            hand.append(torch.softmax(logits, -1)[newline].item())
    assert result["line_ends"] == 15 == len(hand)
    assert result["odds"] == pytest.approx(sorted(hand), rel=1e-5)
    assert "15 line ends of 5 responses" in capsys.readouterr().out


def test_mc_settings_command_end_to_end(tiny, tmp_path, capsys):
    """diagnose.py --mc-settings: every setting measured on one batch; fixed K spends exactly K
    per state, top-up at most K; the named setting is the cheapest within 0.02 of fixed K's
    value MAE."""
    path, _, _ = tiny
    torch.manual_seed(0)
    diagnose.main(["--mc-settings", "--checkpoint", path, "--out", str(tmp_path),
                   "--trajectories", "2", "--group", "3", "--gt-rollouts", "4", "--repeats", "1",
                   "--max-new-tokens", "12"])
    result = json.load(open(tmp_path / "mc_settings.json"))
    rows = result["settings"]
    assert set(rows) == set(diagnose.settings_to_compare(4)) and result["episodes"] == 6
    assert [rows[f"fixed K={k}"]["per_state"] for k in (2, 4, 8)] == [2, 4, 8]
    assert rows["reuse+top-up K=4"]["per_state"] <= 4 and rows["reuse K=4"]["per_state"] == 4
    fixed = rows["fixed K=4"]["value_mae"]
    within = {n: r["mc_tokens"] for n, r in rows.items() if r["value_mae"] <= fixed + 0.02}
    # ties: by name
    assert result["cheapest_within_0.02"] == min((tokens, n) for n, tokens in within.items())[1]
    assert result["cheapest_within_0.02"] in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--trace", "--group", "1"], "--group 1: GRPO's advantage is a reward less its group's mean, "
                                  "always 0 in a group of one; give at least 2"),
    (["--k", "1,1,2"], "argument --k: '1,1,2': 1 given twice; expected each K once"),
    (["--k", "3,1,3,1"], "argument --k: '3,1,3,1': 1, 3 given twice; expected each K once"),
])
def test_diagnose_refuses_a_trace_group_of_one_and_a_repeated_k(capsys, args, message):
    """Issue 36 item 14: one line and exit 2, as train.py refuses GRPO's group of one."""
    with pytest.raises(SystemExit) as stop:
        diagnose.parse_args(["--checkpoint", "x", *args])
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert diagnose.parse_args(["--checkpoint", "x", "--group", "1"]).group == 1  # no GRPO here
    assert diagnose.parse_args(["--checkpoint", "x", "--k", "1,2"]).k == [1, 2]
