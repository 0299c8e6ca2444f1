"""The prompt a model is asked and the answer it is taught to write, for the model a user brings: the data's
template or --prompt-template, --chat's turns of the tokenizer's chat template, the ids that end a turn,
SFT demonstrations in --answer's style, and a warning when no response holds an answer the grader reads.

Needs: reward.py (the data, the answer styles' readers), parallel.py (which process speaks). All engineering
around the algorithm: a first reading may skip this file (docs/your-own-model.md tells its settings)."""
import re

from tqdm import tqdm

import parallel
import reward
from reward import DataError, first_line


def pose_problems(cfg, tok, problems: list[dict]):
    """Each problem's prompt text and ids, and its answer style (--answer): --prompt-template (else the data's
    own template; with --chat the question alone), with --chat a user turn of the tokenizer's chat template
    (and --system), add_generation_prompt: ids as the template writes them, no BOS added to them."""
    if cfg.chat and not getattr(tok, "chat_template", None):
        raise DataError(f"--chat: the tokenizer of --model {cfg.model!r} has no chat template; leave out --chat "
                        "and write the prompt with --prompt-template")
    if cfg.answer != "hash" and reward.is_math(problems):
        raise DataError(f"--answer {cfg.answer}: only for GSM8K-format data and arith; MATH is graded by its "
                        "own rules (its \\boxed{} answer)")
    template = cfg.prompt_template or ("{question}" if cfg.chat else None)
    for p in problems:
        if template is not None:
            p["prompt"] = template.replace("{question}", p["question"].strip())
        if cfg.chat:
            system = [{"role": "system", "content": cfg.system}] if cfg.system else []
            p["prompt"] = tok.apply_chat_template(system + [{"role": "user", "content": p["prompt"]}],
                                                  tokenize=False, add_generation_prompt=True)
            p["prompt_ids"] = tok(p["prompt"], add_special_tokens=False).input_ids
        else:
            p["prompt_ids"] = encode_prompt(tok, p["prompt"])
        if not p.get("math"):
            p["style"] = cfg.answer


def encode_prompt(tok, prompt: str) -> list[int]:
    """BOS + the prompt's tokens: what sampling starts from (the tokenizer's own BOS, as in pretraining)."""
    ids = tok(prompt, add_special_tokens=False).input_ids
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


def read_template_file(given: dict, error):
    """--prompt-template @FILE: the file's text is the template (config.json records the text)."""
    template = given.get("prompt_template", "")
    if template.startswith("@"):
        try:
            with open(template[1:], encoding="utf-8") as f:
                given["prompt_template"] = f.read()
        except (OSError, UnicodeDecodeError) as e:
            error(f"--prompt-template {template}: cannot read {template[1:]!r} ({first_line(e)})")


def drop_long_prompts(problems: list[dict], max_tokens: int, split: str, context: int | None = None) -> list[dict]:
    """The problems whose prompt is at most max_tokens long and leaves the model's context room for at
    least one response token (a full context would leave every response empty)."""
    limit = max_tokens if context is None else min(max_tokens, context - 1)
    rule = f"--max-prompt-tokens {max_tokens}" if limit == max_tokens else \
        f"the model's context of {context} tokens less one for the response"
    kept = [p for p in problems if len(p["prompt_ids"]) <= limit]
    if not kept:
        raise DataError(f"{rule}: every {split} problem's prompt is longer")
    if len(kept) < len(problems) and parallel.rank() == 0:
        tqdm.write(f"skipped {len(problems) - len(kept)} of {len(problems)} {split} problems: "
                   f"prompt over {rule}")
    return kept


def stop_ids(tok, model, chat: bool) -> tuple[int, ...]:
    """Every id that ends a response, the one SFT ends a turn in first: with --chat the chat template's end
    of turn (Qwen's <|im_end|>, Llama 3's <|eot_id|>), else the tokenizer's EOS; then the tokenizer's EOS and
    every id of the model's generation_config.eos_token_id (an int or a list)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    ids = ([end_of_turn(tok)] if chat else []) + [tok.eos_token_id] + configured
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def end_of_turn(tok) -> int | None:
    """The special token the chat template writes right after an assistant's turn, if it writes one."""
    marker = "ANSWER-7f3"
    text = tok.apply_chat_template([{"role": "user", "content": "Q"}, {"role": "assistant", "content": marker}],
                                   tokenize=False)
    after = tok(text.split(marker)[-1], add_special_tokens=False).input_ids
    return after[0] if after and after[0] in tok.all_special_ids + list(tok.added_tokens_decoder) else None


def sft_target(answer: str, style: str = "hash", chat: bool = False) -> str:
    """The SFT response of the reference: '\\n' + answer without <<calculator>> notes + '\\n'; its final
    '#### N' written 'The answer is \\boxed{N}.' in the boxed style; a chat turn without the newlines."""
    text = re.sub(r"<<[^>]*>>", "", answer)
    if style == "boxed" and "####" in text:
        head, _, number = text.rpartition("####")
        text = head + f"The answer is \\boxed{{{number.strip()}}}."
    return text.strip("\n") if chat else "\n" + text + "\n"


def sft_example(tok, prompt: str, answer: str, style: str = "hash", chat: bool = False,
                prompt_ids: list[int] | None = None, end_id: int | None = None) -> tuple[list[int], int]:
    """(prompt + response + end-of-turn ids, prompt length: SFT's loss is on the response, as the reference's
    MLEDataCollator in trainers/mle_trainer.py masks the query), the response tokenized after the prompt
    (alone, SentencePiece would start it with a '▁'), or alone where the two merge (BPE).
    prompt_ids: the prompt as sampling starts from it (default: encode_prompt); end_id: default EOS."""
    prompt_ids = encode_prompt(tok, prompt) if prompt_ids is None else prompt_ids
    target = sft_target(answer, style, chat)
    prompt_text_ids = tok(prompt, add_special_tokens=False).input_ids
    joint = tok(prompt + target, add_special_tokens=False).input_ids
    if joint[: len(prompt_text_ids)] == prompt_text_ids:
        response = joint[len(prompt_text_ids):]
    else:
        response = tok(target, add_special_tokens=False).input_ids
    return prompt_ids + response + [tok.eos_token_id if end_id is None else end_id], len(prompt_ids)


def sft_examples(tok, problems: list[dict], max_tokens: int, chat: bool = False) -> list[tuple[list[int], int]]:
    """(ids, prompt length) of the SFT examples no longer than the longest sequence RL holds, max_tokens =
    --max-prompt-tokens + --max-new-tokens: SFT never needs more memory than RL for one."""
    end = stop_ids(tok, None, chat)[0]  # the id a turn ends in, as sampling stops at it
    examples = [sft_example(tok, p["prompt"], p.get("demonstration", p["answer"]), p.get("style", "hash"),
                                   chat, p["prompt_ids"], end) for p in problems]
    kept = [(ids, n_prompt) for ids, n_prompt in examples if len(ids) <= max_tokens]
    if not kept:
        raise DataError(f"--max-prompt-tokens + --max-new-tokens = {max_tokens}: every training problem's SFT "
                        "example (prompt and solution) is longer")
    if len(kept) < len(examples) and parallel.rank() == 0:
        tqdm.write(f"sft: skipped {len(examples) - len(kept)} of {len(examples)} training problems: prompt and "
                   f"solution over --max-prompt-tokens + --max-new-tokens = {max_tokens} tokens")
    return kept


def no_answer_warning(texts: list[str], style: str, math: bool, where: str) -> str | None:
    """A warning when not one of these responses gives an answer the grader can read (None when one does):
    it names the style expected and the settings that change it. Training from zero reward is allowed."""
    read = (lambda t: bool(reward.math_answers(t))) if math else (lambda t: reward.final_answer(t, style) is not None)
    if not texts or any(map(read, texts)):
        return None
    expected = "MATH's final answer (a \\boxed{}, or a last number)" if math else \
        {"hash": "a final '#### N' line (--answer hash)", "boxed": "a \\boxed{N} (--answer boxed)"}[style]
    other = "" if math else f"--answer {'boxed' if style == 'hash' else 'hash'} grades the other style; "
    return (f"warning: {where}: none of the {len(texts)} responses holds an answer the grader can read; it "
            f"expects {expected}; {other}--prompt-template and --chat change what the model is asked")


def warn_if_unread(episodes, tok, where: str):
    """A warning line when no response holds an answer the grader reads (no_answer_warning)."""
    texts = [tok.decode(ep.response_ids, skip_special_tokens=True) for ep in episodes]
    style, math = (episodes[0].style, episodes[0].math) if episodes else ("hash", False)
    warning = no_answer_warning(texts, style, math, where)
    if warning and parallel.rank() == 0:
        tqdm.write(warning)
