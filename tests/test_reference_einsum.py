"""The reference's score functions compute exactly their einsum specs (the spec is the equation; the function
is the fast form that reads the cache in place)."""
import torch

from mla_conformance.model import reference as ref


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
