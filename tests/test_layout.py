"""The package's layout rules (issue 20), checked from its source: no import cycle, no file over 700 lines,
argparse only in cli/, no globals-update namespace injection in the tests."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside a function (an implicit parent
    package import is not an edge: ``import a.b.c`` runs ``a.b``'s ``__init__`` but depends on ``a.b.c``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
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
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


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
