"""What machine this is, for reports and for keys of per-machine measurements."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform reports)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# omp_pause_resource_all's argument: end the runtime's threads (OpenMP 5.0: omp_pause_hard)
_OMP_PAUSE_HARD = 2


def hand_over_compute_threads() -> bool:
    """End the OpenMP worker threads the calling thread started, before another thread takes over
    the computing (the server's engine thread after the model was loaded and warmed up here).

    GNU OpenMP (torch's and the kernels' runtime on Linux) keeps a team of workers per thread that
    ever ran a parallel region, and once its teams hold more threads than there are CPUs it cuts
    every barrier's spin-wait to ~100 iterations: two teams of two on a 2-core machine put both
    compute threads to sleep at each of a pass's ~200 barriers (measured: ~100 context switches
    and a few ms per token, 5-20% of the decode speed). Only libgomp is handed over (LLVM's and
    Intel's runtimes neither throttle this way nor pause per thread); True when it was."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {line.split()[-1] for line in fh if "libgomp" in line and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0 (GCC < 9)
            continue
        pause.restype = ctypes.c_int
        pause.argtypes = [ctypes.c_int]
        return bool(pause(_OMP_PAUSE_HARD) == 0)
    return False
