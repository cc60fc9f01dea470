"""The configurations the pytest benchmarks time (suites/test_decode_bench.py, tests/test_decode_timing_claim.py) and
the absorbed path's speed-up claim they are held to."""

from __future__ import annotations

import torch

from mla_conformance.model.config import MLAConfig
from mla_conformance.perf.timing import bandwidth_fraction, ratio_verdict

PRESET = "deepseek-v2-lite"
DTYPE = torch.bfloat16
CONTEXTS = (1024, 4096, 16384, 32768)
#: Timed rounds per context (few for long contexts: a naive 32k step takes seconds on a CPU).
ROUNDS = {1024: 10, 4096: 5, 16384: 3, 32768: 3}
WARMUP = 1
#: (context, batch): batch 1 everywhere, batch 4 at 1k and 4k.
CASES = [(ctx, b) for ctx in CONTEXTS for b in (1, 4) if b == 1 or ctx <= 4096]
KV_CODECS = ("none", "int8-g32")

#: DeepSeek Sparse Attention decode: a DSA backend on v3.2-mini (v3-mini's MLA dims + a 4-head, 128-wide
#: indexer, top-16) against reference-absorbed's dense decode on v3-mini (the same MLA dims without the
#: indexer), at contexts far above index_topk (v3.2-mini's max_position_embeddings is 1024).
SPARSE_PRESET, DENSE_PRESET = "v3.2-mini", "v3-mini"
SPARSE_CONTEXTS = (256, 1016)
SPARSE_ROUNDS = 7

#: The seed's claim at this context (recorded as a figure) and the floor the test holds it to.
CLAIM_CONTEXT = 16384
SEED_CLAIM_RATIO = 2.0


def cache_byte_ratio(preset: str = PRESET) -> float:
    """Bytes an expanded (naive) cache holds per token over a latent cache's, at ``preset``'s dims (the dtype
    cancels): H x (qk_head + v) / (kv_lora + rope) elements (`mla-conformance budget` prints both rows)."""
    config = MLAConfig.preset(preset)
    return config.expanded_dim / config.latent_dim


#: The floor is the cache byte ratio itself (margin 1, none): at 16k tokens a decode step is mostly the reading
#: of its cache, and reference-absorbed's holds that many times fewer bytes than reference-naive's, so a smaller
#: speed-up means the absorbed step is not exploiting them (a copy of the cache per step, a float64 path,
#: threads stalling each other, ...).
CLAIM_MARGIN = 1.0
CLAIM_FLOOR = cache_byte_ratio(PRESET) * CLAIM_MARGIN


def claim_verdict(ratio: float, bandwidth_readings: list[float]) -> tuple[str, str]:
    """The measured naive / absorbed time at CLAIM_CONTEXT against CLAIM_FLOOR, given the copy-bandwidth readings
    of the run: ("ok" | "inconclusive" | "below floor", one sentence), :func:`~mla_conformance.perf.timing.ratio_verdict`."""
    verdict, sentence = ratio_verdict(ratio, CLAIM_FLOOR, bandwidth_fraction(bandwidth_readings),
                                      what=f"reference-naive / reference-absorbed decode time at {CLAIM_CONTEXT}")
    return verdict, (f"{sentence} (the floor: {PRESET}'s cache byte ratio {cache_byte_ratio(PRESET):.3g}x, expanded "
                     f"over latent bytes per token, x margin {CLAIM_MARGIN:g})")


RATIO_ROUNDS = {1024: 7, 4096: 5, 16384: 5, 32768: 3}


def ctx_id(ctx: int) -> str:
    """1024 -> "ctx1k"; 1016 -> "ctx1016"."""
    return f"ctx{ctx // 1024}k" if ctx % 1024 == 0 else f"ctx{ctx}"
