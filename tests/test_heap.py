"""The serving processes' heap (runtime/serving/heap.py): request-sized blocks come from a heap that keeps what
was freed, unless the operator of the process tuned glibc itself.  Each case runs in a fresh interpreter:
``mallopt`` is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# How many blocks glibc maps for one 4 MiB allocation (mallinfo2's hblks), before and after keep_freed_blocks.
PROBE = """
import ctypes
from policy_operator.runtime.serving import heap

libc = ctypes.CDLL("libc.so.6")
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def mapped(size):
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after - before


print(mapped(4 << 20), heap.keep_freed_blocks(), mapped(4 << 20))
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's heap"
)


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@glibc
def test_request_sized_blocks_come_from_the_heap_once_tuned() -> None:
    assert probe() == ["1", "True", "0"], "a 4 MiB block is mapped by default, taken from the heap once tuned"


@glibc
def test_a_process_that_tuned_glibc_itself_keeps_its_tuning() -> None:
    assert probe(MALLOC_MMAP_THRESHOLD_="131072") == ["1", "False", "1"]
