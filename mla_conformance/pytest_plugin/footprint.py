"""Nothing is written into the user's directory but the report they asked for.

A run of the shipped suites from anywhere (``pytest --pyargs mla_conformance.suites``, or the suites' paths
outside a source checkout) would leave pytest's ``.pytest_cache`` and pytest-benchmark's ``.benchmarks`` in the
directory pytest was started in (pytest's rootdir is that directory when it finds no configuration there):

* the cache plugin is not loaded for such a run (as the checkout's own ``addopts`` say ``-p no:cacheprovider``),
  unless the run asks for the cache (``--lf``, ``--ff``, ``--nf``, ``--sw``, ``--cache-show``, ``--cache-clear``);
* pytest-benchmark gets a throwaway storage while the benchmarks are deselected.

Another project's run is left alone.
"""

from __future__ import annotations

from mla_conformance.pytest_plugin import selection
from mla_conformance.resources import source_checkout

#: the destinations of cacheprovider's and stepwise's options: a run giving one wants the cache
CACHE_OPTIONS = ("lf", "failedfirst", "newfirst", "stepwise", "stepwise_skip", "cacheshow", "cacheclear")
_BENCHMARK_DEFAULT = "file://./.benchmarks"
_BENCHMARK_PREFIX = "mla-conformance-benchmarks-"


def _in_checkout(rootpath) -> bool:
    """pytest's rootdir is this package's source checkout (whose pyproject.toml configures the run)."""
    root = source_checkout()
    return root is not None and root.resolve() == rootpath.resolve()


def block_cache(early_config) -> bool:
    """Before pytest configures its plugins: a run of the shipped suites rooted outside the source checkout
    does not load the cache plugin (nor stepwise, which needs it), unless it asks for the cache. True when
    it blocked them."""
    ns = early_config.known_args_namespace
    if any(getattr(ns, dest, False) for dest in CACHE_OPTIONS):
        return False
    args = getattr(ns, "file_or_dir", None) or []
    pyargs = bool(getattr(ns, "pyargs", False))
    if not args or not selection.names_suites(args, early_config.invocation_params.dir, pyargs):
        return False
    if _in_checkout(early_config.rootpath):
        return False
    manager = early_config.pluginmanager
    if not manager.has_plugin("cacheprovider"):
        return False
    for name in ("stepwise", "cacheprovider"):  # as `-p no:cacheprovider` does (stepwise needs the cache)
        manager.set_blocked(name)
    return True


def benchmark_storage(config) -> None:
    """When this suite runs with its benchmarks deselected, give pytest-benchmark a throwaway storage so no
    ``.benchmarks/`` is left in the current directory (pytest-benchmark creates it in its own
    pytest_configure: this runs before it). An xdist worker uses its controller's."""
    if getattr(config.option, "benchmark_storage", None) != _BENCHMARK_DEFAULT or selection.benchmark_selected(config):
        return
    given = getattr(config, "workerinput", {}).get("mla_benchmark_storage")
    if given:  # a worker that dies cleans up nothing
        config.option.benchmark_storage = given
        return
    if not selection.runs_suite(config):
        return
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix=_BENCHMARK_PREFIX)
    config.option.benchmark_storage = "file://" + tmp
    config.add_cleanup(lambda: shutil.rmtree(tmp, ignore_errors=True))


def hand_to_worker(node) -> None:
    """xdist controller: a worker uses the controller's throwaway benchmark storage."""
    storage = getattr(node.config.option, "benchmark_storage", None)
    if isinstance(storage, str) and storage.startswith("file://") and _BENCHMARK_PREFIX in storage:
        node.workerinput["mla_benchmark_storage"] = storage
