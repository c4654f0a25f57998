"""One rank of the tensor-parallel parity test (tests/engine/test_tensor_parallel.py), run as its own process.

    python tp_rank.py logits|engine MODEL_DIR[,MODEL_DIR...] RANK SIZE STORE_FILE OUT_JSON

Joins a gloo group through STORE_FILE. ``engine``: rank 0 runs a continuously batched workload through an Engine
loaded whole, then through the group's engine (it leads; the other ranks follow), and writes both runs' tokens;
the others write how many steps they followed. ``logits``: for each model folder, prepares three requests (two
with images of different sizes, one text only) with the engine's own preprocessor, then drives the engine's
ModelRunner with the same hand-made steps twice:
on the model loaded whole (TP = 1) and on this rank's shard of it, loaded by shard (and checked equal to the whole
model cut after loading). Each run is one packed encoder call and a
prefill of all three, then greedy decode steps of all three in one batch. Writes, per folder, the largest logit
difference between the two runs, the largest logit, and both runs' greedy tokens.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from PIL import Image

from vlmq.workers.engine import EncoderCache, EncoderInput, EngineConfig, ScheduledSeq, SchedulerOutput, slot_mapping
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.model_runner import ModelRunner
from vlmq.workers.models.loader import load_model
from vlmq.workers.parallel import TPGroup, shard_language_model
from vlmq.workers.parallel.lockstep import follow

BLOCK, BLOCKS, DECODE_STEPS = 4, 256, 6


def requests() -> list[Request]:
    a, b = Image.new("RGB", (120, 90), (200, 40, 30)), Image.new("RGB", (64, 160), (20, 90, 200))
    b.paste((250, 250, 0), (10, 10, 40, 60))
    return [Request(a, "describe the image", 8), Request(b, "what colour is it?", 8),
            Request.chat([{"role": "user", "content": "what is a square?"}])]


def run(model, prepared: list) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The prefill logits of every request and its greedy tokens over DECODE_STEPS batched decode steps."""
    cache = EncoderCache(1 << 30)
    runner = ModelRunner(model, EngineConfig(block_size=BLOCK, num_blocks=BLOCKS), cache)
    encode, tables, ids, free = [], [], [], list(range(BLOCKS))
    for p in prepared:
        seq = p.seq
        runner.add_inputs(seq.seq_id, p.pixel_values, p.grid_thw, p.positions, p.rope_delta)
        for k, img in enumerate(seq.images):
            cache.reserve(img.content_hash, img.num_tokens, seq.seq_id)
            encode.append(EncoderInput(img.content_hash, seq.seq_id, k, img.num_patches, img.num_tokens))
        tables.append([])
        ids.append(list(seq.token_ids))
    cached = [0] * len(prepared)
    logits_out, tokens = [], [[] for _ in prepared]
    for step in range(1 + DECODE_STEPS):
        out = SchedulerOutput(step=step, encoder_inputs=encode if step == 0 else [])
        plan = [len(x) for x in ids] if step == 0 else [1] * len(ids)
        for i, (p, n) in enumerate(zip(prepared, plan, strict=True)):
            start, end = cached[i], cached[i] + n
            while len(tables[i]) * BLOCK < end:
                tables[i].append(free.pop())
            out.scheduled.append(ScheduledSeq(p.seq, n, start, ids[i][start:end], list(tables[i]),
                                              slot_mapping(tables[i], BLOCK, start, end), 0, True))
            cached[i] = end
        with torch.inference_mode():
            logits = model.compute_logits(runner.forward(out)).split(plan)
        for i, lg in enumerate(logits):
            logits_out.append(lg)
            tokens[i].append(int(lg[-1].argmax()))
            ids[i].append(tokens[i][-1])
            prepared[i].seq.token_ids.append(tokens[i][-1])
    return logits_out, tokens


def compare(model_dir: str) -> dict:
    engine = Engine.from_model_dir(model_dir, num_blocks=64)  # its preprocessor: the requests as the engine serves
    prepare = lambda: [engine.preprocessor(f"r{i}", r) for i, r in enumerate(requests())]  # noqa: E731
    whole, whole_tokens = run(load_model(model_dir), prepare())
    shard = load_model(model_dir, tp=TPGroup.world())  # sharded on the meta device, only its slices read
    cut = shard_language_model(load_model(model_dir), TPGroup.world())  # the whole model loaded, then cut
    mine, theirs = shard.state_dict(), cut.state_dict()
    same = mine.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in mine.items())
    ours, our_tokens = run(shard, prepare())
    engine.close()
    return {"max_diff": max((a - b).abs().max().item() for a, b in zip(whole, ours, strict=True)),
            "max_logit": max(a.abs().max().item() for a in whole), "whole": whole_tokens, "tp": our_tokens,
            "kv_heads": shard.num_kv_heads, "loaded_as_cut": same,
            "heads": shard.language_model.layers[0].self_attn.num_heads}


def workload() -> list[Request]:
    """Images of many sizes, the same image asked again (encoder cache), exact repeats (prefix cache), a chat with
    two images and a text-only chat."""
    imgs = [Image.new("RGB", (40 + 23 * i % 170, 50 + 37 * i % 150), (20 * i % 256, 90, 200 - 9 * i))
            for i in range(10)]
    reqs = [Request(img, f"what is in picture {i}?", 8) for i, img in enumerate(imgs)]
    reqs += [Request(img, f"and the colour of {i}?", 8) for i, img in enumerate(imgs[:4])]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    reqs += [Request.chat(two, (imgs[1], imgs[5]), max_new_tokens=8), Request.chat([{"role": "user",
                                                                                     "content": "hello"}])]
    return reqs + reqs[2:5]


def staggered(engine: Engine) -> list[list[int]]:
    """Every request's tokens, a few joining before each step while the others decode."""
    ids, pending, done = [], workload(), {}
    while pending or len(done) < len(ids):
        ids += [engine.add_request(r) for r in pending[:3]]
        del pending[:3]
        done.update((o.request_id, o) for o in engine.step())
    assert all(done[i].error is None for i in ids), [done[i].error for i in ids]
    return [done[i].token_ids for i in ids]


def engine_mode(model_dir: str, tp: TPGroup) -> dict:
    if tp.rank:
        return {"steps": follow(load_model(model_dir, tp=tp), tp)}
    whole = Engine.from_model_dir(model_dir, num_blocks=512)
    expected = staggered(whole)
    whole.close()
    group = Engine.from_model_dir(model_dir, num_blocks=512, tp=tp)
    got = staggered(group)
    group.runner.stop_followers()
    group.close()
    return {"whole": expected, "tp": got, "encoded": group.stats.num_encoded_images,
            "kv_heads": group.runner.model.num_kv_heads}


def main() -> None:
    mode, dirs = sys.argv[1], sys.argv[2].split(",")
    rank, size, store, out = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    tp = TPGroup.world()
    results = {d: compare(d) if mode == "logits" else engine_mode(d, tp) for d in dirs}
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
