"""glibc's heap tuned for a server that allocates the same large buffers for every request.

Every request allocates buffers of a few hundred KB to a few MB: the received frame, the prepared image copied
out of the front-end ring, a batch's stacked rows.  Above glibc's mmap threshold (128 KB, raised only as far as
the largest block freed so far) each is a fresh mmap whose pages fault in on first touch and go back to the
kernel when freed, and heap blocks are handed back as soon as 2x the threshold is free at the heap's top -- so
the same pages fault in again for the next request.  With a fixed mmap threshold above the largest per-request
block and a trim threshold twice that, the heap keeps what one batch freed for the next: the model process's
loop, in bursts of 32 on the 2-core CPU, went from 166-176 to 85-97 us of CPU per request
(bench/results/model-loop-cpu.md), most of it the prepared image copied out of the front-end ring.

Only after the model is loaded: weights staged on the host on their way to the device would otherwise stay in
the heap once freed.  A process that sets ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` itself
keeps its own tuning, and a libc without ``mallopt`` (musl) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Final

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES: Final = 64 << 20  # above a batch of 32 rows of three 224x224 float32 cameras
TRIM_THRESHOLD_BYTES: Final = 2 * MMAP_THRESHOLD_BYTES
_M_TRIM_THRESHOLD: Final = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD: Final = -3
USER_TUNING_ENV: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_blocks() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module's docstring); True when set."""
    if any(name in os.environ for name in USER_TUNING_ENV):
        log.info("heap: %s set, glibc's own tuning kept", " / ".join(n for n in USER_TUNING_ENV if n in os.environ))
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("heap: no glibc mallopt here, the allocator's defaults kept")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
