"""Reports: what ``mla-conformance run`` and ``merge`` write for people and CI. One job per module:

* :mod:`~mla_conformance.report.schema` -- the declared sections and figure keys (checks write, renderers read);
* :mod:`~mla_conformance.report.environment` -- the environment block (the device under test, kernel gating);
* :mod:`~mla_conformance.report.build` -- the plugin's results into a report: rows, verdicts, op results;
* :mod:`~mla_conformance.report.markdown` and :mod:`~mla_conformance.report.sections` -- conformance.md;
* :mod:`~mla_conformance.report.plots` -- the PNG plots;
* :mod:`~mla_conformance.report.outdir` -- the owned, atomic output directory (and single files);
* :mod:`~mla_conformance.report.suites` -- the installed suites;
* :mod:`~mla_conformance.report.run` -- ``run``: pytest in a subprocess, interrupts, the report;
* :mod:`~mla_conformance.report.merge` -- ``merge``: several reports in one matrix;
* :mod:`~mla_conformance.report.docs` -- the generated tables of the docs.

The commands' options are in :mod:`mla_conformance.cli.run` and :mod:`mla_conformance.cli.merge`.
"""

from __future__ import annotations

import importlib


#: Transitional: the names callers imported from the one-file report, and the module that owns each now.
#: Goes when tests/meta/test_isolation.py and tests/test_readme_figures.py import from the owners.
_MOVED = {
    "MARKER": "outdir", "check_out_dir": "outdir", "check_out_file": "outdir", "write_file_atomically": "outdir",
    "build_report": "build", "render_markdown": "markdown", "find_suites": "suites",
    "partial_results_path": "run", "PARTIAL_SCHEMA": "run", "results_from_journal": "run",
    "MAX_WORKER_RESTARTS": "run", "isolation_args": "run", "tempfile": "outdir", "os": "outdir",
}


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(f"mla_conformance.report.{_MOVED[name]}"), name)
    raise AttributeError(f"module 'mla_conformance.report' has no attribute {name!r} (the report is a package: "
                         "import from its modules, e.g. mla_conformance.report.run)")
