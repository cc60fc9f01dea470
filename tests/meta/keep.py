"""The plugin of an inner run that keeps some of its tests (tests/meta/harness.py ``run_subprocess(keep=...)``):
loaded by name, ``-p tests.meta.keep --meta-keep FILE``, where FILE is a :meth:`Keep.to_json`; every other test is
deselected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import pytest


def pytest_addoption(parser):
    parser.addoption("--meta-keep", metavar="FILE", default=None,
                     help="keep only the tests FILE names (tests/meta/keep.py: Keep.to_json)")


def pytest_configure(config):
    path = config.getoption("--meta-keep")
    if path:
        config.pluginmanager.register(Keep(**json.loads(Path(path).read_text(encoding="utf-8"))), "meta-keep")


class Keep:
    """A plugin of an inner run: keeps the tests whose node id is in ``nodeids`` and every test of the backends
    and ops named in ``names`` (the names they report: the ``mla_backend`` / ``mla_op`` parameter) -- or, where
    ``names`` is a dict of name -> suite files (``suites/test_x.py``; None: every file), their tests in those
    files; the rest is deselected (counted as such in the run's summary)."""

    def __init__(self, nodeids: Iterable[str] = (), names: Iterable[str] | dict = ()):
        self.nodeids = set(nodeids)
        self.names = {n: None if f is None else set(f) for n, f in names.items()} if isinstance(names, dict) \
            else dict.fromkeys(names)

    def _keep(self, item) -> bool:
        if item.nodeid in self.nodeids:
            return True
        params = getattr(getattr(item, "callspec", None), "params", {})
        for fixture in ("mla_backend", "mla_op"):
            name = getattr(params.get(fixture), "name", None)
            if name in self.names and (self.names[name] is None or item.nodeid.split("::")[0] in self.names[name]):
                return True
        return False

    def to_json(self) -> str:
        return json.dumps({"nodeids": sorted(self.nodeids),
                           "names": {n: None if f is None else sorted(f) for n, f in sorted(self.names.items())}})

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if self._keep(item)]
        config.hook.pytest_deselected(items=[item for item in items if not self._keep(item)])
        items[:] = kept
