"""``mla-conformance test``: plain pytest over the installed conformance suites, from any directory.

The same tests as ``mla-conformance run``, with pytest's own terminal output and exit code and no report:
``mla-conformance test --backend my_backend.py:MyMLA -- -k numerics -x``.

Test ids are the checkout's, both ways: pytest runs in the directory that holds ``suites/`` (the checkout, or
the installed package), so it prints ``suites/test_numerics.py::test_x[...]`` as the report does, and such an id
(or ``test_numerics.py::...``) given after ``--`` selects that test. What the user names from their own
directory still means the same: file specs, the checkpoint and existing paths after ``--`` are made absolute,
and the current directory is put on the path, so ``--backend mypkg.mla:MyBackend`` resolves from it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mla_conformance.runner.suites import find_suites
from mla_conformance.resources import pytest_run_args
from mla_conformance.specs import OP_PREFIX, spec_name

#: pytest options whose value is a path (made absolute, whether or not it exists yet).
PATH_OPTIONS = frozenset({"--junitxml", "--junit-xml", "--mla-expect", "--mla-results", "--mla-checkpoint",
                          "--basetemp", "--confcutdir", "--log-file", "--report-log", "--html", "--json-report-file",
                          "--benchmark-json"})
#: pytest options whose value is a backend or op spec (a file spec made absolute).
SPEC_OPTIONS = frozenset({"--mla-backend", "--mla-op"})
#: pytest options whose value is a test id (given in the checkout's form).
ID_OPTIONS = frozenset({"--deselect"})
#: pytest options whose value is passed as typed (an expression, a name, a number).
VALUE_OPTIONS = frozenset({"-k", "-m", "-p", "-o", "--override-ini", "-W", "-r", "--tb", "-n", "--maxfail",
                           "--durations", "--dist", "--mla-device", "--mla-timeout", "--mla-threads"})
_SUITE_ID = re.compile(r"^(?:\./)?(?:suites/)?(test_\w+\.py)(::.*)?$")


def absolute_spec(spec: str, here: Path) -> str:
    """A ``path/to/file.py:attr`` spec (also behind ``op:``) with the path made absolute from ``here``; a built-in
    name or ``package.module:attr`` unchanged (the module resolves from ``here`` through PYTHONPATH)."""
    prefix = OP_PREFIX if spec.startswith(OP_PREFIX) else ""
    target, sep, attr = spec[len(prefix):].rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or target.startswith(".")):
        return f"{prefix}{(here / target).resolve()}:{attr}"
    return spec


def suite_id(arg: str, suites: Path, here: Path) -> str | None:
    """``arg`` as a test id relative to the suites' parent (``suites/test_x.py::test_y[...]``), or None when it
    names no test of the suites: a checkout-style id, a bare ``test_x.py[::...]``, or a path into the suites."""
    path, sep, rest = arg.partition("::")
    m = _SUITE_ID.match(path)
    if m and (suites / m.group(1)).is_file():
        return f"{suites.name}/{m.group(1)}{sep}{rest}"
    try:
        inside = (here / path).resolve().relative_to(suites.resolve())
    except (ValueError, OSError):
        return None
    if not (suites / inside).exists():
        return None
    return (suites.name if inside == Path(".") else f"{suites.name}/{inside.as_posix()}") + sep + rest


def _absolute(arg: str, here: Path) -> str:
    path, sep, rest = arg.partition("::")
    return str((here / path).resolve()) + sep + rest


def pytest_args_from(args: list[str], suites: Path, here: Path) -> tuple[list[str], list[str]]:
    """(the test ids among ``args``, the other arguments with the paths they name made absolute from ``here``).

    An option's value is read by the option: a path (:data:`PATH_OPTIONS`), a spec, a test id, or as typed
    (:data:`VALUE_OPTIONS`); any other argument naming an existing path (with a ``/`` or a suffix) is absolute."""
    ids: list[str] = []
    rest: list[str] = []
    pending: str | None = None  # the option whose value comes next
    for arg in args:
        if pending is not None:
            if pending in SPEC_OPTIONS:
                arg = absolute_spec(arg, here)
            elif pending in PATH_OPTIONS:
                arg = _absolute(arg, here)
            elif pending in ID_OPTIONS:
                arg = suite_id(arg, suites, here) or arg
            rest.append(arg)
            pending = None
            continue
        opt, eq, value = arg.partition("=")
        if arg.startswith("-"):
            if opt in PATH_OPTIONS | SPEC_OPTIONS | ID_OPTIONS | VALUE_OPTIONS and not eq:
                pending = opt
            elif opt in SPEC_OPTIONS:
                arg = f"{opt}={absolute_spec(value, here)}"
            elif opt in PATH_OPTIONS:
                arg = f"{opt}={_absolute(value, here)}"
            elif opt in ID_OPTIONS:
                arg = f"{opt}={suite_id(value, suites, here) or value}"
            rest.append(arg)
            continue
        found = suite_id(arg, suites, here)
        if found is not None:
            ids.append(found)
            continue
        path = arg.partition("::")[0]
        rest.append(_absolute(arg, here) if ("/" in path or Path(path).suffix) and (here / path).exists() else arg)
    return ids, rest


def pytest_command(args: Any, suites: Path, tmpdir: str | Path, here: Path) -> tuple[list[str], Path, dict[str, str]]:
    """(the pytest command, the directory it runs in: the suites' parent, its environment) for ``args``."""
    ids, extra = pytest_args_from(list(args.pytest_args or []), suites, here)
    cmd = [sys.executable, "-m", "pytest", *(ids or [suites.name]), *pytest_run_args(suites, tmpdir), "-rfE"]
    for spec in args.backend or []:
        cmd += ["--mla-backend", absolute_spec(spec, here)]
    if args.checkpoint:
        cmd += ["--mla-checkpoint", str((here / args.checkpoint).resolve())]
    if args.device:
        cmd += ["--mla-device", args.device]
    cmd += extra
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), env.get("PYTHONPATH")]))
    return cmd, suites.parent, env


def run_tests(args) -> int:
    for spec in args.backend or []:
        spec_name(spec, "backend")  # fail fast, naming the spec as typed
    suites = find_suites()
    with tempfile.TemporaryDirectory(prefix="mla-conformance-test-") as tmpdir:
        cmd, cwd, env = pytest_command(args, suites, tmpdir, Path.cwd())
        print(f"mla-conformance test: pytest {' '.join(cmd[3:])}  (in {cwd})", flush=True)
        return subprocess.run(cmd, cwd=cwd, env=env).returncode


def add_cli(sub) -> None:
    p = sub.add_parser("test", help="run the installed conformance suites with pytest (no report)",
                       description="Run the installed conformance suites (mla_conformance.suites) with pytest from "
                                   "any directory: pytest's output and exit code, no report. Arguments after `--` "
                                   "go to pytest, e.g. `-- -k numerics -x`; test ids as the report prints them "
                                   "(`suites/test_numerics.py::test_x[...]`) select those tests, and paths are "
                                   "taken from the current directory. Same as `pytest --pyargs "
                                   "mla_conformance.suites --mla-backend SPEC`, with node ids as in a checkout.")
    p.add_argument("--backend", action="append", metavar="SPEC", help="backend spec (repeatable; default: built-ins)")
    p.add_argument("--checkpoint", metavar="DIR", help="a real DeepSeek checkpoint for the checkpoint tests")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS")
    p.set_defaults(func=run_tests)
