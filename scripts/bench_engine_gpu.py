"""Per-resolution engine benchmark on random-weight Qwen2-VL-2B- and 7B-shaped models (GPU; a CPU dry run).

    python scripts/bench_engine_gpu.py --out bench-results/gpu/engine.json          # H200: both models
    python scripts/bench_engine_gpu.py --dry-run --out /tmp/engine.json             # tiny shapes on the CPU

For each model and resolution (256², 448², 1024², 1920x1080) and batch size (1, 8, 64), with every request the
same image size and exactly --max-new-tokens generated (eos ignored):
- engine: TTFT (batch 1: first token time since arrival), prefill tokens/s (prompt tokens of the batch over the
  time until the last first token), decode tokens/s (tokens after the first over the rest of the run), and the
  vision tower's share of the batch-1 TTFT (the encoder call timed alone, synchronised);
- transformers `generate` on the same batch (static, left-padded), tokens/s, in the same process.
Before the table, for --mixed-models: mixed-resolution captions (bench_engine.mixed_captions), the engine against
transformers' best static batch size. Weights are random (the shapes, not the answers, set the cost): model
configs from `model_config`. The JSON is rewritten after every measurement (a run stopped by a time limit keeps
what it measured); each model's "complete" says whether it finished.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import BUNDLED, PROCESSOR_FILES, RowLengths, mixed_captions
from tiny import shapes
from transformers import StoppingCriteriaList

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.models.processor import load_processor, render_prompt

# (text, vision) shapes of Qwen2-VL-2B / 7B (their published configs); "tiny" is the dry run's
SHAPES = {
    "2b": (dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768),
           dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=1536)),
    "7b": (dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768),
           dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=3584)),
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1024, max_position_embeddings=4096),
             dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64)),
}
RESOLUTIONS = ((256, 256), (448, 448), (1024, 1024), (1920, 1080))
MAX_PIXELS = 2_200_000  # above 1920x1080: every table resolution is encoded at its own size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes and sizes on the CPU; checks the script")
    p.add_argument("--models", default="2b,7b", help=f"comma-separated, from {sorted(SHAPES)}")
    p.add_argument("--resolutions", default=",".join(f"{w}x{h}" for w, h in RESOLUTIONS))
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hf-batches", default="8,16,32", help="transformers static batch sizes for mixed captions")
    p.add_argument("--num-mixed", type=int, default=64, help="mixed-resolution caption requests (0: skip)")
    p.add_argument("--mixed-max-side", type=int, default=1344, help="largest image side of the mixed captions")
    p.add_argument("--mixed-models", default="2b", help="models that run the mixed-caption comparison")
    p.add_argument("--kv-fraction", type=float, default=0.5, help="kv_cache_memory_fraction (CUDA)")
    p.add_argument("--out", default="bench-results/gpu/engine.json")
    args = p.parse_args(argv)
    if args.dry_run:
        args.models, args.mixed_models, args.resolutions, args.batches = "tiny", "tiny", "64x64,112x84", "1,2"
        args.max_new_tokens, args.hf_batches, args.num_mixed = 4, "2", 3
        args.mixed_max_side = 160
    args.models, args.mixed_models = args.models.split(","), args.mixed_models.split(",")
    unknown = set(args.models) - set(SHAPES)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {sorted(SHAPES)}")
    args.resolutions = [tuple(int(v) for v in r.split("x")) for r in args.resolutions.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    return args


def model_config(name: str):
    """A Qwen2VLConfig of the named shape, with the bundled tokenizer's special token ids."""
    from transformers import Qwen2VLConfig

    text, vision = SHAPES[name]
    bundled = json.loads((BUNDLED / "config.json").read_text())
    ids = {k: bundled[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    text = dict(text, bos_token_id=414, eos_token_id=416, pad_token_id=414, tie_word_embeddings=name != "7b",
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(text)})
    vision = dict(vision, mlp_ratio=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                         **ids)


def mrope_section(text: dict) -> list[int]:
    # Qwen2-VL splits head_dim / 2 rotary frequencies as [1/4, 3/8, 3/8] over (t, h, w): [16, 24, 24] at 128
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    return [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]


def build_model_dir(name: str, out_dir: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """Random weights of the named shape (initialised on `device`) with the bundled tokenizer, 14-px patches."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    with device:
        model = Qwen2VLForConditionalGeneration._from_config(model_config(name), dtype=dtype)
    model.save_pretrained(out_dir)
    del model
    for file in PROCESSOR_FILES:
        shutil.copy(BUNDLED / file, out_dir / file)
    cfg = json.loads((out_dir / "preprocessor_config.json").read_text())
    cfg.update(patch_size=14, size={"shortest_edge": 3136, "longest_edge": MAX_PIXELS})
    (out_dir / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def requests_at(size: tuple[int, int], batch: int, max_new: int) -> list[Request]:
    # distinct images, also across batch sizes (no encoder or prefix cache hits), all of one size
    return [Request(shapes.make_example((7, batch, i), size=size, caption_prob=1.0).image, shapes.CAPTION_PROMPT,
                    max_new, True) for i in range(batch)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_run(engine: Engine, requests: list[Request], device: torch.device) -> dict:
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(requests, prepare_all_first=True)
    sync(device)
    end = time.perf_counter()
    first = max(o.first_token_time for o in outs)
    prompt = sum(o.prompt_tokens for o in outs)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return dict(wall_s=end - t0, ttft_s=first - min(o.arrival_time for o in outs), prompt_tokens=prompt,
                image_tokens=sum(o.image_tokens for o in outs), prefill_tok_s=prompt / (first - t0),
                decode_tok_s=decoded / max(end - first, 1e-9), tok_s=(decoded + len(outs)) / (end - t0))


def encoder_seconds(engine: Engine, processor, image, device: torch.device, iters: int = 3) -> float:
    """One image through the vision tower alone (preprocessed outside the timing), median of iters."""
    proc = processor.image_processor(images=[image], return_tensors="pt")
    pixels, grid = proc["pixel_values"].to(device), proc["image_grid_thw"].to(device)
    times = []
    with torch.inference_mode():
        for _ in range(iters + 1):
            sync(device)
            t0 = time.perf_counter()
            engine.runner.model.encode_images(pixels, grid)
            sync(device)
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


@torch.inference_mode()
def hf_run(model, processor, requests: list[Request], batch_size: int, device: torch.device) -> dict:
    """transformers generate in static left-padded batches (sorted by image area); tokens/s over the whole run."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].image.width * requests[i].image.height)
    sync(device)
    t0 = time.perf_counter()
    for k in range(0, len(order), batch_size):
        batch = [requests[i] for i in order[k:k + batch_size]]
        inputs = processor(text=[render_prompt(processor, r.question) for r in batch],
                           images=[r.image for r in batch], return_tensors="pt", padding=True).to(device)
        lengths = [r.max_new_tokens for r in batch]
        stop = StoppingCriteriaList([RowLengths(lengths, inputs["input_ids"].shape[1])])
        model.generate(**inputs, max_new_tokens=max(lengths), do_sample=False, eos_token_id=None,
                       stopping_criteria=stop)
    sync(device)
    wall = time.perf_counter() - t0
    return dict(batch_size=batch_size, wall_s=wall, tok_s=sum(r.max_new_tokens for r in requests) / wall)


def bench_resolution(engine, hf, size, args, device) -> dict:
    row = {"resolution": f"{size[0]}x{size[1]}", "batches": {}}
    for batch in args.batches:
        reqs = requests_at(size, batch, args.max_new_tokens)
        eng = engine_run(engine, reqs, device)
        ref = hf_run(*hf, reqs, batch, device)
        row["batches"][str(batch)] = dict(engine=eng, transformers=ref, speedup=eng["tok_s"] / ref["tok_s"])
    ttft = row["batches"][str(args.batches[0])]["engine"]["ttft_s"]
    row["vision_share_of_ttft"] = encoder_seconds(engine, hf[1], requests_at(size, 1, 1)[0].image, device) / ttft
    return row


def bench_mixed(engine, hf, args, device) -> dict:
    reqs = mixed_captions(args.num_mixed, args.mixed_max_side, (args.max_new_tokens // 4 + 1, args.max_new_tokens * 2))
    eng = engine_run(engine, reqs, device)
    refs = [hf_run(*hf, reqs, b, device) for b in args.hf_batches]
    best = max(refs, key=lambda r: r["tok_s"])
    return dict(engine=eng, transformers=refs, best_transformers_batch=best["batch_size"],
                speedup_vs_best=eng["tok_s"] / best["tok_s"])


def bench_model(name: str, args, device, dtype, tmp: Path, out: dict, save) -> None:
    """Fills `out` (the model's part of the report), calling `save` after every measurement."""
    from transformers import AutoModelForImageTextToText

    model_dir = build_model_dir(name, tmp / name, device, dtype)
    sized = dict(kv_cache_memory_fraction=args.kv_fraction, max_model_len=8192) if device.type == "cuda" else \
        dict(num_blocks=2048)
    engine = Engine.from_model_dir(model_dir, device, dtype=dtype, max_num_batched_tokens=8192,
                                   long_prefill_chunk_size=4096, **sized)
    processor = load_processor(model_dir)
    processor.tokenizer.padding_side = "left"
    hf = (AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval(), processor)
    for batch in args.batches:  # warm-up, untimed: Triton compiles, each batch size's CUDA graph is captured
        engine.generate(requests_at((128, 96), batch, 4))
    out.update(config=SHAPES[name], block_size=engine.config.block_size, num_kv_blocks=engine.config.num_blocks,
               resolutions=[], complete=False)
    if args.num_mixed and name in args.mixed_models:  # first: the engine-vs-transformers target
        out["mixed_captions"] = bench_mixed(engine, hf, args, device)
        save()
    for size in args.resolutions:
        out["resolutions"].append(bench_resolution(engine, hf, size, args, device))
        save()
    out["complete"] = True
    engine.close()
    del engine, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(model_dir)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run for a CPU smoke run")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dry_run=args.dry_run,
                  dtype=str(dtype), max_new_tokens=args.max_new_tokens, torch=torch.__version__, models={})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every measurement: a run stopped by its time limit keeps its numbers
        Path(args.out).write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            report["models"][name] = {}
            bench_model(name, args, device, dtype, Path(tmp), report["models"][name], save)
            save()
            print_model(name, report["models"][name])
    print(f"\nwrote {args.out}")
    return report


def print_model(name: str, res: dict) -> None:
    print(f"\n== {name} (block {res['block_size']}, {res['num_kv_blocks']} KV blocks) ==")
    print(f"{'resolution':>11}{'batch':>6}{'TTFT ms':>9}{'prefill t/s':>13}{'decode t/s':>12}{'HF t/s':>9}"
          f"{'speedup':>9}{'vision':>8}")
    for row in res["resolutions"]:
        for batch, r in row["batches"].items():
            e = r["engine"]
            print(f"{row['resolution']:>11}{batch:>6}{e['ttft_s'] * 1e3:>9.1f}{e['prefill_tok_s']:>13.0f}"
                  f"{e['decode_tok_s']:>12.0f}{r['transformers']['tok_s']:>9.0f}{r['speedup']:>9.2f}"
                  f"{row['vision_share_of_ttft']:>8.0%}")
    if "mixed_captions" in res:
        m = res["mixed_captions"]
        print(f"mixed captions: engine {m['engine']['tok_s']:.0f} tok/s, {m['speedup_vs_best']:.2f}x transformers' "
              f"best static batch ({m['best_transformers_batch']})")


if __name__ == "__main__":
    main()
