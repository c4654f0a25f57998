"""LLaVA-NeXT on the engine against transformers (float32, CPU), on tiny random-weight checkpoints that transformers
builds and saves here: anyres preprocessing bit for bit, the image token count against the SDK's price, logits
through the ModelRunner (tiles of many requests in one encoder call, chunked prefills beside decodes on scattered
cache blocks), and greedy outputs of a continuously batched workload with the encoder and prefix caches on."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiled_parity import (
    Req,
    batched_encode_matches,
    chunked_prefill_beside_decodes,
    encoder_calls_under_budget,
    greedy_workload_matches,
    image,
    image_sizes,
    load_checkpoint,
    prefill_then_decode,
    prompt_positions_check_image_tokens,
    resaved_logits_match,
)
from tiny.llava_next import PINPOINTS, TILE, build_llava_next
from transformers import AutoModelForImageTextToText
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

from vlmq.families import read_model_folder, select_best_resolution
from vlmq.workers.engine.anyres import AnyresPreprocessor
from vlmq.workers.engine.tiling import image_preprocessor_for
from vlmq.workers.models.processor import render_prompt

QWEN2 = dict(model_type="qwen2")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    torch.set_num_threads(1)
    text = QWEN2 if request.param == "qwen2" else None
    path = build_llava_next(tmp_path_factory.mktemp(f"llava-next-{request.param}"), text=text)
    return load_checkpoint(path)


# ------------------------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize("native", [True, False], ids=["native", "pil"])
def test_anyres_bit_exact_with_transformers(native):
    ref = LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                     image_grid_pinpoints=PINPOINTS)
    ours = image_preprocessor_for(ref.to_dict())
    assert isinstance(ours, AnyresPreprocessor)
    if not native:
        ours = AnyresPreprocessor(ours.policy, ours.image_mean, ours.image_std, ours.rescale_factor, native=False)
    for i, (w, h) in enumerate(image_sizes(3, 30, 500)):
        img = image(w, h, i)
        expected = ref(images=[img], return_tensors="pt")
        pixels, grid = ours([img])
        assert torch.equal(pixels, expected["pixel_values"][0]), (w, h)
        assert grid[0, 3:].tolist() == expected["image_sizes"][0].tolist() == [h, w]


def test_anyres_bit_exact_at_the_hub_checkpoints_settings():
    """336-px tiles and LLaVA-NeXT's default pinpoints (llava-v1.6's preprocessor_config.json), photo sizes."""
    ref = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    ours = image_preprocessor_for(ref.to_dict())
    for i, (w, h) in enumerate([(1920, 1080), (640, 480), (336, 336), (100, 1000), (1009, 337), (3000, 40)]):
        img = image(w, h, i)
        pixels, grid = ours([img])
        assert torch.equal(pixels, ref(images=[img], return_tensors="pt")["pixel_values"][0]), (w, h)
        rows, cols = (side // 336 for side in select_best_resolution(h, w, ours.policy.grid_pinpoints))
        assert grid[0, :3].tolist() == [rows * cols + 1, rows, cols], (w, h)


def test_token_count_is_the_sdk_price_and_the_processor_count(checkpoint):
    """The engine's LM tokens per image = vlmq.families' price = transformers' processor, on many sizes."""
    path, _, ours, processor = checkpoint
    _, policy = read_model_folder(path)
    pre = image_preprocessor_for(processor.image_processor.to_dict())
    for i, (w, h) in enumerate(image_sizes(5, 60, 700)):
        img = image(w, h, i)
        _, grid = pre([img])
        ((patches, tokens),) = ours.image_counts(grid)
        price = policy.measure(h, w)
        assert (patches, tokens) == (price.encoder_patches, price.vision_tokens), (w, h)
        assert processor.image_inputs([img])[1] == [tokens]
        text = processor(text=[render_prompt(processor, "q")], images=[img], return_tensors="pt")["input_ids"]
        assert int((text == ours.config.image_token_id).sum()) == tokens, (w, h)


# ------------------------------------------------------------------------------------- logits, ModelRunner
def reference_logits(ref, r: Req) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([r.seq.token_ids]), pixel_values=r.pixels[None],
                   image_sizes=r.grid[:, 3:]).logits[0]


def test_single_request_prefill_then_decode(checkpoint):
    _, ref, ours, processor = checkpoint
    r = Req(processor, ours, (130, 60), seed=1)
    assert r.grid.tolist() == [[4, 1, 3, 60, 130]]  # the base tile and a 1×3 canvas
    prefill_then_decode(ours, r, lambda r: reference_logits(ref, r))


def test_mixed_sizes_one_encoder_call_chunked_steps(checkpoint):
    """Three requests of 5, 3 and 4 tiles: one encoder call for all 12 tiles, then a chunked prefill (cutting
    through the image) beside the others' decodes."""
    _, ref, ours, processor = checkpoint
    chunked_prefill_beside_decodes(ours, processor, lambda r: reference_logits(ref, r), [5, 3, 4])


def test_tiles_batched_equal_one_image_at_a_time(checkpoint):
    _, ref, ours, processor = checkpoint
    reqs = [Req(processor, ours, size, 10 + i) for i, size in enumerate([(56, 56), (200, 67), (90, 140), (3, 90)])]
    batched_encode_matches(ours, reqs, lambda pixels, grid: torch.cat(
        ref.model.get_image_features(pixels, grid[:, 3:]).pooler_output))


def test_prompt_positions_check_image_tokens(checkpoint):
    _, _, ours, processor = checkpoint
    prompt_positions_check_image_tokens(ours, processor, [2, 1, 1, 56, 56])


def test_hub_key_layout_and_feature_layers(tmp_path):
    """The Hub's key layout (`vision_tower.vision_model.*`, `language_model.model.*`, `language_model.lm_head.*`)
    loads to the same logits, here with two concatenated feature layers."""
    path = build_llava_next(tmp_path / "saved", vision_feature_layer=[-3, -1])
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    assert "vision_tower.embeddings.class_embedding" in state
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in state.items()}
    resaved_logits_match(path, renamed, lambda r: reference_logits(ref, r))


def test_mistral_sliding_window_bounds_positions(tmp_path):
    """A Mistral LM: same logits as transformers while the sequence fits its sliding window, which becomes the
    model's position bound (intake refuses longer requests)."""
    path = build_llava_next(tmp_path, text=dict(model_type="mistral", sliding_window=200))
    _, ref, ours, processor = load_checkpoint(path)
    assert ours.max_positions == 200
    prefill_then_decode(ours, Req(processor, ours, (90, 140), seed=9), lambda r: reference_logits(ref, r))


# ------------------------------------------------------------------------------------- greedy, the engine
def test_greedy_identical_continuous_batching_with_caches(checkpoint):
    path, ref, _, processor = checkpoint
    greedy_workload_matches(path, ref, processor)


def test_encoder_budget_counts_tiles_patches(checkpoint):
    """Four 5-tile images (16 patches a tile): with a budget of two images' patches, every step's encoder call runs
    the tiles of both requests admitted in it, and no more."""
    path, _, ours, _ = checkpoint
    per_image = ours.image_counts(torch.tensor([[5, 2, 2, 200, 300]]))[0][0]
    assert per_image == 5 * 16
    assert encoder_calls_under_budget(path, per_image, 2) == 2
