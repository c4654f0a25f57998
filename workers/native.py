"""The one place a worker thread that may run torch ops is made: each gets its OpenMP thread count from here.

Why: torch's OpenMP runtime (libgomp) gives each thread that runs a parallel op a team of threads of its own, kept
as long as that thread lives. Once a process holds more team threads than CPUs, every team stops spin-waiting
between parallel regions: its threads sleep and are woken for each one, and the model thread's many small matmuls
each pay a wake-up (about 2,400 context switches per 128-token job on 2 CPUs, and twice the job's time:
``scripts/bench_worker_pace.py``). So the model thread owns the only team; every other long-lived thread runs its
torch ops on itself alone (``omp_threads=1``); a short job that wants the whole machine (loading the model) runs
on a thread that exits (:func:`on_own_thread`), and its team exits with it.

And the team does not spin: ``OMP_WAIT_POLICY=PASSIVE`` (:func:`configure_native_pools`, before torch loads). A
team that spins between parallel regions is fast only while it owns its CPUs; on a machine shared with other work (CI,
several workers on one host, a developer's laptop) each region waits for a descheduled spinner, and the same
128-token job took 3.4-4.1 s instead of 0.27 s (2 CPUs, another benchmark running: bench_worker_pace.py's
``rule-spin`` variant).

Each thread made here also carries its name into the kernel (``/proc/<pid>/task/<tid>/comm``), which the threads
it starts inherit: a team shows as several threads of one name (tests/worker/test_native.py counts them).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
PR_SET_NAME = 15  # prctl(2)
COMM_LEN = 15  # the kernel keeps 15 bytes of a thread's name
ALL = 0  # omp_threads: torch's own count (the model thread)


def worker_thread(target: Callable[[], Any], name: str, *, omp_threads: int = 1, daemon: bool = True
                  ) -> threading.Thread:
    """A thread (not yet started) running ``target`` with ``omp_threads`` OpenMP threads (``ALL``: torch's count)."""

    def run() -> None:
        use_openmp_threads(omp_threads)
        target()

    return threading.Thread(target=run, name=name, daemon=daemon)


def thread_pool(max_workers: int, name: str, *, omp_threads: int = 1) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads (``name_0``, ...) run torch ops with ``omp_threads`` OpenMP threads."""
    return ThreadPoolExecutor(max_workers, name, lambda: use_openmp_threads(omp_threads))


_adopted = threading.local()
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
# fixed, where glibc would raise it to 32 MiB; 4 MiB rather than glibc's starting 128 KiB: the same pace and
# less memory after the corpus (567 vs 612 MB, bench-results/worker-pace-mmap.json), and no map and unmap for
# each of the many mid-sized tensors of a step
MMAP_THRESHOLD_BYTES = 4 << 20


def configure_native_pools() -> None:
    """OpenMP team threads sleep between parallel regions instead of spinning, and the tokenizers library keeps no
    thread pool of its own (each unless the user set its variable).

    The tokenizers pool (Rust rayon: one thread per CPU, started by the first thread that tokenizes) would be a
    second team beside the model thread's; the worker tokenizes one short prompt at a time, which it does not
    parallelise. Both libraries read their variable when they load: call this first thing in the process.
    """
    if "torch" in sys.modules or "tokenizers" in sys.modules:
        log.warning("native pool settings made after torch or tokenizers were imported: they may have no effect")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def fix_mmap_threshold() -> bool:
    """Keeps glibc's mmap threshold fixed (``MMAP_THRESHOLD_BYTES``); False where the C library is not glibc.

    Why: glibc raises the threshold to the size of each mmap-ed block freed (up to 32 MiB), so after one large
    image (its bytes, its decoded pixels) blocks of up to that size come from the heaps instead, which keep what
    is freed in them: the worker's memory grew from 0.55 GB to 1-1.2 GB after one pass of the hostile-image corpus
    and stayed there (bench_worker_pace.py). Fixed, every block over the threshold is mapped and unmapped on its own.
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


def adopt_thread(name: str) -> None:
    """For a pool thread made by a library (Celery's job threads): on its first call there, as :func:`worker_thread`
    would have set it up (one OpenMP thread); nothing after that."""
    if not getattr(_adopted, "done", False):
        _adopted.done = True
        use_openmp_threads(1, f"{name}_{threading.current_thread().name.rsplit('_', 1)[-1]}")


def on_own_thread(call: Callable[[], T], name: str = "vlmq-load") -> T:
    """``call()`` with torch's full thread count, on a thread that exits when it returns (its team exits with it)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # raised again on the caller's thread
            error.append(e)

    thread = worker_thread(run, name, omp_threads=ALL, daemon=False)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def use_openmp_threads(omp_threads: int, name: str | None = None) -> None:
    """Names the calling thread in the kernel and sets its OpenMP thread count (``ALL``: leave torch's)."""
    _set_kernel_name((name or threading.current_thread().name).removeprefix("vlmq-"))
    if omp_threads == ALL:
        return
    import torch

    torch.get_num_threads()  # torch sets this thread's OpenMP thread count on its first use here: before ours
    for lib in _openmp_libraries():
        lib.omp_set_num_threads(omp_threads)


def _set_kernel_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_NAME, name[:COMM_LEN].encode(), 0, 0, 0)
    except (OSError, AttributeError, TypeError):  # not Linux: the name is only for tests and tools
        pass


def _openmp_libraries() -> list[ctypes.CDLL]:
    """The OpenMP runtimes loaded in this process (torch's bundled libgomp, or an Intel or LLVM one)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:  # not Linux
        return []
    found = []
    for path in sorted(paths):
        if path.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp", "libomp")):
            try:
                found.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD))
            except OSError:
                continue
    return found
