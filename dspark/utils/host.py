"""Process-level settings for CPU serving.

glibc's malloc serves large blocks (a prompt step's activations: hundreds of rows × a few thousand
floats) by mmap, and by default raises its mmap threshold to the size of each such block freed: a
process's allocation history then decides whether the next step's temporaries come from the heap or from
fresh pages, which are faulted in on first touch. So a speculative engine, whose allocations differ, ran the
elementwise ops of its prompt steps slower than a plain engine on the same prompts, and its target forward
slower even with speculation all but off; fixed thresholds make the two forwards equal and leave plain
decoding's speed where it was. `tune_malloc` fixes them (256 MiB
mmap threshold, 512 MiB trim threshold), so freed temporaries stay in the heap for the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 256 * 2**20
TRIM_THRESHOLD = 512 * 2**20
IDLE_TRIM_S = 0.5  # a server idle this long after its last request ended trims its heap (`trim_heap_on_cpu`)
_done = False


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once). Not on other C libraries, not when the
    environment sets them already (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_) and not with
    DSPARK_MALLOC_TUNING=0. Returns whether they were set by this call or an earlier one."""
    global _done
    if _done:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get("DSPARK_MALLOC_TUNING", "1") == "0"
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB%s", MMAP_THRESHOLD >> 20,
             TRIM_THRESHOLD >> 20, "" if _done else " (refused)")
    return _done


def trim_heap() -> bool:
    """Give the heap's free memory back to the OS now (glibc `malloc_trim(0)`). Loading a model frees far more
    than a step ever allocates (parsed GGUF headers, dequantization and packing temporaries), and under
    `tune_malloc`'s 512 MiB trim threshold that memory would stay resident; one trim after the load returns
    it and leaves the step-time thresholds as they are. False where the C library has no malloc_trim."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def trim_heap_on_cpu(engine) -> None:
    """`trim_heap` for an engine on the CPU: the server calls it once it has been idle `IDLE_TRIM_S` since its last
    request ended (the response sent, the objects that served it freed), so the memory glibc keeps cached under
    `tune_malloc`'s fixed thresholds goes back to the OS (milliseconds)."""
    from dspark.config import resolve_device
    device = getattr(getattr(engine, "config", None), "device", None)  # (test doubles may have no config)
    if device is not None and resolve_device(str(device)).startswith("cpu"):
        trim_heap()
