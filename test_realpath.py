"""Tests of the real-data path: GSM8K's own answers, SentencePiece-style tokenization (step
boundaries, SFT targets), the reference's stop string and context budget, and offline errors."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as token_models
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaTokenizer,
                          PreTrainedTokenizerFast)

import generation
import rollout
import vine
from engineering import models
from engineering.prompts import encode_prompt
from engineering.sft import sft_example, sft_target
from engineering.tasks import arith_dataset, read_jsonl
from reward import ARITH_PROMPT, PROMPT, STOP, gsm8k_reward

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = read_jsonl(os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl"))  # 55 real GSM8K problems


def gsm8k_prompt(question: str) -> str:
    return PROMPT.format(question=question.strip())


def sft_text(problem: dict) -> str:
    return gsm8k_prompt(problem["question"]) + sft_target(problem["answer"])


# ---- tokenizers built in code ----------------------------------------------------------------

def llama_style_tokenizer(texts: list[str], vocab_size: int = 800) -> LlamaTokenizer:
    """A Llama tokenizer (SentencePiece-style BPE: '▁' for spaces, prepended to the text's first
    word; byte fallback; decoder Replace('▁', ' '), ByteFallback, Fuse, Strip one leading space),
    with <unk>, <s>, </s> and the 256 byte tokens first, as in Llama. The BPE is trained here on
    `texts` without newlines, so '\\n' is always the byte token <0x0A>, as in Llama; rare characters
    (limit_alphabet) fall back to bytes too."""
    bpe = Tokenizer(token_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    lines = [line for text in texts for line in text.split("\n")]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=70, show_progress=False)
    bpe.train_from_iterator(lines, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += sorted(trained["vocab"], key=trained["vocab"].get)
    merges = [tuple(m) for m in trained["merges"]]
    return LlamaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)


def byte_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose pre-tokenizer (Llama-3's rule for punctuation) keeps ':\\n'
    together."""
    tk = Tokenizer(token_models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s+|\p{L}+|\p{N}"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|end|>")


@pytest.fixture(scope="module")
def llama_tok():
    return llama_style_tokenizer([p["question"] for p in FIXTURE] + [p["answer"] for p in FIXTURE])


@pytest.fixture(scope="module")
def byte_tok():
    return byte_level_tokenizer([sft_text(p) for p in FIXTURE])


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    models.build_tiny_model(str(path), seed=0)  # the demo's character-level tokenizer
    return AutoTokenizer.from_pretrained(path)


def llama_response(tok, question: str, text: str) -> list[int]:
    """`text` tokenized as it follows the prompt, as sampling sees it (sft_example), EOS dropped."""
    # sft_target adds the '\n' on each side
    ids, n_prompt = sft_example(tok, gsm8k_prompt(question), text[1:-1])
    return ids[n_prompt:-1]


# ---- 1. grading GSM8K's own answers --------------------------------------------------------

def test_gold_answers_with_thousands_separators_score_one():
    golds = [p["answer"] for p in FIXTURE]
    # 2,125 and the like (fixtures/README.md)
    assert sum("," in a.split("####")[-1] for a in golds) == 8
    assert all(gsm8k_reward(a, a) == 1.0 for a in golds)
    # the gold solution as SFT writes it
    assert all(gsm8k_reward(sft_target(a), a) == 1.0 for a in golds)
    assert gsm8k_reward("#### 2125", "#### 2,125") == 1.0
    assert gsm8k_reward("... so 2,125 blocks.\n#### 2,125", "2,125") == 1.0
    assert gsm8k_reward("#### 2,126", "#### 2,125") == 0.0
    # a comma is a separator, never a decimal point
    assert gsm8k_reward("#### 2.125", "#### 2,125") == 0.0


# ---- 2. step boundaries from the decoded response ------------------------------------------

def test_token_texts_spell_the_decoded_response(llama_tok):
    tok = llama_tok
    byte_tokens = 0
    for p in FIXTURE:
        for text in (sft_target(p["answer"]), p["question"], " " + p["answer"] + " \n½ kg \n"):
            ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
            byte_tokens += sum(t.startswith("<0x") and t != "<0x0A>"
                               for t in tok.convert_ids_to_tokens(ids))
            assert "".join(vine.token_texts(tok, ids)) == \
                tok.decode(ids, skip_special_tokens=True)
    assert byte_tokens > 50  # multi-byte characters (€, ½, ’) split over byte tokens were covered
    # '½' = bytes C2 BD: the first byte adds nothing, the second the character
    ids = tok("a½", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids)[-2:] == ["<0xC2>", "<0xBD>"]
    assert vine.token_texts(tok, ids)[-2:] == ["", "½"]


def test_space_before_newline_keeps_its_space(llama_tok):
    """A lone '▁' decodes to '' on its own, but its text is the space that ends the first line;
    the step that line ends closes with the newline token after it."""
    tok = llama_tok
    ids = llama_response(tok, FIXTURE[27]["question"],
                         "\nShe sold 24 clips. \nIn all 72.\n#### 72\n")
    tokens = tok.convert_ids_to_tokens(ids)
    lone = [tok.decode([i], skip_special_tokens=True) for i in ids]  # each token alone
    newline = tokens.index("<0x0A>", 1)  # the newline that closes step 0
    assert tokens[newline - 1] == "▁" and lone[newline - 1] == ""
    assert vine.token_texts(tok, ids)[newline - 1] == " "
    starts = vine.response_step_starts(tok, ids)
    assert starts[:2] == [0, newline + 1]
    assert [tok.decode(ids[a:b]) for a, b in zip(starts, starts[1:] + [len(ids)])] == \
        ["\nShe sold 24 clips. \n", "In all 72.\n", "#### 72\n"]


def test_boundaries_of_gold_solutions_fall_after_their_newlines(llama_tok):
    """Every gold solution, and the same with a space ending each line (as a model may write it):
    each line is a step that ends with its newline token, and the answer line is one more (the
    reference's GSM8K lines, tasks/gsm8k.py split_solution_into_intermediate_steps, each
    closed by its '\\n')."""
    tok = llama_tok
    for p in FIXTURE:
        gold = sft_target(p["answer"])  # '\n' + the solution without <<calculator>> notes + '\n'
        for text in (gold, gold.replace("\n", " \n")[1:]):
            ids = llama_response(tok, p["question"], text)
            starts = vine.response_step_starts(tok, ids)
            # a step each, then the answer's
            lines = text.split("\n####")[0].strip("\n").split("\n")
            assert len(starts) == len(lines) + 1
            assert all(tok.convert_ids_to_tokens(ids[s - 1]) == "<0x0A>" for s in starts[1:])
            assert tok.decode(ids[starts[-1]:], skip_special_tokens=True).startswith("####")


def test_char_level_boundaries_unchanged(char_tok):
    """The demo's tokenizer: every token decodes alone to its character, so nothing moves."""
    tok = char_tok
    lone = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=True)
    g = torch.Generator().manual_seed(0)
    samples = [tok(sft_target(p["demonstration"]), add_special_tokens=False).input_ids
               + [tok.eos_token_id]
               for p in arith_dataset(50, seed=1, slip=0.3)]
    # specials too
    samples += [torch.randint(0, len(tok), (60,), generator=g).tolist() for _ in range(50)]
    for ids in samples:
        texts = [lone[i] for i in ids]
        assert vine.response_step_starts(tok, ids) == \
            vine.token_steps(texts, vine.line_step_offsets("".join(texts)))


# ---- 3. SFT examples tokenized as sampling sees them ---------------------------------------

def test_sft_example_has_no_spurious_leading_token(llama_tok):
    tok = llama_tok
    for p in FIXTURE:
        ids, n_prompt = sft_example(tok, gsm8k_prompt(p["question"]), p["answer"])
        target = sft_target(p["answer"])
        assert (ids[:n_prompt] == encode_prompt(tok, gsm8k_prompt(p["question"]))
                and ids[0] == tok.bos_token_id)
        alone = tok(target, add_special_tokens=False).input_ids  # the old way: a spurious '▁' first
        assert tok.convert_ids_to_tokens(alone[:2]) == ["▁", "<0x0A>"]
        assert tok.convert_ids_to_tokens(ids[n_prompt]) == "<0x0A>" and ids[-1] == tok.eos_token_id
        assert tok.decode(ids[1:-1]) == gsm8k_prompt(p["question"]) + target
        assert tok.decode(ids[n_prompt:], skip_special_tokens=True) == target


def test_sft_example_char_level_unchanged(char_tok):
    """The demo's ids: prompt_ids + the target tokenized alone + EOS, as train.py built them."""
    tok = char_tok
    for p in arith_dataset(100, seed=2, slip=0.25):
        before = (tok(sft_target(p["demonstration"]), add_special_tokens=False).input_ids
                  + [tok.eos_token_id])
        prompt = ARITH_PROMPT.format(question=p["question"])
        prompt_ids = encode_prompt(tok, prompt)
        assert sft_example(tok, prompt, p["demonstration"]) == \
            (prompt_ids + before, len(prompt_ids))


def test_sft_example_when_a_token_spans_the_prompt_end(byte_tok):
    """Byte-level BPE with a ':\\n' token: tokenized jointly, the prompt's last token would change,
    so the prompt ids stay encode_prompt's and the target is tokenized alone."""
    tok, p = byte_tok, FIXTURE[0]
    prompt_ids = encode_prompt(tok, gsm8k_prompt(p["question"]))
    assert tok.convert_ids_to_tokens(prompt_ids[-1]) == ":"  # sampling starts after ':'
    # ':\n' (Ċ: byte-level '\n')
    assert ":Ċ" in tok.convert_ids_to_tokens(tok(sft_text(p)).input_ids)
    ids, n_prompt = sft_example(tok, gsm8k_prompt(p["question"]), p["answer"])
    assert ids[:n_prompt] == prompt_ids and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == sft_text(p)


# ---- 4. the stop string and the context budget ---------------------------------------------

def test_cut_at_stop_hand_cases(llama_tok, char_tok, byte_tok):
    for tok in (llama_tok, char_tok, byte_tok):
        eos = tok.eos_token_id
        # the budget cuts nothing
        cut_at_stop = lambda ids: generation.finish(ids, len(ids), eos, tok, STOP)[0]
        enc = lambda text: tok(text, add_special_tokens=False).input_ids
        kept = enc("\nA = 3.\n#### 3")
        # HF stops at the token completing the stop string, which may run past it
        # (':\n' in byte-level BPE)
        for tail in ("\n\n\nProblem:",) + (("\n\n\nProblem:\n",) if tok is byte_tok else ()):
            ids = enc("\nA = 3.\n#### 3" + tail)
            assert ids[: len(kept)] == kept
            assert cut_at_stop(ids) == kept + [eos]
            assert cut_at_stop(ids + [eos]) == kept + [eos]
        assert cut_at_stop(kept + [eos]) == kept + [eos]  # no stop string: unchanged
        assert cut_at_stop(kept) == kept
        assert cut_at_stop(enc("\n\n\nProblem")) == enc("\n\n\nProblem")
        # a row that stopped, filled with EOS (fork.continue_from_cache)
        # -> the kept tokens and EOS, finished
        row = enc("\nA = 3.\n#### 3\n\n\nProblem:") + [eos] * 3
        assert generation.finish(row, 100, eos, tok, STOP) == (kept + [eos], True)
        assert (generation.finish(row, len(kept) + 2, eos, tok, STOP)
                == (row[: len(kept) + 2], False))


RUNAWAY = "\n5+3=8\n#### 8\n\n\nProblem:\nWhat is 1+1?\n\nSolution:\n1+1=2\n#### 2\n"


@pytest.fixture(scope="module")
def runaway_model(char_tok):
    """A small model that learnt one response which runs on into an invented next problem."""
    tok, threads = char_tok, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    prompt = encode_prompt(tok, gsm8k_prompt("What is 5+3?"))
    response = tok(RUNAWAY, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ids = torch.tensor([prompt + response])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    torch.set_num_threads(threads)
    return model.eval(), prompt


def test_stop_string_cuts_an_invented_next_problem(char_tok, runaway_model):
    tok, (model, prompt) = char_tok, runaway_model
    eos = tok.eos_token_id
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=200, eos_id=eos,
                              pad_id=tok.pad_token_id)
    runs_on, done = rollout.sample(model, [prompt], 2, [200], greedy)
    assert tok.decode(runs_on[0][0], skip_special_tokens=True) == RUNAWAY and done == [[True, True]]
    assert gsm8k_reward(RUNAWAY, "#### 8") == 0.0  # graded on the invented problem's '#### 2'
    # a main rollout and an MC state
    state = prompt + tok("\n5+3=8", add_special_tokens=False).input_ids
    stopping = dataclasses.replace(greedy, tokenizer=tok, stop=STOP)
    conts, done = rollout.sample(model, [prompt, state], 2, [200, 200], stopping)
    assert conts[0] == [tok("\n5+3=8\n#### 8", add_special_tokens=False).input_ids + [eos]] * 2
    assert conts[1] == [tok("\n#### 8", add_special_tokens=False).input_ids + [eos]] * 2
    assert done == [[True, True], [True, True]]
    assert gsm8k_reward(tok.decode(conts[0][0], skip_special_tokens=True), "#### 8") == 1.0
    short, done = rollout.sample(model, [prompt], 1, [10], stopping)
    assert len(short[0][0]) == 10 and done == [[False]]  # out of budget before any stop: unfinished


def test_context_length_caps_the_budget():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    # EOS outside the vocabulary: never sampled
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=100, eos_id=40, pad_id=0)
    prefixes = [[3] * 50, [4] * 10, [5] * 64, [6] * 70]
    conts, done = rollout.sample(model, prefixes, 2, [100, 20, 100, 100], sampling)
    # min(budget, 64 - prefix length): 14, 20, and nothing at all for prefixes that fill the context
    assert [[len(c) for c in cs] for cs in conts] == [[14, 14], [20, 20], [0, 0], [0, 0]]
    assert not any(f for fs in done for f in fs)


# ---- 10. offline: one line, not a traceback -------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--model", "rho-math-1.1b", "--data", "gsm8k"],
     "--data gsm8k: cannot load openai/gsm8k from the hub"),
    (["--model", "rho-math-1.1b"], "--model 'realtreetune/rho-1b-sft-GSM8K': cannot load it"),
])
def test_offline_hub_model_or_data_fail_in_one_line(tmp_path, args, message):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args,
                        "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: " + message)
    assert ".jsonl" in r.stderr if "--data" in message else "save_pretrained" in r.stderr


# ---- the whole GSM8K path with a Llama-style tokenizer ------------------------------------------

SMALL = ["--iterations", "2", "--prompts-per-iter", "4", "--samples-per-prompt", "2",
         "--mc-rollouts", "2", "--minibatch", "4", "--micro-batch", "2", "--max-new-tokens", "24",
         "--eval-problems", "4", "--eval-samples", "1", "--eval-every", "1", "--save-every", "1",
         "--sft-steps", "3", "--sft-batch", "4"]


@pytest.fixture(scope="module")
def llama_model_dir(llama_tok, tmp_path_factory):
    """A tiny random Llama with the Llama-style tokenizer, saved as a hub model would be."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(llama_tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024,
                         bos_token_id=llama_tok.bos_token_id, eos_token_id=llama_tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    llama_tok.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["vineppo", "ppo", "tppo", "grpo"])
def test_gsm8k_path_with_llama_style_tokenizer(tmp_path, llama_model_dir, algo):
    """The paper's code path end to end: a from_pretrained Llama with a SentencePiece-style
    tokenizer, real GSM8K problems (the fixture), SFT, two iterations of each --algo, a checkpoint
    that reloads."""
    data = os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"),
                        "--model", str(llama_model_dir), "--data", data, "--algo", algo,
                        "--out", str(tmp_path), *SMALL],
                       env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1, 2] and rows[-1]["episodes"] == 8
    assert rows[-1]["mc_states"] > 0 if algo == "vineppo" else "policy_loss" in rows[-1]
    LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint")
