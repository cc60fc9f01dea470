"""Name the likely cause of a numerics failure: float64 oracles of the common MLA bug classes.

Each :class:`BugClass` is the float64 expanded reference with exactly one thing wrong (a missing YaRN
mscale², rotate-half RoPE pairs, a mask aligned top-left, ...). When a backend's output misses the correct
reference, :func:`likely_cause` measures it against every bug oracle and, when one matches far better
than the correct reference, names it; :func:`format_cause` turns that into the sentence a failure
message carries ("likely cause: matches the reference without YaRN mscale² in the softmax scale
(rel_fro 3.1e-07; the correct reference: 2.8e-02)").

Three of the classes depend on how the tokens reached the backend, so every oracle takes ``calls``:
each ``attend()`` call in order, as (start position per row [B], new tokens per row [B]) -- the
no-causal-mask, top-left-chunk-mask and decode-off-by-one bugs only show within a multi-token call,
after the first chunk, or on a call of one token.

The decision rule (:func:`likely_cause`), with its margins measured by tests/meta/test_diagnose.py on
the suite's broken backends and the correct built-ins in float32 and bfloat16 (tiny and V2-Lite dims):

* a bug class *matches* when (1) the output is within the dtype's tolerance of its oracle
  (rel_fro <= ``ACCEPT_TOLERANCES`` x tolerance: the backend would pass if that oracle were the
  reference) and closer to it than to the correct one, and (2) on the positions where that oracle
  differs from the correct one (all positions for most classes; only the decode steps for the decode
  off-by-one, only later chunks and decode steps for the top-left mask) the output is ``FAR_BETTER``
  (5) times closer to the bug oracle than to the correct reference. Restricting (2) to those positions
  keeps a bug confined to 4 decode steps of a 294-token scenario from drowning in the unaffected ones.
* A conforming backend is never closer to a bug oracle than to the correct one (its rounding noise is
  unrelated to the bug's direction, so the bug oracle is sqrt(noise² + effect²) away): measured ratios
  <= 0.6 in bf16, ~0 in fp32. A broken backend is as close to its oracle as a conforming one is to the
  correct reference (~7e-3 in bf16, ~7e-7 in fp32), so the ratio is effect / noise: >= 5.9 in bf16
  and >= 1e4 in fp32 on the tests' scenarios. A bug whose effect on a scenario is below 5x the bf16
  noise (YaRN's ramp on V2-Lite within 30 positions) is not named in bf16 there -- no claim, not a
  wrong one.
* The best matching class is named, with every other matching class within ``TIE`` x its rel_fro
  (classes whose oracles coincide on a config, e.g. a YaRN dict without ``mscale``, are named
  together or not at all); a class whose oracle equals the correct reference on this input
  (mscale == mscale_all_dim, no decode step, a single prefill call, ...) is left out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import torch

from mla_conformance.model.config import MLAConfig, rope_inv_freq, yarn_get_mscale
from mla_conformance.model.reference import apply_rope, masked_softmax, rms_norm, rope_factor
from mla_conformance.model.weights import MLAWeights

#: each attend() call in order: (start position per row [B] int64, new tokens per row [B] int64), CPU
Calls = list[tuple[torch.Tensor, torch.Tensor]]

#: a bug class matches only when its rel_fro <= ACCEPT_TOLERANCES x the dtype's rel_fro tolerance ...
ACCEPT_TOLERANCES = 1.0
#: ... and, where it differs from the correct reference, it is FAR_BETTER times closer than the correct one
FAR_BETTER = 5.0
#: matching classes within TIE x the best one's rel_fro are named together (the output cannot tell them apart)
TIE = 2.0
#: a position where a bug oracle differs from the correct one by less than this x rms(correct) is the same
SAME_OUTPUT = 1e-9


@dataclasses.dataclass(frozen=True)
class BugClass:
    name: str  # e.g. "missing-yarn-mscale2"
    description: str  # completes "matches the reference ..."
    oracle: Callable[[MLAWeights, torch.Tensor, torch.Tensor, Calls], torch.Tensor]
    # (float64 weights, hidden_states float64 [B, T, hidden], lengths [B], calls) -> float64 [B, T, hidden]


# --------------------------------------------------------------------------- variant pieces


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate_half layout: pairs (x[i], x[i + r/2]) -- wrong for DeepSeek's interleaved weights."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _plain_inv_freq(config: MLAConfig) -> torch.Tensor:
    d = config.qk_rope_head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def _mscale_scale(config: MLAConfig, key: str) -> float:
    """1/sqrt(qk_head_dim) x mscale(factor, yarn[key])² (no factor when YaRN or the key is off)."""
    scale = config.qk_head_dim ** -0.5
    y = config.yarn
    if y and y.get(key):
        m = yarn_get_mscale(float(y["factor"]), float(y[key]))
        scale *= m * m
    return scale


def scenario_calls(scenario) -> Calls:
    """The attend() calls ``checks.run_scenario`` makes for a ``checks.Scenario`` (``Scenario.calls``: the prefill
    in chunks of ``scenario.chunk`` tokens, all at once when None, then ``decode_steps`` one-token calls; or its
    explicit schedule), as (start per row, new tokens per row)."""
    done = torch.zeros(scenario.batch, dtype=torch.int64)
    calls = []
    for new, _ in scenario.calls():
        n = torch.tensor(new, dtype=torch.int64)
        calls.append((done.clone(), n))
        done = done + n
    return calls


def call_layout(calls: Calls, B: int, T: int) -> dict[str, torch.Tensor]:
    """Per position [B, T]: start and end (exclusive) of the call that fed it, and that call's S."""
    start = torch.zeros(B, T, dtype=torch.int64)
    end = torch.arange(1, T + 1).expand(B, T).clone()
    width = torch.full((B, T), -1, dtype=torch.int64)
    for s0, n in calls:
        s0, n = s0.to("cpu", torch.int64), n.to("cpu", torch.int64)
        S = int(n.max()) if n.numel() else 0
        for b in range(B):
            a, k = int(s0[b]), int(n[b])
            if k <= 0 or a >= T:
                continue
            z = min(a + k, T)
            start[b, a:z] = a
            end[b, a:z] = a + k
            width[b, a:z] = S
    return {"start": start, "end": end, "S": width}


# --------------------------------------------------------------------------- the oracles


@dataclasses.dataclass(frozen=True)
class Variant:
    """One set of pieces of the float64 expanded reference; the defaults are the correct reference.

    softmax_scale: a function of the config (None: ``config.softmax_scale``); rope: the pair layout;
    inv_freq: a function of the config (None: ``rope_inv_freq``, YaRN's ramp included); rotate_k_pe:
    False caches k_pe unrotated; norm_latent: False caches the latent before kv_a_layernorm; kv_b:
    "heads-first" (correct, [H, nope + v, c]), "axis-order" ([nope + v, H, c]) or "swapped" (W_UK <->
    W_UV); mask: "causal" (key <= query), "call" (a query sees every valid key up to the end of its own
    call: no causal mask within a call), "top-left" (query i of a call sees keys <= i) or "excludes-self"
    (key < query: the causal mask off by one, position 0 sees no key and gives 0); decode_shift:
    tokens of one-token calls (S == 1) are rotated at position - decode_shift.
    """

    softmax_scale: Callable[[MLAConfig], float] | None = None
    rope: Callable = apply_rope
    inv_freq: Callable[[MLAConfig], torch.Tensor] | None = None
    rotate_k_pe: bool = True
    norm_latent: bool = True
    kv_b: str = "heads-first"
    mask: str = "causal"
    decode_shift: int = 0


def _kv_b_rows(cfg: MLAConfig, kind: str) -> torch.Tensor | None:
    """Row permutation of kv_b_proj.weight [H * (nope + v), c] that a kv_b variant reads as [H, nope + v, c]
    (None: the variant does not exist for this config)."""
    H, n, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    rows = torch.arange(H * (n + v))
    if kind == "heads-first":
        return rows
    if kind == "axis-order":  # viewed as [nope + v, H, c], then transposed to [H, nope + v, c]
        return rows.view(n + v, H).T.reshape(-1)
    if kind == "swapped":  # W_UK and W_UV exchanged
        if n != v:
            return None
        per_head = rows.view(H, n + v)
        return torch.cat([per_head[:, n:], per_head[:, :n]], dim=1).reshape(-1)
    raise ValueError(f"unknown kv_b variant {kind!r}")


def variants_attention_f64(weights: MLAWeights, x: torch.Tensor, lengths: torch.Tensor, calls: Calls,
                           variants: list[Variant], rope_convention: str = "transformers") -> list[torch.Tensor | None]:
    """The float64 expanded reference under each variant: float64 [B, T, hidden], zero past lengths
    (None for a variant that does not exist for this config, e.g. W_UK <-> W_UV when nope != v).

    The projections, the latent expansion and o_proj are shared by all variants (so a dozen oracles cost
    little more than one); with ``Variant()`` it equals ``reference.reference_attention_f64`` (under
    ``rope_convention``, a key of schema.ROPE_CONVENTIONS: YaRN's cos/sin factor).
    """
    w = weights.to(torch.float64, device="cpu")
    cfg = w.config
    H, n, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    x = x.to(device="cpu", dtype=torch.float64)
    B, T, _ = x.shape
    lengths = lengths.to("cpu", torch.int64)
    layout = call_layout(calls, B, T)
    # per-token projections, before RoPE (reference.project with the RoPE pieces open)
    if cfg.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps) @ w["q_b_proj.weight"].T
    q_nope, q_pe_raw = q.unflatten(-1, (H, cfg.qk_head_dim)).split([n, r], dim=-1)
    c_raw, k_pe_raw = (x @ w["kv_a_proj_with_mqa.weight"].T).split([cfg.kv_lora_rank, r], dim=-1)
    latents = {True: rms_norm(c_raw, w["kv_a_layernorm.weight"], cfg.rms_norm_eps), False: c_raw}
    # every latent expanded once through kv_b_proj (K nope and V per head); kv_b variants permute its rows
    expanded = {norm: latents[norm] @ w["kv_b_proj.weight"].T
                for norm in {v.norm_latent for v in variants}}                     # [B, T, H * (nope + v)]
    t = torch.arange(T)
    valid = t[None, :] < lengths[:, None]
    in_row = t[None, None, :] < lengths[:, None, None]
    heads, exists = [], []
    for var in variants:
        rows = _kv_b_rows(cfg, var.kv_b)
        if rows is None:
            exists.append(False)
            continue
        exists.append(True)
        kv = expanded[var.norm_latent][..., rows].unflatten(-1, (H, -1))
        k_nope, v = kv.split([n, cfg.v_head_dim], dim=-1)
        positions = t.expand(B, T)
        if var.decode_shift:
            positions = positions - var.decode_shift * (layout["S"] == 1).long()
        freqs = rope_inv_freq(cfg, torch.float64) if var.inv_freq is None else var.inv_freq(cfg)
        angles = positions.to(torch.float64)[..., None] * freqs
        m = rope_factor(cfg, rope_convention)
        cos, sin = torch.cos(angles) * m, torch.sin(angles) * m
        q_pe = var.rope(q_pe_raw, cos, sin)
        k_pe = var.rope(k_pe_raw, cos, sin) if var.rotate_k_pe else k_pe_raw
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, H, -1)], dim=-1)
        s = t[None, :, None]
        if var.mask == "causal":
            allowed = t[None, None, :] <= s
        elif var.mask == "call":
            allowed = t[None, None, :] < layout["end"][:, :, None]
        elif var.mask == "top-left":
            allowed = t[None, None, :] <= s - layout["start"][:, :, None]
        elif var.mask == "excludes-self":
            allowed = t[None, None, :] < s
        else:
            raise ValueError(f"unknown mask {var.mask!r}")
        scale = cfg.softmax_scale if var.softmax_scale is None else var.softmax_scale(cfg)
        scores = torch.einsum("bshd,bthd->bsht", torch.cat([q_nope, q_pe], dim=-1), k) * scale
        p = masked_softmax(scores, allowed & in_row, torch.float64)
        heads.append(torch.einsum("bsht,bthd->bshd", p, v).flatten(-2))
    outs = iter((torch.stack(heads) @ w["o_proj.weight"].T) * valid[..., None] if heads else [])
    return [next(outs) if e else None for e in exists]


def _bug(name: str, description: str, **pieces) -> BugClass:
    variant = Variant(**pieces)

    def oracle(weights, x, lengths, calls):
        out = variants_attention_f64(weights, x, lengths, calls, [variant])[0]
        if out is None:
            raise ValueError(f"bug class {name} does not exist for {weights.config.describe()}")
        return out

    oracle.__name__ = oracle.__qualname__ = f"oracle_{name.replace('-', '_')}"
    oracle.variant = variant
    return BugClass(name, description, oracle)


_BUGS = [
    _bug("missing-yarn-mscale2", "without YaRN mscale² in the softmax scale (1/sqrt(qk_head_dim) only)",
         softmax_scale=lambda cfg: cfg.qk_head_dim ** -0.5),
    _bug("yarn-mscale-not-squared", "with YaRN's mscale(factor, mscale_all_dim) in the softmax scale once "
         "instead of squared", softmax_scale=lambda cfg: (cfg.qk_head_dim ** -0.5 * cfg.softmax_scale) ** 0.5),
    _bug("mscale-not-mscale-all-dim", "with YaRN mscale(factor, mscale)² in the softmax scale instead of "
         "mscale(factor, mscale_all_dim)²", softmax_scale=lambda cfg: _mscale_scale(cfg, "mscale")),
    _bug("softmax-scale-from-576", "with the softmax scale taken from the absorbed width "
         "(1/sqrt(kv_lora_rank + qk_rope_head_dim), times mscale²) instead of 1/sqrt(qk_head_dim)",
         softmax_scale=lambda cfg: cfg.latent_dim ** -0.5 * cfg.softmax_scale * cfg.qk_head_dim ** 0.5),
    _bug("softmax-scale-from-nope", "with the softmax scale taken from qk_nope_head_dim "
         "(1/sqrt(qk_nope_head_dim), times mscale²) instead of 1/sqrt(qk_nope + qk_rope)",
         softmax_scale=lambda cfg: cfg.qk_nope_head_dim ** -0.5 * cfg.softmax_scale * cfg.qk_head_dim ** 0.5),
    _bug("rope-rotate-half", "with rotate-half RoPE pairs (i, i + r/2) instead of DeepSeek's interleaved "
         "pairs (2i, 2i+1)", rope=apply_rope_rotate_half),
    _bug("yarn-ramp-ignored", "with plain RoPE frequencies theta^(-2i/d) where YaRN's interpolation ramp "
         "applies", inv_freq=_plain_inv_freq),
    _bug("unrotated-k-pe", "with k_pe cached without RoPE (q_pe still rotated)", rotate_k_pe=False),
    _bug("latent-before-norm", "with the latent cached before kv_a_layernorm", norm_latent=False),
    _bug("kv-b-wrong-axis-order", "with kv_b_proj viewed as [nope + v, heads, kv_lora] instead of "
         "[heads, nope + v, kv_lora] (W_UK / W_UV mis-sliced)", kv_b="axis-order"),
    _bug("kv-b-uk-uv-swapped", "with W_UK and W_UV exchanged (kv_b_proj's key rows used as values)",
         kv_b="swapped"),
    _bug("no-causal-mask", "without a causal mask (a query sees the later tokens of its own call)",
         mask="call"),
    _bug("chunk-mask-top-left", "with each call's mask aligned top-left (query i of a call sees keys <= i, "
         "not <= start + i; a decode step sees only key 0)", mask="top-left"),
    _bug("causal-mask-excludes-self", "with the causal mask off by one, key < query (a query does not see its own "
         "token; position 0 sees no key and gives 0)", mask="excludes-self"),
    _bug("decode-position-off-by-one", "with one-token (decode) calls rotated at position - 1",
         decode_shift=1),
]

BUG_CLASSES: dict[str, BugClass] = {b.name: b for b in _BUGS}


# --------------------------------------------------------------------------- the decision


def _rel_fro(a: torch.Tensor, ref: torch.Tensor) -> float:
    n = float(ref.norm())
    return float((a - ref).norm()) / n if n else (0.0 if float(a.norm()) == 0 else math.inf)


@dataclasses.dataclass
class Oracles:
    """Every oracle's output on one (weights, x, lengths, calls), over the valid positions ([N, hidden],
    row-major over (b, t < lengths[b])). ``bugs`` leaves out the classes that do not exist for the config
    or give the correct output on this input; ``support[name]`` [N] marks the positions where that bug
    oracle differs from the correct one."""

    correct: torch.Tensor
    bugs: dict[str, torch.Tensor]
    support: dict[str, torch.Tensor]


def oracle_outputs(weights: MLAWeights, x: torch.Tensor, lengths: torch.Tensor, calls: Calls,
                   classes: Iterable[str] | None = None, rope_convention: str = "transformers") -> Oracles:
    """All oracles at once (shared projections), or only those of ``classes`` (names of BUG_CLASSES).
    Compute it once and pass it to :func:`likely_cause` as ``oracles=`` when diagnosing several outputs
    of the same weights, inputs and calls."""
    lengths = lengths.to("cpu", torch.int64)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    names = list(BUG_CLASSES) if classes is None else list(classes)
    unknown = sorted(set(names) - set(BUG_CLASSES))
    if unknown:
        raise ValueError(f"unknown bug class(es) {unknown}; known: {', '.join(BUG_CLASSES)}")
    outs = variants_attention_f64(weights, x, lengths, calls,
                                  [Variant()] + [BUG_CLASSES[k].oracle.variant for k in names], rope_convention)
    correct = outs[0][valid]
    floor = SAME_OUTPUT * float(correct.pow(2).mean().sqrt())
    bugs, support = {}, {}
    for name, out in zip(names, outs[1:]):
        if out is None:
            continue
        out = out[valid]
        differs = (out - correct).abs().amax(-1) > floor
        if bool(differs.any()):
            bugs[name], support[name] = out, differs
    return Oracles(correct, bugs, support)


def likely_cause(out: torch.Tensor, weights: MLAWeights, x: torch.Tensor, lengths: torch.Tensor, calls: Calls,
                 *, correct_rel_fro: float, tolerance_rel_fro: float, oracles: Oracles | None = None,
                 rope_convention: str = "transformers") -> dict | None:
    """The bug class the backend's output matches far better than the correct reference, or None.

    out: the backend's outputs float64 [B, T, hidden] placed by position (as checks.run_scenario
    returns them); weights: the layer in float64 -- for the sharpest match, the weights the backend saw,
    cast to float64; x: the hidden states as the backend saw them, in float64; calls: every attend()
    call, see ``Calls``; correct_rel_fro: the output's rel_fro against the correct reference over the
    valid positions; tolerance_rel_fro: the dtype's rel_fro tolerance.

    A class matches when (1) the output's rel_fro to its oracle over the valid positions is
    <= ACCEPT_TOLERANCES x tolerance_rel_fro and <= correct_rel_fro, and (2) on the positions where that
    oracle differs from the correct one (its support: all of them for most classes, only the decode
    steps for the decode off-by-one) the output is FAR_BETTER times closer to it than to the correct
    reference. The best matching class is named, with every other matching class within TIE x its
    rel_fro (a tie: the output cannot tell them apart). ``rope_convention``: the RoPE convention of the
    correct reference and of every bug oracle (schema.ROPE_CONVENTIONS; they differ where mscale !=
    mscale_all_dim).

    Returns {"cause", "description", "rel_fro", "correct_rel_fro", "support": (positions, valid
    positions), "support_rel_fro": (to the bug oracle, to the correct one), "ranking": [(name, rel_fro),
    ...] for every applicable class, best first, "also": [(name, description, rel_fro), ...]}.
    """
    lengths = lengths.to("cpu", torch.int64)
    if oracles is None:
        oracles = oracle_outputs(weights, x, lengths, calls, rope_convention=rope_convention)
    got = out.to("cpu", torch.float64)[torch.arange(out.shape[1])[None, :] < lengths[:, None]]
    ranking = sorted(((name, _rel_fro(got, o)) for name, o in oracles.bugs.items()), key=lambda item: item[1])
    matching = []
    for name, err in ranking:
        if err > ACCEPT_TOLERANCES * tolerance_rel_fro or err > correct_rel_fro:
            continue
        on = oracles.support[name]
        to_bug, to_correct = _rel_fro(got[on], oracles.bugs[name][on]), _rel_fro(got[on], oracles.correct[on])
        if to_bug * FAR_BETTER <= to_correct:
            matching.append((name, err, int(on.sum()), to_bug, to_correct))
    if not matching:
        return None
    cause, best, n_on, to_bug, to_correct = matching[0]
    return {"cause": cause, "description": BUG_CLASSES[cause].description, "rel_fro": best,
            "correct_rel_fro": correct_rel_fro, "support": (n_on, got.shape[0]),
            "support_rel_fro": (to_bug, to_correct), "ranking": ranking,
            "also": [(m[0], BUG_CLASSES[m[0]].description, m[1]) for m in matching[1:] if m[1] <= TIE * best]}


def format_cause(found: dict) -> str:
    """"likely cause: matches the reference without YaRN mscale² ... (rel_fro 3.1e-07; the correct
    reference: 2.8e-02)", naming every tied class after "or"."""
    text = (f"likely cause: matches the reference {found['description']} (rel_fro {found['rel_fro']:.1e}; "
            f"the correct reference: {found['correct_rel_fro']:.1e}")
    n_on, n_valid = found.get("support", (0, 0))
    if n_on and n_on < n_valid:
        to_bug, to_correct = found["support_rel_fro"]
        text += f"; on the {n_on} of {n_valid} positions where the two differ: {to_bug:.1e} vs {to_correct:.1e}"
    text += ")"
    for name, description, err in found.get("also", []):
        text += f", or equally the reference {description} (rel_fro {err:.1e})"
    return text
