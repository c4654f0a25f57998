"""Decoding modes against free decoding, in one process run, at batch 1 / 8 / 32: JSON schema, stop strings,
logprobs, sampling controls (top_p + penalties), and n=4 against 4 separate requests.

    python scripts/bench_decoding.py [--models tiny,rand30m] [--batches 1,8,32] [--rounds 3] [--json FILE]

Each mode runs the same images and questions with a fixed answer budget; free decoding runs with eos ignored and
the same number of tokens each mode produced, so the ratio is time per generated token (mode / free); each timed
run has a cache salt of its own, so both sides start with cold prefix and encoder caches; mode and free runs
alternate for --rounds rounds and the fastest of each side is kept. n=4 is
compared with 4 separate requests of the same prompt (the prefix cache shares the prompt in both; n=4 is admitted
as one job). Every answer of the JSON mode is parsed and validated (jsonschema).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import torch
from tiny import shapes

from vlmq.workers.backends.base import GenRequest
from vlmq.workers.backends.engine import EngineBackend
from vlmq.workers.engine.engine import Engine, Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import BUNDLED, build_random_30m  # noqa: E402

MAX_NEW = 64
SCHEMA = {"type": "object", "properties": {
    "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 9},
    "colours": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["shape", "count"], "additionalProperties": False}
MODES = {
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "shapes", "schema": SCHEMA}}),
    "stop": dict(stop=(" the", "\n")),
    "logprobs": dict(logprobs=5),
    "controls": dict(temperature=1.0, seed=1, top_p=0.9, top_k=50, frequency_penalty=0.5, repetition_penalty=1.1),
}


def inputs(n: int, seed: int = 7) -> list[tuple]:
    out = []
    for i in range(n):
        ex = shapes.make_example((seed, i), size=(160 + 16 * (i % 8), 128), caption_prob=1.0)
        out.append((ex.image, shapes.CAPTION_PROMPT))
    return out


def timed(engine: Engine, requests: list[Request]) -> tuple[float, list]:
    t = time.perf_counter()
    outs = engine.generate(requests)
    return time.perf_counter() - t, outs


def bench_batch(engine: Engine, batch: int, rounds: int) -> dict:
    work = inputs(batch)
    row: dict = {}
    for mode, options in MODES.items():
        mode_s, free_s = [], []
        for r in range(rounds):  # interleaved, the fastest of each side kept: load on a shared VM only adds time
            # a salt of its own per timed run: neither side finds the other's prompt in the prefix or encoder cache
            secs, outs = timed(engine, [Request(img, q, MAX_NEW, cache_salt=f"{mode}:{batch}:{r}", **options)
                                        for img, q in work])
            assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
            lengths = [max(1, len(o.token_ids)) for o in outs]
            free, _ = timed(engine, [Request(img, q, n, ignore_eos=True, cache_salt=f"free-{mode}:{batch}:{r}")
                                     for (img, q), n in zip(work, lengths, strict=True)])
            mode_s.append(secs)
            free_s.append(free)
        valid = None
        if mode == "json_schema":  # every answer that ended (not cut by max tokens) parses and validates
            for o in outs:
                if o.finish_reason == "stop":
                    jsonschema.validate(json.loads(o.text), SCHEMA)
            valid = sum(o.finish_reason == "stop" for o in outs) / len(outs)
        row[mode] = {"s": round(min(mode_s), 3), "free_s": round(min(free_s), 3),
                     "ratio": round(min(mode_s) / min(free_s), 3), "tokens": sum(lengths),
                     "rounds": rounds} | ({"complete": valid} if valid is not None else {})
    return row


def bench_n(backend: EngineBackend, batch: int) -> dict:
    """n=4 choices as one job each against 4 separate requests of the same prompt, batch // 4 jobs; each side on
    images of its own, so neither finds the other's prompt in the prefix cache."""
    work = inputs(max(1, batch // 4), seed=100 + batch)
    t = time.perf_counter()
    backend.generate([GenRequest(f"n{k}", img, q, MAX_NEW, ignore_eos=True, temperature=1.0, seed=4 * k, n=4)
                      for k, (img, q) in enumerate(work)])
    n4 = time.perf_counter() - t
    t = time.perf_counter()
    backend.generate([GenRequest(f"s{k}.{i}", img, q, MAX_NEW, ignore_eos=True, temperature=1.0, seed=4 * k + i)
                      for k, (img, q) in enumerate(inputs(len(work), seed=200 + batch)) for i in range(4)])
    separate = time.perf_counter() - t
    return {"n4_s": round(n4, 3), "separate_s": round(separate, 3), "ratio": round(n4 / separate, 3),
            "jobs": len(work)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--json", default="bench-results/decoding.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode; the fastest of each side")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {"max_new_tokens": MAX_NEW, "torch_threads": args.threads, "rounds": args.rounds, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = Path(shutil.copytree(BUNDLED, Path(tmp) / name)) if name == "tiny" else \
                build_random_30m(Path(tmp) / name)
            backend = EngineBackend(str(model_dir), "cpu", num_blocks=4096, max_num_seqs=64, speculative="none")
            engine = backend.engine
            # warm-up, the schema's compilation included (compiled once per engine, then cached)
            timed(engine, [Request(img, q, 8, **MODES["json_schema"]) for img, q in inputs(4, seed=1)])
            rows = report["models"].setdefault(name, {})
            for batch in map(int, args.batches.split(",")):
                rows[str(batch)] = bench_batch(engine, batch, args.rounds) | {"n4": bench_n(backend, batch)}
                print(name, batch, json.dumps(rows[str(batch)]), flush=True)
            backend.close()
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
