"""Worker pace benchmark: a normal job's time alone, before and after passes of the hostile-image corpus.

Starts an embedded Redis-compatible server, a file:// store and one CPU worker (tiny-shapes). Per round it times
``--alone`` normal jobs (128 tokens, ignore_eos: the same model work each time), one after another, then sends a
pass of the corpus (tests/hostile_images.py: what the SDK refuses is forged past it, as the e2e test does) and
waits for it. Prints per round the median time alone, the model thread's context switches per job (an OpenMP
team whose threads sleep between parallel regions shows here) and the worker's resident memory; at the end the
ratio last round / first round. ``--env NAME=VALUE`` starts the worker with that variable (e.g.
MALLOC_MMAP_THRESHOLD_). Run it twice, alternating settings, to compare: the machine's load drifts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

import inputs  # noqa: E402
from hostile_images import CASES  # noqa: E402
from test_hostile_images_e2e import PROMPT, Forger  # noqa: E402
from workerproc import TINY_CLASSES, WorkerProcess  # noqa: E402

from vlmq.client import Client  # noqa: E402
from vlmq.embedded import start_valkey  # noqa: E402
from vlmq.errors import InvalidRequest, JobFailed  # noqa: E402
from vlmq.settings import Settings  # noqa: E402


def normal(client: Client) -> float:
    start = time.monotonic()
    client.submit(inputs.encode(inputs.rgb(), "PNG"), PROMPT, max_new_tokens=128, ignore_eos=True).result(timeout=300)
    return time.monotonic() - start


def corpus_pass(client: Client, forger: Forger) -> None:
    jobs = []
    for case in CASES:
        try:
            jobs.append(client.submit(case.data(), PROMPT, max_new_tokens=8))
        except InvalidRequest:
            jobs.append(forger.submit(case.data()))
    for job in jobs:
        try:
            job.result(timeout=300)
        except JobFailed:
            pass


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def switches(pid: int) -> dict[int, int]:
    """Thread id -> voluntary context switches, for each thread of the worker."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = int(next(x for x in status.splitlines() if x.startswith("voluntary_ctxt")).split()[1])
    return out


def alone(client: Client, pid: int, n: int) -> tuple[float, float]:
    """Median seconds of ``n`` normal jobs, and the busiest thread's context switches per job."""
    before = switches(pid)
    times = [normal(client) for _ in range(n)]
    after = switches(pid)
    most = max(v - before.get(tid, 0) for tid, v in after.items())
    return statistics.median(times), most / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--alone", type=int, default=7)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    os.environ.update(kv.split("=", 1) for kv in args.env)
    server = start_valkey()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(broker_url=server.url, storage_url=f"file://{tmp}/store", cost_classes=TINY_CLASSES)
        worker = WorkerProcess(settings, Path(tmp) / "worker.log")
        try:
            worker.wait_ready()
            with Client(settings=settings) as client:
                warm = client.submit(inputs.encode(inputs.rgb(), "PNG"), PROMPT, max_new_tokens=4)
                warm.result(timeout=300)
                forger = Forger(client, settings, warm.id)
                medians = []
                for round_ in range(args.passes + 1):
                    median, per_job = alone(client, worker.proc.pid, args.alone)
                    medians.append(median)
                    print(f"after {round_} passes: alone median {median:.3f} s, {per_job:.0f} context switches per "
                          f"job, worker RSS {rss_mb(worker.proc.pid):.0f} MB", flush=True)
                    if round_ < args.passes:
                        corpus_pass(client, forger)
                forger.close()
            print(f"last / first: {medians[-1] / medians[0]:.2f}")
        finally:
            worker.stop()
            server.stop()


if __name__ == "__main__":
    main()
