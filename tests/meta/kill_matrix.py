"""The kill matrix of both contracts: every conformance test and a broken implementation that must make it
*fail* -- an AssertionError verdict naming it, recorded as outcome "failed", not a crash ("error"), a skip or a
pass -- and the correct implementations, written independently of the reference, that must pass.

* layer: every test function of suites/ that takes the ``mla_backend`` fixture; a broken backend per cell
  (:data:`KILL_MATRIX`), the correct backends (:data:`CORRECT`), crashes that must be errors (:data:`ERROR_CELLS`);
* op: every test of suites/test_op_*.py (it takes ``mla_op``); a broken op and the op tests it must fail
  (:data:`BROKEN_OPS`), the correct ops (:data:`CORRECT_OPS`), crashing ops (:data:`ERROR_OPS`);
* the suite files whose broken implementations another meta module runs (:data:`ELSEWHERE`): the
  generated-case properties and the op methods beyond decode.

Data, and the runs that read it, each through tests/meta/harness.py as a user runs the suite, selecting its
tests by node id or suite file on its command line: :func:`layer_matrix_run` (read by tests/meta/test_kill_matrix.py),
:func:`op_cells_run` and :func:`op_correct_run` (tests/meta/test_op_meta.py), :func:`method_cells_run` and
:func:`method_correct_run` (tests/meta/test_op_methods_meta.py), :func:`generated_runs` (tests/meta/test_generated_meta.py)
and :func:`readme_runs` (the README's backend and op over the whole default suite, its failing variant on
:data:`FAILURE_TEST`: tests/meta/test_readme_template.py). Each is made once per session (tests/conftest.py ``suite_run``).
"""

import re

from mla_conformance.contract.methods import METHOD_SUITES

from . import harness
from .generated_cells import BROKEN as GENERATED, CELLS as GENERATED_CELLS, CORRECT as GENERATED_CORRECT
from .generated_cells import SUITES as GENERATED_SUITES
from .method_cells import BROKEN_OPS as METHOD_BROKEN, CELLS as METHOD_CELLS, CORRECT_OPS as METHOD_CORRECT
from .method_cells import ERROR_OPS as METHOD_ERRORS, ERRORS as METHOD_ERROR_CELLS

HERE = "tests/meta"

#: backend spec -> the name it reports (test ids carry the name)
BROKEN = {
    "rope-layout": (f"{HERE}/impls/broken/backends.py:RopeLayoutMixup", "broken-rope-layout"),
    "kv-b-swapped": (f"{HERE}/impls/broken/backends.py:KvBSwapped", "broken-kv-b-swapped"),
    "decode-position": (f"{HERE}/impls/broken/backends.py:ShiftedDecodePosition", "broken-decode-position"),
    "lying-bytes": (f"{HERE}/impls/broken/backends.py:LyingBytes", "broken-lying-bytes"),
    "expanded-uint8": (f"{HERE}/impls/broken/caches.py:ExpandedUint8ClaimsLatent", "broken-expanded-uint8-pool"),
    "scales-not-counted": (f"{HERE}/impls/broken/caches.py:ScalesNotCounted", "broken-scales-not-counted"),
    "int8-codec": (f"{HERE}/impls/broken/caches.py:BadInt8Codec", "broken-int8-codec"),
    "leaky-pages": (f"{HERE}/impls/broken/caches.py:LeakyPages", "broken-leaky-pages"),
    "paged-bytes": (f"{HERE}/impls/broken/caches.py:PagedBytesUncounted", "broken-paged-bytes"),
    "dsa-interleaved-rope": (f"{HERE}/impls/broken/backends.py:InterleavedIndexerRope", "broken-dsa-interleaved-indexer-rope"),
    "dsa-topk-off-by-one": (f"{HERE}/impls/broken/backends.py:TopkOffByOne", "broken-dsa-topk-off-by-one"),
    "dsa-keys-hidden": (f"{HERE}/impls/broken/backends.py:IndexerKeysHidden", "broken-dsa-indexer-keys-hidden"),
    "dsa-v32-prefix-bf16": (f"{HERE}/impls/independent/deepseek_v32_backend.py:DeepSeekV32PreFixBF16Key",
                            "broken-dsa-v32-prefix-interleaved-bf16"),
    # padded batches (tests/meta/impls/broken/padding_backends.py): idle rows, multi-token steps
    "idle-row-decodes": (f"{HERE}/impls/broken/padding_backends.py:IdleRowDecodes", "broken-idle-row-decodes"),
    "idle-row-writes-slot": (f"{HERE}/impls/broken/padding_backends.py:IdleRowWritesSlot", "broken-idle-row-writes-slot"),
    "idle-rows-compacted": (f"{HERE}/impls/broken/padding_backends.py:IdleRowsCompacted", "broken-idle-rows-compacted"),
    "verify-same-output": (f"{HERE}/impls/broken/padding_backends.py:VerifyStepSameOutput", "broken-verify-step-same-output"),
    "verify-padding-appended": (f"{HERE}/impls/broken/padding_backends.py:VerifyPaddingAppended",
                                "broken-verify-padding-appended"),
}
#: a layer cell's failure must say this (the likely cause), for the broken backends named
LAYER_HINTS = {"idle-row-decodes": "was idle (lengths 0) but its seq_lens went",
               "idle-row-writes-slot": "the token storage of idle row(s) [1, 3] (lengths 0) changed",
               "idle-rows-compacted": "likely cause: the idle rows (lengths 0) change their neighbours",
               "verify-same-output": "likely cause: every query position of a multi-token step gets the same output",
               "verify-padding-appended": "likely cause: the right padding counted as tokens"}

#: correct backends written independently of the reference: on their cells (every cell's first
#: parametrisation, or the tests named) they must pass, or skip where they do not implement an optional
#: part (paging, quantized codecs)
CORRECT = {
    "independent": (f"{HERE}/impls/independent/backend.py:IndependentMLA", "independent-absorbed"),
    "overallocating": (f"{HERE}/impls/broken/caches.py:OverAllocating", "independent-overallocating"),
    "v3-style": (f"{HERE}/impls/independent/v3_reference_backend.py:DeepSeekV3StyleMLA", "deepseek-v3-style"),
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
    "suites/test_layer_padding.py::test_idle_rows": [("idle-row-decodes", ""), ("idle-row-writes-slot", ""),
                                                     ("idle-rows-compacted", "")],
    "suites/test_layer_padding.py::test_multi_token_steps": [("verify-same-output", ""),
                                                             ("verify-padding-appended", "")],
}

#: crashes are errors, not verdicts: (broken spec, name, node id) that must come out "error"
ERROR_CELLS = [
    (f"{HERE}/impls/broken/backends.py:RaisesOnDecode", "broken-raises",
     "suites/test_numerics.py::test_against_float64[broken-raises-float32-prefill_decode-tiny]"),
    (f"{HERE}/impls/broken/backends.py:WrongShape", "broken-wrong-shape",
     "suites/test_cache_bytes.py::test_seed_table[broken-wrong-shape]"),
]

#: conformance-looking tests that are not verdicts, with the reason
EXEMPT = {
    "suites/test_decode_bench.py::test_decode_step": "a timing (benchmark marker): figures, not a verdict",
    "suites/test_decode_bench.py::test_sparse_decode_step": "a timing (benchmark marker): figures, not a verdict",
}

#: suite files whose broken implementations another meta run holds -> its tables: the generated-case
#: properties (their broken backends and ops are shapes nobody listed) and the op methods beyond decode
ELSEWHERE = {
    "suites/test_deepseek_v4.py": f"{HERE}/test_v4_meta.py",
    "suites/test_v4_golden.py": f"{HERE}/test_v4_meta.py",
    "suites/test_layer_generated.py": f"{HERE}/generated_cells.py",
    "suites/test_op_generated.py": f"{HERE}/generated_cells.py",
    **{f"suites/{name}": f"{HERE}/method_cells.py" for name in METHOD_SUITES},
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


# --------------------------------------------------------------------------- the op contract

OPS = f"{HERE}/impls/broken/ops.py"
CALL_OPS = f"{HERE}/impls/broken/call_ops.py"
KERNEL_OPS = f"{HERE}/impls/kernel_style/kernel_ops.py"
FROZEN = f"{HERE}/frozen_base_op.py"
ENGINE_OPS = f"{HERE}/impls/kernel_style/engine_ops.py"
BROKEN_ENGINE = f"{HERE}/impls/broken/engine_ops.py"

#: broken op -> (spec, the name it reports, the op tests (file::function[params after the op name]) that must fail it)
BROKEN_OPS = {
    "ignores-extra-cache": (f"{OPS}:IgnoresExtraCache", "broken-ignores-extra-cache",
                            ["test_op_sparse.py::test_sparse_two_caches[-all]"]),
    "ignores-extra-topk-length": (f"{OPS}:IgnoresExtraTopkLength", "broken-ignores-extra-topk-length",
                                  ["test_op_sparse.py::test_sparse_two_caches[-lengths]"]),
    "lse-base2-as-e": (f"{OPS}:Base2DeclaredE", "broken-lse-base2-as-e",
                       ["test_op_numerics.py::test_out_lse_vs_oracle[-float32]", "test_op_numerics.py::test_split_kv_merge[-1]",
                        "test_op_sparse.py::test_sparse_vs_oracle[]"]),
    "lse-natural-as-2": (f"{OPS}:NaturalDeclaredBase2", "broken-lse-natural-as-2",
                         ["test_op_numerics.py::test_out_lse_vs_oracle[-float32]"]),
    "nan-empty-rows": (f"{OPS}:NanForEmptyRows", "broken-nan-empty-rows",
                       ["test_op_paging.py::test_empty_and_single_key_rows[]",
                        "test_op_sparse.py::test_sparse_all_invalid_rows[]", "test_op_numerics.py::test_split_kv_merge[-2]"]),
    "reads-page-tail": (f"{OPS}:ReadsPageTail", "broken-reads-page-tail",
                        ["test_op_paging.py::test_poisoned_pages[]", "test_op_fp8.py::test_fp8_all_zero_kv[]"]),
    "top-left-causal": (f"{OPS}:TopLeftCausal", "broken-top-left-causal",
                        ["test_op_paging.py::test_multi_token_decode[-4-causal]"]),
    "minus-one-last-token": (f"{OPS}:MinusOneIsLastToken", "broken-minus-one-last-token",
                             ["test_op_sparse.py::test_sparse_invalid_indices[-minus-one]",
                              "test_op_sparse.py::test_sparse_equals_dense[]"]),
    "attn-sink-ignored": (f"{OPS}:SinkIgnored", "broken-attn-sink-ignored",
                          ["test_op_sparse.py::test_attn_sink[]", "test_op_numerics.py::test_attn_sink_dense[]"]),
    # P kept to 3 bits fewer than the cache dtype: an error ~4x the derived bound (written without the reference)
    "coarse-p": (f"{KERNEL_OPS}:CoarsePOp", "broken-coarse-p",
                 ["test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]",
                  "test_op_numerics.py::test_out_lse_vs_oracle[-float16]"]),
    "fp8-exponent-only": (f"{OPS}:Fp8ExponentOnly", "broken-fp8-exponent-only", ["test_op_fp8.py::test_fp8_scale_probe[]"]),
    "fp8-scales-as-bf16": (f"{OPS}:Fp8ScalesAsBf16", "broken-fp8-scales-as-bf16",
                           ["test_op_fp8.py::test_fp8_scale_probe[]", "test_op_fp8.py::test_fp8_vs_dequantized_oracle[]"]),
    "writes-past-block-table": (f"{OPS}:WritesPastBlockTable", "broken-writes-past-block-table",
                                ["test_op_paging.py::test_poisoned_pages[]"]),
    "ignores-q-strides": (f"{OPS}:IgnoresQStrides", "broken-ignores-q-strides", ["test_op_paging.py::test_noncontiguous_q[]"]),
    "naive-softmax": (f"{OPS}:NaiveSoftmax", "broken-naive-softmax", ["test_op_fp8.py::test_fp8_magnitude_sweep[-x256]"]),
    "ignores-topk-length": (f"{OPS}:IgnoresTopkLength", "broken-ignores-topk-length",
                            ["test_op_sparse.py::test_sparse_topk_length[]"]),
    "nondeterministic": (f"{OPS}:Nondeterministic", "broken-nondeterministic", ["test_op_numerics.py::test_deterministic[]"]),
    "batch-variant": (f"{OPS}:BatchVariant", "broken-batch-variant", ["test_op_numerics.py::test_batch_invariant[]"]),
    "heads-capped": (f"{OPS}:HeadsCapped", "broken-heads-capped-at-64", ["test_op_paging.py::test_head_counts[-128]"]),
    "assumes-page-64": (f"{OPS}:AssumesPage64", "broken-assumes-page-64", ["test_op_paging.py::test_page_sizes[-16]"]),
    # engines' padded CUDA-graph batches and graph replays (tests/meta/impls/broken/engine_ops.py: the reports they model)
    "nan-padding-long-max-len": (f"{BROKEN_ENGINE}:NanPaddingAtLongMaxLen", "broken-nan-padding-at-long-max-len",
                                 ["test_op_padding.py::test_padded_batch[-trailing]"]),
    "reads-block-table-minus-one": (f"{BROKEN_ENGINE}:ReadsBlockTableMinusOne", "broken-reads-block-table-minus-one",
                                    ["test_op_padding.py::test_padded_batch[-trailing]"]),
    "metadata-sized-to-real-rows": (f"{BROKEN_ENGINE}:MetadataSizedToRealRows", "broken-metadata-sized-to-real-rows",
                                    ["test_op_padding.py::test_padded_batch[-trailing]",
                                     "test_op_padding.py::test_padded_batch[-interleaved]"]),
    "zeroes-trailing-rows-only": (f"{BROKEN_ENGINE}:ZeroesTrailingRowsOnly", "broken-zeroes-trailing-rows-only",
                                  ["test_op_padding.py::test_padded_batch[-interleaved]"]),
    "undefined-padding-leaks": (f"{BROKEN_ENGINE}:UndefinedPaddingLeaks", "broken-undefined-padding-leaks",
                                ["test_op_padding.py::test_padded_batch[-interleaved]"]),
    "sparse-reads-at-topk-length-0": (f"{BROKEN_ENGINE}:SparseReadsAtTopkLengthZero",
                                      "broken-sparse-reads-at-topk-length-0",
                                      ["test_op_padding.py::test_padded_sparse_batch[-trailing]",
                                       "test_op_padding.py::test_padded_sparse_batch[-interleaved]"]),
    "stale-plan-on-data-ptr": (f"{BROKEN_ENGINE}:StalePlanOnDataPtr", "broken-stale-plan-on-data-ptr",
                               ["test_op_replay.py::test_graph_replay[-dense]",
                                "test_op_replay.py::test_graph_replay[-sparse]"]),
    # engines' calls (issue 26): preallocated outputs, speculative verification
    "rejects-out": (f"{CALL_OPS}:RejectsOutAtMultiToken", "broken-rejects-out-multi-token",
                    ["test_op_out_buffers.py::test_out_buffers[-2]"]),
    "half-written-out": (f"{CALL_OPS}:HalfWrittenOut", "broken-half-written-out",
                         ["test_op_out_buffers.py::test_out_buffers[-3]"]),
    "new-tensor-out": (f"{CALL_OPS}:NewTensorOut", "broken-new-tensor-out", ["test_op_out_buffers.py::test_out_buffers[-1]"]),
    "ignores-out-strides": (f"{CALL_OPS}:IgnoresOutStrides", "broken-ignores-out-strides",
                            ["test_op_out_buffers.py::test_out_buffers_strided[-tokens-first]",
                             "test_op_out_buffers.py::test_out_buffers_strided[-heads-first]"]),
    "same-output": (f"{CALL_OPS}:SameOutputAllPositions", "broken-same-output-all-positions",
                    ["test_op_speculative.py::test_speculative_verify[-6]"]),
    "rows-past-batch": (f"{CALL_OPS}:ReadsRowsPastBatch", "broken-reads-rows-past-batch",
                        ["test_op_speculative.py::test_speculative_verify[-3]"]),
    "nan-at-q-len-2": (f"{CALL_OPS}:NanAtQLen2", "broken-nan-at-q-len-2",
                       ["test_op_paging.py::test_multi_token_decode[-2-causal]"]),
}

#: a failure message must say this (the likely cause) for the broken op's cells
HINTS = {"top-left-causal": "likely cause: top-left causal alignment",
         "nan-padding-long-max-len": "only at a long max length",
         "reads-block-table-minus-one": "the op read a page through a padding row",
         "metadata-sized-to-real-rows": "xLLM #1939",
         "zeroes-trailing-rows-only": "as if padding always trailed the batch",
         "undefined-padding-leaks": "NaN leaked into a real row",
         "sparse-reads-at-topk-length-0": "the op read a key through a padding row",
         "stale-plan-on-data-ptr": "state the op kept from an earlier call",
         "rejects-out": "rejects a legal preallocated buffer", "half-written-out": "only query position 0 of each row",
         "new-tensor-out": "is not the buffer it was handed", "ignores-out-strides": "likely cause: the op wrote its out / lse buffers as if they were contiguous",
         "same-output": "likely cause: every query position of row",
         "rows-past-batch": "likely cause: the op reads block_table / cache_seqlens rows past the batch",
         "nan-at-q-len-2": "non-finite value(s) in queries with keys",
         "lse-natural-as-2": "the lse matches the natural log"}

#: correct ops: every op test runs on them; "all" must pass; otherwise they may skip only with the sentences
#: of SKIPS[mode] (their own unsupported_reason, or a declaration they do not make)
CORRECT_OPS = {
    "independent": (f"{HERE}/impls/independent/op.py:IndependentOp", "independent-op", "all"),
    "base-contract": (f"{HERE}/impls/independent/op.py:BaseContractOp", "base-contract-op", "base"),
    # P rounded to the cache dtype before P.V, float32 accumulation, online softmax over pages (half precision)
    "p-rounding-bf16": (f"{KERNEL_OPS}:PRoundingOp", "p-rounding-op", "dtype"),
    "p-rounding-fp16": (f"{KERNEL_OPS}:PRoundingFp16Op", "p-rounding-fp16-op", "dtype"),
    "split-kv": (f"{KERNEL_OPS}:SplitKVOp", "split-kv-op", "dtype"),
    "no-lse-triton": (f"{KERNEL_OPS}:NoLseTritonOp", "no-lse-triton-op", "no-lse"),
    "frozen": (f"{FROZEN}:FrozenBaseOp", "frozen-base-op", "frozen"),
    # as engines run decode in padded CUDA-graph batches: split-KV by the batch's max length; padding rows zeroed
    # after the call (vLLM); padding rows left NaN and declared undefined
    "split-by-max-len": (f"{ENGINE_OPS}:SplitByMaxLenOp", "split-by-max-len-op", "engine"),
    "zero-padding-after": (f"{ENGINE_OPS}:ZeroPaddingAfterOp", "zero-padding-after-op", "engine"),
    "undefined-padding": (f"{ENGINE_OPS}:UndefinedPaddingOp", "undefined-padding-op", "engine"),
}
#: a skip that names the declaration opting the op in (the op suite's own sentences)
DECLARATION_SKIPS = ("kv_formats is", "page_block_sizes is", "does not declare sparse_decode",
                     "does not declare attn_sink", "does not declare deterministic", "does not declare batch_invariant",
                     "invalid_index = 'minus-one'", "declares returns_lse = False", "does not declare out_buffers")
SKIPS = {
    "base": ("implements dense decode only", "takes no attn_sink",
             "reads a latent cache in q's dtype only",  # its own sentence, asked before the declarations
             *DECLARATION_SKIPS),
    "dtype": ("computes with a ",),  # the kernel-style ops take one dtype
    "no-lse": ("computes with a ", "leaves a query with no keys undefined", *DECLARATION_SKIPS),
    "frozen": DECLARATION_SKIPS,
    "engine": ("decodes dense over a latent cache, without a sink, only", "leaves a causal query before its row's first "
               "key undefined", "leaves a zero-length row undefined", *DECLARATION_SKIPS),
}

#: crashes and contract violations are errors, not verdicts
ERROR_OPS = {
    "raises": (f"{OPS}:RaisesOnDecode", "broken-op-raises", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "lse-layout": (f"{OPS}:WrongLseLayout", "broken-op-lse-layout", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "half-lse": (f"{KERNEL_OPS}:HalfLseOp", "broken-half-lse", "test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]"),
}
#: what an error's message must say
ERROR_TEXT = {"half-lse": ("lse is bfloat16, not float32", "significant bits", "merged")}


def _op_node(test: str, name: str) -> str:
    path, rest = test.split("::")
    func, params = rest.split("[")
    return f"suites/{path}::{func}[{name}{params}"


#: (broken op key, op test, node id) of every op cell; (error op key, node id) of every crash cell
OP_CELLS = [(key, test, _op_node(test, name)) for key, (_, name, tests) in BROKEN_OPS.items() for test in tests]
OP_ERRORS = [(key, _op_node(test, name)) for key, (_, name, test) in ERROR_OPS.items()]
#: every op of the op matrix, in the order the run names them
OP_SPECS = [spec for spec, _, _ in [*BROKEN_OPS.values(), *CORRECT_OPS.values(), *ERROR_OPS.values()]]


#: the op suites of the op matrix: every suites/test_op_*.py but those another meta module kills (ELSEWHERE)
OP_SUITES = [f"suites/{p.name}" for p in sorted((harness.ROOT / "suites").glob("test_op_*.py"))
             if f"suites/{p.name}" not in ELSEWHERE]
#: the suites of the op methods beyond decode (their matrix: tests/meta/test_op_methods_meta.py, run in this process)
METHOD_SUITE_FILES = [f"suites/{name}" for name in METHOD_SUITES]

# --------------------------------------------------------------------------- the README's blocks, and the run

README = harness.ROOT / "README.md"
BACKEND_SECTION, OP_SECTION = "## Check your own backend", "## Check your own kernel"
#: The failure the README shows: its backend without YaRN's mscale^2 (the `scale *=` line of `yarn`), this test.
FAILURE_TEST = "suites/test_numerics.py::test_against_float64[my-mla-float32-prefill-deepseek-v2-lite]"
MSCALE_LINE = re.compile(r"^ +scale \*= .*\n", re.M)
#: the name the README's backend reports, and the names its blocks report in the layer matrix's session (one
#: session's backends need unique names, and the frozen backend is "my-mla" too): its backend, its failing
#: variant, its op (its own name)
README_BACKEND = "my-mla"
README_NAMES = {"backend": "readme-my-mla", "mutant": "readme-my-mla-no-mscale", "op": "my-op"}
#: FAILURE_TEST on the failing variant, as the layer matrix's session names it
MUTANT_TEST = FAILURE_TEST.replace(f"[{README_BACKEND}-", f"[{README_NAMES['mutant']}-")


def readme_block(section: str) -> str:
    """The python block under ``section`` of README.md."""
    text = README.read_text(encoding="utf-8")
    assert section in text, f"README.md has no section {section!r}"
    block = re.search(r"```python\n(.*?)```", text[text.index(section):], re.S)
    assert block, f"README.md's {section!r} has no python block"
    return block.group(1)


def _renamed(block: str, name: str) -> str:
    out, n = re.subn(rf'^( +name = )"{re.escape(README_BACKEND)}"$', rf'\1"{name}"', block, flags=re.M)
    assert n == 1, f"README's backend has {n} `name = \"{README_BACKEND}\"` lines (expected one)"
    return out


def readme_specs(tmp) -> tuple[list[str], list[str]]:
    """The README's backend, its failing variant (the one `scale *=` line removed) and its op written to files
    in ``tmp``; returns (backend specs, op specs)."""
    backend = readme_block(BACKEND_SECTION)
    mutant, n = MSCALE_LINE.subn("", backend)
    assert n == 1, f"README's backend has {n} `scale *=` lines; the failure it shows removes exactly one"
    files = {"readme_backend.py": _renamed(backend, README_NAMES["backend"]),
             "readme_backend_no_mscale.py": _renamed(mutant, README_NAMES["mutant"]),
             "readme_op.py": readme_block(OP_SECTION)}
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    return [f"{tmp / 'readme_backend.py'}:MyBackend", f"{tmp / 'readme_backend_no_mscale.py'}:MyBackend"], \
        [f"{tmp / 'readme_op.py'}:MyOp"]


def layer_matrix_run(pytester) -> harness.SuiteRun:
    """Every layer cell on its broken backend, the correct backends' cells, the crash cells."""
    specs = [*(spec for spec, _ in [*BROKEN.values(), *CORRECT.values()]), *(spec for spec, _, _ in ERROR_CELLS)]
    cells = [n for _, _, n in node_ids() + correct_node_ids()] + [n for _, _, n in ERROR_CELLS]
    return harness.run_inprocess(pytester, cells, backends=specs, expect=1)


def op_cells_run(pytester) -> harness.SuiteRun:
    """Every op cell on its broken op, the crash cells of the erroring ops."""
    ops = [spec for spec, _, _ in [*BROKEN_OPS.values(), *ERROR_OPS.values()]]
    return harness.run_inprocess(pytester, [*(n for _, _, n in OP_CELLS), *(n for _, n in OP_ERRORS)], ops=ops,
                                 expect=1)


def op_correct_run(pytester) -> harness.SuiteRun:
    """Every test of :data:`OP_SUITES` on every correct op."""
    return harness.run_inprocess(pytester, OP_SUITES, ops=[spec for spec, _, _ in CORRECT_OPS.values()])


def method_cells_run(pytester) -> harness.SuiteRun:
    """The op methods' cells on their broken ops, and the crash cells (tests/meta/method_cells.py)."""
    ops = [s for s, *_ in [*METHOD_BROKEN.values(), *METHOD_ERRORS.values()]]
    cells = [*(n for _, _, n in METHOD_CELLS), *(n for _, n in METHOD_ERROR_CELLS)]
    return harness.run_inprocess(pytester, cells, ops=list(dict.fromkeys(ops)), expect=1)


def method_correct_run(pytester) -> harness.SuiteRun:
    """Every test of the method suites on the correct method ops."""
    return harness.run_inprocess(pytester, METHOD_SUITE_FILES, ops=[s for s, *_ in METHOD_CORRECT.values()])


def _split(specs) -> tuple[list[str], list[str]]:
    return ([s for o, s, *_ in specs if o == "--mla-backend"], [s for o, s, *_ in specs if o == "--mla-op"])


def generated_runs(pytester) -> harness.SuiteRun:
    """The generated-case meta run (tests/meta/generated_cells.py): each broken implementation's cell, and every
    generated test of the correct ones; one SuiteRun of both."""
    backends, ops = _split(GENERATED.values())
    cells = harness.run_inprocess(pytester, list(GENERATED_CELLS.values()), backends=backends, ops=ops, expect=1)
    backends, ops = _split(GENERATED_CORRECT.values())
    return cells.joined(harness.run_inprocess(pytester, GENERATED_SUITES, backends=backends, ops=ops))


def readme_runs(pytester) -> harness.SuiteRun:
    """The README's backend and op over the whole default suite, and its failing variant on FAILURE_TEST: one
    SuiteRun of both."""
    readme_backends, readme_ops = readme_specs(pytester.path)
    whole = harness.run_inprocess(pytester, ["suites"], backends=readme_backends[:1], ops=readme_ops)
    return whole.joined(harness.run_inprocess(pytester, [MUTANT_TEST], backends=readme_backends[1:], expect=1))
