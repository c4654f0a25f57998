"""HTTP door benchmark: what ``vlmq serve`` adds over the Python SDK, in the same run against the same pool.

Starts an embedded Valkey, moto's S3 server, one worker of the bundled model and ``vlmq serve`` (child processes on
loopback), then runs the same chat requests (a data: image, ``max_tokens`` 1) from ``--clients`` concurrent
threads two ways, in alternating rounds: the official ``openai`` package against ``vlmq serve``, and the SDK
(``Client.submit`` + ``Job.result``). Reports per-request latency p50/p99 of each, the added latency of the HTTP
door (the difference), requests/s at the producer side, one round trip through the door alone (``GET /v1/models``
with its key check, no job), and the upload throughput of a ``--upload-mb`` batch
file through ``files.create``. Prints a table and writes JSON (default bench-results/serve.json).

At one client the figures are latency (the worker's own pick-up time dominates both paths alike); at several they
are throughput on a machine whose cores the worker, the server and the clients share.

Usage: python scripts/bench_serve.py [--clients 1,8] [--requests 100] [--rounds 2] [--upload-mb 100]
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import openai
import redis
from PIL import Image

from vlmq import apikeys
from vlmq.client import Client
from vlmq.embedded import start_moto, start_valkey
from vlmq.settings import Settings

TINY_CLASSES = "xs=64,s=256,m=1024,l=4096,xl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(args: list[str], settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}, **settings.to_env()}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for(check, what: str, timeout: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout} s")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (168, 168), (200, 60, 40)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_run(call, n: int, clients: int) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
    def one(_: int) -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        latencies = list(pool.map(one, range(n)))
        return latencies, time.perf_counter() - t0


def measure(http_call, sdk_call, clients: int, requests: int, rounds: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Both paths at one concurrency, in alternating rounds after a warm-up."""
    timed_run(http_call, 4 * clients, clients)  # warm-up: connections, caches
    timed_run(sdk_call, 4 * clients, clients)
    runs: dict[str, dict[str, list[float]]] = {"http": {"lat": [], "rps": []}, "sdk": {"lat": [], "rps": []}}
    for _ in range(rounds):
        for name, call in (("http", http_call), ("sdk", sdk_call)):
            latencies, wall = timed_run(call, requests, clients)
            runs[name]["lat"] += latencies
            runs[name]["rps"].append(requests / wall)
    result: dict[str, object] = {name: {"p50_ms": 1000 * pct(r["lat"], 0.5), "p99_ms": 1000 * pct(r["lat"], 0.99),
                                        "req_per_s": statistics.median(r["rps"]), "requests": len(r["lat"])}
                                 for name, r in runs.items()}
    http, sdk = result["http"], result["sdk"]
    result["added_ms"] = {q: http[f"{q}_ms"] - sdk[f"{q}_ms"] for q in ("p50", "p99")}  # type: ignore[index]
    result["clients"] = clients
    return result


def upload(api: openai.OpenAI, megabytes: int, folder: Path) -> dict[str, float]:
    path = folder / "upload.jsonl"
    line = (json.dumps({"custom_id": "x" * 4000}) + "\n").encode()
    with open(path, "wb") as f:
        for _ in range(megabytes * (1 << 20) // len(line)):
            f.write(line)
    size = path.stat().st_size
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        obj = api.files.create(file=f, purpose="batch")
    seconds = time.perf_counter() - t0
    assert obj.bytes == size
    api.files.delete(obj.id)
    return {"bytes": size, "seconds": seconds, "mb_per_s": size / (1 << 20) / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,8", help="concurrent client threads, one run per value")
    p.add_argument("--requests", type=int, default=100, help="per path per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--upload-mb", type=int, default=100)
    p.add_argument("--out", default="bench-results/serve.json")
    args = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    valkey, moto = start_valkey(), start_moto()
    procs: list[subprocess.Popen[bytes]] = []
    folder = Path(tempfile.mkdtemp(prefix="vlmq-bench-serve-"))
    try:
        boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket="bench")
        settings = Settings(broker_url=valkey.url, storage_url="s3://bench/serve", s3_endpoint_url=moto.url,
                            cost_classes=TINY_CLASSES, worker_batch=16)
        procs.append(child(["-m", "vlmq.workers.main"], settings, folder / "worker.log"))
        port = free_port()
        procs.append(child(["-m", "vlmq.cli", "serve", "--port", str(port), "--log-level", "warning"], settings,
                           folder / "serve.log"))
        wait_for(lambda: " ready." in (folder / "worker.log").read_text(errors="replace"), "worker")
        wait_for(lambda: answers(f"http://127.0.0.1:{port}/readyz"), "vlmq serve", 60)
        key = apikeys.create(redis.Redis.from_url(valkey.url), "bench", "bench_serve")
        url = image_url()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "How many shapes?"}]}]
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        sdk = Client(settings=settings, tenant="bench")

        def http_call() -> None:
            api.chat.completions.create(model="tiny-shapes", messages=msgs, max_tokens=1)

        def sdk_call() -> None:
            sdk.submit(messages=msgs, max_new_tokens=1).result(timeout=120)

        result: dict[str, object] = {"runs": [measure(http_call, sdk_call, int(c), args.requests, args.rounds)
                                              for c in args.clients.split(",")]}
        trips, _ = timed_run(lambda: api.models.list(), 300, 1)  # the door alone: HTTP, auth, JSON, no job
        result["door_round_trip_ms"] = {"p50": 1000 * pct(trips, 0.5), "p99": 1000 * pct(trips, 0.99)}
        result["upload"] = upload(api, args.upload_mb, folder)
        result["config"] = {"requests_per_round": args.requests, "rounds": args.rounds, "cpus": os.cpu_count(),
                            "max_tokens": 1}
        sdk.close()
        api.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        moto.stop()
        valkey.stop()
    print(f"{'clients':>7} {'path':<6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for run in result["runs"]:  # type: ignore[attr-defined]
        for name in ("http", "sdk"):
            r = run[name]
            print(f"{run['clients']:>7} {name:<6} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['req_per_s']:>8.1f}")
        print(f"{run['clients']:>7} added by the HTTP door: p50 {run['added_ms']['p50']:+.1f} ms, "
              f"p99 {run['added_ms']['p99']:+.1f} ms")
    trip: dict[str, float] = result["door_round_trip_ms"]  # type: ignore[assignment]
    print(f"a round trip through the door alone (GET /v1/models, auth included): p50 {trip['p50']:.1f} ms, "
          f"p99 {trip['p99']:.1f} ms")
    u: dict[str, float] = result["upload"]  # type: ignore[assignment]
    print(f"upload of {u['bytes'] / (1 << 20):.0f} MiB: {u['seconds']:.1f} s, {u['mb_per_s']:.1f} MiB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
