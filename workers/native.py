"""Process-wide settings of the native libraries under the worker: torch's OpenMP runtime and glibc's malloc.

Both keep the worker's pace and size what they were before a burst of large images: measured with
``scripts/bench_worker_pace.py`` (one worker, tiny-shapes on 2 CPU cores), a 128-token job took 0.53-0.86 s
without the first and 0.25-0.32 s with it, and the worker's resident memory grew from 0.55 GB to 1.3-1.5 GB over
three passes of the hostile-image corpus without the second and stayed at 0.62 GB with it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's starting value, kept fixed


def on_own_thread(call: Callable[[], T], name: str = "vlmq-load") -> T:
    """``call()`` on a thread that exits when it returns, so that the OpenMP threads it starts exit with it.

    Why: torch's OpenMP runtime (libgomp) gives each thread that runs a parallel op its own team of threads, kept
    as long as that thread lives, and once a process holds more team threads than CPUs, every team stops
    spin-waiting between parallel regions: its threads sleep and are woken for each one. Loading a model runs
    parallel ops; on the main thread, which lives as long as the worker, its team would make each small matmul of
    the model thread pay a wake-up (a loop of 1024-wide matrix-vector products: 5x as long on 2 cores).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # raised again on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def fix_mmap_threshold() -> bool:
    """Keeps glibc's mmap threshold at its starting value; False where the C library is not glibc.

    Why: glibc raises the threshold to the size of each mmap-ed block freed (up to 32 MiB), so after one large
    image (its bytes, its decoded pixels) blocks of up to that size come from the heaps instead, which keep what
    is freed in them: the worker's memory grows with each burst of large images and is not given back. Fixed,
    every block over the threshold is mapped and unmapped on its own.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD) failed; the worker's memory may grow after large images")
    return ok
