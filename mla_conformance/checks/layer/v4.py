"""DeepSeek-V4 attention through the layer contract: outputs against the float64 V4 oracle
(:mod:`mla_conformance.model.v4_reference`) per layer type, dtype and scenario, with the likely cause of a failure
named from the oracles of known bugs; and the bytes of the V4 cache per component, measured from its tensors.

A backend opts in with ``deepseek_v4 = True`` (others skip, naming the declaration). The scenarios run on the
``v4-tiny`` model (window 8, CSA every 4 tokens with top-3, HCA every 16), so that a few dozen tokens cross the
window, several compressed entries and the indexer's choice, and on ``v4-mini`` (V4's own widths: head_dim 512,
window 128, ratios 4 / 128) for the bytes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mla_conformance.checks.layer.driver import Scenario, inputs_for, require_support, run_scenario, scenario_lengths
from mla_conformance.checks.layer.numerics import check_rows
from mla_conformance.checks.metrics import dtype_name, error_metrics
from mla_conformance.errors import BackendSpecError
from mla_conformance.kv import model1
from mla_conformance.kv.caches.measure import written_bytes, written_masks
from mla_conformance.messages import failure, times
from mla_conformance.model.v4_config import CSA, HCA, SHORT, SLIDING, TINY_LAYERS, V4Weights, v4_config
from mla_conformance.model.v4_reference import EXACT, Variant, v4_attention_f64

#: scenario -> what it holds a backend to (suites/test_deepseek_v4.py's docstring says why these)
V4_SCENARIOS = {
    # one call: the window, every closed entry, the indexer's choice among up to 10 CSA entries, 2 HCA entries
    "prefill": Scenario("v4_prefill", (40,)),
    # 21 tokens, then 12 single-token steps: entries close during decode (at 24, 28, 32 for CSA; 32 for HCA)
    "prefill_decode": Scenario("v4_prefill_decode", (21,), decode_steps=12),
    # chunks of 6: every chunk boundary but one falls inside a CSA window of 4 and inside an HCA window of 16
    "chunked_prefill": Scenario("v4_chunked_prefill", (45,), chunk=6),
    # rows at different lengths in one call (right padding), then decode steps on all of them
    "varlen_batch": Scenario("v4_varlen_batch", (40, 27, 9), decode_steps=3),
    # rows that start late and idle in between (a batch of generations padded on the left, joined mid-run)
    "late_rows": Scenario.of_calls("v4_late_rows", ((13, 0, 5), (6, 12, 0), (1, 1, 1), (1, 1, 0), (1, 0, 1),
                                                    (1, 1, 1))),
    # past the window and past several compressed entries of both kinds: 70 tokens in chunks of 32 + decode
    "long": Scenario("v4_long", (70,), decode_steps=4, chunk=32),
}

#: The indexer's selection is compared only where it is certain at the backend's precision: a query whose
#: k-th and (k+1)-th visible entries score within this fraction of M (the scale of the scores' rounding errors:
#: sum_i |w_i| sum_c |q_ic k_c|) may legitimately pick either, so its output is not compared (counted in the
#: figures as tied_queries_not_compared). float32: ~100 roundings of u = 6e-8 in a score, 1e-4 leaves room;
#: bfloat16 / float16: the weights and inputs rounded at u = 2^-8 / 2^-11 move a score by ~u x M: 5x that.
SELECTION_MARGIN = {"float64": 1e-9, "float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}

#: known bugs: name -> (the oracle with that bug, the sentence a failure names, layer types it applies to)
LIKELY_CAUSES: dict[str, tuple[Variant, str, tuple[str, ...]]] = {
    "rope-leading": (Variant(rope_slice="leading"), "RoPE on the leading qk_rope_head_dim dims: V4 rotates the "
                     "trailing ones (x[..., -rope:]; transformers' DeepseekV4Attention docstring says 'first', its "
                     "code rotates the trailing slice)", (SLIDING, CSA, HCA)),
    "no-rotate-back": (Variant(rotate_back=False), "the output's rope slice not rotated back: K = V carries RoPE "
                       "into the output, which V4 undoes with the conjugate rotation at the query's position before "
                       "o_a_proj", (SLIDING, CSA, HCA)),
    "no-sink": (Variant(sink=False), "the attention sink not in the softmax denominator alone (dropped, or added "
                "to every score / the numerator, where it cancels): p = exp(z) / (sum exp(z) + exp(sink_h))",
                (SLIDING, CSA, HCA)),
    "window+1": (Variant(window_delta=1), "the sliding window one token too wide: sliding_window + 1 tokens "
                 "(t >= p - sliding_window); V4's is the query and the sliding_window - 1 tokens before it", (SLIDING, CSA, HCA)),
    "window-1": (Variant(window_delta=-1), "the sliding window one token too narrow: sliding_window - 1 "
                 "tokens; V4's is the query and the sliding_window - 1 tokens before it (t > p - sliding_window)", (SLIDING, CSA, HCA)),
    "entry-early": (Variant(entry_early=True), "a compressed entry visible before its window closed: entry j "
                    "(tokens j*m .. j*m+m-1) is visible to query p only when (j+1)*m <= p+1", (CSA, HCA)),
    "overlap-swapped": (Variant(overlap_swapped=True), "CSA's overlapping compressor halves misaligned: an entry "
                        "takes the previous window's first head_dim projections (Ca) and its own window's second "
                        "(Cb)", (CSA,)),
    "entry-rope-last": (Variant(entry_rope="last"), "compressed entries rotated at the wrong position (their "
                        "window's last token; V4 rotates entry j at j*m, its window's first)", (CSA, HCA)),
    "entry-rope-main-theta": (Variant(entry_rope="main-theta"), "compressed entries rotated with the main "
                              "rope_theta without YaRN (V4's compressed path uses compress_rope_theta with YaRN)",
                              (CSA, HCA)),
    "rope-mscale": (Variant(rope_mscale=True), "cos / sin of the compressed layers' YaRN RoPE multiplied by YaRN's "
                    "mscale (0.1 ln(factor) + 1): V4 leaves them unscaled (transformers' DeepseekV4Config forces "
                    "attention_factor 1.0 for that reason)", (CSA, HCA)),
    "scale-mscale": (Variant(scale_mscale=True), "the softmax scale multiplied by YaRN's mscale^2 (DeepSeek-V3's "
                     "rule): V4's is head_dim^-0.5", (CSA, HCA)),
    "no-q-head-norm": (Variant(q_head_norm=False), "the query's per-head RMSNorm (unweighted, after q_b_proj) left "
                       "out", (SLIDING, CSA, HCA)),
    "groups-interleaved": (Variant(groups_interleaved=True), "the grouped output projection's groups taken as "
                           "interleaved heads (i, i + g, ...): group i is the contiguous heads i*H/g .. (i+1)*H/g - 1",
                           (SLIDING, CSA, HCA)),
    "no-ape": (Variant(ape=False), "the compressor's position bias (position_bias / ape) left out of its gate",
               (CSA, HCA)),
    "csa-no-overlap": (Variant(csa_overlap=False), "CSA entries without the previous window's half: CSA's "
                       "compressor windows overlap (2 x ratio slots, stride ratio)", (CSA,)),
    "indexer-no-relu": (Variant(indexer_relu=False), "the lightning indexer scores without the ReLU: "
                        "sum_h w_h ReLU(q_h . k)", (CSA,)),
    "indexer-no-weights": (Variant(indexer_weights=False), "the lightning indexer scores without its per-head "
                           "weights (weights_proj(x) x index_head_dim^-0.5 x index_n_heads^-0.5)", (CSA,)),
}


# --------------------------------------------------------------------------- weights, inputs, oracles

@functools.lru_cache(maxsize=16)
def master_weights(preset: str, layer_type: str, seed: int = 0) -> V4Weights:
    """The float64 weights the oracle uses (one model per preset: each layer type is one of its layers)."""
    return V4Weights.random(v4_config(preset, layer_type), seed=seed, dtype=torch.float64)


@functools.lru_cache(maxsize=32)
def weights_for(preset: str, layer_type: str, dtype: torch.dtype, device: str = "cpu") -> V4Weights:
    return master_weights(preset, layer_type).to(dtype, device=device).clone()


@functools.lru_cache(maxsize=64)
def oracle(preset: str, layer_type: str, scenario_name: str, dtype: torch.dtype, variant: Variant = EXACT):
    """The float64 oracle of a scenario's inputs rounded to ``dtype`` (outputs [B, T, hidden], row traces)."""
    sc = V4_SCENARIOS[scenario_name]
    w = master_weights(preset, layer_type)
    x = inputs_for(w.config, sc).to(dtype).to(torch.float64)
    return v4_attention_f64(w, x, scenario_lengths(sc), variant)


def selection_watch(backend, batch: int):
    """(picks, watch): ``watch`` for run_scenario, collecting each call's CSA selection where the cache (or the
    backend) exposes ``last_topk_indices`` (int64 [B, S, k] entry indices of each query of the last call, -1
    unused) into ``picks[(row, position)]`` (the indices)."""
    picks: dict[tuple[int, int], torch.Tensor] = {}

    def watch(cache, lengths, where):
        start = cache.seq_lens.detach().to("cpu").clone()
        n = lengths.detach().to("cpu").clone()

        def after():
            sel = getattr(cache, "last_topk_indices", None)
            sel = getattr(backend, "last_topk_indices", None) if sel is None else sel
            if not isinstance(sel, torch.Tensor):
                return
            sel = sel.detach().to("cpu").long()
            for b in range(batch):
                for i in range(int(n[b])):
                    picks[(b, int(start[b]) + i)] = sel[b, i][sel[b, i] >= 0]
        return after
    return picks, watch


def own_selection_oracle(w64, x64, lengths, traces, picks, dtype, store=None):
    """Where the backend exposed its selection: the oracle over *its* selection for each query that chose
    otherwise among near ties (every entry it kept that the oracle dropped scores within 2 x SELECTION_MARGIN x M
    of every entry the oracle kept that it dropped), and the queries whose choice is beyond that bound (a wrong
    selection: (row, position, kept, dropped)). None when nothing differs or nothing was exposed."""
    if not picks or all(tr.scores is None for tr in traces):
        return None, []
    bound_rel = 2 * SELECTION_MARGIN[dtype_name(dtype)]
    selections, wrong, differs = [], [], False
    for b, tr in enumerate(traces):
        if tr.scores is None:
            selections.append(None)
            continue
        sel = tr.attended.clone()
        L, N = sel.shape
        for p in range(L):
            own = picks.get((b, p))
            if own is None:
                continue
            mask = torch.zeros(N, dtype=torch.bool)
            mask[own[own < N]] = True
            if torch.equal(mask, tr.attended[p]):
                continue
            kept, dropped = mask & ~tr.attended[p], tr.attended[p] & ~mask
            s = tr.scores[p]
            gap = (s[dropped].max() if dropped.any() else -torch.inf) - (s[kept].min() if kept.any() else torch.inf)
            if (kept & ~torch.isfinite(s)).any() or gap > bound_rel * float(tr.scale[p]):
                wrong.append((b, p, kept.nonzero().flatten().tolist(), dropped.nonzero().flatten().tolist()))
            sel[p] = mask
            differs = True
        selections.append(sel)
    if not differs:
        return None, []
    return v4_attention_f64(w64, x64, lengths, store=store, selections=selections)[0], wrong


def _selection_failure(where, wrong) -> str:
    b, p, kept, dropped = wrong[0]
    return (f"{where}: the lightning indexer's selection differs from the oracle's beyond the tie bound at row {b}, "
            f"position {p}: it attends entries {kept} where the oracle's top-k has {dropped}"
            f"{f' (and {len(wrong) - 1} more queries)' if len(wrong) > 1 else ''}")


def _certain(traces, lengths, T: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T]: the queries whose outputs are compared (not a near tie of the indexer's top-k)."""
    keep = torch.zeros(len(traces), T, dtype=torch.bool)
    for b, tr in enumerate(traces):
        n = int(lengths[b])
        keep[b, :n] = True if tr.margin is None else tr.margin > SELECTION_MARGIN[dtype_name(dtype)]
    return keep


# --------------------------------------------------------------------------- numerics

def judge(backend, layer: str, scenario_name: str, dtype: torch.dtype, device="cpu",
          figures: dict | None = None) -> dict[str, float]:
    """The backend's outputs on a V4 scenario against the float64 oracle, row by row, within the dtype's row
    tolerance (checks.tolerances.row_tolerance); a failure names the likely cause where one known bug's oracle
    matches the output far better than V4's."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    preset, layer_type = TINY_LAYERS[layer]
    w = weights_for(preset, layer_type, dtype, str(device))
    require_support(backend, w.config, dtype=dtype, device=device)
    sc = V4_SCENARIOS[scenario_name]
    x = inputs_for(w.config, sc)
    picks, watch = selection_watch(backend, sc.batch)
    out, _ = run_scenario(backend, w, x, sc, device=device, watch=watch)
    lengths = scenario_lengths(sc)
    ref, traces = oracle(preset, layer_type, scenario_name, dtype)
    where = f"{backend.name} DeepSeek-V4 {SHORT[layer_type]} layer ({preset}) {scenario_name} {dtype_name(dtype)}"
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    ref, keep = _judged_reference(
        master_weights(preset, layer_type), x, dtype, lengths, ref, traces, picks, where, figures,
        cause=lambda: likely_cause(out, valid, preset, layer_type, scenario_name, dtype, figures=figures,
                                   correct=error_metrics(out[valid], ref[valid])["rel_fro"], tol=0.0))
    judged = torch.where(keep[..., None], ref, out)     # a near tie: the backend's own output, not compared
    figures.update(error_metrics(out[keep], ref[keep]))
    check_rows(out, judged, lengths, dtype, where=where, figures=figures,
               cause=lambda tol: likely_cause(out, keep, preset, layer_type, scenario_name, dtype,
                                              correct=figures["rel_fro"], tol=tol.rel_fro, figures=figures))
    return figures


def _judged_reference(w64, x, dtype, lengths, ref, traces, picks, where, figures, store=None, cause=lambda: ""):
    """(the reference each query is held to, the queries compared): over the backend's own selection where it
    exposes one (``last_topk_indices``; a choice beyond the tie bound fails here), else the oracle's, leaving out
    the queries at a near tie of the indexer's top-k (counted: tied_queries_not_compared)."""
    __tracebackhide__ = True
    T = x.shape[1]
    valid = torch.arange(T)[None, :] < lengths[:, None]
    if picks:
        own, wrong = own_selection_oracle(w64, x.to(dtype).to(torch.float64), lengths, traces, picks, dtype, store)
        if wrong:
            raise AssertionError(failure(_selection_failure(where, wrong), cause=cause()))
        figures["own_selection_queries"] = len(picks)
        figures["tied_queries_not_compared"] = 0
        return (ref if own is None else own), valid
    keep = _certain(traces, lengths, T, dtype)
    figures["tied_queries_not_compared"] = int((valid & ~keep).sum())
    return ref, keep


def likely_cause(out, keep, preset, layer_type, scenario_name, dtype, *, correct: float, tol: float,
                 figures: dict) -> str:
    """'; likely cause: ...' when the oracle of one known bug (LIKELY_CAUSES) matches the output within the
    tolerance, or five times better than V4's oracle does; the best such match."""
    best = None
    for name, (variant, sentence, kinds) in LIKELY_CAUSES.items():
        if layer_type not in kinds:
            continue
        ref, _ = oracle(preset, layer_type, scenario_name, dtype, variant)
        err = error_metrics(out[keep], ref[keep])["rel_fro"]
        if (err <= tol or err * 5 <= correct) and (best is None or err < best[0]):
            best = (err, name, sentence)
    if best is None:
        return ""
    figures["likely_cause"] = best[1]
    return (f"; likely cause: {best[2]} (the output matches that bug's oracle to rel_fro {best[0]:.2e}, V4's to "
            f"{correct:.2e})")


def decode_equals_prefill(backend, layer: str, dtype: torch.dtype, device="cpu", *, prefill: int = 21,
                          decode: int = 12, figures: dict | None = None) -> dict[str, float]:
    """Prefill P then D single-token steps gives what one prefill of P + D tokens gives (same tokens): the
    compressor's state carried across calls, entries appearing when their windows close. Within the dtype's row
    tolerance; queries at a near tie of the indexer's top-k are not compared."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    preset, layer_type = TINY_LAYERS[layer]
    w = weights_for(preset, layer_type, dtype, str(device))
    require_support(backend, w.config, dtype=dtype, device=device)
    inc = Scenario("v4_incremental", (prefill,), decode_steps=decode)
    one = Scenario("v4_one_shot", (prefill + decode,))
    x = inputs_for(w.config, one)
    out_inc, _ = run_scenario(backend, w, x, inc, device=device)
    out_one, _ = run_scenario(backend, w, x, one, device=device)
    _, traces = v4_attention_f64(master_weights(preset, layer_type), x.to(dtype).to(torch.float64))
    keep = _certain(traces, torch.tensor([prefill + decode]), x.shape[1], dtype)
    figures.update(error_metrics(out_inc[keep], out_one[keep]))
    check_rows(out_inc, torch.where(keep[..., None], out_one, out_inc), torch.tensor([prefill + decode]), dtype,
               where=(f"{backend.name} DeepSeek-V4 {SHORT[layer_type]} layer: prefill {prefill} + {decode} decode "
                      f"steps against one {prefill + decode}-token prefill"), figures=figures)
    return figures


# --------------------------------------------------------------------------- bytes

def kv_row_bytes(config, dtype: torch.dtype, kv_codec: str = "none") -> int:
    """One KV row (window or entry): head_dim values in the cache dtype, or MODEL1's 584 bytes."""
    if kv_codec == model1.NAME:
        return model1.TOKEN_BYTES
    return config.head_dim * torch.empty(0, dtype=dtype).element_size()


def expected_component_bytes(config, n: int, dtype: torch.dtype, kv_codec: str = "none") -> dict[str, int]:
    """The V4 cache of one row of n tokens, per component (DeepSeek's layout): a window ring of
    min(n, sliding_window) KV rows (K = V: one vector), n // ratio compressed rows (CSA, HCA), a KV row being
    head_dim values in the cache dtype or a 584-byte MODEL1 row; for CSA n // ratio indexer keys of
    index_head_dim in the cache dtype."""
    e = torch.empty(0, dtype=dtype).element_size()
    m, row = config.compress_ratio, kv_row_bytes(config, dtype, kv_codec)
    out = {"window": min(n, config.sliding_window) * row}
    if m:
        out["compressed"] = (n // m) * row
    if config.layer_type == CSA:
        out["indexer"] = (n // m) * config.index_head_dim * e
    return out


V4_COMPONENTS = ("window", "compressed", "indexer", "state", "bookkeeping")


def measure_component_bytes(runs) -> dict[str, int]:
    """Bytes written per component (``cache.v4_layout``), measured from ``tensors()`` over runs of the same
    scenario whose poison differs ((cache, poisoned) pairs; integer storage with 0xFF, then 0x00 bytes, so a
    written byte equal to one poison still counts): of a preallocated buffer, the elements that no longer hold
    the poison in some run; of a buffer that appeared or grew, all its bytes. A tensor listed twice under two
    names (transformers' window keys and values) counts once."""
    cache = runs[0][0]
    tensors = cache.tensors()
    layout = getattr(cache, "v4_layout", None)
    if not isinstance(layout, dict):
        raise BackendSpecError(f"{type(cache).__name__}: a V4 cache declares v4_layout (tensor name -> one of "
                               f"{', '.join(V4_COMPONENTS)}) so its bytes can be measured per component")
    missing = sorted(set(tensors) - set(layout))
    bad = sorted(k for k, v in layout.items() if v not in V4_COMPONENTS)
    if missing or bad:
        raise BackendSpecError(f"{type(cache).__name__}.v4_layout: {'no component for ' + str(missing) if missing else ''}"
                               f"{' unknown components for ' + str(bad) if bad else ''} (components: "
                               f"{', '.join(V4_COMPONENTS)})")
    seen, unique = set(), {}
    for k, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[k] = t
    masks = [written_masks({k: c.tensors()[k] for k in unique}, p) for c, p in runs]
    per_tensor = written_bytes(unique, masks)
    out = {c: 0 for c in V4_COMPONENTS}
    for k, nbytes in per_tensor.items():
        out[layout[k]] += nbytes
    return out


def check_cache_bytes(backend, layer_type: str, dtype: torch.dtype, device="cpu", *, tokens: int,
                      kv_codec: str = "none", figures: dict | None = None) -> dict[str, int]:
    """At V4's widths (``v4-mini``: head_dim 512, window 128, ratios 4 / 128, indexer keys of 128), one row of
    ``tokens`` tokens (a prefill of tokens - 3, then 3 decode steps): the bytes written per component equal
    DeepSeek's layout in the cache dtype. A window holding twice its bytes is named as a key copy beside the value
    (V4's K = V is one vector); one holding every token as a window that is not a ring."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for("v4-mini", layer_type, dtype, str(device))
    cfg = w.config
    require_support(backend, cfg, dtype=dtype, device=device, kv_codec=kv_codec)
    sc = Scenario("v4_bytes", (tokens - 3,), decode_steps=3)
    x = inputs_for(cfg, sc)
    runs = []
    for sentinel in (0xFF, 0x00):
        trace: dict = {}
        _, cache = run_scenario(backend, w, x, sc, device=device, trace=trace, kv_codec=kv_codec,
                                poison_sentinel=sentinel)
        runs.append((cache, trace["poisoned"]))
        if getattr(cache, "v4_layout", None) is None:
            pytest.skip(f"{backend.name}: its V4 cache ({type(cache).__name__}) declares no v4_layout (tensor name -> "
                        f"{', '.join(V4_COMPONENTS)}); the bytes per component are measured where it does "
                        "(docs/deepseek-v4.md)")
        if not any(not dtype_.is_floating_point or dtype_.itemsize == 1
                   for _, dtype_ in trace["poisoned"].storage.values()):
            break  # floating storage is poisoned with NaN whatever the sentinel: one run tells
    measured = measure_component_bytes(runs)
    expected = expected_component_bytes(cfg, tokens, dtype, kv_codec)
    figures.update({f"{k}_bytes": v for k, v in measured.items()})
    figures.update({f"expected_{k}_bytes": v for k, v in expected.items()})
    where = (f"{backend.name} DeepSeek-V4 {SHORT[layer_type]} cache (v4-mini, {tokens} tokens, "
             f"{dtype_name(dtype)}, kv_codec {kv_codec})")
    row = kv_row_bytes(cfg, dtype, kv_codec)
    # the window: DeepSeek's ring holds the last sliding_window rows, the query's own among them; a cache that
    # keeps sliding_window - 1 (transformers': the query's row comes with the call) holds all decode needs too
    lean = min(tokens, cfg.sliding_window - 1) * row
    # MODEL1: FlashMLA's writer leaves each row's 8th scale byte (padding) unwritten: 583 written bytes per row
    for comp, want in expected.items():
        got = measured[comp]
        if got == want or (comp == "window" and got == lean) or (
                kv_codec == model1.NAME and comp != "indexer" and got == want // row * (row - 1)):
            continue
        hint = ""
        if comp == "window" and got in (2 * want, 2 * lean):
            hint = (f"; it holds twice the format ({got // row} rows for a window of {cfg.sliding_window}): a key "
                    "copy and a value copy, where V4's K = V is one vector (one tensor is the whole window)")
        elif comp == "window" and got >= tokens * row:
            hint = (f"; it holds every token ({got // row} rows): the window is not a ring of sliding_window "
                    f"({cfg.sliding_window}) rows")
        elif comp in ("compressed", "indexer") and want and got % want == 0:
            hint = f"; {got // want} x the entries' bytes"
        also = f" (or {lean:,} B: sliding_window - 1 rows)" if comp == "window" else ""
        raise AssertionError(failure(f"{where}: {comp} holds {got:,} B, expected {want:,} B{also}: "
                                     f"{times(got / want) if want else 'inf x'} the format's",
                                     f"format: {_formula(cfg, comp, tokens, dtype, row)}", cause=hint))
    return measured


def _formula(cfg, comp: str, n: int, dtype, row: int) -> str:
    e = torch.empty(0, dtype=dtype).element_size()
    if comp == "window":
        return f"min({n}, {cfg.sliding_window}) rows x {row} B"
    if comp == "compressed":
        return f"{n} // {cfg.compress_ratio} entries x {row} B"
    return f"{n} // {cfg.compress_ratio} keys x {cfg.index_head_dim} x {e} B"


#: the MODEL1 FP8 numerics scenario at V4's widths: a 150-token prefill (past the 128-token window, one HCA entry,
#: 37 CSA entries of which the indexer keeps 8) and 3 decode steps
FP8_SCENARIO = Scenario("v4_fp8", (150,), decode_steps=3)


@functools.lru_cache(maxsize=8)
def _fp8_oracle(layer_type: str, dtype: torch.dtype):
    w = master_weights("v4-mini", layer_type)
    x = inputs_for(w.config, FP8_SCENARIO).to(dtype).to(torch.float64)
    return v4_attention_f64(w, x, scenario_lengths(FP8_SCENARIO), store=model1.stored_f64)


def judge_fp8(backend, layer_type: str, dtype: torch.dtype, device="cpu", figures: dict | None = None) -> dict:
    """The MODEL1 FP8 cache (kv_codec fp8-e4m3-model1) at V4's widths: the output against the float64 oracle whose
    window rows and entries are rounded as MODEL1 stores them (the format's rounding is the format's; the
    arithmetic around it is held to the dtype's row tolerance, as every layer output is)."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for("v4-mini", layer_type, dtype, str(device))
    require_support(backend, w.config, dtype=dtype, device=device, kv_codec=model1.NAME)
    x = inputs_for(w.config, FP8_SCENARIO)
    picks, watch = selection_watch(backend, FP8_SCENARIO.batch)
    out, _ = run_scenario(backend, w, x, FP8_SCENARIO, device=device, kv_codec=model1.NAME, watch=watch)
    lengths = scenario_lengths(FP8_SCENARIO)
    ref, traces = _fp8_oracle(layer_type, dtype)
    where = f"{backend.name} DeepSeek-V4 {SHORT[layer_type]} layer (v4-mini) {model1.NAME} {dtype_name(dtype)}"
    ref, keep = _judged_reference(master_weights("v4-mini", layer_type), x, dtype, lengths, ref, traces, picks,
                                  where, figures, store=model1.stored_f64)
    figures.update(error_metrics(out[keep], ref[keep]))
    check_rows(out, torch.where(keep[..., None], ref, out), lengths, dtype, figures=figures, where=where)
    return figures
