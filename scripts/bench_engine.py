"""Engine vs transformers generate, in one process run: throughput, latency and cache hit rates.

    python scripts/bench_engine.py [--quick] [--models tiny,rand30m] [--json bench_engine.json]

Paths: (a) transformers `generate`, one request at a time; (b) transformers `generate` in static batches of
8 sorted by image size (left padding; a row stops at its own length but the batch runs to its longest);
(c) the vlmq engine (continuous batching, paged KV, encoder + prefix caches). All requests arrive at t=0,
so latency = finish time since the start of the path. Every path generates exactly each request's drawn
answer length (eos ignored), and with eos ignored the greedy tokens of (a) and (c) should agree: the
share of requests whose tokens match is reported as a sanity check.

Workloads: mixed captions (sizes from thumbnails to 1344x1008, capped by the processor's max_pixels;
answer lengths 16-256) and shared images (8 images x 6 questions). Models: the bundled tiny-shapes and a
randomly initialised ~30 M-parameter Qwen2-VL built here (bundled tokenizer and processor files).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tiny import shapes
from transformers import AutoModelForImageTextToText, StoppingCriteria, StoppingCriteriaList

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.models.processor import load_processor, render_prompt

BUNDLED = Path(__file__).resolve().parents[1] / "workers" / "assets" / "tiny-shapes"
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "generation_config.json")


# ------------------------------------------------------------------------------------------------ models
def build_random_30m(out_dir: Path) -> Path:
    """A randomly initialised Qwen2-VL of ~30 M parameters with the bundled tokenizer/processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    bundled = json.loads((BUNDLED / "config.json").read_text())
    ids = {k: bundled[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    text = dict(vocab_size=bundled["text_config"]["vocab_size"], hidden_size=512, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536, bos_token_id=414,
                eos_token_id=416, pad_token_id=414, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for name in PROCESSOR_FILES:
        shutil.copy(BUNDLED / name, out_dir / name)
    # the bundled processor cuts 28-px patches (tiny-shapes); this model keeps Qwen2-VL's 14 px
    processor_cfg = json.loads((out_dir / "preprocessor_config.json").read_text())
    processor_cfg["patch_size"] = vision["patch_size"]
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processor_cfg, indent=2))
    return out_dir


# --------------------------------------------------------------------------------------------- workloads
def mixed_captions(n: int, max_side: int, lengths: tuple[int, int], seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        long = int(np.exp(rng.uniform(np.log(64), np.log(max_side))))  # thumbnails .. max_side, log-uniform
        short = max(56, long * 3 // 4)
        size = (long, short) if rng.random() < 0.5 else (short, long)
        ex = shapes.make_example((seed, i), size=size, caption_prob=1.0)
        out.append(Request(ex.image, shapes.CAPTION_PROMPT, int(rng.integers(*lengths, endpoint=True)), True))
    return out


def shared_images(num_images: int, per_image: int, lengths: tuple[int, int], seed: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_images):
        side = int(rng.integers(448, 1025))
        ex = shapes.make_example((seed, i), size=(side, side * 3 // 4))
        for question, _ in shapes.questions(ex.scene)[:per_image]:
            out.append(Request(ex.image, question, int(rng.integers(*lengths, endpoint=True)), True))
    return out


# ------------------------------------------------------------------------------------------------- paths
class RowLengths(StoppingCriteria):
    """Stops each row of a static batch at its own answer length (the batch still runs to the longest)."""

    def __init__(self, lengths: list[int], prompt_len: int) -> None:
        self.lengths, self.prompt_len = torch.tensor(lengths), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.lengths.to(input_ids.device)  # on the model's device


@torch.inference_mode()
def hf_generate(model, processor, batch: list[Request]) -> list[list[int]]:
    texts = [render_prompt(processor, r.question) for r in batch]
    inputs = processor(text=texts, images=[r.image for r in batch], return_tensors="pt", padding=True)
    lengths = [r.max_new_tokens for r in batch]
    prompt_len = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max(lengths), do_sample=False, eos_token_id=None,
                         stopping_criteria=StoppingCriteriaList([RowLengths(lengths, prompt_len)]))
    return [out[i, prompt_len:prompt_len + n].tolist() for i, n in enumerate(lengths)]


def run_hf(model, processor, requests: list[Request], batch_size: int) -> dict:
    order = list(range(len(requests)))
    if batch_size > 1:  # static batches of similar images
        order.sort(key=lambda i: requests[i].image.width * requests[i].image.height)
    tokens, latency = [None] * len(requests), [0.0] * len(requests)
    t0 = time.perf_counter()
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        for i, ids in zip(idx, hf_generate(model, processor, [requests[i] for i in idx]), strict=True):
            tokens[i], latency[i] = ids, time.perf_counter() - t0
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "latency": latency}


def run_engine(engine: Engine, requests: list[Request]) -> dict:
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    wall = time.perf_counter() - t0
    s = engine.stats
    encoder_lookups = s.encoder_cache_hits + s.encoder_cache_misses
    return {"wall_s": wall, "tokens": [o.token_ids for o in outs], "latency": [o.finish_time - t0 for o in outs],
            "encoder_hit_rate": s.encoder_cache_hits / max(encoder_lookups, 1),
            "prefix_hit_rate": s.prefix_cache_hit_tokens / max(s.prefix_cache_query_tokens, 1),
            "num_steps": s.num_steps, "num_preemptions": s.num_preemptions, "images_encoded": s.num_encoded_images,
            "time_split_s": {**{k: round(v, 2) for k, v in s.timings.items()},
                             **{f"runner_{k}": round(v, 2) for k, v in engine.runner.timings.items()}}}


def reset_counters(engine: Engine) -> None:
    engine.stats.__init__()
    runner, cache, bm = engine.runner, engine.scheduler.encoder_cache, engine.scheduler.block_manager
    runner.timings = dict.fromkeys(runner.timings, 0.0)
    runner.num_encoded_images = runner.num_encoder_calls = 0
    cache.hits = cache.misses = bm.num_prefix_hits = bm.num_prefix_queries = 0


def summarise(res: dict, requests: list[Request]) -> dict:
    lat = np.array(res.pop("latency"))
    n_tokens = sum(len(t) for t in res.pop("tokens"))
    assert n_tokens == sum(r.max_new_tokens for r in requests), "a path generated a different number of tokens"
    return {**res, "images_per_s": len(requests) / res["wall_s"], "tokens_per_s": n_tokens / res["wall_s"],
            "p50_latency_s": float(np.percentile(lat, 50)), "p99_latency_s": float(np.percentile(lat, 99)),
            "generated_tokens": n_tokens, "wall_s": res["wall_s"]}


def bench_model(name: str, model_dir: Path, workloads: dict[str, list[Request]], num_blocks: int,
                results: dict, on_result=lambda: None) -> dict:
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    processor.tokenizer.padding_side = "left"
    warm = Request(shapes.make_example((99, 0), size=(120, 90)).image, "warm-up", 4, True)  # shares nothing
    hf_generate(model, processor, [warm])  # untimed
    for wname, requests in workloads.items():
        a = run_hf(model, processor, requests, 1)
        print(f"[{name}/{wname}] hf_single done in {a['wall_s']:.0f}s", flush=True)
        b = run_hf(model, processor, requests, 8)
        print(f"[{name}/{wname}] hf_static8 done in {b['wall_s']:.0f}s", flush=True)
        engine = Engine.from_model_dir(model_dir, num_blocks=num_blocks)
        engine.generate([warm])  # untimed
        reset_counters(engine)  # count only the workload
        c = run_engine(engine, requests)
        engine.close()
        match = np.mean([x == y for x, y in zip(a["tokens"], c["tokens"], strict=True)])
        row = {"hf_single": summarise(a, requests), "hf_static8": summarise(b, requests),
               "engine": summarise(c, requests), "tokens_match_a_c": float(match)}
        row["ratio_c_over_a"] = row["engine"]["tokens_per_s"] / row["hf_single"]["tokens_per_s"]
        row["ratio_c_over_b"] = row["engine"]["tokens_per_s"] / row["hf_static8"]["tokens_per_s"]
        results[wname] = row
        print_table(name, wname, row, len(requests))
        on_result()
    return results


def print_table(model: str, workload: str, row: dict, n: int) -> None:
    print(f"\n== {model} / {workload} ({n} requests) ==")
    print(f"{'path':<12}{'wall s':>9}{'img/s':>8}{'tok/s':>9}{'p50 s':>8}{'p99 s':>8}{'enc hit':>9}{'pfx hit':>9}")
    for path in ("hf_single", "hf_static8", "engine"):
        r = row[path]
        enc, pfx = r.get("encoder_hit_rate"), r.get("prefix_hit_rate")
        hits = f"{enc:>9.0%}{pfx:>9.0%}" if enc is not None else f"{'-':>9}{'-':>9}"
        print(f"{path:<12}{r['wall_s']:>9.1f}{r['images_per_s']:>8.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['p50_latency_s']:>8.1f}{r['p99_latency_s']:>8.1f}{hits}")
    print(f"engine/a = {row['ratio_c_over_a']:.2f}x   engine/b = {row['ratio_c_over_b']:.2f}x   "
          f"tokens equal (a vs c): {row['tokens_match_a_c']:.0%}   engine time split: {row['engine']['time_split_s']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (minutes)")
    ap.add_argument("--models", default="rand30m,tiny")
    ap.add_argument("--workloads", default="mixed_captions,shared_images")
    ap.add_argument("--json", default="bench_engine.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on a shared CPU, thread barriers stall small ops (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        workloads = {"mixed_captions": mixed_captions(8, 448, (8, 32)), "shared_images": shared_images(2, 3, (8, 16))}
    else:
        workloads = {"mixed_captions": mixed_captions(48, 1344, (16, 256)),
                     "shared_images": shared_images(8, 6, (16, 64))}
    workloads = {k: workloads[k] for k in args.workloads.split(",")}
    report = {"quick": args.quick, "torch_threads": torch.get_num_threads(),
              "models": {}}
    def save() -> None:  # after every workload, so a partial run still leaves its numbers
        Path(args.json).write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"tiny": BUNDLED, "rand30m": None}
        for name in args.models.split(","):
            # a private copy: the bundled checkpoint may be rewritten (training) while the paths run
            model_dir = Path(shutil.copytree(dirs[name], Path(tmp) / name)) if dirs[name] else \
                build_random_30m(Path(tmp) / name)
            bench_model(name, model_dir, workloads, 4096, report["models"].setdefault(name, {}), save)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
