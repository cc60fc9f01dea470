"""The reference's score functions compute exactly their einsum specs (the spec is the equation; the function
is the fast form that reads the cache in place)."""
import torch

from mla_conformance.model import reference as ref
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.weights import MLAWeights


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, generator=_rand.g)


_rand.g = torch.Generator().manual_seed(0)


def test_naive_scores_is_its_einsum():
    q, k = _rand(2, 3, 4, 24), _rand(2, 7, 4, 24)
    torch.testing.assert_close(ref.naive_scores(q, k), torch.einsum(ref.NAIVE_SCORES, q, k), rtol=1e-12, atol=1e-12)


def test_absorbed_scores_is_its_einsum():
    q_lat, q_pe, c, k_pe = _rand(2, 3, 4, 16), _rand(2, 3, 4, 8), _rand(2, 7, 16), _rand(2, 7, 8)
    spec_c, spec_r = ref.ABSORBED_SCORES
    want = torch.einsum(spec_c, q_lat, c) + torch.einsum(spec_r, q_pe, k_pe)
    torch.testing.assert_close(ref.absorbed_scores(q_lat, q_pe, c, k_pe), want, rtol=1e-12, atol=1e-12)


def test_absorbed_equals_naive_in_float64():
    """The absorption identity the two paths rest on: q^C_h W_UK,h . c == q^C_h . (W_UK,h c)."""
    w_uk, c, q = _rand(4, 6, 16), _rand(2, 7, 16), _rand(2, 3, 4, 6)
    k_nope = torch.einsum("btc,hdc->bthd", c, w_uk)
    q_lat = torch.einsum("bshd,hdc->bshc", q, w_uk)
    zero_r, zero_k = torch.zeros(2, 3, 4, 1, dtype=torch.float64), torch.zeros(2, 7, 1, dtype=torch.float64)
    torch.testing.assert_close(ref.absorbed_scores(q_lat, zero_r, c, zero_k), ref.naive_scores(q, k_nope),
                               rtol=1e-12, atol=1e-12)


def _absorbed_mix_with_views(weights, q_nope, q_pe, c, k_pe, allowed):
    """absorbed_scores_and_mix as it was before the memo: W_UK / W_UV as split_kv_b's strided views (in the
    reference's GEMM arithmetic, ref.einsum / ref.matmul)."""
    w_uk, w_uv = ref.split_kv_b(weights)
    q_lat = ref.einsum("bshd,hdc->bshc", q_nope, w_uk)
    scores = ref.absorbed_scores(q_lat, q_pe, c, k_pe) * weights.config.softmax_scale
    scores = scores.to(ref.softmax_dtype(q_nope.dtype)).masked_fill(~allowed[:, :, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0).to(q_nope.dtype)
    o = ref.einsum("bshc,hdc->bshd", ref.einsum("bsht,btc->bshc", p, c), w_uv)
    return ref.matmul(o.flatten(-2), weights["o_proj.weight"].T)


def test_contiguous_kv_b_gives_the_same_bits():
    """absorbed_kv_b's contiguous halves (made once, not copied by einsum at every step) change no bit of the
    absorbed output, in every dtype, decode and prefill shapes, a row with no key included."""
    cfg = MLAConfig.preset("tiny")
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        w = MLAWeights.random(cfg, seed=1, dtype=dtype)
        H, B = cfg.num_attention_heads, 2
        for S, T in ((1, 9), (3, 5)):
            g = torch.Generator().manual_seed(S)
            q_nope = torch.randn(B, S, H, cfg.qk_nope_head_dim, generator=g).to(dtype)
            q_pe = torch.randn(B, S, H, cfg.qk_rope_head_dim, generator=g).to(dtype)
            c = torch.randn(B, T, cfg.kv_lora_rank, generator=g).to(dtype)
            k_pe = torch.randn(B, T, cfg.qk_rope_head_dim, generator=g).to(dtype)
            allowed = torch.ones(B, S, T, dtype=torch.bool)
            allowed[1, 0] = False  # a query with no key: zeros, not NaN
            got = ref.absorbed_scores_and_mix(w, q_nope, q_pe, c, k_pe, allowed)
            assert torch.equal(got, _absorbed_mix_with_views(w, q_nope, q_pe, c, k_pe, allowed)), (dtype, S, T)


def test_contiguous_kv_b_follows_an_in_place_change():
    w = MLAWeights.random(MLAConfig.preset("tiny"), seed=2, dtype=torch.float32)
    w_uk, _ = ref.absorbed_kv_b(w)
    assert ref.absorbed_kv_b(w)[0] is w_uk  # made once
    w["kv_b_proj.weight"].mul_(2)
    w_uk2, w_uv2 = ref.absorbed_kv_b(w)
    views = ref.split_kv_b(w)
    assert torch.equal(w_uk2, views[0]) and torch.equal(w_uv2, views[1])


def test_half_precision_products_sum_in_float32_and_round_once():
    """ref.matmul / ref.einsum multiply half-precision operands as a GPU GEMM does: a bfloat16 or float16
    accumulator stops growing at 256 (2048 for float16) when adding ones, a float32 sum of 4096 ones is 4096; and
    each element is the float64 product rounded once to the dtype, or one of its two neighbours (the float32 sum's
    own rounding)."""
    for dtype in (torch.bfloat16, torch.float16):
        ones = torch.ones(1, 4096, dtype=dtype)
        assert ref.matmul(ones, ones.T).item() == 4096, dtype
        assert ref.einsum("st,t->s", ones, ones[0]).item() == 4096, dtype
        a, b = _rand(8, 512).to(dtype), _rand(512, 8).to(dtype)
        exact = a.double() @ b.double()
        got = ref.matmul(a, b).double()
        ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((got - exact).abs() <= ulp).all(), dtype


def test_half_precision_operands_off_the_cpu_are_multiplied_in_their_dtype():
    """Off the CPU (a GPU's own half-precision GEMM is the arithmetic matmul stands for) nothing is upcast: shown on
    torch's meta device, which has no data."""
    for dtype in (torch.bfloat16, torch.float16):
        a, b = torch.empty(4, 8, dtype=dtype, device="meta"), torch.empty(8, 2, dtype=dtype, device="meta")
        assert ref.gemm_operand(a) is a and ref.matmul(a, b).dtype == dtype
        assert ref.gemm_operand(torch.zeros(2, dtype=dtype)).dtype == torch.float32  # on the CPU: float32
