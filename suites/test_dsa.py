"""DeepSeek Sparse Attention (V3.2): the lightning indexer's selection and sparse MLA, through the contract.

A backend opts in by accepting a config with ``index_topk`` (others skip with their own sentence). On
``tiny-dsa`` (index_topk 16), with contexts of several x index_topk so that selection bites:

* the output against the float64 sparse oracle (``sparse_attention_f64``: indexer in the rotate-half RoPE
  layout, top-min(k, len) per query, absorbed MLA over the selection) on prefill, prefill + decode and a
  varlen batch, to the dtype's tolerance of checks.TOLERANCES; queries whose oracle selection is not unique
  (the k-th and (k+1)-th scores tie: ReLU makes exact-zero ties common) are left out of the comparison
  and counted (``tied_queries_not_compared``), their selection being judged by test_selection; where the
  backend exposes its selection, also against the oracle over that selection on every query; a failure
  whose tokens match the oracle with an interleaved-pair indexer RoPE says so;
* len <= index_topk selects every key, so DSA equals dense MLA (``reference_attention_f64``): checked at
  index_topk - 1 and index_topk, and at index_topk + 1 against the sparse oracle (the last query drops
  one key), on prefill and on decode steps crossing the boundary;
* where the cache (or the backend) exposes ``last_topk_indices`` (optional): the selected set equals the
  oracle's, allowing swaps only among keys whose oracle scores tie with the k-th within the dtype's
  tolerance; valid count min(k, len); unused slots -1;
* where the cache (or the backend) exposes ``last_indexer_scores`` (optional): the scores of every query
  against the float64 oracle (``indexer_scores_f64``), -inf exactly where the key is masked, to the
  ``indexer-scores`` rows of checks.TOLERANCES (bounds relative to M = sum_h |w_h| sum_i |q_i k_i|; the FP8
  row derived from e4m3's rounding with power-of-two block scales); a failure whose scores match the
  interleaved-pair indexer RoPE says so;
* the cache bytes at V3.2's latent dims (``v3.2-mini``: kv_lora 512, rope 64, indexer key 128) in BF16:
  1,408 B per stored token, the indexer keys counted, each buffer measured from ``tensors()``.
"""

import functools

import pytest
import torch

from mla_conformance import MLAConfig, checks
from mla_conformance.checks import Scenario
from mla_conformance.reference import (FP8_BLOCK, indexer_project, indexer_scores_f64, reference_attention_f64,
                                       sparse_attention_f64)

PRESET = "tiny-dsa"
TOPK = 16  # tiny-dsa's index_topk

SCENARIOS = {
    "prefill": Scenario("dsa_prefill", (80,)),
    "prefill_decode": Scenario("dsa_prefill_decode", (64,), decode_steps=6),
    "varlen_batch": Scenario("dsa_varlen_batch", (70, 40, 20), decode_steps=3),
}

#: score ties: keys whose float64 oracle scores lie within this fraction of the query's largest |score| of
#: the k-th selected score may be swapped (the backend's own rounding decides between them)
TIE_TOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 1e-2, "float16": 5e-3}


def _boundary(offset: int, mode: str) -> Scenario:
    """Row 0 ends at index_topk + offset tokens; "varlen" adds shorter rows (and one decode step)."""
    n = TOPK + offset
    if mode == "varlen":
        return Scenario(f"topk{offset:+d}_varlen", (n - 1, n - 2, n - 9), decode_steps=1)
    return Scenario(f"topk{offset:+d}_{mode}", (n,) if mode == "prefill" else (n - 4,),
                    decode_steps=0 if mode == "prefill" else 4)


@functools.lru_cache(maxsize=16)
def _oracle(scenario: Scenario, dtype: torch.dtype, dense: bool, rope_layout: str = "half") -> torch.Tensor:
    w = checks._weights(PRESET, 0)
    x = checks.inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    lengths = checks.scenario_lengths(scenario)
    if dense:
        return reference_attention_f64(w, x, lengths)
    return sparse_attention_f64(w, x, lengths, rope_layout=rope_layout)


@functools.lru_cache(maxsize=8)
def _oracle_scores(scenario: Scenario, dtype: torch.dtype, rope_layout: str = "half") -> torch.Tensor:
    w = checks._weights(PRESET, 0)
    x = checks.inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    return indexer_scores_f64(w, x, checks.scenario_lengths(scenario), rope_layout=rope_layout)


def _interleaved_hint(out, ref, scenario, dtype, valid) -> str:
    """'; likely cause: ...' when most tokens match the sparse oracle whose indexer rotates interleaved pairs
    (the first V3.2 demo's layout) and fewer match the correct one."""
    alt = _oracle(scenario, dtype, False, "interleaved")
    tol = checks.TOLERANCES[checks.dtype_name(dtype)]

    def matching(oracle):
        rms = float(oracle[valid].pow(2).mean().sqrt())
        return float(((out - oracle).abs().amax(-1)[valid] <= tol.max_rel * rms).double().mean())

    alt_share, share = matching(alt), matching(ref)
    if alt_share >= 0.9 and alt_share > share:
        return (f"; likely cause: the indexer's RoPE in the interleaved layout -- {alt_share:.0%} of the tokens match "
                f"the sparse oracle with an interleaved-pair indexer RoPE ({share:.0%} the correct one); DeepSeek's "
                "corrected V3.2 code (2025-11-18) and transformers rotate the indexer's first qk_rope_head_dim dims "
                "as non-interleaved halves (rotate-half), unlike MLA's interleaved k_pe")
    return ""


def _run(backend, scenario, dtype, device, trace=None):
    w = checks.weights_for(PRESET, dtype, device)
    checks.require_support(backend, w.config, dtype=dtype, device=device)
    x = checks.inputs_for(w.config, scenario)
    out, cache = checks.run_scenario(backend, w, x, scenario, device=device, trace=trace)
    return out, cache


@functools.lru_cache(maxsize=8)
def _ambiguous(scenario: Scenario, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] bool: queries whose oracle selection is not unique -- the k-th and (k+1)-th scores tie within
    TIE_TOL (ReLU makes exact-zero ties common: every head negative). Which of the tied keys a backend keeps
    is its own choice (test_selection allows the swap), so those queries' outputs are not compared."""
    scores = _oracle_scores(scenario, dtype)
    B, T, _ = scores.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    tol = TIE_TOL[checks.dtype_name(dtype)]
    for b in range(B):
        for p in range(TOPK, T):
            s = scores[b, p, :p + 1]
            v = s.topk(TOPK + 1).values
            out[b, p] = bool(v[-2] - v[-1] <= tol * float(s.abs().max()))
    return out


def _compare(backend, out, ref, scenario, dtype, what, figures, skip=None, dense=False):
    __tracebackhide__ = True
    lengths = checks.scenario_lengths(scenario)
    valid = torch.arange(out.shape[1])[None, :] < lengths[:, None]
    if skip is not None:
        figures["tied_queries_not_compared"] = int((skip & valid).sum())
        compared = valid & ~skip
        # ties may thin the comparison, never hollow it out (every row keeps most of its queries)
        for b in range(scenario.batch):
            n, kept = int(valid[b].sum()), int(compared[b].sum())
            assert kept * 2 >= n, (f"{scenario.name} {checks.dtype_name(dtype)}: row {b} leaves {n - kept} of {n} "
                                   "queries out as oracle-tied: the scenario no longer tests the output")
        valid = compared
    m = checks.error_metrics(out[valid], ref[valid])
    tol = checks.TOLERANCES[checks.dtype_name(dtype)]
    figures.update(m)
    figures.update(checks.tolerance_figures(tol))
    for b in range(scenario.batch):
        keep = valid[b].nonzero().flatten()
        mb = checks._row_metrics(out[b, keep], ref[b, keep])
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            worst = int(keep[int((out[b, keep] - ref[b, keep]).abs().amax(-1).argmax())])
            hint = (f"at len <= index_topk ({TOPK}) every causal key must be selected: a top-k that keeps fewer "
                    "(an off-by-one at the boundary) or a selection that ignores the causal length drops keys"
                    if dense else f"index_topk {TOPK}: keys selected other than the oracle's change the output")
            raise AssertionError(
                f"{backend.name} {PRESET} {scenario.name} {checks.dtype_name(dtype)}: row {b} differs from {what} "
                f"beyond the tolerance: rel_fro {mb['rel_fro']:.3e} (tolerance {tol.rel_fro:g}), max_abs/rms "
                f"{mb['max_rel']:.3e} (tolerance {tol.max_rel:g}); worst token at position {worst} of "
                f"{int(lengths[b])} ({hint})" + ("" if dense else _interleaved_hint(out, ref, scenario, dtype, valid)))
    return m


class _SelectionRecorder:
    """The backend under test, unchanged, with each attend call's ``last_topk_indices`` (when it exposes one)
    recorded by position: what the oracle over the backend's own selection needs."""

    def __init__(self, backend):
        self._backend, self.name, self.calls = backend, backend.name, []

    def __getattr__(self, attr):
        return getattr(self._backend, attr)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = self._backend.attend(weights, hidden_states, positions, cache, lengths)
        idx = _last_topk(self._backend, cache)
        self.calls.append(None if idx is None else (positions.cpu(), None if lengths is None else lengths.cpu(),
                                                    idx.to("cpu", torch.int64).clone()))
        return out

    def selection(self, B, T):
        """[B, T, K] selection by query position, or None when a call exposed none."""
        if not self.calls or any(c is None for c in self.calls):
            return None
        K = max(c[2].shape[-1] for c in self.calls)
        full = torch.full((B, T, K), -1, dtype=torch.int64)
        for positions, lengths, idx in self.calls:
            n = lengths if lengths is not None else torch.full((B,), positions.shape[1])
            for b in range(B):
                for i in range(int(n[b])):
                    full[b, int(positions[b, i]), :idx.shape[-1]] = idx[b, i]
        return full


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("dtype,scenario", [("float32", "prefill"), ("float32", "prefill_decode"),
                                            ("float32", "varlen_batch"), ("bfloat16", "varlen_batch")])
def test_sparse_attention(mla_backend, scenario, dtype, mla_device, mla_figures):
    """Sparse attention output vs the float64 sparse oracle at contexts of several x index_topk: over the
    oracle's selection (queries with tied k-th scores left out), and, where the backend exposes
    ``last_topk_indices``, over its own selection on every query (so a tie swap is no numerics failure)."""
    sc, dt = SCENARIOS[scenario], checks.DTYPES[dtype]
    rec = _SelectionRecorder(mla_backend)
    out, _ = _run(rec, sc, dt, mla_device)
    _compare(mla_backend, out, _oracle(sc, dt, False), sc, dt, "the float64 sparse oracle", mla_figures,
             skip=_ambiguous(sc, dt))
    own = rec.selection(sc.batch, out.shape[1])
    if own is not None:
        w = checks._weights(PRESET, 0)
        x = checks.inputs_for(w.config, sc).to(dt).to(torch.float64)
        ref = sparse_attention_f64(w, x, checks.scenario_lengths(sc), indices=own)
        own_figures: dict = {}
        _compare(mla_backend, out, ref, sc, dt, "the float64 sparse oracle over the backend's own selection",
                 own_figures)
        mla_figures["own_selection_rel_fro"] = own_figures["rel_fro"]


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("mode", ["prefill", "decode", "varlen"])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_short_context_is_dense(mla_backend, offset, mode, mla_device, mla_figures):
    """len <= index_topk: every key is selected, DSA == dense MLA (float64 dense reference); at
    index_topk + 1 the sparse oracle (the last query drops one key)."""
    sc, dt = _boundary(offset, mode), torch.float32
    out, _ = _run(mla_backend, sc, dt, mla_device)
    dense = offset <= 0
    _compare(mla_backend, out, _oracle(sc, dt, dense), sc, dt,
             "dense MLA (len <= index_topk selects every key)" if dense else "the float64 sparse oracle", mla_figures,
             skip=None if dense else _ambiguous(sc, dt), dense=dense)


def _last_topk(backend, cache):
    for owner in (cache, backend):
        idx = getattr(owner, "last_topk_indices", None)
        if idx is not None:
            return idx
    return None


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("scenario", ["prefill", "varlen_batch"])
def test_selection(mla_backend, scenario, mla_device, mla_figures):
    """The backend's selection (``last_topk_indices`` of its last attend call) is the oracle's top-min(k, len)
    set, swaps allowed only among keys tied with the k-th score; unused slots -1."""
    sc, dt = SCENARIOS[scenario], torch.float32
    trace: dict = {}
    _, cache = _run(mla_backend, sc, dt, mla_device, trace)
    idx = _last_topk(mla_backend, cache)
    if idx is None:
        pytest.skip(f"{mla_backend.name}: exposes no last_topk_indices (optional); its selection is judged "
                    "through the outputs only")
    where = f"{mla_backend.name} {PRESET} {sc.name} float32"
    start, new = trace["calls"][-1]
    idx = idx.to("cpu", torch.int64)
    if idx.dim() != 3 or idx.shape[0] != sc.batch or idx.shape[1] < int(new.max()):
        raise AssertionError(f"{where}: last_topk_indices has shape {tuple(idx.shape)}, expected "
                             f"[{sc.batch}, >= {int(new.max())}, index_topk]")
    scores = _oracle_scores(sc, dt)
    T = scores.shape[-1]
    tol = TIE_TOL["float32"]
    checked = swaps = 0
    for b in range(sc.batch):
        for i in range(int(new[b])):
            p = int(start[b]) + i
            row = idx[b, i]
            mine = row[row >= 0]
            want = min(TOPK, p + 1)
            if bool((row[row < 0] != -1).any()) or len(mine) != want or len(set(mine.tolist())) != want \
                    or bool((mine > p).any()):
                raise AssertionError(f"{where}: query at position {p} (row {b}) selected {sorted(mine.tolist())} "
                                     f"({len(mine)} keys): expected {want} distinct keys in 0..{p}, unused slots -1")
            s = scores[b, p, :p + 1]
            oracle = set(s.topk(want).indices.tolist())
            diff = set(mine.tolist()) ^ oracle
            if diff:
                kth = float(s.topk(want).values[-1])
                scale = float(s.abs().max())
                off = [k for k in diff if abs(float(s[k]) - kth) > tol * scale]
                if off:
                    alt = _oracle_scores(sc, dt, "interleaved")[b, p, :p + 1]
                    alt_set = set(alt.topk(want).indices.tolist())
                    cause = ("; likely cause: the indexer's RoPE in the interleaved layout -- this selection is the "
                             "top-k of the oracle's scores with interleaved-pair indexer RoPE (DeepSeek's corrected "
                             "V3.2 code and transformers rotate non-interleaved halves)"
                             if len(set(mine.tolist()) ^ alt_set) <= len(diff) // 4 else "")
                    raise AssertionError(
                        f"{where}: query at position {p} (row {b}) selected a different key set from the float64 "
                        f"oracle: keys {sorted(diff)} differ, {sorted(off)} with scores "
                        f"{[round(float(s[k]), 6) for k in off]} not tied with the k-th score {kth:.6f} (tolerance "
                        f"{tol:g} x {scale:.4g}){cause}")
                swaps += len(diff) // 2
            checked += 1
    mla_figures.update(queries_checked=checked, tie_swaps=swaps, index_topk=TOPK, context=T)


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("prefill,decode,batch", [(6, 2, 3)])
def test_cache_bytes_v32_dims(mla_backend, prefill, decode, batch, mla_device, mla_figures):
    """At V3.2's latent dims in BF16 (v3.2-mini: 512 + 64 latent, 128-wide indexer key) a DSA cache holds
    (512 + 64 + 128) x 2 = 1,408 B per stored token, the indexer keys counted: the byte rule of
    checks.cache_bytes, then the format itself (a cache declaring "latent" here under-reports 22 %)."""
    got = checks.cache_bytes(mla_backend, "v3.2-mini", torch.bfloat16, prefill=prefill, decode=decode, batch=batch,
                             capacity=16, device=mla_device, figures=mla_figures)
    config = MLAConfig.preset("v3.2-mini")
    want = (config.latent_dim + config.index_head_dim) * 2
    mla_figures["indexer_bytes_per_token"] = config.index_head_dim * 2
    if got["cache_format"] != "latent+indexer" or got["bytes_per_token"] != want:
        raise AssertionError(
            f"{mla_backend.name} v3.2-mini bfloat16: the cache declares {got['cache_format']!r} and holds "
            f"{got['bytes_per_token']:,} B per stored token; DeepSeek Sparse Attention caches the latent (512 + 64) "
            f"and one indexer key ({config.index_head_dim}) per token: 'latent+indexer', {want:,} B in BF16 "
            f"(buffers: {got['tensors']})")


#: test_indexer_scores cases: (preset, dtype, kv_codec, scenario, tolerance row of checks.TOLERANCES)
SCORE_CASES = {
    "float32-prefill_decode": ("tiny-dsa", "float32", "none", SCENARIOS["prefill_decode"], "indexer-scores float32"),
    "bfloat16-varlen_batch": ("tiny-dsa", "bfloat16", "none", SCENARIOS["varlen_batch"], "indexer-scores bfloat16"),
    "fp8-e4m3-flashmla-prefill_decode": ("v3.2-mini", "bfloat16", "fp8-e4m3-flashmla", SCENARIOS["prefill_decode"],
                                         "indexer-scores fp8-e4m3"),
}


@functools.lru_cache(maxsize=4)
def _score_oracle(preset: str, scenario: Scenario, dtype: torch.dtype, rope_layout: str = "half"):
    """(float64 scores [B, T, T], M [B, T, T] = sum_h |w_h| sum_i |q_hi| |k_ti|, e4m3 subnormal term U [B, T, T],
    allowed [B, T, T]) of the inputs as the backend gets them (rounded to dtype)."""
    w = checks._weights(preset, 0)
    x = checks.inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    lengths = checks.scenario_lengths(scenario)
    B, T, _ = x.shape
    scores = indexer_scores_f64(w, x, lengths, rope_layout=rope_layout)
    q, k, hw = indexer_project(w, x, torch.arange(T).expand(B, T), rope_layout=rope_layout)
    M = torch.einsum("bsh,bshd,btd->bst", hw.abs(), q.abs(), k.abs())

    def half_subnormal_step(v):  # per element: 2 x the block's power-of-two scale x 2^-10 (e4m3 subnormal half-step)
        blk = min(FP8_BLOCK, v.shape[-1])
        amax = v.unflatten(-1, (-1, blk)).abs().amax(-1, keepdim=True).clamp_min(1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        return (2 * scale * 2.0 ** -10).expand(*amax.shape[:-1], blk).flatten(-2)

    uq, uk = half_subnormal_step(q), half_subnormal_step(k)
    e = checks.FP8_E4M3_PRODUCT_ERROR
    U = torch.einsum("bsh,bshd,btd->bst", hw.abs(), uq, k.abs() * (1 + e) + uk) + \
        torch.einsum("bsh,bshd,btd->bst", hw.abs(), q.abs() * (1 + e), uk)
    t = torch.arange(T)
    valid_q = t[None, :] < lengths[:, None]
    allowed = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None]) & valid_q[..., None]
    return scores, M, U, allowed


class _ScoreRecorder(_SelectionRecorder):
    """The backend under test, unchanged, with each attend call's ``last_indexer_scores`` recorded by position."""

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = self._backend.attend(weights, hidden_states, positions, cache, lengths)
        s = None
        for owner in (cache, self._backend):
            s = getattr(owner, "last_indexer_scores", None)
            if s is not None:
                break
        self.calls.append(None if s is None else (positions.cpu(), None if lengths is None else lengths.cpu(),
                                                  s.detach().to("cpu").clone()))
        return out


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_indexer_scores(mla_backend, case, mla_device, mla_figures):
    """The lightning indexer's scores (``last_indexer_scores``, float32 [B, S, T], -inf where the key is masked)
    of every query of every call against the float64 oracle: -inf exactly at the masked keys, and on the rest
    rel_fro and max_rel relative to M = sum_h |w_h| sum_i |q_hi k_ti| within the dtype's ``indexer-scores`` row
    of checks.TOLERANCES (FP8: the e4m3 bound, plus e4m3's subnormal half-steps per element)."""
    preset, dtype_name, kv_codec, sc, row = SCORE_CASES[case]
    dt = checks.DTYPES[dtype_name]
    w = checks.weights_for(preset, dt, mla_device)
    checks.require_support(mla_backend, w.config, dtype=dt, device=mla_device, kv_codec=kv_codec)
    rec = _ScoreRecorder(mla_backend)
    x = checks.inputs_for(w.config, sc)
    checks.run_scenario(rec, w, x, sc, device=mla_device, kv_codec=kv_codec)
    if not rec.calls or any(c is None for c in rec.calls):
        pytest.skip(f"{mla_backend.name}: exposes no last_indexer_scores (optional); its indexer is judged "
                    "through its selection and outputs only")
    where = f"{mla_backend.name} {preset} {sc.name} {dtype_name}{'' if kv_codec == 'none' else ' kv_codec ' + kv_codec}"
    oracle, M, U, allowed = _score_oracle(preset, sc, dt)
    B, T, _ = oracle.shape
    got = torch.full((B, T, T), float("nan"), dtype=torch.float64)
    for positions, lengths, s in rec.calls:
        n = lengths if lengths is not None else torch.full((B,), positions.shape[1])
        if s.dim() != 3 or s.shape[0] != B or s.shape[1] != positions.shape[1] or s.dtype != torch.float32:
            raise AssertionError(f"{where}: last_indexer_scores is {tuple(s.shape)} {s.dtype}, expected float32 "
                                 f"[{B}, {positions.shape[1]}, T] (T = keys cached after the call)")
        K = min(s.shape[-1], T)
        for b in range(B):
            for i in range(int(n[b])):
                p = int(positions[b, i])
                got[b, p, :K] = s[b, i, :K].double()
                got[b, p, K:] = float("-inf")
    valid_q = (torch.arange(T)[None, :] < checks.scenario_lengths(sc)[:, None])[..., None].expand(B, T, T)
    masked = valid_q & ~allowed
    wrong_inf = (masked & ~(got == float("-inf"))) | (allowed & ~torch.isfinite(got))
    if bool(wrong_inf.any()):
        b, p, t = (int(v) for v in wrong_inf.nonzero()[0])
        raise AssertionError(f"{where}: the score of key {t} for the query at position {p} (row {b}) is "
                             f"{float(got[b, p, t])}: expected {'-inf (the key is masked: future or past the row)' if masked[b, p, t] else 'a finite score'}"
                             f" ({int(wrong_inf.sum())} such entries)")
    tol = checks.TOLERANCES[row]
    err = (got - oracle)[allowed]
    m_allowed, u_allowed = M[allowed], (U[allowed] if kv_codec != "none" else torch.zeros_like(M[allowed]))
    rel_fro = float(err.norm() / m_allowed.norm())
    excess = err.abs() - u_allowed
    max_rel = float((excess / m_allowed).max())
    mla_figures.update(rel_fro=rel_fro, max_rel=max_rel, tolerance_rel_fro=tol.rel_fro, tolerance_max_rel=tol.max_rel,
                       scores_checked=int(allowed.sum()), tolerance_row=row,
                       rel_fro_of_scores=float(err.norm() / oracle[allowed].norm()))
    bound_fro = tol.rel_fro * float(m_allowed.norm()) + float(u_allowed.norm())
    if not (float(err.norm()) <= bound_fro and max_rel <= tol.max_rel):
        worst = int(excess.div(m_allowed).argmax())
        b, p, t = (int(v) for v in allowed.nonzero()[worst])
        cause = ""
        alt, M_alt, _, _ = _score_oracle(preset, sc, dt, "interleaved")
        alt_err = float((got - alt)[allowed].norm() / M_alt[allowed].norm())
        if alt_err < rel_fro / 4:
            cause = (f"; likely cause: the indexer's RoPE in the interleaved layout -- the scores match the oracle "
                     f"with interleaved-pair indexer RoPE (rel_fro {alt_err:.3e} vs {rel_fro:.3e}); DeepSeek's corrected "
                     "V3.2 code (2025-11-18) and transformers rotate the indexer's first qk_rope_head_dim dims as "
                     "non-interleaved halves (rotate-half), unlike MLA's interleaved k_pe")
        raise AssertionError(
            f"{where}: indexer scores differ from the float64 oracle beyond the {row!r} tolerance: rel_fro "
            f"{rel_fro:.3e} of M (tolerance {tol.rel_fro:g}), max |error| / M {max_rel:.3e} (tolerance "
            f"{tol.max_rel:g}); worst: key {t} for the query at position {p} (row {b}), score "
            f"{float(got[b, p, t]):.6g} vs {float(oracle[b, p, t]):.6g}{cause}")
