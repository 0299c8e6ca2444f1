"""The prompt a model is asked and the answer it is taught to write, for the model a user brings:
the data's template or --prompt-template, --chat's turns of the tokenizer's chat template, the ids
that end a turn, and a warning when no response holds an answer the grader reads (the SFT
demonstrations in --answer's style: sft.py).

Needs: reward.py (the answer styles' readers), tasks.py, parallel.py (which process speaks). All
engineering around the algorithm: a first reading may skip this file (docs/your-own-model.md tells
its settings)."""
import os
import string

from tqdm import tqdm

import reward
from engineering import parallel, tasks
from engineering.tasks import DataError, first_line


def pose_problems(cfg, tok, problems: list[dict], context: int | None = None):
    """Each problem's prompt text and ids, and its answer style (--answer): --prompt-template (else
    the data's own template; with --chat the question alone), with --chat a user turn of the
    tokenizer's chat template (and --system), add_generation_prompt: ids as the template writes
    them, no BOS added to them.
    A template is checked first (check_template; context: the model's), and a warning names the
    characters of the prompts that the tokenizer cannot encode (warn_unencodable)."""
    if cfg.chat and not getattr(tok, "chat_template", None):
        raise DataError(f"--chat: the tokenizer of --model {cfg.model!r} has no chat template; "
                        "leave out --chat and write the prompt with --prompt-template")
    if cfg.answer != "hash" and tasks.is_math(problems):
        raise DataError(f"--answer {cfg.answer}: only for GSM8K-format data and arith; MATH is "
                        "graded by its own rules (its \\boxed{} answer)")
    template = cfg.prompt_template or ("{question}" if cfg.chat else None)
    if template is not None:
        check_template(template, tok, cfg.max_prompt_tokens, context)
    for p in problems:
        if template is not None:
            p["prompt"] = template.format(question=p["question"].strip())
        if cfg.chat:
            p["prompt"] = chat_turns(cfg, tok, p["prompt"])
            p["prompt_ids"] = tok(p["prompt"], add_special_tokens=False).input_ids
        else:
            p["prompt_ids"] = encode_prompt(tok, p["prompt"])
        if not p.get("math"):
            p["style"] = cfg.answer
    warn_unencodable(tok, [p["prompt"] for p in problems], cfg.model)


def chat_turns(cfg, tok, text: str) -> str:
    """The text as a user turn of the tokenizer's chat template, after --system's turn, with
    add_generation_prompt. A template that refuses these turns (Gemma's refuses a system turn) or
    is not valid Jinja: a DataError in one line naming the file that holds it."""
    import jinja2
    system = [{"role": "system", "content": cfg.system}] if cfg.system else []
    try:
        return tok.apply_chat_template(system + [{"role": "user", "content": text}],
                                       tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        file = "chat_template.jinja" if os.path.isfile(
            os.path.join(cfg.model, "chat_template.jinja")) else "tokenizer_config.json"
        where = f"the chat template of --model {cfg.model!r} (its {file})"
        if isinstance(e, jinja2.TemplateSyntaxError):
            raise DataError(f"--chat: {where} is not valid Jinja ({e.message}, line {e.lineno}); "
                            "correct it there, or leave out --chat and write the prompt with "
                            "--prompt-template") from None
        if system:
            raise DataError(f"--chat --system: {where} refuses a system turn ({first_line(e)}); "
                            "leave out --system and write its words in --prompt-template") from None
        raise DataError(f"--chat: {where} refuses a user turn ({first_line(e)}); leave out --chat "
                        "and write the prompt with --prompt-template") from None


# A --prompt-template is a str.format string with one field, {question} (the data's own templates
# are filled the same way and hold no other brace): the words of every refusal of one
EXPECTED = ("a template holding {question}, its only field ({{ and }} write a brace, as in "
            "\\boxed{{}}), e.g. 'Q: {question}\\nA:'")


def template_problem(template: str) -> str | None:
    """What keeps a text from being a template (None: nothing), in words that end in EXPECTED.
    str.format's rules, read by string.Formatter().parse: {{ and }} write a brace, {question}
    is the only field, without a conversion (!r) or a format spec (:>9)."""
    try:
        fields = [(name, conversion, spec) for _, name, spec, conversion
                  in string.Formatter().parse(template) if name is not None]
    except ValueError as e:  # a lone { or }
        return f"not a format string ({e}); expected {EXPECTED}"
    for name, conversion, spec in fields:
        written = "{" + name + (f"!{conversion}" if conversion else "") + \
            (f":{spec}" if spec else "") + "}"
        if name != "question":
            return f"unknown field {written}; expected {EXPECTED}"
        if conversion or spec:
            kind = "a conversion" if conversion else "a format spec"
            return f"{written} has {kind}; expected {EXPECTED}"
    return None if fields else f"expected {EXPECTED}"


def brief(text: str, width: int = 60) -> str:
    """A text as a message shows it: quoted, on one line, its start only when it is long."""
    if len(text) <= width:
        return repr(text)
    return repr(text[:width]) + f"... ({len(text)} characters)"


def prompt_room(max_tokens: int, context: int | None) -> tuple[int, str]:
    """(the most tokens a prompt may have, the rule in words): --max-prompt-tokens, and the model's
    context less one token for the response."""
    if context is None or max_tokens <= context - 1:
        return max_tokens, f"--max-prompt-tokens {max_tokens}"
    return context - 1, f"the model's context of {context} tokens less one for the response"


def check_template(template: str, tok, max_tokens: int, context: int | None = None):
    """A DataError in one line for a template that is not one (template_problem), or that cannot fit
    a prompt alone, found before any problem is encoded: more characters than prompt_room's tokens
    can hold (each at most the tokenizer's longest token), else more tokens than that, encoded once
    with an empty question."""
    problem = template_problem(template)
    if problem:
        raise DataError(f"--prompt-template {brief(template)}: {problem}")
    limit, rule = prompt_room(max_tokens, context)
    longest = max(map(len, tok.get_vocab()), default=1)  # characters of the longest token
    if len(template) > limit * longest:
        raise DataError(f"--prompt-template {brief(template)}: {len(template)} characters "
                        f"cannot fit {rule} (a token of this tokenizer holds at most {longest})")
    n = len(encode_prompt(tok, template.format(question="")))
    if n > limit:
        raise DataError(f"--prompt-template {brief(template)}: {n} tokens without the question, "
                        f"over {rule}")


def warn_unencodable(tok, texts: list[str], model: str):
    """One warning line naming the characters of these texts the tokenizer cannot encode.
    Its unknown token stands for them (the tiny model's character tokenizer and a '问'), or they
    are dropped; byte-level BPE encodes every one. Each distinct character is encoded alone, once;
    white space may encode to nothing (a tokenizer folds it)."""
    chars = sorted(set("".join(texts)))
    unknown, dropped = [], []
    for c, ids in zip(chars, tok(chars, add_special_tokens=False).input_ids if chars else []):
        if tok.unk_token_id is not None and tok.unk_token_id in ids:
            unknown.append(c)
        elif not ids and not c.isspace():
            dropped.append(c)
    named = lambda cs: ", ".join(map(repr, cs[:12])) + \
        (f" and {len(cs) - 12} more" if len(cs) > 12 else "")
    fates = ([f"{named(unknown)}: read as {tok.unk_token!r}"] if unknown else []) + \
        ([f"{named(dropped)}: dropped"] if dropped else [])
    if fates and parallel.rank() == 0:
        tqdm.write(f"warning: the tokenizer of --model {model!r} cannot encode characters of the "
                   f"prompts (the template or the questions): {'; '.join(fates)}")


def encode_prompt(tok, prompt: str) -> list[int]:
    """BOS + the prompt's tokens: what sampling starts from (the tokenizer's own BOS, as in
    pretraining)."""
    ids = tok(prompt, add_special_tokens=False).input_ids
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


# the most bytes a --prompt-template @FILE may hold (1 MiB): over a hundred times a prompt of
# the default --max-prompt-tokens
FILE_LIMIT = 1 << 20


def read_small_file(path: str, limit: int = FILE_LIMIT) -> str:
    """A UTF-8 text file of at most limit bytes, its line ends read as open() reads them; a larger
    one is an OSError. Its size is checked before it is read, and at most limit + 1 bytes are read
    (/dev/zero and a pipe have no size)."""
    with open(path, "rb") as f:
        too_large = os.fstat(f.fileno()).st_size > limit
        data = b"" if too_large else f.read(limit + 1)
    if too_large or len(data) > limit:
        raise OSError(f"over {limit} bytes, the most it may hold")
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def read_template_file(given: dict, error):
    """--prompt-template @FILE: the file's text is the template (config.json records the text).
    A given template is checked here, before any work: an empty file, one too large to read
    (read_small_file), or one that is not a template (template_problem), is refused in one line
    naming the file, or the text's start."""
    template = given.get("prompt_template", "")
    shown = template if template.startswith("@") else brief(template)
    if template.startswith("@"):
        try:
            given["prompt_template"] = read_small_file(template[1:])
        except (OSError, UnicodeDecodeError) as e:
            error(f"--prompt-template {template}: cannot read {template[1:]!r} ({first_line(e)})")
        if not given["prompt_template"].strip():
            empty = "is empty" if not given["prompt_template"] else "holds only white space"
            error(f"--prompt-template {template}: {template[1:]!r} {empty}; expected {EXPECTED}")
    problem = template_problem(given["prompt_template"]) if given.get("prompt_template") else None
    if problem:
        error(f"--prompt-template {shown}: {problem}")


def drop_long_prompts(problems: list[dict], max_tokens: int, split: str,
                      context: int | None = None) -> list[dict]:
    """The problems whose prompt is at most max_tokens long and leaves the model's context room for
    at least one response token (a full context would leave every response empty)."""
    limit, rule = prompt_room(max_tokens, context)
    kept = [p for p in problems if len(p["prompt_ids"]) <= limit]
    if not kept:
        raise DataError(f"{rule}: every {split} problem's prompt is longer")
    if len(kept) < len(problems) and parallel.rank() == 0:
        tqdm.write(f"skipped {len(problems) - len(kept)} of {len(problems)} {split} problems: "
                   f"prompt over {rule}")
    return kept


def stop_ids(tok, model, chat: bool) -> tuple[int, ...]:
    """Every id that ends a response, the one SFT ends a turn in first: with --chat the chat
    template's end of turn (Qwen's <|im_end|>, Llama 3's <|eot_id|>), else the tokenizer's EOS; then
    the tokenizer's EOS and every id of the model's generation_config.eos_token_id (an int or a
    list)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = ([] if configured is None else [configured] if isinstance(configured, int)
                  else list(configured))
    ids = ([end_of_turn(tok)] if chat else []) + [tok.eos_token_id] + configured
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def end_of_turn(tok) -> int | None:
    """The special token the chat template writes right after an assistant's turn, if it writes
    one."""
    marker = "ANSWER-7f3"
    text = tok.apply_chat_template([{"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": marker}], tokenize=False)
    after = tok(text.split(marker)[-1], add_special_tokens=False).input_ids
    return (after[0] if after and after[0] in tok.all_special_ids + list(tok.added_tokens_decoder)
            else None)


def no_answer_warning(texts: list[str], style: str, math: bool, where: str) -> str | None:
    """A warning when not one of these responses gives an answer the grader can read (None when one
    does): it names the style expected and the settings that change it. Training from zero reward is
    allowed."""
    read = ((lambda t: bool(reward.math_answers(t))) if math
            else (lambda t: reward.final_answer(t, style) is not None))
    if not texts or any(map(read, texts)):
        return None
    expected = "MATH's final answer (a \\boxed{}, or a last number)" if math else \
        {"hash": "a final '#### N' line (--answer hash)",
         "boxed": "a \\boxed{N} (--answer boxed)"}[style]
    other = "" if math else \
        f"--answer {'boxed' if style == 'hash' else 'hash'} grades the other style; "
    return (f"warning: {where}: none of the {len(texts)} responses holds an answer the grader can "
            f"read; it expects {expected}; {other}--prompt-template and --chat change what the "
            "model is asked")


def warn_if_unread(episodes, tok, where: str):
    """A warning line when no response holds an answer the grader reads (no_answer_warning)."""
    texts = [tok.decode(ep.response_ids, skip_special_tokens=True) for ep in episodes]
    style, math = (episodes[0].style, episodes[0].math) if episodes else ("hash", False)
    warning = no_answer_warning(texts, style, math, where)
    if warning and parallel.rank() == 0:
        tqdm.write(warning)
