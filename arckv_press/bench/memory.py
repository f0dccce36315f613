"""Peak memory of a measured step, for the benchmark scripts.

- :class:`PeakHeldMemory`: the peak bytes the step allocated and still held at once, above its
  start (tensors are most of it). On CUDA the caching allocator's own peak counter; on CPU the bytes
  glibc's ``malloc`` has handed out and not taken back (``mallinfo2``: the heap's blocks in use plus
  its ``mmap`` blocks), sampled by a thread. Unlike the resident set, freed memory the allocator
  keeps does not count, so a step's figure does not depend on what ran before it.
- :class:`PeakRSS`: the process's resident set, sampled by a thread (weights, the allocator's
  retained pages and everything else the process holds included): what a user's machine sees.

Where there is no ``mallinfo2`` (not glibc), :class:`PeakHeldMemory` falls back to the resident set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

__all__ = ["PeakHeldMemory", "PeakRSS", "harness_free_peak_mib", "malloc_in_use"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2


def malloc_in_use() -> int | None:
    """Bytes ``malloc`` has handed out and not taken back (glibc's ``mallinfo2``: ``uordblks``, the
    heap's blocks in use, plus ``hblkhd``, its ``mmap`` blocks), or ``None`` without ``mallinfo2``.
    Counts every thread's arena."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _trim() -> None:
    """Return the free memory the allocator still holds to the system (glibc ``malloc_trim``)."""
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:
        pass


class _Sampler:
    """Peak of ``read()`` above its value at entry (``peak`` bytes, absolute; ``peak_mib`` relative),
    sampled every ``interval`` seconds by a thread, and once more at exit."""

    def __init__(self, read, interval: float):
        self.read, self.interval = read, interval
        self.peak_mib = float("nan")

    def __enter__(self):
        _trim()
        self.start = self.peak = self.read()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(self.interval):
                self.peak = max(self.peak, self.read())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())
        self.peak_mib = (self.peak - self.start) / 2**20
        return False


class PeakHeldMemory:
    """Peak bytes allocated inside the ``with`` block and held at once, in MiB (``peak_mib``), on
    ``device`` (``cpu``, or a CUDA device: its allocator's exact peak). On CPU sampled every
    ``interval`` seconds (a buffer held for less may be missed)."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.001):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_mib = float("nan")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            read = malloc_in_use if _MALLINFO2 is not None else PeakRSS.rss_bytes
            self._sampler = _Sampler(read, self.interval).__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mib = max(torch.cuda.max_memory_allocated(self.device) - self._start, 0) / 2**20
        else:
            self._sampler.__exit__(*exc)
            self.peak_mib = max(self._sampler.peak_mib, 0.0)
        return False


class PeakRSS(_Sampler):
    """Peak resident memory of the process above its value at entry, in MiB (``peak_mib``; ``peak`` in
    bytes, absolute), sampled every ``interval`` seconds by a thread. Free memory the allocator still
    holds is returned to the system first (glibc ``malloc_trim``, where there is one), so the step's
    own allocations count."""

    def __init__(self, interval: float = 0.005):
        super().__init__(self.rss_bytes, interval)

    @staticmethod
    def rss_bytes() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            import psutil

            return psutil.Process().memory_info().rss


def harness_free_peak_mib(rss: PeakRSS, held=None) -> float:
    """The process's peak resident MiB of a measured step, less the bytes of the prefilled cache
    ``held`` that only the harness keeps beside it (to compact a copy of it per method): what the
    step's peak is when a user compacts their one prefilled cache in place."""
    from arckv_press.cache import cache_nbytes

    return (rss.peak - (cache_nbytes(held) if held is not None else 0)) / 2**20
