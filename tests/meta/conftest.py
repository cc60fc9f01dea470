"""torch and hypothesis (its pytest plugin imports it in every inner run) are imported before any meta test sets up
its ``pytester``: pytester drops the modules imported after its set-up when the test ends, and the next test imports
them again (torch must never be imported twice; hypothesis costs 1-4 s a run). Here, in the session's conftest, not
in tests/meta/harness.py: the kill matrix's lane (tests/meta/jobs.py) imports harness for its subprocess run and has
no use for torch.
"""

import hypothesis  # noqa: F401
import torch  # noqa: F401
