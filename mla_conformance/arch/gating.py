"""Gating: whether a kernel of the support matrix can run on a device, and the one sentence saying why not.

* :func:`why_not` -> None when the kernel is supported, else one sentence (device as data or detected)
* :func:`kernel_skip_reason` -> what the ``requires_kernel`` pytest marker uses to decide a skip
* :func:`matrix_report` -> the matrix, the device and a verdict per kernel (``mla-conformance matrix --json``)
"""

from __future__ import annotations

from typing import Any

from mla_conformance.arch.capability import parse_version, version_str
from mla_conformance.arch.device import DeviceInfo, detect
from mla_conformance.arch.matrix import MATRIX, adapter_status, get_kernel, kernel_ids


def device_phrase(info: DeviceInfo) -> str:
    """The second half of a why-not sentence: what the device is ("this host has no CUDA device (cpu)")."""
    if info.device_type == "cpu":
        if info.cuda_available:
            return "the device under test is the CPU (cpu), not a CUDA device"
        return "this host has no CUDA device (cpu)"
    if info.device_type == "cuda" and info.capability is None:
        return "this host has no CUDA device (cuda is not available)"
    if info.device_type == "rocm":
        label = f" ({info.name})" if info.name else ""
        return f"this device is an AMD ROCm GPU{label}, not an NVIDIA CUDA device"
    if info.device_type != "cuda":
        return f"the device under test is {info.device_type}, not a CUDA device"
    return f"this device is {info.describe()}"


def why_not(kernel_id: str, device_info: DeviceInfo | None = None, *, check_package: bool = True) -> str | None:
    """None when ``kernel_id`` can run on the device; otherwise one sentence saying why not.

    ``device_info`` None means this host (:func:`detect`).  The checks, in order: a CUDA device,
    an architecture the kernel is built for, the CUDA version torch was built with (when known;
    a proxy for the toolkit the kernel was compiled with), and — with ``check_package`` and when
    the device info knows it — whether the kernel's package is installed.  A device stated as data
    (:meth:`DeviceInfo.from_capability`) without ``cuda_version``/``packages`` is judged on its
    architecture alone.  Unknown ids raise ValueError.
    """
    row = get_kernel(kernel_id)
    info = detect() if device_info is None else device_info
    needs = row.needs()

    if not info.is_cuda:
        return f"{row.name} needs {needs}; {device_phrase(info)}"

    target = row.target_for(info.capability)  # type: ignore[arg-type]
    if target is None:
        return f"{row.name} needs {needs}; {device_phrase(info)}"

    have = parse_version(info.cuda_version)
    if target.min_cuda is not None and have is not None and have < target.min_cuda:
        return (
            f"{row.name} needs CUDA >= {version_str(target.min_cuda)} on {target.name}; "
            f"this torch was built with CUDA {info.cuda_version} and this device is {info.describe()}"
        )

    if check_package:
        pkg = info.package(row.package)
        if pkg is not None and not pkg.installed:
            return (
                f"{row.name} runs on this device, {info.describe()}, "
                f"but the {row.package} package is not installed"
            )
    return None


def kernel_skip_reason(kernel_id: str, device: Any = None) -> str | None:
    """The skip reason for ``@pytest.mark.requires_kernel(kernel_id)``, or None to run the test.

    ``device`` is what the test runs on (a torch.device, ``"cpu"``, ``"cuda:0"``; None: this host's
    default).  Checks architecture, CUDA version and that the kernel's package is installed.
    """
    return why_not(kernel_id, detect(device), check_package=True)


def judge_all(info: DeviceInfo, check_package: bool) -> dict[str, dict[str, Any]]:
    """kernel id -> {"supported": bool, "reason": the why-not sentence or None}, in matrix order."""
    verdicts = {}
    for kid in kernel_ids():
        reason = why_not(kid, info, check_package=check_package)
        verdicts[kid] = {"supported": reason is None, "reason": reason}
    return verdicts


def matrix_report(capability: Any = None, *, name: str | None = None, cuda_version: str | None = None) -> dict[str, Any]:
    """The object ``matrix --json`` prints."""
    if capability is not None:
        info = DeviceInfo.from_capability(capability, name, cuda_version=cuda_version)
        judged_on = "architecture and CUDA version" if cuda_version else "architecture"
        check_package = False
    else:
        info = detect()
        judged_on = "architecture, CUDA version and installed packages"
        check_package = True
    device = info.to_dict()
    device["judged_on"] = judged_on
    return {
        "device": device,
        "matrix": [row.to_dict() for row in MATRIX],
        "verdicts": judge_all(info, check_package),
        "adapters": adapter_status(),
    }
