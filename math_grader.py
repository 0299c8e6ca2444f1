"""MATH answers compared up to mathematical equivalence: the reference's Minerva-style grader
(tasks/math_grader_minerva.py, tasks/math_answer_exctraction.py `strip_string`), rewritten, with the
differences listed in the README. Not needed to read the algorithm: reward.math_reward calls `answers_match`.

    normalize(answer)           string clean-up: \\dfrac -> \\frac, units, degrees, \\left, spaces, ...
    math_equal(pred, gold)      strings, then close numbers, tuples and intervals, matrices, 'x=5',
                                then sympy (time-limited; any parser error is 'not equal')
    answers_match(preds, golds) every prediction matches a gold answer and every gold one a prediction
"""
import contextlib
import functools
import math
import re
import signal
import threading

SYMPY_SECONDS = 2.0  # the reference allows 15 s per simplification; a grade sits inside every MC continuation
MAX_SYMPY_CHARS = 300  # longer is not an answer: not parsed
KNOWN_NAMES = ("sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "log", "exp")
LATEX_NAMES = {"\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/", "\\ln": " log ",
               "\\log": " log ", "\\exp": " exp ", **{f"\\{f}": f" {f} " for f in KNOWN_NAMES[3:9]}}


# ---- normalisation (the reference's strip_string) ------------------------------------------------

def normalize(answer: str) -> str:
    s = str(answer).strip().replace("\n", "").rstrip(".").replace("\\!", "")
    if re.match(r"\\(text|mbox)\{", s) and s.endswith("}"):  # the reference deleted a whole \mbox{Saturday}
        s = s[s.index("{") + 1:-1]
    s = re.sub(r"\\[tdc]frac", r"\\frac", s).replace("\\left", "").replace("\\right", "")
    without_unit = re.sub(r"\\text{.*?}$", "", s).strip()  # '5\text{ cm}' -> '5'
    s = without_unit if without_unit else s
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").strip()
    s = re.sub(r"\{(c|m)?m\}(\^(2|3))?", "", s).strip()
    s = re.sub(r"p\.m\.$", "", s).strip()
    s = re.sub(r"(\d)\s*t$", r"\1", s).strip()
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
    for command in ("sqrt", "tan"):  # '\sqrt2' -> '\sqrt{2}'
        s = re.sub(rf"\\{command}(-?[0-9.a-zA-Z]+)", rf"\\{command}{{\1}}", s)
        s = re.sub(rf"\\{command}\s+(\w+)$", rf"\\{command}{{\1}}", s)
    s = slash_to_frac(braced_fracs(s.replace(" ", "")))
    return re.sub(r"(\\|,|\.)+$", "", s)


def braced_fracs(s: str) -> str:
    """'\\frac12' -> '\\frac{1}{2}', '\\frac1{72}' -> '\\frac{1}{72}'; unchanged when a \\frac is cut short."""
    head, *parts = s.split("\\frac")
    for part in parts:
        if not part.startswith("{"):
            if len(part) < 2:
                return s
            part = "{" + part[0] + "}" + (part[1:] if part[1] == "{" else "{" + part[1] + "}" + part[2:])
        head += "\\frac" + part
    return head


def slash_to_frac(s: str) -> str:
    """'3/4' -> '\\frac{3}{4}' for integers written plainly (and anything with sqrt)."""
    parts = s.split("/")
    plain = lambda x: "sqrt" in x or re.fullmatch(r"-?(0|[1-9]\d*)", x)
    return f"\\frac{{{parts[0]}}}{{{parts[1]}}}" if len(parts) == 2 and all(map(plain, parts)) else s


# ---- equality ---------------------------------------------------------------------------------

def parse_number(s: str) -> float | None:
    """'1,000' -> 1000.0, '10%' -> 0.1; None when not a plain number."""
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
    """The reference's 1e-3, but at most half a unit in the last decimal place of the less precise answer
    that writes decimals, and 0 between exact numbers. The reference's 1e-3 (and math.isclose's relative
    1e-9) graded 0.0000673 right against 0.0000672, 3/57 against 3/56 and 11,111,111,101 against ...100."""
    places = [min(map(len, re.findall(r"\.(\d+)", a))) for a in (pred, gold) if re.search(r"\.\d", a)]
    return min(1e-3, 0.5 * 10.0 ** -min(places)) if places else 0.0


def close(x: float, y: float, pred: str, gold: str) -> bool:
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=allowed_error(pred, gold))


def numbers_equal(pred: str, gold: str, x: float, y: float) -> bool:
    """Close numbers (allowed_error). A percentage may be written with or without its sign: '10%' matches
    10 and 0.1. The reference tried gold, gold/100 and gold*100 always, so '0.1' matched '10'."""
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
    if (re.fullmatch(r"[(\[].+[)\]]", pred) and re.fullmatch(r"[(\[].+[)\]]", gold)  # tuples and intervals
            and pred[0] + pred[-1] == gold[0] + gold[-1]):  # the reference ignored which brackets
        pred_items, gold_items = pred[1:-1].split(","), gold[1:-1].split(",")
        if len(pred_items) == len(gold_items) and all(map(math_equal, pred_items, gold_items)):
            return True
    pred_rows, gold_rows = matrix_rows(pred), matrix_rows(gold)
    if pred_rows and gold_rows and len(pred_rows) == len(gold_rows):
        if all(len(p) == len(g) and all(map(math_equal, p, g)) for p, g in zip(pred_rows, gold_rows)):
            return True
    if pred.count("=") == 1 and gold.count("=") == 1:  # equations: the same up to a sign
        p, g = (f"{side[0]}-({side[1]})" for side in (pred.split("="), gold.split("=")))
        return symbolic_equal(p, g) or symbolic_equal(f"-({p})", g)
    if pred.count("=") == 1 and "=" not in gold and len(pred.split("=")[0].strip()) <= 2:  # 'x=5' vs '5'
        return math_equal(pred.split("=")[1], gold)
    if gold.count("=") == 1 and "=" not in pred and len(gold.split("=")[0].strip()) <= 2:
        return math_equal(pred, gold.split("=")[1])
    return symbolic_equal(pred, gold)


def matrix_rows(s: str) -> list[list[str]] | None:
    m = re.fullmatch(r"\\begin\{[pb]matrix\}(.*)\\end\{[pb]matrix\}", s)
    if m is None:
        return None
    return [row.strip().split("&") for row in m.group(1).split("\\\\") if row.strip()]


def answers_match(preds: list[str], golds: list[str]) -> bool:
    """The reference's eval_math: repeats dropped, the last len(golds) predictions kept (a model may box
    an intermediate result first); each side's answers all matched by the other's."""
    golds = list(dict.fromkeys(g for g in golds if g))  # an empty gold ('\\boxed{}', twice in MATH): no match
    preds = list(dict.fromkeys(preds))[-len(golds):] if golds else []
    return bool(golds and preds) and all_matched(preds, golds, answer_equal)


def answer_equal(pred: str, gold: str) -> bool:
    if "\\cup" in pred and "\\cup" in gold:  # unions of intervals, as sets of intervals
        return all_matched(pred.split("\\cup"), gold.split("\\cup"), math_equal)
    return math_equal(pred, gold)


def all_matched(preds: list[str], golds: list[str], equal) -> bool:
    hits = [(i, j) for i, p in enumerate(preds) for j, g in enumerate(golds) if equal(p, g)]
    return {i for i, _ in hits} == set(range(len(preds))) and {j for _, j in hits} == set(range(len(golds)))


# ---- sympy, the last resort -------------------------------------------------------------------

class OutOfTime(BaseException):
    """Raised by the alarm; a BaseException, so that sympy's own `except Exception` cannot swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """SIGALRM after `seconds`, in the main thread of a POSIX process (elsewhere only the input guards hold)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
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
    """'\\frac{\\sqrt{3}}{2}\\pi' -> '((sqrt(3))/(2)) pi '; None for what it cannot read (the reference
    used pylatexenc here). Innermost braces first, so every \\frac meets brace-free arguments."""
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
    """Only arithmetic on numbers, at most 2 unknown letters, known functions and small exponents (a number,
    a letter or a bracket without powers): sympy's parser runs Python; a huge power runs in C past any alarm."""
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
    """simplify(pred - gold) == 0, or both evaluate to close numbers; False on any error or timeout."""
    import sympy
    a, b = to_sympy(pred), to_sympy(gold)
    if a is None or b is None:
        return False
    try:
        with time_limit(SYMPY_SECONDS):
            if sympy.simplify(a - b) == 0:
                return True
            return close(float(sympy.N(a)), float(sympy.N(b)), pred, gold)
    except (Exception, OutOfTime):
        return False
