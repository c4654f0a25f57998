"""Our Qwen2-VL / Qwen2.5-VL model code against transformers (float32, CPU), run the way requests are served:
through the engine's ModelRunner (packed encoder call, encoder cache, flattened mixed steps on the paged KV cache),
with the positions the model supplies at intake."""

import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.workers.engine import (
    EncoderCache,
    EncoderInput,
    EngineConfig,
    ImagePlaceholder,
    SamplingParams,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
    slot_mapping,
)
from vlmq.workers.engine.model_runner import ModelRunner
from vlmq.workers.models.loader import load_model

TOL = 1e-4
IMG, START, END = 290, 292, 293  # image_pad, vision_start, vision_end ids of the tiny configs
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]},
            bos_token_id=None, eos_token_id=None)  # fmt: skip
IDS = dict(image_token_id=IMG, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)
FAMILIES = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2)),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                   dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4,
                        window_size=56, fullatt_block_indexes=[1])),
}  # fmt: skip
PROCESSOR = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 24})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request, tmp_path_factory):
    config_cls, hf_cls, vision = FAMILIES[request.param]
    torch.manual_seed(0)
    config = config_cls(text_config=dict(TEXT, initializer_range=0.1), vision_config=dict(vision), **IDS)
    ref = hf_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_model(path, "cpu", torch.float32)


def make_image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


class Seq:
    """One request: prompt ids in the Qwen2-VL layout, its images' pixels and its engine `Sequence`."""

    def __init__(self, sizes: list[tuple[int, int]], seed: int, processor=PROCESSOR) -> None:
        rnd = random.Random(seed)
        feats = processor([make_image(w, h, seed + i) for i, (w, h) in enumerate(sizes)]) if sizes else None
        patch_dim = 3 * processor.temporal_patch_size * processor.patch_size**2
        self.pixels = torch.empty(0, patch_dim) if feats is None else torch.as_tensor(feats["pixel_values"])
        self.grid = torch.empty(0, 3, dtype=torch.long) if feats is None else torch.as_tensor(feats["image_grid_thw"])
        ids, images = [rnd.randrange(280) for _ in range(3)], []
        for k, (t, h, w) in enumerate(self.grid.tolist()):
            n = t * h * w // 4
            images.append(ImagePlaceholder(f"{seed}:{k}", len(ids) + 1, n, t * h * w))
            ids += [START] + [IMG] * n + [END] + [rnd.randrange(280) for _ in range(rnd.randint(1, 4))]
        self.seq = Sequence(seed, ids, images=tuple(images), sampling=SamplingParams(max_new_tokens=64))
        self.ids = self.seq.token_ids  # the runner reads the sequence's tokens; decoding appends to them
        self.prompt_len = len(ids)
        self.table: list[int] = []
        self.cached = 0


class Runner:
    """Drives the engine's ModelRunner with hand-made steps: every image in one packed encoder call on the first
    step, then the given chunks (prefill pieces beside decodes) on scattered cache blocks."""

    def __init__(self, model, seqs: list[Seq], block_size: int = 4, num_blocks: int = 256) -> None:
        config = EngineConfig(block_size=block_size, num_blocks=num_blocks)
        cache = EncoderCache(1 << 30)
        self.runner = ModelRunner(model, config, cache)
        self.model, self.block_size = model, block_size
        self.free = random.Random(1).sample(range(num_blocks), num_blocks)  # scattered block tables
        self.encode = []
        for s in seqs:
            positions, delta = model.prompt_positions(s.ids, s.grid)
            self.runner.add_inputs(s.seq.seq_id, s.pixels, s.grid, positions, delta)
            for k, img in enumerate(s.seq.images):
                cache.reserve(img.content_hash, img.num_tokens, s.seq.seq_id)  # as the scheduler does
                self.encode.append(EncoderInput(img.content_hash, s.seq.seq_id, k, img.num_patches, img.num_tokens))

    def step(self, plan: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Run one step of `n` new tokens per sequence; returns each sequence's logits [n, vocab]."""
        out = SchedulerOutput(step=0, encoder_inputs=self.encode)
        self.encode = []
        for s, n in plan:
            start, end = s.cached, s.cached + n
            while len(s.table) * self.block_size < end:
                s.table.append(self.free.pop())
            out.scheduled.append(ScheduledSeq(s.seq, n, start, s.ids[start:end], list(s.table),
                                              slot_mapping(s.table, self.block_size, start, end), 0, True))
            s.cached = end
        calls = self.runner.num_encoder_calls
        hidden = self.runner.forward(out)
        assert self.runner.num_encoder_calls - calls == (1 if out.encoder_inputs else 0)  # all images, one call
        with torch.no_grad():
            return list(self.model.compute_logits(hidden).split([n for _, n in plan]))


def reference_logits(ref, s: Seq) -> torch.Tensor:
    ids = torch.tensor([s.ids])
    kw = {} if not s.grid.numel() else dict(pixel_values=s.pixels, image_grid_thw=s.grid)
    with torch.no_grad():
        return ref(input_ids=ids, mm_token_type_ids=(ids == IMG).int(), **kw).logits[0]


def check(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff:.2e} (logit std {ref.std().item():.2f})"


def decode(runner: Runner, seqs: list[Seq], steps: int, last: list[torch.Tensor]) -> None:
    # greedy: append our argmax, then one decode token per sequence per step, all in one batch
    for _ in range(steps):
        for s, lg in zip(seqs, last, strict=True):
            s.ids.append(int(lg[-1].argmax()))
        last = runner.step([(s, 1) for s in seqs])
    for s, lg in zip(seqs, last, strict=True):
        s.ids.append(int(lg[-1].argmax()))  # so the reference covers the last decoded position too


def test_single_image_prefill_then_decode(models):
    ref, ours = models
    s = Seq([(84, 112)], seed=1)
    runner = Runner(ours, [s])
    logits = runner.step([(s, s.prompt_len)])
    check(logits[0], reference_logits(ref, s))
    decoded = []
    for _ in range(4):
        s.ids.append(int(logits[0][-1].argmax()))
        logits = runner.step([(s, 1)])
        decoded.append(logits[0][-1])
    full = reference_logits(ref, s)
    check(torch.stack(decoded), full[s.prompt_len :])
    assert ours.config.image_token_id in s.ids[: s.prompt_len]


def test_multi_image_batch_mixed_steps(models):
    """Three requests (two images of different sizes, one image, text only) share one packed encoder call and
    mixed steps: chunked prefills (cutting through images) beside decodes, on scattered cache blocks."""
    ref, ours = models
    run_mixed_steps(ref, ours, Seq([(56, 84), (140, 112)], seed=2), Seq([(196, 56)], seed=3), Seq([], seed=4))


def run_mixed_steps(ref, ours, a: Seq, b: Seq, c: Seq) -> None:
    """a's prefill starts beside b's and c's whole prefills, then continues in chunks of 5 while b and c decode;
    all logits are checked against the reference."""
    runner = Runner(ours, [a, b, c])
    outs = {x: [] for x in (a, b, c)}
    first = runner.step([(a, 7), (b, b.prompt_len), (c, c.prompt_len)])
    outs[a].append(first[0])
    b.ids.append(int(first[1][-1].argmax()))
    c.ids.append(int(first[2][-1].argmax()))
    while a.cached < a.prompt_len:  # a's prefill continues in chunks of 5 while b and c decode
        n = min(5, a.prompt_len - a.cached)
        res = runner.step([(b, 1), (a, n), (c, 1)])
        outs[a].append(res[1])
        outs[b].append(res[0])
        outs[c].append(res[2])
        b.ids.append(int(res[0][-1].argmax()))
        c.ids.append(int(res[2][-1].argmax()))
    decode(runner, [a, b, c], 3, [outs[a][-1], outs[b][-1], outs[c][-1]])
    check(torch.cat(outs[a]), reference_logits(ref, a)[: a.prompt_len])
    for s, head in ((b, first[1]), (c, first[2])):
        full = reference_logits(ref, s)
        check(head, full[: s.prompt_len])
        check(torch.cat(outs[s]), full[s.prompt_len : s.prompt_len + len(outs[s])])


def test_packed_encoder_matches_one_image_at_a_time(models):
    ref, ours = models
    s = Seq([(56, 56), (140, 84), (84, 252)], seed=5)
    with torch.no_grad():
        packed = torch.cat(ours.encode_images(s.pixels, s.grid))
        theirs = torch.cat(ref.model.get_image_features(s.pixels, s.grid).pooler_output)
        alone, start = [], 0
        for g in s.grid:
            n = int(g.prod())
            alone += ours.encode_images(s.pixels[start : start + n], g[None])
            start += n
    assert (packed - theirs).abs().max().item() <= TOL
    assert (torch.cat(alone) - theirs).abs().max().item() <= TOL


def test_mrope_positions_match_transformers(models):
    ref, ours = models
    s = Seq([(56, 112), (168, 56)], seed=6)
    ids = torch.tensor([s.ids])
    expected, delta = ref.model.get_rope_index(ids, (ids == IMG).int(), image_grid_thw=s.grid)
    pos, ours_delta = ours.prompt_positions(s.ids, s.grid)
    assert torch.equal(pos, expected[:, 0]) and ours_delta == int(delta)
    assert ours_delta < 0  # images take fewer positions than tokens, so decode continues below the token index


def test_loader_new_key_layout_and_tied_embeddings(tmp_path):
    """transformers-5 module names (`model.language_model.*`, `model.visual.*`) and a checkpoint without
    `lm_head` (tie_word_embeddings) load to the same logits as the reference."""
    config_cls, hf_cls, vision = FAMILIES["qwen2_vl"]
    torch.manual_seed(1)
    config = config_cls(text_config=dict(TEXT), vision_config=dict(vision), tie_word_embeddings=True, **IDS)
    ref = hf_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path / "old")
    state = load_file(tmp_path / "old" / "model.safetensors")
    assert "lm_head.weight" not in state
    renamed = {
        ("model.language_model." + k[6:] if k.startswith("model.") else "model." + k): v for k, v in state.items()
    }
    (tmp_path / "new").mkdir()
    save_file(renamed, tmp_path / "new" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tmp_path / "old" / "config.json", tmp_path / "new" / "config.json")
    ours = load_model(tmp_path / "new", "cpu", torch.float32)
    assert ours.lm_head.weight is ours.language_model.embed_tokens.weight
    s = Seq([(84, 56)], seed=7)
    check(Runner(ours, [s]).step([(s, s.prompt_len)])[0], reference_logits(ref, s))
