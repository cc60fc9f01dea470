"""Generated cases (hypothesis) for both contracts, checked exactly as the hand-written tests check theirs.

* **op** (:func:`check_op_property`): every case of a property's strata (:mod:`mla_conformance.checks.strategies`)
  is built by the op suite's builder (:func:`mla_conformance.checks.op.build`: poisoned pages of any positive
  size, shuffled block tables, canaries) and compared with the float64 oracle within the same per-element
  derived bounds (:func:`mla_conformance.checks.op.check_against_oracle`, ``OP_TOLERANCES``);
* **layer** (:func:`check_layer_property`): every case drives the backend through the suite's driver
  (:func:`mla_conformance.checks.layer.driver.run_scenario`: poisoned caches, ragged rows, chunked prefill, decode
  steps) and holds each row to the dtype's row of ``TOLERANCES`` against the float64 expanded reference, as
  :func:`mla_conformance.checks.layer.numerics.numerics` does.

A failing case is shrunk by hypothesis to a minimal one; the failure message then ends with that case's line and
the command that replays exactly it (``--mla-case``), and the test's figures carry both (``generated_case``,
``reproducer``). A replay (``replay=`` the case line) checks that one case and nothing else.

``generation`` is the plugin's :class:`mla_conformance.pytest_plugin.generated.Generation` (the test's
``mla_generation`` fixture): the hypothesis settings of the profile, the case to replay, the command builder.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import configuration, errors, given, reject

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op.inputs import not_declared
from mla_conformance.checks.layer.driver import inputs_for, require_support, run_scenario, scenario_lengths
from mla_conformance.checks.layer.driver import Scenario, diagnosis
from mla_conformance.checks.layer.numerics import check_rows, likely_cause_message
from mla_conformance.checks.metrics import DTYPES, error_metrics
from mla_conformance.checks.strategies import (LAYER_CONFIGS, LayerDraw, OpDraw, OpSupport, Stratum, layer_strata,
                                               op_strata, parse_case)
from mla_conformance.contract.layer import support_reason
from mla_conformance.contract.op import OpCase, declared
from mla_conformance.model.config import MLAConfig, PRESETS
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.weights import MLAWeights

#: the dtypes an op is asked in, preferred first (an FP8 cache takes a bfloat16 q)
_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: page sizes tried first, when declared (the rest in the declared order)
_PREFERRED_PAGES = (64, 16, 1)


# --------------------------------------------------------------------------- op cases


def op_support(op, device: str, sizes: str = "default") -> OpSupport:
    """What the strategies may draw for this op: its declared page sizes (any positive size), the (format,
    dtype) pairs it accepts for dense and sparse decode, its invalid-index rule, attn_sink, rows without keys."""
    declared_pages = tuple(int(p) for p in declared(op, "page_block_sizes") if int(p) >= 1)
    pages = tuple(p for p in _PREFERRED_PAGES if p in declared_pages) + \
        tuple(p for p in declared_pages if p not in _PREFERRED_PAGES)
    if not pages:
        pytest.skip(f"{op.name}: declares no positive page_block_sizes ({declared(op, 'page_block_sizes')!r})")

    def probe(**kw) -> str | None:
        reasons = []
        for heads in (16, 64, 128, 1):  # an op may take some head counts only
            base = dict(batch=2, s_q=1, h_q=heads, page_block_size=pages[0], dtype=torch.float32, device=device)
            base.update(kw)
            reason = op_checks.unsupported(op, OpCase(**base))
            if reason is None:
                return None
            reasons.append(reason)
        return reasons[0]

    def formats(**kw):
        pairs, reasons = [], []
        for fmt in declared(op, "kv_formats"):
            for dt in (_DTYPES if fmt == "latent" else ("bfloat16",)):
                reason = probe(kv_format=fmt, dtype=getattr(torch, dt), **kw)
                if reason is None:
                    pairs.append((fmt, dt))
                elif reason not in reasons:
                    reasons.append(reason)
        return tuple(pairs), reasons

    dense, reasons = formats()
    if not dense:
        pytest.skip(f"{op.name}: {'; '.join(reasons)}")
    sparse = formats(topk=32)[0] if declared(op, "sparse_decode") else ()
    invalid = ("minus-one",) + (("past-end", "int-max") if declared(op, "invalid_index") == "out-of-range" else ())
    fmt, dt = dense[0]
    empty = probe(kv_format=fmt, dtype=getattr(torch, dt), rows_without_keys=True) is None
    sink = bool(declared(op, "attn_sink")) and probe(kv_format=fmt, dtype=getattr(torch, dt), attn_sink=True) is None
    return OpSupport(pages=pages, formats=dense, sparse_formats=sparse, invalid=invalid, sink=sink, empty_rows=empty,
                     sizes=sizes)


def op_spec(op, case: OpDraw, device: str) -> op_checks.Spec:
    """The op suite's input spec of a generated case (rows without keys as its inputs have them)."""
    sparse = case.topk is not None
    opcase = OpCase(batch=case.batch, s_q=case.s_q, h_q=case.h_q, page_block_size=case.page,
                    dtype=getattr(torch, case.dtype), kv_format=case.kv_format, topk=case.topk, attn_sink=case.sink,
                    causal=case.causal and not sparse, device=device,
                    **op_checks.kinds_of_rows_without_keys(case.lens, case.s_q, case.causal, sparse))
    if case.all_invalid:
        opcase = dataclasses.replace(opcase, zero_length_rows=True)
    spec = op_checks.Spec(opcase, case.lens, seed=case.seed, scale_format=declared(op, "fp8_scale_format"),
                   noncontig_q=case.noncontig, invalid=case.invalid, all_invalid_rows=case.all_invalid,
                   topk_length=case.topk_length)
    if sparse and not opcase.rows_without_keys:
        # invalid entries and topk_length together can leave a sparse query no valid index: ask the oracle
        if bool(torch.isinf(op_checks.oracle_of(spec)[1]).any()):
            spec = dataclasses.replace(spec, case=dataclasses.replace(opcase, zero_length_rows=True))
    return spec


def op_case_declined(op, case: OpDraw, device: str) -> str | None:
    """The op's sentence for a generated case it declines (the case is then not drawn again)."""
    return op_checks.unsupported(op, op_spec(op, case, device).case)


def check_op_case(op, case: OpDraw, *, device: str, figures: dict) -> None:
    """One generated case against the float64 oracle (the hand-written op tests' bounds and messages)."""
    __tracebackhide__ = True
    op_checks.check_against_oracle(op, op_spec(op, case, device), check=f"generated {case.prop} case", figures=figures)


def check_op_property(op, prop: str, *, device: str, figures: dict, generation) -> None:
    """Every stratum of an op property (or the one case ``generation.case`` replays) against the oracle."""
    __tracebackhide__ = True
    if generation.case is not None:
        case = _replayed(generation.case, OpDraw, prop)
        reason = op_case_declined(op, case, device)
        if reason:
            pytest.skip(f"{op.name}: {reason}")
        figures.update(generated_property=prop, generated_case=str(case), generated_examples=1)
        check_op_case(op, case, device=device, figures=figures)
        return
    support = op_support(op, device, generation.sizes)
    strata = op_strata(prop, support)
    if not strata:
        pytest.skip(f"{op.name}: {not_declared('sparse_decode', 'generated sparse cases')}")
    _run_strata(op.name, prop, strata, generation, figures,
                declined=lambda c: op_case_declined(op, c, device),
                check=lambda c, f: check_op_case(op, c, device=device, figures=f))


# --------------------------------------------------------------------------- layer cases


def layer_config(name: str) -> MLAConfig:
    preset, overrides = LAYER_CONFIGS[name]
    return MLAConfig(**{**copy.deepcopy(PRESETS[preset]), **overrides})


@functools.lru_cache(maxsize=4)
def _master(name: str) -> MLAWeights:
    """The float64 weights of a layer config the oracle uses (never handed to a backend)."""
    return MLAWeights.random(layer_config(name), seed=0, dtype=torch.float64)


@functools.lru_cache(maxsize=8)
def _weights(name: str, dtype: torch.dtype, device: str) -> MLAWeights:
    return _master(name).to(dtype, device=device).clone()


def layer_configs(backend, device: str) -> tuple[tuple[str, int | None], ...]:
    """The layer configs the backend accepts in float32, each with the longest row it is checked on (a DSA
    config's index_topk: within it DeepSeek Sparse Attention selects every key, so the dense float64
    reference is the oracle; None for dense configs)."""
    out = []
    for name in LAYER_CONFIGS:
        config = layer_config(name)
        if support_reason(backend, config, dtype=torch.float32, device=device) is None:
            out.append((name, config.index_topk if config.dsa else None))
    return tuple(out)


def layer_case_declined(backend, case: LayerDraw, device: str) -> str | None:
    return support_reason(backend, layer_config(case.config), dtype=DTYPES[case.dtype], device=device)


def check_layer_case(backend, case: LayerDraw, *, device: str, figures: dict) -> None:
    """One generated layer case: every row against the float64 expanded reference within its row's bounds
    (:func:`mla_conformance.checks.layer.numerics.check_rows`: rel_fro and max_abs / rms, as the numerics tests)."""
    __tracebackhide__ = True
    dtype = DTYPES[case.dtype]
    config = layer_config(case.config)
    require_support(backend, config, dtype=dtype, device=device)
    scenario = Scenario(f"generated {case.prop}", case.prefill, decode_steps=case.decode, chunk=case.chunk)
    w = _weights(case.config, dtype, str(device))
    x = inputs_for(config, scenario, seed=1 + case.seed)
    trace: dict = {}
    out, _ = run_scenario(backend, w, x, scenario, device=device, trace=trace)
    lengths = scenario_lengths(scenario)
    x64 = x.to(dtype).to(torch.float64)
    ref = reference_attention_f64(_master(case.config), x64, lengths)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = error_metrics(out[valid], ref[valid])
    figures.update(m)
    where = f"{backend.name} [{case}] generated layer case"
    check_rows(out, ref, lengths, dtype, where=where, figures=figures,
               detail=lambda b: (f" (prefill {case.prefill[b]}, chunks of {case.chunk or 'all'}, then {case.decode} "
                                 "decode steps)"),
               cause=lambda tol: likely_cause_message(out, _master(case.config), x64, lengths, trace["calls"],
                                                      correct=m["rel_fro"], tol=tol, figures=figures)
               + diagnosis(backend, w))
    figures.update(rel_fro_over_tolerance=m["rel_fro"] / figures["tolerance_rel_fro"])


def check_layer_property(backend, prop: str, *, device: str, figures: dict, generation) -> None:
    """Every stratum of the layer property (or the replayed case) against the float64 reference."""
    __tracebackhide__ = True
    if generation.case is not None:
        case = _replayed(generation.case, LayerDraw, prop)
        figures.update(generated_property=prop, generated_case=str(case), generated_examples=1)
        check_layer_case(backend, case, device=device, figures=figures)
        return
    configs = layer_configs(backend, device)
    if not configs:
        reasons = {support_reason(backend, layer_config(n), dtype=torch.float32, device=device) for n in LAYER_CONFIGS}
        pytest.skip("; ".join(sorted(r for r in reasons if r)))
    _run_strata(backend.name, prop, layer_strata(configs, generation.sizes), generation, figures,
                declined=lambda c: layer_case_declined(backend, c, device),
                check=lambda c, f: check_layer_case(backend, c, device=device, figures=f))


# --------------------------------------------------------------------------- running strata


def _replayed(text: str, kind, prop: str):
    __tracebackhide__ = True
    case = parse_case(text)  # the plugin has read it once already: a bad line is a usage error there
    if not isinstance(case, kind) or case.prop != prop:
        pytest.skip(f"--mla-case replays a {case.prop!r} case, not one of this test's ({prop!r})")
    return case


@dataclasses.dataclass
class _Tally:
    examples: int = 0
    declined: dict = dataclasses.field(default_factory=dict)
    per_stratum: dict = dataclasses.field(default_factory=dict)
    worst: float = 0.0
    worst_case: str | None = None


def _run_strata(name: str, prop: str, strata: list[Stratum], generation, figures: dict, *, declined, check) -> None:
    """Run each stratum's examples (hypothesis, the profile's settings); on the first failing stratum, re-raise
    the shrunk case's failure with its case line and replay command appended."""
    __tracebackhide__ = True
    tally = _Tally()
    with _hypothesis_storage():
        _run_each(name, prop, strata, generation, figures, tally, declined=declined, check=check)
    figures.update(generated_property=prop, generated_examples=tally.examples,
                   generated_examples_per_stratum=tally.per_stratum,
                   generated_declined=sum(tally.declined.values()), generated_profile=generation.profile)
    if tally.worst_case is not None:
        figures.update(generated_worst_case=tally.worst_case, generated_worst_error_over_bound=tally.worst)
    if not tally.examples:
        pytest.skip(f"{name}: declines every generated {prop} case: {'; '.join(tally.declined)}")


@contextlib.contextmanager
def _hypothesis_storage():
    """Hypothesis caches the constants it finds in local modules under its home directory, ``.hypothesis/`` in
    the working directory by default, even without an example database: during the generated cases its home is a
    directory of the system's temporary directory instead (the user's working directory is left as it was), and
    whatever it was before afterwards."""
    before = getattr(configuration, "__hypothesis_home_directory", None)  # module-level: not name-mangled
    configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "mla-conformance-hypothesis")
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(before)


def _run_each(name, prop, strata, generation, figures, tally, *, declined, check) -> None:
    __tracebackhide__ = True
    for stratum in strata:
        last: dict = {}
        count = {"n": 0}
        prop_test = generation.settings(stratum.share)(given(stratum.strategy)(
            _example(tally, last, count, declined, check, reject)))
        try:
            prop_test()
        except errors.Unsatisfiable:
            pass  # every case of the stratum declined: counted in generated_declined
        except errors.FlakyFailure as exc:
            _fill_failure(figures, prop, stratum, last, tally.examples + count["n"], generation)
            raise AssertionError(f"{name}: generated {prop} case ({stratum.name}) failed once and passed when run "
                                 f"again: the result is not repeatable ({exc}){_tail(figures)}") from None
        except Exception as exc:
            _fill_failure(figures, prop, stratum, last, tally.examples + count["n"], generation)
            raise _with_case(exc, figures) from None
        tally.examples += count["n"]
        tally.per_stratum[stratum.name] = count["n"]


def _example(tally: _Tally, last: dict, count: dict, declined, check, reject):
    """The body hypothesis runs on each case: a declined case is rejected (not counted), a run one checked."""

    def example(case):
        __tracebackhide__ = True
        reason = declined(case)
        if reason:
            tally.declined[reason] = tally.declined.get(reason, 0) + 1
            reject()
        last["case"], last["figures"] = case, {}
        count["n"] += 1
        check(case, last["figures"])
        ratio = last["figures"].get("out_error_over_bound", last["figures"].get("rel_fro_over_tolerance"))
        if ratio is not None and ratio >= tally.worst:
            tally.worst, tally.worst_case = float(ratio), str(case)

    return example


def _fill_failure(figures: dict, prop: str, stratum: Stratum, last: dict, examples: int, generation) -> None:
    """The figures of the minimal failing case (the last one hypothesis ran: it replays the shrunk case to raise
    its failure), its case line and the command replaying it."""
    figures.clear()
    figures.update(last.get("figures", {}))
    case = str(last["case"]) if "case" in last else None
    figures.update(generated_property=prop, generated_stratum=stratum.name, generated_profile=generation.profile,
                   generated_examples=examples)
    if case is not None:
        figures.update(generated_case=case, reproducer=generation.command(case))


def _tail(figures: dict) -> str:
    if "generated_case" not in figures:
        return ""
    return (f"\n  minimal case ({figures['generated_stratum']}; shrunk by hypothesis): {figures['generated_case']}"
            f"\n  replay exactly this case: {figures['reproducer']}")


def _with_case(exc: Exception, figures: dict) -> Exception:
    """The same kind of exception (a failure stays a failure, an op's error an error) with the case appended."""
    message = f"{exc}{_tail(figures)}"
    try:
        return type(exc)(message)
    except Exception:
        return AssertionError(message)


__all__ = ["op_support", "op_spec", "check_op_case", "check_op_property", "layer_config", "layer_configs",
           "check_layer_case", "check_layer_property"]
