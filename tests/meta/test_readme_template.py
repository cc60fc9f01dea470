"""README.md is a front page whose code runs: its minimal backend and its minimal op, pasted into files, CONFORM
(the default suite runs on both, as a user runs it, and nothing fails or errors); the verdict and the failure it
shows are what the commands print; it has at most 200 lines; every relative link of README.md, markers.md and
docs/*.md resolves.

The blocks run as a user runs them (:func:`readme_runs`): the README's backend and op over the
whole default suite, its failing variant (the `scale *=` line removed) on FAILURE_TEST. There they report the names
README_NAMES; a failure line is compared with the README's under the README's name. tests/meta/frozen_base_backend.py and frozen_base_op.py, the base contract
frozen forever, are held to their verdicts by the kill matrix and the op meta tests; the README's blocks may be
shorter than they are.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from . import harness

pytestmark = pytest.mark.meta

README = harness.ROOT / "README.md"
BACKEND_SECTION, OP_SECTION = "## Check your own backend", "## Check your own kernel"
#: The failure the README shows: its backend without YaRN's mscale^2 (the `scale *=` line of `yarn`), this test.
FAILURE_TEST = "suites/test_numerics.py::test_against_float64[my-mla-float32-prefill-deepseek-v2-lite]"
MSCALE_LINE = re.compile(r"^ +scale \*= .*\n", re.M)
#: the name the README's backend reports, and the names its blocks report in the layer matrix's session (one
#: session's backends need unique names, and the frozen backend is "my-mla" too): its backend, its failing
#: variant, its op (its own name)
README_BACKEND = "my-mla"
README_NAMES = {"backend": "readme-my-mla", "mutant": "readme-my-mla-no-mscale", "op": "my-op"}
#: FAILURE_TEST on the failing variant, as the layer matrix's session names it
MUTANT_TEST = FAILURE_TEST.replace(f"[{README_BACKEND}-", f"[{README_NAMES['mutant']}-")


def readme_block(section: str) -> str:
    """The python block under ``section`` of README.md."""
    text = README.read_text(encoding="utf-8")
    assert section in text, f"README.md has no section {section!r}"
    block = re.search(r"```python\n(.*?)```", text[text.index(section):], re.S)
    assert block, f"README.md's {section!r} has no python block"
    return block.group(1)


def _renamed(block: str, name: str) -> str:
    out, n = re.subn(rf'^( +name = )"{re.escape(README_BACKEND)}"$', rf'\1"{name}"', block, flags=re.M)
    assert n == 1, f"README's backend has {n} `name = \"{README_BACKEND}\"` lines (expected one)"
    return out


def readme_specs(tmp) -> tuple[list[str], list[str]]:
    """The README's backend, its failing variant (the one `scale *=` line removed) and its op written to files
    in ``tmp``; returns (backend specs, op specs)."""
    backend = readme_block(BACKEND_SECTION)
    mutant, n = MSCALE_LINE.subn("", backend)
    assert n == 1, f"README's backend has {n} `scale *=` lines; the failure it shows removes exactly one"
    files = {"readme_backend.py": _renamed(backend, README_NAMES["backend"]),
             "readme_backend_no_mscale.py": _renamed(mutant, README_NAMES["mutant"]),
             "readme_op.py": readme_block(OP_SECTION)}
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    return [f"{tmp / 'readme_backend.py'}:MyBackend", f"{tmp / 'readme_backend_no_mscale.py'}:MyBackend"], \
        [f"{tmp / 'readme_op.py'}:MyOp"]



def readme_runs(pytester) -> harness.SuiteRun:
    """The README's backend and op over the whole default suite, and its failing variant on FAILURE_TEST: one
    SuiteRun of both."""
    readme_backends, readme_ops = readme_specs(pytester.path)
    whole = harness.run_inprocess(pytester, ["suites"], backends=readme_backends[:1], ops=readme_ops)
    return whole.joined(harness.run_inprocess(pytester, [MUTANT_TEST], backends=readme_backends[1:], expect=1))

ROOT = harness.ROOT
MAX_LINES = 200

@pytest.fixture
def readme_run(suite_run) -> dict:
    """The README blocks' tests; its failing variant's failure line, said with the README backend's name (the only
    word the run's unique name changes)."""
    run = suite_run("readme", readme_runs)
    names = {README_NAMES["backend"], README_NAMES["op"]}
    failure = run.printed_failure(MUTANT_TEST)
    prefix = f"E   AssertionError: {README_NAMES['mutant']} "
    if failure.startswith(prefix):
        failure = f"E   AssertionError: {README_BACKEND} " + failure[len(prefix):]
    return {"tests": [t for t in run.tests if names & {t.get("params", {}).get(k) for k in ("backend", "op")}],
            "exit": run.code, "log": run.tail(), "failure": failure}


def _outcomes(run: dict, kind: str, name: str) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for t in run["tests"]:
        if t.get("params", {}).get(kind) == name:
            by.setdefault(t["outcome"], []).append(t)
    return by


@pytest.mark.parametrize("kind, name", [("backend", README_NAMES["backend"]), ("op", README_NAMES["op"])])
def test_readme_block_conforms(readme_run, kind, name):
    """CONFORMS: no test of it failed or errored, some passed, every skip says why."""
    got = _outcomes(readme_run, kind, name)
    bad = [f"{t['nodeid']}: {t['outcome']}: {t.get('reason', '')[:300]}" for o in ("failed", "error")
           for t in got.get(o, [])]
    assert not bad, f"README's {kind} {name!r} does not conform ({len(bad)} failed or errored):\n" + "\n".join(bad)
    assert got.get("passed"), f"README's {kind} {name!r} passed no test (exit {readme_run['exit']}):\n{readme_run['log']}"
    assert all(t.get("reason") for t in got.get("skipped", [])), "a skip of the README's block gives no reason"


def test_readme_verdict_is_the_runs(readme_run):
    """The verdict README.md shows for its backend is the one the run gives it (its words: the counts in the line
    are an example of the day, not checked)."""
    got = _outcomes(readme_run, "backend", README_NAMES["backend"])
    verdict = "CONFORMS" if not got.get("failed") and not got.get("error") else "DOES NOT CONFORM"
    shown = re.findall(rf"^  {README_BACKEND}: ([A-Z ]+) \(\d+ passed, (\d+) failed, (\d+) errors, \d+ skipped\)$",
                       README.read_text(encoding="utf-8"), re.M)
    assert shown == [("CONFORMS", "0", "0")] and verdict == "CONFORMS", (
        f"README.md's verdict excerpt ({shown}) is not what `mla-conformance run --backend my_backend.py:MyBackend` "
        f"gives its backend now ({verdict})")


def _words(text: str) -> list[str]:
    """The line less its figures (a figure's digits differ from host to host in float32 rounding)."""
    return re.split(r"[-+]?\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)


def test_readme_failure_is_what_the_command_prints(readme_run):
    """The failure README.md shows is the one its backend without the `scale *=` line gets: the same words (its
    figures are the day's example)."""
    text = README.read_text(encoding="utf-8")
    shown = [line for line in text.splitlines() if line.startswith("E   AssertionError: ")]
    assert len(shown) == 1, "README.md shows one failure line ('E   AssertionError: ...')"
    assert _words(shown[0]) == _words(readme_run["failure"]), (
        f"README.md's failure excerpt differs from what {FAILURE_TEST} prints for its backend without the "
        f"`scale *=` line; replace it with:\n{readme_run['failure']}")


def test_readme_op_takes_head_dim_v_as_the_contract_passes_it():
    """The README's op has the op contract's decode signature (the frozen base op's) plus head_dim_v=512 (d_v)."""
    from mla_conformance.contract.op import D_V

    ns: dict = {}
    exec(compile(readme_block(OP_SECTION), "README.md:op", "exec"), ns)  # noqa: S102 (the README's own block)
    sig = inspect.signature(ns["MyOp"].decode)
    assert sig.parameters["head_dim_v"].default == D_V and sig.parameters["head_dim_v"].kind.name == "KEYWORD_ONLY"
    frozen = ast.parse((ROOT / "tests/meta/frozen_base_op.py").read_text(encoding="utf-8"))
    (decode,) = [n for n in ast.walk(frozen) if isinstance(n, ast.FunctionDef) and n.name == "decode"]
    base = [a.arg for a in decode.args.args + decode.args.kwonlyargs]
    assert [p for p in sig.parameters if p != "head_dim_v"] == base


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move reference to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


DOCS = [README, ROOT / "markers.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.is_file():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
