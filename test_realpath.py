"""Tests of the real-data path: GSM8K's own answers, SFT targets with SentencePiece-style and
byte-level tokenizers."""
import json
import os

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

import checkpoint
from reward import PROMPT, arith_dataset, encode_prompt, gsm8k_reward, read_jsonl, sft_example, sft_target

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = read_jsonl(os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl"))  # 55 real GSM8K problems


def sft_text(problem: dict) -> str:
    return PROMPT.format(question=problem["question"].strip()) + sft_target(problem["answer"])


# ---- tokenizers built in code ----------------------------------------------------------------

def llama_style_tokenizer(texts: list[str], vocab_size: int = 800) -> LlamaTokenizer:
    """A Llama tokenizer (SentencePiece-style BPE: '▁' for spaces, prepended to the text's first
    word; byte fallback; decoder Replace('▁', ' '), ByteFallback, Fuse, Strip one leading space),
    with <unk>, <s>, </s> and the 256 byte tokens first, as in Llama. The BPE is trained here on
    `texts` without newlines, so '\\n' is always the byte token <0x0A>, as in Llama; rare characters
    (limit_alphabet) fall back to bytes too."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    lines = [line for text in texts for line in text.split("\n")]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=70, show_progress=False)
    bpe.train_from_iterator(lines, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += sorted(trained["vocab"], key=trained["vocab"].get)
    merges = [tuple(m) for m in trained["merges"]]
    return LlamaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)


def byte_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose pre-tokenizer (Llama-3's rule for punctuation) keeps ':\\n' together."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s+|\p{L}+|\p{N}"), behavior="isolated"),
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
    checkpoint.build_tiny_model(str(path), seed=0)  # the demo's character-level tokenizer
    return AutoTokenizer.from_pretrained(path)


# ---- 1. grading GSM8K's own answers --------------------------------------------------------

def test_gold_answers_with_thousands_separators_score_one():
    golds = [p["answer"] for p in FIXTURE]
    assert sum("," in a.split("####")[-1] for a in golds) == 8  # 2,125 and the like (fixtures/README.md)
    assert all(gsm8k_reward(a, a) == 1.0 for a in golds)
    assert all(gsm8k_reward(sft_target(a), a) == 1.0 for a in golds)  # the gold solution as SFT writes it
    assert gsm8k_reward("#### 2125", "#### 2,125") == 1.0
    assert gsm8k_reward("... so 2,125 blocks.\n#### 2,125", "2,125") == 1.0
    assert gsm8k_reward("#### 2,126", "#### 2,125") == 0.0
    assert gsm8k_reward("#### 2.125", "#### 2,125") == 0.0  # a comma is a separator, never a decimal point


# ---- 3. SFT examples tokenized as sampling sees them ---------------------------------------

def test_sft_example_has_no_spurious_leading_token(llama_tok):
    tok = llama_tok
    for p in FIXTURE:
        ids, n_prompt = sft_example(tok, p["question"], p["answer"])
        target = sft_target(p["answer"])
        assert ids[:n_prompt] == encode_prompt(tok, p["question"]) and ids[0] == tok.bos_token_id
        alone = tok(target, add_special_tokens=False).input_ids  # the old way: a spurious '▁' first
        assert tok.convert_ids_to_tokens(alone[:2]) == ["▁", "<0x0A>"]
        assert tok.convert_ids_to_tokens(ids[n_prompt]) == "<0x0A>" and ids[-1] == tok.eos_token_id
        assert tok.decode(ids[1:-1]) == PROMPT.format(question=p["question"].strip()) + target
        assert tok.decode(ids[n_prompt:], skip_special_tokens=True) == target


def test_sft_example_char_level_unchanged(char_tok):
    """The demo's ids: prompt_ids + the target tokenized alone + EOS, as train.py built them."""
    tok = char_tok
    for p in arith_dataset(100, seed=2, slip=0.25):
        before = tok(sft_target(p["demonstration"]), add_special_tokens=False).input_ids + [tok.eos_token_id]
        prompt_ids = encode_prompt(tok, p["question"])
        assert sft_example(tok, p["question"], p["demonstration"]) == (prompt_ids + before, len(prompt_ids))


def test_sft_example_when_a_token_spans_the_prompt_end(byte_tok):
    """Byte-level BPE with a ':\\n' token: tokenized jointly, the prompt's last token would change,
    so the prompt ids stay encode_prompt's and the target is tokenized alone."""
    tok, p = byte_tok, FIXTURE[0]
    prompt_ids = encode_prompt(tok, p["question"])
    assert tok.convert_ids_to_tokens(prompt_ids[-1]) == ":"  # sampling starts after ':'
    assert ":Ċ" in tok.convert_ids_to_tokens(tok(sft_text(p)).input_ids)  # ':\n' (Ċ: byte-level '\n')
    ids, n_prompt = sft_example(tok, p["question"], p["answer"])
    assert ids[:n_prompt] == prompt_ids and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == sft_text(p)
