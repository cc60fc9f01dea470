"""The op contract's method tables, pinned (issue 29): what every table and behaviour derived from the method registry
gave before there was a registry -- METHODS, SIGNATURES, TENSORS, DECLARATIONS, METHOD_DECLARATIONS, what
``declared()`` accepts, returns and refuses for each declaration (the allowed values, head-dim pairs, formats, page
sizes), what ``MethodCase.describe`` / ``OpCase.describe`` print, the sentences a method test skips with
(checks.op_methods.unsupported), METHOD_SUITES and the report's generic sections.

tests/op_tables_before_registry.json holds them as the parallel tables gave them (written by ``python -m
tests.test_op_registry`` from commit a4a56e6, before the registry; never regenerated since). The comparison is
restricted to the five methods it knows (decode, prefill, sparse_prefill, merge, write) and their declarations: a
method added later changes none of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mla_conformance.checks import op_methods
from mla_conformance.contract import op
from mla_conformance.contract.op import MethodCase, OpCase
from mla_conformance.report import markdown

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
        "METHOD_SUITES": op_methods.METHOD_SUITES,
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


if __name__ == "__main__":  # the pin's first writing (see the module docstring): never rerun on a later tree
    PINNED.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {{\n" + ",\n".join(f"  {json.dumps(k2)}: {json.dumps(v2)}"
                                                                         for k2, v2 in v.items()) + "\n }"
                                         if isinstance(v, dict) else f" {json.dumps(k)}: {json.dumps(v)}"
                                         for k, v in observed().items()) + "\n}\n", encoding="utf-8")
