"""How the CPU threads of a timed decode step wait for each other: passively (``OMP_WAIT_POLICY=PASSIVE``).

torch's CPU ops and the BLAS under them run each op as an OpenMP parallel region, and by default a thread that
finishes its share *spins* at the region's barrier. On a machine where another process holds a core, the
thread that shares it is descheduled, and the spinning one keeps its own core instead of letting it run:
every region then waits for a scheduler time slice. A decode step of many short regions suffers most:
reference-absorbed's step (tens of regions) slows far more than reference-naive's (a few long ones), so `bench`
printed a fraction of the absorbed speed-up on a 2-core machine with one core busy (issue 31; the figures are
`bench`'s, run with and without the policy). Waiting passively, an idle thread
sleeps and its core runs the descheduled one.

OpenMP reads the policy once, when torch loads its runtime, so :func:`prefer_passive_wait` must run before
``import torch``; this module imports neither torch nor anything that does. A policy the user set is kept.
"""

from __future__ import annotations

import os
import sys

#: The OpenMP variable and the value the timed steps want.
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def prefer_passive_wait() -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy or torch is already loaded (too late: its
    OpenMP runtime read the environment then). Returns :func:`wait_policy`."""
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_ENV, PASSIVE)
    return wait_policy()


def wait_policy() -> str | None:
    """The policy this process's environment names (None: OpenMP's default, spin then sleep). A figure for the
    record: it is the one in effect when it was set before torch loaded, as :func:`prefer_passive_wait` does."""
    return os.environ.get(WAIT_POLICY_ENV)
