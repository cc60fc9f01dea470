"""The background jobs' rule (tests/meta/background.py): a process started off the main thread gets the session's
starting environment explicitly (``env=``). CPython spawns through vfork(), so an inherited environment is read
from this process's memory while the main thread's tests may be changing it (CI: "OSError: [Errno 14] Bad
address"). Checked from the source of every module a job of tests/meta/jobs.py is defined in, and of the harness."""

import ast
import inspect
from pathlib import Path

import pytest

from .jobs import JOBS

HERE = Path(__file__).resolve().parent
SPAWNS = {"run", "Popen", "check_output", "check_call", "call"}

pytestmark = pytest.mark.meta


def _job_modules() -> list[Path]:
    return sorted({Path(inspect.getsourcefile(fn)).resolve() for fn in JOBS.values()} | {HERE / "harness.py"})


def test_the_jobs_module_is_checked():
    assert HERE / "jobs.py" in _job_modules(), [p.name for p in _job_modules()]


@pytest.mark.parametrize("path", _job_modules(), ids=lambda p: p.name)
def test_every_spawn_passes_an_environment(path):
    bare = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SPAWNS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess":
            if "env" not in {k.arg for k in node.keywords}:
                bare.append(f"{path.name}:{node.lineno}")
    assert not bare, f"subprocess calls without env= (use background.env()): {bare}"
