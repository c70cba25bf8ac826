"""The README's code runs: every ```python block of README.md, top to bottom, in one namespace."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.gpu
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_examples():
    assert len(python_blocks(README.read_text())) >= 1


def test_readme_examples_run():
    namespace = {"__name__": "readme"}
    for i, block in enumerate(python_blocks(README.read_text())):
        code = compile(block, f"README.md python block {i}", "exec")
        exec(code, namespace)  # a failing block raises, naming itself in the traceback
