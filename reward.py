"""This file computes the reward R of a response: 1 for a right final answer, else 0.

- in GSM8K and the built-in task the answer follows a last '#### N', or is in a last \\boxed{};
- in MATH the answers are extracted as the reference does, then compared by math_grader.py.
Reading order: grade, then the graders it calls (gsm8k_reward here, math_reward at the end).
engineering/tasks.py loads the problems. docs/reference.md names the reference's functions
followed here; docs/gpu.md and docs/math.md list where this file departs from them."""
import functools
import re

import math_grader

# the reference's prompt, no trailing space
PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
# the built-in task's: a tiny model has no use for 35 characters of template
ARITH_PROMPT = "{question}\n"
# the reference stops generation here, where the model has begun inventing a next problem
STOP = "\n\n\nProblem:"


def response_reward(ep, response_ids: list[int], tokenizer) -> float:
    """R of a whole response to ep's problem: ep's own, or a prefix of it plus a continuation."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    return grade(text, ep.gold, ep.question, ep.math, ep.style)


def grade(response: str, gold: str, question: str = "", math: bool = False,
          style: str = "hash") -> float:
    """The task's reward R of a response's text: 1.0 for a right final answer, else 0.0.
    The answer is judged by MATH's rules with math, else by GSM8K's (the arith task's too) in
    `style`. `question` matters only to MATH's lists ('separated by commas')."""
    return math_reward(response, gold, question) if math else gsm8k_reward(response, gold, style)


def extract_answer(text: str) -> str | None:
    """Everything after the last '####', stripped, or None when there is no '####'."""
    return text.split("####")[-1].strip() if "####" in text else None


def final_answer(text: str, style: str = "hash") -> str | None:
    """The answer a response gives in `style` (--answer), after the last '####' for hash or in
    the last \\boxed{} for boxed; None when it gives none."""
    if style == "boxed":
        found = boxed_answers(text)
        return found[-1] if found else None
    return extract_answer(text)


def gsm8k_reward(completion: str, gold_answer: str, style: str = "hash") -> float:
    """GSM8K's reward, 1.0 or 0.0. In hash style the answers must match as strings bar commas
    and case ('72.0' and '$72' score 0); in boxed style the last \\boxed{} must equal the gold
    number by math_grader ('72.0' and '\\$72' score 1)."""
    gold = extract_answer(gold_answer)
    gold = gold_answer.strip() if gold is None else gold
    pred = final_answer(completion, style)
    if pred is None:
        return 0.0
    if style == "boxed":
        return float(math_grader.math_equal(math_grader.normalize(pred),
                                            math_grader.normalize(gold)))
    # commas go on both sides, or a gold '#### 2,125' could never score (docs/gpu.md)
    return float(pred.replace(",", "").lower() == gold.replace(",", "").lower())


# ---- MATH (Hendrycks et al. 2021): the answer in \\boxed{}, graded up to equivalence -------------


def boxed_answers(text: str) -> list[str]:
    """The content of every brace-matched \\boxed{...}, with a '%' when one follows the box."""
    answers = []
    # '\boxed 2$' is read as '\boxed{2}' (docs/math.md)
    text = re.sub(r"\\boxed ([^${}\n]+)", r"\\boxed{\1}", text)
    for piece in text.split("boxed{")[1:]:
        depth = 0
        for i, char in enumerate(piece):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth < 0:  # the box closes here; a '%' just after it is kept (docs/math.md)
                answers.append(piece[:i] + ("%" if piece[i + 1: i + 2] == "%" else ""))
                break
    return answers


# Minerva's closing line, its answer in any math delimiters (docs/reference.md)
CLOSING = re.compile(r"final answer is\s*(?:\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\])"
                     r"\s*\.?\s*I hope", re.S)


def extracted_answers(text: str) -> list[str]:
    """The answers a MATH response gives: 'The final answer is $X$. I hope' (X boxed or not),
    else every \\boxed{}, else what follows 'he answer is', else an ```output block, else the
    last number."""
    # only the first closing line counts
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
    """Every extracted answer, normalized, cut to its first line and split into parts: at commas
    when the problem asks for a list, at '\\text{ and }', and at commas outside brackets.
    With whole, a list of each answer's parts."""
    answers = [math_grader.answer_parts(answer, problem) for answer in extracted_answers(text)]
    return answers if whole else [part for parts in answers for part in parts]


@functools.lru_cache(maxsize=20_000)
def gold_math_answers(solution: str, problem: str) -> tuple[str, ...]:
    return tuple(math_answers(solution, problem))


def math_reward(completion: str, gold_solution: str, problem: str = "") -> float:
    """MATH's reward: 1.0 iff the completion's answers match those of the gold solution,
    extracted the same way. `problem` matters only when it asks for a list 'separated by commas'."""
    return float(math_grader.answers_match(math_answers(completion, problem, whole=True),
                                           list(gold_math_answers(gold_solution, problem))))
