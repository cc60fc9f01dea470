"""Spec resolution, above both contracts: a built-in name, ``package.module:attr``, ``path/to/file.py:attr`` or
``op:SPEC`` (an op behind the layer contract) becomes a backend or an op instance, or a BackendSpecError naming
the spec. The one resolver for ``--mla-backend``, ``--mla-op``, ``run --backend`` and ``bench --backend``."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from mla_conformance.contract.layer import BUILTINS, REQUIRED_METHODS
from mla_conformance.contract.op import BUILTIN_OPS, DECLARATIONS as OP_DECLARATIONS
from mla_conformance.contract.op import METHODS as OP_METHODS, REQUIRED_METHODS as OP_REQUIRED
from mla_conformance.contract.op import declared as op_declared, methods_of
from mla_conformance.errors import BackendSpecError, environment_line

#: ``op:SPEC``: an op (mla_conformance.contract.op) behind the layer contract
OP_PREFIX = "op:"


def _op_backend(spec: str):
    """``op:SPEC`` -> OpBackend(get_op(SPEC)); a bad SPEC is a BackendSpecError naming both."""
    op_spec = spec[len(OP_PREFIX):].strip()
    if not op_spec:
        raise BackendSpecError(f"backend spec {spec!r}: 'op:' needs an op spec after it: a built-in op "
                               f"({', '.join(BUILTIN_OPS)}), package.module:attr or path/to/file.py:attr")
    from mla_conformance.impl.ops.layer import OpBackend  # imports torch: naming a spec (spec_name) must not

    try:
        op = get_op(op_spec)
        return OpBackend(op)
    except (BackendSpecError, TypeError) as exc:  # TypeError: an op without decode cannot be a layer backend
        raise BackendSpecError(f"backend spec {spec!r}: {exc}") from None


def _import_attr(spec: str, target: str, attr: str, kind: str = "backend") -> Any:
    if target.endswith(".py") or "/" in target or target.startswith("."):
        path = Path(target)
        if not path.is_file():
            raise BackendSpecError(f"{kind} spec {spec!r}: file {target!r} does not exist")
        mod_name = f"_mla_backend_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[mod_name]
                raise BackendSpecError(f"{kind} spec {spec!r}: importing {target!r} failed: "
                                       f"{environment_line(exc)}") from None
    else:
        cwd = str(Path.cwd())
        if cwd not in sys.path and "" not in sys.path:  # module:attr resolves from where it is typed (as uvicorn's)
            sys.path.append(cwd)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
                raise BackendSpecError(f"{kind} spec {spec!r}: no module named {exc.name!r}") from None
            raise BackendSpecError(f"{kind} spec {spec!r}: importing {target!r} failed: "
                                   f"{environment_line(exc)}") from None
        except Exception as exc:
            raise BackendSpecError(f"{kind} spec {spec!r}: importing {target!r} failed: "
                                   f"{environment_line(exc)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BackendSpecError(f"{kind} spec {spec!r}: {target!r} has no attribute {attr!r}") from None


def resolve_spec(spec: str, *, kind: str, builtins: dict[str, str], required: tuple[str, ...],
                 forms: str = "package.module:attr or path/to/file.py:attr", hint=None) -> Any:
    """Resolve a spec (a built-in name, ``package.module:attr`` or ``path/to/file.py:attr``; a class is
    instantiated without arguments) to an object with a ``name`` string and the ``required`` methods, or raise
    BackendSpecError naming the spec. ``kind`` ("backend", "op") words the messages; ``hint(spec)`` may add a
    sentence to the unknown-name message."""
    if not isinstance(spec, str) or not spec.strip():
        raise BackendSpecError(f"{kind} spec {spec!r}: empty; give a built-in {kind} ({', '.join(builtins)}), {forms}")
    spec = spec.strip()
    if spec in builtins:
        target, attr = builtins[spec].split(":")
    elif ":" in spec:
        target, _, attr = spec.rpartition(":")
        if not target or not attr:
            raise BackendSpecError(f"{kind} spec {spec!r}: expected module:attr or file.py:attr")
    else:
        import difflib

        close = difflib.get_close_matches(spec, list(builtins), n=1, cutoff=0.6)
        extra = hint(spec) if hint is not None else None
        extra = f" ({extra})" if extra else (f" (did you mean {close[0]!r}?)" if close else "")
        raise BackendSpecError(f"{kind} spec {spec!r}: not a built-in {kind}{extra}; built-ins are "
                               f"{', '.join(builtins)}; or give {forms}")
    obj = _import_attr(spec, target, attr, kind)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise BackendSpecError(f"{kind} spec {spec!r}: instantiating {attr} without arguments failed: "
                                   f"{environment_line(exc)}") from None
    missing = [m for m in required if not callable(getattr(obj, m, None))]
    if missing:
        contract = "the contract" if kind == "backend" else f"the {kind} contract"
        raise BackendSpecError(f"{kind} spec {spec!r}: {type(obj).__name__} is not a{'n' if kind[0] in 'aeio' else ''} "
                               f"{kind}: missing {', '.join(missing)} ({contract} needs name, {', '.join(required)})")
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise BackendSpecError(f"{kind} spec {spec!r}: {type(obj).__name__} has no 'name' string attribute")
    return obj


def _op_hint(spec: str) -> str | None:
    if spec in BUILTIN_OPS:
        return f"{spec!r} is an op: give {OP_PREFIX + spec!r} to run it behind the layer contract"
    return None


def get_backend(spec: str):
    """Resolve a backend spec to a backend instance, or raise BackendSpecError naming the spec."""
    if isinstance(spec, str) and spec.strip().startswith(OP_PREFIX):
        return _op_backend(spec.strip())
    return resolve_spec(spec, kind="backend", builtins=BUILTINS, required=REQUIRED_METHODS,
                        forms="package.module:attr, path/to/file.py:attr or op:SPEC (an op behind the layer contract)",
                        hint=_op_hint)


def get_op(spec: str):
    """Resolve an op spec to an op instance, or raise BackendSpecError naming the spec."""
    obj = resolve_spec(spec, kind="op", builtins=BUILTIN_OPS, required=OP_REQUIRED)
    if not methods_of(obj):  # every method is optional, but an op has at least one
        raise BackendSpecError(f"op spec {spec.strip()!r}: {type(obj).__name__} is not an op: it has none of the "
                               f"methods {', '.join(OP_METHODS)} (the op contract needs name, "
                               f"{', '.join(OP_REQUIRED)} and at least one of them)")
    for key in OP_DECLARATIONS:
        op_declared(obj, key)  # a bad declaration is a bad spec, said now
    return obj


def spec_name(spec: str, kind: str) -> str:
    """The name the backend (``kind`` "backend") or op of ``spec`` reports, resolving the spec only when it is not
    a built-in: a built-in's name is its key (tests/meta/test_backend_spec.py holds this), so checking and naming
    built-ins imports no torch (``mla-conformance run`` and ``test`` check every spec in their own process before
    pytest starts). A bad spec is a BackendSpecError naming it, as from get_backend / get_op."""
    s = spec.strip() if isinstance(spec, str) else spec
    if kind == "op":
        return s if s in BUILTIN_OPS else get_op(s).name
    return s if s in BUILTINS else get_backend(s).name  # op:SPEC resolves: its op must have decode
