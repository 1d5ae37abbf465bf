"""Keep freed host memory for reuse instead of handing it back to the kernel (glibc malloc).

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as mapped blocks
are freed) with a fresh mapping, and hands the heap's free top back to the kernel once it
exceeds 128 KiB. A training step allocates and frees its activations, gradients and FSDP2's
flat buffers every time, so each step faults every page of them in again, and on CPU processes
that share cores the kernel's time is the ranks' time. Measured on the 2-core VM, 4 gloo
processes of one thread each, the MLP example's forward and backward at micro-batch 4
(3 runs each, 2026-12-06): with glibc's defaults 24-37 ms a step, 7-15 ms
of it in the kernel (3,000-3,600 minor page faults a step); with freed memory kept 14-17 ms, 1-4
ms in the kernel, no faults. Whole runs of the runtime gain less (bench/host_allocator.py:
the MLP's dp 4 ZeRO 0 and 3 0.86 and 0.91 of their steps, other layouts within noise).

The profiler, `plan calibrate` and every rank of the runtime set the same thresholds, so that
layers are timed under the allocator the plan runs with. `PLAN_KEEP_FREED_MEMORY=0` in the
environment leaves glibc's defaults (for a host that must get freed memory back at once; then
profile, calibrate and run with it alike).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1          # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20      # glibc's largest (its DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): larger blocks stay mapped
TRIM_THRESHOLD = 1 << 30       # free memory the heap keeps at its top before returning it


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (later allocations follow them).
    False, changing nothing, where the C library is not glibc (macOS, musl) or the environment
    says PLAN_KEEP_FREED_MEMORY=0."""
    if os.environ.get("PLAN_KEEP_FREED_MEMORY") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt       # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
