"""Options, profiles and the fixture of the generated-case suites (hypothesis; suites/test_op_generated.py and
suites/test_layer_generated.py), registered by the plugin through ``pytest_plugins``.

Options::

    --mla-case CASE    replay exactly one generated case: the line a failure printed (its first word names the
                       property, e.g. 'heads B=1 lens=17 s_q=1 h=126 page=64 float32 latent seed=0'); every
                       other test of the run is deselected
    --mla-thorough     the thorough profile: many examples per stratum, random (not derandomized), larger shapes
                       (rows to 32k keys, batches to 1,024 rows, top-k to 2,048): nightly CI and GPU hosts

Profiles (hypothesis settings, applied to the generated-case tests only, never loaded globally):
:data:`PROFILES`. The default is deterministic (``derandomize``: two runs draw the same cases), keeps no
example database (``database=None``: nothing is written to the working directory) and runs a few examples
per stratum. Nothing here imports torch or hypothesis until a generated-case test asks for its settings.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

#: profile name -> hypothesis settings (examples are per stratum of a property: mla_conformance.checks.strategies)
PROFILES: dict[str, dict] = {
    "mla-conformance": {"max_examples": 4, "derandomize": True, "database": None},
    "mla-conformance-thorough": {"max_examples": 60, "derandomize": False, "database": None},
}
#: the default profile's and the thorough one's shape sizes (mla_conformance.checks.strategies)
SIZES = {"mla-conformance": "default", "mla-conformance-thorough": "thorough"}

MARKER = ("mla_generated(property): a generated-case test (hypothesis) of that property; --mla-case '<property> "
          "...' runs only the tests of the case's property")


def pytest_addoption(parser):
    group = parser.getgroup("mla-conformance", "MLA conformance suite")
    group.addoption("--mla-case", default=None, metavar="CASE",
                    help="replay exactly one generated case, the line a generated-case failure printed (e.g. "
                         "'heads B=1 lens=17 s_q=1 h=126 page=64 float32 latent seed=0'); deselects every other test")
    group.addoption("--mla-thorough", action="store_true", default=False,
                    help="generated-case tests: the thorough hypothesis profile (many random examples per "
                         "stratum, rows to 32k keys, batches to 1,024 rows); see docs/generated-cases.md")


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER)
    text = config.getoption("--mla-case")
    if text is not None:
        case_property(text)  # a bad line is a usage error before anything runs


def case_property(text: str) -> str:
    """The property of a --mla-case line (UsageError naming the option for a line that does not read)."""
    from mla_conformance.checks.strategies import parse_case  # imports hypothesis: only when a case is replayed

    try:
        return parse_case(text).prop
    except ValueError as exc:
        raise pytest.UsageError(f"--mla-case {text!r}: {exc}") from None


def pytest_collection_modifyitems(config, items):
    text = config.getoption("--mla-case")
    if text is None:
        return
    prop = case_property(text)
    keep = [item for item in items if _property_of(item) == prop]
    if not keep:
        raise pytest.UsageError(f"--mla-case {text!r}: none of the collected tests generates {prop!r} cases "
                                f"(test_generated_{prop} in suites/test_op_generated.py or suites/"
                                "test_layer_generated.py)")
    drop = [item for item in items if _property_of(item) != prop]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _property_of(item) -> str | None:
    marker = item.get_closest_marker("mla_generated")
    return str(marker.args[0]) if marker is not None and marker.args else None


class Generation:
    """What a generated-case test needs from the run: the case to replay (or None), the hypothesis settings of
    the profile, the shape sizes, and the command that replays a case of this test."""

    def __init__(self, request, device: str):
        config = request.config
        self.case: str | None = config.getoption("--mla-case")
        self.profile = "mla-conformance-thorough" if config.getoption("--mla-thorough") else "mla-conformance"
        self.sizes = SIZES[self.profile]
        self._request = request
        self._device = device

    def settings(self, share: float = 1.0):
        """The profile's hypothesis settings with ``share`` of its examples (at least one)."""
        return hypothesis_settings(self.profile, share)

    def command(self, case: str) -> str:
        """``pytest FILE::TEST --mla-op SPEC --mla-device DEV --mla-case '<case>'`` (``--mla-backend`` for a
        layer test), runnable from the directory pytest was started in."""
        node, config = self._request.node, self._request.config
        path = Path(node.path)
        try:
            shown = os.path.relpath(path, config.invocation_params.dir)
        except ValueError:  # another drive
            shown = str(path)
        if shown.startswith(".."):
            shown = str(path)
        params = getattr(getattr(node, "callspec", None), "params", {})
        option, obj = (("--mla-op", params["mla_op"]) if "mla_op" in params else
                       ("--mla-backend", params.get("mla_backend")))
        spec = _spec_of(config, option, obj)
        return (f"pytest {shlex.quote(f'{shown}::{node.originalname}')} {option} {shlex.quote(spec)} "
                f"--mla-device {shlex.quote(self._device)} --mla-case {shlex.quote(case)}")


def hypothesis_settings(profile: str, share: float = 1.0):
    """A profile of :data:`PROFILES` as hypothesis settings, with ``share`` of its examples (at least one): no
    deadline (an op's first call may compile), one bug reported (the first stratum's, shrunk), no explain phase
    (it reruns cases), quiet (the failure message carries the case), every health check off (a declined case is
    rejected by design; a 1,024-row case is large by design)."""
    from hypothesis import HealthCheck, Phase, Verbosity, settings

    base = PROFILES[profile]
    return settings(max_examples=max(1, round(base["max_examples"] * share)), derandomize=base["derandomize"],
                    database=base["database"], deadline=None, report_multiple_bugs=False, print_blob=False,
                    verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))


def _spec_of(config, option: str, obj) -> str:
    """The spec the run named ``obj`` by (its name for a default built-in)."""
    name = getattr(obj, "name", str(obj))
    given = config.getoption(option) or []
    if not given or name in given:
        return name
    if len(given) == 1:
        return given[0]
    from mla_conformance.specs import get_backend, get_op  # imports torch: only once a generated case has failed

    resolve = get_op if option == "--mla-op" else get_backend
    for spec in given:
        try:
            if resolve(spec).name == name:
                return spec
        except Exception:  # a spec that resolved at collection resolves again; any other is not this one
            continue
    return name


@pytest.fixture
def mla_generation(request, mla_device) -> Generation:
    """The generated-case settings of this run (--mla-case, --mla-thorough) and the replay command builder."""
    return Generation(request, mla_device)
