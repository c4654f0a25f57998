"""InternVL on the engine against transformers (float32, CPU), on tiny random-weight checkpoints that transformers
builds and saves here: tiling bit for bit, logits through the ModelRunner (tiles of many requests in one encoder
call, chunked prefills beside decodes on scattered cache blocks), and greedy outputs of a continuously batched
workload with the encoder and prefix caches on."""
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
from tiny.internvl import build_internvl
from transformers import AutoModelForImageTextToText
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from vlmq.families import InternVLPolicy
from vlmq.workers.engine.tiling import TilingPreprocessor

LLAMA = dict(model_type="llama", attention_bias=True, mlp_bias=True, head_dim=24)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    torch.set_num_threads(1)
    text = LLAMA if request.param == "llama" else None
    path = build_internvl(tmp_path_factory.mktemp(f"internvl-{request.param}"), text=text)
    return load_checkpoint(path)


# ------------------------------------------------------------------------------------------- preprocessing
@pytest.mark.parametrize("native", [True, False], ids=["native", "pil"])
def test_tiles_bit_exact_with_transformers(native):
    ref = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, max_patches=6,
                                   image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    config = ref.to_dict()
    ours = TilingPreprocessor.from_preprocessor_config({**config, "crop_to_patches": False})  # the processor crops
    if not native:
        ours = TilingPreprocessor(ours.policy, ours.image_mean, ours.image_std, ours.rescale_factor, native=False)
    price = InternVLPolicy(tile_height=56, tile_width=56, max_tiles=6)  # the SDK's price of the same tiles
    for i, (w, h) in enumerate(image_sizes(3, 30, 500)):
        img = image(w, h, i)
        expected = ref(images=[img], crop_to_patches=True, return_tensors="pt")
        pixels, grid = ours([img])
        assert torch.equal(pixels, expected["pixel_values"]), (w, h)
        assert grid[0, 0] == expected["num_patches"][0] == price.measure(h, w).num_tiles, (w, h)
        assert grid[0, 0] == ref.get_number_of_image_patches(h, w, {"crop_to_patches": True})


# ------------------------------------------------------------------------------------- logits, ModelRunner
def reference_logits(ref, r: Req) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([r.seq.token_ids]), pixel_values=r.pixels).logits[0]


def test_single_request_prefill_then_decode(checkpoint):
    _, ref, ours, processor = checkpoint
    r = Req(processor, ours, (130, 60), seed=1)
    assert r.grid.tolist() == [[3, 1, 2]]  # a 2×1 grid and the thumbnail
    prefill_then_decode(ours, r, lambda r: reference_logits(ref, r))


def test_mixed_sizes_one_encoder_call_chunked_steps(checkpoint):
    """Three requests of 1, 3 and 7 tiles: one encoder call for all 11 tiles, then a chunked prefill (cutting
    through the image) beside the others' decodes."""
    _, ref, ours, processor = checkpoint
    chunked_prefill_beside_decodes(ours, processor, lambda r: reference_logits(ref, r), [7, 1, 3])


def test_tiles_batched_equal_one_image_at_a_time(checkpoint):
    _, ref, ours, processor = checkpoint
    reqs = [Req(processor, ours, size, 10 + i) for i, size in enumerate([(56, 56), (200, 67), (90, 140)])]
    batched_encode_matches(ours, reqs, lambda pixels, grid: ref.model.get_image_features(pixels).pooler_output)


def test_prompt_positions_check_image_tokens(checkpoint):
    _, _, ours, processor = checkpoint
    prompt_positions_check_image_tokens(ours, processor, [1, 1, 1])


def test_hub_key_layout_and_feature_layer(tmp_path):
    """The Hub's -hf key layout (`model.language_model.*`, `model.vision_tower.*`, ...) loads to the same logits,
    here with features taken from an inner vision layer (vision_feature_layer=-2)."""
    path = build_internvl(tmp_path / "saved", vision=dict(num_hidden_layers=3), vision_feature_layer=-2)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    renamed = {"model." + k.replace("language_model.model.", "language_model."): v for k, v in state.items()}
    assert {"model.language_model.embed_tokens.weight", "model.vision_tower.embeddings.cls_token"} <= renamed.keys()
    resaved_logits_match(path, renamed, lambda r: reference_logits(ref, r))


# ------------------------------------------------------------------------------------- greedy, the engine
def test_greedy_identical_continuous_batching_with_caches(checkpoint):
    path, ref, _, processor = checkpoint
    greedy_workload_matches(path, ref, processor)


@pytest.mark.parametrize("images_per_step", [2, 4])
def test_encoder_budget_counts_tiles_patches(checkpoint, images_per_step):
    """Four 7-tile images (16 patches a tile): with a budget of `images_per_step` images' patches, every step's
    encoder call runs the tiles of all requests admitted in it, and no more than the budget."""
    path, _, ours, _ = checkpoint
    per_image = ours.image_counts(torch.tensor([[7, 2, 3]]))[0][0]
    assert per_image == 7 * 16
    assert encoder_calls_under_budget(path, per_image, images_per_step) == 4 // images_per_step
