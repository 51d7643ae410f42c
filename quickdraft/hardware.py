"""What machine this is, for reports and for keys of per-machine measurements."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass


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


# Other programs keeping this much of one core busy on average (steal by the VM's neighbours
# included) make a measurement unfit to keep: a first start beside a compile on both cores picked
# and kept slower kernels for 30 days (0.89x against 1.10x llama.cpp after a quiet re-tune).
BUSY_CORES = 0.25


@dataclass(frozen=True)
class Load:
    """How busy the machine was while something was measured: the cores other processes (and the
    hypervisor's steal) kept busy on average, out of the cores this process may run on."""

    others: float
    cores: int

    @property
    def busy(self) -> bool:
        return self.others > BUSY_CORES

    def describe(self) -> str:
        return f"other programs kept {self.others:.2f} of {self.cores} cores busy"


class LoadWatch:
    """Watches the CPUs this process may run on from :meth:`start` to :meth:`load`: their busy time
    (all but idle and I/O wait, steal included) minus this process's own CPU time is what others
    took. Where the CPU times cannot be read it reports an idle machine (the timings' own spread
    is then the only guard)."""

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _cpus() -> list[int]:
        try:
            return sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return list(range(os.cpu_count() or 1))

    def _sample(self) -> tuple[float, float, float] | None:
        import psutil

        try:
            per_cpu = psutil.cpu_times(percpu=True)
            own = psutil.Process().cpu_times()
        except (OSError, psutil.Error):
            return None
        busy = 0.0
        for i in self._cpus():
            if i < len(per_cpu):
                t = per_cpu[i]
                busy += sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(
                    t, "guest_nice", 0.0)
        return time.monotonic(), busy, own.user + own.system

    def start(self) -> LoadWatch:
        self._start = self._sample()
        return self

    def load(self) -> Load:
        """The load since :meth:`start`."""
        cores = len(self._cpus())
        end = self._sample()
        if self._start is None or end is None or end[0] - self._start[0] <= 0:
            return Load(0.0, cores)
        wall = end[0] - self._start[0]
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return Load(max(0.0, others / wall), cores)
