"""Loading by shard: the peak host memory of each rank loading a >= 1 B-parameter checkpoint at TP = 2, against
TP = 1 loading it whole, in one run.

    python scripts/bench_tp_load.py [--layers 24] [--out bench-results/tp_load.json]

Writes a random-weight Qwen2-VL checkpoint (bf16 safetensors in several files; the bundled model's tokenizer and
vision settings, a 2,048-wide language model of --layers layers), then loads it with ``load_model`` in fresh
processes: once whole, then as the two ranks of a gloo group (``load_model(..., tp=TPGroup.world())``), at the
same time. Each process reports its peak RSS (``ru_maxrss``) and its RSS after the imports, before loading.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

BUNDLED = Path(__file__).resolve().parents[1] / "workers" / "assets" / "tiny-shapes"
LOAD = """
import json, resource, sys, time, torch
import torch.distributed as dist
from vlmq.workers.models.loader import load_model
from vlmq.workers.parallel import TPGroup
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
before = rss_kib()
tp = None
if len(sys.argv) > 2:
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[3]), world_size=2)
    tp = TPGroup.world()
t = time.perf_counter()
model = load_model(sys.argv[1], dtype=torch.bfloat16, tp=tp)
seconds = time.perf_counter() - t
held = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"rss_before_kib": before, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "param_bytes": held, "seconds": seconds}))
"""


def build(folder: Path, layers: int) -> int:
    """The checkpoint folder; returns its parameter count."""
    from vlmq.workers.models.qwen2_vl import Qwen2VLModel

    config = json.loads((BUNDLED / "config.json").read_text())
    config["text_config"] |= dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                  num_attention_heads=16, num_key_value_heads=2, dtype="bfloat16",
                                  layer_types=["full_attention"] * layers)
    config["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]  # head_dim 128, as Qwen2-VL's
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    config["vision_config"]["hidden_size"] = 2048  # the merger's output: the LM's width
    config["dtype"] = "bfloat16"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name in BUNDLED.iterdir():
        if name.suffix != ".safetensors" and name.name != "config.json" and name.is_file():
            shutil.copy(name, folder / name.name)
    from transformers import AutoConfig
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen2VLModel(AutoConfig.from_pretrained(folder)).named_parameters()}
    gen, part, total = torch.Generator().manual_seed(0), {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        key = name if name.startswith("lm_head.") else "model." + name  # transformers-5 layout
        part[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        total += part[key].numel()
        if sum(t.numel() for t in part.values()) > 150_000_000 or i == len(shapes) - 1:
            save_file(part, str(folder / f"model-{i:05d}.safetensors"))
            part = {}
    return total


def load(folder: Path, *rank_args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD, str(folder), *rank_args], stdout=subprocess.PIPE, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default="bench-results/tp_load.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        t = time.perf_counter()
        params = build(folder, args.layers)
        print(f"checkpoint: {params / 1e9:.2f} B parameters, bf16, written in {time.perf_counter() - t:.0f} s",
              flush=True)
        whole = json.loads(load(folder).communicate()[0])
        ranks = [load(folder, str(Path(tmp) / "store"), str(r)) for r in range(2)]
        shards = [json.loads(p.communicate()[0]) for p in ranks]
    report = {"command": " ".join(sys.argv), "parameters": params, "tp1": whole, "tp2": shards}
    mib = 1 / 1024
    print("| load | peak RSS | RSS before loading | parameters held | load time |\n|---|---|---|---|---|")
    for label, r in [("TP = 1", whole)] + [(f"TP = 2, rank {i}", s) for i, s in enumerate(shards)]:
        print(f"| {label} | {r['peak_kib'] * mib:,.0f} MiB | {r['rss_before_kib'] * mib:,.0f} MiB | "
              f"{r['param_bytes'] / 2**20:,.0f} MiB | {r['seconds']:.1f} s |")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
