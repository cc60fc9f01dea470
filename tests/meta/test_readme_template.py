"""The README's backend is the frozen base-contract backend, character for character, so the verdict the kill
matrix holds tests/meta/frozen_base_backend.py to (CONFORMS with explicit skips) is the README template's."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.meta
ROOT = Path(__file__).resolve().parent.parent.parent


def _code(text: str) -> str:
    """A module's code without its docstring."""
    return re.sub(r'\A"""(?:.|\n)*?"""\n+', "", text)


def test_readme_backend_is_the_frozen_backend():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Check your own backend"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "README's 'Check your own backend' has no python block"
    frozen = (ROOT / "tests/meta/frozen_base_backend.py").read_text(encoding="utf-8")
    assert block.group(1) == _code(frozen), (
        "README's backend differs from tests/meta/frozen_base_backend.py: the README shows the frozen file's code "
        "(which never changes); fix the README, not the frozen file")
