"""What machine is this: the one place that reads the processor model, core count, memory and the
versions of the inference libraries. Each caller composes the description it needs (a replay's
fingerprint, a calibration cache key, a benchmark report's header) from these parts, so the same
fact is read the same way everywhere.

torch is imported only by `gpu_name` and `torch_details`: the bus host may not have it, and the
payload's boot must not pay for it here."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo, else what `platform` knows."""
    fallback = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), fallback)
    except OSError:
        return fallback


def cpu_count() -> int:
    return os.cpu_count() or 1


def memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def library_versions(names: tuple[str, ...] = ("torch", "transformers")) -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing is imported); None where absent."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def gpu_name() -> str | None:
    import torch  # heavy: only callers that run inference ask for the GPU

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def torch_details(device: str) -> dict:
    """What changes a measured compute cost on this machine: torch's thread count and build, the device."""
    import torch  # heavy: only the calibration harness asks

    details = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        details["gpu"] = torch.cuda.get_device_name()
    return details
