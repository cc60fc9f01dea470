"""The declared order of mla_conformance's packages (issue 29: packages import downward only), lowest first.

A *package* is a first-level subpackage or top-level module of ``mla_conformance`` (``checks``, ``dtypes``,
...); ``ROOT`` is ``mla_conformance/__init__.py``. A module may import its own package and any package of a
lower layer, never one of its own layer's peers nor a higher one: module-level and function-level imports
alike, ``import a.b.c`` counting as an import of ``a.b.c`` (tests/test_layout.py::test_packages_import_downward
checks it). Each layer is a tuple; one with two names would be peers that import neither of each other, and
there is none: the order is strict.

Why each layer is where it is (what it needs below it):

* ``errors`` -- the exception classes every other layer raises; needs nothing.
* ``dtypes`` -- the spelling of a dtype and the float8 e4m3 bound the formats share (torch-free); needs nothing.
* ``resources`` -- where the package data lives (fixtures, goldens, suites); raises ``errors``.
* ``schema`` -- the declared sections and figure keys of a run's results; needs nothing (pure python: no torch,
  no pytest), so the plugin that fills a test's ``Figures`` and the report's renderers (``merge`` among them,
  which imports neither torch nor pytest) both read it from below.
* ``messages`` -- how a failure message reads (headline with the margin, likely cause, details, the bound's key);
  needs nothing (pure python), so the contract's call boundary and every check write their messages through it.
* ``arch`` -- devices, capabilities and kernel gating (the support matrix); raises ``errors``.
* ``contract`` -- what a backend and an op provide, and the call boundary (``contract.calls``: a backend's
  exception is a BackendError, a bad result an error or a failure); names dtypes, raises errors. Above
  ``arch`` only so the order is strict: neither imports the other.
* ``model`` -- the MLA config, weights, checkpoints and the float64 reference (``FP8_INDEXER_BLOCK``, DeepSeek's
  act_quant block, is the DSA reference's), and the checkpoint probe (``restore_yarn_softmax_scale`` with it); needs
  ``errors``, ``resources``, ``dtypes``.
* ``ROOT`` -- ``__version__`` and the lazy ``MLAConfig`` / ``MLAWeights``: the model it re-exports, and nothing
  else; whatever prints the version (the plugin, the report, the CLI) is above it.
* ``kv`` -- the latent caches and their codecs, sized from ``model.config``.
* ``impl`` -- the built-in backends and ops: they run the model's reference over the ``kv`` caches under the
  ``contract`` and the ``arch`` gating.
* ``specs`` -- a backend or op named on the command line (``op:SPEC`` wraps an ``impl`` op): resolves into
  ``impl``.
* ``generation`` -- greedy decoding of the tiny model with every layer's attention through a backend (through
  ``contract.calls``): what the golden and codec checks run.
* ``checks`` -- the conformance checks: drive backends (``specs``, ``impl``) over ``model``, ``kv`` and
  ``generation``.
* ``engine`` -- serving engines end to end (an engine's generations, logprobs and cache against the float64
  reference): runs an engine in a subprocess and holds it to ``checks``' tolerances and ``generation``'s reference.
* ``pytest_plugin`` -- the suites' options, fixtures, isolation and the results a run records (under
  ``schema``'s keys); ``checks`` and ``specs`` below it, never the report it feeds.
* ``report`` -- the plugin's results rendered: conformance.json / .md, plots, merge; reads the plugin's results
  and sections, so above it.
* ``perf`` -- timings and the bench's gate: ``checks``' correctness before any clock.
* ``runner`` -- ``run``'s work: pytest in a subprocess, watched through the plugin's journal (``runner.watchdog``),
  then the report it renders; the command's options are ``cli.run``, one layer up.
* ``cli`` -- the commands' options (argparse lives here only), each calling into the layer that does the work.
"""

#: lowest first; a package may import the packages of the layers before its own
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("dtypes",),
    ("resources",),
    ("schema",),
    ("messages",),
    ("arch",),
    ("contract",),
    ("model",),
    ("ROOT",),
    ("kv",),
    ("impl",),
    ("specs",),
    ("generation",),
    ("checks",),
    ("engine",),
    ("pytest_plugin",),
    ("report",),
    ("perf",),
    ("runner",),
    ("cli",),
)
