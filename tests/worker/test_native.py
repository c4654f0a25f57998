"""The worker's settings of native libraries (workers/native.py), each observed in a fresh Python process."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from vlmq.workers.native import on_own_thread


def _run(code: str, *args: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=True)
    return [int(v) for v in out.stdout.split()]


def test_on_own_thread_returns_its_value_and_raises_its_error() -> None:
    seen: list[threading.Thread] = []
    assert on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="lost"):
        on_own_thread(lambda: {}["lost"])


TEAMS = """
import os, torch
from vlmq.workers.native import on_own_thread
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
base = threads()
on_own_thread(lambda: torch.ones(4_000_000).add_(1))  # a parallel op: an OpenMP team for that thread
after_own = threads()
torch.ones(4_000_000).add_(1)
print(base, after_own, threads())
"""


def test_an_openmp_team_started_on_own_thread_ends_with_it() -> None:
    base, after_own, after_main = _run(TEAMS)
    assert after_own == base  # its team exited with the thread
    assert after_main == base + 1  # one started on a thread that lives (this main thread) stays


MMAP = """
import ctypes, sys
from vlmq.workers.native import fix_mmap_threshold
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                 "fordblks keepcost").split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
big = bytearray(20 * 1024**2)
del big  # a mapped block freed: glibc's own rule raises the threshold to its size
before = libc.mallinfo2().hblkhd
block = bytearray(4 * 1024**2)
print(libc.mallinfo2().hblkhd - before)
"""


def test_the_mmap_threshold_stays_fixed_after_a_large_block_is_freed() -> None:
    (mapped_default,) = _run(MMAP, "default")
    (mapped_fixed,) = _run(MMAP, "fixed")
    assert mapped_default == 0  # without the fix, a 4 MiB block after a 20 MiB one comes from the heap ...
    assert mapped_fixed >= 4 * 1024**2  # ... with it, it is mapped (and unmapped when freed)
