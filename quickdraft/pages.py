"""Memory pages of a model's large weight buffers (Linux; elsewhere plain allocations, nothing given back).

A decode step streams every weight once. In 4 KiB pages that is a page walk every 4 KiB, and the pages of a
process that allocated and freed much before (a benchmark that wrote the file it loads, a notebook) lie
scattered: gemma-4-E2B's one-row GEMMs read 16 GB/s there against 21 GB/s from transparent huge pages
(benchmarks/results/gguf_archs/README.md). So the loader puts weights in buffers advised as huge pages
before their first touch (:func:`weight_buffer`), whatever the system's THP mode leaves to madvise; and a
buffer being replaced slab by slab gives each slab's pages back as it goes (:func:`discard_pages`).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch

PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MIN_HUGE_BYTES = 4 << 20  # smaller buffers: a plain allocation (numpy's own rule of thumb)
_MADV_HUGEPAGE = 14


_LIBC: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> None:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None)  # (this process's C library, loaded once)
    _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice)


def weight_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised uint8 array of ``shape`` for weights: on Linux, from 4 MiB on, anonymous memory
    aligned to and advised as transparent huge pages before anything touches it (the memory goes when
    the last array or tensor viewing it does)."""
    n = int(np.prod(shape, dtype=np.int64))
    if sys.platform != "linux" or n < MIN_HUGE_BYTES:
        return np.empty(shape, dtype=np.uint8)
    region = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # (shared anonymous memory is shmem: no THP)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -addr % HUGE_PAGE
    _madvise(addr + offset, n, _MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8, count=n, offset=offset).reshape(shape)


def discard_pages(t: torch.Tensor) -> None:
    """Give the whole memory pages inside ``t``'s bytes back to the system (Linux; elsewhere nothing):
    they read as zeros afterwards, so only for bytes nothing will read again."""
    if sys.platform != "linux" or not t.is_cpu:
        return
    start = t.data_ptr()
    lo = -(-start // PAGE_BYTES) * PAGE_BYTES
    hi = (start + t.numel() * t.element_size()) // PAGE_BYTES * PAGE_BYTES
    if hi > lo:
        _madvise(lo, hi - lo, mmap.MADV_DONTNEED)
