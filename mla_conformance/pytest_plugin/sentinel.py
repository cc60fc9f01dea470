"""A serial ``pytest`` whose backend kills it says so: which test was running, and what to do.

A plain serial run (``pytest suites --mla-backend …``, no xdist worker to replace) has no process left to say
anything when native code segfaults, aborts or calls ``os._exit``: faulthandler prints a stack for a signal, but
``os._exit(3)`` ends the run with nothing at all. So, in a serial pytest that runs suite tests, the plugin starts
one small process (``python -S``, no import of this package) on the suite's first test and tells it each suite
test's node id through a pipe as the test starts; at the end of the session it says "done" and the process
exits. When the pipe closes without "done" (pytest died), it prints, on the terminal's stderr, the test that
was running and that the tests after it did not run.

Not started under ``mla-conformance run`` (``--mla-results``: ``run`` reads the journal and says the same), in an
xdist worker or controller (xdist reports a dead worker), or in a pytest run inside a test (pytester, a test's
subprocess: ``PYTEST_CURRENT_TEST`` is set; the outer session's sentinel speaks).
"""

from __future__ import annotations

import os
import subprocess
import sys

_DONE = b"\x00done\n"

#: The sentinel's program: the last node id it was told, printed if the pipe ends without the "done" line.
PROGRAM = r'''
import sys
last = None
for line in sys.stdin.buffer:
    if line == b"\x00done\n":
        sys.exit(0)
    last = line.decode("utf-8", "replace").rstrip("\n")
if last:
    sys.stderr.write(
        "\nmla-conformance: pytest ended abruptly while running " + last + ": its process died (a signal, "
        "abort() or os._exit() in native code, or the --mla-timeout watchdog ended a hang Python could not "
        "interrupt; the stack above, when faulthandler printed one, says where) and "
        "the tests after it did not run. Run under `mla-conformance run` or `pytest -n 1` to have the crash "
        "recorded as that test's error and the rest run in a fresh worker.\n")
    sys.stderr.flush()
'''


class Sentinel:
    """One per serial pytest session that runs suite tests (:meth:`wanted`); :meth:`started` per suite test."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.off = False

    @staticmethod
    def wanted(config) -> bool:
        return not (hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None)
                    or getattr(config.option, "dist", "no") != "no" or config.getoption("--mla-results")
                    or os.environ.get("PYTEST_CURRENT_TEST"))

    def started(self, config, nodeid: str) -> None:
        if self.off:
            return
        if self.proc is None:
            if not self.wanted(config):
                self.off = True
                return
            capman = config.pluginmanager.getplugin("capturemanager")
            try:
                if capman is not None:  # the terminal's stderr, not pytest's capture of it
                    with capman.global_and_fixture_disabled():
                        self.proc = self._spawn()
                else:
                    self.proc = self._spawn()
            except OSError:
                self.off = True
                return
        try:
            self.proc.stdin.write(nodeid.replace("\n", " ").encode("utf-8", "replace") + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            self.off = True

    @staticmethod
    def _spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-S", "-c", PROGRAM], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, env={"PYTHONIOENCODING": "utf-8"})

    def finish(self) -> None:
        """The session ended: the sentinel exits quietly."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(_DONE)
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.proc = None
