"""CPU: the tree is formatted as ``pyproject.toml``'s ``[tool.ruff]`` says (``ruff format``)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tree_is_formatted():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout + done.stderr
