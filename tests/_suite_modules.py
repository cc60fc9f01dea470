"""The tool's tests of a suite file's internals reuse that file's helpers: the suite module is loaded by
path under a private name (so pytest does not collect its conformance tests a second time here)."""

import importlib.util
import sys
from pathlib import Path

SUITES = Path(__file__).resolve().parent.parent / "suites"


def suite_namespace(name: str) -> dict:
    """The helpers, fixtures and constants of suites/<name>.py (its test functions left out)."""
    key = f"_mla_suite_{name}"
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, SUITES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return {k: v for k, v in vars(module).items() if not k.startswith(("test_", "__"))}
