"""Keep freed memory in the process, so that a pipeline's fresh tensors cost no page faults.

A stage allocates and frees tensors of a layer's size every minibatch (gradients, received
activations). glibc serves such a block from fresh pages once it has handed the freed one back to
the kernel, and the kernel then faults in every 4 KiB page on first touch, which for a gradient of
tens of megabytes costs as long as a small backward pass (``benchmarks/pipeline_throughput.py``
counts the page faults per batch). Two settings of ``mallopt`` stop that: blocks up to 32 MiB come
from the heap, and the heap's free top is never trimmed. The process then keeps its peak memory
instead of returning it, which is what a caching allocator (CUDA's, jemalloc's) does too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory"]

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # an int: never trim in practice


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # only glibc has gnu_get_libc_version; musl's mallopt does nothing
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
