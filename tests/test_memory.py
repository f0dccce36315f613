"""arckv_press.bench.memory: the peak memory of a measured step, against the bytes of the tensors it
makes (counted by hand)."""

import time

import pytest
import torch

from arckv_press.bench.memory import PeakRSS, PeakHeldMemory, malloc_in_use

MB = 2**20
needs_mallinfo = pytest.mark.skipif(malloc_in_use() is None, reason="no glibc mallinfo2 here")


@needs_mallinfo
def test_tensor_peak_is_the_largest_sum_of_held_tensor_bytes():
    with PeakHeldMemory() as mem:
        a = torch.ones(8 * MB // 4)
        b = torch.ones(4 * MB // 4)      # a + b held: 12 MiB
        time.sleep(0.02)
        del a
        c = torch.ones(16 * MB // 4)     # b + c held: 20 MiB, the peak
        time.sleep(0.02)
        del b, c
        d = torch.ones(8 * MB // 4)
        time.sleep(0.02)
    assert 19 < mem.peak_mib < 21      # the tensors, within a MiB of what else came and went
    del d


@needs_mallinfo
def test_freed_memory_the_allocator_keeps_does_not_count():
    """Resident pages left by an earlier step do not lower or raise the next step's figure."""
    x = torch.ones(32 * MB // 4)
    del x
    with PeakHeldMemory() as mem:
        y = torch.ones(4 * MB // 4)
        time.sleep(0.02)
    assert 3 < mem.peak_mib < 5
    del y


def test_tensor_peak_of_an_in_place_step_is_not_the_tensor():
    x = torch.ones(4 * MB // 4)
    with PeakHeldMemory() as mem:
        x.add_(1)  # in place: no other 4 MiB
        time.sleep(0.01)
    assert 0 <= mem.peak_mib < 1


def test_rss_peak_sees_touched_pages():
    n = 64 * MB // 4
    with PeakRSS() as rss:
        x = torch.ones(n)  # 64 MiB, every page written
        time.sleep(0.02)
        del x
    assert rss.peak_mib > 48
