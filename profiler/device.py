"""Where and in what precision to profile: device and dtype choice, the device's name."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.errors import InputError
from pipeplan.profile import DeviceInfo

if TYPE_CHECKING:  # typing only: torch is imported where it is used
    import torch

__all__ = ["DTYPES", "resolve_device", "resolve_dtype", "device_info", "cpu_name", "available_bytes"]

DTYPES = ("float32", "bfloat16")


def resolve_device(name: str | None) -> torch.device:
    """``torch.device`` for ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; None = cuda when available."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InputError(f"unknown device {name!r} (expected cpu, cuda or cuda:N)") from exc
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"unsupported device {name!r} (expected cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {name} requested, but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            raise InputError(f"--device {name} requested, but this machine has {count} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """``torch.float32`` or ``torch.bfloat16`` from its name."""
    import torch

    if name not in DTYPES:
        raise InputError(f"unsupported dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return getattr(torch, name)


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo`` "model name"), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_info(device: torch.device) -> DeviceInfo:
    import torch

    if device.type == "cuda":
        return DeviceInfo(type="cuda", name=torch.cuda.get_device_name(device))
    return DeviceInfo(type="cpu", name=cpu_name())


def available_bytes(device: torch.device) -> int:
    """Bytes this process may still allocate on ``device``: the GPU's free memory, or on
    the CPU the smaller of the host's available memory and what the address-space limit
    (``RLIMIT_AS``) leaves."""
    import resource

    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            status = Path("/proc/self/status").read_text()
            used = int(status.split("VmSize:")[1].split()[0]) * 1024
        except (OSError, IndexError, ValueError):
            used = 0
        available = min(available, max(soft - used, 0))
    return available
