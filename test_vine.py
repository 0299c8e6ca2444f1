"""Tests: the math against hand-computed or exactly enumerable cases, and smoke runs of train.py."""
import bisect
import collections
import contextlib
import copy
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as token_models
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

import batching
import fork
import generation
import ppo
import reward
import rollout
import train
import value
import vine
import vine_cheaper
from engineering import checkpoint, models, parallel
from engineering.sft import sft_target
from reward import extract_answer, gsm8k_reward
from engineering.tasks import DataError, arith_dataset, load_problems, read_jsonl, split_of

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- grading ------------------------------------------------------------------------------

def test_gsm8k_grader_reference_rules():
    assert extract_answer("a\n#### 72") == "72"
    assert extract_answer("#### 1\n#### 2 ") == "2"            # the last '####' wins
    assert extract_answer("no answer here") is None
    assert gsm8k_reward("\nx\n#### 1,000\n", "1000") == 1.0     # commas removed from the prediction
    assert gsm8k_reward("#### 72", "Natalia...\n#### 72") == 1.0  # full GSM8K answer field as gold
    assert gsm8k_reward("#### 72.0", "72") == 0.0               # no float parsing
    assert gsm8k_reward("#### $72", "72") == 0.0
    assert gsm8k_reward("the answer is 72", "72") == 0.0        # missing answer
    assert gsm8k_reward("#### 7\n#### 72", "72") == 1.0


@pytest.mark.parametrize("steps", [(2, 5), (1, 1), (6, 8), (8, 8)])
def test_arith_task_is_consistent_and_multistep(steps):
    """Every line recomputes the running total, a single digit; a slipped demonstration's lines
    are off by one where they slip and follow on from there; chains have MIN to MAX steps."""
    slipped = 0
    for p in arith_dataset(300, seed=3, steps=steps, slip=0.25):
        lines, demo = p["answer"].split("\n"), p["demonstration"].split("\n")
        assert steps[0] <= len(lines) - 1 <= steps[1] and lines[-1].startswith("#### ")
        for text in (lines, demo):
            total = None
            for line in text[:-1]:
                lhs, rhs = line.split("=")
                a, op, b = (lhs.partition("+") if "+" in lhs else lhs.partition("-"))
                assert total is None or int(a) == total  # the chain goes on from the line above
                exact = int(a) + int(b) if op == "+" else int(a) - int(b)
                assert (int(rhs) - exact in ((0,) if text is lines else (-1, 0, 1))
                        and 0 <= int(rhs) <= 9)
                slipped += int(rhs) != exact
                total = int(rhs)
            assert text[-1] == f"#### {total}"
        assert gsm8k_reward(sft_target(p["answer"]), p["answer"]) == 1.0
    assert slipped > 0


# ---- steps and advantages -----------------------------------------------------------------

def line_steps(texts: list[str], boxed: bool = False) -> list[int]:
    """GSM8K's step starts of a response whose tokens have these texts (vine.response_step_starts
    without a tokenizer)."""
    return vine.token_steps(texts, vine.line_step_offsets("".join(texts), boxed))


def split(text, tokens=None):
    tokens = tokens or list(text)  # character-level tokens by default
    starts = line_steps(tokens)
    return ["".join(tokens[a:b]) for a, b in zip(starts, starts[1:] + [len(tokens)])]


def test_step_split_examples():
    # every '\n' closes its step; the answer line is a step of its own
    assert split("\nA.\nB.\n#### 72\n") == ["\nA.\n", "B.\n", "#### 72\n"]
    assert (split("\nA = 3.\nB = 4.\n\nC = 7\n#### 1,000")
            == ["\nA = 3.\n", "B = 4.\n", "\n", "C = 7\n", "#### 1,000"])
    # no answer: every line, leading empties merged
    assert split("\n\nA\nB\n") == ["\n\nA\n", "B\n"]
    assert split("A\n\n#### 5") == ["A\n", "\n", "#### 5"]
    # the same lines as the reference's rule: each of its steps ends where one of ours does
    for text in ("\nA.\nB.\n#### 72\n", "\nA = 3.\nB = 4.\n\nC = 7\n#### 1,000", "a\nb\n"):
        ours = {len("".join(split(text)[:i + 1])) for i in range(len(split(text)))}
        theirs = reference_step_starts(list(text))[1:]
        assert all(start + 1 in ours for start in theirs), text  # its '\n' ends one of ours


def reference_step_starts(texts: list[str]) -> list[int]:
    """The reference's rule (tasks/gsm8k.py, split_solution_into_intermediate_steps), kept as the
    biased convention of the exact-enumeration test: a step opens at the '\n' before its line;
    the last line joins the answer ('\n####'); leading empty lines join the first."""
    text = "".join(texts)
    answer_at = text.find("\n####")
    lines = (text if answer_at < 0 else text[:answer_at]).split("\n")
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    newlines = [c for c, char in enumerate(text) if char == "\n"]
    opens = []
    if nonempty:
        last = nonempty[-1] if answer_at >= 0 else len(lines) - 1
        opens = [newlines[i - 1] for i in range(nonempty[0] + 1, last + 1)]
    return vine.token_steps(texts, opens)


def test_step_starts_docstring_cases_hold():
    """The table of cases in line_step_offsets' docstring is what the function does."""
    rows = vine.line_step_offsets.__doc__.split("split at the offsets):")[1].splitlines()[1:]
    cases = [row.strip() for row in rows if row.strip().startswith("'")]
    assert len(cases) == 4
    for case in cases:
        end = case.index("'", 1)  # the response between quotes, then its pieces
        text = case[1:end].replace("\\n", "\n")
        shown = case[end + 1:].strip().split("   ")[0]  # before the comment
        pieces = [piece.replace("\\n", "\n") for piece in shown.split(" | ")]
        assert split(text) == pieces, case


def test_step_split_multichar_tokens_follow_first_character():
    # '.\n' carries the newline that closes step 0, so step 1 starts at the next token; '\n#'
    # closes step 2 with its '\n' and opens nothing (its '#' goes with it): step 3 is '###...'
    assert (split(None, ["A", ".\n", "B", "\n", "C", "\n#", "### 5", "</s>"[:0]])
            == ["A.\n", "B\n", "C\n#", "### 5"])


def hand_byte_level_bpe(merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A byte-level BPE with these merges only: its base tokens are the 256 bytes as characters
    ('Ġ' a space, 'Ċ' a '\\n'), and Llama-3's pre-tokenizer pattern cuts the text first (a space
    goes with the letters after it, digits stand alone, punctuation keeps the newlines after it:
    '.\\n\\n' can be one token, as it is in Llama-3's vocabulary)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet + ["".join(m) for m in merges])}
    tk = Tokenizer(token_models.BPE(vocab, merges))
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_token_texts_docstring_trace():
    """The trace in token_texts' docstring: 'a €.' in a byte-level BPE without merges, '€' as
    three byte tokens, the first two adding '' (the decoded text ends in half a character)."""
    tok = hand_byte_level_bpe([])
    ids = tok("a €.", add_special_tokens=False)["input_ids"]
    tokens = ["a", "Ġ", "â", "Ĥ", "¬", "."]
    assert tok.convert_ids_to_tokens(ids) == tokens
    decoded = [tok.backend_tokenizer.decode(ids[: t + 1]) for t in range(len(ids))]
    assert decoded == ["a", "a ", "a \ufffd", "a \ufffd", "a €", "a €."]
    texts = vine.token_texts(tok, ids)
    assert texts == ["a", " ", "", "", "€", "."]
    rows = [row.split("'")[1::2] for row in vine.token_texts.__doc__.splitlines()
            if row.strip().startswith("'") and row.count("'") == 6]
    assert rows == [list(row) for row in zip(tokens, decoded, texts)]


def test_step_split_of_one_byte_level_bpe_response_by_hand():
    r"""One byte-level BPE response through each stage of vine.response_step_starts, as a table.

    The text: "I had 5 €.\n\nNow 3.\n#### 3" (an empty line, then the answer line). Stages:
    1. token_texts: the text each token adds; a byte inside a character adds '' until the
       character is complete ('€' is 3 bytes without a merge: 'â', 'Ĥ' add '', '¬' adds '€');
    2. firsts: each token's first character offset, the running sum of the texts' lengths;
    3. line_step_offsets on the whole text: opens = [11, 12, 19], after the '\n's at 10, 11, 18
       (steps of the text: 'I had 5 €.\n' | '\n' | 'Now 3.\n' | '#### 3');
    4. token_steps: a token is in its first character's step, bisect_right(opens, first) (the
       table's step); a step starts at each token where that changes: starts = [0, 9, 13].
    Token 8, '.\n\n', starts at '.' in step 0, so its first '\n' closes step 0 inside it, and
    the text's step 1 (its second '\n', the empty line) holds no token's first character: it
    stays in step 0, and the response has 3 steps: tokens 0-8, 9-12, 13-15."""
    tok = hand_byte_level_bpe([("Ġ", "h"), ("a", "d"), ("Ġh", "ad"), ("N", "o"), ("No", "w"),
                               (".", "Ċ"), (".Ċ", "Ċ"), ("#", "#"), ("##", "##")])
    text = "I had 5 €.\n\nNow 3.\n#### 3"
    # t: token index | BPE token | its text (repr) | first: offset of its first character |
    # step: its first character's step, bisect_right(opens, first)
    table = [
        ( 0, "I",     "I",       0, 0),
        ( 1, "Ġhad",  " had",    1, 0),       # a leading space, Ġ, goes with the word
        ( 2, "Ġ",     " ",       5, 0),       # a digit stands alone, without its space
        ( 3, "5",     "5",       6, 0),
        ( 4, "Ġ",     " ",       7, 0),
        ( 5, "â",     "",        8, 0),       # '€', 3 bytes: '' until its last byte, so
        ( 6, "Ĥ",     "",        8, 0),       # these two share the offset of '€'
        ( 7, "¬",     "€",       8, 0),
        ( 8, ".ĊĊ",   ".\n\n",   9, 0),       # '.' is in step 0: this token too, '\n\n' and all
        ( 9, "Now",   "Now",    12, 2),       # the next token: a step starts (the text's step 2)
        (10, "Ġ",     " ",      15, 2),
        (11, "3",     "3",      16, 2),
        (12, ".Ċ",    ".\n",    17, 2),       # its '\n' (18) closes step 2 inside it
        (13, "####",  "####",   19, 3),       # the answer line: a step of its own
        (14, "Ġ",     " ",      23, 3),
        (15, "3",     "3",      24, 3),
    ]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert [row[0] for row in table] == list(range(len(ids)))
    assert tok.convert_ids_to_tokens(ids) == [row[1] for row in table]
    texts = vine.token_texts(tok, ids)
    assert texts == [row[2] for row in table] and "".join(texts) == text
    firsts = [len("".join(texts[:t])) for t in range(len(texts))]
    assert firsts == [row[3] for row in table]
    opens = vine.line_step_offsets(text)
    assert opens == [11, 12, 19]
    assert [bisect.bisect_right(opens, first) for first in firsts] == [row[4] for row in table]
    assert vine.token_steps(texts, opens) == [0, 9, 13]
    assert vine.response_step_starts(tok, ids) == [0, 9, 13]


def test_step_advantages_hand_computed():
    # V(s0)=.5, V(s1)=.25, V(s2)=1, reward 1: A = [.25-.5, 1-.25, 1-1]
    assert vine.step_advantages([0.5, 0.25, 1.0], 1.0) == pytest.approx([-0.25, 0.75, 0.0])
    # states past the cap take the realised return: zero advantage there, R - V at the cap
    assert vine.step_advantages([0.5, 0.7, None, None], 1.0) == pytest.approx([0.2, 0.3, 0.0, 0.0])
    assert vine.step_advantages([0.5], 0.0) == pytest.approx([-0.5])
    # reuse: the response joins V(s_{i+1}) of A_i, (n V + R) / (n + 1), never the baseline V(s_i)
    assert (vine_cheaper.reuse_step_advantages([0.5, 0.25, 1.0], 1.0, [2, 3, 4])
            == pytest.approx([0.4375 - 0.5, 0.75, 0.0]))
    assert (vine_cheaper.reuse_step_advantages([0.5, 0.25, None], 0.0, [2, 3, None])
            == pytest.approx([0.1875 - 0.5, -0.25, 0.0]))
    assert vine.token_advantages([0, 2, 3], [1.0, 2.0, 3.0], 5) == [1.0, 1.0, 2.0, 3.0, 3.0]


# where fork.continue_from_cache is faked: a cache, so that vine takes the fork's path
CACHE = "the old-log-prob pass's cache"


def test_mc_values_mean_of_continuations_and_dedup(monkeypatch):
    calls = []

    def fake_sample(model, prefixes, k, budgets, sampling, **kw):
        calls.append((prefixes, budgets))
        # continuation j of a prefix is [j]; its reward (below) is 1 iff j < len(prefix) % 4
        return [[[j] for j in range(k)] for _ in prefixes], [[True] * k for _ in prefixes]

    monkeypatch.setattr(fork, "continue_from_cache", fake_sample)
    eps = [rollout.Episode([1, 5], [7, 8, 9, 2], "", 0, True, step_starts=[0, 1, 3]),
           rollout.Episode([1, 5], [7, 8, 6, 2], "", 0, True, step_starts=[0, 2]),
           rollout.Episode([1, 6], [7, 2], "", 1, True, step_starts=[0])]
    grade = lambda ep, ids, tok: float(ids[-1] < (len(ep.prompt_ids) + len(ids) - 1) % 4)
    monkeypatch.setattr(reward, "response_reward", grade)
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_id=2, pad_id=0)
    counts = vine.mc_values(None, eps, CACHE, sampling, vine.MCSettings(4, max_states=25))
    assert counts["mc_states"] == 5   # 6 states, [1,5] shared by the two samples of prompt 0
    assert len(calls) == 1 and sorted(calls[0][1]) == [7, 8, 9, 10, 10]  # budget = 10 - boundary
    # prefix length L -> continuation rewards [j < L % 4 for j < 4] -> value (L % 4) / 4
    assert eps[0].step_values == [2 / 4, 3 / 4, 1 / 4]
    assert eps[1].step_values == [2 / 4, 0 / 4]
    assert eps[2].step_values == [2 / 4]


def test_mc_values_cap_leaves_none(monkeypatch):
    ep = rollout.Episode([1], [4, 4, 4, 2], "", 0, True, step_starts=[0, 1, 2, 3])
    monkeypatch.setattr(fork, "continue_from_cache",
                        lambda m, prefixes, k, b, sampling, **kw: (
                            [[[2]] * k for _ in prefixes], [[True] * k for _ in prefixes]))
    monkeypatch.setattr(reward, "response_reward", lambda ep, ids, tok: 1.0)
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=2, pad_id=0)
    vine.mc_values(None, [ep], CACHE, sampling, vine.MCSettings(2, max_states=2))
    assert ep.step_values == [1.0, 1.0, None, None]


def definition_page_block() -> dict:
    """The functions of docs/mc-values-by-definition.md's python block."""
    page = open(os.path.join(HERE, "docs", "mc-values-by-definition.md")).read()
    block = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert len(block.splitlines()) < 40  # as the README says
    functions = {}
    exec(block, functions)
    return functions


@pytest.mark.slow
def test_the_definition_page_gives_mc_values_numbers(tmp_path):
    """docs/mc-values-by-definition.md's block (each state encoded afresh by generate, one
    continuation at a time) and the project's path (forked from the old-log-prob cache, states
    shared, batched) agree, greedy: on a random model the same continuations, token for token;
    on one that knows an answer by heart, the same values and step advantages, some 1 (its
    answer's states), some 0 (another prompt's, a prefix it never saw)."""
    definition = definition_page_block()
    models.build_tiny_model(str(tmp_path), seed=0)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = lambda text: tok(text, add_special_tokens=False).input_ids
    end = [tok.eos_token_id]
    prompt, other = ([tok.bos_token_id] + ids(f"What is {q}?\n") for q in ("2+3-1", "2+3-2"))
    right, gold = ids("\n2+3=5\n5-1=4\n#### 4") + end, "2+3=5\n5-1=4\n#### 4"
    episodes = [rollout.Episode(prompt, right, gold, 0, True),
                rollout.Episode(prompt, ids("\n2+3=5, so five\n5-1=4\n#### 4") + end, gold, 0,
                                True),
                rollout.Episode(prompt, ids("\n2+3=6\n6-1=5\n#### 5") + end, gold, 0, True),
                rollout.Episode(prompt, ids("\n2+3=5\n5-"), gold, 0, False),
                rollout.Episode(other, ids("\n2+3=5\n5-2=3\n#### 3") + end,
                                "2+3=5\n5-2=3\n#### 3", 1, True)]
    for ep in episodes:
        ep.reward = reward.response_reward(ep, ep.response_ids, tok) if ep.finished else 0.0
    vine.split_steps(episodes, tok)
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=32,
                              eos_id=tok.eos_token_id, pad_id=rollout.pad_id(tok), tokenizer=tok)
    # the random model: every state's continuation, forked and afresh
    cache = rollout.old_logprobs(model, episodes, 1.0, greedy.pad_id, keep_cache=True)
    states = vine.distinct_states(episodes)  # state tokens -> (e, b)
    forked = fork.continue_from_cache(model, [list(s) for s in states], 1,
                                            [32 - b for _, b in states.values()], greedy,
                                            cache=cache, rows=[e for e, _ in states.values()])
    afresh = [definition["continuation"](model, tok.eos_token_id, list(s), 32 - b, 0.0)
              for s, (_, b) in states.items()]
    assert forked == ([[c] for c, _ in afresh], [[f] for _, f in afresh])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):  # by heart
        model(input_ids=torch.tensor([prompt + right]), labels=torch.tensor([prompt + right])
              ).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    cache = rollout.old_logprobs(model, episodes, 1.0, greedy.pad_id, keep_cache=True)
    vine.mc_values(model, episodes, cache, greedy, vine.MCSettings(k=2))
    for ep in episodes:
        by_definition = [definition["mc_value"](model, tok, ep, start, 2, 32, 0.0)
                         for start in ep.step_starts]
        assert ep.step_values == by_definition
        assert (definition["step_advantages"](model, tok, ep, 2, 32, 0.0)
                == vine.step_advantages(ep.step_values, ep.reward))
    assert ([episodes[e].step_values for e in (0, 1, 4)]
            == [[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def reference_rollout_count(rewards: list[int], k: int, increment: int, max_k: int,
                            ci_width: float) -> int:
    """The reference's loop, one round at a time: how many of `rewards` (in order) it draws."""
    n = k
    while True:
        p = sum(rewards[:n]) / n
        if 2 * 1.96 * (p * (1 - p) / n) ** 0.5 <= ci_width or n >= max_k:
            return n
        n += increment


def adaptive_count(rewards: list[int], k: int, increment: int, max_k: int, ci_width: float) -> int:
    n = k
    while more := vine_cheaper.more_rollouts(rewards[:n], increment, max_k, ci_width):
        n += more
    return n


@pytest.mark.parametrize("k, increment, max_k, ci_width", [(3, 2, 9, 0.6), (2, 1, 8, 0.5),
                                                           (3, 3, 10, 0.05), (4, 3, 11, 0.7),
                                                           (1, 2, 8, 0.9)])
def test_more_rollouts_draws_what_the_reference_draws_on_every_outcome(k, increment, max_k,
                                                                       ci_width):
    # every 0/1 sequence long enough for any stop: the count of the reference's round-by-round loop,
    # whose last round may step past max_k (3, +3, <= 10 draws 12), cut to max_k
    longest = max_k + increment
    for bits in itertools.product((0, 1), repeat=longest):
        assert adaptive_count(list(bits), k, increment, max_k, ci_width) == \
            min(max_k, reference_rollout_count(list(bits), k, increment, max_k, ci_width)), bits


def fake_mc_sampling(monkeypatch):
    """Two episodes of one prompt, and a fake `sample` whose continuation of a prefix [1, 3, ...] is
    right (ends in 3) always, else every other one: (the calls it records, sampling, episodes)."""
    calls = []

    def fake_sample(model, prefixes, n, budgets, sampling, **kw):
        calls.append((len(prefixes), n))
        return [[[3 if p[-1] == 3 or j % 2 else 4] for j in range(n)] for p in prefixes], \
            [[True] * n for _ in prefixes]

    monkeypatch.setattr(fork, "continue_from_cache", fake_sample)
    monkeypatch.setattr(reward, "response_reward", lambda ep, ids, tok: float(ids[-1] == 3))
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=9, eos_id=2, pad_id=0)
    eps = [rollout.Episode([1], [3, 3, 2], "", 0, True, reward=1.0, step_starts=[0, 1]),
           rollout.Episode([1], [4, 3, 2], "", 0, True, reward=1.0, step_starts=[0, 1])]
    return calls, sampling, eps


def test_state_rewards_gives_each_state_its_own_count(monkeypatch):
    """vine.mc_values' `wanted`: K for all is one prefix of K rows a state, else a row each."""
    calls, sampling, eps = fake_mc_sampling(monkeypatch)
    states = vine.distinct_states(eps)
    assert list(states) == [(1,), (1, 3), (1, 4)]
    rewards, tokens = vine.state_rewards(None, eps, CACHE, states, dict.fromkeys(states, 2),
                                         sampling)
    # a row j of a prefix not ending in 3 is right when j is odd
    assert calls == [(3, 2)] and tokens == 6
    assert rewards == {(1,): [0.0, 1.0], (1, 3): [1.0, 1.0], (1, 4): [0.0, 1.0]}
    calls.clear()
    wanted = {(1,): 3, (1, 3): 1, (1, 4): 0}
    rewards, tokens = vine.state_rewards(None, eps, CACHE, states, wanted, sampling)
    assert calls == [(4, 1)] and tokens == 4  # every row is a row 0
    assert rewards == {(1,): [0.0, 0.0, 0.0], (1, 3): [1.0], (1, 4): []}


def test_mc_max_rollouts_is_a_cap(monkeypatch):
    """--mc-rollouts 2 --mc-max-rollouts 3 --mc-increment 50: at most 3 continuations a state (52
    before)."""
    assert (vine_cheaper.more_rollouts([0, 1], 50, 3, 0.05) == 1
            and vine_cheaper.more_rollouts([1, 1], 50, 3, 0.05) == 0)
    calls, sampling, eps = fake_mc_sampling(monkeypatch)
    counts = vine_cheaper.mc_values(None, eps, CACHE, sampling, vine.MCSettings(2),
                                    vine_cheaper.CheaperSettings(max_k=3, increment=50,
                                                                 ci_width=0.05))
    # [1] and [1, 4] are mixed after 2: one more each, 3 in all; [1, 3] agrees and stops at 2
    assert (calls == [(3, 2), (2, 1)] and counts["mc_continuations"] == 3 + 2 + 3
            and counts["mc_states"] == 3)


def test_more_rollouts_hand_computed():
    # the reference's 10, +4, 30, 0.05: ten that agree stop; any disagreement can only stop at 30
    assert (vine_cheaper.more_rollouts([1] * 10, 4, 30, 0.05) == 0
            and vine_cheaper.more_rollouts([0] * 10, 4, 30, 0.05) == 0)
    assert vine_cheaper.more_rollouts([1] * 9 + [0], 4, 30, 0.05) == 20
    assert vine_cheaper.more_rollouts([1] * 29 + [0], 4, 30, 0.05) == 0  # at the cap
    # width 0.5: at n = 14 the least width over 5..9
    # successes is 0.502, at 18 (5 of 18) 0.414: jump 8
    assert vine_cheaper.more_rollouts([1] * 5 + [0] * 5, 4, 30, 0.5) == 8


def adaptive_law(p: float, k=10, increment=4, max_k=30, ci_width=0.05) -> tuple[float, float]:
    """Exactly, for a state of value p: (E[V_hat], E[continuations]) under more_rollouts' rule."""
    from math import comb
    # (n, successes) -> prob
    law = {(k, s): comb(k, s) * p ** s * (1 - p) ** (k - s) for s in range(k + 1)}
    mean = count = 0.0
    while law:
        (n, s), prob = law.popitem()
        more = vine_cheaper.more_rollouts([1] * s + [0] * (n - s), increment, max_k, ci_width)
        if more == 0:
            mean, count = mean + prob * s / n, count + prob * n
        for j in range(more + 1 if more else 0):
            key = (n + more, s + j)
            law[key] = law.get(key, 0.0) + prob * comb(more, j) * p ** j * (1 - p) ** (more - j)
    return mean, count


def test_adaptive_bias_and_cost_enumerated_exactly():
    # the docstring's numbers: biased toward the ends, none at 0.5
    assert adaptive_law(0.9)[0] == pytest.approx(0.9233, abs=1e-4)
    assert adaptive_law(0.1)[0] == pytest.approx(0.0767, abs=1e-4)
    assert adaptive_law(0.5)[0] == pytest.approx(0.5, abs=1e-12)
    assert adaptive_law(1.0) == pytest.approx((1.0, 10.0))
    for p in (0.1, 0.5, 0.9, 0.99):  # 10, then 20 more unless the first 10 agree
        assert adaptive_law(p)[1] == pytest.approx(10 + 20 * (1 - p ** 10 - (1 - p) ** 10))


# A two-step tree: from the prompt [1], step 1 is token 3
# or 4, step 2 is token 3 or 4; the reward of each path
POLICY = {(1,): {3: 0.7, 4: 0.3}, (1, 3): {3: 0.6, 4: 0.4}, (1, 4): {3: 0.2, 4: 0.8}}
TREE_REWARD = {(3, 3): 1.0, (3, 4): 0.0, (4, 3): 0.0, (4, 4): 1.0}


def paths(state=(1,)):
    """(continuation, probability) of every way the policy can go on from `state` to the end."""
    if len(state) == 3:
        return [((), 1.0)]
    return [((a,) + rest, pa * pr) for a, pa in POLICY[state].items()
            for rest, pr in paths(state + (a,))]


def true_value(state) -> float:
    return sum(prob * TREE_REWARD[state[1:] + rest] for rest, prob in paths(state))


def expected_advantages(monkeypatch, k: int, group: int, **options) -> dict:
    """E[A_i | s_i, a_i] of the first episode by exact enumeration of every response of the group
    and every MC continuation of every state, through train.value_with_mc and the step
    advantages (vine.py's, or vine_cheaper.py's with options); and the same with the response
    put into its own baselines (what reuse must not do).
    -> {(i, step tokens): (E, E put in baseline)}"""
    states = [(1,), (1, 3), (1, 4)]
    assignment = {}
    monkeypatch.setattr(fork, "continue_from_cache",
                        lambda model, prefixes, n, budgets, sampling, **kw: (
        [[list(assignment[(tuple(p), j)]) for j in range(n)] for p in prefixes],
        [[True] * n for _ in prefixes]))
    monkeypatch.setattr(reward, "response_reward", lambda ep, ids, tok: TREE_REWARD[tuple(ids)])
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=2, eos_id=2, pad_id=0)
    sums, weights = collections.defaultdict(lambda: [0.0, 0.0]), collections.defaultdict(float)
    continuation_sets = [list(itertools.product(paths(s), repeat=k)) for s in states]
    for responses in itertools.product(paths(), repeat=group):
        for conts in itertools.product(*continuation_sets):
            weight = math.prod(p for _, p in responses) * math.prod(p for c in conts for _, p in c)
            assignment = {(s, j): c[j][0] for s, c in zip(states, conts) for j in range(k)}
            eps = [rollout.Episode([1], list(r), "", 0, True, reward=TREE_REWARD[r],
                                   step_starts=[0, 1])
                   for r, _ in responses]
            cheaper = vine_cheaper.CheaperSettings(**options)
            train.value_with_mc(None, eps, CACHE, sampling, vine.MCSettings(k), cheaper)
            ep = eps[0]
            advantages = vine_cheaper.episode_step_advantages(ep, cheaper.reuse)
            own = [(n * v + ep.reward) / (n + 1)
                   for v, n in zip(ep.step_values, ep.step_counts or [k] * 2)]
            # the response in the baseline of its own steps
            wrong = vine.step_advantages(own, ep.reward)
            for i in range(2):
                key = (i, tuple(ep.response_ids[: i + 1]))
                sums[key][0] += weight * advantages[i]
                sums[key][1] += weight * wrong[i]
                weights[key] += weight
    return {key: (a / weights[key], b / weights[key]) for key, (a, b) in sums.items()}


@pytest.mark.parametrize("k, group, options", [(1, 1, {}), (2, 1, dict(reuse=True)),
                                               (1, 2, dict(reuse=True)),
                                               (2, 2, dict(reuse=True, top_up=True))])
def test_reused_responses_keep_the_advantage_unbiased(monkeypatch, k, group, options):
    result = expected_advantages(monkeypatch, k, group, **options)
    assert len(result) == 6  # A_0 after 3 or 4, A_1 after each of the four paths
    for (i, taken), (mean, wrong) in result.items():
        state = (1,) + taken[:i]
        q = true_value(state + taken[i:])  # Q(s_i, a_i) = V(s_{i+1}); V(s_2) = the path's reward
        assert mean == pytest.approx(q - true_value(state), abs=1e-12), (i, taken)
        if options and i == 1:  # the response in its own baseline: E[A_1] shrinks by n / (n + 1)
            assert abs(wrong - (q - true_value(state))) > 0.05, (i, taken)


# ---- the step rule, exactly: every response of a tabular policy enumerated -----------------------

def tabular_toy(texts: list[str], right: int, length: int, needs_answer: bool, seed: int):
    """A policy with its own logits for every history: each response of up to `length` tokens,
    its probability (differentiable in the logits) and its reward, and V of every prefix.

    Token `right` ends a response with reward 1 (with needs_answer, only after a '####' token);
    the other end token with 0; a response still going after `length` tokens is unfinished: 0."""
    ends = {right, len(texts) - 1} if right != len(texts) - 1 else {right}
    steps = [v for v in range(len(texts)) if v not in ends]
    histories = [()]
    for h in histories:  # breadth first: every history of fewer than `length` tokens
        histories += [h + (v,) for v in steps] if len(h) + 1 < length else []
    row = {h: i for i, h in enumerate(histories)}
    logits = torch.randn(len(histories), len(texts), dtype=torch.float64,
                         generator=torch.Generator().manual_seed(seed)).requires_grad_()
    table = torch.log_softmax(logits, -1)
    logp = lambda h, v: table[row[h], v]
    responses = [h + (v,) for h in histories for v in range(len(texts))
                 if v in ends or len(h) + 1 == length]
    outcome = lambda y: float(y[-1] == right and (not needs_answer or "####" in
                                                  "".join(texts[v] for v in y)))
    rewards = {y: outcome(y) for y in responses}
    log_p = {y: sum(logp(y[:t], y[t]) for t in range(len(y))) for y in responses}
    sums = collections.defaultdict(lambda: [0.0, 0.0])  # h -> [E[R; y begins with h], P(h)]
    for y in responses:
        p = torch.exp(log_p[y]).item()
        for b in range(len(y)):
            sums[y[:b]][0] += p * rewards[y]
            sums[y[:b]][1] += p
    value = {h: total / weight for h, (total, weight) in sums.items()}  # V(h) = E[R | h], exact
    return logits, logp, log_p, rewards, value


def expected_gradients(texts, rule, right, needs_answer, seed, reuse_m=0):
    """(grad E[R], the expected gradient of VinePPO's surrogate, the largest gap between
    E[R | s is a state of the response] and V(s)): exact values, ratio 1, no whitening, no KL;
    reuse_m > 0: the response joins V(s_{i+1}) with m other samples (vine_cheaper)."""
    logits, logp, log_p, rewards, value = tabular_toy(texts, right, 5, needs_answer, seed)
    expected_reward = sum(torch.exp(log_p[y]) * r for y, r in rewards.items())
    true = torch.autograd.grad(expected_reward, logits, retain_graph=True)[0]
    surrogate, through = 0.0, collections.defaultdict(lambda: [0.0, 0.0])
    for y, r in rewards.items():
        starts = rule([texts[v] for v in y])
        values = [value[y[:b]] for b in starts]
        steps = (vine_cheaper.reuse_step_advantages(values, r, [reuse_m] * len(values))
                 if reuse_m else vine.step_advantages(values, r))
        advantages = vine.token_advantages(starts, steps, len(y))
        p = torch.exp(log_p[y]).item()
        surrogate = surrogate + p * sum(a * logp(y[:t], y[t]) for t, a in enumerate(advantages))
        for b in starts[1:]:  # a reused sample of V(s): R of a response that has s as a state
            through[y[:b]][0] += p * r
            through[y[:b]][1] += p
    expected = torch.autograd.grad(surrogate, logits)[0]
    reuse_gap = max(abs(total / weight - value[s]) for s, (total, weight) in through.items())
    return true, expected, reuse_gap


def answer_joined_step_starts(texts: list[str]) -> list[int]:
    """Every '\\n' closes its step but the one before '####': the reference's answer rule."""
    text = "".join(texts)
    opens = [c + 1 for c, char in enumerate(text) if char == "\n" and text[:c].strip()
             and "####" not in text[:c] and not text.startswith("####", c + 1)]
    return vine.token_steps(texts, opens)


@pytest.mark.parametrize("texts, right, needs_answer", [
    (["a", "\n", "", ""], 2, False),                # lines, a right and a wrong end
    (["a", "\n", "####", "", ""], 3, True)])        # and an answer marker the reward needs
def test_every_newline_closing_its_step_is_exactly_unbiased(texts, right, needs_answer):
    """The expected gradient of VinePPO's surrogate with exact values equals grad E[R] under
    vine.line_step_offsets (a state is decided by its own tokens), and not under the reference's
    rule (a step opens at the '\n' before its line: a state depends on its next token)."""
    for seed in range(3):
        for reuse_m in (0, 2):
            true, ours, gap = expected_gradients(texts, line_steps, right,
                                                 needs_answer, seed, reuse_m)
            assert true.abs().max() > 0.01
            assert (ours - true).abs().max() < 1e-12 and gap < 1e-12, (seed, reuse_m)
    # the reference's rule: biased, and a reused sample misses V(s) by far
    biased = [expected_gradients(texts, reference_step_starts, right, needs_answer, seed)
              for seed in range(3)]
    assert max((theirs - true).abs().max() for true, theirs, _ in biased) > 1e-3
    assert max(gap for _, _, gap in biased) > 0.5
    if needs_answer:  # lines closed by their '\n', but the answer joining the last: biased too
        joined = [expected_gradients(texts, answer_joined_step_starts, right, True, seed)
                  for seed in range(3)]
        assert max((theirs - true).abs().max() for true, theirs, _ in joined) > 1e-3


def test_mc_values_adaptive_rounds_and_top_up_counts(monkeypatch):
    calls, sampling, eps = fake_mc_sampling(monkeypatch)
    counts = vine_cheaper.mc_values(None, eps, CACHE, sampling, vine.MCSettings(3),
                                    vine_cheaper.CheaperSettings(max_k=9, increment=2,
                                                                 ci_width=0.05))
    # round 1: 3 states x 3; [1, 3] agrees and stops;
    # [1] and [1, 4] are mixed, straight to 9: one call
    assert (calls == [(3, 3), (2, 6)] and counts["mc_continuations"] == 3 + 9 + 9
            and counts["mc_states"] == 3)
    assert (eps[0].step_values == [4 / 9, 1.0] and eps[1].step_values == [4 / 9, 4 / 9]
            and eps[0].step_counts == [])
    calls.clear()
    counts = vine_cheaper.mc_values(None, eps, CACHE, sampling, vine.MCSettings(3),
                                    vine_cheaper.CheaperSettings(reuse=True, top_up=True))
    # the prompt has one other response through it: 2
    # continuations; [1, 3] and [1, 4]: none, so 3 each
    assert calls == [(8, 1)] and counts["mc_continuations"] == 8  # one call: a row per continuation
    # [1]: 4, 4 and ep 1's R
    assert eps[0].step_counts == [3, 3] and eps[0].step_values == [1 / 3, 1.0]
    with pytest.raises(ValueError):
        vine_cheaper.mc_values(None, eps, CACHE, sampling, vine.MCSettings(3),
                               vine_cheaper.CheaperSettings(top_up=True))


# ---- rollouts and forking -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval().double()  # float64: greedy ties cannot flip


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]


def test_forked_greedy_equals_reencoded_greedy(model):
    seqs = random_seqs([30, 17, 25])
    ids, mask = rollout.pad_right(seqs, 0)
    _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
    prefixes = [seqs[0][:12], seqs[0][:30], seqs[1][:5], seqs[2][:25], seqs[1][:17]]
    rows = [0, 0, 1, 2, 1]
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=12, eos_id=2, pad_id=0)
    forked, _ = fork.continue_from_cache(model, prefixes, 3, [12] * 5, greedy, cache=cache,
                                               rows=rows)
    for prefix, row, forks in zip(prefixes, rows, forked):
        alone, _ = rollout.sample(model, [prefix], 1, [12], greedy)  # encoded alone, unbatched
        assert len(set(map(tuple, forks))) == 1 and forks[0] == alone[0][0]
        assert len(set(forks[0])) > 1  # a non-trivial continuation
        # the plain fork of this one state
        assert fork.fork_one_state(model, cache, row, prefix, 3, 12, greedy)[0] == forks


def test_mc_values_by_definition_equal_the_forks(model, monkeypatch):
    """--no-fork (cache None: each state encoded afresh, rollout.sample_by_definition) and the
    fork give the same continuations greedy, so the same MC values and step advantages, under a
    reward that reads every continuation token."""
    seqs = random_seqs([9, 12, 7])
    episodes = [rollout.Episode([1, 5], seq, "", group=g, finished=True, reward=float(g == 0),
                                step_starts=starts)
                for g, (seq, starts) in enumerate(zip(seqs, ([0, 3, 6], [0, 4], [0, 2, 5])))]
    monkeypatch.setattr(reward, "response_reward", lambda ep, ids, tok: sum(ids) % 7 / 6)
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=16, eos_id=2, pad_id=0)
    cache = rollout.old_logprobs(model, episodes, 1.0, 0, keep_cache=True)
    vine.mc_values(model, episodes, cache, greedy, vine.MCSettings(k=2))
    forked = [(ep.step_values, vine.episode_advantages(ep).tolist()) for ep in episodes]
    vine.mc_values(model, episodes, None, greedy, vine.MCSettings(k=2))
    plain = [(ep.step_values, vine.episode_advantages(ep).tolist()) for ep in episodes]
    assert forked == plain and len({v for values, _ in plain for v in values}) >= 3


def test_no_fork_samples_responses_by_definition_too(model, monkeypatch):
    """--no-fork (Sampling.fork False): rollout.sample encodes each prompt afresh and never forks a
    cache, and greedy gives the responses the fork gives."""
    prompts = random_seqs([5, 8, 3])
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=12, eos_id=2, pad_id=0)
    forked = rollout.sample(model, prompts, 2, [12, 12, 12], greedy)

    def refuse(*args, **kwargs):
        raise AssertionError("forked under --no-fork")
    monkeypatch.setattr(fork, "continue_from_cache", refuse)
    plain = rollout.sample(model, prompts, 2, [12, 12, 12], dataclasses.replace(greedy, fork=False))
    assert plain == forked and any(len(row) > 1 for rows in plain[0] for row in rows)
    assert train.parse_args(["--no-fork"]).no_fork


def first_forward_inputs(model, **generate_kwargs) -> dict:
    """The keyword arguments of the first forward pass `generate` makes."""
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw),
                                                 with_kwargs=True)
    try:
        model.generate(**generate_kwargs, max_new_tokens=1, do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
    return seen[0]


def test_what_the_fork_relies_on_in_generate(model):
    """fork.fork's two assumptions, shown: with a cache of W-1 columns, `generate` feeds
    the model only the ids past the cache's length (transformers v5.25.0
    src/transformers/generation/utils.py, lines 4336 and 704); and it numbers a row's
    positions by the running sum of its mask, minus one (line 923)."""
    ids = torch.tensor([random_seqs([6])[0]])  # [1, W = 6]
    cache = model(input_ids=ids[:, :-1], use_cache=True).cache  # W-1 = 5 columns
    fed = first_forward_inputs(model, input_ids=ids, attention_mask=torch.ones_like(ids),
                               cache=cache)
    assert fed["input_ids"].tolist() == [ids[0, -1:].tolist()]  # the last id alone
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # two columns of left padding
    fed = first_forward_inputs(model, input_ids=ids, attention_mask=mask)
    assert fed["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3]]  # padding 0, then 0, 1, ...


def test_forked_logprobs_equal_full_forward(model):
    """Log-probs through a fork of several prefixes of several rows, over three decoding steps
    (each written into the preallocated cache), equal those of the full forward pass."""
    seqs = random_seqs([20, 9, 14], seed=2)
    ids, mask = rollout.pad_right(seqs, 0)
    full, cache = rollout.token_logprobs(model, ids, mask, 0.6, keep_cache=True)
    rows, ends = [0, 2, 1, 0], [7, 11, 6, 16]
    prefixes = [seqs[r][:e] for r, e in zip(rows, ends)]
    fork_ids, attn, forked = fork.fork(cache, prefixes, rows, 1, 3, pad_id=0)
    for step in range(3):  # feed the true next tokens one at a time
        last = torch.tensor([seqs[r][e - 1 + step] for r, e in zip(rows, ends)])[:, None]
        out = model(input_ids=last, attention_mask=attn, cache=forked,
                    position_ids=torch.tensor(ends)[:, None] - 1 + step)
        logp = (out.logits[:, -1] / 0.6).log_softmax(-1)
        for i, (r, e) in enumerate(zip(rows, ends)):
            assert (logp[i, seqs[r][e + step]].item()
                    == pytest.approx(full[r, e - 1 + step].item(), abs=1e-9))
        attn = torch.cat([attn, torch.ones(4, 1, dtype=attn.dtype)], 1)
    assert forked.get_seq_length() == max(ends) + 2


def cut_cost(batches, lengths, budgets, rows, overhead):
    """(padding + overhead per batch, batches) of a batching, computed from its definition."""
    padding = sum(rows[j] * (max(lengths[i] for i in b) + max(budgets[i] for i in b)
                             - lengths[j] - budgets[j])
                  for b in batches for j in b)
    return padding + overhead * len(batches), len(batches)


def test_least_padding_hand_example():
    # 2 x 2 <= 20 and 2 x 10 <= 20, one batch of all would be 4 x 10 = 40 > 20: padding 1 + 1
    assert (batching.least_padding([9, 1, 10, 2], [0] * 4, [1] * 4, 20, overhead=2)
            == [[1, 3], [0, 2]])
    # no padding
    assert batching.least_padding([9, 1, 10, 2], [0] * 4, [1] * 4, 20) == [[1], [3], [0], [2]]
    # a batch costs 3: cutting [1, 2] from [9, 10] saves 16 of padding, cutting [1] from [2] only 1
    assert (batching.least_padding([9, 1, 10, 2], [0] * 4, [1] * 4, 100, overhead=3)
            == [[1, 3], [0, 2]])
    assert batching.least_padding([1, 2], [0, 0], [1, 1], 100, overhead=3) == [[0, 1]]
    # over the budget: alone
    assert batching.least_padding([50, 1], [0, 0], [1, 1], 10) == [[1], [0]]
    assert batching.padding_fraction([[0, 1]], [1, 3], [2, 0], [1, 1]) == pytest.approx(1 - 6 / 10)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 4), st.integers(1, 3)), min_size=1,
                max_size=7),
       st.integers(5, 60), st.sampled_from([0, 4, 30]))
def test_least_padding_is_the_best_of_every_cut(items, max_tokens, overhead):
    """Against every set of cut points of the items sorted by length (then budget): the least cost
    (fewest batches on a tie); every item exactly once; no batch over the budget but a lone item."""
    lengths, budgets, rows = map(list, zip(*items))
    batches = batching.least_padding(lengths, budgets, rows, max_tokens, overhead)
    assert sorted(j for b in batches for j in b) == list(range(len(items)))
    tokens = lambda b: (sum(rows[j] for j in b)
                        * (max(lengths[j] for j in b) + max(budgets[j] for j in b)))
    assert all(tokens(b) <= max_tokens or len(b) == 1 for b in batches)
    order = sorted(range(len(items)), key=lambda j: (lengths[j], budgets[j]))
    best = None
    for cuts in itertools.product([False, True], repeat=len(items) - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(items)]
        cand = [order[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        if all(tokens(b) <= max_tokens or len(b) == 1 for b in cand):
            cost = cut_cost(cand, lengths, budgets, rows, overhead)
            best = cost if best is None else min(best, cost)
    assert cut_cost(batches, lengths, budgets, rows, overhead) == best


def test_group_chunks_keep_prompts_whole_within_the_budget():
    # group -> its episodes' prompt + response
    lengths = {0: [5, 9], 1: [30, 31, 30], 2: [6], 3: [28, 2]}
    episodes = [rollout.Episode([1] * 2, [3] * (n - 2), "", g, True) for g, ns in lengths.items()
                for n in ns]
    index = lambda chunks: [[next(i for i, e in enumerate(episodes) if e is ep) for ep in c]
                            for c in chunks]
    # sorted by longest: groups 2, 0, 3, 1 (rows 1, 2, 2, 3); 1 x 3 of padding for a batch fewer,
    # groups 0 and 3 would be 4 x 28 > 100
    assert (index(batching.group_chunks(episodes, 100, overhead=20))
            == [[0, 1, 5], [2, 3, 4], [6, 7]])
    assert (index(batching.group_chunks(episodes, 100, overhead=2))
            == [[0, 1], [2, 3, 4], [5], [6, 7]])
    # all fit (8 x 31): padding 25 + 2 x 22 + 2 x 3 = 75 against 3 and 2 x 3 in two batches
    assert index(batching.group_chunks(episodes, 1000, overhead=20)) == [[0, 1, 5], [2, 3, 4, 6, 7]]
    assert index(batching.group_chunks(episodes, 1000, overhead=100)) == [list(range(8))]


def test_greedy_continuations_whatever_the_batching(model, monkeypatch):
    """At T = 0 the fork's continuations do not depend on how the states are cut into batches."""
    seqs = random_seqs([30, 17, 25])
    ids, mask = rollout.pad_right(seqs, 0)
    _, cache = rollout.token_logprobs(model, ids, mask, 1.0, keep_cache=True)
    prefixes = [seqs[0][:12], seqs[0][:30], seqs[1][:5], seqs[2][:25], seqs[1][:17], seqs[2][:6]]
    rows, budgets = [0, 0, 1, 2, 1, 2], [12, 4, 12, 8, 10, 12]
    outs = []
    for max_tokens, overhead in ((1, 0), (120, 10 ** 6), (300, 10 ** 6), (10 ** 6, 10 ** 6)):
        # a batch per state ... one of all
        monkeypatch.setattr(batching, "batch_overhead", lambda _: overhead)
        greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=12, eos_id=2, pad_id=0,
                                  max_batch_tokens=max_tokens)
        cuts = batching.least_padding(list(map(len, prefixes)), budgets, [2] * 6, max_tokens,
                                      overhead)
        outs.append((len(cuts), fork.continue_from_cache(model, prefixes, 2, budgets, greedy,
                                                               cache=cache, rows=rows)))
    assert [n for n, _ in outs] == [6, 4, 2, 1] and all(out == outs[0][1] for _, out in outs)


def test_token_logprobs_temperature_and_alignment(model):
    ids = torch.tensor([[1, 5, 7, 9]])
    logp, _ = rollout.token_logprobs(model, ids, torch.ones_like(ids), 0.5)
    logits = model(input_ids=ids).logits[0]
    for t in range(3):
        expected = torch.log_softmax(logits[t] / 0.5, -1)[ids[0, t + 1]]
        assert logp[0, t].item() == pytest.approx(expected.item(), abs=1e-9)


def test_sample_budget_and_finish_flags(model):
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=5, eos_id=2, pad_id=0)
    conts, done = rollout.sample(model, random_seqs([6, 6]), 2, [3, 5], sampling)
    for cs, fs, budget in zip(conts, done, [3, 5]):
        for c, f in zip(cs, fs):
            assert 1 <= len(c) <= budget and f == (c[-1] == 2) and 2 not in c[:-1]


def test_mc_estimate_matches_the_exact_value_by_enumeration():
    """A tiny policy (6 tokens, at most 3 new ones) where a state's true value can be enumerated:
    the mean reward of sampled continuations, plain and forked, matches it within 4 s.e."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5,
                         max_position_embeddings=32, eos_token_id=2)
    m = LlamaForCausalLM(config).eval()
    temperature, eos, budget = 0.6, 2, 3
    # any function of the outcome
    reward = lambda cont, done: float(3 in cont) * (1.0 if done else 0.5)

    @torch.no_grad()
    def exact(prefix, new, depth):  # sum over every continuation of p(continuation) * reward
        if depth == 0:
            return reward(new, False)  # out of budget: unfinished
        p = torch.softmax(m(torch.tensor([prefix + new])).logits[0, -1].double() / temperature, -1)
        return sum(p[t].item() * (reward(new, True) if t == eos
                                  else exact(prefix, new + [t], depth - 1))
                   for t in range(6))

    state, longer = [1, 4, 5, 0], [1, 4, 5, 0, 3, 3, 4]
    truth = exact(state, [], budget)
    assert 0.05 < truth < 0.95
    ids, mask = rollout.pad_right([longer, [1, 5]], 0)
    _, cache = rollout.token_logprobs(m, ids, mask, temperature, keep_cache=True)
    n = 4000
    # re-encoded, and forked from a longer sequence
    for forked in (False, True):
        sampling = rollout.Sampling(temperature=temperature, top_p=1.0, max_new_tokens=budget,
                                    eos_id=eos, pad_id=0)
        if forked:
            conts, done = fork.continue_from_cache(m, [state], n, [budget], sampling,
                                                         cache=cache, rows=[0])
        else:
            conts, done = rollout.sample(m, [state], n, [budget], sampling)
        estimate = sum(reward(c, d) for c, d in zip(conts[0], done[0])) / n
        # rewards in [0, 1]: var <= v(1-v)
        assert abs(estimate - truth) < 4 * math.sqrt(truth * (1 - truth) / n)


# ---- PPO ----------------------------------------------------------------------------------

def test_ppo_loss_hand_example():
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.5]]))
    old = torch.log(torch.tensor([[0.4, 0.6, 0.5]]))       # ratios 1.5, 0.5, 1.0
    ref = torch.log(torch.tensor([[0.3, 0.3, 0.25]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])                  # third token is padding
    loss, st = ppo.ppo_loss(logp, old, ref, adv, mask, clip=0.2, kl_coef=0.1)
    pg = (max(-1.5, -1.2) + max(0.5, 0.8)) / 2              # = (-1.2 + 0.8) / 2
    k3 = [0.5 - math.log(0.5) - 1, 1 - 0 - 1]               # exp(d) - d - 1, d = log(ref / logp)
    assert st["policy_loss"] == pytest.approx(pg)
    assert loss.item() == pytest.approx(pg + 0.1 * sum(k3))
    assert st["clipfrac"] == pytest.approx(1.0)
    assert st["approx_kl"] == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2)


def test_ppo_loss_ignores_what_lies_outside_the_response():
    """A prompt token's log-prob of -200 (where ref_logp is collate's 0) changes neither the loss
    nor its gradient: exp(200) would be inf in fp32, and inf x the mask's 0 is NaN."""
    old = torch.log(torch.tensor([[0.5, 0.4, 0.6]]))
    ref = torch.tensor([[0.0, math.log(0.3), math.log(0.5)]])
    adv, mask = torch.tensor([[0.0, 1.0, -1.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    results = []
    for prompt_logp in (-1.0, -200.0):
        logp = torch.tensor([[prompt_logp, math.log(0.4), math.log(0.6)]], requires_grad=True)
        loss, _ = ppo.ppo_loss(logp, old, ref, adv, mask, kl_coef=0.1)
        loss.backward()
        results.append((loss.item(), logp.grad.tolist()))
    k3 = [0.3 / 0.4 - math.log(0.3 / 0.4) - 1, 0.5 / 0.6 - math.log(0.5 / 0.6) - 1]
    assert results[0][0] == pytest.approx((-1.0 + 1.0) / 2 + 0.1 * sum(k3), rel=1e-5)  # ratios 1
    assert results[1] == results[0] and math.isfinite(results[1][0])


def test_ppo_loss_skips_exploded_batch_and_kl_clamp():
    logp, old = torch.zeros(1, 2), torch.full((1, 2), -5.0)  # ratio e^5 > 10
    loss, st = ppo.ppo_loss(logp, old, old, torch.ones(1, 2), torch.ones(1, 2))
    assert st["skipped"] == 1.0 and loss.item() == 0.0
    kl_only, _ = ppo.ppo_loss(logp, logp, torch.full((1, 2), 30.0), torch.zeros(1, 2),
                              torch.ones(1, 2), kl_coef=1.0)
    assert kl_only.item() == pytest.approx(20.0)  # each token's k3 clamped to 10, summed


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = ppo.masked_whiten(x, mask)
    # unbiased std of 1,2,3 is 1
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[0, 3].item() == 0.0


def test_masked_whiten_with_global_statistics():
    """Two processes whiten their halves of a minibatch with its global mean and variance: the
    all_reduce here adds what the other process would contribute, hand-computed."""
    x = torch.tensor([[1.0, 5.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # the half [7, 8]
    other = [torch.tensor([7.0 + 8.0, 2.0]), torch.tensor((7.0 - 4.8) ** 2 + (8.0 - 4.8) ** 2)]
    calls = iter(other)
    w = ppo.masked_whiten(x, mask, all_reduce=lambda t: t + next(calls))
    # all five: 1, 5, 3, 7, 8 -> mean 4.8, unbiased variance 8.2
    expected = [(v - 4.8) / 8.2 ** 0.5 for v in (1.0, 5.0, 3.0)]
    assert [w[0, 0].item(), w[0, 1].item(), w[1, 0].item()] == pytest.approx(expected, abs=1e-6)
    assert w[0, 2].item() == w[1, 1].item() == 0.0


def test_merge_metrics_of_several_processes():
    from engineering import parallel
    rows = [({"episodes": 8, "mc_states": 10}, {"train_reward": 0.5, "lr": 1e-5},
             {"time_mc_values": 2.0, "seconds": 5.0}),
            ({"episodes": 8, "mc_states": 14}, {"train_reward": 0.75, "lr": 1e-5},
             {"time_mc_values": 3.0, "seconds": 4.0})]
    assert parallel.merge_metrics(rows) == {"episodes": 16, "mc_states": 24, "train_reward": 0.625,
                                            "lr": 1e-5, "time_mc_values": 3.0, "seconds": 5.0}
    assert parallel.merge_metrics(rows[:1]) == {**rows[0][0], **rows[0][1], **rows[0][2]}


def test_live_tensor_bytes_counts_the_peak():
    """The CPU memory counter behind bench.py's peak-memory figures, on known allocations."""
    import gc
    import bench
    with bench.LiveTensorBytes() as counter:
        a = torch.zeros(1000, 1000)            # 4 MB
        b = a + 1                              # 8 MB live
        view = b[:10]                          # a view: no new storage
        del a
        gc.collect()
        c = torch.zeros(500, 1000)             # 6 MB live
        assert counter.live == 6_000_000 and view.shape == (10, 1000)
    assert counter.peak == 8_000_000 and c.numel() == 500_000


def naive_gae(rewards, values, gamma, lam):
    """The textbook per-step loop on one unpadded trajectory."""
    adv, T = [0.0] * len(rewards), len(rewards)
    for t in range(T):
        for l in range(T - t):
            v_next = values[t + l + 1] if t + l + 1 < T else 0.0
            adv[t] += (gamma * lam) ** l * (rewards[t + l] + gamma * v_next - values[t + l])
    return adv


def test_gae_matches_naive_loop_and_closed_form():
    g = torch.Generator().manual_seed(0)
    values = torch.rand(3, 6, generator=g)
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] * 2 + [0.0] * 4])
    rewards = torch.zeros(3, 6)
    for i, n in enumerate([6, 4, 2]):
        rewards[i, n - 1] = float(i % 2 == 0)
    rewards[0, 2] = 0.5  # an intermediate reward too
    for gamma, lam in [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0)]:
        adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
        for i, n in enumerate([6, 4, 2]):
            expected = naive_gae(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
            assert adv[i, :n].tolist() == pytest.approx(expected, abs=1e-6)
            assert (adv[i, n:].abs().sum() == 0
                    and ret[i, :n].tolist() == pytest.approx((adv + values)[i, :n].tolist()))
    adv, ret = ppo.gae(rewards[1:], values[1:], mask[1:], 1.0, 1.0)  # sparse reward: A_t = R - V_t
    assert adv[0, :4].tolist() == pytest.approx((0.0 - values[1, :4]).tolist())
    assert (adv[1, :2].tolist() == pytest.approx((1.0 - values[2, :2]).tolist())
            and ret[1, :2].tolist() == [1.0, 1.0])


def test_group_advantages_hand_example():
    adv = ppo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
                               torch.tensor([0, 0, 0, 0, 1, 1]))
    # std 0.5 in group 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.0, 0.0], abs=1e-5)


def test_explained_variance():
    mask = torch.ones(1, 4)
    returns = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((1, 4), 0.5), returns, mask) == pytest.approx(0.0)


def test_tracking_logits_are_prior_plus_running_sum():
    o = torch.tensor([[9.0, 0.5, 1.0, -2.0, 3.0], [0.25, 7.0, 1.0, 2.0, 0.0]])
    z = value.tracking_logits(o, torch.tensor([2, 3]))  # b at position P-1, h from position P on
    assert z[0].tolist() == [0.0, 0.5, 1.5, -0.5, 2.5]  # b = 0.5, then +1, -2, +3
    assert z[1].tolist() == [0.0, 0.0, 1.0, 3.0, 3.0]


@pytest.fixture(scope="module")
def backbone(model):
    return copy.deepcopy(model.base_model).float()


def test_tracking_head_zero_init_and_bce_learns(backbone):
    torch.manual_seed(0)
    critic = value.Critic(copy.deepcopy(backbone), "tracking")
    ids = torch.randint(3, 40, (8, 10))
    mask, plens = torch.ones_like(ids), torch.full((8,), 4)
    v = critic.values(ids, mask, plens)
    assert torch.all(v[:, 3:] == 0.5)  # zero-initialised: V = sigmoid(b) = sigmoid(0) everywhere
    # a learnable problem: the outcome is whether token 6 (a response token) is even
    rewards = (ids[:, 6] % 2 == 0).float()
    act = (torch.arange(9)[None, :] >= 3).float().expand(8, 9)
    opt = torch.optim.Adam(critic.head.parameters(), lr=0.05)
    losses = []
    for _ in range(60):
        loss, _ = critic.loss(critic(ids, mask, plens), None, None, rewards, act)
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < 0.8 * losses[0]


def test_scalar_value_clipping_hand_example(backbone):
    critic = value.Critic(copy.deepcopy(backbone), "scalar")
    # out is forward's [B, L]: its last column, the terminal state's, is no action's
    out, old = torch.tensor([[0.9, 0.1, 5.0]]), torch.tensor([[0.5, 0.2]])
    returns, mask = torch.tensor([[1.0, 0.0]]), torch.ones(1, 2)
    loss, st = critic.loss(out, old, returns, None, mask, clip=0.2)
    # token 0: clipped to 0.7 -> max(0.01, 0.09) = 0.09; token 1: within the clip -> 0.01
    assert loss.item() == pytest.approx(0.5 * (0.09 + 0.01) / 2) and st["value_clipfrac"] == 0.5


def test_optimizer_step_skips_nonfinite_gradients():
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    (model(torch.tensor([[float("nan"), 1.0]])).sum()).backward()
    assert ppo.optimizer_step(model, optim, sched) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    (model(torch.tensor([[3.0, 4.0]])).sum() * 10).backward()
    assert (ppo.optimizer_step(model, optim, sched, max_norm=1.0)
            == pytest.approx(10 * math.sqrt(26)))
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_lr_schedule():
    assert ppo.lr_factor(0, 100, 10) == 0.0
    assert ppo.lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert ppo.lr_factor(55, 100, 10) == pytest.approx(0.5)
    assert ppo.lr_factor(100, 100, 10) == 0.0


@pytest.mark.parametrize("warmup, expected", [(0, [1.0, 0.75, 0.5, 0.25]),
                                              (1, [0.0, 1.0, 2 / 3, 1 / 3]),
                                              (2, [0.0, 1.0, 1.0, 0.5])])
def test_lr_schedule_short_warmups(warmup, expected):
    """A warm-up of 0, 1 or 2 steps (the demo's --iterations 3 or 4 round 3% to one step): no
    0/0."""
    assert [ppo.lr_factor(step, 4, warmup) for step in range(4)] == pytest.approx(expected)


def tiny_llama(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=dropout, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


def scored_episodes(model, rewards_by_group, lengths):
    """Episodes with random responses of the given lengths, old = ref log-probs of `model` (ratio
    1)."""
    eps, g = [], torch.Generator().manual_seed(3)
    for group, (rewards, lens) in enumerate(zip(rewards_by_group, lengths)):
        for r, n in zip(rewards, lens):
            eps.append(rollout.Episode([1, 5], torch.randint(3, 20, (n,), generator=g).tolist(), "",
                                       group, True, r))
    for ep in eps:
        ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids], 0)
        with torch.no_grad():
            ep.old_logp = ep.ref_logp = rollout.per_response(
                rollout.token_logprobs(model, ids, mask, 1.0)[0], [ep])[0]
    return eps


def run_update(model, eps, whiten):
    learner = ppo.Learner(model, 1e-2, 10, 0, False, "cpu")
    hp = ppo.PPOSettings(epochs=1, minibatch=len(eps), micro_batch=len(eps), temperature=1.0,
                         clip=0.2, kl_coef=0.0, value_clip=0.2, whiten=whiten)
    return ppo.ppo_update(eps, learner, None, hp, move_policy=True, pad_id=0, device="cpu",
                          autocast=contextlib.nullcontext())


def test_grpo_zero_variance_group_gets_zero_advantage_and_gradient(monkeypatch):
    """GRPO's group-normalised advantage is used as GRPO defines it: no second, token-level
    centring, which would push a group whose answers were all right (advantage 0) by the others'
    lengths."""
    model = tiny_llama()
    eps = scored_episodes(model, [[1.0, 1.0], [1.0, 0.0]], [[3, 3], [2, 6]])
    ppo.assign_advantages("grpo", eps, 1.0, 1.0, 1.0)
    assert [ep.advantages[0].item() for ep in eps] == pytest.approx([0, 0, 1, -1], abs=1e-5)
    seen, loss = [], ppo.ppo_loss
    monkeypatch.setattr(ppo, "ppo_loss",
                        lambda logp, old, ref, adv, act, *a, **kw: seen.append((adv, act)) or
                        loss(logp, old, ref, adv, act, *a, **kw))
    for whiten, group_a_is_zero in [(False, True), (True, False)]:
        seen.clear()
        run_update(copy.deepcopy(model), eps, whiten)
        # rows in shuffled order; the all-correct group's responses are the 3-token ones
        adv, act = seen[0]
        zero = all(adv[i][act[i] > 0].abs().max() < 1e-6 for i in range(len(eps))
                   if act[i].sum() == 3)
        assert zero == group_a_is_zero
    before = [p.detach().clone() for p in model.parameters()]
    # only the all-correct group: no gradient at all
    stats = run_update(model, eps[:2], whiten=False)
    assert (stats["grad_norm"] == 0.0
            and all(torch.equal(a, b) for a, b in zip(before, model.parameters())))


SPLIT_LENGTHS = [[2, 7, 3], [5, 1, 4]]  # one minibatch of six responses; halves of 12 and 10 tokens


def split_episodes():
    """Six episodes of different lengths, old and reference log-probs off the policy's (ratios clip,
    the KL is not 0), random advantages, critic values and returns: one minibatch for PPO and a
    critic."""
    eps, g = (scored_episodes(tiny_llama(), [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], SPLIT_LENGTHS),
              torch.Generator())
    g.manual_seed(5)
    for ep in eps:
        n = len(ep.response_ids)
        ep.old_logp = ep.old_logp + 0.3 * torch.randn(n, generator=g)
        ep.ref_logp = ep.ref_logp - 0.5 * torch.rand(n, generator=g)
        ep.advantages = torch.randn(n, generator=g)
        ep.critic_values, ep.returns = torch.rand(n, generator=g), torch.rand(n, generator=g)
    return eps


def minibatch_gradients(eps, head, micro_batch):
    """One step of the policy and a critic on eps as one minibatch (under torchrun: this process's
    share): ([the policy's gradient, the critic's], ppo_update's statistics)."""
    policy = ppo.Learner(tiny_llama(), 1e-3, 10, 0, False, torch.device("cpu"))
    critic = ppo.Learner(value.Critic(tiny_llama(seed=1).model, head), 1e-3, 10, 0, False,
                         torch.device("cpu"))
    grads, step = [], ppo.optimizer_step

    def capture(model, *args, **kwargs):  # the gradient the optimizer is about to step with
        grads.append([p.grad.clone() for p in model.parameters()])
        return step(model, *args, **kwargs)

    ppo.optimizer_step = capture
    try:
        hp = ppo.PPOSettings(epochs=1, minibatch=len(eps), micro_batch=micro_batch,
                             temperature=1.0, clip=0.2, kl_coef=0.1, value_clip=0.2, whiten=True)
        stats = ppo.ppo_update(eps, policy, critic, hp, move_policy=True, pad_id=0,
                               device=torch.device("cpu"), autocast=contextlib.nullcontext())
    finally:
        ppo.optimizer_step = step
    return grads, stats


def assert_same_update(a, b):
    (grads_a, stats_a), (grads_b, stats_b) = a, b
    for learner_a, learner_b in zip(grads_a, grads_b, strict=True):
        for x, y in zip(learner_a, learner_b, strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-7), (x - y).abs().max()
    assert stats_a.keys() == stats_b.keys() and stats_a["clipfrac"] > 0 and stats_a["kl"] > 0
    assert stats_a == pytest.approx(stats_b, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("head", value.HEADS)
def test_minibatch_gradient_and_losses_do_not_depend_on_the_micro_batch(head):
    """Every loss is a mean over the whole minibatch's tokens (the BCE heads': states), so
    micro-batches of 1 and 3 responses of different lengths step with the gradient of the whole
    minibatch, and log its losses."""
    eps = split_episodes()
    whole = minibatch_gradients(eps, head, micro_batch=6)
    for micro_batch in (1, 3):
        assert_same_update(minibatch_gradients(eps, head, micro_batch), whole)


@pytest.mark.slow
def test_minibatch_gradient_and_losses_do_not_depend_on_the_processes(tmp_path):
    """torchrun --nproc_per_node 2 (gloo): each process takes half of the minibatch (12 and 10
    tokens) in micro-batches of 2 and 1; the averaged gradient and the logged losses are one
    process's on all six. A non-finite loss on one process skips the step on both and is counted
    once."""
    script = tmp_path / "split.py"
    script.write_text(f"import os, sys, torch\nsys.path.insert(0, {HERE!r})\n"
                      "from engineering import parallel\nimport test_vine\n"
                      "rank, world, _ = parallel.init(torch.device('cpu'))\n"
                      "mine = test_vine.split_episodes()[3 * rank: 3 * rank + 3]\n"
                      "out = {head: test_vine.minibatch_gradients(mine, head, 2)"
                      " for head in ('scalar', 'tracking', 'bce')}\n"
                      "if rank == 1:\n    mine[0].old_logp[0] = float('nan')\n"
                      "counts = parallel.gather("
                      "test_vine.minibatch_gradients(mine, 'scalar', 2)[1]['nonfinite_skips'])\n"
                      "if rank == 0:\n"
                      f"    torch.save((out, counts), {str(tmp_path / 'split.pt')!r})\n"
                      "parallel.close()\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(script)], cwd=HERE,
                       env={**OFFLINE, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out, counts = torch.load(tmp_path / "split.pt")
    eps = split_episodes()
    for head in value.HEADS:
        assert_same_update(out[head], minibatch_gradients(eps, head, micro_batch=6))
    assert sum(counts) == 1


def test_a_nonfinite_loss_skips_the_whole_step_in_one_process_too():
    """One process skips what two under torchrun skip: a NaN old log-prob in one micro-batch makes
    the policy's gradient non-finite, so its whole step is skipped (counted once), not taken on
    the other micro-batches; the critic, whose loss is finite, steps."""
    eps = split_episodes()
    eps[0].old_logp[0] = float("nan")
    (policy_grads, critic_grads), stats = minibatch_gradients(eps, "scalar", 2)
    assert not all(torch.isfinite(g).all() for g in policy_grads)
    assert all(torch.isfinite(g).all() for g in critic_grads)
    assert stats["nonfinite_skips"] == 1 and "value_loss" in stats


def test_dropout_only_inside_updates():
    """Sampling, old log-probs and MC continuations see no dropout: a model that has it is in
    training mode only inside the SFT and PPO updates."""
    model = tiny_llama(dropout=0.5)
    eps = scored_episodes(model.eval(), [[1.0, 0.0]], [[4, 5]])
    ppo.assign_advantages("grpo", eps, 1.0, 1.0, 1.0)
    run_update(model, eps, whiten=True)
    assert not model.training
    ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in eps], 0)
    first, second = (rollout.token_logprobs(model, ids, mask, 1.0)[0] for _ in range(2))
    assert torch.equal(first, second)


# ---- value diagnostics --------------------------------------------------------------------

def test_diagnostic_metrics_hand_examples():
    import diagnose
    # state 1: gt ranks a > b > c; pred agrees on (a,b), (a,c), ties on (b,c) -> 2 of 3 right
    # state 2: gt ties (x,y) -> wrong whatever the prediction
    groups = [([0.9, 0.5, 0.1], [0.8, 0.3, 0.3]), ([0.5, 0.5], [0.6, 0.4])]
    assert diagnose.pairwise_accuracy(groups) == pytest.approx(2 / 4)
    rows = [{"trajectory": 0, "step": 0, "n_steps": 3, "gt": 0.50, "est": 0.52},
            {"trajectory": 0, "step": 1, "n_steps": 3, "gt": 0.70, "est": 0.50},
            {"trajectory": 0, "step": 2, "n_steps": 3, "gt": 1.00, "est": 0.90},
            {"trajectory": 1, "step": 0, "n_steps": 1, "gt": 0.20, "est": 0.30}]
    s = diagnose.summarize(rows, "est")
    assert s["mae"] == pytest.approx((0.02 + 0.2 + 0.1 + 0.1) / 4) and s["within_0.05"] == 0.25
    assert (s["mae_early"] == pytest.approx(0.06) and s["mae_middle"] == pytest.approx(0.2)
            and s["mae_late"] == pytest.approx(0.1))
    # deltas within trajectory 0: gt (+0.2, +0.3), est (-0.02, +0.4): two points, correlation 1
    assert diagnose.delta_correlation(rows, "est") == pytest.approx(1.0)


def test_compare_seconds_budget(tmp_path, monkeypatch):
    """compare.py --seconds: a run is stopped once its complete metrics rows hold that many training
    seconds; the arms are compared at them, each by its last evaluation by then, with its lag."""
    import compare

    class Child:  # a train.py that logs an iteration of 4 s at every poll, never ending by itself
        def __init__(self, cmd):
            self.args, self.returncode, self.rows = cmd, None, 0

        def poll(self):
            with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
                self.rows += 1
                f.write(json.dumps({"iteration": self.rows, "seconds": 4.0,
                                    "eval_accuracy": 0.1}) + "\n")
            return self.returncode

        def terminate(self):
            self.returncode = 143

        def wait(self):
            return self.returncode

    os.makedirs(tmp_path / "run")
    monkeypatch.setattr(compare.subprocess, "Popen", Child)
    monkeypatch.setattr(compare.time, "sleep", lambda _: None)
    compare.run(str(tmp_path / "run"), seconds=10)
    # 4, 8, 12: stopped at the first >= 10
    assert compare.training_seconds(str(tmp_path / "run")) == 12.0
    assert os.path.exists(tmp_path / "run" / "finished")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 4, "seco')  # a row still being written is not counted
    assert compare.training_seconds(str(tmp_path / "run")) == 12.0
    # exit 3
    failing = type("Failing", (Child,), {"poll": lambda self: setattr(self, "returncode", 3) or 3})
    monkeypatch.setattr(compare.subprocess, "Popen", failing)
    with pytest.raises(SystemExit) as stop:
        compare.run(str(tmp_path / "other"), seconds=10)
    assert stop.value.code == 3 and not os.path.exists(tmp_path / "other" / "finished")
    a = [[(0, 0.0, 0.2), (1, 9.0, 0.4), (2, 18.0, 0.6), (3, 27.0, 0.7)],
         [(0, 0.0, 0.2), (1, 11.0, 0.5)]]
    b = [[(0, 0.0, 0.2), (1, 4.0, 0.3), (2, 8.0, 0.35), (3, 12.0, 0.4)]]
    summary = compare.summarize({"a": a, "b": b}, budget=10.0)
    assert (summary["a"]["at_budget"] == pytest.approx((0.3, 0.1))
            and summary["a"]["lag"] == pytest.approx(1.0))
    assert summary["b"]["at_budget"] == (0.35, 0.0) and summary["b"]["lag"] == pytest.approx(0.2)
    # the mean of the last
    assert summary["a"]["iterations"] == 2 and summary["b"]["iterations"] == 3
    grid, mean, least, most = compare.on_grid(a, points=3)  # the shorter seed ends at 11 s
    assert grid == [0.0, 5.5, 11.0] and mean == pytest.approx([0.2, 0.2, 0.45])
    assert least == [0.2, 0.2, 0.4] and most == [0.2, 0.2, 0.5]


def test_arith_held_out_questions_are_never_training_questions():
    """For every --arith-steps (with and without traps): each split's questions are distinct and its
    own by split_of, so none is in both; one chain step has 10 * 9 questions, all found, 1 in 5 held
    out."""
    settings = [((lo, hi), None) for lo in range(1, 9) for hi in range(lo, 9)] + \
        [((lo, hi), traps) for lo, hi in ((1, 1), (2, 3), (6, 8), (12, 16), (30, 40))
         for traps in ((0, 2), (1, 3))]
    for steps, traps in settings:
        train, test = ([p["question"] for p in arith_dataset(40, 0, steps, 0.5, traps, split)]
                       for split in ("train", "test"))
        assert (len(set(train)) == len(train) and len(set(test)) == len(test)
                and not set(train) & set(test))
        assert {split_of(q) for q in train} <= {"train"} and {split_of(q) for q in test} <= {"test"}
    every = [p["question"] for split in ("train", "test")
             for p in arith_dataset(2000, 0, (1, 1), split=split)]
    assert len(set(every)) == 90 and sum(split_of(q) == "test" for q in every) == 15


def test_short_chains_and_jsonl_without_eval_data_hold_out_a_split(tmp_path, capsys):
    assert len(load_problems("arith", "test", steps="1-1")) == 15
    assert ("--arith-steps 1-1: the held-out split has only 15 distinct questions"
            in capsys.readouterr().out)
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                            for i in range(50)))
    train, test = (load_problems(str(path), split, hold_out=True) for split in ("train", "test"))
    assert "is held out for evaluation and not trained on" in capsys.readouterr().out
    assert sorted(p["question"] for p in train + test) == sorted(f"q{i}" for i in range(50))
    assert test and not {p["question"] for p in train} & {p["question"] for p in test}
    assert len(load_problems(str(path), "test")) == 50  # with --eval-data: the file as it is
    # q0 is a training question
    path.write_text(json.dumps({"question": "q0", "answer": "#### 0"}) + "\n")
    capsys.readouterr()
    with pytest.raises(DataError, match=r"its 1 problems \(1 distinct questions\) leave the test "
                                        "split empty .*; give --eval-data"):
        load_problems(str(path), "test", hold_out=True)
    assert "is held out" not in capsys.readouterr().out  # refused, not announced first


def test_trap_chains_err_exactly_as_designed():
    """--arith-traps: the answer's lines are right modulo 10 and wrap (carry/borrow) in MIN-MAX of
    them; the demonstration is right wherever its own line does not wrap, and where it does, one too
    high with p = forget (all of them at 1, none at 0: the demonstration is then the answer)."""
    def parse(line):
        lhs, rhs = line.split("=")
        a, op, b = lhs.partition("+") if "+" in lhs else lhs.partition("-")
        exact = int(a) + int(b) if op == "+" else int(a) - int(b)
        return int(a), exact % 10, not 0 <= exact <= 9, int(rhs)

    for forget in (0.0, 0.7, 1.0):
        wrapping, wrong, counts = 0, 0, set()
        for p in arith_dataset(300, seed=5, steps=(6, 9), slip=forget, traps=(1, 3)):
            answer, demo = ([parse(line) for line in text.split("\n")[:-1]]
                            for text in (p["answer"], p["demonstration"]))
            assert 6 <= len(answer) <= 9 and all(right == said for _, right, _, said in answer)
            # each goes on from the last
            assert [a for a, *_ in answer[1:]] == [said for *_, said in answer[:-1]]
            counts.add(sum(wraps for _, _, wraps, _ in answer))
            assert (p["answer"].endswith(f"#### {answer[-1][3]}")
                    and p["demonstration"].endswith(f"#### {demo[-1][3]}"))
            for _, right, wraps, said in demo:
                assert said == right if not wraps else said in (right, (right + 1) % 10)
                wrapping, wrong = wrapping + wraps, wrong + (said != right)
            assert forget or p["demonstration"] == p["answer"]
        assert counts == {1, 2, 3} and wrong / wrapping == pytest.approx(forget, abs=0.05)


def test_compare_summary_hand_example(tmp_path, capsys):
    """compare.py: accuracy at each evaluation against training seconds (evaluation excluded), the
    mean and standard error over seeds, and the accuracy when the fastest method had finished."""
    import compare

    def write(name, rows):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return compare.curve(str(tmp_path / name))

    slow = [write(f"slow{s}",
                  [{"iteration": 0, "eval_accuracy": 0.5}, {"iteration": 1, "seconds": 10.0},
                   {"iteration": 2, "seconds": 10.0, "eval_accuracy": acc}])
            for s, acc in ((0, .7), (1, .9))]
    fast = [write("fast0", [{"iteration": 0, "eval_accuracy": 0.5, "eval_greedy_accuracy": 0.4},
                            {"iteration": 1, "seconds": 5.0},
                            {"iteration": 2, "seconds": 6.0, "eval_accuracy": 0.6,
                             "eval_greedy_accuracy": 0.7}])]
    assert (compare.curve(str(tmp_path / "fast0"), "eval_greedy_accuracy")
            == [(0, 0.0, 0.4), (2, 11.0, 0.7)])
    assert slow[0] == [(0, 0.0, 0.5), (2, 20.0, 0.7)] and fast[0] == [(0, 0.0, 0.5), (2, 11.0, 0.6)]
    summary = compare.summarize({"slow": slow, "fast": fast})
    assert summary["slow"]["final"] == pytest.approx((0.8, 0.1))  # s.e. = stdev 0.1414 / sqrt(2)
    assert summary["slow"]["seconds"] == 20.0 and summary["slow"]["budget"] == 11.0
    # by 11 s only its start was evaluated
    assert summary["slow"]["at_budget"] == pytest.approx((0.5, 0.0))
    assert summary["fast"]["at_budget"] == (0.6, 0.0)
    renamed = {"vineppo": summary["slow"], "grpo": summary["fast"]}
    # sqrt(.1² + 0²)
    assert compare.lead(renamed, "vineppo", "grpo", "final") == pytest.approx((0.2, 0.1))
    assert compare.lead(renamed, "vineppo", "grpo", "at_budget") == pytest.approx((-0.1, 0.0))
    assert [compare.verdict(m_se)
            for m_se in ((0.2, 0.1), (0.21, 0.1), (-0.21, 0.1), (-0.1, 0.0))] == \
        ["within noise", "counts", "counts against",
         "counts against"]  # beyond twice the s.e., not at it
    compare.report({"6-8": renamed, "10-12": renamed}, "greedy accuracy")
    out = capsys.readouterr().out
    assert "vineppo's lead over grpo at equal iterations: 6-8: 0.200 ± 0.100 (within noise), " \
        "10-12: 0.200 ± 0.100 (within noise); growth 0.000 ± 0.141 (within noise)" in out
    # a variant of VinePPO (--variant): its lead over every method, VinePPO's over it once
    compare.report({"10-12": {**renamed, "vineppo-reuse": summary["fast"]}}, "greedy accuracy")
    leads = [line.split(" at equal")[0] for line in capsys.readouterr().out.splitlines()
             if "lead" in line]
    assert leads == (["greedy accuracy: vineppo's lead over grpo"] * 2
                     + ["greedy accuracy: vineppo's lead over vineppo-reuse"] * 2
                     + ["greedy accuracy: vineppo-reuse's lead over grpo"] * 2)


# ---- data errors and end-to-end runs ------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": "a\\n#### 1"}\n{"question": "q"\n',
     r"bad.jsonl:2: not valid JSON"),
    ('{"question": "q", "answer": "no final number"}\n', r"bad.jsonl:1: 'answer' has no final"),
    ('{"answer": "#### 3"}\n', r"bad.jsonl:1: missing .* 'question'"),
    ('{"question": "q", "answer": "x\\n#### seventy"}\n',
     r"bad.jsonl:1: 'answer' has no final '#### <number>'"),
    ("\n\n", r"bad.jsonl: no problems found"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(DataError, match=message):
        read_jsonl(str(bad))


def test_jsonl_with_a_byte_order_mark_is_read(tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b'{"question": "q", "answer": "a\\n#### 1"}\n')
    assert read_jsonl(str(data)) == [{"question": "q", "answer": "a\n#### 1"}]


ADVERSARIAL = ["", "####", "#### ", "#" * 10_000, "9" * 100_000 + "\n#### " + "9" * 100_000,
               "####" * 5000, "#### \u0667\u0662", "#### \x00\x1b[31m72", "\ud800", "#### 7\u200b2",
               "#### ７２", "#### 72\r\n"]


@given(st.text(), st.text())
@settings(max_examples=300, deadline=None)
def test_grader_never_raises_on_any_text(completion, gold):
    assert gsm8k_reward(completion, gold) in (0.0, 1.0)
    assert gsm8k_reward("#### " + completion, "#### 3") in (0.0, 1.0)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_grader_never_raises_on_adversarial_text(text):
    assert gsm8k_reward(text, "72") in (0.0, 1.0) and gsm8k_reward("#### 72", text) in (0.0, 1.0)
    vine.line_step_offsets(text[:5000])  # the step splitter takes any text too


OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no test needs a hub; an unknown id fails at once


def run_train(*args, cwd=HERE):
    return subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args], cwd=cwd,
                          env=OFFLINE, capture_output=True, text=True, timeout=600)


SMALL = ["--iterations", "2", "--prompts-per-iter", "4", "--samples-per-prompt", "2",
         "--mc-rollouts", "2", "--minibatch", "4", "--micro-batch", "2", "--max-new-tokens", "24",
         "--eval-problems", "4", "--eval-samples", "1", "--eval-every", "1", "--save-every", "1",
         "--sft-steps", "3", "--sft-batch", "4"]


@pytest.mark.slow
def test_demo_smoke_run_writes_metrics_and_loadable_checkpoint(tmp_path):
    r = run_train("--out", str(tmp_path), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    for key in ("train_reward", "eval_accuracy", "eval_greedy_accuracy", "kl", "policy_loss",
                "clipfrac", "approx_kl", "advantage_std", "tokens_generated", "seconds",
                *parallel.PHASES):
        assert key in rows[-1]
    assert rows[1]["mc_states"] > 0 and (tmp_path / "samples.jsonl").exists()
    # K = 2 per state
    assert all(row["mc_continuations"] == 2 * row["mc_states"] for row in rows[1:])
    # time_save: the previous iteration's checkpoint (none before the first); seconds: training,
    # evaluation aside
    assert rows[1]["time_save"] == 0.0 and rows[2]["time_save"] > 0 and rows[2]["time_eval"] > 0
    assert rows[2]["seconds"] == pytest.approx(sum(rows[2][phase] for phase in parallel.TRAINING))
    # the settings that differ from the defaults, the demo's included, printed first; all in
    # config.json
    printed = r.stdout.split("settings (")[1].splitlines()[0]
    assert "--sft-steps 3 " in printed and "--lr 0.0001 " in printed and "--algo" not in printed
    assert json.loads((tmp_path / "config.json").read_text())["lr"] == train.DEMO["lr"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    tok = AutoTokenizer.from_pretrained(tmp_path / "checkpoint")
    assert model.config.vocab_size == len(tok) and not (tmp_path / "checkpoint.tmp").exists()


@pytest.mark.slow
def test_adaptive_mc_with_reused_responses_runs(tmp_path):
    r = run_train("--out", str(tmp_path), *SMALL, "--mc-max-rollouts", "6", "--mc-increment", "2",
                  "--mc-reuse")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1:]
    for row in rows:  # 2 continuations per state first, then 4 more where they disagree
        assert (2 * row["mc_states"] <= row["mc_continuations"] <= 6 * row["mc_states"]
                and row["mc_tokens"] > 0)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "tppo", "grpo"])
def test_each_algo_runs_and_checkpoint_reloads(tmp_path, algo):
    warmup = ["--critic-warmup", "1", "--lam", "0.9"] if algo == "tppo" else []
    r = run_train("--algo", algo, "--out", str(tmp_path), *SMALL, *warmup)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1, 2] and "policy_loss" in rows[-1]
    assert rows[-1]["lr"] == 0.0  # the policy's schedule ends at 0, after a --critic-warmup too
    if warmup:  # the first iteration trains the critic only
        assert "policy_loss" not in rows[1] and "value_loss" in rows[1]
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    if algo != "grpo":
        assert "value_loss" in rows[-1] and "explained_variance" in rows[-1]
        critic = checkpoint.load_critic(str(tmp_path / "checkpoint"), "cpu")
        assert critic.head_type == {"ppo": "scalar", "tppo": "tracking"}[algo]


# two answers to one question: after a short SFT the policy writes either, so some rewards are 1 and
# some 0 on any machine's draws (on the arith task after 3 SFT steps every reward may be 0:
# VinePPO's advantages all 0, and weights that did not move would be equal across processes for
# nothing)
COIN_FLIP = [{"question": "Flip a coin.", "answer": f"1+{d - 1}={d}\n#### {d}"} for d in (1, 2) * 4]


@pytest.mark.slow
@pytest.mark.parametrize("algo, shard", [("vineppo", []), ("ppo", ["--fsdp"])])
def test_torchrun_two_processes_stay_in_sync(tmp_path, algo, shard):
    """torchrun --nproc_per_node 2 on CPU (gloo), SFT and 2 iterations, with DDP or FSDP: the SFT
    equals a single process's, afterwards both processes hold identical weights, which moved,
    every iteration's metrics count each prompt once, and --resume continues."""
    out, data = tmp_path / "out", tmp_path / "coin.jsonl"
    data.write_text("".join(json.dumps(problem) + "\n" for problem in COIN_FLIP))
    task = ["--data", str(data), "--eval-data", str(data), "--sft-steps", "40", "--sft-lr", "5e-3"]
    # train.py's main, then each process saves the weights it holds (beside --out, not in it)
    script = tmp_path / "run.py"
    script.write_text(f"import os, sys, torch\nsys.path.insert(0, {HERE!r})\nimport train\n"
                      "from engineering import parallel\n"
                      "policy = train.main(train.parse_args(sys.argv[1:]))\n"
                      "weights = parallel.full_state_dict(policy)\n"  # FSDP: all shards gathered
                      f"torch.save(weights, os.path.join({str(tmp_path)!r}, "
                      "'rank' + os.environ['RANK'] + '.pt'))\n"
                      "parallel.close()\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(script), "--algo", algo, "--out", str(out),
                        *SMALL, *task, *shard], cwd=HERE,
                       env={**OFFLINE, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = run_train("--algo", algo, "--out", str(tmp_path / "alone"), *SMALL, *task,
                      "--iterations", "0")
    assert alone.returncode == 0, alone.stderr[-3000:]
    sft_alone = AutoModelForCausalLM.from_pretrained(tmp_path / "alone" / "reference").state_dict()
    sft_split = AutoModelForCausalLM.from_pretrained(out / "reference").state_dict()
    # SFT split over processes = SFT alone
    assert all(torch.allclose(sft_alone[k], sft_split[k], atol=1e-6) for k in sft_alone)
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint").state_dict()
    # after SFT, before RL
    start = AutoModelForCausalLM.from_pretrained(out / "reference").state_dict()
    assert (all(torch.equal(w0[k], saved[k]) for k in saved)
            and any(not torch.equal(w0[k], start[k]) for k in start))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:  # 4 prompts x 2 samples per iteration, split 2 + 2 over the processes
        assert row["prompts"] == 4 and row["episodes"] == 8 and "eval_accuracy" in row
    # the coin flip's point: a learning signal
    assert any(0 < row["train_reward"] < 1 for row in rows[1:])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", os.path.join(HERE, "train.py"), "--algo", algo,
                        "--out", str(out), *SMALL, *task, *shard, "--iterations", "3", "--resume"],
                       cwd=HERE, env={**OFFLINE, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=600)
    # optimizer states (FSDP: gathered, then re-sharded) and RNG reloaded
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in open(out / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["vineppo", "ppo"])
def test_gradient_checkpointing_runs(tmp_path, algo):
    """--gradient-checkpointing reaches the policy, the critic still trains (ppo), and the MC forks
    of the second iteration, sampled while the policy is in training mode, still get their KV
    cache."""
    cfg = train.parse_args(["--algo", algo, "--out", str(tmp_path), *SMALL,
                            "--gradient-checkpointing"])
    policy = train.main(cfg)
    assert policy.is_activation_checkpointing
    with open(tmp_path / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    assert (last["iteration"] == 2
            and (last["mc_states"] > 0 if algo == "vineppo" else "value_loss" in last))


@pytest.mark.slow
def test_gsm8k_format_path_with_local_model_and_jsonl(tmp_path):
    """The paper's code path (a from_pretrained model, GSM8K-format data, paper defaults) on a tiny
    model."""
    models.build_tiny_model(str(tmp_path / "model"), seed=0)
    data = tmp_path / "gsm8k_fixture.jsonl"
    problems = [{"question": "Natalia sold 48 clips in April and half as many in May. "
                             "How many in all?",
                 "answer": "She sold 48/2 = <<48/2=24>>24 in May.\n"
                           "In all 48+24 = <<48+24=72>>72.\n#### 72"},
                {"question": "Weng earns $12 an hour. She worked 2 hours. How much did she earn?",
                 "answer": "She earned 12*2 = <<12*2=24>>24.\n#### 24"}] * 3
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    # two distinct questions are too few to hold one out:
    # the held-out set is given (here, the same file)
    r = run_train("--model", str(tmp_path / "model"), "--data", str(data), "--eval-data", str(data),
                  "--out", str(tmp_path / "out"), *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(open(tmp_path / "out" / "metrics.jsonl").readlines()) == 3
    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint")


TIMING = ("seconds", *parallel.PHASES)


def numbers(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in open(out / "metrics.jsonl")]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_numbers(tmp_path):
    """SIGKILL at an arbitrary moment after the first iteration, then --resume: the metrics
    equal an uninterrupted run's, with no iteration repeated or skipped."""
    args = [*SMALL, "--iterations", "3", "--save-every", "1"]
    full = run_train("--out", str(tmp_path / "full"), *args)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out", str(out),
                             *args], cwd=HERE, env=OFFLINE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if ((out / "metrics.jsonl").exists()
                and '"iteration": 1' in (out / "metrics.jsonl").read_text()):
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    resumed = run_train("--out", str(out), *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert numbers(out) == numbers(tmp_path / "full")
    assert [row["iteration"] for row in numbers(out)] == [0, 1, 2, 3]
    wrong = run_train("--out", str(out), *args, "--resume", "--algo", "grpo")
    assert wrong.returncode == 2 and "written with --algo 'vineppo', not 'grpo'" in wrong.stderr


@pytest.mark.slow
def test_first_rl_step_starts_from_a_clean_gradient(tmp_path, monkeypatch):
    """Advantages all 0 (GRPO's, zeroed here: a group of one, which --samples-per-prompt refuses,
    has them) and no KL term: the first iteration's gradient must be exactly zero (the last SFT
    gradient must not leak into the first PPO step)."""
    monkeypatch.setattr(ppo, "group_advantages",
                        lambda rewards, group, eps=1e-6: torch.zeros_like(rewards))
    train.main(train.parse_args(["--algo", "grpo", "--out", str(tmp_path), *SMALL, "--kl-coef", "0",
                                 "--iterations", "1"]))
    assert numbers(tmp_path)[1]["grad_norm"] == 0.0


@pytest.mark.slow
def test_no_fork_runs_an_iteration_without_a_fork(tmp_path, monkeypatch):
    """python train.py --no-fork: SFT, evaluation, responses and MC values, none of it forked."""
    def refuse(*args, **kwargs):
        raise AssertionError("forked under --no-fork")
    monkeypatch.setattr(fork, "continue_from_cache", refuse)
    train.main(train.parse_args(["--no-fork", "--out", str(tmp_path), *SMALL,
                                 "--iterations", "1"]))
    assert numbers(tmp_path)[1]["mc_states"] > 0


def test_last_checkpoint_survives_a_kill_between_renames(tmp_path):
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / "checkpoint.tmp").mkdir()  # a half-written new checkpoint is never picked
    assert checkpoint.last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.pt").write_bytes(b"x")
    assert checkpoint.last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint")


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr -1.0: expected >= 0"),
    (["--mc-rollouts", "-2"], "--mc-rollouts -2: expected >= 1"),
    (["--samples-per-prompt", "0"], "--samples-per-prompt 0: expected >= 1"),
    (["--prompts-per-iter", "0"], "--prompts-per-iter 0: expected >= 1"),
    (["--minibatch", "0"], "--minibatch 0: expected >= 1"),
    (["--micro-batch", "0"], "--micro-batch 0: expected >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected >= 1"),
    (["--eval-samples", "0"], "--eval-samples 0: expected >= 1"),
    (["--epochs", "0"], "--epochs 0: expected >= 1"),
    (["--warmup", "nan"], "--warmup nan: expected"),
    (["--critic-lr", "inf"], "--critic-lr inf: expected"),
    (["--device", "bogus"], "--device 'bogus': expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["--temperature", "0"], "--temperature 0.0: expected >= 0.001"),
    (["--top-p", "0"], "--top-p 0.0: expected in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: expected in (0, 1]"),
    (["--clip", "-0.1"], "--clip -0.1: expected > 0"),
    (["--iterations", "-1"], "--iterations -1: expected >= 0"),
    (["--eval-problems", "-3"], "--eval-problems -3: expected >= 0"),
    (["--eval-every", "-1"], "--eval-every -1: expected >= 0"),
    (["--gamma", "2"], "--gamma 2.0: expected between 0 and 1"),
    (["--arith-slip", "1.5"], "--arith-slip 1.5: expected between 0 and 1"),
    (["--arith-steps", "5-2"], "--arith-steps '5-2': expected MIN-MAX, 1 <= MIN <= MAX"),
    (["--arith-steps", "2-9"], "--arith-steps 2-9: at most 8 steps without --arith-traps"),
    (["--arith-traps", "3"], "--arith-traps '3': expected '' or MIN-MAX, 0 <= MIN <= MAX"),
    (["--kl-coef", "-1"], "--kl-coef -1.0: expected >= 0"),
    (["--value-head", "scalar"],
     "--value-head 'scalar': only ppo and tppo have a critic, not vineppo"),
    (["--value-head", "tracking", "--algo", "grpo"],
     "--value-head 'tracking': only ppo and tppo have a critic"),
    (["--value-head", "mlp", "--algo", "ppo"],
     "--value-head 'mlp': expected one of scalar, tracking, bce"),
    (["--algo", "a2c"], "--algo 'a2c': expected one of vineppo, ppo, tppo, grpo"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--mc-max-rollouts", "3"], "--mc-max-rollouts 3: below --mc-rollouts 4 (round 1)"),
    (["--mc-top-up"], "--mc-top-up counts the responses as continuations: it needs --mc-reuse"),
    (["--mc-top-up", "--mc-reuse", "--mc-max-rollouts", "30"], "not --mc-max-rollouts"),
    (["--mc-ci-width", "0"], "--mc-ci-width 0.0: expected > 0"),
    (["--algo", "tppo", "--value-head", "scalar"],
     "--algo tppo --value-head scalar: exactly --algo ppo (TPPO is GAE on the tracking head); "
     "use --algo ppo"),
    (["--prompt-template", "@/dev/zero"],  # no size: read to one byte past the limit
     "--prompt-template @/dev/zero: cannot read '/dev/zero' (over 1048576 bytes, the most it may "
     "hold)"),
])
def test_bad_setting_gives_one_line_error(capsys, args, message):
    """Every setting is checked once, right after parsing: exit status 2 and one line, no
    traceback."""
    with pytest.raises(SystemExit) as stop:
        train.parse_args(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--data", "nope"],
     "--data 'nope': expected 'arith', 'gsm8k', 'math' or a path ending in .jsonl"),
    (["--data", "missing.jsonl"], "missing.jsonl: cannot read"),
    (["--model", "no/such-model-here"], "--model 'no/such-model-here': cannot load it"),
    (["--model", "./no-such-dir"], "--model './no-such-dir': no such directory"),
    (["--out", "/dev/null/out"], "--out '/dev/null/out': not writable"),
    (["--device", "cuda"], "--device cuda: no CUDA device is available here"),
    (["--max-prompt-tokens", "5"],
     "--max-prompt-tokens 5: every training problem's prompt is longer"),
])
def test_bad_input_gives_one_line_error(tmp_path, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run_train("--out", str(tmp_path / "out"), *SMALL, *args)
    assert (r.returncode == 2 and message in r.stderr
            and "Traceback" not in r.stderr), r.stderr[-2000:]


@pytest.mark.slow
def test_no_run_destroys_another_runs_results(tmp_path):
    """A second run into the same --out is refused unless it resumes or overwrites; a resume never
    starts over on top of results, names a setting it cannot change, survives a torn metrics line,
    logs iteration 0 once, and says so when there is nothing left to train."""
    out, small = str(tmp_path), [*SMALL, "--save-every", "1"]
    assert run_train("--out", out, *small, "--iterations", "0").returncode == 0
    again = run_train("--out", out, *small, "--iterations", "0")
    assert (again.returncode == 2 and "holds an earlier run" in again.stderr
            and "--overwrite" in again.stderr)
    assert run_train("--out", out, *small, "--iterations", "1", "--resume").returncode == 0
    assert [row["iteration"] for row in numbers(tmp_path)] == [0, 1]  # iteration 0 logged once
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 2, "train_rew')  # a kill in the middle of a write
    longer = run_train("--out", out, *small, "--iterations", "2", "--resume")
    assert (longer.returncode == 0
            and "LR schedule is stretched to end at iteration 2" in longer.stdout)
    assert [row["iteration"] for row in numbers(tmp_path)] == [0, 1, 2]
    done = run_train("--out", out, *small, "--iterations", "1", "--resume")
    assert done.returncode == 0 and "nothing to train" in done.stderr + done.stdout
    assert [row["iteration"] for row in numbers(tmp_path)] == [0, 1, 2]
    other = run_train("--out", out, *small, "--iterations", "2", "--resume", "--sft-steps", "5")
    assert other.returncode == 2 and "written with --sft-steps 3, not 5" in other.stderr
    (tmp_path / "checkpoint" / "trainer_state.pt").write_bytes(b"damaged")
    damaged = run_train("--out", out, *small, "--iterations", "3", "--resume")
    assert damaged.returncode == 2 and "trainer_state.pt cannot be read" in damaged.stderr
    (tmp_path / "checkpoint" / "trainer_state.pt").unlink()
    missing = run_train("--out", out, *small, "--iterations", "3", "--resume")
    assert missing.returncode == 2 and "checkpoint has no trainer_state.pt" in missing.stderr
    assert [row["iteration"] for row in numbers(tmp_path)] == [0, 1, 2]  # nothing wiped
    fresh = run_train("--out", out, *small, "--iterations", "1", "--overwrite", "--eval-every", "0",
                      "--save-every", "0")
    assert fresh.returncode == 0 and [row["iteration"] for row in numbers(tmp_path)] == [0, 1]


# ---- the sampler's settings, the stop string at a prefix's end (generation.generate, finish) -----

def test_sampling_sets_the_models_own_generation_settings_aside(model, capsys):
    """A generation_config that sets what `generate` would otherwise take from it changes no token.
    Sampling is softmax(logits / T) with the run's top-p, greedy its argmax (forked and fresh)."""
    from transformers import GenerationConfig
    own = copy.deepcopy(model)
    own.generation_config = GenerationConfig(
        do_sample=False, temperature=0.3, top_p=0.5, top_k=1, min_p=0.5, typical_p=0.5,
        epsilon_cutoff=0.2, eta_cutoff=0.2, repetition_penalty=5.0, no_repeat_ngram_size=1,
        bad_words_ids=[[5]], suppress_tokens=[6], min_new_tokens=6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    prefixes = random_seqs([9, 5], seed=4)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (0.0, 1.0)):
        sampling = rollout.Sampling(temperature=temperature, top_p=top_p, max_new_tokens=8,
                                    eos_id=2, pad_id=0)
        runs = []
        for m in (model, own):
            torch.manual_seed(5)
            runs.append((rollout.sample(m, prefixes, 3, [8, 8], sampling),
                         fork.fresh_decode(m, prefixes, 2, 8, sampling)))
        assert runs[0] == runs[1]
    assert own.generation_config.repetition_penalty == 5.0  # set aside for each call only
    assert models.overridden_settings(model) == {}
    assert list(models.overridden_settings(own)) == [
        "bad_words_ids", "epsilon_cutoff", "eta_cutoff", "min_new_tokens", "min_p",
        "no_repeat_ngram_size", "repetition_penalty", "suppress_tokens", "temperature", "top_k",
        "top_p", "typical_p"]
    for m, rank in ((own, 1), (model, 0), (own, 0)):  # one line, from the first process only
        models.announce_overridden_settings(m, rank)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "repetition_penalty=5.0, suppress_tokens=[6]" in lines[0]


def bigram_llama(tok, successor: dict[str, str]):
    """A 1-layer Llama whose next token is successor[last token] ('c' after any other).
    Its layer adds nothing, the embeddings are one-hot, the head scores the successor alone."""
    vocab = len(tok)
    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    head = torch.zeros(vocab, vocab)
    head[tok.convert_tokens_to_ids("c")] = 50.0
    for a, b in successor.items():
        head[:, tok.convert_tokens_to_ids(a)] = 0.0
        head[tok.convert_tokens_to_ids(b), tok.convert_tokens_to_ids(a)] = 50.0
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.lm_head.weight.copy_(head)
    return model


def test_stop_string_begun_in_the_prefix_ends_the_continuation_whatever_the_batch(tmp_path):
    """A stop string begun in the prefix and ended in the continuation cuts it to EOS, finished.
    `generate` stops there ('x a' then 'b'), and the result does not depend on the batch."""
    from reward import STOP
    models.build_tiny_model(str(tmp_path), seed=0)  # its character-level tokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = bigram_llama(tok, {"a": "b", "w": "q", "q": "a", "y": "y"})
    eos, enc = tok.eos_token_id, lambda text: tok(text, add_special_tokens=False).input_ids
    sampling = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=5, eos_id=eos,
                                pad_id=tok.pad_token_id, stop="ab", tokenizer=tok)
    prefixes = [enc("xa"), enc("xw"), enc("xy")]  # across the boundary; in its own tokens; never
    expected = ([[[eos]] * 2, [enc("q") + [eos]] * 2, [enc("yyyyy")] * 2],
                [[True] * 2, [True] * 2, [False] * 2])
    assert rollout.sample(model, prefixes, 2, [5] * 3, sampling) == expected  # one batch
    for j, prefix in enumerate(prefixes):  # each alone
        alone = rollout.sample(model, [prefix], 2, [5], sampling)
        assert alone == ([expected[0][j]], [expected[1][j]])
    # the project's stop string after a state that ends in a newline, and one the prefix holds whole
    finish = lambda row, before: generation.finish(row, 100, eos, tok, STOP, before)
    assert finish(enc("\n\nProblem:"), enc("4.\n")) == ([eos], True)
    assert finish(enc("\n\nProblem:") + [eos], enc("4.\n")) == ([eos], True)
    assert finish(enc("\n\nProblem:"), enc("4.")) == (enc("\n\nProblem:"), False)
    assert finish(enc("B\n\n\nProblem:"), enc("4.\n")) == (enc("B") + [eos], True)
    assert finish(enc("B"), enc("\n\n\nProblem:")) == (enc("B"), False)
