"""The op suite's own tools: reference-op anchored to the row-by-row float64 oracle, the FP8 656-byte codec to
FlashMLA's tests/quant.py semantics (scale = 2^ceil(log2(max(amax / 448, 1e-4))) under pow2, e4m3 of
value / scale, float32 scales, bf16 rope; dequantize = e4m3.float() * scale), merge_by_lse's round trip, and
the inputs op_checks builds (poison, invalid block ids, shuffled tables, canaries)."""

import functools
import math

import pytest
import torch

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import prefill as prefill_checks
from mla_conformance.checks.op import sparse_prefill as sparse_prefill_checks
from mla_conformance.contract.op import OpCase
from mla_conformance.kv import model1
from mla_conformance.model import attention_oracles as oracles
from mla_conformance.impl.ops.reference import ReferenceOp, decode_fp8_656, encode_fp8_656, fp8_scales, oracle
from mla_conformance.model.attention_oracles import lse_to_natural, merge_by_lse, natural_to_base

F64 = torch.float64


def _case(**kw):
    base = dict(batch=3, s_q=1, h_q=4, page_block_size=16, dtype=F64)
    base.update(kw)
    return OpCase(**base)


ANCHOR_SPECS = {
    "dense-causal-s_q4": op_checks.Spec(_case(s_q=4, causal=True), (3, 40, 17)),
    "dense-page1-empty": op_checks.Spec(_case(batch=4, page_block_size=1), (0, 1, 5, 9)),
    "sparse-topk_length-sink": op_checks.Spec(_case(s_q=2, topk=16, attn_sink=True, h_q=6), (30, 20, 10), invalid="int-max",
                                       topk_length=True),
    "fp8-fp32-scales": op_checks.Spec(_case(s_q=2, causal=True, kv_format="fp8-e4m3-flashmla"), (37, 64, 5),
                               scale_format="fp32", magnitude=16.0),
}


@pytest.mark.parametrize("name", list(ANCHOR_SPECS))
def test_reference_op_matches_the_oracle(name):
    """reference-op (batched, torch.where masking) and the oracle (row by row) agree in float64 to 1e-12 on out;
    lse is float32 by contract (half a step, 6e-8 relative)."""
    spec = ANCHOR_SPECS[name]
    inp = op_checks.build(spec)
    out, lse = op_checks.run_op(ReferenceOp(), inp, "anchor")
    ref_out, ref_lse, _ = op_checks.oracle_of(spec)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), name
    assert float((out.double() - ref_out).abs().max()) <= 1e-12 * max(1.0, float(ref_out.abs().max())), name
    finite = torch.isfinite(ref_lse)
    assert float(((lse.double() - ref_lse).abs() / (1 + ref_lse.abs()))[finite].max()) <= 1.2e-7, name


# --------------------------------------------------------------------------- FP8 codec vs FlashMLA's quant.py


def _flashmla_quantize(latent_bf16: torch.Tensor) -> torch.Tensor:
    """FlashMLA tests/quant.py, V32_FP8Sparse layout, written from its semantics: per 128-value tile
    scale_inv = amax(|x|).float() / 448 cast to ue8m0 as 2^ceil(log2(clamp_min(scale_inv, 1e-4))), nope =
    (x.float() / scale_inv) as e4m3, the 4 scales as float32 bytes, the rope as the input's bf16 bytes."""
    n = latent_bf16.shape[0]
    out = torch.empty(n, 656, dtype=torch.uint8)
    scales = torch.empty(n, 4, dtype=torch.float32)
    for t in range(4):
        tile = latent_bf16[:, t * 128:(t + 1) * 128]
        inv = tile.abs().max(dim=-1).values.float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).to(torch.float32)
        scales[:, t] = inv
        out[:, t * 128:(t + 1) * 128] = (tile.float() / inv[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, 512:528] = scales.view(torch.uint8)
    out[:, 528:] = latent_bf16[:, 512:].contiguous().view(torch.uint8)
    return out


def _flashmla_dequantize(rows: torch.Tensor) -> torch.Tensor:
    """FlashMLA's dequantize_k_cache (V32): bf16 result, nope.float() * its float32 scale, rope as stored."""
    nope = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (4, 128))
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    c = (nope * scale[..., None]).flatten(-2).to(torch.bfloat16)
    return torch.cat([c, rows[:, 528:].contiguous().view(torch.bfloat16)], dim=-1)


def test_fp8_codec_matches_flashmla_quant():
    g = torch.Generator().manual_seed(0)
    mags = torch.logspace(-7, 3, 64, dtype=torch.float64)
    x = (torch.randn(64, 576, generator=g, dtype=torch.float64) * mags[:, None]).to(torch.bfloat16)
    x[3, 128:256] = 0  # an all-zero tile
    ours = encode_fp8_656(x, "pow2")
    theirs = _flashmla_quantize(x)
    assert torch.equal(ours, theirs), f"{int((ours != theirs).sum())} bytes differ from FlashMLA's quantize"
    assert torch.equal(decode_fp8_656(ours, torch.bfloat16).view(torch.int16),
                       _flashmla_dequantize(theirs).view(torch.int16))


def test_fp8_scale_formats_on_the_probes():
    """A tile whose amax is 336: scale 1.0 under pow2 (336 / 448 = 0.75 rounded up to a power of two), 0.75 under
    fp32 (not a power of two: 1.5 x 2^-1); an all-zero tile: 2^-13 under pow2 (1e-4 rounded up), 1e-4 under fp32."""
    c = torch.zeros(2, 512)
    c[0, :128] = torch.linspace(-336, 300, 128)
    assert fp8_scales(c, "pow2")[0, 0].item() == 1.0 and fp8_scales(c, "fp32")[0, 0].item() == 0.75
    assert fp8_scales(c, "pow2")[1, 0].item() == 2.0 ** -13
    assert fp8_scales(c, "fp32")[1, 0].item() == pytest.approx(1e-4, rel=1e-7)
    for fmt in ("pow2", "fp32"):
        rows = encode_fp8_656(torch.cat([c, torch.zeros(2, 64)], -1), fmt)
        back = decode_fp8_656(rows, F64)
        assert torch.equal(back[1], torch.zeros(576, dtype=F64)), fmt  # all zero stays exactly zero
        # fp32: amax / scale is 448, e4m3's largest value, and 448 x 0.75 gives 336 back exactly; pow2: 336 / 1.0
        # lies between the e4m3 values 320 and 352 (step 32 above 256) and rounds to even, 320
        assert float(back[0, :128].abs().max()) == {"fp32": 336.0, "pow2": 320.0}[fmt], fmt
    with pytest.raises(ValueError, match="fp8 scale format"):
        fp8_scales(c, "ue8m0")


# --------------------------------------------------------------------------- merge_by_lse


MERGE_SPEC = op_checks.Spec(_case(batch=3, s_q=2), (40, 16, 7))


@functools.lru_cache(maxsize=1)
def _merge_parts():
    """The oracle of each row's keys split at a page boundary (row 2, one page: its first part is empty)."""
    inp = op_checks.build(MERGE_SPEC)
    parts = []
    for part in op_checks.split_at_pages(inp):
        t = {n: b.view for n, b in part.buffers.items()}
        parts.append(oracle(t["q"], t["kv_cache"], t["block_table"], t["cache_seqlens"],
                            softmax_scale=part.softmax_scale, causal=False))
    return parts


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("empty", ["+inf", "-inf"])
def test_merge_by_lse_round_trip(base, empty):
    """Keys split in two and merged by LSE (in either base, an empty part's lse either infinity) give the oracle
    of all the keys."""
    whole_out, whole_lse, _ = op_checks.oracle_of(MERGE_SPEC)
    parts = []
    for o, l in _merge_parts():
        l = natural_to_base(l, base)
        if empty == "-inf":
            l = torch.where(torch.isinf(l), torch.full_like(l, -math.inf), l)
        parts.append((o, l))
    assert bool(torch.isinf(parts[0][1][2]).all())  # row 2 (7 keys, one page): its first part has no keys
    out, lse = merge_by_lse(parts[0][0], parts[0][1], parts[1][0], parts[1][1], base)
    assert float((out - whole_out).abs().max()) < 1e-12
    assert float((lse - whole_lse).abs().max()) < 1e-12
    # two empty parts: out 0, lse +inf; a NaN lse stays NaN
    inf = torch.full((1, 1, 1), math.inf, dtype=F64)
    o, l = merge_by_lse(torch.zeros(1, 1, 1, 2), inf, torch.zeros(1, 1, 1, 2), -inf, base)
    assert torch.equal(o, torch.zeros(1, 1, 1, 2, dtype=F64)) and l.item() == math.inf
    o, l = merge_by_lse(torch.ones(1, 1, 1, 2), torch.full((1, 1, 1), math.nan), torch.ones(1, 1, 1, 2), inf, base)
    assert math.isnan(l.item()) and bool(torch.isnan(o).all())
    assert lse_to_natural(torch.tensor([1.0]), "2").item() == pytest.approx(math.log(2.0))


# --------------------------------------------------------------------------- the suite's inputs


def test_inputs_are_poisoned_shuffled_and_canaried():
    spec = op_checks.Spec(OpCase(batch=3, s_q=2, h_q=4, page_block_size=16, dtype=torch.bfloat16), (37, 32, 0),
                   noncontig_q=True, spare_pages=3)
    inp = op_checks.build(spec)
    kv, bt = inp.tensor("kv_cache"), inp.tensor("block_table")
    assert bt.dtype == torch.int32 and inp.tensor("cache_seqlens").dtype == torch.int32
    assert bt[0, :3].tolist() != sorted(bt[0, :3].tolist()) or bt[1, :2].tolist() != sorted(bt[1, :2].tolist())
    assert (bt[0, 3:] == op_checks.INVALID_BLOCK).all() and (bt[2] == op_checks.INVALID_BLOCK).all()
    used = set(bt[bt != op_checks.INVALID_BLOCK].tolist())
    unused = [b for b in range(kv.shape[0]) if b not in used]
    assert len(unused) == 3 and torch.isnan(kv[unused].float()).all()
    assert torch.isnan(kv[int(bt[0, 2]), 37 - 32:].float()).all()     # row 0's last page: 5 keys, then NaN
    assert not torch.isnan(kv[int(bt[0, 2]), :5].float()).any()
    assert not torch.isnan(kv[int(bt[1, 1])].float()).any()           # row 1 ends on a page boundary
    q = inp.tensor("q")
    assert not q.is_contiguous() and q.shape == (3, 2, 4, 576)
    for name, buf in inp.buffers.items():
        assert (buf.base[-op_checks.CANARY_BYTES:] == op_checks.CANARY_BYTE).all(), name
    fp8 = op_checks.build(op_checks.Spec(OpCase(batch=1, s_q=1, h_q=1, page_block_size=16, dtype=torch.bfloat16,
                                  kv_format="fp8-e4m3-flashmla"), (5,)))
    kv8 = fp8.tensor("kv_cache")
    assert kv8.dtype == torch.uint8 and kv8.shape[-1] == 656
    assert (kv8[int(fp8.tensor("block_table")[0, 0]), 5:] == 0xFF).all()


# --------------------------------------------------------------------------- the optional methods' anchors


def _flashmla_model1_quantize(k: torch.Tensor) -> torch.Tensor:
    """FlashMLA tests/quant.py quantize_k_cache, MODEL1_FP8Sparse branch, transcribed: k [num_blocks, page, 1,
    512] bf16 -> the [num_blocks, page, 1, 584] view of its padded block memory (unwritten bytes 0 here)."""
    num_blocks, page = k.shape[:2]
    k = k.squeeze(2)
    per_block = (page * 584 + 575) // 576 * 576
    result = torch.zeros((num_blocks, per_block), dtype=torch.float8_e4m3fn)[:, :page * 584]
    nope_rope = result[:, :page * 576].view(num_blocks, page, 576)
    nope, rope = nope_rope[:, :, :448], nope_rope[:, :, 448:].view(torch.bfloat16)
    scale = result[:, page * 576:].view(num_blocks, page, 8)[:, :, :7].view(torch.float8_e8m0fnu)
    rope[:] = k[..., 448:]
    for t in range(7):
        inv = k[..., t * 64:(t + 1) * 64].abs().max(dim=-1).values.float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).to(torch.float32)
        scale[:, :, t] = inv.to(torch.float8_e8m0fnu)
        nope[:, :, t * 64:(t + 1) * 64] = (k[..., t * 64:(t + 1) * 64].float() / inv[..., None]).to(torch.float8_e4m3fn)
    return result.view(num_blocks, page, 1, -1)


def test_model1_layout_matches_flashmla_quant():
    """kv.model1 (encode into each token's two spans, decode) byte for byte against FlashMLA's MODEL1 quantizer,
    584 B/token, blocks padded to 576; the reference op's write of every slot builds the same memory."""
    g = torch.Generator().manual_seed(1)
    nb, page = 3, 16
    mags = torch.logspace(-6, 2, nb * page, dtype=torch.float64).view(nb, page, 1, 1)
    k = (torch.randn(nb, page, 1, 512, generator=g, dtype=torch.float64) * mags).to(torch.bfloat16)
    k[1, 2, 0, 64:128] = 0  # an all-zero tile: the 1e-4 floor
    theirs = _flashmla_model1_quantize(k).view(torch.uint8)
    assert model1.TOKEN_BYTES == 584 and model1.block_bytes(page) == (page * 584 + 575) // 576 * 576
    blocks = torch.zeros(nb, model1.block_bytes(page), dtype=torch.uint8)
    cache = model1.cache_view(blocks, page)
    flat = k.reshape(-1, 512)
    ReferenceOp().write(flat[:, :448], flat[:, 448:], cache, torch.arange(nb * page), kv_format=model1.NAME)
    mem = model1.block_memory(cache)
    for o in range(page):  # the written spans, token by token (the scale group's padding byte is never written)
        for start, length in model1.spans(page, o):
            assert torch.equal(mem[:, start:start + length], model1.block_memory(theirs)[:, start:start + length])
    # dequantize as quant.py's dequantize_k_cache: e4m3.to(bf16) x scale.to(bf16), then the rope
    assert torch.equal(model1.decode(cache, torch.bfloat16).view(torch.int16)[..., 448:],
                       k.view(torch.int16)[..., 448:])
    assert float((model1.decode(cache, F64) - k.to(F64)).abs().div(k.to(F64).abs().amax(-1, keepdim=True)
                                                                     .clamp_min(1e-30)).max()) <= 2 ** -4


def _flashmla_ref_sparse_fwd(q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None):
    """FlashMLA tests/ref.py ref_sparse_attn_fwd, transcribed (float32 there; float64 here): (out, max_logits,
    lse) with lse +inf for a row with no valid index."""
    s_q, topk = indices.shape[0], indices.shape[-1]
    idx = indices.clone().squeeze(1).long()
    if topk_length is not None:
        idx[torch.arange(topk).unsqueeze(0).broadcast_to(s_q, topk) >= topk_length.unsqueeze(1)] = -1
    invalid = (idx < 0) | (idx >= kv.shape[0])
    idx[invalid] = 0
    gathered = kv.index_select(0, idx.flatten()).reshape(s_q, topk, -1).double()
    P = (q.double() @ gathered.transpose(1, 2)) * sm_scale
    P[invalid.unsqueeze(1).broadcast_to(P.shape)] = float("-inf")
    orig_lse = torch.logsumexp(P, dim=-1)
    max_logits = P.max(dim=-1).values
    lse_for_o = orig_lse if attn_sink is None else torch.logsumexp(
        torch.stack([orig_lse, attn_sink.double().broadcast_to(orig_lse.shape)]), dim=0)
    lse_for_o = lse_for_o.clone()
    lse_for_o[lse_for_o == float("-inf")] = float("+inf")
    out = torch.exp(P - lse_for_o.unsqueeze(-1)) @ gathered[..., :d_v]
    orig_lse[orig_lse == float("-inf")] = float("+inf")
    return out, max_logits, orig_lse


def test_sparse_prefill_oracle_and_reference_match_flashmla_ref():
    spec = sparse_prefill_checks.SparseSpec(s_q=5, s_kv=40, topk=16, h_q=8, invalid_share=0.3, all_invalid_rows=(2,), topk_length=True,
                         attn_sink=True, dtype="float64")
    t = {n: b.view for n, b in sparse_prefill_checks.build(spec).items()}
    theirs = _flashmla_ref_sparse_fwd(t["q"], t["kv"], t["indices"], 0.5, 512, t["topk_length"], t["attn_sink"])
    ours = oracles.sparse_prefill(t["q"], t["kv"], t["indices"], softmax_scale=0.5, d_v=512, topk_length=t["topk_length"],
                             attn_sink=t["attn_sink"])
    ref = ReferenceOp().sparse_prefill(t["q"], t["kv"], t["indices"], softmax_scale=0.5, d_v=512,
                                       topk_length=t["topk_length"], attn_sink=t["attn_sink"])
    for a, b, c in zip(theirs, ours, ref):
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(torch.isinf(a), torch.isinf(c))
        fin = torch.isfinite(a)
        assert float((a[fin] - b[fin]).abs().max()) < 1e-12 and float((a[fin] - c.double()[fin]).abs().max()) < 1e-6
    assert bool(torch.isposinf(ours[2][2]).all()) and bool(torch.isneginf(ours[1][2]).all())
    assert float(ours[0][2].abs().max()) == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_reference_prefill_matches_the_oracle(causal):
    """reference-op's prefill (heads batched, torch.where masking) and the oracle (query by query) in float64:
    bottom-right causal, GQA, a row with no keys."""
    spec = prefill_checks.PrefillSpec(((5, 5), (3, 0), (6, 4), (2, 11)), h_q=6, h_k=2, dtype="float64", causal=causal)
    t = [prefill_checks.build(spec)[n].view for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    out, lse = ReferenceOp().prefill(*t, softmax_scale=spec.softmax_scale, causal=causal)
    ref_out, ref_lse = oracles.prefill(*t, softmax_scale=spec.softmax_scale, causal=causal)
    assert float((out - ref_out).abs().max()) < 1e-12
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 1e-6  # lse is float32 by contract


@pytest.mark.parametrize("empty_a,empty_b", [("+inf", None), (None, "-inf"), ("+inf", "-inf"), ("-inf", "-inf")])
def test_merge_oracle_and_reference_treat_both_infinities_as_empty(empty_a, empty_b):
    g = torch.Generator().manual_seed(2)
    oa, ob = torch.randn(2, 3, 4, generator=g, dtype=F64), torch.randn(2, 3, 4, generator=g, dtype=F64)
    la, lb = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    for lse, out, mark in ((la, oa, empty_a), (lb, ob, empty_b)):
        if mark:
            lse[0] = math.inf if mark == "+inf" else -math.inf
            out[0] = 0.0
    out, lse = oracles.merge(oa, la, ob, lb)
    ref_out, ref_lse = ReferenceOp().merge(oa, la, ob, lb)
    assert float((out - ref_out).abs().max()) < 1e-12
    if empty_a and empty_b:
        assert bool((out[0] == 0).all()) and bool(torch.isposinf(lse[0]).all()) and bool(torch.isposinf(ref_lse[0]).all())
    else:
        kept = ob[0] if empty_a else oa[0]
        assert float((out[0] - kept).abs().max()) < 1e-15
    # the merge of the non-empty rows is the log-sum-exp mix (token 1)
    w = torch.softmax(torch.stack([la[1], lb[1]]), 0)
    assert float((out[1] - (w[0, :, None] * oa[1] + w[1, :, None] * ob[1])).abs().max()) < 1e-12
