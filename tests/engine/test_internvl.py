"""InternVL on the engine against transformers (float32, CPU), on tiny random-weight checkpoints that transformers
builds and saves here: tiling bit for bit, logits through the ModelRunner (tiles of many requests in one encoder
call, chunked prefills beside decodes on scattered cache blocks), and greedy outputs of a continuously batched
workload with the encoder and prefix caches on."""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tiny.internvl import build_internvl
from transformers import AutoModelForImageTextToText
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from vlmq.workers.engine import EncoderCache, EncoderInput, EngineConfig, ImagePlaceholder, Sequence, slot_mapping
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.model_runner import ModelRunner
from vlmq.workers.engine.outputs import ScheduledSeq, SchedulerOutput
from vlmq.workers.engine.tiling import TilingPreprocessor, num_tiles
from vlmq.workers.models.loader import load_model
from vlmq.workers.models.processor import ChatPrompt, load_processor, render_prompt

TOL = 1e-4
LLAMA = dict(model_type="llama", attention_bias=True, mlp_bias=True, head_dim=24)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    torch.set_num_threads(1)
    text = LLAMA if request.param == "llama" else None
    path = build_internvl(tmp_path_factory.mktemp(f"internvl-{request.param}"), text=text)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref, load_model(path, "cpu", torch.float32), load_processor(path)


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------------------- preprocessing
SIZES = [(1, 1), (1, 300), (300, 1), (56, 56), (112, 56), (56, 112), (55, 57), (100, 100), (168, 56), (200, 67),
         (67, 200), (333, 111), (30, 400), (400, 30), (250, 249), (13, 17), (112, 112), (224, 56), (79, 120)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "pil"])
def test_tiles_bit_exact_with_transformers(native):
    ref = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, max_patches=6,
                                   image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    config = ref.to_dict()
    ours = TilingPreprocessor.from_preprocessor_config({**config, "crop_to_patches": False})  # the processor crops
    if not native:
        ours = TilingPreprocessor(ours.policy, ours.image_mean, ours.image_std, ours.rescale_factor, native=False)
    rng = random.Random(3)
    sizes = SIZES + [(rng.randint(1, 500), rng.randint(1, 500)) for _ in range(30)]
    for i, (w, h) in enumerate(sizes):
        img = image(w, h, i)
        expected = ref(images=[img], crop_to_patches=True, return_tensors="pt")
        pixels, grid = ours([img])
        assert torch.equal(pixels, expected["pixel_values"]), (w, h)
        assert grid[0, 0] == expected["num_patches"][0] == num_tiles(h, w, ours.policy), (w, h)
        assert grid[0, 0] == ref.get_number_of_image_patches(h, w, {"crop_to_patches": True})


# ------------------------------------------------------------------------------------- logits, ModelRunner
class Req:
    """One request as the engine's intake makes it: chat prompt with the image span, tiles, placeholder."""

    def __init__(self, processor, model, size: tuple[int, int], seed: int) -> None:
        pre = TilingPreprocessor.from_preprocessor_config(processor.image_processor.to_dict())
        self.pixels, self.grid = pre([image(*size, seed)])
        ((patches, tokens),) = model.image_counts(self.grid)
        ids = ChatPrompt(processor).ids(f"question {seed}", tokens)
        at = ids.index(model.config.image_token_id)
        self.seq = Sequence(seed, ids, images=(ImagePlaceholder(f"img{seed}", at, tokens, patches),))
        self.prompt_len, self.table, self.cached = len(ids), [], 0


class Runner:
    """The engine's ModelRunner driven with hand-made steps on scattered cache blocks."""

    def __init__(self, model, reqs: list[Req], block_size: int = 4, num_blocks: int = 256) -> None:
        cache = EncoderCache(1 << 30)
        self.runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=num_blocks), cache)
        self.model, self.block_size = model, block_size
        self.free = random.Random(1).sample(range(num_blocks), num_blocks)
        self.encode = []
        for r in reqs:
            self.runner.add_inputs(r.seq.seq_id, r.pixels, r.grid, *model.prompt_positions(r.seq.token_ids, r.grid))
            img = r.seq.images[0]
            cache.reserve(img.content_hash, img.num_tokens, r.seq.seq_id)
            self.encode.append(EncoderInput(img.content_hash, r.seq.seq_id, 0, img.num_patches, img.num_tokens))

    def step(self, plan: list[tuple[Req, int]]) -> list[torch.Tensor]:
        out = SchedulerOutput(step=0, encoder_inputs=self.encode)
        self.encode = []
        for r, n in plan:
            start, end = r.cached, r.cached + n
            while len(r.table) * self.block_size < end:
                r.table.append(self.free.pop())
            out.scheduled.append(ScheduledSeq(r.seq, n, start, r.seq.token_ids[start:end], list(r.table),
                                              slot_mapping(r.table, self.block_size, start, end), 0, True))
            r.cached = end
        calls = self.runner.num_encoder_calls
        hidden = self.runner.forward(out)
        assert self.runner.num_encoder_calls - calls == (1 if out.encoder_inputs else 0)  # all tiles, one call
        return list(self.model.compute_logits(hidden).split([n for _, n in plan]))


def reference_logits(ref, r: Req) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([r.seq.token_ids]), pixel_values=r.pixels).logits[0]


def check(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff:.2e} (logit std {ref.std().item():.2f})"


def test_single_request_prefill_then_decode(checkpoint):
    _, ref, ours, processor = checkpoint
    r = Req(processor, ours, (130, 60), seed=1)
    assert r.grid.tolist() == [[3, 1, 2]]  # a 2×1 grid and the thumbnail
    runner = Runner(ours, [r])
    logits = runner.step([(r, r.prompt_len)])[0]
    check(logits, reference_logits(ref, r))
    decoded = []
    for _ in range(4):
        r.seq.token_ids.append(int(logits[-1].argmax()))
        logits = runner.step([(r, 1)])[0]
        decoded.append(logits[-1])
    check(torch.stack(decoded), reference_logits(ref, r)[r.prompt_len:])


def test_mixed_sizes_one_encoder_call_chunked_steps(checkpoint):
    """Three requests of 1, 3 and 7 tiles: one encoder call for all 11 tiles, then a chunked prefill (cutting
    through the image) beside the others' decodes."""
    _, ref, ours, processor = checkpoint
    a, b, c = (Req(processor, ours, size, seed) for seed, size in enumerate([(300, 200), (40, 40), (60, 130)], 2))
    assert [int(x.grid[0, 0]) for x in (a, b, c)] == [7, 1, 3]
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
    check(torch.cat(outs[a]), reference_logits(ref, a))
    for r in (b, c):
        full = reference_logits(ref, r)
        check(heads[r], full[:r.prompt_len])
        check(torch.cat(outs[r]), full[r.prompt_len:])


def test_tiles_batched_equal_one_image_at_a_time(checkpoint):
    _, ref, ours, processor = checkpoint
    reqs = [Req(processor, ours, size, 10 + i) for i, size in enumerate([(56, 56), (200, 67), (90, 140)])]
    pixels, grid = torch.cat([r.pixels for r in reqs]), torch.cat([r.grid for r in reqs])
    with torch.no_grad():
        batched = torch.cat(ours.encode_images(pixels, grid))
        alone = torch.cat([ours.encode_images(r.pixels, r.grid)[0] for r in reqs])
        theirs = ref.model.get_image_features(pixels).pooler_output.reshape(batched.shape)
    assert (batched - theirs).abs().max().item() <= TOL
    assert (alone - theirs).abs().max().item() <= TOL


def test_prompt_positions_check_image_tokens(checkpoint):
    _, _, ours, processor = checkpoint
    r = Req(processor, ours, (130, 60), seed=5)
    positions, delta = ours.prompt_positions(r.seq.token_ids, r.grid)
    assert positions.tolist() == [list(range(r.prompt_len))] and delta == 0
    with pytest.raises(ValueError, match="image tokens"):
        ours.prompt_positions(r.seq.token_ids, torch.tensor([[1, 1, 1]]))


def test_hub_key_layout_and_feature_layer(tmp_path):
    """The Hub's -hf key layout (`model.language_model.*`, `model.vision_tower.*`, ...) loads to the same logits,
    here with features taken from an inner vision layer (vision_feature_layer=-2)."""
    path = build_internvl(tmp_path / "saved", vision=dict(num_hidden_layers=3), vision_feature_layer=-2)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    renamed = {"model." + k.replace("language_model.model.", "language_model."): v for k, v in state.items()}
    assert {"model.language_model.embed_tokens.weight", "model.vision_tower.embeddings.cls_token"} <= renamed.keys()
    shutil.copytree(path, tmp_path / "hub", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(renamed, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path / "hub", "cpu", torch.float32)
    r = Req(load_processor(tmp_path / "hub"), ours, (90, 140), seed=9)
    check(Runner(ours, [r]).step([(r, r.prompt_len)])[0], reference_logits(ref, r))


# ------------------------------------------------------------------------------------- greedy, the engine
MAX_NEW = 10


def workload() -> list[tuple[Image.Image, str]]:
    rng = random.Random(7)
    fresh = [(image(rng.randint(8, 260), rng.randint(8, 260), i), f"what is in picture {i}?") for i in range(40)]
    same_image = [(img, f"and the colour of {i}?") for i, (img, _) in enumerate(fresh[:8])]  # encoder-cache hits
    return fresh + same_image + fresh[10:16]  # exact repeats: whole-prompt prefix-cache hits


def test_greedy_identical_continuous_batching_with_caches(checkpoint):
    path, ref, _, processor = checkpoint
    prompts = workload()
    assert len(prompts) >= 50
    expected = {}
    eos = ref.generation_config.eos_token_id
    for img, question in prompts:
        if (id(img), question) not in expected:
            inputs = processor(text=[render_prompt(processor, question)], images=[img], return_tensors="pt")
            with torch.no_grad():
                out = ref.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            expected[id(img), question] = [t for t in out.tolist() if t != eos][:MAX_NEW]
    assert len({tuple(v) for v in expected.values()}) > len(expected) // 2  # answers depend on the image
    engine = Engine.from_model_dir(path, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                                   long_prefill_chunk_size=64)
    ids, pending = [], [Request(img, q, max_new_tokens=MAX_NEW) for img, q in prompts]
    done = {}
    while len(done) < len(prompts):  # a few requests join before every step, while others decode
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


@pytest.mark.parametrize("images_per_step", [2, 4])
def test_encoder_budget_counts_tiles_patches(checkpoint, images_per_step):
    """Four 7-tile images (16 patches a tile): with a budget of `images_per_step` images' patches, every step's
    encoder call runs the tiles of all requests admitted in it, and no more than the budget."""
    path, _, ours, _ = checkpoint
    requests = [Request(image(300, 200, 50 + i), "describe", max_new_tokens=3) for i in range(4)]
    per_image = ours.image_counts(torch.tensor([[7, 2, 3]]))[0][0]
    assert per_image == 7 * 16
    engine = Engine.from_model_dir(path, num_blocks=256, max_num_encoder_patches=images_per_step * per_image)
    outputs = engine.generate(requests, prepare_all_first=True)
    engine.close()
    assert all(o.error is None for o in outputs)
    assert engine.stats.num_encoded_images == 4
    assert engine.stats.num_encoder_calls == 4 // images_per_step
