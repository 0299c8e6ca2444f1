"""The reward R of a response: 1 for a right final answer, else 0.

- GSM8K's format (the built-in task too): the answer after a last '#### N', or in a last \\boxed{};
- MATH's: the reference's answer extraction, then math_grader.py's equivalence.
Read in order: grade, then the graders it calls (gsm8k_reward here, math_reward at the end).
The problems themselves are loaded by engineering/tasks.py."""
import functools
import re

import math_grader

# the reference's prompt, no trailing space
PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
# the built-in task's: a tiny model has no use for 35 characters of template
ARITH_PROMPT = "{question}\n"
# the reference stops generation here: the model has begun inventing a next problem
STOP = "\n\n\nProblem:"


def response_reward(ep, response_ids: list[int], tokenizer) -> float:
    """R of a whole response to ep's problem (ep's own, or a prefix of it + a continuation)."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    return grade(text, ep.gold, ep.question, ep.math, ep.style)


def grade(response: str, gold: str, question: str = "", math: bool = False,
          style: str = "hash") -> float:
    """R, the task's reward of a response's text: 1.0 for a right final answer by MATH's rules
    (math) or by GSM8K's (arith too) in `style`, else 0.0. `question` matters only to MATH's
    lists ('separated by commas')."""
    return math_reward(response, gold, question) if math else gsm8k_reward(response, gold, style)


def extract_answer(text: str) -> str | None:
    """Everything after the last '####', stripped; None when there is no '####'
    (reference: tasks/gsm8k.py)."""
    return text.split("####")[-1].strip() if "####" in text else None


def final_answer(text: str, style: str = "hash") -> str | None:
    """The answer a response gives in `style` (--answer): after the last '####' (hash) or inside the
    last \\boxed{} (boxed); None when it gives none."""
    if style == "boxed":
        found = boxed_answers(text)
        return found[-1] if found else None
    return extract_answer(text)


def gsm8k_reward(completion: str, gold_answer: str, style: str = "hash") -> float:
    """hash: 1.0 iff the answers match as strings bar commas and case ('72.0', '$72' score 0, as in
    the reference); boxed: iff the last \\boxed{} equals the gold number by math_grader
    ('72.0', '\\$72' score 1)."""
    gold = extract_answer(gold_answer)
    gold = gold_answer.strip() if gold is None else gold
    pred = final_answer(completion, style)
    if pred is None:
        return 0.0
    if style == "boxed":
        return float(math_grader.math_equal(math_grader.normalize(pred),
                                            math_grader.normalize(gold)))
    # The reference (tasks/gsm8k.py, GSM8K.grade_answer) removes commas from the prediction only, so
    # a gold answer written '#### 2,125' (14 of GSM8K's 1319 test problems) could never score:
    # removed on both sides here.
    return float(pred.replace(",", "").lower() == gold.replace(",", "").lower())


# ---- MATH (Hendrycks et al. 2021): the answer in \\boxed{}, graded up to equivalence -------------


def boxed_answers(text: str) -> list[str]:
    """The content of every brace-matched \\boxed{...}, with a '%' written just after it."""
    answers = []
    # '\boxed 2$': the reference found none
    text = re.sub(r"\\boxed ([^${}\n]+)", r"\\boxed{\1}", text)
    for piece in text.split("boxed{")[1:]:
        depth = 0
        for i, char in enumerate(piece):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth < 0:  # the reference kept '...}' instead of '...%' here
                answers.append(piece[:i] + ("%" if piece[i + 1: i + 2] == "%" else ""))
                break
    return answers


# Minerva's closing line, its answer in any math delimiters (the reference read only '$...$')
CLOSING = re.compile(r"final answer is\s*(?:\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\])"
                     r"\s*\.?\s*I hope", re.S)


def extracted_answers(text: str) -> list[str]:
    """The reference's extract_answer: 'The final answer is $X$. I hope' (X boxed or not),
    else every \\boxed{}, else what follows 'he answer is', else an ```output block, else the
    last number."""
    # the first only, as the reference
    closing = CLOSING.match(text, max(text.find("final answer is"), 0))
    if closing:
        found = next(group for group in closing.groups() if group is not None)
        return boxed_answers(found) if "boxed" in found else [found]
    if "boxed" in text:
        return boxed_answers(text)
    if "he answer is" in text:
        return [text.split("he answer is")[-1]]
    if "```output" in text and text.split("```output")[-1].split("```")[0].strip():
        return [text.split("```output")[-1].split("```")[0]]
    return re.findall(r"-?\d*\.?\d+", text.replace(",", ""))[-1:]


def math_answers(text: str, problem: str = "", whole: bool = False) -> list:
    """The reference's extract_math_answer: every extracted answer normalized, first line only, and
    split into several: at commas when the problem asks for a list, at '\\text{ and }', at commas
    outside brackets. whole: a list of each answer's parts."""
    answers = [math_grader.answer_parts(answer, problem) for answer in extracted_answers(text)]
    return answers if whole else [part for parts in answers for part in parts]


@functools.lru_cache(maxsize=20_000)
def gold_math_answers(solution: str, problem: str) -> tuple[str, ...]:
    return tuple(math_answers(solution, problem))


def math_reward(completion: str, gold_solution: str, problem: str = "") -> float:
    """1.0 iff the completion's answers match those of the gold solution, extracted the same way
    (the reference's eval_math; `problem` matters only when it asks for a list
    'separated by commas')."""
    return float(math_grader.answers_match(math_answers(completion, problem, whole=True),
                                           list(gold_math_answers(gold_solution, problem))))
