"""Tests: every .py file of the repository within 100 columns and without unused names (ruff);
the core's files and functions, and the README, within their budgets."""
import ast
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ruff_finds_nothing():
    """ruff with the project's pyproject.toml: line length 100, pyflakes."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", HERE], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_core_files_and_functions_within_their_budgets():
    """The core (every .py file but the tests, bench, compare, diagnose and math_grader): no file
    over 330 lines, no function over 60, the proxies for a reader's time."""
    tools = {"bench.py", "compare.py", "diagnose.py", "math_grader.py"}
    core = [path for path in glob.glob(os.path.join(HERE, "*.py"))
            + glob.glob(os.path.join(HERE, "engineering", "*.py"))
            if not os.path.basename(path).startswith("test_")
            and os.path.basename(path) not in tools]
    assert len(core) > 15
    over = []
    for path in core:
        source = open(path).read()
        name = os.path.relpath(path, HERE)
        if len(source.splitlines()) > 330:
            over.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    over.append(f"{name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not over, over


def test_readme_within_its_budget():
    """The README, the first page a student reads: at most 15,000 characters."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    assert len(text) <= 15_000, f"README.md: {len(text)} characters"
