"""Encoder throughput with tiles batched across requests vs one request at a time (InternVL-shaped model).

    python scripts/bench_tiles.py                       # CPU, one thread, 8 mixed-size images
    python scripts/bench_tiles.py --device cuda --requests 64 --threads 16

Builds a random-weight InternVL checkpoint of about 30 M parameters (448-px tiles, 14-px patches, pixel shuffle
0.5, up to 12 tiles + thumbnail; InternViT and Qwen2 LM of width 384) with transformers, tiles a workload of
mixed-size images with the engine's TilingPreprocessor, then times the model's encoder two ways on the same tiles:

- batched: what the engine does when the requests are admitted in one step: ONE `encode_images` call over the
  tiles of every request (`--per-step` caps how many requests share a step);
- alone: one call per request (its tiles only), as a server that encodes each request on its own would.

It checks that both give the same embeddings, prints a table and writes JSON (`--out`). Ratios, not absolute
times, are the result: CPU times vary from run to run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny.internvl import build_internvl  # noqa: E402

from vlmq.workers.engine.tiling import TilingPreprocessor  # noqa: E402
from vlmq.workers.models.loader import load_model  # noqa: E402

TEXT = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=7, num_attention_heads=6, num_key_value_heads=2)
VISION = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, intermediate_size=1536, image_size=448)
SIZES = [(448, 448), (640, 480), (1280, 720), (300, 900), (500, 500), (1024, 768), (200, 200), (900, 300)]


def workload(n: int, pre: TilingPreprocessor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in
              (SIZES[i % len(SIZES)] for i in range(n))]
    return [pre([image]) for image in images]  # per request: tiles [T, 3, S, S], grid [1, 3]


def timed(fn, device: torch.device) -> tuple[float, list[torch.Tensor]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def run(model, reqs, per_step: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[float, int, list]]:
    moved = [(pixels.to(device, dtype), grid.to(device)) for pixels, grid in reqs]

    def alone() -> list[torch.Tensor]:
        return [model.encode_images(pixels, grid)[0] for pixels, grid in moved]

    def batched() -> list[torch.Tensor]:
        out = []
        for i in range(0, len(moved), per_step):
            step = moved[i:i + per_step]
            out += model.encode_images(torch.cat([p for p, _ in step]), torch.cat([g for _, g in step]))
        return out

    with torch.inference_mode():
        batched()  # warm-up (allocator, kernels)
        results = {}
        for name, fn, calls in (("alone", alone, len(moved)), ("batched", batched, -(-len(moved) // per_step))):
            seconds, out = timed(fn, device)
            results[name] = (seconds, calls, out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--per-step", type=int, default=0, help="requests per encoder call (0: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench-results/encoder_tiles.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        path = build_internvl(Path(tmp) / "internvl-30m", text=TEXT, vision=VISION, max_patches=12)
        model = load_model(path, device, dtype)
        pre = TilingPreprocessor.from_preprocessor_config(json.loads((path / "preprocessor_config.json").read_text()))
    reqs = workload(args.requests, pre)
    tiles = sum(int(grid[0, 0]) for _, grid in reqs)
    per_step = args.per_step or len(reqs)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        results = run(model, reqs, per_step, device, dtype)
        for name, (seconds, _, _) in results.items():
            best[name] = min(best.get(name, float("inf")), seconds)
    diff = max((a - b).abs().max().item() for a, b in zip(results["alone"][2], results["batched"][2], strict=True))
    params = sum(p.numel() for p in model.parameters())
    rows = [{"mode": name, "encoder_calls": results[name][1], "tiles": tiles, "seconds": best[name],
             "tiles_per_s": tiles / best[name], "speedup_vs_alone": best["alone"] / best[name]}
            for name in ("alone", "batched")]
    print(f"InternVL-shaped model, {params / 1e6:.1f} M parameters, {args.device} ({dtype}), {args.threads} threads; "
          f"{len(reqs)} requests, {tiles} tiles of 448 px, {per_step} requests per batched call; "
          f"best of {args.repeats}; max |batched - alone| = {diff:.1e}")
    print(f"{'mode':<8} {'calls':>5} {'tiles':>5} {'seconds':>8} {'tiles/s':>8} {'vs alone':>8}")
    for r in rows:
        print(f"{r['mode']:<8} {r['encoder_calls']:>5} {r['tiles']:>5} {r['seconds']:>8.3f} {r['tiles_per_s']:>8.2f} "
              f"{r['speedup_vs_alone']:>7.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"device": args.device, "dtype": str(dtype), "threads": args.threads, "params": params,
             "requests": len(reqs), "per_step": per_step, "repeats": args.repeats, "max_abs_diff": diff}
    out.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
