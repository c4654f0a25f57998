"""What the tiling families' parity tests (InternVL, LLaVA-NeXT) share: checkpoints loaded both ways, a request as
the engine's intake makes it (driven through the ModelRunner by test_model_parity's Runner), the logits checks, and
the greedy workload run as one continuously batched engine load against transformers' `generate` (whose answers
the Qwen3-VL engine test takes from here too)."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_model_parity import TOL, Runner, check
from test_model_parity import make_image as image
from transformers import AutoModelForImageTextToText

from vlmq.workers.engine import ImagePlaceholder, Sequence
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.tiling import image_preprocessor_for
from vlmq.workers.models.loader import load_model
from vlmq.workers.models.processor import ChatPrompt, load_processor, render_prompt

MAX_NEW = 10
# tiny, one-pixel strips, exact tile multiples, near-square ties and extreme aspect ratios
SIZES = [(1, 1), (1, 300), (300, 1), (56, 56), (112, 56), (56, 112), (55, 57), (100, 100), (168, 56), (56, 168),
         (200, 67), (67, 200), (333, 111), (30, 400), (400, 30), (250, 249), (13, 17), (112, 112), (224, 56), (79, 120)]


def image_sizes(seed: int, count: int, largest: int) -> list[tuple[int, int]]:
    """SIZES and `count` random (width, height) pairs up to `largest`."""
    rng = random.Random(seed)
    return SIZES + [(rng.randint(1, largest), rng.randint(1, largest)) for _ in range(count)]


def load_checkpoint(path: Path) -> tuple:
    """(path, transformers' model, ours, our processor) of a checkpoint folder, float32 on the CPU."""
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref, load_model(path, "cpu", torch.float32), load_processor(path)


class Req:
    """One request as the engine's intake makes it: chat prompt with the image span, tiles, placeholder."""

    def __init__(self, processor, model, size: tuple[int, int], seed: int) -> None:
        pre = image_preprocessor_for(processor.image_processor.to_dict())
        self.pixels, self.grid = pre([image(*size, seed)])
        ((patches, tokens),) = model.image_counts(self.grid)
        ids = ChatPrompt(processor).ids(f"question {seed}", tokens)
        at = ids.index(model.config.image_token_id)
        self.seq = Sequence(seed, ids, images=(ImagePlaceholder(f"img{seed}", at, tokens, patches),))
        self.ids = self.seq.token_ids  # what the shared Runner reads; decoding appends to it
        self.prompt_len, self.table, self.cached = len(ids), [], 0


def prefill_then_decode(ours, r: Req, reference) -> None:
    """One request's prefill, then 4 greedy decode steps, against `reference(r)`: the whole sequence's logits."""
    runner = Runner(ours, [r])
    logits = runner.step([(r, r.prompt_len)])[0]
    check(logits, reference(r))
    decoded = []
    for _ in range(4):
        r.seq.token_ids.append(int(logits[-1].argmax()))
        logits = runner.step([(r, 1)])[0]
        decoded.append(logits[-1])
    check(torch.stack(decoded), reference(r)[r.prompt_len:])


def chunked_prefill_beside_decodes(ours, processor, reference, tiles: list[int]) -> None:
    """Requests a, b, c for 300×200, 40×40 and 60×130 images (of `tiles` tiles): one encoder call for all their
    tiles; b and c prefill whole and then decode while a prefills in chunks (cutting through its image); every logit
    against `reference`."""
    a, b, c = (Req(processor, ours, size, seed) for seed, size in enumerate([(300, 200), (40, 40), (60, 130)], 2))
    assert [int(x.grid[0, 0]) for x in (a, b, c)] == tiles
    runner = Runner(ours, [a, b, c])
    first = runner.step([(a, 9), (b, b.prompt_len), (c, c.prompt_len)])
    heads, outs = {b: first[1], c: first[2]}, {a: [first[0]], b: [], c: []}
    while a.cached < a.prompt_len:
        for r in (b, c):
            r.seq.token_ids.append(int((outs[r] or [heads[r]])[-1][-1].argmax()))
        res = runner.step([(b, 1), (a, min(7, a.prompt_len - a.cached)), (c, 1)])
        outs[b].append(res[0])
        outs[a].append(res[1])
        outs[c].append(res[2])
    check(torch.cat(outs[a]), reference(a))
    for r in (b, c):
        full = reference(r)
        check(heads[r], full[:r.prompt_len])
        check(torch.cat(outs[r]), full[r.prompt_len:])


def prompt_positions_check_image_tokens(ours, processor, wrong_grid: list[int]) -> None:
    """Plain text positions (delta 0) for a prompt with one image; a grid row of another token count is refused."""
    r = Req(processor, ours, (130, 60), seed=5)
    positions, delta = ours.prompt_positions(r.seq.token_ids, r.grid)
    assert positions.tolist() == [list(range(r.prompt_len))] and delta == 0
    with pytest.raises(ValueError, match="image tokens"):
        ours.prompt_positions(r.seq.token_ids, torch.tensor([wrong_grid]))


def resaved_logits_match(path: Path, state: dict, reference) -> None:
    """The checkpoint folder `path` with its weights replaced by `state` (in a copy, `hub` beside it) loads to a
    prefill's logits equal to `reference(r)`."""
    hub = path.parent / "hub"
    shutil.copytree(path, hub, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, hub / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(hub, "cpu", torch.float32)
    r = Req(load_processor(hub), ours, (90, 140), seed=9)
    check(Runner(ours, [r]).step([(r, r.prompt_len)])[0], reference(r))


def batched_encode_matches(ours, reqs: list[Req], reference) -> None:
    """The tiles of several images in one encoder call give the same features as one image at a time, and as
    `reference(pixels, grid)` (transformers' image features of the same tiles, [K, hidden])."""
    pixels, grid = torch.cat([r.pixels for r in reqs]), torch.cat([r.grid for r in reqs])
    with torch.no_grad():
        batched = torch.cat(ours.encode_images(pixels, grid))
        alone = torch.cat([ours.encode_images(r.pixels, r.grid)[0] for r in reqs])
        theirs = reference(pixels, grid).reshape(batched.shape)
    assert (batched - theirs).abs().max().item() <= TOL
    assert (alone - theirs).abs().max().item() <= TOL


def encoder_calls_under_budget(path, per_image: int, images_per_step: int) -> int:
    """Four requests for 300×200 images (`per_image` encoder patches each) through an engine whose step encoder
    budget is `images_per_step` images' patches; returns its encoder calls (after checking all four encoded)."""
    requests = [Request(image(300, 200, 50 + i), "describe", max_new_tokens=3) for i in range(4)]
    engine = Engine.from_model_dir(path, num_blocks=256, max_num_encoder_patches=images_per_step * per_image)
    outputs = engine.generate(requests, prepare_all_first=True)
    engine.close()
    assert all(o.error is None for o in outputs)
    assert engine.stats.num_encoded_images == 4
    return engine.stats.num_encoder_calls


def workload() -> list[tuple[Image.Image, str]]:
    rng = random.Random(7)
    fresh = [(image(rng.randint(8, 260), rng.randint(8, 260), i), f"what is in picture {i}?") for i in range(40)]
    same_image = [(img, f"and the colour of {i}?") for i, (img, _) in enumerate(fresh[:8])]  # encoder-cache hits
    return fresh + same_image + fresh[10:16]  # exact repeats: whole-prompt prefix-cache hits


def greedy_answers(ref, processor, prompts: list[tuple[Image.Image, str]]) -> dict[tuple[int, str], list[int]]:
    """transformers' greedy `generate` (MAX_NEW tokens, eos dropped) of each distinct (image, question), one at a
    time, keyed by (id(image), question)."""
    expected = {}
    eos = ref.generation_config.eos_token_id
    for img, question in prompts:
        if (id(img), question) not in expected:
            inputs = processor(text=[render_prompt(processor, question)], images=[img], return_tensors="pt")
            with torch.no_grad():
                out = ref.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            expected[id(img), question] = [t for t in out.tolist() if t != eos]
    return expected


def greedy_workload_matches(path, ref, processor) -> None:
    """>= 50 mixed-resolution prompts as one continuously batched engine load (a few join before every step, while
    others decode), caches on: every answer token for token equal to transformers' greedy `generate`."""
    prompts = workload()
    assert len(prompts) >= 50
    expected = greedy_answers(ref, processor, prompts)
    assert len({tuple(v) for v in expected.values()}) > len(expected) // 2  # answers depend on the image
    engine = Engine.from_model_dir(path, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                                   long_prefill_chunk_size=64)
    ids, pending = [], [Request(img, q, max_new_tokens=MAX_NEW) for img, q in prompts]
    done = {}
    while len(done) < len(prompts):
        ids += [engine.add_request(r) for r in pending[:4]]
        del pending[:4]
        done.update((o.request_id, o) for o in engine.step())
    engine.close()
    for (img, question), rid in zip(prompts, ids, strict=True):
        assert done[rid].error is None
        assert done[rid].token_ids == expected[id(img), question], question
    stats = engine.stats
    assert stats.encoder_cache_hits > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.num_encoder_calls < stats.num_encoded_images  # tiles of several requests per encoder call
