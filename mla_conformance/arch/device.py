"""The device under test: detection, and the one description of it that every output prints.

* :func:`detect` -> :class:`DeviceInfo`: this host's device (or ``"cpu"`` / ``"cuda:1"`` / a torch.device), with
  the matrix's packages found (never imported: a broken or wrong-architecture build cannot crash detection);
  :meth:`DeviceInfo.from_capability` states a device as data (``(9, 0)``, ``"12.0"``, ``"sm_100"``).
* :func:`device_description` -> the dict the report's environment, ``bench``'s JSON and the plugin's header
  print, one set of keys (:data:`DESCRIPTION_KEYS`); :func:`device_line` words it on one line.
* :func:`check_device`: a ``--device`` / ``--mla-device`` value that torch can use here, or an input error.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from mla_conformance.arch.capability import Capability, cap_str, parse_capability, sm_name
from mla_conformance.arch.matrix import matrix_packages
from mla_conformance.errors import UserError


@dataclass(frozen=True)
class PackageInfo:
    """Whether an importable module is present (found, never imported) and its distribution version."""

    module: str
    installed: bool
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "installed": self.installed, "version": self.version}


def installed_version(package: str) -> str | None:
    """A package's version without importing it where it is not imported yet (importing torch or transformers only
    to name its version would load the whole library in every pytest process and xdist worker, most of which never
    use it): the module's own ``__version__``, else its distribution's; None when it is not installed."""
    module = sys.modules.get(package)
    if module is not None and hasattr(module, "__version__"):
        return str(module.__version__)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_info(module: str) -> PackageInfo:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):
        found = False
    version = None
    if found:
        for dist in (module, module.replace("_", "-"), f"{module}-python".replace("_", "-")):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
            except Exception:  # a broken distribution must not break detection
                break
    return PackageInfo(module, found, version)



@dataclass(frozen=True)
class DeviceInfo:
    """A device to judge: detected on this host (:func:`detect`) or stated as data."""

    device_type: str  # "cpu", "cuda", "rocm", "mps", ...
    capability: Capability | None = None
    name: str | None = None
    index: int | None = None
    cuda_version: str | None = None  # torch.version.cuda (the CUDA torch was built with)
    torch_version: str | None = None
    cuda_available: bool = False  # whether this host has a usable CUDA device at all
    packages: tuple[PackageInfo, ...] = ()
    detected: bool = False  # False: stated as data (packages and CUDA may be unknown)

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_capability(
        cls,
        capability: Any,
        name: str | None = None,
        *,
        cuda_version: str | None = None,
        packages: Iterable[PackageInfo] | None = None,
    ) -> "DeviceInfo":
        """A CUDA device stated as data, e.g. ``DeviceInfo.from_capability((12, 0), "NVIDIA GeForce RTX 5090")``.

        ``cuda_version`` (e.g. ``"12.8"``) makes the CUDA requirement count; ``packages`` the
        package check.  Left out, only the architecture is judged.
        """
        return cls(
            device_type="cuda",
            capability=parse_capability(capability),
            name=name,
            cuda_version=cuda_version,
            cuda_available=True,
            packages=tuple(packages or ()),
            detected=False,
        )

    @classmethod
    def cpu(cls) -> "DeviceInfo":
        """A host without a CUDA device, stated as data."""
        return cls(device_type="cpu", detected=False)

    # -- views --------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda" and self.capability is not None

    @property
    def sm(self) -> str | None:
        return sm_name(self.capability) if self.capability is not None else None

    def package(self, module: str) -> PackageInfo | None:
        for p in self.packages:
            if p.module == module:
                return p
        return None

    def describe(self) -> str:
        """``"SM120 (NVIDIA GeForce RTX 5090, compute capability 12.0)"``, ``"cpu"``, ..."""
        if self.capability is None:
            return self.device_type
        parts = [self.name] if self.name else []
        parts.append(f"compute capability {cap_str(self.capability)}")
        return f"{sm_name(self.capability)} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "capability": None if self.capability is None else cap_str(self.capability),
            "sm": self.sm,
            "name": self.name,
            "index": self.index,
            "cuda_version": self.cuda_version,
            "torch_version": self.torch_version,
            "cuda_available": self.cuda_available,
            "packages": {p.module: {"installed": p.installed, "version": p.version} for p in self.packages},
            "detected": self.detected,
        }


def _normalize_device(device: Any) -> str | None:
    if device is None:
        return None
    return str(device).strip()


def detect(device: Any = None) -> DeviceInfo:
    """Detect ``device`` (None: the default CUDA device when there is one, else the CPU).

    ``device`` may be a ``torch.device`` or a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
    Never imports a kernel library; the results are cached per device.
    """
    return _detect_cached(_normalize_device(device))


def _cpu_only_torch() -> str | None:
    """The installed torch's version when it is a CPU-only build (its local version tag is ``+cpu``) and not imported
    yet, else None. Such a build has no CUDA (torch.version.cuda and .hip are None, no device is available), so a
    CPU device is described without importing torch (the ``run`` process that writes the report never needs torch
    otherwise)."""
    if "torch" in sys.modules:
        return None
    version = installed_version("torch")
    return version if version is not None and version.endswith("+cpu") else None


@functools.lru_cache(maxsize=None)
def _detect_cached(device: str | None) -> DeviceInfo:
    cpu_build = _cpu_only_torch() if device in (None, "cpu") else None
    if cpu_build is not None:
        return DeviceInfo(device_type="cpu", torch_version=cpu_build, cuda_version=None, cuda_available=False,
                          packages=tuple(package_info(m) for m in matrix_packages()), detected=True)
    import torch

    torch_version = str(torch.__version__)
    cuda_version = torch.version.cuda
    hip_version = getattr(torch.version, "hip", None)
    packages = tuple(package_info(m) for m in matrix_packages())
    try:
        cuda_available = bool(torch.cuda.is_available())
    except Exception:
        cuda_available = False

    if device is None:
        dev = torch.device("cuda" if cuda_available else "cpu")
    else:
        dev = torch.device(device)

    common = dict(
        torch_version=torch_version,
        cuda_version=cuda_version,
        cuda_available=cuda_available,
        packages=packages,
        detected=True,
    )
    if dev.type != "cuda" or not cuda_available:
        return DeviceInfo(device_type=dev.type, **common)

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    capability = tuple(torch.cuda.get_device_capability(index))
    if hip_version:
        # ROCm builds of torch expose AMD GPUs as "cuda" devices with gfx numbers as the
        # "capability" (an MI250 reports 9.0): never mistake one for an SM90.
        return DeviceInfo(device_type="rocm", name=name, index=index, capability=None, **common)
    return DeviceInfo(device_type="cuda", capability=capability, name=name, index=index, **common)


def _clear_detect_cache() -> None:
    _detect_cached.cache_clear()


detect.cache_clear = _clear_detect_cache  # type: ignore[attr-defined]


#: The keys of :func:`device_description`, in the order they are printed.
DESCRIPTION_KEYS = ("device", "device_name", "sm", "capability", "cuda", "torch", "cores", "threads")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: Any = None) -> dict[str, Any]:
    """The device under test as the report, ``bench`` and the plugin's header print it (:data:`DESCRIPTION_KEYS`).

    ``device`` as given to the run (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a torch.device; None: this host's default).
    ``device_name`` is the GPU's name, or the CPU's model name on the CPU; ``sm``, ``capability`` and ``cuda`` (the
    CUDA torch was built with) are None off a CUDA device; ``cores`` is this host's CPU count and ``threads``
    torch's intra-op thread count now.
    """
    info = detect(device)
    on_gpu = info.device_type in ("cuda", "rocm")
    named = str(device) if device is not None else ("cuda" if info.cuda_available else "cpu")
    return {
        "device": named,
        "device_name": info.name if on_gpu else cpu_name(),
        "sm": info.sm,
        "capability": None if info.capability is None else cap_str(info.capability),
        "cuda": info.cuda_version if info.device_type == "cuda" else None,
        "torch": info.torch_version,
        "cores": os.cpu_count(),
        # torch's intra-op thread count now (None where torch is not imported: nothing here ran on it)
        "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    }


def device_line(description: dict[str, Any]) -> str:
    """``cuda:0: NVIDIA H200, SM90 (capability 9.0), CUDA 12.8`` or ``cpu: AMD EPYC 7B13, 2 cores, 1 thread``."""
    d = description
    if d.get("capability"):
        return f"{d['device']}: {d['device_name']}, {d['sm']} (capability {d['capability']}), CUDA {d['cuda']}"
    threads = d.get("threads")
    return (f"{d['device']}: {d['device_name']}, {d['cores']} cores"
            + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""))


def check_device(device: str | None, option: str = "--device") -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that torch can use here (None: cuda when there is one, else cpu);
    a :class:`~mla_conformance.errors.UserError` naming ``option`` otherwise."""
    import torch  # imported when a device is checked, not when the matrix is read

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise UserError(f"{option} {device!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(f"{option} {device}: torch sees no CUDA device on this host (torch {torch.__version__}, "
                        f"{build})")
    if index and int(index) >= torch.cuda.device_count():
        raise UserError(f"{option} {device}: this host has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device
