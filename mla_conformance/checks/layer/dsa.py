"""Checks of DeepSeek Sparse Attention (V3.2) through the layer contract, for suites/test_dsa.py (its docstring
states the rules): the output against the float64 sparse oracle where the oracle's selection is certain at the
declared indexer precision (and over the backend's own selection where it exposes one), DSA == dense MLA at
len <= index_topk, the exposed selection (``last_topk_indices``) and indexer scores (``last_indexer_scores``)
against the oracle's, and the cache bytes at V3.2's dims. The indexer oracles: mla_conformance.model.dsa_reference.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mla_conformance.checks.layer.bytes import INDEXER_FORMATS, cache_bytes, indexer_format_of
from mla_conformance.checks.layer.driver import (Scenario, inputs_for, master_weights, require_support, run_scenario,
                                           scenario_lengths, weights_for)
from mla_conformance.checks.layer.numerics import rows_failure
from mla_conformance.checks.metrics import DTYPES, dtype_name, error_metrics, row_metrics
from mla_conformance.checks.tolerances import FP8_E4M3_PRODUCT_ERROR, TOLERANCES, tolerance_figures
from mla_conformance.messages import bound_line, failure, num, over, times
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.dsa_reference import indexer_score_oracle
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.dsa_reference import indexer_rope_layout, other_rope_layout, sparse_attention_f64


def _topk(preset: str) -> int:
    return MLAConfig.preset(preset).index_topk


def indexer_row(indexer_format: str, dtype: torch.dtype) -> str:
    """The ``indexer-scores`` row of TOLERANCES for an indexer stored as ``indexer_format`` in a run at
    ``dtype``: FP8 block-128 -> the e4m3 row; a bf16 key, or a bf16 / fp16 run -> the bf16 row (fp16 rounds
    finer); else float32 (a float64 run is held to the float32 row too: the scores are float32 by contract)."""
    if indexer_format == "fp8-e4m3-block128":
        return "indexer-scores fp8-e4m3"
    if indexer_format == "bf16" or dtype in (torch.bfloat16, torch.float16):
        return "indexer-scores bfloat16"
    return "indexer-scores float32"


def _boundary(preset: str, offset: int, mode: str) -> Scenario:
    """Row 0 ends at index_topk + offset tokens; "varlen" adds shorter rows (and one decode step)."""
    n = _topk(preset) + offset
    if mode == "varlen":
        return Scenario(f"topk{offset:+d}_varlen", (n - 1, n - 2, n - 9), decode_steps=1)
    return Scenario(f"topk{offset:+d}_{mode}", (n,) if mode == "prefill" else (n - 4,),
                    decode_steps=0 if mode == "prefill" else 4)


def _x64(preset: str, scenario: Scenario, dtype: torch.dtype) -> torch.Tensor:
    """The scenario's inputs as the backend gets them (rounded to dtype), in float64."""
    w = master_weights(preset, 0)
    return inputs_for(w.config, scenario).to(dtype).to(torch.float64)


@functools.lru_cache(maxsize=32)
def _oracle(preset: str, scenario: Scenario, dtype: torch.dtype, dense: bool,
            rope_layout: str | None = None) -> torch.Tensor:
    """The float64 oracle (dense MLA, or DSA with the indexer RoPE in ``rope_layout``, None = the config's)."""
    w = master_weights(preset, 0)
    x, lengths = _x64(preset, scenario, dtype), scenario_lengths(scenario)
    if dense:
        return reference_attention_f64(w, x, lengths)
    return sparse_attention_f64(w, x, lengths, rope_layout=rope_layout)


@functools.lru_cache(maxsize=16)
def _score_oracle(preset: str, scenario: Scenario, dtype: torch.dtype, rope_layout: str | None = None):
    """(float64 scores [B, T, T], M [B, T, T] = sum_h |w_h| sum_i |q_hi| |k_ti|, e4m3 subnormal term U [B, T, T],
    allowed [B, T, T]) of the inputs as the backend gets them (rounded to dtype); ``rope_layout`` None: the
    config's."""
    w = master_weights(preset, 0)
    x, lengths = _x64(preset, scenario, dtype), scenario_lengths(scenario)
    return indexer_score_oracle(w, x, lengths, product_error=FP8_E4M3_PRODUCT_ERROR, rope_layout=rope_layout)


def _score_bound(preset: str, scenario: Scenario, dtype: torch.dtype, row: str) -> torch.Tensor:
    """[B, T, T]: how far a conforming backend's score of each key may lie from the oracle's (the row's max_rel x
    M, plus e4m3's subnormal term for the FP8 row): what test_indexer_scores holds exposed scores to."""
    _, M, U, _ = _score_oracle(preset, scenario, dtype)
    bound = TOLERANCES[row].max_rel * M
    return bound + U if row == "indexer-scores fp8-e4m3" else bound


@functools.lru_cache(maxsize=32)
def _uncertain(preset: str, scenario: Scenario, dtype: torch.dtype, row: str) -> torch.Tensor:
    """[B, T] bool: queries whose oracle selection is not certain at the indexer precision of ``row``: some key
    the oracle selects (j) and one it drops (k) have s_j - s_k <= e_j + e_k (e: _score_bound), so a conforming
    backend may keep k instead of j (ReLU also makes exact-zero ties common: every head negative). Which of them
    a backend keeps is its own choice (test_selection allows exactly those swaps), so on those queries its output
    is compared over its own selection only."""
    scores, _, _, allowed = _score_oracle(preset, scenario, dtype)
    bound = _score_bound(preset, scenario, dtype, row)
    K = _topk(preset)
    B, T, _ = scores.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for p in range(K, T):
            s, e, ok = scores[b, p, :p + 1], bound[b, p, :p + 1], allowed[b, p, :p + 1]
            if not bool(ok.all()):
                continue
            sel = torch.zeros(p + 1, dtype=torch.bool)
            sel[s.topk(K).indices] = True
            out[b, p] = bool(float((s - e)[sel].min()) <= float((s + e)[~sel].max()))
    return out


def _layout_cause(preset: str) -> tuple[str, str]:
    """(the other indexer RoPE layout, a sentence naming it as the likely cause) for the config's layout."""
    layout = indexer_rope_layout(MLAConfig.preset(preset))
    other = other_rope_layout(layout)
    if other == "interleaved":
        return other, ("the indexer's RoPE in the interleaved layout -- {detail}; this config is DeepSeek-V3.2's "
                       "(indexer_rope_interleave false): DeepSeek's corrected V3.2 code (2025-11-18) and transformers "
                       "rotate the indexer's first qk_rope_head_dim dims as non-interleaved halves (rotate-half), "
                       "unlike MLA's interleaved k_pe")
    return other, ("the indexer's RoPE in the half-split (rotate-half) layout -- {detail}; this config declares "
                   "indexer_rope_interleave true (GLM-5's DSA): its indexer rotates interleaved pairs, as MLA's k_pe")


def _layout_hint(out, ref, preset, scenario, dtype, valid) -> str:
    """'; likely cause: ...' when most tokens match the sparse oracle with the other indexer RoPE layout and
    fewer match the correct one."""
    other, sentence = _layout_cause(preset)
    alt = _oracle(preset, scenario, dtype, False, other)
    tol = TOLERANCES[dtype_name(dtype)]

    def matching(oracle):
        rms = float(oracle[valid].pow(2).mean().sqrt())
        return float(((out - oracle).abs().amax(-1)[valid] <= tol.max_rel * rms).double().mean())

    alt_share, share = matching(alt), matching(ref)
    if alt_share >= 0.9 and alt_share > share:
        return "; likely cause: " + sentence.format(
            detail=f"{alt_share:.0%} of the compared tokens match the sparse oracle with that layout ({share:.0%} the "
                   "correct one)")
    return ""


def _run(backend, preset, scenario, dtype, device, trace=None):
    w = weights_for(preset, dtype, device)
    require_support(backend, w.config, dtype=dtype, device=device)
    x = inputs_for(w.config, scenario)
    out, cache = run_scenario(backend, w, x, scenario, device=device, trace=trace)
    return out, cache


def _compare(backend, out, ref, preset, scenario, dtype, what, figures, valid=None, dense=False, hint=True):
    """Row by row: out vs ref over ``valid`` [B, T] (default: every token of every row) to the dtype's tolerance."""
    __tracebackhide__ = True
    lengths = scenario_lengths(scenario)
    in_row = torch.arange(out.shape[1])[None, :] < lengths[:, None]
    valid = in_row if valid is None else valid & in_row
    m = error_metrics(out[valid], ref[valid])
    tol = TOLERANCES[dtype_name(dtype)]
    figures.update(m)
    figures.update(tolerance_figures(tol))
    K = _topk(preset)
    for b in range(scenario.batch):
        keep = valid[b].nonzero().flatten()
        if not len(keep):
            continue
        mb = row_metrics(out[b, keep], ref[b, keep])
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            worst = int(keep[int((out[b, keep] - ref[b, keep]).abs().amax(-1).argmax())])
            cause = (f"at len <= index_topk ({K}) every causal key must be selected: a top-k that keeps fewer "
                     "(an off-by-one at the boundary) or a selection that ignores the causal length drops keys"
                     if dense else f"index_topk {K}: keys selected other than the oracle's change the output")
            layout = _layout_hint(out, ref, preset, scenario, dtype, valid) if hint and not dense else ""
            raise AssertionError(rows_failure(
                f"{backend.name} {preset} {scenario.name} {dtype_name(dtype)}: row {b} differs from {what}", mb, tol,
                f"worst token at position {worst} of {int(lengths[b])}", f"{len(keep)} compared tokens; {cause}",
                cause=layout, key=f'TOLERANCES["{dtype_name(dtype)}"]'))
    return m


def _last(owner_names, backend, cache):
    for owner in (cache, backend):
        for name in owner_names:
            value = getattr(owner, name, None)
            if value is not None:
                return value
    return None


class _SelectionRecorder:
    """The backend under test, unchanged, with each attend call's ``last_topk_indices`` (when it exposes one)
    recorded with the call's positions and lengths: what the oracle over the backend's own selection needs."""

    attr = "last_topk_indices"

    def __init__(self, backend):
        self._backend, self.name, self.calls = backend, backend.name, []

    def __getattr__(self, attr):
        return getattr(self._backend, attr)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = self._backend.attend(weights, hidden_states, positions, cache, lengths)
        got = _last((self.attr,), self._backend, cache)
        self.calls.append(None if got is None else (positions.cpu(), None if lengths is None else lengths.cpu(),
                                                    got.detach().to("cpu").clone()))
        return out

    def exposed(self) -> bool:
        return bool(self.calls) and all(c is not None for c in self.calls)

    def queries(self, B):
        """(b, call's row index i, position p, the call's tensor row) of every valid query of every call."""
        for positions, lengths, got in self.calls:
            n = lengths if lengths is not None else torch.full((B,), positions.shape[1])
            for b in range(B):
                for i in range(int(n[b])):
                    yield b, i, int(positions[b, i]), got

    def selection(self, B, T):
        """[B, T, K] selection by query position, or None when a call exposed none."""
        if not self.exposed():
            return None
        K = max(c[2].shape[-1] for c in self.calls)
        full = torch.full((B, T, K), -1, dtype=torch.int64)
        for b, i, p, idx in self.queries(B):
            full[b, p, :idx.shape[-1]] = idx[b, i].to(torch.int64)
        return full


def _declared_row(backend, cache, dtype) -> tuple[str, str]:
    """(indexer_format the run's cache / backend declares, its indexer-scores row at dtype)."""
    fmt = indexer_format_of(backend, cache)
    return fmt, indexer_row(fmt, dtype)


def judge_sparse(backend, preset, sc, dt, device, figures):
    """The sparse output: over the backend's own selection on every query (where exposed), and against the
    oracle's selection on the queries whose oracle selection is certain at the declared indexer precision."""
    __tracebackhide__ = True
    rec = _SelectionRecorder(backend)
    out, cache = _run(rec, preset, sc, dt, device)
    fmt, row = _declared_row(backend, cache, dt)
    uncertain = _uncertain(preset, sc, dt, row)
    lengths = scenario_lengths(sc)
    valid = torch.arange(out.shape[1])[None, :] < lengths[:, None]
    n_uncertain = int((uncertain & valid).sum())
    figures.update(indexer_format=fmt, tie_row=row, tied_queries_not_compared=n_uncertain,
                   queries=int(valid.sum()))
    own = rec.selection(sc.batch, out.shape[1])
    if own is None:
        for b in range(sc.batch):
            n, kept = int(valid[b].sum()), int((valid[b] & ~uncertain[b]).sum())
            if kept * 2 < n:
                pytest.skip(f"{backend.name} {preset} {sc.name} {dtype_name(dt)}: at the precision of its "
                            f"indexer (indexer_format {fmt!r}, the {row!r} bound) {n - kept} of row {b}'s {n} queries "
                            "have an uncertain oracle selection, and the backend exposes no last_topk_indices "
                            "(optional): its output cannot be judged here; expose last_topk_indices to be judged "
                            "over its own selection")
    _compare(backend, out, _oracle(preset, sc, dt, False), preset, sc, dt,
             "the float64 sparse oracle (queries with a certain selection)", figures, valid=~uncertain)
    if own is not None:
        w = master_weights(preset, 0)
        ref = sparse_attention_f64(w, _x64(preset, sc, dt), lengths, indices=own)
        own_figures: dict = {}
        _compare(backend, out, ref, preset, sc, dt, "the float64 sparse oracle over the backend's own selection "
                 "(every query)", own_figures, hint=False)
        figures["own_selection_rel_fro"] = own_figures["rel_fro"]
        figures["own_selection_queries"] = int(valid.sum())
    return out


def check_short_context_is_dense(backend, preset: str, offset: int, mode: str, dt: torch.dtype, device,
                                 figures: dict) -> None:
    """len <= index_topk: every key is selected, DSA == dense MLA (float64 dense reference); at
    index_topk + 1 the sparse oracle (the last query drops one key)."""
    __tracebackhide__ = True
    sc = _boundary(preset, offset, mode)
    if offset > 0:
        judge_sparse(backend, preset, sc, dt, device, figures)
        return
    out, _ = _run(backend, preset, sc, dt, device)
    _compare(backend, out, _oracle(preset, sc, dt, True), preset, sc, dt,
             "dense MLA (len <= index_topk selects every key)", figures, dense=True)


def check_selection(backend, preset: str, sc: Scenario, dt: torch.dtype, device, figures: dict) -> None:
    """The backend's selection (``last_topk_indices`` of every attend call) is the oracle's top-min(k, len) set
    per query, a kept key swapped for a dropped one only where their oracle scores lie within the declared
    indexer precision's bound (e_j + e_k); unused slots -1."""
    __tracebackhide__ = True
    rec = _SelectionRecorder(backend)
    _, cache = _run(rec, preset, sc, dt, device)
    if not rec.exposed():
        pytest.skip(f"{backend.name}: exposes no last_topk_indices (optional); its selection is judged "
                    "through the outputs only")
    fmt, row = _declared_row(backend, cache, dt)
    where = f"{backend.name} {preset} {sc.name} {dtype_name(dt)}"
    K = _topk(preset)
    for positions, lengths, idx in rec.calls:
        n = int(positions.shape[1] if lengths is None else lengths.max())
        if idx.dim() != 3 or idx.shape[0] != sc.batch or idx.shape[1] < n or idx.dtype.is_floating_point:
            raise AssertionError(f"{where}: last_topk_indices is {tuple(idx.shape)} {idx.dtype}, expected integer "
                                 f"[{sc.batch}, >= {n}, index_topk]")
    scores, _, _, _ = _score_oracle(preset, sc, dt)
    bound = _score_bound(preset, sc, dt, row)
    checked = swaps = 0
    for b, i, p, idx in rec.queries(sc.batch):
        row_idx = idx[b, i].to(torch.int64)
        mine = row_idx[row_idx >= 0]
        want = min(K, p + 1)
        if bool((row_idx[row_idx < 0] != -1).any()) or len(mine) != want or len(set(mine.tolist())) != want \
                or bool((mine > p).any()):
            raise AssertionError(f"{where}: query at position {p} (row {b}) selected {sorted(mine.tolist())} "
                                 f"({len(mine)} keys): expected {want} distinct keys in 0..{p}, unused slots -1")
        s, e = scores[b, p, :p + 1], bound[b, p, :p + 1]
        oracle = set(s.topk(want).indices.tolist())
        kept, dropped = set(mine.tolist()) - oracle, oracle - set(mine.tolist())
        off = [(j, k) for j in sorted(dropped) for k in sorted(kept) if float(s[j] - s[k]) > float(e[j] + e[k])]
        if off:
            other, sentence = _layout_cause(preset)
            alt = _score_oracle(preset, sc, dt, other)[0][b, p, :p + 1]
            alt_set = set(alt.topk(want).indices.tolist())
            n_diff = len(kept) + len(dropped)
            cause = ("; likely cause: " + sentence.format(
                detail=f"this selection is {len(set(mine.tolist()) ^ alt_set)} keys from the top-k of the oracle's "
                       f"scores with that layout, {n_diff} from the correct one")
                     if len(set(mine.tolist()) ^ alt_set) <= n_diff // 4 else "")
            j, k = off[0]
            raise AssertionError(failure(
                f"{where}: query at position {p} (row {b}) selected a different key set from the float64 oracle: "
                f"score gap {over(float(s[j] - s[k]), float(e[j] + e[k]))} (key {k} kept over key {j})",
                f"it keeps {sorted(kept)} and drops {sorted(dropped)}; {len(off)} swap(s) beyond the indexer's "
                f"precision; oracle scores: key {k} {float(s[k]):.6g}, key {j} {float(s[j]):.6g}",
                bound_line(f'TOLERANCES["{row}"]', f"max_rel x M of both keys; indexer_format {fmt!r}"),
                cause=cause))
        swaps += len(kept)
        checked += 1
    figures.update(queries_checked=checked, tie_swaps=swaps, index_topk=K, context=scores.shape[-1],
                   indexer_format=fmt, tie_row=row)


def check_cache_bytes_v32_dims(backend, prefill: int, decode: int, batch: int, device, figures: dict) -> None:
    """At V3.2's latent dims in BF16 (v3.2-mini: 512 + 64 latent, 128-wide indexer key) a DSA cache is
    'latent+indexer' and holds, measured, its declared indexer storage's bytes per stored token (the measurement
    itself is cache_bytes's)."""
    __tracebackhide__ = True
    got = cache_bytes(backend, "v3.2-mini", torch.bfloat16, prefill=prefill, decode=decode, batch=batch,
                      capacity=16, device=device, figures=figures)
    if got["cache_format"] != "latent+indexer":
        config = MLAConfig.preset("v3.2-mini")
        raise AssertionError(
            f"{backend.name} v3.2-mini bfloat16: the cache declares {got['cache_format']!r} and holds, measured, "
            f"{got['measured_bytes_per_token']:,} B per stored token; DeepSeek Sparse Attention caches the latent "
            f"(512 + 64) and one indexer key ({config.index_head_dim}) per token: declare 'latent+indexer' and its "
            f"indexer_format (one of {', '.join(INDEXER_FORMATS)}) (buffers: {got['tensors']})")
    assert got["measured_bytes_per_token"] == got["formula_bytes_per_token"]  # cache_bytes raised with the cause


def check_indexer_scores(backend, preset: str, dtype_label: str, kv_codec: str, sc: Scenario, device,
                         figures: dict) -> None:
    """The lightning indexer's scores (``last_indexer_scores``, float32 [B, S, T], -inf where the key is masked)
    of every query of every call against the float64 oracle: -inf exactly at the masked keys, and on the rest
    rel_fro and max_rel relative to M = sum_h |w_h| sum_i |q_hi k_ti| within the ``indexer-scores`` row of
    TOLERANCES of the indexer the backend declares (FP8 block-128: the e4m3 bound, plus e4m3's subnormal
    half-steps per element)."""
    __tracebackhide__ = True
    dt = DTYPES[dtype_label]
    w = weights_for(preset, dt, device)
    require_support(backend, w.config, dtype=dt, device=device, kv_codec=kv_codec)
    rec = _SelectionRecorder(backend)
    rec.attr = "last_indexer_scores"
    x = inputs_for(w.config, sc)
    _, cache = run_scenario(rec, w, x, sc, device=device, kv_codec=kv_codec)
    if not rec.exposed():
        pytest.skip(f"{backend.name}: exposes no last_indexer_scores (optional); its indexer is judged "
                    "through its selection and outputs only")
    fmt = indexer_format_of(backend, cache, kv_codec)
    row = indexer_row(fmt, dt)
    fp8 = row == "indexer-scores fp8-e4m3"
    where = (f"{backend.name} {preset} {sc.name} {dtype_label}{'' if kv_codec == 'none' else ' kv_codec ' + kv_codec}"
             f" indexer_format {fmt!r}")
    oracle, M, U, allowed = _score_oracle(preset, sc, dt)
    B, T, _ = oracle.shape
    got = torch.full((B, T, T), float("nan"), dtype=torch.float64)
    for positions, lengths, s in rec.calls:
        if s.dim() != 3 or s.shape[0] != B or s.shape[1] != positions.shape[1] or s.dtype != torch.float32:
            raise AssertionError(f"{where}: last_indexer_scores is {tuple(s.shape)} {s.dtype}, expected float32 "
                                 f"[{B}, {positions.shape[1]}, T] (T = keys cached after the call)")
    for b, i, p, s in rec.queries(B):
        K = min(s.shape[-1], T)
        got[b, p, :K] = s[b, i, :K].double()
        got[b, p, K:] = float("-inf")
    valid_q = (torch.arange(T)[None, :] < scenario_lengths(sc)[:, None])[..., None].expand(B, T, T)
    masked = valid_q & ~allowed
    wrong_inf = (masked & ~(got == float("-inf"))) | (allowed & ~torch.isfinite(got))
    if bool(wrong_inf.any()):
        b, p, t = (int(v) for v in wrong_inf.nonzero()[0])
        raise AssertionError(f"{where}: the score of key {t} for the query at position {p} (row {b}) is "
                             f"{float(got[b, p, t])}: expected {'-inf (the key is masked: future or past the row)' if masked[b, p, t] else 'a finite score'}"
                             f" ({int(wrong_inf.sum())} such entries)")
    tol = TOLERANCES[row]
    err = (got - oracle)[allowed]
    m_allowed, u_allowed = M[allowed], (U[allowed] if fp8 else torch.zeros_like(M[allowed]))
    rel_fro = float(err.norm() / m_allowed.norm())
    excess = err.abs() - u_allowed
    max_rel = float((excess / m_allowed).max())
    figures.update(rel_fro=rel_fro, max_rel=max_rel, tolerance_rel_fro=tol.rel_fro, tolerance_max_rel=tol.max_rel,
                   scores_checked=int(allowed.sum()), tolerance_row=row, indexer_format=fmt,
                   rel_fro_of_scores=float(err.norm() / oracle[allowed].norm()))
    bound_fro = tol.rel_fro * float(m_allowed.norm()) + float(u_allowed.norm())
    if not (float(err.norm()) <= bound_fro and max_rel <= tol.max_rel):
        worst = int(excess.div(m_allowed).argmax())
        b, p, t = (int(v) for v in allowed.nonzero()[worst])
        cause = ""
        other, sentence = _layout_cause(preset)
        alt, M_alt, _, _ = _score_oracle(preset, sc, dt, other)
        alt_err = float((got - alt)[allowed].norm() / M_alt[allowed].norm())
        if alt_err < rel_fro / 4:
            cause = "; likely cause: " + sentence.format(
                detail=f"the scores match the oracle with that layout (rel_fro {alt_err:.3e} vs {rel_fro:.3e})")
        fro_over = float(err.norm()) / bound_fro if bound_fro else float("inf")
        raise AssertionError(failure(
            f"{where}: indexer scores differ from the float64 oracle: "
            + (f"max |error| / M {over(max_rel, tol.max_rel)}" if max_rel / tol.max_rel >= fro_over else
               f"rel_fro of M {num(rel_fro)} vs bound {num(bound_fro / float(m_allowed.norm()))}, {times(fro_over)} over")
            + f" (key {t}, query at position {p}, row {b})",
            f"got {float(got[b, p, t]):.6g}, expected {float(oracle[b, p, t]):.6g}; rel_fro {rel_fro:.3e} of M "
            f"(tolerance {tol.rel_fro:g}), max |error| / M {max_rel:.3e} (tolerance {tol.max_rel:g})",
            bound_line(f'TOLERANCES["{row}"]'), cause=cause))
