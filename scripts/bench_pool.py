"""Pool efficiency: the same requests through the engine in one process and through one real worker, in one run.

    python scripts/bench_pool.py [--n 16] [--repeats 3] [--out bench-results/bench_pool.json]

(a) ``Engine.generate`` on the requests all at once, in this process (the engine the worker builds: same backend
arguments, on a thread of its own, with the worker's native-pool settings); (b) the same requests submitted through
the SDK (``Client.submit_many``, image bytes as PNG) to one worker process (tiny-shapes, default batch: 16 jobs
held at once; the engine alone gets the same bound, ``max_num_seqs``) on an embedded Valkey and a file:// store,
all at t=0, timed from the submit to the last result. The workload is scripts/bench_engine.py's mixed captions
(``--n`` 48 requests, sizes log-uniform from thumbnails to ``--max-side``, answer lengths drawn in ``--lengths``,
eos ignored). Repeats alternate (a) and (b) and report
medians: jobs/s, generated tokens/s, and efficiency = (b) jobs/s / (a) jobs/s. Where a job's time goes outside the
engine comes from the timings each result carries (queue wait, input fetch, image decode, model = batcher wait +
engine) and the client's own submit and result-read time. Worker start-up is timed too (exec to ready, to the first
finished job): see README.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "e2e")]

from vlmq.workers import native  # noqa: E402

native.configure_native_pools()  # the engine alone here runs as the worker's does (before torch loads)

import bench_engine  # noqa: E402
from workerproc import TINY_CLASSES, WorkerProcess  # noqa: E402

from vlmq.client import Client  # noqa: E402
from vlmq.embedded import start_valkey  # noqa: E402
from vlmq.settings import Settings  # noqa: E402

PHASES = ("queue", "fetch", "decode_image", "model", "total")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


class EngineAlone:
    def __init__(self, settings: Settings) -> None:
        from vlmq.models import resolve_model
        from vlmq.workers.kvstore import store_from_settings
        from vlmq.workers.main import model_dir

        spec = resolve_model("tiny-shapes", settings)
        self.thread = native.thread_pool(1, "vlmq-bench-engine", omp_threads=native.ALL)
        kv_store = store_from_settings(settings, spec.name, model_dir(spec), None)
        from vlmq.workers.backends.engine import EngineBackend

        # the worker's engine, holding at most the worker's batch at once (its batcher's bound)
        self.backend = self.thread.submit(lambda: EngineBackend(
            model_dir(spec), "cpu", kv_tokens=settings.worker_budget, kv_store=kv_store,
            speculative=settings.speculative or "model", max_num_seqs=settings.worker_batch)).result()

    def run(self, requests: list) -> tuple[float, int]:
        def go() -> tuple[float, int]:
            start = time.monotonic()  # caches kept, as the worker's are (each repeat draws new images)
            outs = self.backend.engine.generate(requests)
            took = time.monotonic() - start
            return took, sum(len(o.token_ids) for o in outs)

        return self.thread.submit(go).result()


def through_pool(client: Client, requests: list, images: list[bytes]) -> tuple[float, int, dict, float, float]:
    start = time.monotonic()
    jobs = client.submit_many([{"image": data, "prompt": r.question, "max_new_tokens": r.max_new_tokens,
                                "ignore_eos": True} for r, data in zip(requests, images, strict=True)])
    submitted = time.monotonic() - start
    results = [job.result(timeout=600) for job in jobs]
    took = time.monotonic() - start
    phases = {p: statistics.median(r.timings.get(p, 0.0) for r in results) for p in PHASES}
    read_start = time.monotonic()
    for job in jobs[:4]:
        job.result(timeout=60)  # a result read, again: what the client pays per job after the worker's write
    read = (time.monotonic() - read_start) / 4
    return took, sum(len(r.token_ids) for r in results), phases, submitted / len(jobs), read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-side", type=int, default=1344)
    parser.add_argument("--lengths", default="16,256")
    parser.add_argument("--out", default="bench-results/bench_pool.json")
    args = parser.parse_args()
    lo, hi = (int(v) for v in args.lengths.split(","))
    server = start_valkey()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(broker_url=server.url, storage_url=f"file://{tmp}/store", cost_classes=TINY_CLASSES)
        exec_at = time.monotonic()
        worker = WorkerProcess(settings, Path(tmp) / "worker.log")
        try:
            worker.wait_ready()
            ready_s = time.monotonic() - exec_at
            engine = EngineAlone(settings)
            with Client(settings=settings) as client:
                client.submit(png_bytes(bench_engine.mixed_captions(1, 64, (4, 4), seed=99)[0].image), "warm-up",
                              max_new_tokens=4).result(timeout=300)
                first_job_s = time.monotonic() - exec_at
                engine.run(bench_engine.mixed_captions(2, 64, (4, 4), seed=98))  # warm-up
                for rep in range(args.repeats):
                    requests = bench_engine.mixed_captions(args.n, args.max_side, (lo, hi), seed=rep)
                    images = [png_bytes(r.image) for r in requests]  # the worker decodes what it is sent
                    requests = [bench_engine.Request(bench_engine_image(data), r.question, r.max_new_tokens, True)
                                for r, data in zip(requests, images, strict=True)]
                    if rep % 2:  # alternate which goes first: the machine's load drifts
                        b_s, b_tokens, phases, submit_s, read_s = through_pool(client, requests, images)
                        a_s, a_tokens = engine.run(requests)
                    else:
                        a_s, a_tokens = engine.run(requests)
                        b_s, b_tokens, phases, submit_s, read_s = through_pool(client, requests, images)
                    rows.append({"repeat": rep, "engine_s": round(a_s, 3), "pool_s": round(b_s, 3),
                                 "engine_tokens": a_tokens, "pool_tokens": b_tokens,
                                 "efficiency": round(a_s / b_s, 3),
                                 "job_median_phases_s": {k: round(v, 4) for k, v in phases.items()},
                                 "client_submit_s_per_job": round(submit_s, 4),
                                 "client_result_read_s": round(read_s, 4)})
                    print(f"repeat {rep}: engine {a_s:.2f} s, pool {b_s:.2f} s, efficiency {a_s / b_s:.2f}; job "
                          "medians " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()) +
                          f"; submit {submit_s * 1000:.0f} ms/job", flush=True)
        finally:
            worker.stop()
            server.stop()
    eff = statistics.median(r["efficiency"] for r in rows)
    summary = {"n": args.n, "engine_jobs_per_s": round(statistics.median(args.n / r["engine_s"] for r in rows), 2),
               "pool_jobs_per_s": round(statistics.median(args.n / r["pool_s"] for r in rows), 2),
               "engine_tokens_per_s": round(statistics.median(r["engine_tokens"] / r["engine_s"] for r in rows), 1),
               "pool_tokens_per_s": round(statistics.median(r["pool_tokens"] / r["pool_s"] for r in rows), 1),
               "efficiency_median": eff, "worker_exec_to_ready_s": round(ready_s, 2),
               "worker_exec_to_first_job_s": round(first_job_s, 2)}
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                                          "command": " ".join(sys.argv), "summary": summary, "repeats": rows},
                                         indent=2) + "\n")


def bench_engine_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


if __name__ == "__main__":
    main()
