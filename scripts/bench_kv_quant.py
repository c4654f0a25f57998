"""Effect of a quantised KV prefix on the bundled model's greedy answers.

For each held-out shapes example: prefill the prompt (image included) except its last token with
transformers, round-trip the whole KV cache through ``vlmq.kernels`` block quantisation (int8 and
fp8 e4m3, one scale per block of 16 tokens and KV head), then decode greedily and compare with the
unquantised answer. Prints agreement and writes JSON (default bench-results/kv_quant.json).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tiny.shapes import make_split
from transformers import AutoModelForImageTextToText

from vlmq.kernels import dequantize_kv_blocks, quantize_kv_blocks
from vlmq.workers.main import ASSETS
from vlmq.workers.models.processor import load_processor, render_prompt

BLOCK = 16


def roundtrip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [B, H, T, D] -> quantised per block of BLOCK tokens and head -> back, same shape."""
    b, h, t, d = x.shape
    pad = (-t) % BLOCK
    blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).permute(0, 2, 1, 3)  # [B, T', H, D]
    blocks = blocks.reshape(b * (t + pad) // BLOCK, BLOCK, h, d).contiguous()
    q, scales = quantize_kv_blocks(blocks, dtype)
    back = dequantize_kv_blocks(q, scales, dtype=x.dtype).reshape(b, t + pad, h, d).permute(0, 2, 1, 3)
    return back[:, :, :t].contiguous()


@torch.inference_mode()
def answer(model, inputs: dict, max_new: int, kv_dtype: torch.dtype | None) -> list[int]:
    ids = inputs["input_ids"]
    # the prompt minus its last token; generate() then feeds that token on top of the (quantised) cache
    prefix = {k: (v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v)
              for k, v in inputs.items()}
    out = model(**prefix, use_cache=True)
    cache = out.past_key_values
    if kv_dtype is not None:
        for layer in cache.layers:
            layer.keys.copy_(roundtrip(layer.keys, kv_dtype))
            layer.values.copy_(roundtrip(layer.values, kv_dtype))
    rest = {k: v for k, v in inputs.items() if k != "pixel_values"}  # the image is already in the cache
    gen = model.generate(**rest, past_key_values=cache, max_new_tokens=max_new, do_sample=False)
    return gen[0, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--out", default="bench-results/kv_quant.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(ASSETS / "tiny-shapes", local_files_only=True).eval()
    processor = load_processor(ASSETS / "tiny-shapes")
    stats = {"int8": [0, 0, 0], "fp8_e4m3": [0, 0, 0]}  # same answer, same tokens compared, tokens
    for ex in make_split(11, args.n):
        inputs = processor(text=[render_prompt(processor, ex.question)], images=[ex.image], return_tensors="pt")
        ref = answer(model, inputs, args.max_new_tokens, None)
        plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        # the split prefill must itself be exact, or the comparison means nothing
        assert plain[0, inputs["input_ids"].shape[1]:].tolist() == ref, "split prefill changed the answer"
        for name, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
            got = answer(model, inputs, args.max_new_tokens, dtype)
            stats[name][0] += got == ref
            stats[name][1] += sum(a == b for a, b in zip(got, ref, strict=False))
            stats[name][2] += max(len(got), len(ref))
    report = {name: {"same_answer": s[0] / args.n, "same_tokens": s[1] / max(s[2], 1)} for name, s in stats.items()}
    report["examples"] = args.n
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'KV prefix':<10} {'same answer':>12} {'same tokens':>12}   ({args.n} held-out examples)")
    for name in stats:
        print(f"{name:<10} {report[name]['same_answer']:>12.3f} {report[name]['same_tokens']:>12.3f}")


if __name__ == "__main__":
    main()
