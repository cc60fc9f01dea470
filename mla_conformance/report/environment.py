"""The environment block of a report: the suite's version, Python, torch, transformers, the host, the device
under test (:func:`mla_conformance.arch.device.device_description`, the one description every output
prints) and each kernel's gating on that device, judged when the run happens."""

from __future__ import annotations

import platform
from typing import Any

from mla_conformance import __version__
from mla_conformance.arch.device import device_description, installed_version
from mla_conformance.arch.gating import kernel_skip_reason
from mla_conformance.arch.matrix import kernel_ids


def environment(device: str) -> dict[str, Any]:
    """What the report says the run ran on. ``device`` is the one the tests ran on (the plugin's record)."""
    described = device_description(device)
    # torch's thread count in this process, not the tests' (``run`` gives pytest --mla-threads 1): left out
    described.pop("threads", None)
    env: dict[str, Any] = {"suite_version": __version__, "python": platform.python_version(),
                           "platform": platform.platform(terse=True), "machine": platform.machine(), **described}
    env["transformers"] = installed_version("transformers")
    # judged when the run happens, on the device it ran on: rendering reads this, never the renderer's host
    env["kernel_gating"] = {kid: kernel_skip_reason(kid, device) for kid in kernel_ids()}
    return env
