"""Tests of MATH: the answer grader (hand-written equivalences, the reference's fallbacks, never a
crash or a hang), the step splitter (the reference's own outputs, in token space, which
boundaries are decided by the text before them), the data path, and, where a copy of MATH-500
lies beside the repository (../shared/data/math/test.jsonl), every gold answer and solution."""
import json
import os
import re
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import math_grader
import train
import vine
from engineering import models, tasks
from engineering.tasks import DataError, is_math, load_problems, read_jsonl
from reward import math_answers, math_reward
from test_realpath import SMALL, llama_style_tokenizer  # SMALL: two iterations, tiny sizes

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE_PATH = os.path.join(HERE, "fixtures", "math_sample.jsonl")
# 17 real MATH problems (fixtures/README.md)
FIXTURE = [json.loads(line) for line in open(FIXTURE_PATH)]
MATH500_PATH = os.path.join(HERE, "..", "shared", "data", "math", "test.jsonl")
MATH500 = ([json.loads(line) for line in open(MATH500_PATH)] if os.path.exists(MATH500_PATH)
           else None)
needs_math500 = pytest.mark.skipif(MATH500 is None, reason="no ../shared/data/math/test.jsonl")
LIST = "Enter all the solutions, separated by commas."


def graded(pred: str, gold: str, problem: str = "") -> float:
    return math_reward(f"So the answer is $\\boxed{{{pred}}}$.", f"Thus $\\boxed{{{gold}}}$.",
                       problem)


# ---- 1. the grader on hand-written cases ------------------------------------------------------

@pytest.mark.parametrize("pred, gold, problem, right", [
    ("\\frac{1}{2}", "0.5", "", 1), ("\\dfrac12", "0.5", "", 1),
    ("\\tfrac{2}{4}", "\\frac{1}{2}", "", 1),
    ("1/2", "\\frac12", "", 1), ("\\frac{3}{57}", "\\frac{3}{56}", "", 0),
    ("\\frac{31}{5}", "6\\frac{1}{5}", "", 1),
    ("\\frac{1}{3}", "0.333", "", 1), ("\\frac{1}{3}", "0.33", "", 0),             # fractions
    ("5\\text{ cm}", "5", "", 1), ("5\\mbox{ cm}", "5", "", 1),
    ("12\\text{ inches}", "13", "", 0),                                            # units
    ("90^\\circ", "90", "", 1), ("90^{\\circ}", "90", "", 1), ("45^\\circ", "90", "", 0),  # degrees
    ("10\\%", "10", "", 1), ("10\\%", "0.1", "", 1), ("10", "10\\%", "", 1),
    ("0.1", "10", "", 0),                                                          # percent
    ("10", "0.1", "", 0), ("x=5", "5", "", 1), ("5", "x=5", "", 1), ("x=6", "5", "", 0),  # x = 5
    ("y=2x+1", "y=1+2x", "", 1), ("2x+1=y", "y=2x+1", "", 1), ("y=2x-1", "y=2x+1", "", 0),
    ("(1, 2)", "(1,2)", "", 1), ("(2,1)", "(1,2)", "", 0),
    ("(0.5,3)", "\\left(\\frac12, 3\\right)", "", 1),
    ("(1,2,3)", "(1,2)", "", 0),                                                   # tuples
    ("[2,5)", "[2,5)", "", 1), ("(2,5)", "[2,5)", "", 0),
    ("(-\\infty, 0]", "(-\\infty,0]", "", 1),                                      # intervals
    ("(1,\\infty)\\cup(-\\infty,0)", "(-\\infty,0)\\cup(1,\\infty)", "", 1),
    ("(-\\infty,0)\\cup(2,\\infty)", "(-\\infty,0)\\cup(1,\\infty)", "", 0),
    ("\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
     "", 1),
    ("\\begin{pmatrix}0.5\\\\-1\\end{pmatrix}", "\\begin{pmatrix}\\frac{1}{2}\\\\-1\\end{pmatrix}",
     "", 1),
    ("\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
     "", 0),                                                                       # matrices
    ("\\sqrt{8}", "2\\sqrt{2}", "", 1), ("\\sqrt2", "\\sqrt{2}", "", 1),
    ("\\sqrt{3}", "\\sqrt{2}", "", 0),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", "", 1), ("\\sqrt[3]{8}", "2", "", 1),  # roots
    ("2\\pi", "\\pi\\cdot 2", "", 1), ("\\frac{\\pi}{2}", "1.5708", "", 1),
    ("3.14", "\\pi", "", 0),                                                       # pi
    ("-11+27i", "27i-11", "", 1), ("2\\cdot 3", "6", "", 1), ("2\\cdot 3", "23", "", 0),
    ("3, 2", "2,3", LIST, 1), ("3,-2", "-2, 3", LIST, 1), ("3,2", "2,3", "", 1),
    ("2,4", "2,3", LIST, 0),
    ("3\\text{ and }2", "2\\text{ and }3", "", 1),                                 # unordered lists
    ("1024", "2^{10}", "", 1), ("2^{10}", "1000", "", 0), ("1,\\!000", "1000", "", 1),
    ("11111111101", "11111111100", "", 0), ("0.0000673", "0.0000672", "", 0),      # numbers
    ("\\text{east}", "\\text{east}", "", 1), ("\\text{(C)}", "\\text{(D)}", "", 0),
    ("East", "west", "", 0),
    ("7.3\\%", "7.2\\%", "", 0), ("2^{100}-3", "2^{100}-2", "", 0),
    ("10112", "1011_2", "", 0),                                                    # found by the
    ("\\frac{h^2}m", "\\frac{h^2}{m}", "", 1), ("\\frac{1}{m}", "1", "", 0),
    ("5\\mathrm{cm}^2", "5", "", 1),
    ("\\sin^{2} t", "\\sin^2 t", "", 1), ("\\sin^2 t", "\\sin^2 x", "", 0),
    ("2t", "2", "", 0),                                                            # other forms
])
def test_hand_written_equivalences(pred, gold, problem, right):
    assert graded(pred, gold, problem) == right


def fraction_forms(num: str, den: str) -> set[str]:
    """\\frac{num}{den} in each way LaTeX reads it: \\frac, \\dfrac or \\tfrac; a one-character
    argument braced, bare, or after a space (a bare letter right after \\frac would make another
    command's name)."""
    def forms(arg: str, first: bool) -> list[str]:
        if len(arg) > 1:
            return ["{" + arg + "}"]
        return ["{" + arg + "}", " " + arg] + ([] if first and arg.isalpha() else [arg])
    return {f"\\{command}{a}{b}" for command in ("frac", "dfrac", "tfrac")
            for a in forms(num, True) for b in forms(den, False)}


@pytest.mark.parametrize("num, den", [("7", "2"), ("x", "y"), ("12", "5"), ("3", "10"),
                                      ("\\sqrt{3}", "2"), ("\\pi", "4"), ("1", "x")])
def test_a_fraction_in_every_latex_form_is_that_fraction(num, den):
    braced, upside_down = f"\\frac{{{num}}}{{{den}}}", f"\\frac{{{den}}}{{{num}}}"
    for form in fraction_forms(num, den):
        assert graded(form, braced) == graded(braced, form) == 1, form
        assert graded(form, upside_down) == graded(upside_down, form) == 0, form
    # as LaTeX reads
    assert graded("\\frac{7}2x", "\\frac{7x}{2}") == graded("\\frac{1}{\\frac{1}2}", "2") == 1


def test_a_unit_in_text_or_mbox_is_dropped_however_it_is_spaced():
    for command in ("text", "mbox"):
        for unit in ("{cm}", "{ cm}", " { cm }", "{ square feet}"):
            for power in ("", "^2", "^{3}"):
                for gap in ("", " ", "\\ ", "\\,"):
                    written = f"12{gap}\\{command}{unit}{power}"
                    assert graded(written, "12") == graded("12", written) == 1, written
                    assert graded(written, "13") == graded("13", written) == 0, written
    assert (graded("\\text { east}", "\\text{East}") == 0
            and graded("\\text { east}", "\\text{east}") == 1)


def test_a_base_subscript_braced_or_not():
    for number, base in [("1011", "2"), ("52", "8"), ("4210", "5"), ("A3", "9")]:
        bare, braced = f"{number}_{base}", f"{number}_{{{base}}}"
        assert (graded(bare, braced) == graded(braced, bare)
                == graded(f"{number}_ {base}", braced) == 1)
        assert (graded(bare, f"{number}_{{{int(base) - 1}}}")
                == graded(f"1{number}_{base}", braced) == 0)
    assert graded("1011_{10}", "1011_{10}") == 1 and graded("1011_{10}", "1011_1") == 0


@pytest.mark.parametrize("name, value, other", [
    ("x", "5", "6"), ("k", "\\frac{1}{2}", "\\frac{1}{3}"), ("(a,b)", "(3,4)", "(4,3)"),
    ("x_1", "7", "8"), ("(x, y, z)", "(1,-2,\\frac12)", "(1,2,\\frac12)"),
    ("\\theta", "\\frac{\\pi}{3}", "\\frac{\\pi}{6}")])
def test_an_answer_named_in_an_assignment_is_its_value(name, value, other):
    named = f"{name} = {value}"
    assert graded(named, value) == graded(value, named) == graded(named, f"{name}={value}") == 1
    assert graded(f"{name}={other}", value) == graded(named, other) == graded(other, named) == 0


def test_an_equation_as_the_answer_stays_an_equation():
    assert (graded("y=2x+3", "y=2x+3") == graded("y = 3 + 2x", "y=2x+3")
            == graded("2x-y+3=0", "y=2x+3") == 1)
    assert graded("y=2x+4", "y=2x+3") == graded("x=2y+3", "y=2x+3") == graded("y=2x", "2x+3") == 0
    # '2x = 6' says x = 3: a number names nothing
    assert graded("2x=6", "6") == graded("6", "2x=6") == 0


@pytest.mark.parametrize("opening, closing",
                         [("$", "$"), ("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")])
def test_minervas_closing_line_in_any_math_delimiters(opening, closing):
    for answer, extracted, same, other in [("\\frac{3}{5}", "\\frac{3}{5}", "0.6", "\\frac{3}{4}"),
                                           ("(1, 2)", "(1,2)", "(1,2)", "(2,1)"),
                                           ("\\boxed{7}", "7", "7", "8")]:
        text = (f"It is 9.\nFinal Answer: The final answer is {opening}{answer}{closing}. "
                "I hope it is correct.")
        assert math_answers(text) == [extracted], text
        assert math_reward(text, f"$\\boxed{{{same}}}$") == 1, text
        assert math_reward(text, f"$\\boxed{{{other}}}$") == 0, text


@pytest.mark.parametrize("items, problem", [(["0", "1"], ""), (["0", "1"], LIST),
                                            (["-1", "\\frac12", "3"], ""), (["3i", "-3i"], ""),
                                            (["B", "C"], "")])
def test_a_list_answer_matches_only_the_whole_list(items, problem):
    """Every element, in any order, and nothing else: a list without brackets is a set of answers
    whether or not the problem says 'separated by commas' (with brackets it is a tuple or an
    interval: in order)."""
    gold = ",".join(items)
    for written in (gold, ", ".join(items), ", ".join(reversed(items))):
        assert graded(written, gold, problem) == 1, written
    for wrong in items + [", ".join(items[1:]), gold + ",5", f"({gold})"]:
        assert graded(wrong, gold, problem) == graded(gold, wrong, problem) == 0, wrong


def test_thousands_separators_against_lists():
    for written, plain in [("1,000", "1000"), ("10,\\!080", "10080"), ("8{,}880", "8880"),
                           ("-11,111,111,100", "-11111111100"),
                           ("\\frac{1}{29,\\!322}", "\\frac{1}{29322}")]:
        assert graded(written, plain) == graded(plain, written) == 1, written
    for written, other in [("3,2", "32"), ("0,1", "1"), ("0,100", "100"), ("1,00", "100"),
                           ("1,000", "1")]:
        assert graded(written, other) == graded(other, written) == 0, written


def test_the_references_extraction_fallbacks():
    assert (math_answers("so the final answer is $\\frac{1}{2}$. I hope it is correct.")
            == ["\\frac{1}{2}"])
    assert (math_answers("First $\\boxed{3}$, then $\\boxed{\\frac{a}{b^{2}}}$.")
            == ["3", "\\frac{a}{b^2}"])
    assert math_answers("Hence the answer is 42.\nMore text") == ["42"]
    assert math_answers("It is 3, then 5, not 1,250 or 7.5 apples") == ["7.5"]  # the last number
    assert math_answers("```output\n12\n```") == ["12"]
    assert math_answers("x = \\boxed 9$.") == ["9"] and math_answers("$\\boxed{10}\\%$") == ["10"]
    assert math_answers("is $\\boxed{10}%$") == ["10%"]  # the reference returned '10}' here
    assert math_answers("no number") == [] and math_reward("no number", "$\\boxed{5}$") == 0.0
    # the last len(gold) answers count: an intermediate boxed result first does not hurt
    assert math_reward("$\\boxed{3}$ so $\\boxed{5}$", "$\\boxed{5}$") == 1.0
    assert math_reward("$\\boxed{5}$ so $\\boxed{3}$", "$\\boxed{5}$") == 0.0
    # the reference: 0
    assert math_reward("$\\boxed{5}$, $\\boxed{3}$, $\\boxed{5}$", "$\\boxed{5}$") == 1.0
    # a list boxed one by one
    assert math_reward("$\\boxed{0}$ and $\\boxed{1}$", "$\\boxed{0, 1}$") == 1.0
    assert math_reward("$\\boxed{0, 1}$", "$\\boxed{0}$ and $\\boxed{1}$") == 1.0
    assert math_reward("$\\boxed{}$", "$\\boxed{}$") == 0.0  # an empty gold matches nothing


def test_every_fixture_gold_grades_one_and_a_changed_answer_zero():
    for row in FIXTURE:
        assert math_reward(row["solution"], row["solution"],
                           row["problem"]) == 1.0, row["unique_id"]
        changed = changed_answer(row["solution"])
        assert math_reward(changed, row["solution"], row["problem"]) == 0.0, row["unique_id"]


@needs_math500
def test_every_math500_gold_grades_one_and_a_changed_answer_zero():
    for row in MATH500:
        problem, solution = row["problem"], row["solution"]
        assert math_reward(solution, solution, problem) == 1.0, row["unique_id"]
        assert math_reward(f"$\\boxed{{{row['answer']}}}$", solution,
                           problem) == 1.0, row["unique_id"]
        assert math_reward(changed_answer(solution), solution, problem) == 0.0, row["unique_id"]


def last_box(solution: str) -> tuple[int, int]:
    """Where the content of the solution's last \\boxed{...} begins and ends."""
    start = solution.rindex("boxed{") + len("boxed{")
    depth, end = 0, start
    while depth >= 0:
        depth += {"{": 1, "}": -1}.get(solution[end], 0)
        end += 1
    return start, end - 1


def changed_answer(solution: str) -> str:
    """The solution with its last boxed answer changed: its last digit before any unit + 1 (mod 10),
    or '+1' appended ('864\\mbox{ inches}^2' -> '865\\mbox{ inches}^2': a unit is dropped, its power
    with it)."""
    start, end = last_box(solution)
    answer = solution[start:end]
    digits = [m.start() for m in re.finditer(r"\d", re.split(r"\\text|\\mbox", answer)[0])]
    if digits:
        answer = (answer[: digits[-1]] + str((int(answer[digits[-1]]) + 1) % 10)
                  + answer[digits[-1] + 1:])
    else:
        answer += "+1"
    return solution[:start] + answer + solution[end:]


# a brace group (one level nested within) or one character
ARG = r"(\{(?:[^{}]|\{[^{}]*\})*\}|[0-9A-Za-z])"
FRAC = re.compile(r"\\([dt]?frac)\s*" + ARG + r"\s*" + ARG)
bare = lambda arg: arg[1] if re.fullmatch(r"\{[0-9A-Za-z]\}", arg) else arg
braced = lambda arg: arg if arg.startswith("{") else "{" + arg + "}"
ALONE = r"(?![0-9A-Za-z.])"  # not followed by what a greedy reader would take into the argument
OTHER_FORMS = {  # each rewrites every place it applies; each writes the same LaTeX
    "\\frac{a}b": lambda s: FRAC.sub(lambda m: f"\\{m[1]}{m[2]}{bare(m[3])}", s),
    "\\frac ab": lambda s: FRAC.sub(lambda m: f"\\{m[1]} {bare(m[2])}{bare(m[3])}", s),
    "\\frac{a}{b}": lambda s: FRAC.sub(lambda m: f"\\{m[1]}{braced(m[2])}{braced(m[3])}", s),
    "\\dfrac": lambda s: s.replace("\\frac", "\\dfrac"),
    "\\frac for \\dfrac": lambda s: re.sub(r"\\[dt]frac", r"\\frac", s),
    "\\sqrt 2, x^2, 1011_2": lambda s: re.sub(r"(\\sqrt|\^|_)\{([0-9A-Za-z])\}" + ALONE,
                                           lambda m: (m[1] + (" " if m[1] == "\\sqrt" else "")
                                                      + m[2]), s),
    "\\sqrt{2}, x^{2}, 1011_{2}": lambda s: re.sub(r"(\\sqrt|\^|_)\s*([0-9A-Za-z])" + ALONE,
                                                   r"\1{\2}", s),
}


def other_form_pairs(rows: list[dict]):
    """(response, gold solution, problem, form) for each answer of `rows` that a form writes
    otherwise: the `answer` field so written, boxed; the solution with its final answer so written,
    against the solution and the other way round."""
    for row in rows:
        solution, problem = row["solution"], row["problem"]
        start, end = last_box(solution)
        for name, rewrite in OTHER_FORMS.items():
            if rewrite(row["answer"]) != row["answer"]:
                yield f"So it is $\\boxed{{{rewrite(row['answer'])}}}$.", solution, problem, name
            if rewrite(solution[start:end]) != solution[start:end]:
                written = solution[:start] + rewrite(solution[start:end]) + solution[end:]
                yield written, solution, problem, name
                yield solution, written, problem, name


@needs_math500
def test_every_math500_answer_in_its_other_common_forms_grades_one():
    pairs = list(other_form_pairs(MATH500))
    # 5 of MATH-500's answers write \\frac{a}b, hundreds \\frac{a}{b} or \\dfrac
    assert len(pairs) > 500
    wrong = [(name, response[-40:], gold[-40:]) for response, gold, problem, name in pairs
             if math_reward(response, gold, problem) != 1]
    assert not wrong


@pytest.mark.parametrize("answer", [
    "9^{9^{9^{9}}}", "(10^{999})^{999}", "10^{10^{10}}", "99999!", "2^{100000}", "x^{y^{z}}",
    "\\frac{" * 200,
    "__import__('os').system('echo hi')", "().__class__", "a.b.c",
    "\\sqrt{" * 50 + "2" + "}" * 50, "x" * 5000,
    "\\begin{pmatrix}" + "1&" * 300 + "\\end{pmatrix}", "(" * 300 + ")" * 300,
    "\\frac{1}{0}", "0^{-1}",
    "\ud800",
])
def test_hostile_answers_grade_zero_quickly(answer):
    start = time.perf_counter()
    assert graded(answer, "7") == 0.0 and graded("7", answer) == 0.0
    # a bound, not a timing claim
    assert time.perf_counter() - start < 2 * math_grader.SYMPY_SECONDS + 5


LATEXISH = st.sampled_from(list("0123456789+-*/^=.,()[]{}$%!xyzi\\ \nboxedfracsqrtpi"))


@given(st.text(alphabet=LATEXISH, max_size=60), st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_grader_and_splitter_take_any_text(latexish, anything):
    for completion in (latexish, "$\\boxed{" + latexish + "}$", anything):
        assert math_reward(completion, "$\\boxed{" + latexish + "}$", LIST) in (0.0, 1.0)
        bounds = math_grader.math_step_offsets(completion)
        assert bounds[0] == 0 and bounds[-1] == len(completion)
        # '' is one empty step
        assert all(a < b for a, b in zip(bounds, bounds[1:])) or bounds == [0, 0]


def test_the_time_limit_interrupts_a_long_computation():
    with pytest.raises(math_grader.OutOfTime):
        with math_grader.time_limit(0.05):
            while True:
                pass
    assert (not math_grader.safe_to_parse("__import__(os)")
            and not math_grader.safe_to_parse("2**(2**(2**9))"))
    assert (math_grader.safe_to_parse("((sqrt(3))/(2)) pi")
            and math_grader.safe_to_parse("x**(2)+y**(2)"))


# ---- 2. the step splitter -----------------------------------------------------------------------

# the reference's own outputs (its split_solution_inplace)
@pytest.mark.parametrize("text, steps", [
    ("Let $x=3$. Then $y=4$. So the answer is $\\boxed{7}$.",
     ["Let $x=3$. Then $y=4$.", " So the answer is $\\boxed{7}$."]),
    ("We get $x = 5.$ Then $y=2x = 10.$ So $x+y=\\boxed{15}$.",
     ["We get $x = 5.$", " Then $y=2x = 10.$", " So $x+y=\\boxed{15}$."]),
    ("Note that\n\\[a^2+b^2=4+9=13.\\]Thus the answer is $\\boxed{13}$.",
     ["Note that\n\\[a^2+b^2=4+9=13.\\]", "Thus the answer is $\\boxed{13}$."]),
    ("If he lifts two 15-pound weights instead for $n$ times, he will lift a total of "
     "$2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve "
     "for $n$: \\begin{align*}\n30n&=480\\\\\n"
     "\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}",
     ["If he lifts two 15-pound weights instead for $n$ times,",
      " he will lift a total of $2\\cdot15\\cdot n=30n$ pounds of weight.",
      "  Equating this to 480 pounds, we can solve for $n$: \\begin{align*}", "\n30n&=480\\\\",
      "\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}", "\n\\end{align*}"]),
    ("", [""]), ("ab", ["ab"]), ("\n", ["\n"]),
])
def test_math_steps_as_the_reference_splits(text, steps):
    bounds = math_grader.math_step_offsets(text)
    assert [text[a:b] for a, b in zip(bounds, bounds[1:])] == steps


def check_steps(text: str) -> list[int]:
    """No empty step; a boundary inside a LaTeX span only where the reference cuts one: after a math
    separator (',$', '=', '+', ...) of a part over 100 characters; in a multi-line span also at a
    newline, or after prose punctuation (a piece cut at a newline inside a span no longer sees the
    span whole)."""
    bounds = math_grader.math_step_offsets(text)
    assert (bounds[0] == 0 and bounds[-1] == len(text)
            and all(a < b for a, b in zip(bounds, bounds[1:])))
    spans = [m.span() for pattern in math_grader.MATH_SPANS
             for m in re.finditer(pattern, text, flags=re.S)]
    math_cut, prose_cut = r"(,\$|,\\\)|,\\\]|=|\\equiv|\+|\\cancelto)$", r"(,|\sand|:|\sto)$"
    for b in bounds[1:-1]:
        for lo, hi in (span for span in spans if span[0] < b < span[1]):
            multi_line = "\n" in text[lo:hi]
            at_prose_cut = text[b] == "\n" or re.search(prose_cut, text[:b])
            assert re.search(math_cut, text[:b]) or multi_line and at_prose_cut
    return bounds


def test_fixture_solutions_split_without_empty_steps():
    for row in FIXTURE:
        check_steps(row["solution"])
        check_steps("\n" + row["solution"] + "\n")  # as the SFT response writes it


@needs_math500
def test_math500_steps_as_the_reference_counts_them():
    """Every MATH-500 solution; the statistics the reference's splitter gives (mean 9.6 steps,
    median 7, median step 55 characters, 3.6% of steps over 100 characters)."""
    counts, lengths = [], []
    for row in MATH500:
        bounds = check_steps(row["solution"])
        counts.append(len(bounds) - 1)
        lengths += [b - a for a, b in zip(bounds, bounds[1:])]
    assert round(statistics.mean(counts), 1) == 9.6 and statistics.median(counts) == 7
    assert (statistics.median(lengths) == 55
            and round(sum(n > 100 for n in lengths) / len(lengths), 3) == 0.036)


def test_math_steps_in_token_space():
    """Each token is in its first character's step: with a character-level tokenizer the token
    steps are the character steps; with a SentencePiece-style one, a step starts at the first
    token starting in it."""
    texts = ["\n" + row["solution"] + "\n" for row in FIXTURE]
    tok = llama_style_tokenizer(texts + [row["problem"] for row in FIXTURE])
    multi_step = 0
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        pieces = vine.token_texts(tok, ids)
        firsts = [sum(map(len, pieces[:t])) for t in range(len(ids))]
        bounds = math_grader.math_step_offsets("".join(pieces))
        expected = sorted({0} | {next(t for t, c in enumerate(firsts) if c >= b)
                                 for b in bounds[1:-1]})
        assert vine.response_step_starts(tok, ids, math=True) == expected
        multi_step += len(expected) > 1
        chars = list(text)  # one token per character
        assert vine.token_steps(chars, bounds[1:-1]) == bounds[:-1]
    assert multi_step >= 12  # of the 17 solutions


# ---- 2b. which step boundaries are decided by the text before them (docs/math.md) ---------------
# A boundary b is decided by its past when the steps of text[:b] + X up to b are the steps of the
# text up to b whatever X follows: then the state text[:b] is a stopping time and VinePPO's
# advantage at it has no look-ahead term.

def continuations(other: str) -> list[str]:
    """The fixed continuations tried after a boundary.
    The response ends there, or ends with the SFT's closing newline; a sentence that opens with a
    capital, and the same in lower case; another solution, whole and from its second step."""
    bounds = math_grader.math_step_offsets(other)
    sentence = "hen we have $x = 1$ and $y = 2$.\n"
    return ["", "\n", " T" + sentence, " t" + sentence, other, other[bounds[1]:]]


def boundary_kind(text: str, b: int) -> str:
    """The rule that put the step boundary at b, read from the text around it.
    Math that ends a sentence first (a newline may follow it), then a newline inside a LaTeX span
    or outside, then a sentence end; anything else is a cut near a long part's middle."""
    if text[:b].endswith(math_grader.MATH_ENDS):
        return "math ends a sentence"
    if text[b] == "\n":
        spans = [m.span() for pattern in math_grader.MATH_SPANS
                 for m in re.finditer(pattern, text, flags=re.S)]
        return "newline in a span" if any(lo < b < hi for lo, hi in spans) else "newline"
    if text[b - 1] == "." and re.match(r"\s+[A-Z]", text[b:]):
        return "sentence end"
    return "long part's middle"


def look_ahead(text: str, other: str) -> dict[int, tuple[str, bool, bool]]:
    """Each boundary b of text's steps (not 0 or the end): its kind, and whether it is look-ahead.
    It is when text[:b] + X has other steps up to b than text has, for some X of
    continuations(other) (first bool), or for one of 20 characters or more (second: the
    response goes on, so no short last part follows b). A lower bound: a finite set of X, and
    only the text's own boundaries are tried (not a position that another X would make one)."""
    bounds = math_grader.math_step_offsets(text)
    found = {}
    for b in bounds[1:-1]:
        upto = lambda steps: [c for c in steps if c <= b]
        changed = [x for x in continuations(other)
                   if upto(math_grader.math_step_offsets(text[:b] + x)) != upto(bounds)]
        found[b] = (boundary_kind(text, b), bool(changed), any(len(x) >= 20 for x in changed))
    return found


def look_ahead_counts(rows: list[dict]) -> dict[str, list[int]]:
    """{kind: [boundaries, look-ahead ones, look-ahead ones with the response going on]}.
    Over the solutions written as the SFT response ('\\n' + solution + '\\n'), each continued by
    the next row's; 'all' sums the kinds, 'responses' counts responses with at least one."""
    texts = ["\n" + row["solution"] + "\n" for row in rows]
    counts = {"all": [0, 0, 0], "responses": [0, 0, 0]}
    for i, text in enumerate(texts):
        found = look_ahead(text, texts[(i + 1) % len(texts)]).values()
        for kind, *ahead in found:
            for key in kind, "all":
                counts[key] = [n + k for n, k in zip(counts.get(key, [0, 0, 0]), [1, *ahead])]
        seen = [True, any(a for _, a, _ in found), any(g for _, _, g in found)]
        counts["responses"] = [n + k for n, k in zip(counts["responses"], seen)]
    return counts


def test_look_ahead_boundaries_of_the_fixture_as_docs_math_counts_them():
    """docs/math.md's figures for the fixture: every boundary is look-ahead once the response may
    end after it; with the response going on, every sentence end and newline, most long parts'
    middles, and no cut after math that ends a sentence."""
    assert look_ahead_counts(FIXTURE) == {
        "all": [37, 37, 28], "responses": [17, 14, 12],
        "math ends a sentence": [6, 6, 0], "newline": [4, 4, 4], "newline in a span": [7, 7, 7],
        "sentence end": [4, 4, 4], "long part's middle": [16, 16, 13]}


def steps_up_to(text: str, end: int) -> list[int]:
    return [c for c in math_grader.math_step_offsets(text) if c <= end]


@pytest.mark.parametrize("prefix, one, other, kind, going_on", [
    # a sentence end: a cut after '.' only before spaces and a capital
    ("We know that x is two.", " Then y is three here.", " then y is three here.",
     "sentence end", True),
    # a newline opens its part: a cut before the '\n'
    ("We know that x is two", "\nso y is three here.", " so y is three here.", "newline", True),
    # a newline inside a span is cut only once the span closes
    ("So \\begin{align*}\nx&=1\\\\", "\ny&=2\n\\end{align*}", "\ny&=2 and more text goes on",
     "newline in a span", True),
    # a part over 100 characters is cut near its middle: where it ends moves the middle
    ("We know that x is two, and y is three, and z is four,",
     " and w is five, and v is six, and u is seven, and so on.",
     " and w is five, and v is six, and u is seven, and t is eight, and s is nine, and so on.",
     "long part's middle", True),
    # a last part under 20 characters joins the one before: the response's end decides, even
    # after math that ends a sentence, a cut otherwise decided by its past
    ("We get $x = 5.$", " Then y is five too, as said.", "\n", "math ends a sentence", False),
])
def test_a_look_ahead_boundary_kind_by_two_texts_sharing_a_prefix(prefix, one, other, kind,
                                                                  going_on):
    """Two texts sharing a prefix, with other steps within it; look_ahead finds the boundary at
    the prefix's end (other is one of the continuations it tries) and its kind."""
    assert steps_up_to(prefix + one, len(prefix)) != steps_up_to(prefix + other, len(prefix))
    assert look_ahead(prefix + one, other)[len(prefix)] == (kind, True, going_on)


def test_a_cut_after_math_that_ends_a_sentence_is_decided_by_its_past():
    """The cut after '.$' stands whatever follows, as long as the response goes on (and no '$'
    follows the closing '$' at once: once in the 12,000 training solutions)."""
    prefix = "We get $x = 5.$"
    for rest in [" Then y is five too, as said.", " and so y is five, as said.",
                 "\n\nNext, we find y from x."]:
        assert steps_up_to(prefix + rest, len(prefix)) == [0, len(prefix)]


# ---- 3. data, settings and the whole path -------------------------------------------------------

def test_math_jsonl_read_by_its_fields_and_errors_name_file_and_line(tmp_path):
    problems = read_jsonl(FIXTURE_PATH)
    assert len(problems) == 17 and is_math(problems)
    assert problems[0] == {"question": FIXTURE[0]["problem"], "answer": FIXTURE[0]["solution"],
                           "math": True}
    bad = tmp_path / "bad.jsonl"
    good = '{"problem": "p", "solution": "$\\\\boxed{1}$"}\n'
    for content, message in [(good + '{"problem": "q"}\n',
                              "bad.jsonl:2: missing or empty string field"),
                             ('{"problem": "p", "solution": "no answer"}\n',
                              "bad.jsonl:1: 'solution' has no"),
                             (good + "[1]\n", "bad.jsonl:2: expected a JSON object")]:
        bad.write_text(content)
        with pytest.raises(DataError, match=re.escape(message)):
            read_jsonl(str(bad))
    with pytest.raises(DataError, match="one holds MATH problems"):
        is_math(problems + [{"question": "q", "answer": "#### 1"}])


HOSTILE = [("surrogate.jsonl", '{"question": "What is \\ud800 1+1?", "answer": "#### 2"}', 3,
            "lone surrogate"),
           ("math.jsonl", '{"problem": "p", "solution": "$\\\\boxed{\\udfff}$"}', 3,
            "lone surrogate"),
           ("deep.jsonl", "[" * 200_000, 1, "nested too deeply"),
           ("deep2.jsonl", "[" * 200_000, 3, "nested too deeply")]


@pytest.mark.parametrize("name, line, number, message", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_valid_but_hostile_json_is_refused_naming_file_and_line(tmp_path, name, line, number,
                                                                message):
    """A lone surrogate (valid JSON, no valid text: sha256 and the tokenizer fail on it) and deep
    nesting (Python's parser recurses): refused on reading, and the format check of the command line
    survives them."""
    first = '{"problem": "q", "solution": "$\\\\boxed{1}$"}' if name == "math.jsonl" else \
        '{"question": "q", "answer": "#### 1"}'
    path = tmp_path / name
    path.write_text("\n".join(([] if number == 1 else [first, first]) + [line, first]) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:{number}: ") + ".*" + message) as error:
        load_problems(str(path), "test", hold_out=True)
    assert "\n" not in str(error.value)
    # deep.jsonl's first line: not MATH's
    assert tasks.is_math_data(str(path)) == (name == "math.jsonl")


@pytest.mark.slow
def test_train_refuses_hostile_json_in_one_line(tmp_path):
    """Through the command line (its format check reads the first line too): one line,
    exit status 2."""
    import subprocess
    import sys
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "\n")
    run = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--data", str(path),
                          "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    expected = f"error: {path}:1: JSON nested too deeply; expected one object per line\n"
    assert run.returncode == 2 and run.stderr == expected, run.stderr[-500:]


def test_math_settings_apply_where_the_user_sets_nothing():
    paper = train.parse_args(["--model", "rho-math-1.1b", "--data", "math"])
    assert paper.model == models.MATH_ALIASES["rho-math-1.1b"] == "realtreetune/rho-1b-sft-MATH"
    assert (paper.iterations, paper.max_value_states, paper.eval_samples) == (1000, 0, 16)
    gsm8k = train.parse_args(["--model", "rho-math-1.1b", "--data", "gsm8k"])
    # as before
    assert (gsm8k.model, gsm8k.iterations, gsm8k.max_value_states) == ("rho-math-1.1b", 650, 26)
    mine = train.parse_args(["--data", FIXTURE_PATH, "--max-value-states", "5",
                             "--iterations", "3"])
    # and the demo's settings
    assert (mine.iterations, mine.max_value_states, mine.sft_steps) == (3, 5, 1500)
    assert train.parse_args(["--data", FIXTURE_PATH]).max_value_states == 0


def test_help_names_the_math_defaults(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("1000 with MATH data, else 650" in text and "0 with MATH data, else 26" in text
            and "'math'" in text)


def test_offline_math_data_fails_in_one_line(monkeypatch):
    """The hub's failure in one line (GSM8K's code, whose real offline run
    test_realpath.py checks)."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/MATH-500' on the Hub "
                              "(LocalEntryNotFound)\nmore")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as error:
        load_problems("math", "test")
    assert str(error.value).startswith("--data math: cannot load HuggingFaceH4/MATH-500 "
                                       "from the hub (Couldn't")
    assert ("\n" not in str(error.value) and "problem" in str(error.value)
            and ".jsonl" in str(error.value))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["vineppo", "ppo", "tppo", "grpo"])
def test_math_path_with_the_tiny_model(tmp_path, algo):
    """--data on MATH's format end to end, in this process: SFT on the gold solutions, an iteration
    of each --algo graded by math_reward, MATH's steps with no cap on MC states, a checkpoint."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(train.parse_args(["--data", FIXTURE_PATH, "--algo", algo, "--out", str(tmp_path),
                                     *SMALL, "--iterations", "1"]))
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["iteration"] for row in rows] == [0, 1] and rows[-1]["episodes"] == 8
    assert rows[-1]["mc_states"] > 0 if algo == "vineppo" else "policy_loss" in rows[-1]
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=True)
    settings = json.loads((tmp_path / "config.json").read_text())
    assert settings["max_value_states"] == 0 and state["iteration"] == 1
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    problems = {row["solution"]: row["problem"] for row in FIXTURE}
    assert all(s["reward"] == math_reward(s["response"], s["gold"], problems[s["gold"]])
               for s in samples)
