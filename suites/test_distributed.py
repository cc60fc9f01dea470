"""The layer contract across real ranks (mla_conformance.contract.distributed): W processes spawned by
torch.multiprocessing, one gloo group, each rank its shard of the weights (TP over heads), its share of the cache
(DCP over tokens), or both; every rank's output against the single-process float64 reference, every rank's cache
bytes against the tokens it must hold (TP: whole, W x redundancy; DCP: exactly its owned tokens). A rank that
raises, crashes or hangs fails the test naming the rank. One launch per world size (and per user backend) is shared
by the cases. The backends: those of --mla-backend that declare ``distributed`` (others skip, naming it), else the
built-in reference-tp, reference-dcp and reference-tp-dcp. World sizes: --mla-world-size (default 2); W > 2 carry
the ``distributed`` marker (.ci/run runs W = 4 and 8). See mla_conformance.checks.layer.distributed."""

import dataclasses

import pytest

from mla_conformance.checks.layer import distributed as distributed_checks
from mla_conformance.contract.distributed import declared_plans

BUILTIN = ("reference-tp", "reference-dcp", "reference-tp-dcp")
_LAUNCHES: dict = {}


@dataclasses.dataclass(frozen=True)
class DistParam:
    """One test's backend (``name``: the report counts the test as that backend's), its spec, W and case."""

    name: str
    spec: str
    world_size: int
    case: object


def _specs(config) -> list[str]:
    return list(config.getoption("--mla-backend") or ()) or ([] if config.getoption("--mla-op") else list(BUILTIN))


def pytest_generate_tests(metafunc):
    if "distributed_backend" not in metafunc.fixturenames:
        return
    from mla_conformance.specs import get_backend

    sizes = metafunc.config.getoption("--mla-world-size", None) or [2]
    params = []
    for spec in _specs(metafunc.config):
        backend = get_backend(spec)
        plans = declared_plans(backend)
        cases = distributed_checks.cases_for(plans) or [None]
        for w in sizes:
            marks = [pytest.mark.distributed] if w > 2 else []
            for case in cases:
                cid = f"{backend.name}-W{w}-{case.name if case else 'none'}"
                params.append(pytest.param(DistParam(backend.name, spec, w, case), id=cid, marks=marks))
    metafunc.parametrize("distributed_backend", params)


def _launch(config, spec: str, w: int):
    """One launch per world size for the built-ins together, one per other spec: every case of its backends."""
    group = tuple(s for s in _specs(config) if s in BUILTIN) if spec in BUILTIN else (spec,)
    key = (group, w)
    if key not in _LAUNCHES:
        from mla_conformance.specs import get_backend

        jobs = [(s, case) for s in group for case in distributed_checks.cases_for(declared_plans(get_backend(s)))]
        _LAUNCHES[key] = distributed_checks.launch(jobs, w)
    return _LAUNCHES[key]


def _case(request, distributed_backend: DistParam):
    spec, name, w, case = (distributed_backend.spec, distributed_backend.name, distributed_backend.world_size,
                           distributed_backend.case)
    if case is None:
        pytest.skip(f"{name}: does not declare distributed (the layer contract's optional declaration "
                    "`distributed = (\"tp\", \"dcp\", \"tp+dcp\")`: mla_conformance.contract.distributed), so it is "
                    "not run across ranks")
    return spec, name, _launch(request.config, spec, w), case


@pytest.mark.mla_section("distributed")
def test_rank_outputs(request, distributed_backend, mla_figures):
    """Every rank's output equals the single-process float64 reference (float32 layer bounds)."""
    spec, name, run, case = _case(request, distributed_backend)
    distributed_checks.assert_rank_outputs(run, spec, case, name=name, figures=mla_figures)


@pytest.mark.mla_section("distributed")
def test_rank_cache_bytes(request, distributed_backend, mla_figures):
    """Every rank's cache holds exactly its tokens: all of them under TP (W x the bytes of one cache over the
    ranks), its owned ones under DCP."""
    spec, name, run, case = _case(request, distributed_backend)
    distributed_checks.assert_rank_cache(run, spec, case, name=name, figures=mla_figures)
