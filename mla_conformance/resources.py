"""Where the suite's files are: the conformance suites, the fixtures (tiny model, prompts, manifest), goldens.

They are found through ``importlib.resources``, never by path arithmetic from a module's ``__file__``. A
source checkout keeps them at the top level (``suites/``, ``fixtures/``, ``golden/``); the build maps those
directories into the distribution as the packages ``mla_conformance.suites``, ``mla_conformance.fixtures``
and ``mla_conformance.goldens`` (``setup.py``). An editable install (``pip install -e .``) maps the same names
to the checkout's directories, so there the checkout's files are what is read (and written).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from mla_conformance.errors import MLAInputError

SUITES = "mla_conformance.suites"
FIXTURES = "mla_conformance.fixtures"
GOLDENS = "mla_conformance.goldens"


def _directory(package: str) -> Path:
    try:
        root = files(package)
    except ModuleNotFoundError:
        raise MLAInputError(f"{package} is not installed: this installation of mla-conformance is incomplete "
                            "(reinstall it; in a checkout, `pip install -e .`)") from None
    if not isinstance(root, Path):  # e.g. a zipped install: the suites need real files
        raise MLAInputError(f"{package} is not on the file system ({root}); install mla-conformance unzipped")
    return root


def suites_dir() -> Path:
    """The conformance suites (``suites/`` of a checkout)."""
    return _directory(SUITES)


def fixtures_dir() -> Path:
    """``fixtures/``: the tiny model, prompts.json and MANIFEST.sha256."""
    return _directory(FIXTURES)


def tiny_model_dir() -> Path:
    return fixtures_dir() / "models" / "tiny-mla"


def prompts_file() -> Path:
    return fixtures_dir() / "prompts.json"


def golden_root() -> Path:
    """``golden/``: the goldens, read from the package (the checkout's directory in an editable install)."""
    return _directory(GOLDENS)


def source_checkout() -> Path | None:
    """The source checkout the suite's files are read from, None for an installed wheel or sdist."""
    root = golden_root().parent
    if (root / "pyproject.toml").is_file() and (root / "mla_conformance" / "__init__.py").is_file():
        return root
    return None


def check_goldens_writable() -> Path:
    """The golden directory when goldens may be written (a source checkout); MLAInputError otherwise."""
    root = golden_root()
    if source_checkout() is None:
        raise MLAInputError(f"goldens are written only in a source checkout of mla-conformance; this installation's "
                            f"goldens ({root}) are package data and stay read-only. Clone the repository, "
                            "`pip install -e .` there and run `pytest suites/test_generation_golden.py "
                            "--snapshot-update` in it")
    return root


def pytest_location_args(suites: Path, tmpdir: str | Path) -> list[str]:
    """pytest arguments that make a run of ``suites`` independent of the directory it is started from.

    In a source checkout, none: pytest finds the checkout's pyproject.toml. An installed suite has no
    configuration of its own, and pytest would take the first one above site-packages (a project's
    pyproject.toml when the venv lives inside it): an empty ini file and the package as rootdir instead,
    so node ids read ``suites/test_….py::…`` as in a checkout (what ``--mla-expect`` files name).
    """
    if (suites.parent / "pyproject.toml").is_file():
        return []
    ini = Path(tmpdir) / "pytest.ini"
    ini.write_text("[pytest]\n", encoding="utf-8")
    return ["-c", str(ini), "--rootdir", str(suites.parent)]


#: Installed pytest plugins the suites do not use, which pytest would otherwise import in every process of a run
#: (each worker too) and assertion-rewrite there (a plugin's whole package; nothing is cached where Python writes
#: no bytecode): anyio's (no async tests) and hypothesis's (the generated cases drive hypothesis themselves,
#: mla_conformance/checks/generated.py, and it is imported only where they run).
UNUSED_PLUGINS = ("anyio", "hypothesispytest")
#: pytest's options leaving :data:`UNUSED_PLUGINS` out
NO_UNUSED_PLUGINS = tuple(arg for name in UNUSED_PLUGINS for arg in ("-p", f"no:{name}"))


def pytest_run_args(suites: Path, tmpdir: str | Path) -> list[str]:
    """What every pytest run of the suites that ``run`` and ``test`` start takes: :func:`pytest_location_args`;
    none of a checkout's own addopts (its choice of xdist workers is for the checkout's tests); pytest's cache and
    pytest-benchmark's storage in the run's temporary directory (nothing left where the suites or the caller are);
    :data:`UNUSED_PLUGINS` not loaded."""
    import importlib.util

    args = [*pytest_location_args(suites, tmpdir), "-o", "addopts=", "-o", f"cache_dir={Path(tmpdir) / 'pytest-cache'}",
            *NO_UNUSED_PLUGINS]
    if importlib.util.find_spec("pytest_benchmark"):
        args += ["--benchmark-storage", f"file://{Path(tmpdir) / 'benchmarks'}"]
    return args


def read_json(path: Path, *, missing: str, error: type[Exception] = MLAInputError):
    """A JSON file the user named, or one line naming it: ``error(f"{path}: {missing}")`` when it is absent,
    ``error(f"{path}: not valid JSON (...)")`` when it does not parse."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
