"""Benchmark: our Qwen2-VL image preprocessing vs transformers' image processor, same images, same process.

Prints a table (best-of-N milliseconds per image for each, and the ratio) and writes JSON. Both produce the
same pixel_values bit for bit; the script checks that first.

    python scripts/bench_preprocess.py [--rounds 5] [--threads 0] [--json bench_preprocess.json]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vlmq.workers.engine.preprocess import ImagePreprocessor

# a fixed set of common photo/screenshot sizes, (width, height)
IMAGE_SIZES = [(256, 256), (448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720), (1344, 1008), (1920, 1080)]


def make_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / (w - 1), yy * 255 / (h - 1), (xx + yy) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed repetitions per image (best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="also time ours on the whole set with a thread pool")
    ap.add_argument("--json", default="bench_preprocess.json", help="where to write the results")
    args = ap.parse_args()

    ref, ours = Qwen2VLImageProcessorPil(), ImagePreprocessor()
    images = [make_image(w, h, i) for i, (w, h) in enumerate(IMAGE_SIZES)]
    expected = ref(images, return_tensors="pt")
    pixels, grid = ours(images)
    assert torch.equal(pixels, expected["pixel_values"]) and torch.equal(grid, expected["image_grid_thw"])

    rows = []
    print(f"{'image':>11} {'tokens':>6} {'transformers ms':>16} {'ours ms':>8} {'ratio':>6}")
    for (w, h), img, g in zip(IMAGE_SIZES, images, grid.tolist(), strict=True):
        # per image, one right after the other, so drifts in machine load hit both
        t_ref = best_ms(partial(ref, [img]), args.rounds)
        t_ours = best_ms(partial(ours, [img]), args.rounds)
        rows.append({"width": w, "height": h, "tokens": g[1] * g[2] // 4, "transformers_ms": t_ref, "ours_ms": t_ours})
        print(f"{f'{w}x{h}':>11} {rows[-1]['tokens']:>6} {t_ref:>16.2f} {t_ours:>8.2f} {t_ref / t_ours:>5.1f}x")
    total_ref, total_ours = sum(r["transformers_ms"] for r in rows), sum(r["ours_ms"] for r in rows)
    result = {"images": rows, "transformers_ms": total_ref, "ours_ms": total_ours, "ratio": total_ref / total_ours}
    print(f"{'whole set':>11} {'':>6} {total_ref:>16.2f} {total_ours:>8.2f} {total_ref / total_ours:>5.1f}x")
    if args.threads > 0:
        with ThreadPoolExecutor(args.threads) as pool:
            t_pool = best_ms(partial(ours, images, executor=pool), args.rounds)
        result["ours_threads"] = {"threads": args.threads, "ms": t_pool, "ratio": total_ref / t_pool}
        print(f"ours with {args.threads} threads on the whole set: {t_pool:.2f} ms, {total_ref / t_pool:.1f}x")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
