"""Tests of the real-data path: GSM8K's own answers."""
import os

from reward import gsm8k_reward, read_jsonl, sft_target

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = read_jsonl(os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl"))  # 55 real GSM8K problems


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
