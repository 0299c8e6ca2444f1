"""The problems a run trains and is evaluated on: the built-in arithmetic task, a .jsonl file, or
GSM8K and MATH from the hub, each checked with a one-line error that names the file and the line.

Needs: reward.py (a MATH solution's final answer). All engineering around the algorithm, but for
draw_problems (phase 1 of train.main's loop): a first reading may skip this file."""
import hashlib
import json
import random
import re
import sys

from reward import ARITH_PROMPT, PROMPT, extract_answer, math_answers


class DataError(ValueError):
    """Bad input data: the message names the file, the line and what was expected."""


def first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def arith_problem(rng: random.Random, min_steps: int, max_steps: int, slip: float = 0.0) -> dict:
    """'What is 7+2-5?' -> '7+2=9\n9-5=4\n#### 4'; every running total a single digit, so a tiny
    model learns the arithmetic fast. The SFT 'demonstration' slips by one with p = slip and goes
    on from there."""
    total = sloppy = rng.randint(0, 9)
    question, lines, demo = str(total), [], []
    for _ in range(rng.randint(min_steps, max_steps)):
        # an operation that keeps both totals in 0-9: one exists while they differ by at most 8
        # (<= 8 steps)
        sign, x = rng.choice([(sign, x) for sign in "+-" for x in range(1, 10)
                              if all(0 <= apply(t, sign, x) <= 9 for t in (total, sloppy))])
        question += f"{sign}{x}"
        lines.append(f"{total}{sign}{x}={apply(total, sign, x)}")
        result = apply(sloppy, sign, x)
        if rng.random() < slip:
            result = rng.choice([r for r in (result - 1, result + 1) if 0 <= r <= 9])
        demo.append(f"{sloppy}{sign}{x}={result}")
        total, sloppy = apply(total, sign, x), result
    return {"question": f"What is {question}?", "answer": "\n".join(lines) + f"\n#### {total}",
            "demonstration": "\n".join(demo) + f"\n#### {sloppy}"}


def apply(total: int, sign: str, x: int) -> int:
    return total + x if sign == "+" else total - x


def trap_problem(rng: random.Random, min_steps: int, max_steps: int, traps: tuple[int, int],
                 forget: float) -> dict:
    """--arith-traps: running totals modulo 10, 'What is (7+5-8) mod 10?' -> '7+5=2\n2-8=4\n#### 4',
    chains of any length. A trap is a step that wraps past 9 or below 0 (a carry or a borrow); a
    chain has MIN-MAX of them, at random places. The SFT demonstration makes a systematic error at
    its own wrapping steps: with p = forget it writes the result one too high (mod 10), and goes
    on from there."""
    n = rng.randint(min_steps, max_steps)
    hard = set(rng.sample(range(n), min(n, rng.randint(*traps))))
    total = sloppy = rng.randint(0, 9)
    question, lines, demo = str(total), [], []
    for i in range(n):
        sign, x = rng.choice([(sign, x) for sign in "+-" for x in range(1, 10)
                              if wraps(total, sign, x) == (i in hard)])  # 9 of the 18 either way
        question += f"{sign}{x}"
        lines.append(f"{total}{sign}{x}={apply(total, sign, x) % 10}")
        result = (apply(sloppy, sign, x) + (wraps(sloppy, sign, x) and rng.random() < forget)) % 10
        demo.append(f"{sloppy}{sign}{x}={result}")
        total, sloppy = apply(total, sign, x) % 10, result
    return {"question": f"What is ({question}) mod 10?",
            "answer": "\n".join(lines) + f"\n#### {total}",
            "demonstration": "\n".join(demo) + f"\n#### {sloppy}"}


def wraps(total: int, sign: str, x: int) -> bool:
    return not 0 <= apply(total, sign, x) <= 9


HELD_OUT = 5  # one question in 5 belongs to the held-out split


def split_of(question: str) -> str:
    """'test' for one question in HELD_OUT, chosen by a hash of its text (the same on
    every machine)."""
    digest = hashlib.sha256(question.strip().encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % HELD_OUT == 0 else "train"


ATTEMPTS = 20  # problems drawn per problem asked for, at most: small question spaces run out


def arith_dataset(n: int, seed: int, steps: tuple[int, int] = (2, 5), slip: float = 0.0,
                  traps: tuple[int, int] | None = None, split: str | None = None) -> list[dict]:
    """Up to n problems with distinct questions, all of `split` (None: either); fewer where its
    questions run out (a short chain has few: 10 * 9^n of n steps), after ATTEMPTS * n draws."""
    rng = random.Random(seed)
    draw = (lambda: trap_problem(rng, *steps, traps, slip)) if traps else \
        (lambda: arith_problem(rng, *steps, slip))
    problems, seen = [], set()
    for _ in range(ATTEMPTS * n):
        p = draw()
        if p["question"] not in seen and split in (None, split_of(p["question"])):
            seen.add(p["question"])
            problems.append(p)
            if len(problems) == n:
                break
    return problems


def check_fields(row, where: str, fields: tuple[str, str]):
    """A JSON object with these two non-empty string fields, or a DataError naming where
    it is not."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with '{fields[0]}' and '{fields[1]}', "
                        f"got {type(row).__name__}")
    for field in fields:
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise DataError(f"{where}: missing or empty string field '{field}'")
        try:  # JSON's '\\ud800' escape: valid JSON, not text (sha256 and the tokenizer need UTF-8)
            row[field].encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: field '{field}' holds a lone surrogate "
                            f"({row[field][e.start]!r} at character {e.start}); "
                            "expected text that UTF-8 can write") from None


def check_problem(row, where: str) -> dict:
    check_fields(row, where, ("question", "answer"))
    if not re.fullmatch(r"-?[0-9][0-9,]*(\.[0-9]+)?", extract_answer(row["answer"]) or ""):
        raise DataError(f"{where}: 'answer' has no final '#### <number>' line")
    return {"question": row["question"], "answer": row["answer"]}


def read_jsonl(path: str) -> list[dict]:
    try:
        # a byte-order mark (Windows editors) is accepted
        with open(path, encoding="utf-8-sig") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    problems = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg}); "
                            "expected one object per line") from None
        except RecursionError:
            # Python's parser recurses: 200,000 '[' are valid JSON it cannot read
            raise DataError(f"{path}:{i}: JSON nested too deeply; "
                            "expected one object per line") from None
        # the first row's fields choose the format: MATH's problem/solution, or GSM8K's
        if not problems:
            check = (check_math_problem if isinstance(row, dict) and "problem" in row
                     else check_problem)
        problems.append(check(row, f"{path}:{i}"))
    if not problems:
        raise DataError(f"{path}: no problems found; "
                        "expected JSON lines with 'question' and 'answer'")
    return problems


def load_problems(data: str, split: str, steps: str = "2-5", slip: float = 0.0, traps: str = "",
                  hold_out: bool = False, flag: str = "--data") -> list[dict]:
    """'arith' (up to 2000 problems a split, the same for every seed; no held-out question is a
    training question) | 'gsm8k' (openai/gsm8k) | a .jsonl file (any split; with hold_out, the
    questions of `split` by split_of). Each problem with its prompt text: the reference's template,
    or the built-in task's.
    steps, traps: arith's --arith-steps and --arith-traps, 'MIN-MAX' ('' traps: the plain task).
    flag: the setting that names `data` (--data, --eval-data), for the messages."""
    if data == "arith":
        min_max, n_traps = (tuple(int(n) for n in s.split("-")) if s else None
                            for s in (steps, traps))
        problems = arith_dataset(2000, seed=0 if split == "train" else 10_000, steps=min_max,
                                 slip=slip, traps=n_traps, split=split)
        if len(problems) < 2000 and split == "test":
            print(f"--arith-steps {steps}: the held-out split has only {len(problems)} "
                  "distinct questions")
    elif data.endswith(".jsonl"):
        problems = read_jsonl(data)
        if hold_out:
            problems = held_out_split(problems, data, split)
    elif data == "gsm8k":
        problems = hub_problems(f"{flag} gsm8k", "openai/gsm8k", "main", split, check_problem,
                                "GSM8K's format, "
                                "one {\"question\": ..., \"answer\": ...} object per line")
    elif data == "math":
        problems = hub_problems(f"{flag} math", MATH_HUB[split], None, split, check_math_problem,
                                "MATH's format, "
                                "one {\"problem\": ..., \"solution\": ...} object per line "
                                "(PRM800K's math_splits)")
    else:
        raise DataError(f"{flag} {data!r}: expected 'arith', 'gsm8k', 'math' "
                        "or a path ending in .jsonl")
    template = ARITH_PROMPT if data == "arith" else PROMPT
    return [{**p, "prompt": template.format(question=p["question"].strip())} for p in problems]


def held_out_split(problems: list[dict], data: str, split: str) -> list[dict]:
    """The problems of `split` ('train' or 'test') by split_of; an empty split is refused."""
    kept = [p for p in problems if split_of(p["question"]) == split]
    if not kept:
        distinct = len({p["question"].strip() for p in problems})
        raise DataError(f"{data}: its {len(problems)} problems ({distinct} distinct questions) "
                        f"leave the {split} split empty (one question in {HELD_OUT} is held out, "
                        "by a hash of its text); give --eval-data")
    if split == "test":
        print(f"--data {data} without --eval-data: one question in {HELD_OUT} ({len(kept)}) "
              "is held out for evaluation and not trained on")
    return kept


def warn_other_prompts(cfg):
    """A warning when the evaluation asks in another prompt than training: the built-in task's own
    (ARITH_PROMPT) on one side, the reference's (PROMPT) on the other. --prompt-template and --chat
    pose both alike; MATH with arith is refused later (is_math)."""
    if not cfg.eval_data or cfg.prompt_template or cfg.chat or \
            (cfg.data == "arith") == (cfg.eval_data == "arith") or \
            is_math_data(cfg.data) or is_math_data(cfg.eval_data):
        return
    own = lambda data: ARITH_PROMPT if data == "arith" else PROMPT
    print(f"warning: --eval-data {cfg.eval_data}: asked in its own prompt {own(cfg.eval_data)!r}, "
          f"not in {own(cfg.data)!r}, the one --data {cfg.data} trains in; --prompt-template "
          "poses both in one", file=sys.stderr)


def is_math_data(data: str) -> bool:
    """--data math, or a .jsonl whose first row has MATH's fields (read in full, and checked,
    when loaded)."""
    if not data.endswith(".jsonl"):
        return data == "math"
    try:
        with open(data, encoding="utf-8-sig") as f:
            return "problem" in json.loads(next((line for line in f if line.strip()), "{}"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError):
        return False  # read_jsonl then names the file and line


def hub_problems(setting: str, repo: str, config: str | None, split: str, check,
                 offline_format: str):
    from datasets import load_dataset  # imported here: the offline demo never needs it
    try:
        rows = load_dataset(repo, config, split=split)
    except Exception as e:  # offline, hub and cache errors all end here: one line, not a traceback
        raise DataError(f"{setting}: cannot load {repo} from the hub ({first_line(e)}); "
                        "offline, point --data and --eval-data at local .jsonl files in "
                        f"{offline_format}") from None
    return [check(r, f"{repo}[{split}][{i}]") for i, r in enumerate(rows)]


def draw_problems(problems: list[dict], n: int, seed: int, rank: int = 0,
                  world: int = 1) -> list[dict]:
    """This process's equal share of n problems drawn with `seed` (the same in every process)."""
    picked = random.Random(seed).sample(range(len(problems)),
                                        min(n, len(problems) // world * world))
    return [problems[i] for i in picked[rank::world]]


# PRM800K's split (the reference's): train on the 12,000 problems outside MATH-500, test on MATH-500
MATH_HUB = {"train": "zzy1123/MATH_train_test_split", "test": "HuggingFaceH4/MATH-500"}


def check_math_problem(row, where: str) -> dict:
    """A MATH problem as the rest of the code reads one: 'question' = problem,
    'answer' = gold solution."""
    check_fields(row, where, ("problem", "solution"))
    if not math_answers(row["solution"], row["problem"]):
        raise DataError(f"{where}: 'solution' has no final answer (a \\boxed{{...}})")
    return {"question": row["problem"], "answer": row["solution"], "math": True}


def is_math(problems: list[dict]) -> bool:
    """True for MATH problems, False for GSM8K's format (arith too); one format for training
    and evaluation."""
    if len({bool(p.get("math")) for p in problems}) > 1:
        raise DataError("--data and --eval-data: one holds MATH problems (problem/solution), "
                        "the other GSM8K's (question/answer); they are graded differently, "
                        "so give both in one format")
    return bool(problems) and bool(problems[0].get("math"))
