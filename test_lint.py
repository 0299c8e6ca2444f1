"""Tests: every .py file of the repository within 100 columns and without unused names (ruff)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ruff_finds_nothing():
    """ruff with the project's pyproject.toml: line length 100, pyflakes."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", HERE], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
