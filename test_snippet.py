"""The README's promise "Use it in your own trainer": the files it names, copied alone into an
empty folder, run its code block as written, on a tiny random Llama, and give VinePPO's step
advantages."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from engineering import models

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Use it in your own trainer"
pytestmark = pytest.mark.slow  # its one test runs the block in a fresh python process

# what the block takes as given: a model, its tokenizer, and a batch of responses of the
# built-in task
BEFORE = '''import json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
torch.set_num_threads(1)  # the same numbers on every machine, and no waits on a busy one
tok = AutoTokenizer.from_pretrained("model")
model = AutoModelForCausalLM.from_pretrained("model").eval()
ids = lambda text: tok(text, add_special_tokens=False).input_ids
prompts = [[tok.bos_token_id] + ids("What is 2+3-1?\\n")] * 3
responses = [ids("\\n2+3=5\\n5-1=4\\n#### 4") + [tok.eos_token_id],   # right
             ids("\\n2+3=6\\n6-1=5\\n#### 5") + [tok.eos_token_id],   # wrong
             ids("\\n2+3=5\\n5-")]                                    # unfinished
golds = ["2+3=5\\n5-1=4\\n#### 4"] * 3
# the model learns the right answer by heart first, so that continuations are sometimes right: values in (0, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
right = torch.tensor([prompts[0] + responses[0]])
for _ in range(30):
    model(input_ids=right, labels=right).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.eval()
'''  # noqa: E501 (the script's own lines, run as written)
AFTER = '''
print(json.dumps({"where": rollout.__file__, "rewards": [ep.reward for ep in episodes],
                  "starts": [ep.step_starts for ep in episodes], "values": [ep.step_values for ep in episodes],
                  "old_logp": [len(ep.old_logp) for ep in episodes],
                  "advantages": [a.tolist() for a in advantages], "lengths": [len(r) for r in responses]}))
'''  # noqa: E501 (the script's own lines, run as written)


def readme_section() -> tuple[list[str], str]:
    """(the files the section names to copy, its python block)."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    named = re.search(r"copy ((?:`\w+\.py`(?:, | and )?)+)", section)
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert named and block, f"README: '{SECTION}' names no files to copy or has no python block"
    return re.findall(r"`(\w+\.py)`", named.group(1)), block.group(1)


def run_snippet(tmp_path, save_model) -> dict:
    """The section's files copied alone into tmp_path, `save_model(folder)` writing the model
    there, the block run as written between BEFORE and AFTER: what AFTER prints."""
    files, block = readme_section()
    assert len(block.strip().splitlines()) <= 16 and "math_grader.py" in files
    for name in files:
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    save_model(str(tmp_path / "model"))
    (tmp_path / "run.py").write_text(BEFORE + block + AFTER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "run.py"], cwd=tmp_path,
                       env={**env, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=600)
    # e.g. a sibling the named files import and the README omits
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert os.path.dirname(out["where"]) == str(tmp_path)  # the copies ran, not the project's files
    return out


def check_step_advantages(out: dict):
    """Rewards graded, a log-prob per response token, A_i on all of step i, sum_i A_i = R - V(s_0),
    and every V_hat(s_i) a mean of K = 9 rewards; s_0, one prompt, valued once."""
    assert out["rewards"] == [1.0, 0.0, 0.0] and out["old_logp"] == out["lengths"]
    for starts, values, adv, n, reward in zip(out["starts"], out["values"], out["advantages"],
                                              out["lengths"], out["rewards"]):
        assert starts[0] == 0 and len(starts) == len(values) >= 2 and len(adv) == n
        # K = 9 rewards
        assert all(0 <= v <= 1 and (9 * v) == pytest.approx(round(9 * v)) for v in values)
        bounds = starts[1:] + [n]
        # A_i on all of step i
        assert all(len(set(adv[lo:hi])) == 1 for lo, hi in zip(starts, bounds))
        # sum of A_i = R - V(s_0)
        assert sum(adv[lo] for lo in starts) == pytest.approx(reward - values[0])
    assert len({values[0] for values in out["values"]}) == 1  # s_0, the same prompt: one estimate


def test_the_readme_snippet_runs_from_the_files_it_names(tmp_path):
    out = run_snippet(tmp_path, lambda folder: models.build_tiny_model(folder, seed=0))
    check_step_advantages(out)
    # not all 0 or 1: a real test of the sums
    assert any(0 < v < 1 for values in out["values"] for v in values), out["values"]
