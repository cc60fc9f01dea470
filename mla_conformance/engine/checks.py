"""What the engine suite holds an engine to, each rule a named function raising AssertionError with the verdict
first (what, where, measured vs bound), then the likely cause:

* :func:`compare_greedy` / :func:`assert_greedy_tokens`: the engine's greedy tokens equal the float64 reference's
  until the first position whose reference top-1 / top-2 margin is below the tie bound (a tie, reported, not a
  failure);
* :func:`assert_logprobs`: the chosen and top-k tokens' log-probabilities within :func:`logprob_tolerance` of the
  reference's, at every position where the engine and the reference have generated the same tokens;
* :func:`assert_same_as_cold`: a configuration (prefix-cache reuse, chunked prefill) gives the cold run's tokens and
  log-probabilities;
* :func:`assert_latent_cache`: the engine's cache holds the latent (kv_lora_rank + qk_rope_head_dim elements a token
  a layer), measured from its own tensors.

The tolerance (docs/tolerances.md, "Engine log-probabilities"): a chosen token's log-probability z_c - logsumexp(z)
errs by at most 2 max_i |dz_i|; each logit errs as the layer table's rows say a layer output errs, over the model's
L attention layers and its LM head (sqrt(L + 1) stages of independent error), per element ln(V) times the row's
relative error (row_tolerance's rule), relative to the logits' spread (their standard deviation: a common offset
cancels in log_softmax). A greedy choice is forced when the reference's margin exceeds twice that (each of the two
log-probabilities may move by tau): below it, the engine may pick either and it is a tie.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.engine.contract import Completion
from mla_conformance.engine.reference import ReferenceCompletion


def logprob_tolerance(dtype: str, layers: int, ref_logprobs: torch.Tensor) -> float:
    """tau at one position: 2 sqrt(L + 1) rel_fro(dtype) ln(V) std(z) (the module docstring's derivation)."""
    rel = TOLERANCES[dtype].rel_fro
    v = ref_logprobs.numel()
    return 2 * math.sqrt(layers + 1) * rel * math.log(v) * float(ref_logprobs.std())


@dataclasses.dataclass
class GreedyComparison:
    """One prompt: tokens matched before the first divergence (None: no divergence), whether that divergence is a
    tie (reference margin below its bound), and the worst log-probability delta over the compared positions."""

    prompt: str
    generated: int
    matched: int
    diverged_at: int | None
    margin: float | None
    tie_bound: float | None
    engine_token: int | None
    reference_token: int | None
    worst_delta: float
    worst_position: int
    worst_tolerance: float
    first_out_of_tolerance: int | None

    @property
    def tie(self) -> bool:
        return self.diverged_at is not None and self.margin < self.tie_bound

    @property
    def failed_tokens(self) -> bool:
        return self.diverged_at is not None and not self.tie


def compare_greedy(prompt: str, ref: ReferenceCompletion, got: Completion, *, dtype: str,
                   layers: int) -> GreedyComparison:
    n = min(len(got.tokens), len(ref.tokens))
    matched = 0
    while matched < n and got.tokens[matched] == ref.tokens[matched]:
        matched += 1
    diverged = matched if matched < n else None
    worst, worst_pos, worst_tol, first_out = 0.0, 0, 0.0, None
    # positions 0..matched share the prefix with the reference: the engine's distribution there is comparable
    for pos in range(min(matched + 1, n)):
        lp = ref.logprobs[pos]
        tol = logprob_tolerance(dtype, layers, lp)
        tokens = {got.tokens[pos]: got.logprobs[pos], **got.top[pos]} if pos < len(got.top) else {
            got.tokens[pos]: got.logprobs[pos]}
        delta = max(abs(v - float(lp[t])) for t, v in tokens.items())
        if delta / tol > (worst / worst_tol if worst_tol else -1):
            worst, worst_pos, worst_tol = delta, pos, tol
        if first_out is None and delta > tol:
            first_out = pos
    margin = bound = None
    if diverged is not None:
        margin = ref.margin(diverged)
        bound = 2 * logprob_tolerance(dtype, layers, ref.logprobs[diverged])
    return GreedyComparison(prompt, n, matched, diverged, margin, bound,
                            got.tokens[diverged] if diverged is not None else None,
                            ref.tokens[diverged] if diverged is not None else None,
                            worst, worst_pos, worst_tol, first_out)


def likely_cause(c: GreedyComparison) -> str:
    """Where the engine goes wrong: from the first generated token (its prefill, or the model as it loaded it) or
    only after it (its decode kernel, or the cache the decode reads)."""
    first_bad = c.first_out_of_tolerance if c.first_out_of_tolerance is not None else c.diverged_at
    if first_bad == 0:
        return ("likely cause: wrong from the first generated token, which the prompt's prefill computes: the prefill "
                "attention (softmax scale, YaRN mscale, RoPE layout) or the model as the engine loaded it")
    return (f"likely cause: the first generated token (the prefill) agrees and position {first_bad} does not: the "
            "decode path (the decode kernel's softmax scale or RoPE, or the latent cache it reads: the layout "
            "written, the pages)")


def assert_greedy_tokens(comparisons: list[GreedyComparison], *, dtype: str) -> None:
    bad = [c for c in comparisons if c.failed_tokens]
    if not bad:
        return
    c = min(bad, key=lambda c: c.diverged_at)
    raise AssertionError(
        f"greedy tokens diverge from the float64 reference at position {c.diverged_at} of prompt {c.prompt} "
        f"(engine {c.engine_token}, reference {c.reference_token}): reference margin {c.margin:.4g} >= tie bound "
        f"{c.tie_bound:.3g} ({dtype}) by {c.margin / c.tie_bound:.3g}x; {len(bad)} of {len(comparisons)} prompts "
        f"diverge beyond a tie\n{likely_cause(c)}")


def assert_logprobs(comparisons: list[GreedyComparison], *, dtype: str) -> None:
    bad = [c for c in comparisons if c.first_out_of_tolerance is not None]
    if not bad:
        return
    c = max(bad, key=lambda c: c.worst_delta / c.worst_tolerance)
    first = min(bad, key=lambda c: c.first_out_of_tolerance)
    raise AssertionError(
        f"log-probabilities beyond the {dtype} tolerance: worst {c.worst_delta:.3g} > {c.worst_tolerance:.3g} by "
        f"{c.worst_delta / c.worst_tolerance:.3g}x at position {c.worst_position} of prompt {c.prompt}; the first "
        f"diverging position is {first.first_out_of_tolerance} of prompt {first.prompt}; {len(bad)} of "
        f"{len(comparisons)} prompts out\n{likely_cause(first)}")


def assert_same_as_cold(prompts: list[str], refs: list[ReferenceCompletion], cold: list[Completion],
                        warm: list[Completion], *, dtype: str, layers: int, what: str) -> float:
    """``warm`` (the same prompts under prefix-cache reuse or chunked prefill) against the cold run: the same
    tokens until a tie of the cold run's own top-2 (its margin below the tie bound), log-probabilities of the
    tokens both report within tau of the cold run's (tau as for the reference, from the reference's logits at that
    position). Returns the worst delta."""
    worst = 0.0
    for name, ref, c, w in zip(prompts, refs, cold, warm):
        n = min(len(c.tokens), len(w.tokens), len(ref.logprobs))
        for pos in range(n):
            tol = logprob_tolerance(dtype, layers, ref.logprobs[pos])
            cold_lp = {c.tokens[pos]: c.logprobs[pos], **c.top[pos]}
            warm_lp = {w.tokens[pos]: w.logprobs[pos], **w.top[pos]}
            common = [t for t in cold_lp if t in warm_lp]
            delta = max((abs(warm_lp[t] - cold_lp[t]) for t in common), default=0.0)
            worst = max(worst, delta)
            if delta > tol:
                raise AssertionError(
                    f"{what}: log-probabilities differ from the cold run by {delta:.3g} > {tol:.3g} ({dtype}) by "
                    f"{delta / tol:.3g}x at position {pos} of prompt {name}\nlikely cause: the {what} path computes "
                    "attention over the cached / chunked prefix differently from one pass over the whole prompt")
            if w.tokens[pos] != c.tokens[pos]:
                top2 = sorted(c.top[pos].values(), reverse=True)[:2]
                margin = top2[0] - top2[1] if len(top2) == 2 else math.inf
                if margin >= 2 * tol:
                    raise AssertionError(
                        f"{what}: token {w.tokens[pos]} at position {pos} of prompt {name}, the cold run chose "
                        f"{c.tokens[pos]} by a margin {margin:.4g} >= tie bound {2 * tol:.3g} ({dtype})\nlikely "
                        f"cause: the {what} path computes attention over the cached / chunked prefix differently")
                break
    return worst


def assert_latent_cache(kv: dict, *, latent_elements: int, dtype_bytes: int) -> float:
    """The engine's cache stores the latent: bytes per token per layer measured from its tensors equal
    latent_elements x the cache's element size. Returns the measured bytes."""
    measured = kv["bytes_per_token_per_layer"]
    want = latent_elements * dtype_bytes
    if measured != want:
        shapes = "; ".join(f"{t['layer']} {t['shape']} {t['dtype']}" for t in kv["tensors"][:2])
        raise AssertionError(
            f"KV cache bytes per token per layer {measured:g} != the latent's {want} ({latent_elements} elements x "
            f"{dtype_bytes} bytes) by {measured / want:.3g}x (the engine's tensors: {shapes})\nlikely cause: the "
            f"engine caches {'the expanded K/V' if measured > want else 'fewer elements than the latent'} "
            f"(layout {kv.get('layout')!r})")
    return measured
