"""Archive-warm vs cold: time to first token and total time of a second request on an image another worker saw.

    python scripts/bench_kv_archive.py [--models tiny,rand30m] [--sizes 448,1024] [--json bench-results/kv_archive.json]

Per model and image size: worker A (an engine with a KV store on a moto S3 server) answers question 1 on image X
and archives X's encoder output (and, once evicted, prefix blocks); then, timed:
- cold: a fresh engine with the archive off answers question 2 on X (encodes X, prefills everything);
- warm: a fresh engine with a fresh store (empty host tier: as on another worker) on the same archive answers
  question 2 on X, fetching X's encoder output and its prefix chain (the KV blocks up to the image's end) from S3.
Medians of --repeats runs each; every answer must equal the cold one. The 30 M model is the random Qwen2-VL of
bench_engine.py.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
import torch
from bench_engine import BUNDLED, build_random_30m
from PIL import Image

from vlmq.embedded import start_moto
from vlmq.storage import S3Storage
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.kvstore import KVStore, KVStoreConfig, weights_identity

MAX_NEW = 16


def image(side: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8), "RGB")


def timed(engine: Engine, req: Request) -> dict:
    out = engine.generate([req])[0]
    return {"ttft_s": out.first_token_time - out.arrival_time, "total_s": out.finish_time - out.arrival_time,
            "token_ids": out.token_ids}


ARCHIVE_KEY = secrets.token_bytes(32)  # this run's workers' VLMQ_KV_ARCHIVE_KEY


def image_tokens(engine: Engine, img: Image.Image) -> int:
    return engine.preprocessor("probe", Request(img, "?")).seq.images[0].num_tokens


def engine_with(model_dir: Path, storage, prefix: str | None) -> Engine:
    store = None
    if prefix is not None:
        store = KVStore(weights_identity(model_dir), KVStoreConfig(archive_key=ARCHIVE_KEY),
                        S3Storage(storage[0], prefix, storage[1]))
    return Engine.from_model_dir(model_dir, num_blocks=512, max_num_batched_tokens=4096,
                                 long_prefill_chunk_size=4096, kv_store=store)


def bench(model_dir: Path, side: int, storage, repeats: int) -> dict:
    img = image(side)
    prefix = f"bench-{model_dir.name}-{side}-{time.time_ns()}"
    a = engine_with(model_dir, storage, prefix)
    a.generate([Request(img, "What is in the picture?", MAX_NEW, ignore_eos=True)])
    a.tiers.store.flush()
    q2 = Request(img, "Describe the colours.", MAX_NEW, ignore_eos=True)
    cold = [timed(engine_with(model_dir, storage, None), q2) for _ in range(repeats)]
    warm = []
    for _ in range(repeats):
        e = engine_with(model_dir, storage, prefix)
        warm.append({**timed(e, q2), "restored_images": e.tiers.counts["restored_images"],
                     "restored_blocks": e.tiers.counts["restored_blocks"],
                     "archive_hits": e.tiers.store.stats()["archive_hits"]})
        e.tiers.store.close()
    assert all(r["token_ids"] == cold[0]["token_ids"] for r in cold + warm), "an answer differs from the cold one"
    row = {"image": f"{side}x{side}", "image_tokens": a.stats.num_encoded_images and image_tokens(a, img)}
    for name in ("ttft_s", "total_s"):  # medians over the repeats
        row[f"cold_{name}"] = round(statistics.median(r[name] for r in cold), 4)
        row[f"warm_{name}"] = round(statistics.median(r[name] for r in warm), 4)
    row["ttft_ratio"] = round(row["warm_ttft_s"] / row["cold_ttft_s"], 3)
    row["total_ratio"] = round(row["warm_total_s"] / row["cold_total_s"], 3)
    row.update({k: warm[-1][k] for k in ("archive_hits", "restored_images", "restored_blocks")})
    row["same_answer"] = True
    a.tiers.store.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="rand30m,tiny")
    ap.add_argument("--sizes", default="448,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="bench-results/kv_archive.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    for var, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, value)  # the local moto server accepts any credentials
    server = start_moto()
    try:
        boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="bench")
        results = {"device": "cpu", "storage": "moto S3 server on localhost", "max_new_tokens": MAX_NEW, "rows": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models.split(","):
                model_dir = BUNDLED if name == "tiny" else build_random_30m(Path(tmp) / name)
                for side in map(int, args.sizes.split(",")):
                    row = bench(model_dir, side, ("bench", server.url), args.repeats)
                    results["rows"][f"{name}-{side}"] = row
                    print(name, json.dumps(row), flush=True)
        Path(args.json).parent.mkdir(exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
