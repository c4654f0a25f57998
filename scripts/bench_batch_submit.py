"""Batch-file submit benchmark: the producer's peak memory and lines per second against the file's size.

For each size, writes an OpenAI-format batch file (images: a distinct one per 25 lines, as data: URLs, paths and
file:// URLs of files beside the batch file; every 100th line bad, of 12 kinds), then submits it
from a fresh producer process (``Client.submit_batch``, no worker) against an embedded Redis-compatible server
and file:// storage, and reads that process's peak RSS (``ru_maxrss``) and its Python-heap peak (tracemalloc)
before and after the submit. Prints a table and writes JSON (default bench-results/batch_submit.json).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from vlmq.embedded import start_valkey

PRODUCER = """
import json, resource, sys, time, tracemalloc
from vlmq.client import Client
with Client(sys.argv[1], sys.argv[2]) as client:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    t0 = time.perf_counter()
    batch = client.submit_batch(sys.argv[3])
    seconds = time.perf_counter() - t0
    heap = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "heap_peak": heap, "rss_before_kib": before, "rss_peak_kib": after,
                      "counts": batch.refresh()["request_counts"]}))
"""


def png(k: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32 + k % 40, 32 + k // 40 % 50), (k % 251, 60, 200)).save(buf, "PNG")
    return buf.getvalue()


def line(custom_id: str, url: str, model: str = "tiny-shapes", **body: object) -> str:
    content = [{"type": "text", "text": "How many shapes?"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": content}],
                                "max_tokens": 2, **body}})


def bad(i: int, good: str) -> str:
    kinds = [good[:-3], good.replace('"POST"', '"GET"'), line(f"r{i}", "missing.png"),
             line(f"r{i}", "data:image/png;base64,!!!"), line(f"r{i}", "x", model="gpt-4o"),
             line(f"r{i}", "data:image/png;base64," + base64.b64encode(b"not an image").decode()),
             line("r0", "img1.png"), line(f"r{i}", "img1.png", max_tokens=0), line(f"r{i}", "img1.png", tools=[]),
             good.replace("/chat/completions", "/embeddings"), line("", "img1.png"), line(f"r{i}", "img1.png", n=99)]
    return kinds[i // 100 % len(kinds)]


def write_file(folder: Path, n: int) -> Path:
    sources = []
    for k in range(max(8, n // 25)):
        if k % 3 == 1:
            (folder / f"img{k}.png").write_bytes(png(k))
            sources.append(f"img{k}.png")
        elif k % 3 == 2:
            (folder / f"img{k}.png").write_bytes(png(k))
            sources.append(f"file://{folder}/img{k}.png")
        else:
            sources.append("data:image/png;base64," + base64.b64encode(png(k)).decode())
    (folder / "img1.png").write_bytes(png(1))
    path = folder / "requests.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            good = line(f"r{i}", sources[i % len(sources)])
            f.write((bad(i, good) if i % 100 == 50 else good) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="5000,50000", help="lines per file, comma-separated")
    parser.add_argument("--out", default="bench-results/batch_submit.json")
    args = parser.parse_args()
    rows = []
    server = start_valkey()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in (int(x) for x in args.sizes.split(",")):
                folder, store = Path(tmp) / f"f{n}", Path(tmp) / f"store{n}"
                folder.mkdir()
                path = write_file(folder, n)
                t0 = time.perf_counter()
                run = subprocess.run([sys.executable, "-c", PRODUCER, server.url, f"file://{store}", str(path)],
                                     capture_output=True, text=True, check=True)
                report = json.loads(run.stdout) | {"lines": n, "file_bytes": path.stat().st_size,
                                                   "process_seconds": time.perf_counter() - t0}
                rows.append(report)
                subprocess.run([sys.executable, "-c", "import redis, sys; redis.Redis.from_url(sys.argv[1])"
                                ".flushall()", server.url], check=True)
    finally:
        server.stop()
    print("| lines | file | submit | lines/s | producer peak RSS (at start) | Python heap peak | refused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lines']:,} | {r['file_bytes'] / 2**20:.1f} MiB | {r['seconds']:.1f} s | "
              f"{r['lines'] / r['seconds']:,.0f} | {r['rss_peak_kib'] / 1024:.0f} MiB "
              f"({r['rss_before_kib'] / 1024:.0f}) | {r['heap_peak'] / 2**20:.1f} MiB | "
              f"{r['counts']['rejected']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
