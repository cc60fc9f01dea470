"""The generated-case meta run's tables (tests/meta/test_generated_meta.py reads them; tests/meta/kill_matrix.py runs
their cells in the layer matrix's process): each broken geometry implementation, the generated test that must fail
it and what its shrunk case must show, and the correct wide-declaring implementations."""

import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SUITES = ["suites/test_op_generated.py", "suites/test_layer_generated.py"]
OPS = ROOT / "tests" / "meta" / "impls" / "kernel_style" / "geometry_ops.py"


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


#: broken implementation -> (option, spec, the name it reports, the generated test that must fail it, what the shrunk
#: case must show: a predicate on the parsed case and the class in words)
BROKEN = {
    "page-bitmask": ("--mla-op", f"{OPS}:BrokenPageBitmask", "broken-page-bitmask", "test_op_generated.py::test_generated_pages",
                     lambda c: not _pow2(c.page) and max(c.lens) > 2 ** int(math.log2(c.page)),
                     "a page size not a power of two, a row past its first 2^floor(log2 P) keys"),
    "tail-head-tile": ("--mla-op", f"{OPS}:BrokenTailHeadTile", "broken-tail-head-tile", "test_op_generated.py::test_generated_heads",
                       lambda c: c.h_q == 126, "126 heads (a tail tile of 62 after one of 64)"),
    "odd-heads": ("--mla-op", f"{OPS}:BrokenOddHeads", "broken-odd-heads", "test_op_generated.py::test_generated_heads",
                  lambda c: c.h_q > 8 and c.h_q % 2 == 1 and c.h_q < 64, "an odd head count above 8"),
    "causal-non-pow2": ("--mla-op", f"{OPS}:BrokenCausalNonPow2", "broken-causal-non-pow2", "test_op_generated.py::test_generated_mtp",
                        lambda c: c.causal and c.s_q == 3, "causal s_q = 3"),
    "rows-capped": ("--mla-op", f"{OPS}:BrokenRowsCapped", "broken-rows-capped-2048", "test_op_generated.py::test_generated_long_rows",
                    lambda c: max(c.lens) > 2048, "a row past 2048 keys"),
    "batch-capped": ("--mla-op", f"{OPS}:BrokenBatchCapped", "broken-batch-capped-32", "test_op_generated.py::test_generated_batch",
                     lambda c: c.batch == 33, "33 rows"),
    "topk-tail": ("--mla-op", f"{OPS}:BrokenTopkTail", "broken-topk-tail-dropped", "test_op_generated.py::test_generated_sparse",
                  lambda c: c.topk is not None and c.topk > 64 and c.topk % 64, "top-k above 64, not a multiple of 64"),
    "zero-new-token-rows": ("--mla-backend", "tests/meta/impls/broken/geometry_backends.py:BrokenZeroNewTokenRows",
                            "broken-zero-new-token-rows", "test_layer_generated.py::test_generated_layer",
                            lambda c: c.batch >= 2 and c.chunk is not None and c.chunk < max(c.prefill) and c.decode >= 1,
                            "ragged rows prefilled in chunks (a row with no new tokens in a call), then decode"),
}
#: correct implementations: every generated test of theirs must pass
CORRECT = {"wide-geometry-op": ("--mla-op", f"{OPS}:WideOp"),
           "independent-absorbed": ("--mla-backend", "tests/meta/impls/independent/backend.py:IndependentMLA")}


def _node(test: str, name: str) -> str:
    return f"suites/{test}[{name}]"


CELLS = {key: _node(test, name) for key, (_, _, name, test, _, _) in BROKEN.items()}
