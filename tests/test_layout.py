"""The package's layout rules (issue 20), checked from its source: no import cycle, packages import downward only
(issue 29: the order of tests/layers.py), no file over 700 lines, argparse only in cli/, no globals-update
namespace injection in the tests."""
from __future__ import annotations

import ast
import functools
import subprocess
from pathlib import Path

import pytest

from tests.layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mla_conformance"
MAX_LINES = 700
#: names appearing from nowhere: a suite module's namespace copied into a test module (spelled in two parts so
#: that a grep of tests/ for the call finds no use at all)
INJECT = "globals()" + ".update"


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """A package file's syntax tree, parsed once for every rule here."""
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _imports(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a package file, and whether it is inside a function (one walk of the tree)."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            elif not isinstance(child, (ast.expr, ast.Constant)):  # statements hold the imports; expressions none
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(_tree(path), False)
    return found


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / PKG.name).rglob("*.py"))}


def import_edges(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(module, package module it imports, "file:line") for every import statement of the package under ``root``,
    at module level or inside a function (an implicit parent package import is not an edge: ``import a.b.c`` runs
    ``a.b``'s ``__init__`` but depends on ``a.b.c``)."""
    mods = _modules(root)
    edges = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        where = path.relative_to(root).as_posix()
        for node, _ in _imports(path):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in dict.fromkeys(targets):
                if t in mods and t != name:
                    edges.append((name, t, f"{where}:{node.lineno}"))
    return edges


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (:func:`import_edges`)."""
    graph: dict[str, set[str]] = {m: set() for m in _modules(root)}
    for name, target, _ in import_edges(root):
        graph[name].add(target)
    return graph


def package_of(module: str) -> str:
    """The first-level subpackage or top-level module a module belongs to; ``ROOT`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ROOT"


def check_downward(edges: list[tuple[str, str, str]], modules, layers=LAYERS) -> None:
    """AssertionError naming every package outside ``layers`` and every import of a package that is not below the
    importer's (its own layer's peers included), as ``pkg_a -> pkg_b (file:line)``."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    unplaced = sorted({package_of(m) for m in [*modules, *(t for _, t, _ in edges)]} - set(rank))
    if unplaced:  # raised, not asserted: the message stays the lines below (no assertion rewriting around it)
        raise AssertionError(f"package(s) in no layer of tests/layers.py: {', '.join(unplaced)}")
    upward = sorted({f"{a} -> {b} ({where})" for m, t, where in edges
                     if (a := package_of(m)) != (b := package_of(t)) and rank[b] >= rank[a]})
    if upward:
        raise AssertionError("imports of a package not below the importer's (tests/layers.py, lowest first: "
                             + " < ".join("/".join(layer) for layer in layers) + "):\n" + "\n".join(upward))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_name_each_package_once():
    named = [pkg for layer in LAYERS for pkg in layer]
    assert len(named) == len(set(named)), f"a package in two layers of tests/layers.py: {named}"
    stale = sorted(set(named) - {package_of(m) for m in _modules()})
    assert not stale, f"tests/layers.py names packages that do not exist: {stale}"


def test_packages_import_downward():
    check_downward(import_edges(), _modules())


PLANTED = {  # a tiny tree: kv imports checks (upward) in a function, model imports kv.codecs (upward) as a.b.c
    "mla_conformance/__init__.py": "",
    "mla_conformance/errors.py": "",
    "mla_conformance/model/__init__.py": "",
    "mla_conformance/model/config.py": "from mla_conformance.errors import *\nimport mla_conformance.kv.codecs\n",
    "mla_conformance/kv/__init__.py": "",
    "mla_conformance/kv/codecs.py": ("from ..model.config import *\n\n\ndef f():\n"
                                     "    from mla_conformance.checks import driver\n"),
    "mla_conformance/checks/__init__.py": "",
    "mla_conformance/checks/layer/driver.py": "from mla_conformance.kv import codecs\n",
}


def test_an_upward_import_fails_naming_it(tmp_path):
    """The check fails (an AssertionError, not an error) on a tree with planted upward imports, naming each."""
    for rel, src in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    with pytest.raises(AssertionError) as exc:
        check_downward(import_edges(tmp_path), _modules(tmp_path))
    lines = str(exc.value).splitlines()[1:]
    assert lines == ["kv -> checks (mla_conformance/kv/codecs.py:5)",
                     "model -> kv (mla_conformance/model/config.py:2)"], lines


def test_a_planted_edge_in_the_real_graph_fails_naming_it():
    edges = import_edges() + [("mla_conformance.model.config", "mla_conformance.report.build",
                               "mla_conformance/model/config.py:1")]
    with pytest.raises(AssertionError) as exc:
        check_downward(edges, _modules())
    assert "model -> report (mla_conformance/model/config.py:1)" in str(exc.value).splitlines()[1:], str(exc.value)


def test_a_package_in_no_layer_fails_naming_it():
    with pytest.raises(AssertionError, match="in no layer of tests/layers.py: newpkg"):
        check_downward([], [*_modules(), "mla_conformance.newpkg.thing"])


def test_no_file_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_argparse_only_in_cli():
    users = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                   if "argparse" in p.read_text() and "cli" not in p.relative_to(PKG).parts[:1])
    assert not users, f"argparse outside mla_conformance/cli/: {users}"


def test_no_globals_update_in_tests():
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                   if p != Path(__file__) and INJECT in p.read_text())
    assert not users, f"{INJECT} in {users}"


def test_function_local_imports_of_the_package_say_why():
    """A function-local import of the package's own modules hides an edge of the import graph: it is there only
    where a heavy import must wait (torch, hypothesis, the report package), with the reason on its line or the
    line above."""
    silent = []
    for path in sorted(PKG.rglob("*.py")):
        src = path.read_text()
        lines = src.splitlines()
        for node, in_function in _imports(path):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if in_function and (mod or "").startswith("mla_conformance") and "#" not in lines[node.lineno - 1] \
                    and not lines[node.lineno - 2].strip().startswith("#"):
                silent.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, "function-local imports without a reason:\n" + "\n".join(sorted(set(silent)))


#: suffixes of build outputs and binaries: never in the tree (.gitignore keeps them out of `git add`)
BUILD_OUTPUTS = (".whl", ".tar.gz", ".egg", ".so", ".o", ".pyc", ".pyd", ".dll", ".dylib", ".exe")
#: the binary files the tree holds on purpose: the embedded models' real safetensors checkpoints
BINARIES_ALLOWED = ("fixtures/models/",)


def _tracked(root: Path) -> list[str]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout ({root}): the tracked files cannot be listed")
    return [p for p in proc.stdout.decode().split("\0") if p]


def stray_binaries(root: Path) -> list[str]:
    """Tracked build outputs, build directories and binary files (a NUL byte in the first 8 KiB) outside
    BINARIES_ALLOWED."""
    bad = []
    for rel in _tracked(root):
        path = root / rel
        if rel.endswith(BUILD_OUTPUTS) or any(part in ("build", "dist") or part.endswith(".egg-info")
                                               for part in Path(rel).parts[:-1]):
            bad.append(f"{rel} (a build output)")
        elif not rel.startswith(BINARIES_ALLOWED) and path.is_file() and b"\0" in path.read_bytes()[:8192]:
            bad.append(f"{rel} (a binary file)")
    return bad


def test_no_build_outputs_or_binaries_tracked():
    bad = stray_binaries(ROOT)
    assert not bad, f"tracked files that are build outputs or binaries (remove them; .gitignore lists the kinds): {bad}"


def test_a_committed_wheel_is_found(tmp_path):
    """The check fails on what it exists for: a wheel committed at the root (as pyflakes-4.1.0-py2.py3-none-any.whl
    was), and a binary file elsewhere than the fixtures."""
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "pkg-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04")
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01")
    (tmp_path / "fixtures" / "models").mkdir(parents=True)
    (tmp_path / "fixtures" / "models" / "m.safetensors").write_bytes(b"\x00\x01")
    git("add", "-f", ".")
    assert stray_binaries(tmp_path) == ["blob.dat (a binary file)", "pkg-1.0-py3-none-any.whl (a build output)"]


def test_addopts_leave_out_the_unused_plugins():
    """The checkout's pytest leaves out what `run` leaves out (resources.UNUSED_PLUGINS, spelled again in
    pyproject.toml's addopts, which cannot import it)."""
    import shlex
    import tomllib

    from mla_conformance.resources import NO_UNUSED_PLUGINS

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = shlex.split(ini["addopts"])
    pairs = list(zip(addopts, addopts[1:]))
    missing = [p for p in zip(NO_UNUSED_PLUGINS[::2], NO_UNUSED_PLUGINS[1::2]) if p not in pairs]
    assert not missing, f"pyproject.toml's addopts lack {missing}"
