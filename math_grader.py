"""MATH's text rules a first reading skips: answers compared up to mathematical equivalence (the
reference's Minerva-style grader, tasks/math_grader_minerva.py, tasks/math_answer_exctraction.py
`strip_string`, rewritten, with the differences listed in docs/math.md), and where a MATH solution's
reasoning steps begin (tasks/math_extract_steps_inplace.py). Not needed to read the algorithm:
reward.math_reward calls `answers_match`, vine.response_step_starts calls `math_step_offsets`.
Outside the core's line budget (keep it under ~520 lines); needs no sibling.

    normalize(answer)           string clean-up: \\dfrac -> \\frac, units, degrees, \\left,
                                spaces, ...
    answer_parts(answer, prob)  an extracted answer normalized, and split where the problem asks
                                for a list
    math_equal(pred, gold)      strings, then close numbers, tuples and intervals, matrices, 'x=5',
                                then sympy (time-limited; any parser error is 'not equal')
    answers_match(answers, golds)  every prediction matches a gold answer and every gold one a
                                prediction
    math_step_offsets(text)     [0, start of step 2, ..., len(text)]: sentences and lines, LaTeX
                                kept whole
"""
import contextlib
import functools
import math
import re
import signal
import threading
from itertools import accumulate

# the reference allows 15 s per simplification; a grade sits inside every MC continuation
SYMPY_SECONDS = 2.0
MAX_SYMPY_CHARS = 300  # longer is not an answer: not parsed
KNOWN_NAMES = ("sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "log", "exp")
LATEX_NAMES = {"\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/",
               "\\ln": " log ", "\\log": " log ", "\\exp": " exp ",
               **{f"\\{f}": f" {f} " for f in KNOWN_NAMES[3:9]}}


# ---- normalisation (the reference's strip_string) ------------------------------------------------

UNIT = r"\\(text|mbox)\{[^{}]*\}(\^\{?[23]\}?)?$"  # '5\text{ cm}', '15\mbox{ cm}^2': dropped
# '11,111,100': a number; '0,1' and '1,00' are lists
THOUSANDS = r"-?[1-9]\d{0,2}(,\d{3})+(\.\d+)?%?"
LATEX_TOKEN = re.compile(r"\\[A-Za-z]+|\\?.", re.S)  # a command's name, or one character


def normalize(answer: str) -> str:
    s = str(answer).strip().replace("\n", "").rstrip(".").replace("\\!", "").replace("{,}", ",")
    s = re.sub(r"\\(text|mbox)\s+\{", r"\\\1{", s)  # '\text { cm}' is '\text{ cm}'
    # the reference deleted a whole \mbox{Saturday}
    if re.match(r"\\(text|mbox)\{", s) and s.endswith("}"):
        s = s[s.index("{") + 1:-1]
    s = re.sub(r"\\[tdc]frac", r"\\frac", s).replace("\\left", "").replace("\\right", "")
    # the reference's r'\\text{.*?}$', with \mbox and a power
    without_unit = re.sub(UNIT, "", s).strip()
    s = without_unit if without_unit else s
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").strip()
    # the reference's units {cm}, {m}^2 and '5 t', here after a text command and a plain number
    # only: it read \frac{h^2}{m} as \frac{h^2} and \sin^2 t as \sin^2
    s = re.sub(r"\\(mathrm|text|mbox|rm)\{(c|m)?m\}(\^(2|3))?", "", s).strip()
    s = re.sub(r"p\.m\.$", "", s).strip()
    s = re.sub(r"^(-?[\d.,]+)\s+t$", r"\1", s).strip()
    s = s.replace("\\$", "").replace("$", "").replace("x\\in", "").replace("\\%", "%")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.replace("\\cdot", "*")  # the reference deletes it: '2\cdot 3' became '23'
    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = s.replace("\\mathbf", "").replace("\\mathrm", "")
    s = re.sub(r"\\mbox{.*?}", "", s)
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    s = re.sub(r"(\d+)\.0+([^\d])", r"\1\2", s)
    s = re.sub(r"(\d+)\.0+$", r"\1", s)
    if s.startswith("."):
        s = "0" + s
    for command in ("sqrt", "tan"):  # '\sqrt2' -> '\sqrt{2}', also '\sqrt 2' inside the answer
        s = re.sub(rf"\\{command}\s*(-?[0-9.a-zA-Z]+)", rf"\\{command}{{\1}}", s)
    # 1011_{2} -> 1011_2
    s = re.sub(r"([_^])\{([0-9A-Za-z])\}(?![0-9A-Za-z.])", r"\1\2", s.replace(" ", ""))
    s = re.sub(r"(?<!\\)\{(" + THOUSANDS + r")\}", lambda m: "{" + m[1].replace(",", "") + "}", s)
    s = slash_to_frac(braced_fracs(s))
    return re.sub(r"(\\|,|\.)+$", "", s)


def answer_parts(answer: str, problem: str = "") -> list[str]:
    """An extracted answer's first line, normalized, split at commas when the problem asks for a
    list ('separated by commas'), else at '\\text{ and }' and at commas outside brackets (a bare
    list is a list whatever the problem says; a number with thousands separators is not one)
    (reward.math_answers)."""
    return list(parts_of(answer, "separated by commas" in problem))


@functools.lru_cache(maxsize=200_000)
def parts_of(answer: str, asks_for_a_list: bool) -> tuple[str, ...]:
    answer = normalize(answer.strip().split("\n")[0].lstrip(":").rstrip(".").rstrip("/"))
    if asks_for_a_list and not any(c in answer for c in "()[]"):
        return tuple(a.strip() for a in answer.split(","))
    parts = [a.strip() for a in re.split(r"\\text\{\s*and\s*\}", answer)]
    return tuple(item for part in parts for item in list_items(part))


def list_items(s: str) -> list[str]:
    """'0,1' -> ['0', '1']: split at the commas outside every bracket; '(0,1)', '1,000' and '1'
    stay whole."""
    depth, cuts = 0, [-1]
    for i, char in enumerate(s):
        depth += (char in "{([") - (char in "})]")
        if char == "," and depth == 0:
            cuts.append(i)
    if len(cuts) == 1 or re.fullmatch(THOUSANDS, s):
        return [s]
    return [item for a, b in zip(cuts, cuts[1:] + [len(s)]) if (item := s[a + 1:b].strip())]


def braced_fracs(s: str) -> str:
    """Both arguments of every \\frac braced, as LaTeX reads them (a brace group, a command such as
    \\pi, else one character): '\\frac12' -> '\\frac{1}{2}', '\\frac{7}2' -> '\\frac{7}{2}',
    '\\frac\\pi4' -> '\\frac{\\pi}{4}'; the last \\frac first (an argument may hold one); unchanged
    when one is cut short."""
    written = s
    for at in reversed([m.end() for m in re.finditer(r"\\frac", s)]):
        for _ in range(2):
            end = argument_end(s, at)
            if end is None:
                return written
            if s[at] != "{":
                s, end = s[:at] + "{" + s[at:end] + "}" + s[end:], end + 2
            at = end
    return s


def argument_end(s: str, at: int) -> int | None:
    """Where the LaTeX argument starting at s[at] ends; None where there is none (the text ends,
    a '}')."""
    if at >= len(s) or s[at] == "}":
        return None
    if s[at] != "{":
        return LATEX_TOKEN.match(s, at).end()
    depth = 0
    while at < len(s):
        depth += {"{": 1, "}": -1}.get(s[at], 0)
        at += 2 if s[at] == "\\" else 1  # '\{' and '\}' are no group's braces
        if depth == 0:
            return at
    return None


def slash_to_frac(s: str) -> str:
    """'3/4' -> '\\frac{3}{4}' for integers written plainly (and anything with sqrt)."""
    parts = s.split("/")
    plain = lambda x: "sqrt" in x or re.fullmatch(r"-?(0|[1-9]\d*)", x)
    return (f"\\frac{{{parts[0]}}}{{{parts[1]}}}" if len(parts) == 2 and all(map(plain, parts))
            else s)


# ---- equality ---------------------------------------------------------------------------------

def parse_number(s: str) -> float | None:
    """'1,000' -> 1000.0, '10%' -> 0.1; None when not a plain number ('0,1' is a list: the
    reference read 1)."""
    if "," in s and not re.fullmatch(THOUSANDS, s) or "_" in s:  # Python reads '1011_2' as 10112
        return None
    s = s.replace(",", "")
    try:
        return float(s)
    except ValueError:
        pass
    if s.endswith("%"):
        try:
            return float(s[:-1].rstrip("\\")) / 100
        except ValueError:
            pass
    return None


def allowed_error(pred: str, gold: str) -> float:
    """The reference's 1e-3, but at most half a unit in the last decimal place of the less precise
    answer that writes decimals, and 0 between exact numbers. The reference's 1e-3 (and
    math.isclose's relative 1e-9) graded 0.0000673 right against 0.0000672, 3/57 against 3/56 and
    11,111,111,101 against ...100."""
    # '7.2%': 0.072, 3 places
    places = [min(map(len, re.findall(r"\.(\d+)", a))) + 2 * a.endswith("%")
              for a in (pred, gold) if re.search(r"\.\d", a)]
    return min(1e-3, 0.5 * 10.0 ** -min(places)) if places else 0.0


def close(x: float, y: float, pred: str, gold: str) -> bool:
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=allowed_error(pred, gold))


def numbers_equal(pred: str, gold: str, x: float, y: float) -> bool:
    """Close numbers (allowed_error). A percentage may be written with or without its sign:
    '10%' matches 10 and 0.1. The reference tried gold, gold/100 and gold*100 always, so '0.1'
    matched '10'."""
    candidates = [y]
    if pred.endswith("%") != gold.endswith("%"):
        candidates.append(y * 100 if gold.endswith("%") else y / 100)
    return any(close(x, c, pred, gold) for c in candidates)


@functools.lru_cache(maxsize=200_000)
def math_equal(pred: str, gold: str) -> bool:
    """The reference's math_equal on normalized answers, in its order."""
    if pred == gold:
        return True
    x, y = parse_number(pred), parse_number(gold)
    if x is not None and y is not None:
        return numbers_equal(pred, gold, x, y)
    if not pred:
        return False
    pred, gold = pred.strip(), gold.strip()
    # tuples and intervals
    if (re.fullmatch(r"[(\[].+[)\]]", pred) and re.fullmatch(r"[(\[].+[)\]]", gold)
            and pred[0] + pred[-1] == gold[0] + gold[-1]):  # the reference ignored which brackets
        pred_items, gold_items = pred[1:-1].split(","), gold[1:-1].split(",")
        if len(pred_items) == len(gold_items) and all(map(math_equal, pred_items, gold_items)):
            return True
    pred_rows, gold_rows = matrix_rows(pred), matrix_rows(gold)
    if pred_rows and gold_rows and len(pred_rows) == len(gold_rows):
        if all(len(p) == len(g) and all(map(math_equal, p, g))
               for p, g in zip(pred_rows, gold_rows)):
            return True
    if pred.count("=") == 1 and gold.count("=") == 1:  # equations: the same up to a sign
        (pred_lhs, pred_rhs), (gold_lhs, gold_rhs) = pred.split("="), gold.split("=")
        if (pred_lhs == gold_lhs and named_value(pred) is not None
                and math_equal(pred_rhs, gold_rhs)):
            return True  # '(a,b)=(3,4)': the same name, the same value
        p, g = f"{pred_lhs}-({pred_rhs})", f"{gold_lhs}-({gold_rhs})"
        return symbolic_equal(p, g) or symbolic_equal(f"-({p})", g)
    if named_value(pred) is not None and "=" not in gold:  # 'x=5' vs '5'
        return math_equal(named_value(pred), gold)
    if named_value(gold) is not None and "=" not in pred:
        return math_equal(pred, named_value(gold))
    return symbolic_equal(pred, gold)


NAME = r"([A-Za-z]{1,2}|\\[A-Za-z]+)(_\{?\w+\}?)?'*"  # x, ab, \theta, x_1, x_{12}, f'
NAMED = rf"{NAME}|\({NAME}(,{NAME})*\)"  # x, or a tuple of names: (a,b)


def named_value(answer: str) -> str | None:
    """'x=5' -> '5', '(a,b)=(3,4)' -> '(3,4)'; None for any other answer ('2x=6', 'y=2x+3=z', '5').
    The reference's was any left side of up to 2 characters, so '2x=6' matched 6."""
    lhs, equals, rhs = answer.partition("=")
    return rhs if equals and "=" not in rhs and re.fullmatch(NAMED, lhs) else None


def matrix_rows(s: str) -> list[list[str]] | None:
    m = re.fullmatch(r"\\begin\{[pb]matrix\}(.*)\\end\{[pb]matrix\}", s)
    if m is None:
        return None
    return [row.strip().split("&") for row in m.group(1).split("\\\\") if row.strip()]


def answers_match(answers: list[list[str]], golds: list[str]) -> bool:
    """The reference's eval_math on a response's answers (each a list of its parts): the last
    answers, as many as hold len(golds) distinct parts (a model may box an intermediate result
    first); each side's answers all matched by the other's. An answer is never cut: the reference
    kept the last len(golds) parts, so a '0,1' matched a gold '1' (and dropped repeats first, so
    '5', '3', '5' did not match a gold '5')."""
    # an empty gold ('\\boxed{}', twice in MATH): no match
    golds = list(dict.fromkeys(g for g in golds if g))
    preds = []
    # whole answers, the last first, until they hold as many as the gold
    for parts in reversed(answers):
        if len(set(preds)) >= len(golds):
            break
        preds = parts + preds
    return bool(golds and preds) and all_matched(list(dict.fromkeys(preds)), golds, answer_equal)


def answer_equal(pred: str, gold: str) -> bool:
    if "\\cup" in pred and "\\cup" in gold:  # unions of intervals, as sets of intervals
        return all_matched(pred.split("\\cup"), gold.split("\\cup"), math_equal)
    return math_equal(pred, gold)


def all_matched(preds: list[str], golds: list[str], equal) -> bool:
    hits = [(i, j) for i, p in enumerate(preds) for j, g in enumerate(golds) if equal(p, g)]
    return ({i for i, _ in hits} == set(range(len(preds)))
            and {j for _, j in hits} == set(range(len(golds))))


# ---- sympy, the last resort -------------------------------------------------------------------

class OutOfTime(BaseException):
    """Raised by the alarm; a BaseException, so that sympy's own `except Exception` cannot
    swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """SIGALRM after `seconds`, in the main thread of a POSIX process (elsewhere only the input
    guards hold)."""
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer")):
        yield
        return

    def alarm(signum, frame):
        raise OutOfTime

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def latex_to_sympy_text(s: str) -> str | None:
    """'\\frac{\\sqrt{3}}{2}\\pi' -> '((sqrt(3))/(2)) pi '; None for what it cannot read (the
    reference used pylatexenc here). Innermost braces first, so every \\frac meets brace-free
    arguments."""
    groups = [(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))"),
              (r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))"),
              (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
              (r"(?<!\\frac)(?<!\\sqrt)(?<![}\]])\{([^{}]*)\}", r"(\1)")]
    s = re.sub(r"(\d)(?=\\frac\{\d+\}\{\d+\})", r"\1+", s)  # a mixed number: 15\frac{39}{40}
    while "{" in s:
        before = s
        for pattern, replacement in groups:
            s = re.sub(pattern, replacement, s)
        if s == before:
            return None
    for command, name in LATEX_NAMES.items():
        s = s.replace(command, name)
    return None if "\\" in s or "}" in s else s.replace("^", "**")


def safe_to_parse(text: str) -> bool:
    """Only arithmetic on numbers, at most 2 unknown letters, known functions and small exponents
    (a number, a letter or a bracket without powers): sympy's parser runs Python; a huge power
    runs in C past any alarm."""
    text = text.replace(" ", "")
    if len(text) > MAX_SYMPY_CHARS or not re.fullmatch(r"[0-9A-Za-z+\-*/().!]*", text):
        return False
    if re.search(r"\.[A-Za-z]", text):  # no attribute access
        return False
    letters = re.sub("|".join(KNOWN_NAMES), "", text)
    if len({c for c in letters if c.isalpha()}) > 2 or re.search(r"\d{4,}!", text):
        return False
    exponents = re.findall(r"\*\*(-?[\d.]+|[A-Za-z]|\((?:[^()*]|\([^()*]*\))*\))", text)
    if len(exponents) != text.count("**"):
        return False
    return math.prod(int(n) for e in exponents for n in re.findall(r"\d+", e)) <= 1000


@functools.lru_cache(maxsize=50_000)
def to_sympy(latex: str):
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)
    transformations = standard_transformations + (implicit_multiplication_application,)
    text = latex_to_sympy_text(latex)
    if text is None or not text.strip() or not safe_to_parse(text):
        return None
    try:
        with time_limit(SYMPY_SECONDS):
            return parse_expr(text, transformations=transformations)
    except (Exception, OutOfTime):
        return None


@functools.lru_cache(maxsize=200_000)
def symbolic_equal(pred: str, gold: str) -> bool:
    """simplify(pred - gold) == 0, or both evaluate to close numbers; False on any error
    or timeout."""
    import sympy
    a, b = to_sympy(pred), to_sympy(gold)
    if a is None or b is None:
        return False
    try:
        with time_limit(SYMPY_SECONDS):
            difference = sympy.simplify(a - b)
            if difference == 0:
                return True
            # exactly not 0: 2^{100}-3 is not 2^{100}-2, close as the floats are
            if difference.is_Rational:
                return False
            return close(float(sympy.N(a)), float(sympy.N(b)), pred, gold)
    except (Exception, OutOfTime):
        return False


# ---- MATH's steps (reference: tasks/math_extract_steps_inplace.py split_solution_inplace) --------
# LaTeX spans, hidden in this order behind placeholders of 60 characters (the reference's length,
# on which its length rules depend); math ending a sentence ends a step; parts that are only a
# math opener join the next.
MATH_SPANS = [r"\[asy\].*?\[/asy\]", r"\$\\begin\{tabular\}.*?\\end\{tabular\}\$",
              r"\\begin\{tabular\}.*?\\end\{tabular\}", r"\\\(.*?\\\)", r"\\\[.*?\\\]",
              r"\$\$.*?\$\$", r"(?<!\\)\$.*?[^\\]\$(?!\$)", r"\\begin\{([^}]*)\}.*?\\end\{\1\}"]
PLACEHOLDER = re.compile(r"<\|\d{56}\|>")
MATH_ENDS = (".$", ".$$", ".\\)", ".\\]")
OPENER = re.compile(r"\$|\$\$|\\\(|\\\[|\\begin\{[^}]*\}|\[asy\]")
SENTENCE_END = (r"(?<!\b[A-Za-z]\.)(?<!\s[A-Za-z]\.)(?<!\s[A-Za-z][A-Za-z]\.)"  # not 'e.g.'
                r"(?<=\.)(?=\s+[A-Z])")
# (pattern, cut after n characters)
PROSE_CUTS = [(",", 1), (r"\sand\s", 4), (":", 1), (r"\sto\s", 3)]
MATH_CUTS = [(r",\$", 2), (r",\\\)", 3), (r",\\\]", 3), ("=", 1), (r"\\equiv", 6), (r"\+", 1),
             (r"\\cancelto", 9)]


def hide_math(text: str) -> tuple[str, dict]:
    """(text with each LaTeX span replaced by a placeholder, {placeholder: span}); equal spans
    share one."""
    found = {}
    hide = lambda m: found.setdefault(m.group(0), f"<|{len(found):056d}|>")
    for pattern in MATH_SPANS:
        text = re.sub(pattern, hide, text, flags=re.S)
    return text, {placeholder: span for span, placeholder in found.items()}


def show_math(text: str, spans: dict) -> str:
    while PLACEHOLDER.search(text):  # a span may hold an earlier one
        text = PLACEHOLDER.sub(lambda m: spans[m.group(0)], text)
    return text


def merge_short(bounds: list[int], short) -> list[int]:
    """Remove the boundary after each part short(start, end) (before it, for the last part):
    it joins one."""
    i = 0
    while i < len(bounds) - 1:
        if short(bounds[i], bounds[i + 1]):
            bounds.pop(i if i == len(bounds) - 2 else i + 1)
        else:
            i += 1
    return bounds


def math_step_offsets(text: str) -> list[int]:
    """[0, start of step 2, ..., len(text)]: the reference's steps of a MATH solution, in
    five passes."""
    hidden, spans = hide_math(text)
    # 1-2. sentence ends and newlines (a newline opens its part); a lone newline or a short part
    #      without a full stop joins the next (the last part stays)
    pieces = [piece if i == 0 else "\n" + piece for sentence in re.split(SENTENCE_END, hidden)
              for i, piece in enumerate(sentence.split("\n"))]
    short = lambda a, b: b < len(hidden) and (hidden[a:b] == "\n" or
                                              b - a < 20 and not hidden[a:b].endswith("."))
    bounds = merge_short(list(accumulate(map(len, pieces), initial=0)), short)
    # 3. a cut after math that ends a sentence; then parts under 20 characters, math shown, join a
    #    neighbour
    after_math = lambda a, b: [a + m.end() for m in PLACEHOLDER.finditer(hidden[a:b])
                               if spans[m.group(0)].endswith(MATH_ENDS)]
    bounds = [0] + [cut for a, b in zip(bounds, bounds[1:]) for cut in after_math(a, b) + [b]]
    shown = lambda a, b: show_math(hidden[a:b], spans)
    bounds = merge_short(bounds, lambda a, b: (len(shown(a, b)) < 20
                                               and not shown(a, b).endswith(MATH_ENDS)))
    # 4. math shown again (offsets into `text` from here), a cut at each newline inside a span;
    #    parts that are only an opener or under 3 characters join a neighbour
    shown_bounds = [0]
    for a, b in zip(bounds, bounds[1:]):
        start, part = shown_bounds[-1], hidden[a:b]
        while m := PLACEHOLDER.search(part):
            span = show_math(spans[m.group(0)], spans)
            shown_bounds += [start + m.start() + n.start() for n in re.finditer("\n", span)]
            part = part.replace(m.group(0), span)
        shown_bounds.append(start + len(part))
    bounds = merge_short(shown_bounds,
                         lambda a, b: b - a < 3 or OPENER.fullmatch(text[a:b].strip()))
    # 5. a part over 100 characters is cut near its middle, again and again
    bounds = [0] + [a + cut for a, b in zip(bounds, bounds[1:])
                    for cut in (break_long(text[a:b])[1:] if b - a > 100 else [b - a])]
    return bounds if len(bounds) > 1 and bounds[-1] == len(text) else [0, len(text)]


def break_long(part: str) -> list[int]:
    """Cuts of a long part: each piece over 100 characters is cut at the prose candidate nearest its
    middle (math hidden, both sides >= 40), else at the math one (both sides >= 20). A piece that
    starts in the range [first math cut, longest piece math-cut] skips prose (the reference's range,
    in piece-relative offsets)."""
    cuts, math_from, math_to, i = [0, len(part)], None, 0, 0
    while i < len(cuts) - 1:
        a, b = cuts[i], cuts[i + 1]
        cut = None
        if b - a > 100:
            if math_from is None or not math_from <= a < math_to:
                cut = prose_cut(part[a:b])
            if cut is None:
                cut = middle_cut(part[a:b], MATH_CUTS, 20)
                if cut is not None:
                    math_from, math_to = (min(cut, cut if math_from is None else math_from),
                                          max(math_to, b - a))
        if cut is None:
            i += 1
        else:
            cuts.insert(i + 1, a + cut)
    return cuts


def prose_cut(piece: str) -> int | None:
    hidden, spans = hide_math(piece)
    shown_len = lambda s: len(show_math(s, spans))
    cut = middle_cut(hidden, PROSE_CUTS, 40, shown_len)
    return None if cut is None else shown_len(hidden[:cut])


def middle_cut(text: str, patterns, shortest: int, length=len) -> int | None:
    """The candidate of the first pattern that has one nearest the middle, if both sides are
    long enough."""
    for pattern, n in patterns:
        cuts = [m.start() + n for m in re.finditer(pattern, text)]
        if cuts:
            cut = min(cuts, key=lambda c: abs(2 * c - len(text)))
            if min(length(text[:cut]), length(text[cut:])) >= shortest:
                return cut
    return None
