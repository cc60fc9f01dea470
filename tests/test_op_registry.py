"""The op contract's method registry (mla_conformance.contract.methods.METHOD_SPECS, issue 29): every table and
behaviour derived from it is what the parallel tables gave before it; a name that is not a method is an error
everywhere; each spec's suites, sections and declarations are what the suites, the report's schema and the docs say.

The pin: what every table and behaviour derived from the method registry
gave before there was a registry -- METHODS, SIGNATURES, TENSORS, DECLARATIONS, METHOD_DECLARATIONS, what
``declared()`` accepts, returns and refuses for each declaration (the allowed values, head-dim pairs, formats, page
sizes), what ``MethodCase.describe`` / ``OpCase.describe`` print, the sentences a method test skips with
(checks.op.methods.unsupported), METHOD_SUITES and the report's generic sections.

tests/op_tables_before_registry.json holds them as the parallel tables gave them (written by ``python -m
tests.test_op_registry`` from commit a4a56e6, before the registry; never regenerated since). The comparison is
restricted to the five methods it knows (decode, prefill, sparse_prefill, merge, write) and their declarations: a
method added later changes none of them.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from mla_conformance.checks.op import methods as op_methods
from mla_conformance.contract import methods, op
from mla_conformance.contract.methods import METHOD_SPECS, Declaration, MethodSpec, method_spec
from mla_conformance.contract.op import MethodCase, OpCase
from mla_conformance.report import markdown
from mla_conformance.resources import suites_dir
from mla_conformance.schema import SECTIONS

PINNED = Path(__file__).with_name("op_tables_before_registry.json")

#: values handed to declared() for every declaration: the allowed ones, wrong types, head-dim pairs, formats, sizes
PROBES = (None, True, False, 0, 1, "e", "2", "+inf", "-inf", "bogus", "any", "either", "negative", "dummy-slot-0",
          "minus-one", "out-of-range", "pow2", "fp32", "defined", "undefined", "latent", ("latent",),
          ["fp8-e4m3-flashmla", "latent"], ("fp8-e4m3-model1",), ("nope",), (16, 64), [1], (), ((576, 512),),
          [[192, 128], (256, 256)], ((1, 2),), ((2, 3),), ((0, 0),), (("a", 1),), (576, 512))

BF16, F32 = torch.bfloat16, torch.float32
#: cases of every method, with each flag describe prints
CASES = {
    "prefill": [dict(dtype=BF16, h_q=8, h_k=8, d_qk=192, d_v=128, tokens=4, causal=True),
                dict(dtype=F32, h_q=6, h_k=2, d_qk=256, d_v=256, tokens=19, batch=3, rows_without_keys=True,
                     strided=True, padding_rows=2, device="cuda"),
                dict(dtype=F32, h_q=1, h_k=1, d_qk=192, d_v=128, queries_before_first_key=True)],
    "sparse_prefill": [dict(dtype=BF16, h_q=64, h_k=1, d_qk=576, d_v=512, tokens=4, topk=64),
                       dict(dtype=F32, h_q=16, h_k=1, d_qk=512, d_v=512, tokens=3, topk=128, topk_length=True,
                            attn_sink=True, zero_length_rows=True),
                       dict(dtype=F32, h_q=16, h_k=1, d_qk=576, d_v=512, tokens=3, topk=128, topk_length=True,
                            attn_sink=True),
                       dict(dtype=F32, h_q=16, h_k=1, d_qk=576, d_v=512, tokens=3, topk=128, attn_sink=True)],
    "merge": [dict(dtype=BF16, h_q=8, d_v=128, tokens=4),
              dict(dtype=F32, h_q=3, d_v=512, tokens=7, lse_base="2", rows_without_keys=True, strided=True)],
    "write": [dict(dtype=BF16, d_qk=576, d_v=512, tokens=4, kv_format="latent", page_block_size=16),
              dict(dtype=BF16, d_qk=512, d_v=448, tokens=9, kv_format="fp8-e4m3-model1", page_block_size=64,
                   strided=True, padding_rows=1),
              dict(dtype=BF16, d_qk=576, d_v=512, tokens=2, kv_format="fp8-e4m3-flashmla", page_block_size=16)],
}
OP_CASES = [dict(batch=2, s_q=1, h_q=8, page_block_size=64, dtype=BF16),
            dict(batch=3, s_q=4, h_q=16, page_block_size=16, dtype=F32, kv_format="fp8-e4m3-flashmla", topk=64,
                 attn_sink=True, causal=True, rows_without_keys=True, padding_rows=1, device="cuda")]


class _Op:
    """An op of the given declarations and methods (unsupported_reason: None)."""

    def __init__(self, name, **attrs):
        self.name = name
        for k, v in attrs.items():
            setattr(self, k, v)

    def unsupported_reason(self, case):
        return None


def _noop(*args, **kwargs):
    return None


#: ops whose declarations decide the method tests' skips (op_methods.unsupported)
OPS = [_Op("bare", prefill=_noop, sparse_prefill=_noop, merge=_noop, write=_noop),
       _Op("wide", prefill=_noop, sparse_prefill=_noop, merge=_noop, write=_noop, prefill_head_dims="any",
           sparse_prefill_head_dims=((576, 512), (512, 512)), sparse_prefill_topk_length=True,
           sparse_prefill_attn_sink=True, write_kv_formats=("latent", "fp8-e4m3-model1"),
           write_page_block_sizes=(16, 64)),
       _Op("half", sparse_prefill=_noop, sparse_prefill_topk_length=True, write_kv_formats=("fp8-e4m3-flashmla",))]


def _outcome(fn):
    try:
        return ["value", fn()]
    except Exception as exc:  # what it refuses, as it says it
        return ["raises", type(exc).__name__, str(exc)]


def observed() -> dict:
    """Every table and behaviour the pin holds, as JSON values (tuples are lists)."""
    probes = {key: [_outcome(lambda: op.declared(_Op("probed", **({} if v is None else {key: v})), key))
                    for v in PROBES] for key in op.DECLARATIONS}
    cases = {m: [MethodCase(m, **kw) for kw in kws] for m, kws in CASES.items()}
    return json.loads(json.dumps({
        "METHODS": op.METHODS,
        "SIGNATURES": op.SIGNATURES,
        "TENSORS": op.TENSORS,
        "DECLARATIONS": op.DECLARATIONS,
        "METHOD_DECLARATIONS": op.METHOD_DECLARATIONS,
        "declared": probes,
        "describe": {m: [c.describe() for c in cs] for m, cs in cases.items()},
        "describe_decode": [OpCase(**kw).describe() for kw in OP_CASES],
        "unsupported": {o.name: {m: [op_methods.unsupported(o, c) for c in cs] for m, cs in cases.items()}
                        for o in OPS},
        "METHOD_SUITES": methods.METHOD_SUITES,
        "GENERIC_SECTIONS": markdown.GENERIC_SECTIONS,
    }))


def _restricted(tables: dict, methods: list[str], keys: list[str]) -> dict:
    """The tables' parts of these methods and declarations only, in their order."""
    out = dict(tables)
    out["METHODS"] = [m for m in tables["METHODS"] if m in methods]
    for name in ("SIGNATURES", "TENSORS", "METHOD_DECLARATIONS", "describe"):
        out[name] = {m: tables[name][m] for m in tables[name] if m in methods}
    for name in ("DECLARATIONS", "declared"):
        out[name] = {k: tables[name][k] for k in tables[name] if k in keys}
    out["unsupported"] = {o: {m: r for m, r in per.items() if m in methods} for o, per in tables["unsupported"].items()}
    return out


def test_the_tables_are_what_they_were_before_the_registry():
    pinned = json.loads(PINNED.read_text(encoding="utf-8"))
    got = observed()
    keys = list(pinned["DECLARATIONS"])
    got = _restricted(got, pinned["METHODS"], keys)
    pinned_suites, pinned_sections = pinned["METHOD_SUITES"], pinned["GENERIC_SECTIONS"]
    got["METHOD_SUITES"] = [s for s in got["METHOD_SUITES"] if s in pinned_suites]
    got["GENERIC_SECTIONS"] = [s for s in got["GENERIC_SECTIONS"] if s in pinned_sections]
    for name in pinned:
        assert got[name] == pinned[name], f"{name} differs from what it was before the registry"
    assert set(got) == set(pinned)


# --------------------------------------------------------------------------- the registry


def test_the_registry_is_ordered_and_every_table_is_derived_from_it():
    assert op.METHOD_SPECS is METHOD_SPECS
    assert [s.name for s in METHOD_SPECS][:5] == ["decode", "prefill", "sparse_prefill", "merge", "write"]
    assert op.METHODS == tuple(s.name for s in METHOD_SPECS) and op.OPTIONAL_METHODS == op.METHODS[1:]
    for spec in METHOD_SPECS:
        assert method_spec(spec.name) is spec
        assert op.SIGNATURES[spec.name] == spec.signature and op.TENSORS[spec.name] == spec.tensors
        assert op.METHOD_DECLARATIONS[spec.name] == tuple(d.name for d in spec.declarations)
        for d in spec.declarations:
            assert op.DECLARATIONS[d.name] == d.default and methods.declaration(d.name) is d
    assert list(op.DECLARATIONS) == [d.name for s in METHOD_SPECS for d in s.declarations]
    assert methods.METHOD_SUITES == (*(f for s in METHOD_SPECS[1:] for f in s.suites), *methods.COMPOSITION_SUITES)
    assert markdown.GENERIC_SECTIONS[:-3] == tuple(sec for s in METHOD_SPECS[1:] for sec in s.sections)


class _HasAll:
    name = "has-all"
    nonsense = staticmethod(_noop)

    def unsupported_reason(self, case):
        return None


def _renamed(case, method):
    """``case`` with another method's name, past MethodCase's own check (as an op's stale case object might be)."""
    object.__setattr__(case, "method", method)
    return case


NOT_A_METHOD = r"'nonsense' is not a method of the op contract \(its methods: decode, prefill, sparse_prefill, merge, " \
               r"write"


@pytest.mark.parametrize("call", [
    lambda: method_spec("nonsense"),
    lambda: MethodCase("nonsense", BF16),
    lambda: MethodCase(method="nonsense", dtype=BF16).describe(),
    lambda: op.has_method(_HasAll(), "nonsense"),
    lambda: op.layout_of("nonsense", "q"),
    lambda: op_methods.missing_method_reason(_HasAll(), "nonsense"),
    lambda: op_methods.require_method(_HasAll(), "nonsense"),
    lambda: op_methods.unsupported(_HasAll(), _renamed(MethodCase("merge", BF16), "nonsense")),
], ids=["method_spec", "MethodCase", "describe", "has_method", "layout_of", "missing_method_reason", "require_method",
        "unsupported"])
def test_a_name_that_is_not_a_method_is_an_error_everywhere(call):
    """Never described, detected or skipped as another method (MethodCase's describe once fell back to write's)."""
    with pytest.raises(ValueError, match=NOT_A_METHOD):
        call()


def test_a_method_case_of_the_base_method_is_an_error():
    with pytest.raises(ValueError, match=f"MethodCase is a case of {', '.join(op.OPTIONAL_METHODS)}; decode's "
                                         "cases are OpCase"):
        MethodCase("decode", BF16)


def test_a_name_that_is_not_a_declaration_is_an_error():
    with pytest.raises(ValueError, match=r"'nonsense' is not a declaration of the op contract \(its declarations: "
                                         r"lse_base, returns_lse, "):
        op.declared(_HasAll(), "nonsense")


def test_the_registry_refuses_what_would_make_two_owners_of_a_fact():
    p = method_spec("prefill")
    cases = {"registered twice": (METHOD_SPECS[0], p, p),
             "belongs to prefill and merge": (METHOD_SPECS[0], p, dataclasses.replace(method_spec("merge"),
                                                                                       suites=p.suites)),
             "are not prefixed 'merge_'": (METHOD_SPECS[0], dataclasses.replace(method_spec("merge"),
                                                                                declarations=p.declarations)),
             "only it, is the base method": (p, METHOD_SPECS[0])}
    for text, specs in cases.items():
        with pytest.raises(ValueError, match=text):
            methods._checked(specs)
    with pytest.raises(ValueError, match="kind 'enum' is not one of flag, choice"):
        Declaration("x_y", 1, "enum")
    with pytest.raises(ValueError, match="its default 'z' is not allowed"):
        methods.choice("x_y", "z", ("a", "b"))
    with pytest.raises(ValueError, match="a choice declaration has no allowed values"):
        Declaration("x_y", "a", methods.CHOICE)


def test_each_gate_is_an_attribute_of_the_case_it_gates():
    fields = {f.name for f in dataclasses.fields(MethodCase)}
    for spec in METHOD_SPECS[1:]:
        for d in spec.declarations:
            assert set(d.gate) <= fields, (spec.name, d.name, d.gate)
            assert bool(d.gate) == bool(d.needed_for), (spec.name, d.name)
    assert not any(d.gate for d in METHOD_SPECS[0].declarations), "decode's gates are checks.op.inputs.unsupported's"


def _suite_tests(path: Path):
    """(test function, its mla_section markers, its arguments) of each test of a suite file."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call)
                     and isinstance(d.func, ast.Attribute) and d.func.attr == "mla_section"]
            yield node.name, marks, [a.arg for a in node.args.args]


@pytest.mark.parametrize("spec", METHOD_SPECS, ids=lambda s: s.name)
def test_each_spec_s_suites_exist_take_mla_op_and_carry_its_sections(spec: MethodSpec):
    found = set()
    for name in spec.suites:
        path = suites_dir() / name
        assert path.is_file(), f"{spec.name}: suite {name} does not exist"
        tests = list(_suite_tests(path))
        assert tests, f"{spec.name}: {name} has no test"
        for test, marks, args in tests:
            assert "mla_op" in args, f"{name}::{test} takes no mla_op"
            assert len(marks) == 1, f"{name}::{test}: mla_section markers {marks}"
            found |= set(marks)
    assert found == set(spec.sections), f"{spec.name}: its suites' sections {sorted(found)}, its spec's {spec.sections}"
    assert set(spec.sections) <= set(SECTIONS), f"{spec.name}: sections not in schema.SECTIONS"


def test_every_op_suite_is_one_method_s_or_a_composition_s():
    owned = [f for s in METHOD_SPECS for f in s.suites] + list(methods.COMPOSITION_SUITES)
    assert sorted(owned) == sorted(p.name for p in suites_dir().glob("test_op_*.py"))
    for name in methods.COMPOSITION_SUITES:
        assert all("mla_op" in args for _, _, args in _suite_tests(suites_dir() / name))


def test_every_declaration_is_in_the_docs():
    """docs/op-contract.md's generated table (``python tools/docs.py --check`` holds it current) lists each with its
    default, and the contract's prose (contract/op.py's docstring) names each."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "op-contract.md").read_text(encoding="utf-8")
    for spec in METHOD_SPECS:
        assert f"`{spec.signature}`" in text, spec.name
        for d in spec.declarations:
            assert f"`{d.name}` = `{repr(d.default).replace(chr(39), chr(34))}`" in text, d.name
            assert re.search(f"``{d.name}\\b", op.__doc__), f"{d.name} is not in contract/op.py's prose"


if __name__ == "__main__":  # the pin's first writing (see the module docstring): never rerun on a later tree
    PINNED.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {{\n" + ",\n".join(f"  {json.dumps(k2)}: {json.dumps(v2)}"
                                                                         for k2, v2 in v.items()) + "\n }"
                                         if isinstance(v, dict) else f" {json.dumps(k)}: {json.dumps(v)}"
                                         for k, v in observed().items()) + "\n}\n", encoding="utf-8")
