"""Reports: what ``mla-conformance run`` and ``merge`` write for people and CI, rendered from a run's results (the run
itself is :mod:`mla_conformance.runner`). One job per module:

* :mod:`~mla_conformance.report.environment` -- the environment block (the device under test, kernel gating);
* :mod:`~mla_conformance.report.build` -- the plugin's results into a report: rows, verdicts, op results;
* :mod:`~mla_conformance.report.markdown` and :mod:`~mla_conformance.report.sections` -- conformance.md;
* :mod:`~mla_conformance.report.plots` -- the PNG plots;
* :mod:`~mla_conformance.report.outdir` -- the owned, atomic output directory (and single files);
* :mod:`~mla_conformance.report.merge` -- ``merge``: several reports in one matrix;

The declared sections and figure keys the renderers read are :mod:`mla_conformance.schema` (below the plugin that
records them). The commands' options are in :mod:`mla_conformance.cli.run` and :mod:`mla_conformance.cli.merge`.
"""
