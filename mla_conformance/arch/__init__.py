"""Architecture gating: which MLA kernels can run on which device, and why not.

* :mod:`~mla_conformance.arch.matrix`: the support matrix as data (:data:`~.matrix.MATRIX`, one
  :class:`~.matrix.KernelRow` per kernel, with the upstream sources of every fact) and the suite's adapters
* :mod:`~mla_conformance.arch.capability`: compute capabilities and versions as data (``"9.0"``, ``"sm_100"``)
* :mod:`~mla_conformance.arch.device`: :func:`~.device.detect`, :class:`~.device.DeviceInfo` and the one
  device description (:func:`~.device.device_description`) the report, ``bench`` and the plugin print
* :mod:`~mla_conformance.arch.gating`: :func:`~.gating.why_not`, :func:`~.gating.kernel_skip_reason`

``mla-conformance matrix`` renders them (:mod:`mla_conformance.cli.matrix`). The names below are re-exported
for the callers that use ``arch.NAME`` (the built-in ops call ``arch.detect`` and ``arch.why_not``, so a test
that states the device patches ``mla_conformance.arch.detect``).
"""

from mla_conformance.arch.capability import parse_capability
from mla_conformance.arch.device import DeviceInfo, PackageInfo, detect
from mla_conformance.arch.gating import kernel_skip_reason, why_not
from mla_conformance.arch.matrix import (ADAPTERS, MATRIX, NOT_RUN_ON_HARDWARE, RUN_ON_HARDWARE, KernelRow,
                                         adapter_status, get_kernel, kernel_ids)

__all__ = ["ADAPTERS", "MATRIX", "NOT_RUN_ON_HARDWARE", "RUN_ON_HARDWARE", "DeviceInfo", "KernelRow", "PackageInfo",
           "adapter_status", "detect", "get_kernel", "kernel_ids", "kernel_skip_reason", "parse_capability", "why_not"]
