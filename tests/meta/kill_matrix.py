"""The kill matrix: every conformance test (a test function of suites/ that takes the ``mla_backend``
fixture) and a broken backend that must make it *fail* -- an AssertionError verdict, recorded as
outcome "failed", not a crash ("error"), a skip or a pass.

Data only; tests/meta/test_kill_matrix.py runs every cell in one pytest subprocess and checks the
outcomes, and that no conformance test is missing from the matrix.
"""

HERE = "tests/meta"

#: backend spec -> the name it reports (test ids carry the name)
BROKEN = {
    "rope-layout": (f"{HERE}/broken_backends.py:RopeLayoutMixup", "broken-rope-layout"),
    "kv-b-swapped": (f"{HERE}/broken_backends.py:KvBSwapped", "broken-kv-b-swapped"),
    "decode-position": (f"{HERE}/broken_backends.py:ShiftedDecodePosition", "broken-decode-position"),
    "lying-bytes": (f"{HERE}/broken_backends.py:LyingBytes", "broken-lying-bytes"),
    "expanded-uint8": (f"{HERE}/broken_caches.py:ExpandedUint8ClaimsLatent", "broken-expanded-uint8-pool"),
    "scales-not-counted": (f"{HERE}/broken_caches.py:ScalesNotCounted", "broken-scales-not-counted"),
    "int8-codec": (f"{HERE}/broken_caches.py:BadInt8Codec", "broken-int8-codec"),
    "leaky-pages": (f"{HERE}/broken_caches.py:LeakyPages", "broken-leaky-pages"),
    "paged-bytes": (f"{HERE}/broken_caches.py:PagedBytesUncounted", "broken-paged-bytes"),
    "dsa-interleaved-rope": (f"{HERE}/broken_backends.py:InterleavedIndexerRope", "broken-dsa-interleaved-indexer-rope"),
    "dsa-topk-off-by-one": (f"{HERE}/broken_backends.py:TopkOffByOne", "broken-dsa-topk-off-by-one"),
    "dsa-keys-hidden": (f"{HERE}/broken_backends.py:IndexerKeysHidden", "broken-dsa-indexer-keys-hidden"),
    "dsa-v32-prefix-bf16": (f"{HERE}/deepseek_v32_backend.py:DeepSeekV32PreFixBF16Key",
                            "broken-dsa-v32-prefix-interleaved-bf16"),
}

#: correct backends written independently of the reference: on their cells (every cell's first
#: parametrisation, or the tests named) they must pass, or skip where they do not implement an optional
#: part (paging, quantized codecs)
CORRECT = {
    "independent": (f"{HERE}/independent_backend.py:IndependentMLA", "independent-absorbed"),
    "overallocating": (f"{HERE}/broken_caches.py:OverAllocating", "independent-overallocating"),
    "v3-style": (f"{HERE}/v3_reference_backend.py:DeepSeekV3StyleMLA", "deepseek-v3-style"),
    "reference-dsa": ("reference-dsa", "reference-dsa"),
    # the base contract as the README shows it, frozen (never edited): its verdict must not move as features land
    "frozen-base": (f"{HERE}/frozen_base_backend.py:MyBackend", "my-mla"),
}
CORRECT_TESTS = {
    "independent": "all but V3 dims",  # every cell but the V3-dims bytes (2 s of weights; same rule as bytes_formula)
    "frozen-base": "all but V3 dims",
    "overallocating": ("suites/test_cache_bytes.py::test_seed_table", "suites/test_cache_bytes.py::test_bytes_formula"),
    "v3-style": ("suites/test_numerics.py::test_against_float64", "suites/test_numerics.py::test_incremental_equals_prefill",
                 "suites/test_conventions.py::test_yarn_rope_attention_factor_convention",
                 "suites/test_checkpoint.py::test_prefill_decode_on_checkpoint",
                 "suites/test_generation_golden.py::test_golden_generation", "suites/test_cache_bytes.py::test_seed_table"),
    "reference-dsa": ("suites/test_dsa.py::test_sparse_attention", "suites/test_dsa.py::test_short_context_is_dense",
                      "suites/test_dsa.py::test_selection", "suites/test_cache_bytes.py::test_bytes_formula_dsa",
                      "suites/test_dsa.py::test_cache_bytes_v32_dims", "suites/test_dsa.py::test_indexer_scores"),
}

#: conformance test (file::function) -> [(broken key, the parametrisation after the backend name)]
KILL_MATRIX = {
    "suites/test_cache_bytes.py::test_seed_table": [("expanded-uint8", "")],
    "suites/test_cache_bytes.py::test_bytes_formula": [("lying-bytes", "-6-2-3-float32-tiny")],
    "suites/test_cache_bytes.py::test_bytes_formula_v3_dims": [("lying-bytes", "-deepseek-v3")],
    "suites/test_cache_bytes.py::test_bytes_formula_dsa": [("dsa-keys-hidden", "-6-2-3-tiny-dsa-bfloat16")],
    "suites/test_dsa.py::test_sparse_attention": [("dsa-interleaved-rope", "-float32-prefill"),
                                                  ("dsa-topk-off-by-one", "-float32-varlen_batch")],
    "suites/test_dsa.py::test_short_context_is_dense": [("dsa-topk-off-by-one", "-0-prefill-tiny-dsa-float32")],
    "suites/test_dsa.py::test_selection": [("dsa-interleaved-rope", "-prefill"),
                                           ("dsa-v32-prefix-bf16", "-v3.2-mini-varlen_batch")],
    "suites/test_dsa.py::test_cache_bytes_v32_dims": [("dsa-keys-hidden", "-6-2-3")],
    "suites/test_dsa.py::test_indexer_scores": [("dsa-interleaved-rope", "-float32-prefill_decode")],
    "suites/test_numerics.py::test_against_float64": [("decode-position", "-float32-prefill_decode-tiny"),
                                                      ("rope-layout", "-bfloat16-varlen_batch-v3-mini")],
    "suites/test_numerics.py::test_float16": [("kv-b-swapped", "-tiny")],
    "suites/test_numerics.py::test_incremental_equals_prefill": [("decode-position", "-float32-tiny")],
    "suites/test_checkpoint.py::test_prefill_decode_on_checkpoint": [("kv-b-swapped", "fixture-{b}-float32")],
    "suites/test_conventions.py::test_yarn_rope_attention_factor_convention": [("rope-layout", "")],
    "suites/test_generation_golden.py::test_golden_generation": [("kv-b-swapped", "-tiny-short"),
                                                                 ("dsa-interleaved-rope", "-tiny-dsa-short")],
    "suites/test_generation_golden.py::test_golden_generation_per_codec": [("int8-codec", "-int8-g32")],
    "suites/test_paged_cache.py::test_paged_equals_contiguous": [("leaky-pages", "-tiny-float32-16")],
    "suites/test_paged_cache.py::test_nan_in_unused_pages_never_reaches_outputs": [("leaky-pages", "")],
    "suites/test_paged_cache.py::test_paged_cache_bytes": [("paged-bytes", "")],
    "suites/test_quantized_kv.py::test_codec_bytes": [("scales-not-counted", "-int8-g32-tiny-bfloat16")],
    "suites/test_quantized_kv.py::test_attention_error": [("int8-codec", "-int8-g32")],
}

#: crashes are errors, not verdicts: (broken spec, name, node id) that must come out "error"
ERROR_CELLS = [
    (f"{HERE}/broken_backends.py:RaisesOnDecode", "broken-raises",
     "suites/test_numerics.py::test_against_float64[broken-raises-float32-prefill_decode-tiny]"),
    (f"{HERE}/broken_backends.py:WrongShape", "broken-wrong-shape",
     "suites/test_cache_bytes.py::test_seed_table[broken-wrong-shape]"),
]

#: conformance-looking tests that are not verdicts, with the reason
EXEMPT = {
    "suites/test_decode_bench.py::test_decode_step": "a timing (benchmark marker): figures, not a verdict",
    "suites/test_decode_bench.py::test_sparse_decode_step": "a timing (benchmark marker): figures, not a verdict",
}


def _node(test: str, name: str, params: str) -> str:
    inside = params.replace("{b}", name) if "{b}" in params else name + params
    return f"{test}[{inside}]"


def node_ids() -> list[tuple[str, str, str]]:
    """(test, broken key, node id) of every cell."""
    return [(test, key, _node(test, BROKEN[key][1], params))
            for test, cells in KILL_MATRIX.items() for key, params in cells]


def correct_node_ids() -> list[tuple[str, str, str]]:
    """(test, correct key, node id): every cell's parametrisation on every correct backend."""
    return [(test, key, _node(test, CORRECT[key][1], params))
            for test, cells in KILL_MATRIX.items() for key in CORRECT for _, params in cells[:1]
            if (test in CORRECT_TESTS[key] if isinstance(CORRECT_TESTS[key], tuple)
                else not test.endswith("test_bytes_formula_v3_dims"))]
