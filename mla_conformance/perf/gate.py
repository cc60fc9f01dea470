"""No timing without correctness: the decode step a benchmark times is checked first against the float64 oracle.

The gate runs on the very prepared step that is then timed (the same backend, weights, filled cache, new
token, page size, kv codec, dtype, batch and context), so the configuration checked is the configuration
timed; one that fails gets no figure: ``Prepared.step`` raises :class:`NotTimed` ("not timed: wrong output
(<measured> vs <bound>, <where>)") and ``bench`` prints that line instead of GB/s.

**The oracle of one decode step** (the new token at position ``context`` over keys ``0..context``), in
float64 from the float64 master weights and the hidden states the cache was filled from, rounded to the run's
dtype as the backend saw them (:func:`mla_conformance.perf.fill.hidden_chunk`)::

    c_t, k^R_t       = RMSNorm(W_DKV x_t), RoPE(W_KR x_t)        t = 0..context (the key half of reference.project)
    q^C, q^R         = reference.project(x_new)
    out              = reference.absorbed_scores_and_mix(q^C, q^R, c, k^R)   every key allowed

(absorbed and expanded agree to ~1e-15 in float64; the expanded ``reference_attention_f64`` recomputes every
query, quadratic in the context: 34 GB of scores at 16k.) DeepSeek Sparse Attention configs attend over a
selection: the backend's own ``last_topk_indices`` when it exposes one (suites/test_dsa.py's every-query
comparison), else the top-``index_topk`` of the float64 indexer scores of the new token over every key.

**The bounds are the suite's, plus one term the suite's short rows do not need**, per row:

* kv_codec "none": ``checks.TOLERANCES[dtype]``, rel_fro and max_abs/rms, as ``checks.numerics``, each plus the
  row's score-rounding term (:mod:`mla_conformance.perf.score_rounding`): TOLERANCES counts roundings of relative
  size u independent of the row's length, but rounding the attention scores to the dtype before the softmax (the
  references, transformers' eager attention) errs in proportion to the logits' magnitude, which at 1k-32k keys
  alone exceeds TOLERANCES' bf16 rel_fro. The term is derived from this step's own float64 quantities (probability
  1e-6 per row that a correct backend's score rounding exceeds it, under the probabilistic model of rounding);
  a backend whose scores are float32 has that much margin;
* a quantized kv_codec: the suite holds the backend's unquantized output to ``TOLERANCES[dtype]`` and its
  codec output to ``kv.codecs.ERROR_BOUNDS[codec].attention`` (rel_fro against the unquantized output), so
  by the triangle inequality the codec output lies within ``tol + attention x (1 + tol)`` of the oracle in
  rel_fro, with tol the rel_fro above (TOLERANCES + the term); no codec bound exists per element, so max_abs/rms
  is recorded, not bounded;
* an ``op:`` backend (:class:`mla_conformance.impl.ops.layer.OpBackend`), in addition: the op itself at the
  timed case (batch, s_q 1, its head count, page size, dtype, kv format, causal, every row ``context + 1``
  keys) through ``checks.op.check_against_oracle`` with ``checks.OP_TOLERANCES`` (where the config has the
  op contract's 576 / 512 head dims, which ``checks.op`` builds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mla_conformance.checks.layer.driver import master_weights, weights_for
from mla_conformance.checks.metrics import dtype_name, row_metrics
from mla_conformance.checks.op.compare import check_against_oracle
from mla_conformance.checks.op.inputs import Spec, unsupported
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.contract.calls import NonFiniteOutput, check_output
from mla_conformance.contract.layer import cache_format_of
from mla_conformance.contract.op import D_QK, D_V, OpCase
from mla_conformance.errors import BackendOutputError
from mla_conformance.impl.ops.layer import CODEC_FORMATS, OpBackend, head_dims_of
from mla_conformance.kv.codecs import ERROR_BOUNDS
from mla_conformance.model import reference
from mla_conformance.model import dsa_reference as dsa_ref
from mla_conformance.perf import score_rounding
from mla_conformance.perf.fill import chunk_starts, hidden_chunk

ORACLE = "float64 oracle of the decode step (reference.project + absorbed_scores_and_mix, float64 master weights)"


class NotTimed(AssertionError):
    """A step that has not passed the correctness gate was asked to be timed."""


@dataclasses.dataclass
class Correctness:
    """The gate's outcome for one prepared decode step: what was checked, against what, with which bound."""

    passed: bool
    checked: dict[str, Any]
    bound: dict[str, Any]
    measured: dict[str, Any]
    failure: str | None = None       # "<measured> vs <bound>, <where>" when it failed
    op: dict[str, Any] | None = None  # the op-level check of an op: backend
    oracle: str = ORACLE

    def refusal(self) -> str:
        return f"not timed: wrong output ({self.failure})"

    def record(self) -> dict[str, Any]:
        """For the report and the JSON: the configuration checked, the outcome, the bound, what was measured."""
        return {"outcome": "pass" if self.passed else "wrong output", "checked": self.checked, "oracle": self.oracle,
                "bound": self.bound, "measured": self.measured, "failure": self.failure, "op": self.op}


def configuration(p) -> dict[str, Any]:
    """The configuration a prepared step checks and times."""
    return {"backend": p.backend.name, "preset": p.preset, "dtype": dtype_name(p.dtype), "context": p.context,
            "batch": p.batch, "kv_codec": p.kv_codec, "page_block_size": getattr(p.cache, "page_block_size", None),
            "cache_format": cache_format_of(p.backend, p.cache), "cache": type(p.cache).__name__,
            "device": str(p.device), "seed": p.seed,
            "step": f"one decode step: one new token per row at position {p.context} over {p.context} cached tokens"}


def where(p) -> str:
    page = getattr(p.cache, "page_block_size", None)
    return (f"{p.backend.name}'s decode step over {p.context} cached tokens ({p.preset} {dtype_name(p.dtype)}, batch "
            f"{p.batch}, kv_codec {p.kv_codec}" + (f", page {page}" if page else "") + f", {p.device})")


def bound_for(dtype: torch.dtype, kv_codec: str) -> dict[str, Any]:
    """The suite's part of the bound on one decode step's output against the float64 oracle (``row_bounds`` adds
    each row's score-rounding term; see the module docstring)."""
    name = dtype_name(dtype)
    tol = TOLERANCES[name]
    if kv_codec == "none":
        return {"rel_fro": tol.rel_fro, "max_rel": tol.max_rel, "source": f"checks.TOLERANCES[{name!r}]",
                "reason": tol.reason}
    attention = ERROR_BOUNDS[kv_codec].attention
    return {"rel_fro": tol.rel_fro + attention * (1 + tol.rel_fro), "max_rel": None,
            "source": f"checks.TOLERANCES[{name!r}].rel_fro {tol.rel_fro:g} + kv.codecs.ERROR_BOUNDS[{kv_codec!r}]"
                      f".attention {attention:g} x (1 + {tol.rel_fro:g})",
            "reason": "the suite's two bounds of a codec run (unquantized output vs float64, codec output vs "
                      "unquantized), joined by the triangle inequality; no codec bound per element exists"}


# --------------------------------------------------------------------------- the oracle

_KEYS: dict[tuple, tuple] = {}
#: Bytes of float64 keys kept across prepared steps (every backend of a benchmark session at the same context and
#: batch shares them; V2-Lite's 32k keys of one row take 151 MB).
KEYS_CACHE_BYTES = 1 << 30


def _keys_f64(w64, p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """c [B, context, kv_lora], k_pe [B, context, rope] (and the indexer keys of a DSA config) in float64 of the
    hidden states the cache was filled from; cached (up to KEYS_CACHE_BYTES) per preset/seed/dtype/context/batch/
    device."""
    key = (p.preset, p.seed, p.dtype, p.context, p.batch, str(p.device))
    if key in _KEYS:
        return _KEYS[key]
    cfg = w64.config
    cs, kpes, iks = [], [], []
    with torch.no_grad():
        for start, n in chunk_starts(p.context):
            x, pos = hidden_chunk(cfg, start, n, p.batch, p.seed, p.device, p.dtype)
            x = x.to(torch.float64)
            # the key half of reference.project (its query half costs 6x more at V2-Lite dims, and is not needed)
            c, k_pe = (x @ w64["kv_a_proj_with_mqa.weight"].T).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
            cos, sin = reference.rope_cos_sin(cfg, pos)
            cs.append(reference.rms_norm(c, w64["kv_a_layernorm.weight"], cfg.rms_norm_eps))
            kpes.append(reference.apply_rope(k_pe, cos, sin))
            if cfg.dsa:
                iks.append(dsa_ref.indexer_project(w64, x, pos)[1])
    got = (torch.cat(cs, 1), torch.cat(kpes, 1), torch.cat(iks, 1) if iks else None)

    def nbytes(entry) -> int:
        return sum(t.numel() * t.element_size() for t in entry if t is not None)

    while _KEYS and sum(map(nbytes, _KEYS.values())) + nbytes(got) > KEYS_CACHE_BYTES:
        _KEYS.pop(next(iter(_KEYS)))
    _KEYS[key] = got
    return got


def selection_of(p) -> torch.Tensor | None:
    """The backend's own selection of the last step ([B, 1, K] key positions, -1 padded), when it exposes one."""
    for owner in (p.cache, p.backend):
        got = getattr(owner, "last_topk_indices", None)
        if isinstance(got, torch.Tensor):
            return got
    return None


@dataclasses.dataclass
class Oracle:
    """The float64 decode step: its output and the projections it was computed from (what score_rounding reads)."""

    out: torch.Tensor          # [B, 1, hidden]
    keys: str                  # which keys it attends over
    weights: Any               # the float64 master weights
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    c: torch.Tensor
    k_pe: torch.Tensor
    allowed: torch.Tensor      # [B, 1, context + 1]


def oracle_step(p, own_selection: torch.Tensor | None = None) -> Oracle:
    """The float64 decode step at position ``context`` (see the module docstring), with its projections."""
    on_cpu = torch.device(p.device).type == "cpu"
    w64 = master_weights(p.preset, p.seed) if on_cpu else weights_for(p.preset, torch.float64, p.device, seed=p.seed)
    cfg = w64.config
    c_ctx, kpe_ctx, ik_ctx = _keys_f64(w64, p)
    x_new = p.hidden.to(torch.float64)
    pos_new = torch.full((p.batch, 1), p.context, dtype=torch.int64, device=x_new.device)
    with torch.no_grad():
        q_nope, q_pe, c_new, kpe_new = reference.project(w64, x_new, pos_new)
        c, k_pe = torch.cat([c_ctx, c_new], 1), torch.cat([kpe_ctx, kpe_new], 1)
        N = p.context + 1
        allowed = torch.ones(p.batch, 1, N, dtype=torch.bool, device=x_new.device)
        keys = f"every key (0..{p.context})"
        if cfg.dsa and N > cfg.index_topk:
            if own_selection is not None:
                sel, keys = own_selection.to(device=x_new.device, dtype=torch.int64), \
                    f"the backend's own selection of {cfg.index_topk} keys (last_topk_indices)"
            else:
                q_i, k_new, w_i = dsa_ref.indexer_project(w64, x_new, pos_new)
                scores = dsa_ref.indexer_scores(q_i, torch.cat([ik_ctx, k_new], 1), w_i, allowed)
                sel, keys = dsa_ref.select_topk(scores, cfg.index_topk), \
                    f"the float64 indexer's top-{cfg.index_topk} (the backend exposes no last_topk_indices)"
            allowed = dsa_ref.selection_mask(sel, N)
        out = reference.absorbed_scores_and_mix(w64, q_nope, q_pe, c, k_pe, allowed)
    return Oracle(out, keys, w64, q_nope, q_pe, c, k_pe, allowed)


def decode_oracle(p, own_selection: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
    """(float64 [B, 1, hidden] output of the decode step at position ``context``, which keys it attends over)."""
    o = oracle_step(p, own_selection)
    return o.out, o.keys


_TERMS: dict[tuple, tuple[torch.Tensor, str, list[dict]]] = {}


def oracle_and_score_rounding(p, own_selection: torch.Tensor | None = None) -> tuple[torch.Tensor, str, list[dict]]:
    """The oracle's output, its keys and the score-rounding term of each row (perf.score_rounding), kept for the
    next backend of the same configuration (a benchmark session times several at one context)."""
    sel = None if own_selection is None else tuple(own_selection.flatten().tolist())
    key = (p.preset, p.seed, p.dtype, p.context, p.batch, str(p.device), sel)
    if key not in _TERMS:
        o = oracle_step(p, own_selection)
        rows = score_rounding.score_rounding(o.weights, o.q_nope, o.q_pe, o.c, o.k_pe, o.allowed, o.out, p.dtype,
                                 weights_key=(p.preset, p.seed, str(p.device)))
        while len(_TERMS) >= 8:
            _TERMS.pop(next(iter(_TERMS)))
        _TERMS[key] = (o.out, o.keys, rows)
    return _TERMS[key]


# --------------------------------------------------------------------------- the checks


def row_bounds(bound: dict[str, Any], dtype: torch.dtype, kv_codec: str, terms: list[dict]) -> list[dict[str, Any]]:
    """The bound of each row: the suite's (``bound_for``) plus that row's score-rounding term (perf.score_rounding),
    in rel_fro through the same triangle inequality as the codec's bound (tol -> tol + term)."""
    rows = []
    for t in terms:
        if kv_codec == "none":
            rows.append({"rel_fro": bound["rel_fro"] + t["rel_fro"], "max_rel": bound["max_rel"] + t["max_rel"]})
            continue
        tol, attention = TOLERANCES[dtype_name(dtype)].rel_fro, ERROR_BOUNDS[kv_codec].attention
        rows.append({"rel_fro": tol + t["rel_fro"] + attention * (1 + tol + t["rel_fro"]), "max_rel": None})
    return rows


def check_step(p, out) -> Correctness:
    """The gated step's output ``out`` (the step at position ``context``) against the oracle and the bound."""
    checked, bound, at = configuration(p), bound_for(p.dtype, p.kv_codec), where(p)

    def failed(text: str, measured: dict | None = None) -> Correctness:
        return Correctness(False, checked, bound, measured or {}, failure=text)

    try:
        check_output(p.backend, out, p.hidden, p.lengths, at, p.positions)
    except NonFiniteOutput as exc:  # "<name>: attend() output has N non-finite value(s): ... (<at>)"
        what = exc.where.removeprefix(f"{p.backend.name}: ").removesuffix(f" ({at})")
        return failed(f"{what} vs a finite output, {at}")
    except BackendOutputError as exc:
        return failed(f"{str(exc).removeprefix(f'{p.backend.name}: ').removesuffix(f' ({at})')}, {at}")
    ref_out, keys, terms = oracle_and_score_rounding(p, selection_of(p) if p.config.dsa else None)
    bound["score_rounding"] = {**score_rounding.describe(p.dtype), "rows": terms}
    bound["rows"] = row_bounds(bound, p.dtype, p.kv_codec, terms)
    rows = [row_metrics(out[b].to(torch.float64), ref_out[b]) for b in range(p.batch)]
    measured = {"rel_fro": max(r["rel_fro"] for r in rows), "max_rel": max(r["max_rel"] for r in rows),
                "rows": [{"rel_fro": r["rel_fro"], "max_rel": r["max_rel"]} for r in rows], "keys": keys}
    checked["oracle_keys"] = keys
    for b, (r, lim, t) in enumerate(zip(rows, bound["rows"], terms)):
        for name, shown in (("rel_fro", "rel_fro"), ("max_rel", "max_abs/rms")):
            if lim[name] is not None and not r[name] <= lim[name]:
                return failed(f"{shown} {r[name]:.3e} vs {lim[name]:.3g} ({bound['source']}, + score rounding "
                              f"{t[name]:.3g}: perf.score_rounding), row {b} of {at} against the float64 oracle over "
                              f"{keys}", measured)
    result = Correctness(True, checked, bound, measured)
    if isinstance(p.backend, OpBackend):
        result.op = check_op(p)
        if result.op["outcome"] == "wrong output":
            result.passed, result.failure = False, result.op["failure"]
    return result


def op_case(p) -> OpCase | None:
    """The op contract's case of the timed call of an ``op:`` backend (None where checks.op cannot build it)."""
    if head_dims_of(p.config) != (D_QK, D_V):
        return None
    return OpCase(batch=p.batch, s_q=1, h_q=int(p.config.num_attention_heads),
                  page_block_size=p.backend.page_block_size, dtype=p.dtype, kv_format=CODEC_FORMATS[p.kv_codec],
                  causal=True, device=str(p.device))


def check_op(p) -> dict[str, Any]:
    """The op of an ``op:`` backend at the timed case against checks.op's float64 oracle and OP_TOLERANCES."""
    op = p.backend.op
    case = op_case(p)
    if case is None:
        d_qk, d_v = head_dims_of(p.config)
        return {"outcome": "not applicable", "why": f"checks.op builds the op contract's {D_QK} / {D_V} head dims; "
                                                    f"{p.preset} has {d_qk} / {d_v} (the layer check covers the call)"}
    record: dict[str, Any] = {"case": case.describe(), "lens": p.context + 1, "check": "checks.op.check_against_oracle"}
    reason = unsupported(op, case)
    if reason:
        record.update(outcome="wrong output", failure=f"op {op.name} declines the timed case ({case.describe()}): "
                                                      f"{reason}")
        return record
    figures: dict[str, Any] = {}
    spec = Spec(case=case, lens=(p.context + 1,) * p.batch)
    try:
        check_against_oracle(op, spec, check="bench correctness gate", figures=figures)
    except AssertionError as exc:
        record.update(outcome="wrong output", figures=_plain(figures),
                      failure=f"op {op.name} at the timed case, vs checks.OP_TOLERANCES: {exc}")
        return record
    record.update(outcome="pass", figures=_plain(figures))
    return record


def _plain(figures: dict) -> dict:
    """The JSON-able figures of an op check."""
    return {k: v for k, v in figures.items() if isinstance(v, (int, float, str, bool)) or v is None}
