"""Conformance checks shared by the suites, the meta tests and the ``run`` command.

Each check takes a backend and raises ``AssertionError`` (with a message naming the backend, the
scenario and the measured numbers) when the backend does not conform; ``pytest.skip`` is raised
through :func:`require_support` with the backend's own sentence when it opts out.

One job per module, re-exported here under the names the suites call as ``checks.X``:

* :mod:`~mla_conformance.checks.tolerances` -- the tolerance tables, each number with its reason;
* :mod:`~mla_conformance.checks.metrics` -- error metrics, dtype names, the margin, the NaN sentences;
* :mod:`~mla_conformance.checks.layer.driver` -- running a backend through a scenario (weights, inputs, poison);
* :mod:`~mla_conformance.contract.calls` -- the call boundary the driver uses (``call_backend``, ``check_output``:
  the contract's, named here too);
* :mod:`~mla_conformance.checks.layer.bytes` -- the byte formulas, THE byte measurement, :func:`cache_bytes`;
* :mod:`~mla_conformance.checks.layer.numerics` -- outputs against the float64 reference;
* :mod:`~mla_conformance.checks.layer.diagnose` -- oracles of known bug classes, for "likely cause";
* per suite: :mod:`~mla_conformance.checks.layer.dsa`, :mod:`~mla_conformance.checks.layer.paged`,
  :mod:`~mla_conformance.checks.layer.codecs`, :mod:`~mla_conformance.checks.layer.golden`,
  :mod:`~mla_conformance.checks.layer.checkpoint` (imported by their suites as submodules).

By level: ``checks/layer/`` checks a backend through the layer contract (attend() over scenarios),
``checks/op/`` an op through the op contract (its namespace, ``from mla_conformance.checks import op as oc``, over
inputs, run and compare; a module per optional method and per engine-call shape); beside them, what both use:
tolerances, metrics, and the generated cases (generated, strategies).
"""

from __future__ import annotations

from mla_conformance.checks.layer.bytes import (INDEXER_FORMATS, WrittenBytes, cache_bytes, default_indexer_format,
                                          format_bytes_per_token, indexer_bytes_per_token, indexer_elements,
                                          indexer_format_of, measure_written_bytes, per_token_elements,
                                          v2_lite_cache_probe)
from mla_conformance.checks.layer.driver import (SCENARIOS, Scenario, diagnosis, inputs_for, master_weights, require_support,
                                           run_scenario, scenario_lengths, weights_for)
from mla_conformance.checks.layer.numerics import (NUMERICS_PRESETS, incremental_equals_prefill, likely_cause_message,
                                                   numerics)
from mla_conformance.checks.metrics import (DTYPES, NAN_FROM_POISON, NAN_OWN, dtype_name, error_metrics, format_metrics,
                                            margin, row_metrics)
from mla_conformance.checks.tolerances import (ANCHOR_TOLERANCES, FP8_E4M3_PRODUCT_ERROR, OP_ACC_ROUNDINGS,
                                               OP_DOT_ROUNDINGS, OP_LSE_ROUNDING, OP_TOLERANCES, TOLERANCES,
                                               OpTolerance, Tolerance, tolerance_figures, unit_roundoff)
from mla_conformance.contract.calls import NAN_HINT, NonFiniteOutput, call_backend, check_output, tensors_of_checked

__all__ = [
    "ANCHOR_TOLERANCES", "DTYPES", "FP8_E4M3_PRODUCT_ERROR", "INDEXER_FORMATS", "NAN_FROM_POISON", "NAN_HINT",
    "NAN_OWN", "NUMERICS_PRESETS", "NonFiniteOutput", "OP_ACC_ROUNDINGS", "OP_DOT_ROUNDINGS", "OP_LSE_ROUNDING", "OP_TOLERANCES",
    "OpTolerance", "SCENARIOS", "Scenario", "TOLERANCES", "Tolerance", "WrittenBytes", "cache_bytes", "call_backend",
    "check_output", "default_indexer_format", "diagnosis", "dtype_name", "error_metrics", "format_bytes_per_token",
    "format_metrics", "incremental_equals_prefill", "indexer_bytes_per_token", "indexer_elements",
    "indexer_format_of", "inputs_for", "likely_cause_message", "margin", "master_weights", "measure_written_bytes",
    "numerics", "per_token_elements", "require_support", "row_metrics", "run_scenario", "scenario_lengths",
    "tensors_of_checked", "tolerance_figures", "unit_roundoff", "v2_lite_cache_probe", "weights_for",
]
