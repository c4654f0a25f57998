"""Quantised KV archive on the bundled model: greedy answers unchanged, and bytes saved.

    python scripts/bench_kv_archive_quant.py [--n 200] [--json bench-results/kv_archive_quant.json]

For each archive encoding (lossless, int8, fp8): worker A answers one question on each of n held-out images
(seed 9) and archives the images' encoder outputs and prefix chains in that encoding; worker B (a fresh engine
and store, as on another machine) answers another question on each image, restoring from the archive. B's
answers are compared with a cold engine's (no store) and the archive's bytes are summed.
"""
from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path

import torch
from tiny.shapes import make_split, questions

from vlmq import keys
from vlmq.storage import FileStorage
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.kvstore import KVStore, KVStoreConfig, weights_identity
from vlmq.workers.main import ASSETS

MODEL = Path(ASSETS) / "tiny-shapes"
MAX_NEW = 32
ARCHIVE_KEY = secrets.token_bytes(32)  # this run's workers' VLMQ_KV_ARCHIVE_KEY


def engine(storage: FileStorage | None, quant: str) -> Engine:
    store = None
    if storage is not None:
        # every restore from the archive; this run's key signs it
        config = KVStoreConfig(host_bytes=0, quant=quant, always_fetch=True, archive_key=ARCHIVE_KEY)
        store = KVStore(weights_identity(MODEL), config, storage)
    return Engine.from_model_dir(MODEL, num_blocks=4096, kv_store=store)


def run(quant: str, first: list[Request], second: list[Request], cold: list[list[int]], root: Path) -> dict:
    storage = FileStorage(root / (quant or "lossless"))
    a = engine(storage, quant)
    a.generate(first)
    a.tiers.store.flush()
    b = engine(storage, quant)
    t0 = time.perf_counter()
    answers = [o.token_ids for o in b.generate(second)]
    sizes = {"enc": 0, "prefix": 0}
    for obj in storage.list_objects(keys.KV_ROOT):
        sizes[obj.key.split("/")[2]] += obj.size
    same = sum(x == y for x, y in zip(answers, cold, strict=True))
    row = {"encoding": quant or "lossless", "examples": len(second), "answers_unchanged": same,
           "fraction_unchanged": round(same / len(second), 4), "archive_bytes": sum(sizes.values()),
           "encoder_output_bytes": sizes["enc"], "prefix_kv_bytes": sizes["prefix"],
           "restored_images": b.tiers.counts["restored_images"], "restored_blocks": b.tiers.counts["restored_blocks"],
           "encoded_images_on_b": b.stats.num_encoded_images, "seconds_b": round(time.perf_counter() - t0, 2)}
    for e in (a, b):
        e.tiers.store.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", default="bench-results/kv_archive_quant.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    examples = make_split(9, args.n)  # seed 9: held out from training
    first = [Request(e.image, e.question, MAX_NEW) for e in examples]
    second = []
    for i, e in enumerate(examples):
        other = [q for q, _ in questions(e.scene) if q != e.question] or [e.question]
        second.append(Request(e.image, other[i % len(other)], MAX_NEW))
    cold = [o.token_ids for o in engine(None, "").generate(second)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for quant in ("", "int8", "fp8"):
            rows.append(run(quant, first, second, cold, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    lossless = rows[0]["archive_bytes"]
    for row in rows:
        row["bytes_saved_vs_lossless"] = round(1 - row["archive_bytes"] / lossless, 4)
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": "tiny-shapes (bundled, float32 on CPU)", "rows": rows},
                                          indent=2) + "\n")


if __name__ == "__main__":
    main()
