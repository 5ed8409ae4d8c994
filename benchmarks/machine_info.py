"""What the benchmark reads about the machine and the process: /proc (peak RSS, memory,
CPU), the load average, library versions and the GPU (nvidia-smi).

Linux first: where /proc is missing, RSS falls back to `resource` and the rest to None.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import resource

import numpy as np

from cognet.benchmarks import engines as eng
from cognet.benchmarks.workload import Pool


def release_memory() -> float:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so that what an
    earlier run freed does not count in the next run's RSS; returns the RSS in MB after."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status_mb("VmRSS:") or 0.0


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the process' peak RSS (Linux VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    peak = _status_mb("VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
            cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count()
    info = {
        "cpu": cpu,
        "cores": cores,
        "threads": threads,
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": _gpu_name(),
        "versions": _versions(),
        "load_average_start": loadavg(),
    }
    return info


def workload_info(pool: Pool) -> dict:
    past = pool.history_lengths()
    return {
        "source": pool.description,
        "patients": len(pool),
        "past_visits_mean": float(past.mean()),
        "past_visits_max": int(past.max()),
        "codes_mean": float(np.mean([len(p[-1].diag) + len(p[-1].proc) for p in pool.patients])),
    }


def _versions() -> dict:
    out = {}
    for mod in ("numpy", "pyarrow", "onnxruntime", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _gpu_name() -> str | None:
    out = (eng.nvidia_smi("--query-gpu=name") or "").strip()
    return out.splitlines()[0] if out else None


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            return round(int(fh.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
