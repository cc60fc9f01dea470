"""Backend specs: built-in names, module:attr, file.py:attr; bad specs name themselves."""

from pathlib import Path

import pytest

from mla_conformance.contract.layer import BUILTINS
from mla_conformance.specs import get_backend
from mla_conformance.errors import BackendSpecError

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec", list(BUILTINS))
def test_builtins_resolve(spec):
    assert get_backend(spec).name == spec


def test_module_and_file_specs():
    assert get_backend("mla_conformance.impl.backends.reference:ReferenceAbsorbed").name == "reference-absorbed"
    path = ROOT / "tests" / "meta" / "impls" / "independent" / "backend.py"
    assert get_backend(f"{path}:IndependentMLA").name == "independent-absorbed"
    assert get_backend(f"{path}:BACKEND").name == "independent-absorbed"  # an instance


@pytest.mark.parametrize("spec,message", [
    ("no_such_module:X", "no module named 'no_such_module'"),
    ("tests/meta/missing_file.py:X", "file 'tests/meta/missing_file.py' does not exist"),
    ("reference-absorbd", "not a built-in backend (did you mean 'reference-absorbed'?)"),
    ("mla_conformance.impl.backends.reference:Nope", "has no attribute 'Nope'"),
    ("mla_conformance.model.config:MLAConfig", "instantiating MLAConfig without arguments failed"),
    ("mla_conformance.model.config:PRESETS", "is not a backend: missing"),
])
def test_bad_specs_name_the_spec(spec, message):
    with pytest.raises(BackendSpecError) as info:
        get_backend(spec)
    assert repr(spec) in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("spec", ["no_such_module:X", "tests/meta/missing_file.py:X", "reference-absorbd"])
def test_pytest_reports_bad_spec_without_traceback(spec, pytester):
    from .test_inputs import pytest_inprocess

    code, out, err = pytest_inprocess(pytester, "suites/test_cache_bytes.py", "--mla-backend", spec)
    assert code == 4, out + err
    assert spec in err and "Traceback" not in err + out


def test_module_spec_resolves_from_the_current_directory(tmp_path, monkeypatch):
    """`mla-conformance run --backend mypkg.mla:MyBackend` typed in the project directory (a console script's
    sys.path does not hold the current directory) finds mypkg there."""
    import sys

    from mla_conformance.specs import get_backend

    pkg = tmp_path / "mypkg_from_cwd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mla.py").write_text((Path(__file__).parent / "frozen_base_backend.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_backend("mypkg_from_cwd.mla:MyBackend").name == "my-mla"


def test_a_builtin_is_named_by_its_key_so_naming_it_imports_nothing():
    """specs.spec_name names a built-in by its key without resolving it (run and test check every spec in their
    own process, which then imports no torch for built-ins): that is only right while each built-in reports its
    key as its name."""
    from mla_conformance.contract.op import BUILTIN_OPS
    from mla_conformance.specs import get_op, spec_name

    for key in BUILTINS:
        assert get_backend(key).name == key == spec_name(key, "backend")
    for key in BUILTIN_OPS:
        assert get_op(key).name == key == spec_name(key, "op")
