"""The op contract's methods, one registry entry each (issue 29): :data:`METHOD_SPECS` holds a :class:`MethodSpec` per
method -- its signature, its tensors, its declarations (each a :class:`Declaration`: default, kind, allowed values,
the case attributes it gates), what a case's description says of it, its suite files and its report sections --
and every per-method table of the package is derived from it: :data:`METHODS`, :data:`SIGNATURES`,
:data:`TENSORS`, :data:`DECLARATIONS`, :data:`METHOD_DECLARATIONS` here (re-exported by
:mod:`mla_conformance.contract.op`, whose docstring is the contract's prose) and :data:`METHOD_SUITES`, the method
tests' skips (``mla_conformance.checks.op.methods``), the report's generic sections
(``mla_conformance.report.markdown.GENERIC_SECTIONS``) and the docs tables of docs/op-contract.md
(``python tools/docs.py``). Section names are declared, with their meaning, in :data:`mla_conformance.schema.SECTIONS`
(below this package); tests/test_op_registry.py holds each spec's sections to that and to its suites' markers.

A name that is not a method (:func:`method_spec`) or not a declaration (:func:`declaration`) is a ValueError naming
it and the known ones, everywhere: nothing falls back to another method.

To add a method:

1. a :class:`MethodSpec` in :data:`METHOD_SPECS` (its declarations prefixed by its name) and its section, with its
   meaning, in schema.SECTIONS;
2. its words: contract/op.py's docstring (the method and each of its declarations; a declaration's gates are
   MethodCase fields, given with ``needed_for``) and a bullet in docs/op-contract.md's "The optional methods";
3. its float64 oracle in mla_conformance/model/ (attention_oracles.py has the others'), its check in checks/op/
   (recording figures under keys schema.FIGURES declares) and its suite file(s) under suites/ (each test takes
   ``mla_op``);
4. the method on ReferenceOp (impl/ops/reference.py, calling the oracle) and on the independent op
   (tests/meta/impls/independent/op_methods.py), and a broken op for each of its tests
   (tests/meta/impls/broken/op_methods.py, a cell in tests/meta/test_op_methods_meta.py);
5. ``python tools/docs.py``: it rewrites the tables (docs/op-contract.md, markers.md).

Pure python (no torch): the report's renderers read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mla_conformance.dtypes import dtype_name
from mla_conformance.errors import BackendSpecError

#: The head dims of the op contract: q and the latent key are 576 = 512 (kv_lora, also the value) + 64 (rope).
D_QK = 576
D_V = 512
D_ROPE = 64
FP8_ROW_BYTES = 656

#: What ``decode`` reads and ``write`` writes; "fp8-e4m3-model1" is FlashMLA's MODEL1 layout (584 B/token,
#: mla_conformance.kv.model1), read by sparse decode only.
KV_FORMATS = ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
WRITE_KV_FORMATS = KV_FORMATS
#: DeepSeek-V3's prefill head dims in "MHA mode": q / k 128 nope + 64 rope, v 128.
PREFILL_D_QK = 192
PREFILL_D_V = 128

# --------------------------------------------------------------------------- declarations

#: The kinds of a declaration, what the op may declare and what ``declared()`` returns:
#: flag -- True or False (a bool, nothing else); choice -- one of its ``allowed`` values; head-dims -- "any" or
#: (d_qk, d_v) pairs with 0 < d_v <= d_qk (returned as a tuple of int pairs); formats -- a sequence of its
#: ``allowed`` values; sizes -- a sequence of page sizes (both returned as a tuple); claim -- a property the op
#: claims of its results (determinism, batch invariance), read for its truth and returned as declared.
FLAG, CHOICE, HEAD_DIMS, FORMATS, SIZES, CLAIM = "flag", "choice", "head-dims", "formats", "sizes", "claim"
KINDS = (FLAG, CHOICE, HEAD_DIMS, FORMATS, SIZES, CLAIM)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One optional declaration of a method: the op's attribute ``name``, its ``default`` (what an op that does not
    declare it gets), its ``kind`` (:data:`KINDS`) and, for a choice or formats, the ``allowed`` values.

    ``gate``: the :class:`~mla_conformance.contract.op.MethodCase` attributes a case needs the declaration to admit
    (their value, a tuple of them where more than one): a flag must be declared True for a case whose attribute is
    true, a value declaration must include the case's value; a method test of a case it does not admit skips,
    saying ``needed_for`` is not tested (``mla_conformance.checks.op.methods.unsupported``). Decode's
    declarations gate :class:`~mla_conformance.contract.op.OpCase` in ``mla_conformance.checks.op.inputs``.
    """

    name: str
    default: Any
    kind: str
    allowed: tuple = ()
    gate: tuple[str, ...] = ()
    needed_for: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"declaration {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == FLAG:
            object.__setattr__(self, "allowed", (True, False))
        elif (self.kind in (CHOICE, FORMATS)) != bool(self.allowed):
            raise ValueError(f"declaration {self.name!r}: a {self.kind} declaration "
                             f"{'lists its' if self.allowed else 'has no'} allowed values")
        try:
            self.validate("(the registry)", self.default)
        except BackendSpecError as exc:
            raise ValueError(f"declaration {self.name!r}: its default {self.default!r} is not allowed: {exc}") from None

    def validate(self, owner, value) -> Any:
        """``value`` as ``declared()`` returns it, or a BackendSpecError naming ``owner`` (the op's name) and the
        attribute when the kind does not allow it."""
        key = self.name
        if self.kind == FLAG and not isinstance(value, bool):
            raise BackendSpecError(f"op {owner!r}: {key} = {value!r} is not True or False")
        if self.kind == CHOICE and value not in self.allowed:
            raise BackendSpecError(f"op {owner!r}: {key} = {value!r} is not one of "
                                   f"{', '.join(map(repr, self.allowed))}")
        if self.kind == HEAD_DIMS:
            if value == "any":
                return value
            try:
                pairs = tuple((int(a), int(b)) for a, b in value)
            except (TypeError, ValueError):
                pairs = ()
            if not pairs or any(not 0 < v <= qk for qk, v in pairs):
                raise BackendSpecError(f"op {owner!r}: {key} {value!r} must be 'any' or (d_qk, d_v) pairs with "
                                       f"0 < d_v <= d_qk, e.g. ({self.default[0]!r},)")
            return pairs
        if self.kind in (FORMATS, SIZES):
            value = tuple(value)
            if self.kind == FORMATS and any(f not in self.allowed for f in value):
                raise BackendSpecError(f"op {owner!r}: {key} {value!r} must be among "
                                       f"{', '.join(map(repr, self.allowed))}")
        return value

    def needed(self, case) -> Any:
        """What ``case`` needs of this declaration: its :attr:`gate` attribute's value (a tuple of several)."""
        values = tuple(getattr(case, a) for a in self.gate)
        return values[0] if len(values) == 1 else values

    def admits(self, declared_value, needed) -> bool:
        """Whether an op declaring ``declared_value`` takes a case that needs ``needed`` (:meth:`needed`)."""
        if self.kind in (FLAG, CLAIM):
            return not needed or bool(declared_value)
        if self.kind == HEAD_DIMS:
            return declared_value == "any" or tuple(needed) in declared_value
        if self.kind == CHOICE:
            return needed == declared_value
        return needed in declared_value


def flag(name: str, default: bool, **kw) -> Declaration:
    return Declaration(name, default, FLAG, **kw)


def choice(name: str, default: str, allowed: tuple[str, ...], **kw) -> Declaration:
    return Declaration(name, default, CHOICE, allowed, **kw)


def head_dims(name: str, default, **kw) -> Declaration:
    return Declaration(name, default, HEAD_DIMS, **kw)


def formats(name: str, default: tuple[str, ...], allowed: tuple[str, ...], **kw) -> Declaration:
    return Declaration(name, default, FORMATS, allowed, **kw)


def sizes(name: str, default: tuple[int, ...], **kw) -> Declaration:
    return Declaration(name, default, SIZES, **kw)


def claim(name: str, default: bool) -> Declaration:
    return Declaration(name, default, CLAIM)


# --------------------------------------------------------------------------- methods


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One method of the op contract.

    ``name``: the op's attribute (a method is detected on the op: a callable of that name); ``signature``: as the skip
    of an op without it and the usage errors quote it; ``tensors``: its inputs then what it returns, (name, shape,
    what it holds) -- docs/op-contract.md's tables and the layouts a shape error of an op's result names;
    ``declarations``: its own (prefixed by its name, but the base method's), in the order the report and the docs
    list them; ``parts``: what a case's description (``describe()``) says of this method, a function of the case;
    ``empty``: what it says of a case with ``rows_without_keys``; ``row_kinds``: whether such a case tells the two
    kinds apart (``zero_length_rows``, ``queries_before_first_key``); ``suites``: its suite files under suites/
    (every test in them takes ``mla_op``); ``sections``: the report sections (``mla_section`` markers) of their tests.
    ``base``: the method the contract is written around (decode): its cases are OpCase and its description carries
    no method name; the others' cases are MethodCase.
    """

    name: str
    signature: str
    tensors: tuple[tuple[str, str, str], ...]
    declarations: tuple[Declaration, ...]
    parts: Callable[[Any], list[str]]
    suites: tuple[str, ...]
    sections: tuple[str, ...]
    empty: str = "rows without keys"
    row_kinds: bool = True
    base: bool = False

    def describe(self, case) -> str:
        """One line of ``case`` (an OpCase of the base method, a MethodCase of the others): the method's name (not
        the base's), its :attr:`parts`, then what every case says (rows without keys, strided, padding rows, device)."""
        parts = ([] if self.base else [self.name]) + list(self.parts(case))
        if case.rows_without_keys:
            parts.append(self.empty)
        if getattr(case, "strided", False):
            parts.append("strided")
        if case.padding_rows:
            parts.append(f"{case.padding_rows} padding rows")
        parts.append(case.device)
        return ", ".join(parts)


def _causal(case) -> str:
    return "causal" if case.causal else "non-causal"


def _decode_parts(case) -> list[str]:
    parts = [f"B={case.batch}", f"s_q={case.s_q}", f"h_q={case.h_q}", f"page={case.page_block_size}",
             dtype_name(case.dtype), case.kv_format, _causal(case)]
    if case.topk is not None:
        parts.append(f"sparse top-{case.topk}")
    if case.attn_sink:
        parts.append("attn_sink")
    return parts


def _prefill_parts(case) -> list[str]:
    return [f"B={case.batch}", f"total_q={case.tokens}", f"h_q={case.h_q}", f"h_k={case.h_k}",
            f"d={case.d_qk}/{case.d_v}", dtype_name(case.dtype), _causal(case)]


def _sparse_prefill_parts(case) -> list[str]:
    parts = [f"s_q={case.tokens}", f"h_q={case.h_q}", f"h_kv={case.h_k}", f"d={case.d_qk}/{case.d_v}",
             f"top-{case.topk}", dtype_name(case.dtype)]
    return parts + [p for p, on in (("topk_length", case.topk_length), ("attn_sink", case.attn_sink)) if on]


def _merge_parts(case) -> list[str]:
    return [f"T={case.tokens}", f"h={case.h_q}", f"d={case.d_v}", f"out {dtype_name(case.dtype)}",
            f"lse base {case.lse_base}"]


def _write_parts(case) -> list[str]:
    return [f"T={case.tokens}", case.kv_format, f"page={case.page_block_size}", dtype_name(case.dtype)]


LSE_BASES = ("e", "2")
EMPTY_ROWS = ("+inf", "-inf")
SCALE_FORMATS = ("pow2", "fp32")

DECODE = MethodSpec(
    name="decode",
    signature="decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None, "
              "topk_length=None, attn_sink=None) -> (out, lse)",
    tensors=(
        ("q", f"[B, s_q, h_q, {D_QK}]", f"q's dtype: the absorbed nope part ({D_V}, already x W_UK), then the rotated "
                                        f"rope part ({D_ROPE}); may be non-contiguous"),
        ("kv_cache", f"[num_blocks, page_block_size, 1, {D_QK}]",
         f"q's dtype (`latent`: the normed latent c, then the rotated k_pe); uint8 [..., {FP8_ROW_BYTES}] "
         f"(`fp8-e4m3-flashmla`: {D_V} e4m3, 4 float32 tile scales, {D_ROPE} bfloat16 rope); uint8 [..., 584] "
         "(`fp8-e4m3-model1`)"),
        ("block_table", "[B, max_blocks]", "int32: row b's j-th page is kv_cache[block_table[b, j]]; entries past a "
                                           "row's pages may hold anything"),
        ("cache_seqlens", "[B]", "int32: keys per row, 0 allowed"),
        ("indices", "[B, s_q, topk]", "int32 (`sparse_decode`): into the flattened cache, block * page_block_size + "
                                      "offset; -1 (and, under `invalid_index = \"out-of-range\"`, any entry outside "
                                      "the cache) invalid"),
        ("topk_length", "[B]", "int32 or None (`sparse_decode`): only the first topk_length[b] entries count"),
        ("attn_sink", "[h_q]", "float32 or None (`attn_sink`)"),
        ("out", f"[B, s_q, h_q, {D_V}]", "any floating dtype (compared in float64; half a step of its own dtype "
                                      "allowed); a query with no keys: 0"),
        ("lse", "[B, h_q, s_q]", "float32, heads first, in `lse_base`; a query with no keys: `empty_row` (+inf); "
                                 "None under `returns_lse = False`"),
    ),
    declarations=(
        choice("lse_base", "e", LSE_BASES),
        flag("returns_lse", True),
        choice("empty_row", "+inf", EMPTY_ROWS),
        flag("sparse_decode", False),
        flag("sparse_decode_extra_cache", False),
        choice("invalid_index", "minus-one", ("minus-one", "out-of-range")),
        flag("attn_sink", False),
        sizes("page_block_sizes", (64,)),
        formats("kv_formats", ("latent",), KV_FORMATS),
        choice("fp8_scale_format", "pow2", SCALE_FORMATS),
        claim("deterministic", False),
        claim("batch_invariant", False),
        head_dims("head_dims", ((D_QK, D_V),)),
        choice("padding_rows", "defined", ("defined", "undefined")),
        flag("out_buffers", False),
    ),
    parts=_decode_parts,
    suites=("test_op_numerics.py", "test_op_paging.py", "test_op_sparse.py", "test_op_fp8.py", "test_op_padding.py",
            "test_op_replay.py", "test_op_speculative.py", "test_op_out_buffers.py", "test_op_generated.py",
            "test_op_dcp.py"),
    sections=("op-numerics", "op-split-kv", "op-determinism", "op-poison", "op-shapes", "op-sparse", "op-fp8",
              "op-padding", "op-replay", "op-speculative", "op-out-buffers", "op_generated", "op-dcp"),
    base=True,
)

PREFILL = MethodSpec(
    name="prefill",
    signature="prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> (out, lse)",
    tensors=(
        ("q", "[total_q, h_q, d_qk]", "the model dtype; may be a strided view"),
        ("k", "[total_k, h_k, d_qk]", "q's dtype; h_q % h_k == 0, query head h reads kv head h // (h_q / h_k); may be "
                                      "a strided view"),
        ("v", "[total_k, h_k, d_v]", "q's dtype; may be a slice of a buffer padded to d_qk"),
        ("cu_seqlens_q", "[B + 1]", "int32: row b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]"),
        ("cu_seqlens_k", "[B + 1]", "int32: row b's keys are k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]] (0 allowed)"),
        ("out", "[total_q, h_q, d_v]", "any floating dtype; a query with no keys: 0"),
        ("lse", "[total_q, h_q]", "float32, tokens first (not decode's [B, h_q, s_q]), in `prefill_lse_base`; a "
                                  "query with no keys: `prefill_empty_row`; None under `prefill_returns_lse = False`"),
    ),
    # the (d_qk, d_v) pairs it takes; the base of its lse; the lse of a query with no keys; whether it returns one
    declarations=(
        head_dims("prefill_head_dims", ((PREFILL_D_QK, PREFILL_D_V),), gate=("d_qk", "d_v"),
                  needed_for="prefill at these head dims"),
        choice("prefill_lse_base", "e", LSE_BASES),
        choice("prefill_empty_row", "+inf", EMPTY_ROWS),
        flag("prefill_returns_lse", True),
    ),
    parts=_prefill_parts,
    suites=("test_op_prefill.py",),
    sections=("op_prefill",),
)

SPARSE_PREFILL = MethodSpec(
    name="sparse_prefill",
    signature="sparse_prefill(q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None) "
              "-> (out, max_logits, lse)",
    tensors=(
        ("q", "[s_q, h_q, d_qk]", "the model dtype"),
        ("kv", "[s_kv, h_kv, d_qk]", "q's dtype; the value is kv[..., :d_v]"),
        ("indices", "[s_q, h_kv, topk]", "int32 into kv's s_kv; an entry < 0 or >= s_kv is invalid"),
        ("topk_length", "[s_q]", "int32 or None (`sparse_prefill_topk_length`)"),
        ("attn_sink", "[h_q]", "float32 or None (`sparse_prefill_attn_sink`)"),
        ("out", "[s_q, h_q, d_v]", "any floating dtype; a row with no valid index: 0"),
        ("max_logits", "[s_q, h_q]", "float32: the largest scaled logit (natural units); no valid index: -inf"),
        ("lse", "[s_q, h_q]", "float32, tokens first, in `sparse_prefill_lse_base`; no valid index: +inf"),
    ),
    # (d_qk, d_v) pairs (576 / 512 V3.2, 512 / 512 MODEL1), lse base, topk_length, attn_sink
    declarations=(
        head_dims("sparse_prefill_head_dims", ((D_QK, D_V),), gate=("d_qk", "d_v"),
                  needed_for="sparse_prefill at these head dims"),
        choice("sparse_prefill_lse_base", "e", LSE_BASES),
        flag("sparse_prefill_topk_length", False, gate=("topk_length",), needed_for="sparse prefill with topk_length"),
        flag("sparse_prefill_attn_sink", False, gate=("attn_sink",), needed_for="sparse prefill with attn_sink"),
    ),
    parts=_sparse_prefill_parts,
    suites=("test_op_sparse_prefill.py",),
    sections=("op_sparse_prefill",),
)

MERGE = MethodSpec(
    name="merge",
    signature="merge(out_a, lse_a, out_b, lse_b) -> (out, lse)",
    tensors=(
        ("out_a", "[T, h, d]", "any floating dtype, possibly strided; an empty side's out is 0"),
        ("lse_a", "[T, h]", "float32, tokens first (possibly a view of [h, T] storage, as vLLM keeps it), in "
                            "`merge_lse_base`; +inf or -inf marks an empty side (those `merge_empty_input` takes)"),
        ("out_b", "[T, h, d]", "out_a's dtype"),
        ("lse_b", "[T, h]", "as lse_a"),
        ("out", "[T, h, d]", "out_a's dtype: (w_a out_a + w_b out_b) / (w_a + w_b), w = exp(lse - max); both "
                             "sides empty: 0"),
        ("lse", "[T, h]", "float32, in `merge_lse_base`: the log of the summed weights; both sides empty: "
                          "`merge_empty_row` (the output's marker only)"),
    ),
    # the base of the lse it takes and returns; the lse it returns when both sides are empty; the infinity that marks
    # an empty side among its inputs
    declarations=(
        choice("merge_lse_base", "e", LSE_BASES),
        choice("merge_empty_row", "+inf", EMPTY_ROWS),
        choice("merge_empty_input", "either", ("either", "+inf", "-inf")),
    ),
    parts=_merge_parts,
    suites=("test_op_merge.py",),
    sections=("op_merge",),
    empty="empty sides",
    row_kinds=False,  # an empty side is one kind
)

WRITE = MethodSpec(
    name="write",
    signature="write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format) -> None",
    tensors=(
        ("kv_c", f"[T, {D_V}]", "the model dtype (`fp8-e4m3-model1`: [T, 448]); may be a view of the projection output"),
        ("k_pe", f"[T, {D_ROPE}]", "the model dtype: the rotated rope key"),
        ("kv_cache", "as decode reads `kv_format`", "written in place: the slots slot_mapping names, nothing else"),
        ("slot_mapping", "[T]", "int64: token t goes to slot block * page_block_size + offset (block = slot // "
                                "page_block_size); a negative slot writes nothing (under `write_padding_slot = "
                                "\"dummy-slot-0\"` padding comes with slot 0 instead); a slot twice in one call is "
                                "the caller's error"),
    ),
    # the formats it writes, the FP8 tile-scale convention it writes, the page sizes it writes into, how padding comes
    declarations=(
        formats("write_kv_formats", ("latent",), WRITE_KV_FORMATS, gate=("kv_format",), needed_for="write"),
        choice("write_fp8_scale_format", "pow2", SCALE_FORMATS),
        sizes("write_page_block_sizes", (64,), gate=("page_block_size",), needed_for="write"),
        choice("write_padding_slot", "negative", ("negative", "dummy-slot-0")),
    ),
    parts=_write_parts,
    suites=("test_op_write.py",),
    sections=("op_write",),
    row_kinds=False,  # a write has no queries
)

#: The methods of the op contract, in the order the docs, the report and ``methods_of`` list them.
METHOD_SPECS: tuple[MethodSpec, ...] = (DECODE, PREFILL, SPARSE_PREFILL, MERGE, WRITE)

#: The suites of compositions of methods, not of one method (no MethodSpec lists them): test_op_composition.py runs
#: an op's prefill, merge and write together as chunked prefill does (mla_conformance.checks.op.composition).
COMPOSITION_SUITES = ("test_op_composition.py",)
#: The suite files of the optional methods (each MethodSpec's but the base method's), then the compositions' (the
#: decode op meta test, tests/meta/test_op_meta.py, covers the others; tests/meta/test_op_methods_meta.py covers
#: these).
METHOD_SUITES = tuple(s for spec in METHOD_SPECS if not spec.base for s in spec.suites) + COMPOSITION_SUITES


def _checked(specs: tuple[MethodSpec, ...]) -> dict[str, MethodSpec]:
    """name -> spec, once the registry is one: unique method, declaration, suite and section names, one base method
    (first), every other method's declarations prefixed by its name."""
    by_name: dict[str, MethodSpec] = {}
    owner: dict[str, str] = {}
    for spec in specs:
        if spec.name in by_name:
            raise ValueError(f"op method {spec.name!r} is registered twice")
        by_name[spec.name] = spec
        for what, names in (("declaration", [d.name for d in spec.declarations]), ("suite", spec.suites),
                            ("section", spec.sections)):
            for n in names:
                if (what, n) in owner:
                    raise ValueError(f"{what} {n!r} belongs to {owner[what, n]} and {spec.name}")
                owner[what, n] = spec.name
        if not spec.base:
            stray = [d.name for d in spec.declarations if not d.name.startswith(spec.name + "_")]
            if stray:
                raise ValueError(f"op method {spec.name!r}: declarations {stray} are not prefixed {spec.name + '_'!r}")
    if [s.base for s in specs] != [True] + [False] * (len(specs) - 1):
        raise ValueError("the first op method, and only it, is the base method")
    return by_name


_BY_NAME = _checked(METHOD_SPECS)
BASE_METHOD = METHOD_SPECS[0]

#: The kernels an op may implement, each optional (its tests skip, naming it, on an op without it).
METHODS: tuple[str, ...] = tuple(_BY_NAME)
#: The methods beyond the base one (their cases are MethodCase).
OPTIONAL_METHODS: tuple[str, ...] = tuple(s.name for s in METHOD_SPECS if not s.base)
#: Each method's signature, as the skip of an op without it and the usage errors quote it.
SIGNATURES: dict[str, str] = {s.name: s.signature for s in METHOD_SPECS}
#: Each method's tensors, its inputs then what it returns: (name, shape, what it holds).
TENSORS: dict[str, tuple[tuple[str, str, str], ...]] = {s.name: s.tensors for s in METHOD_SPECS}
#: Every declaration, by name (its method's spec holds it).
DECLARATION_SPECS: dict[str, Declaration] = {d.name: d for s in METHOD_SPECS for d in s.declarations}
#: Optional declarations and their defaults.
DECLARATIONS: dict[str, Any] = {name: d.default for name, d in DECLARATION_SPECS.items()}
#: Which method each declaration belongs to (what the report prints for an op: the declarations of the methods it
#: has, so an op written before a method existed reports what it reported then).
METHOD_DECLARATIONS: dict[str, tuple[str, ...]] = {s.name: tuple(d.name for d in s.declarations)
                                                    for s in METHOD_SPECS}


def method_spec(name: str) -> MethodSpec:
    """The spec of method ``name``; a name that is not a method is a ValueError naming it and the methods."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} is not a method of the op contract (its methods: {', '.join(METHODS)})") from None


def declaration(key: str) -> Declaration:
    """The declaration ``key``; a name that is not one is a ValueError naming it and the declarations."""
    try:
        return DECLARATION_SPECS[key]
    except (KeyError, TypeError):
        raise ValueError(f"{key!r} is not a declaration of the op contract (its declarations: "
                         f"{', '.join(DECLARATION_SPECS)})") from None


__all__ = ["MethodSpec", "Declaration", "METHOD_SPECS", "METHOD_SUITES", "COMPOSITION_SUITES", "BASE_METHOD", "METHODS", "OPTIONAL_METHODS", "SIGNATURES",
           "TENSORS", "DECLARATIONS", "DECLARATION_SPECS", "METHOD_DECLARATIONS", "method_spec", "declaration", "KINDS",
           "FLAG", "CHOICE", "HEAD_DIMS", "FORMATS", "SIZES", "CLAIM", "D_QK", "D_V", "D_ROPE", "FP8_ROW_BYTES",
           "KV_FORMATS", "WRITE_KV_FORMATS", "PREFILL_D_QK", "PREFILL_D_V"]
