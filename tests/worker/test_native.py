"""The worker's thread rule and native-library settings (workers/native.py), each observed in a fresh process."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from vlmq.workers.native import on_own_thread

pytestmark = pytest.mark.timeout(120)


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> list[int]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=100,
                         check=True, env=env)
    return [int(v) for v in out.stdout.split()]


def test_on_own_thread_returns_its_value_and_raises_its_error() -> None:
    seen: list[threading.Thread] = []
    assert on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="lost"):
        on_own_thread(lambda: {}["lost"])


TEAMS = """
import os, time, torch
from vlmq.workers.native import on_own_thread
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
base = threads()
on_own_thread(lambda: torch.ones(4_000_000).add_(1))  # a parallel op: an OpenMP team for that thread
deadline = time.monotonic() + 20
while threads() > base and time.monotonic() < deadline:  # the team's threads exit after that thread does
    time.sleep(0.01)
after_own = threads()
torch.ones(4_000_000).add_(1)
print(base, after_own, threads())
"""


def test_an_openmp_team_started_on_own_thread_ends_with_it() -> None:
    base, after_own, after_main = _run(TEAMS)
    assert after_own == base  # its team exited with the thread
    assert after_main == base + 1  # one started on a thread that lives (this main thread) stays


# every way native.py makes a long-lived thread; each runs parallel torch ops (as a KV tier's conversion or the
# preprocessing does) and reports the threads started besides itself, and its kernel name
SIDE = """
import os, sys, threading, torch
from vlmq.workers import native
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
base = threads()
omp = native.ALL if sys.argv[2] == "all" else 1
def side():
    torch.ones(4_000_000, dtype=torch.float16).float().mul_(2)
    print(threads() - base - 1)
    name = open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()
    print(int(name in ("side", "side_0", "job_0")))
if sys.argv[1] == "thread":
    thread = native.worker_thread(side, "vlmq-side", omp_threads=omp)
    thread.start()
    thread.join()
elif sys.argv[1] == "pool":
    with native.thread_pool(1, "vlmq-side", omp_threads=omp) as pool:
        pool.submit(side).result()
else:  # a library's pool thread adopted at its first task (Celery's job threads)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1, "ThreadPoolExecutor-0") as pool:
        pool.submit(lambda: (native.adopt_thread("vlmq-job"), side())).result()
"""


@pytest.mark.parametrize("how", ["thread", "pool", "adopted"])
def test_a_thread_beside_the_model_thread_starts_no_openmp_team(how: str) -> None:
    assert _run(SIDE, how, "one") == [0, 1]  # no team; named in the kernel, as a team of its would be
    if how != "adopted":
        assert _run(SIDE, how, "all") == [1, 1]  # the model thread's setting: a team of its own (one more thread)


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
block = bytearray(8 * 1024**2)
print(libc.mallinfo2().hblkhd - before)
"""


def test_the_mmap_threshold_stays_fixed_after_a_large_block_is_freed() -> None:
    (mapped_default,) = _run(MMAP, "default")
    (mapped_fixed,) = _run(MMAP, "fixed")
    assert mapped_default == 0  # without the fix, an 8 MiB block after a 20 MiB one comes from the heap ...
    assert mapped_fixed >= 8 * 1024**2  # ... with it, it is mapped (and unmapped when freed)


WAIT = """
import os
from vlmq.workers.native import configure_native_pools
configure_native_pools()
print(int(os.environ["OMP_WAIT_POLICY"] == "PASSIVE"))
"""


def test_openmp_threads_wait_passively_unless_the_user_chose() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _run(WAIT, env=env) == [1]
    assert _run(WAIT, env={**env, "OMP_WAIT_POLICY": "ACTIVE"}) == [0]


THREAD_MAKERS = {"Thread", "ThreadPoolExecutor", "Timer"}
# one-shot, short-lived, no torch ops: the shutdown timer that hands unfinished jobs back
NOT_LONG_LIVED = {("app.py", "Timer")}


def test_every_worker_thread_is_made_through_native() -> None:
    import ast
    from pathlib import Path

    import vlmq.workers

    root = Path(vlmq.workers.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "native.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in THREAD_MAKERS and (path.name, name) not in NOT_LONG_LIVED:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert found == []  # make it with native.worker_thread / native.thread_pool: they set its OpenMP threads
