"""Facts about one rank: host, device, versions, kernel, shared memory and the relevant variables.

Everything is read when :func:`collect` runs (not at import), so a test can patch
``platform.release`` or ``torch.__version__`` on one rank and see it reported.
"""
from __future__ import annotations

import os
import platform
import sys

import torch

__all__ = ["ENV_PREFIXES", "ENV_NAMES", "TABLE_COLUMNS", "collect"]

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "MASTER_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)

# (heading, key) of the one-line-per-rank table; the JSON holds every fact.
TABLE_COLUMNS = (("rank", "rank"), ("local", "local_rank"), ("host", "host"),
                 ("device", "device"), ("model", "device_model"), ("mem GiB", "memory"),
                 ("cc", "compute_capability"), ("torch", "torch"), ("cuda", "cuda"),
                 ("nccl", "nccl"), ("driver", "driver"), ("python", "python"),
                 ("kernel", "kernel"), ("shm GiB", "shm"), ("cpus", "cpus"))


def _meminfo():
    """(total, available) bytes of host memory, or (None, None) where /proc/meminfo is missing."""
    values = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


def _cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver():
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."
    for word in first.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


def _shm():
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _device_facts(device):
    if device.type != "cuda":
        total, free = _meminfo()
        return {"device_model": _cpu_model(), "memory_total": total, "memory_free": free,
                "compute_capability": None, "device_uuid": None, "pci_bus_id": None}
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    bus = ":".join(str(getattr(props, f"pci_{p}_id", "?")) for p in ("domain", "bus", "device"))
    return {"device_model": props.name, "memory_total": int(total), "memory_free": int(free),
            "compute_capability": f"{props.major}.{props.minor}",
            "device_uuid": str(getattr(props, "uuid", "")) or None, "pci_bus_id": bus}


def _nccl_version():
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def collect(ctx):
    """This rank's facts as a JSON-ready dict."""
    shm_total, shm_free = _shm()
    facts = {
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world, "host": ctx.host,
        "pid": os.getpid(), "device": str(ctx.device),
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": _nccl_version(),
        "driver": _nvidia_driver(), "python": platform.python_version(),
        "python_executable": sys.executable, "kernel": platform.release(),
        "shm_total": shm_total, "shm_free": shm_free, "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(ENV_PREFIXES) or k in ENV_NAMES},
    }
    if ctx.cuda:
        facts["cuda_device_count"] = torch.cuda.device_count()
    facts.update(_device_facts(ctx.device))
    return facts
