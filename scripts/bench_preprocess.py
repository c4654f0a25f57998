"""Benchmark: our Qwen2-VL image preprocessing vs transformers' image processor, same images, same process.

What is measured: decoded RGB PIL images in, (pixel_values, image_grid_thw) out. Decoding is NOT in the
headline (both sides get the same decoded image); a separate line adds a JPEG decode to both sides. Our two
paths are timed: "ours" is the default one (the C resampler, fused with lookup and patchify, when it is built)
and "ours_pil" the fallback (PIL's resize, then numpy). All run on one core (torch intra-op threads = 1 unless
--torch-threads says otherwise), one right after the other for every image and round, rotating which goes
first; each figure is the median over --rounds, of wall time and of process CPU time (on a machine shared with
other jobs the CPU-time ratio is the steadier one). Before timing, the script checks that every path gives the
same pixel_values bit for bit.

Prints per-image and whole-set times and ratios, the time per stage of each path, the ceiling that PIL's
resize puts on the fallback's ratio, and (with --threads) batch throughput with a thread pool; writes JSON to
--out.

    python scripts/bench_preprocess.py [--rounds 15] [--threads 2] [--out bench-results/preprocess.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.cost import smart_resize
from vlmq.workers.engine import resample
from vlmq.workers.engine.preprocess import NATIVE, ImagePreprocessor

# a fixed set of common photo/screenshot sizes, (width, height)
IMAGE_SIZES = [(256, 256), (448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720), (1344, 1008), (1920, 1080)]
REF_STAGES = ("process_image", "resize", "rescale", "normalize", "patchify")  # methods of the transformers class
PATHS = ("transformers", "ours", "ours_pil")
_ref_spent: dict[str, float] = defaultdict(float)  # CPU ms per stage method, filled by TimedReference


def make_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / (w - 1), yy * 255 / (h - 1), (xx + yy) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


class TimedReference(Qwen2VLImageProcessorPil):
    """transformers' processor, unchanged, with a clock read around each stage method (for the breakdown only)."""


def _timed(name: str) -> Callable:
    def method(self, *args, **kwargs):
        start = time.process_time()
        try:
            return getattr(Qwen2VLImageProcessorPil, name)(self, *args, **kwargs)
        finally:
            _ref_spent[name] += (time.process_time() - start) * 1e3

    return method


for _name in REF_STAGES:
    setattr(TimedReference, _name, _timed(_name))


def clock(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def cpu_ms(fn: Callable[[], object]) -> float:
    return clock(fn)[1]


def median_ms(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms) over rounds."""
    walls, cpus = zip(*(clock(fn) for _ in range(rounds)), strict=True)
    return statistics.median(walls), statistics.median(cpus)


def per_image(paths: dict[str, Callable], images: list[Image.Image], rounds: int) -> list[dict]:
    """Median wall and CPU ms of each path on each image; they run back to back, rotating which goes first."""
    times: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    names = list(paths)
    for r in range(rounds):
        for i, img in enumerate(images):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                times[i, name].append(clock(lambda img=img, name=name: paths[name]([img])))
    rows = []
    for i, img in enumerate(images):
        h, w = smart_resize(img.height, img.width)
        row = {"width": img.width, "height": img.height, "resized": [w, h], "tokens": h * w // 28**2}
        for name in names:
            row[f"{name}_ms"] = statistics.median(wall for wall, _ in times[i, name])
            row[f"{name}_cpu_ms"] = statistics.median(cpu for _, cpu in times[i, name])
        rows.append(row)
    return rows


def whole_set(rows: list[dict], ours: str, kind: str) -> dict[str, float]:
    ref, mine = sum(r[f"transformers{kind}_ms"] for r in rows), sum(r[f"{ours}{kind}_ms"] for r in rows)
    return {"transformers_ms": ref, "ours_ms": mine, "ratio": ref / mine}


def ref_stages(images: list[Image.Image], rounds: int) -> dict[str, float]:
    """Median CPU ms per stage of the transformers path over the set; 'pil_resize' is PIL's resize call alone."""
    ref, spent = TimedReference(), defaultdict(list)
    for _ in range(rounds):
        _ref_spent.clear()
        total = sum(cpu_ms(lambda img=img: ref([img], return_tensors="pt")) for img in images)
        for name in REF_STAGES:
            spent[name].append(_ref_spent[name])
        spent["rest (kwargs, checks, concat, to torch)"].append(total - sum(_ref_spent.values()))
        spent["total"].append(total)
        spent["pil_resize (inside resize)"].append(sum(cpu_ms(lambda img=img: _pil_resize(img)) for img in images))
    return {name: statistics.median(v) for name, v in spent.items()}


def _pil_resize(img: Image.Image) -> Image.Image:
    h, w = smart_resize(img.height, img.width)
    return img.resize((w, h), Image.Resampling.BICUBIC) if (h, w) != (img.height, img.width) else img


def our_stages(ours: ImagePreprocessor, images: list[Image.Image], rounds: int) -> dict[str, float]:
    """Median CPU ms per stage of the PIL fallback over the set (normalize and patchify run band by band, as in
    `to_patches`, with a clock around each call)."""
    spent = defaultdict(list)
    for _ in range(rounds):
        got: dict[str, float] = defaultdict(float)
        for img in images:
            got["total"] += cpu_ms(lambda img=img: ours([img]))
            got["resize (PIL + asarray)"] += cpu_ms(lambda img=img: ours.resize(img))
            for name, ms in banded_stages(ours, ours.resize(img)).items():
                got[name] += ms
        got["rest (total minus the above, ± noise)"] = got["total"] - sum(ms for k, ms in got.items() if k != "total")
        for name, ms in got.items():
            spent[name].append(ms)
    return {name: statistics.median(v) for name, v in spent.items()}


def native_stages(ours: ImagePreprocessor, images: list[Image.Image], rounds: int) -> dict[str, float]:
    """Median CPU ms per stage of the native path over the set: the PIL -> numpy copy, the C resize alone (to
    uint8), and the one C pass that resizes, looks up and writes patch rows into a fresh output."""
    p, spent = ours.policy, defaultdict(list)
    for _ in range(rounds):
        got: dict[str, float] = defaultdict(float)
        for img in images:
            rgb, size = np.asarray(img), smart_resize(img.height, img.width, p)
            got["total"] += cpu_ms(lambda img=img: ours([img]))
            got["asarray (PIL -> numpy copy)"] += cpu_ms(lambda img=img: np.asarray(img))
            got["output allocation (np.empty, first touch)"] += cpu_ms(lambda s=size: _fresh_output(ours, s))
            got["C resize alone (to uint8, for reference)"] += cpu_ms(lambda r=rgb, s=size: resample.resize(r, s))
            got["C resize + lookup + patchify (one pass)"] += cpu_ms(lambda r=rgb, s=size: _native_pass(ours, r, s))
        got["rest (total - asarray - one pass, ± noise)"] = (
            got["total"] - got["asarray (PIL -> numpy copy)"] - got["C resize + lookup + patchify (one pass)"]
        )
        for name, ms in got.items():
            spent[name].append(ms)
    return {name: statistics.median(v) for name, v in spent.items()}


def _fresh_output(ours: ImagePreprocessor, size: tuple[int, int]) -> None:
    np.empty((size[0] * size[1] // ours.policy.patch_size**2, ours.patch_dim), dtype=np.float32).fill(0)


def _native_pass(ours: ImagePreprocessor, rgb: np.ndarray, size: tuple[int, int]) -> None:
    p = ours.policy
    out = np.empty((size[0] * size[1] // p.patch_size**2, ours.patch_dim), dtype=np.float32)
    resample.resize_patches(rgb, size, ours._table, out, p.patch_size, p.merge_size, p.temporal_patch_size)


def banded_stages(ours: ImagePreprocessor, rgb: np.ndarray) -> dict[str, float]:
    p, band = ours.policy.patch_size, ours.policy.patch_size * ours.policy.merge_size
    h, w, _ = rgb.shape
    planes = np.empty((3, band, w), dtype=np.float32)
    out, per_band = np.empty((h * w // p**2, ours.patch_dim), dtype=np.float32), band * w // p**2
    got = {"normalize (table lookup, by bands)": 0.0, "patchify (strided copy, by bands)": 0.0}
    for i in range(h // band):
        rgb_band, rows = rgb[i * band : (i + 1) * band], out[i * per_band : (i + 1) * per_band]
        got["normalize (table lookup, by bands)"] += cpu_ms(lambda b=rgb_band: ours.normalize(b, planes))
        got["patchify (strided copy, by bands)"] += cpu_ms(lambda r=rows: ours.patchify(planes, r))
    return got


def decode_ms(images: list[Image.Image], rounds: int) -> tuple[float, float]:
    """Median (wall, CPU) ms to decode the whole set from JPEG (quality 95) to RGB: what both paths would add."""
    blobs = []
    for img in images:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        blobs.append(buf.getvalue())
    return median_ms(lambda: [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs], rounds)


def batch_threads(ref, ours: ImagePreprocessor, images: list[Image.Image], threads: int, rounds: int) -> dict:
    """The whole set as one batch, wall ms: ours on a thread pool vs ours on one thread, vs transformers as it
    runs (one call, sequential) and on the same pool (one call per image). More cores than the one-core
    comparison: read these as throughput, not as a like-for-like ratio."""
    with ThreadPoolExecutor(threads) as pool:
        ref_seq = median_ms(lambda: ref(images, return_tensors="pt"), rounds)[0]
        ref_pool = median_ms(lambda: list(pool.map(lambda im: ref([im], return_tensors="pt"), images)), rounds)[0]
        ours_seq = median_ms(lambda: ours(images), rounds)[0]
        ours_pool = median_ms(lambda: ours(images, executor=pool), rounds)[0]
    return {"threads": threads, "transformers_sequential_ms": ref_seq, "transformers_pool_ms": ref_pool,
            "ours_sequential_ms": ours_seq, "ours_pool_ms": ours_pool, "ratio_vs_sequential": ref_seq / ours_pool,
            "ratio_vs_pool": ref_pool / ours_pool, "ours_speedup_from_threads": ours_seq / ours_pool}


def check_parity(ref, paths: list[ImagePreprocessor], images: list[Image.Image]) -> None:
    expected = ref(images, return_tensors="pt")
    with ThreadPoolExecutor(2) as pool:
        for ours in paths:
            for pixels, grid in (ours(images), ours(images, executor=pool)):
                assert torch.equal(pixels, expected["pixel_values"]), f"pixel_values differ ({ours.native=})"
                assert torch.equal(grid, expected["image_grid_thw"]), f"image_grid_thw differs ({ours.native=})"


def print_report(result: dict) -> None:
    names = [n for n in PATHS if f"{n}_ms" in result["images"][0]]
    print(f"path of ImagePreprocessor(): {result['setup']['default_path']}\n")
    print(f"{'image':>11} {'tokens':>6}" + "".join(f" {n + ' ms':>17}" for n in names) + "   ratio to transformers")
    for r in result["images"]:
        cells = "".join(f" {r[f'{n}_ms']:>8.2f} ({r[f'{n}_cpu_ms']:>6.2f})" for n in names)
        ratios = "  ".join(f"{n} {r['transformers_ms'] / r[f'{n}_ms']:.2f}x" for n in names[1:])
        print(f"{r['width']:>5}x{r['height']:<5} {r['tokens']:>6}{cells}   {ratios}")
    for n in names[1:]:
        w, c = result["wall"][n], result["cpu"][n]
        print(f"whole set, {n}: transformers {w['transformers_ms']:.2f} ms, {n} {w['ours_ms']:.2f} ms:"
              f" {w['ratio']:.2f}x wall, {c['ratio']:.2f}x CPU")
    print(f"(wall ms, CPU ms in brackets; one core each, decode excluded, medians of {result['setup']['rounds']}"
          " rounds)")
    for side, stages in result["stages"].items():
        print(f"\nstages, {side} (CPU ms over the set):")
        for name, ms in stages.items():
            print(f"  {name:<44} {ms:8.2f}")
    ceiling = result["ceiling_pil_resize"]
    print(f"\nceiling of the PIL path (transformers total / PIL resize alone, CPU): {ceiling:.2f}x")
    d = result["decode"]
    print(f"JPEG decode of the set: {d['ms']:.2f} ms wall, {d['cpu_ms']:.2f} ms CPU; ratio with decode on both"
          f" sides: {d['ratio_with_decode']:.2f}x wall, {d['cpu_ratio_with_decode']:.2f}x CPU")
    if "threads" in result:
        t = result["threads"]
        print(f"batch of {len(result['images'])} images, {t['threads']} threads: ours {t['ours_pool_ms']:.2f} ms"
              f" ({t['ours_speedup_from_threads']:.2f}x its one-thread {t['ours_sequential_ms']:.2f} ms);"
              f" transformers sequential {t['transformers_sequential_ms']:.2f} ms ({t['ratio_vs_sequential']:.2f}x),"
              f" transformers on the same pool {t['transformers_pool_ms']:.2f} ms ({t['ratio_vs_pool']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="timed repetitions of everything (medians are kept)")
    ap.add_argument("--threads", type=int, default=0, help="also time a whole-set batch on a pool of this size")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (1: a one-core comparison)")
    ap.add_argument("--out", default="bench-results/preprocess.json", help="where to write the JSON results")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)

    ref, ours, ours_pil = Qwen2VLImageProcessorPil(), ImagePreprocessor(), ImagePreprocessor(native=False)
    images = [make_image(w, h, i) for i, (w, h) in enumerate(IMAGE_SIZES)]
    check_parity(ref, [ours, ours_pil], images)

    paths = {"transformers": lambda ims: ref(ims, return_tensors="pt"), "ours": ours, "ours_pil": ours_pil}
    if not NATIVE:  # "ours" is the PIL path already
        del paths["ours_pil"]
    rows = per_image(paths, images, args.rounds)
    named = [n for n in paths if n != "transformers"]
    wall, cpu = {n: whole_set(rows, n, "") for n in named}, {n: whole_set(rows, n, "_cpu") for n in named}
    stages = {"transformers": ref_stages(images, args.rounds), "ours_pil": our_stages(ours_pil, images, args.rounds)}
    if NATIVE:
        stages["ours (native)"] = native_stages(ours, images, args.rounds)
    dec_wall, dec_cpu = decode_ms(images, args.rounds)
    w, c = wall["ours"], cpu["ours"]
    result = {
        "setup": {"rounds": args.rounds, "torch_threads": args.torch_threads, "cpus": os.cpu_count(),
                  "decode_included": False, "statistic": "median per image, summed over the set",
                  "images": "synthetic noisy gradients, decoded RGB PIL images",
                  "default_path": f"native (C resampler, {resample.kernels()} kernels)" if NATIVE
                  else f"PIL ({resample.REASON})"},
        "images": rows, "wall": wall, "cpu": cpu, "ratio": wall["ours"]["ratio"], "stages": stages,
        "ceiling_pil_resize": stages["transformers"]["total"] / stages["transformers"]["pil_resize (inside resize)"],
        "decode": {"ms": dec_wall, "cpu_ms": dec_cpu,
                   "ratio_with_decode": (w["transformers_ms"] + dec_wall) / (w["ours_ms"] + dec_wall),
                   "cpu_ratio_with_decode": (c["transformers_ms"] + dec_cpu) / (c["ours_ms"] + dec_cpu)},
    }
    if args.threads > 0:
        result["threads"] = batch_threads(ref, ours, images, args.threads, args.rounds)
    print_report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
