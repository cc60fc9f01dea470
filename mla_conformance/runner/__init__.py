"""``mla-conformance run``'s work: the suites in a pytest subprocess, watched, interrupted and reported. One job per
module:

* :mod:`~mla_conformance.runner.run` -- pytest in a subprocess (xdist workers, each replaced when it dies), signals,
  then the report (rendered by :mod:`mla_conformance.report`);
* :mod:`~mla_conformance.runner.watchdog` -- the watch over the whole run: a run that makes no progress is ended
  with a verdict, from the plugin's journal;
* :mod:`~mla_conformance.runner.suites` -- where the installed suites are.

The command's options are :mod:`mla_conformance.cli.run` (and ``cli.test``, plain pytest over the same suites).
"""
