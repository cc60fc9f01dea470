"""Checks of the op contract (:mod:`mla_conformance.contract.op`) shared by ``suites/test_op_*.py``: one name space
(``from mla_conformance.checks import op as oc``) over the three modules that do the work:

* **inputs** (:mod:`~mla_conformance.checks.op.inputs`: :func:`make_case`, :class:`Spec`, :func:`build`): the
  first case the op accepts; paged caches behind shuffled block tables, NaN (0xFF bytes for the FP8 layout) in
  every unused page and in the unfilled tail of each row's last page, unused block-table entries set to
  :data:`INVALID_BLOCK`; every buffer the op is handed is a view at the start of a larger allocation whose
  remaining bytes (the canary) are checked after the call, as are the inputs themselves (the op must not
  write them). Inputs are deterministic (seeded) and built once per session (:func:`build` is cached), as is
  the float64 oracle of each (:func:`oracle_of`);
* **running** (:mod:`~mla_conformance.checks.op.run`: :func:`run_op`): the op declines a case with
  ``unsupported_reason`` (the test skips with its sentence); an op that raises or returns the wrong type, shape
  or dtype is a :class:`~mla_conformance.errors.BackendError` / ``BackendOutputError`` (an *error*, not a
  failure);
* **comparing** (:mod:`~mla_conformance.checks.op.compare`: :func:`compare`, :func:`check_against_oracle`): out
  and lse against the oracle (lse converted from the op's declared ``lse_base``; a query with no keys must give
  out exactly 0 and the declared ``empty_row`` infinity; NaN in a query with keys fails), within
  :data:`mla_conformance.checks.OP_TOLERANCES`;
* **engine calls** (:mod:`~mla_conformance.checks.op.calls`: :func:`check_out_buffers`, :func:`check_speculative`):
  caller-owned out= / lse= buffers (``out_buffers``), causal multi-token decode over an engine's persistent tables.

Every failure message names the op, the case (:meth:`OpCase.describe`), the check and the measured numbers;
``figures`` (the test's ``mla_figures``) is filled before anything is raised.
"""

from __future__ import annotations

from mla_conformance.checks.metrics import OP_NAN_HINT as NAN_HINT
from mla_conformance.checks.metrics import dtype_name
from mla_conformance.checks.op.compare import (as_reference, bitwise_equal, bounds, check_against_oracle, compare,
                                               oracle_of, tolerance_for, top_left_oracle_of)
from mla_conformance.checks.op.inputs import (CANARY_BYTE, CANARY_BYTES, INT_MAX, INVALID_BLOCK, INVALID_KINDS,
                                              KNOWN_PAGE_SIZES, SOFTMAX_SCALE, Buffer, OpInputs, Spec, build,
                                              check_fp8_probe_scales, declared_spec, dense_of_selection, two_caches,
                                              first_supported, has_rows_without_keys, variant_label, kinds_of_rows_without_keys, make_case, make_case_and_lens,
                                              page_order, page_sizes, pick_page, require, require_declared, require_invalid_kind,
                                              selected_slots, single_row, split_at_pages, unsupported, where)
from mla_conformance.checks.op.run import run_op, validate
from mla_conformance.checks.op.calls import LAYOUTS, check_out_buffers, check_speculative, engine_tables
from mla_conformance.checks.tolerances import OP_TOLERANCES, OpTolerance
from mla_conformance.model.attention_oracles import lse_to_natural, merge_by_lse

__all__ = ["KNOWN_PAGE_SIZES", "INVALID_BLOCK", "INT_MAX", "INVALID_KINDS", "SOFTMAX_SCALE", "CANARY_BYTES",
           "CANARY_BYTE", "NAN_HINT", "OP_TOLERANCES", "OpTolerance", "Spec", "OpInputs", "Buffer", "build",
           "oracle_of", "run_op", "validate", "compare", "check_against_oracle", "bitwise_equal", "make_case",
           "make_case_and_lens", "has_rows_without_keys", "kinds_of_rows_without_keys", "bounds", "top_left_oracle_of", "pick_page", "page_order", "page_sizes", "variant_label",
           "require", "require_declared", "first_supported", "unsupported", "tolerance_for", "merge_by_lse",
           "lse_to_natural", "where", "dtype_name", "split_at_pages", "single_row", "selected_slots",
           "dense_of_selection", "two_caches", "as_reference", "declared_spec", "check_fp8_probe_scales", "require_invalid_kind",
           "LAYOUTS", "check_out_buffers", "check_speculative", "engine_tables"]
