"""Cache-affinity benchmark: throughput of a 2-worker pool with affinity routing on and off, same run.

Starts an embedded Redis-compatible server and NUM_WORKERS worker processes (the bundled model, file storage),
then runs the workload alternately without affinity (the baseline: every job on the shared class queue) and
with it, fresh images each run: each image's first question (waited for), then the other questions, round
after round, image after image (interleaved). It reports wall time from the first submit to the last result,
jobs per second, and images encoded fleet-wide (from the workers' published counters), and the ratio of
medians. Prints a table and writes JSON (default bench-results/affinity.json).

    python scripts/bench_affinity.py [--images 16] [--questions 8] [--repeats 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bundled model's scenes: scripts/tiny

from vlmq.client import Client  # noqa: E402
from vlmq.embedded import start_valkey  # noqa: E402
from vlmq.settings import Settings  # noqa: E402

MODEL = "tiny-shapes"
QUESTIONS = ["How many shapes?", "What colour is the circle?", "Is there a square?", "Describe the image.",
             "Where is the triangle?", "What is the largest shape?", "Any red shapes?", "Name one shape."]
CLASSES = "xs=64,s=256,m=1024,l=4096,xl"  # scaled to the bundled model's images (at most 324 tokens)


def scene(seed: int, size: int) -> bytes:
    from tiny.shapes import make_example

    buf = io.BytesIO()
    make_example((4242, seed), size=(size, size)).image.save(buf, "PNG")
    return buf.getvalue()


def start_worker(settings: Settings, name: str, log_dir: Path) -> subprocess.Popen[bytes]:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the child writes it until stopped)
    return subprocess.Popen([sys.executable, "-m", "vlmq.workers.main", "--name", name],
                            env={**os.environ, **settings.to_env()}, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(log_dir: Path, names: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not all(" ready." in (log_dir / f"{n}.log").read_text(errors="replace") for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not ready after {timeout} s; logs in {log_dir}")
        time.sleep(0.5)


def encoded(client: Client) -> int:
    return int(client.cache_stats()["models"].get(MODEL, {}).get("counters", {}).get("encoded_images", 0))


def run_once(client: Client, seed: int, args: argparse.Namespace) -> dict[str, float]:
    images = [scene(seed + i, args.size) for i in range(args.images)]
    before = encoded(client)
    t0 = time.perf_counter()
    first = client.submit_many([{"image": im, "prompt": QUESTIONS[0], "max_new_tokens": args.max_new_tokens}
                                for im in images])
    for job in first:
        job.result(timeout=600)
    rest = client.submit_many([{"image": im, "prompt": QUESTIONS[q % len(QUESTIONS)],
                                "max_new_tokens": args.max_new_tokens}
                               for q in range(1, args.questions) for im in images])
    for job in rest:
        job.result(timeout=600)
    wall = time.perf_counter() - t0
    jobs = len(first) + len(rest)
    return {"wall_s": wall, "jobs_per_s": jobs / wall, "jobs": jobs, "encoded_images": encoded(client) - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--size", type=int, default=1000, help="image side in pixels (1000: 324 vision tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--out", type=Path, default=Path("bench-results/affinity.json"))
    args = parser.parse_args()
    server = start_valkey()
    tmp = Path(tempfile.mkdtemp(prefix="vlmq-bench-affinity-"))
    settings = Settings(broker_url=server.url, storage_url=f"file://{tmp / 'store'}", cost_classes=CLASSES,
                        affinity_queue_bound=args.images * args.questions,
                        kv_archive=0)  # routing's effect alone (the archive also saves encodes across workers)
    names = [f"w{i}" for i in range(args.workers)]
    workers = [start_worker(settings, name, tmp) for name in names]
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        wait_ready(tmp, names)
        seed = 10_000
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                with Client(settings=dataclasses.replace(settings, affinity=mode == "on")) as client:
                    runs[mode].append(run_once(client, seed, args))
                seed += args.images
                print(f"affinity {mode}: {runs[mode][-1]}", flush=True)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait()
        server.stop()
    report(args, runs)
    return 0


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]]) -> None:
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    ratio = median["on"]["jobs_per_s"] / median["off"]["jobs_per_s"]
    print(f"\n{'mode':<14}{'jobs/s':>10}{'wall s':>10}{'images encoded':>16}")
    for mode, m in median.items():
        print(f"{'affinity ' + mode:<14}{m['jobs_per_s']:>10.2f}{m['wall_s']:>10.2f}{m['encoded_images']:>16.0f}")
    print(f"throughput ratio with/without affinity: {ratio:.2f}x")
    doc = {"workload": {k: getattr(args, k) for k in ("images", "questions", "size", "max_new_tokens", "workers",
                                                      "repeats")},
           "model": MODEL, "runs": runs, "median": median, "throughput_ratio_on_over_off": ratio,
           "command": "python scripts/bench_affinity.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
