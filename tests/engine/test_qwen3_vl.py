"""Our Qwen3-VL model code against transformers (float32, CPU), through the engine's ModelRunner: interleaved
M-RoPE, the vision tower's interpolated position embeddings and DeepStack taps added in the first LM layers, with
chunked prefills that cut through images beside decodes on the paged KV cache."""

import pytest
import torch
from test_model_parity import IDS, Runner, Seq, check, reference_logits, run_mixed_steps
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmq.workers.models.loader import checkpoint_key_to_param, load_model
from vlmq.workers.models.qwen3_vl import Qwen3VLModel

# head_dim 32 != hidden / heads; 16 rotary frequencies: t takes 0,3,..,15, h 1,4,..,13, w 2,5,..,14
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                             "mrope_interleaved": True})  # fmt: skip
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=16,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh")
PROCESSOR = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                     size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 24})


def tiny_config(**kw) -> Qwen3VLConfig:
    return Qwen3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), **IDS, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    ref = Qwen3VLForConditionalGeneration._from_config(tiny_config(), attn_implementation="sdpa",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():  # random (not zero) biases and norm weights, so a missed one shows in the logits
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen3_vl")
    ref.save_pretrained(path)
    ours = load_model(path, "cpu", torch.float32)
    assert isinstance(ours, Qwen3VLModel)
    return ref, ours


def seq(sizes, seed) -> Seq:
    return Seq(sizes, seed, PROCESSOR)


@pytest.mark.parametrize("size", [(32, 32), (96, 128), (384, 224)])
def test_single_image_encoder_and_prefill(models, size):
    """Encoder output (merger and each DeepStack tap) and prefill logits of one image; the 8×8 learned position
    table is resampled down to 2×2 patches and up to 24×14."""
    ref, ours = models
    s = seq([size], seed=1)
    with torch.no_grad():
        theirs = ref.model.get_image_features(s.pixels, s.grid)
        ours_out = torch.cat(ours.encode_images(s.pixels, s.grid))
    expected = torch.cat([torch.cat(theirs.pooler_output), *(torch.cat(f) for f in theirs.deepstack_features)], -1)
    assert ours_out.shape == expected.shape == (int(s.grid.prod()) // 4, 64 * 3)
    assert (ours_out - expected).abs().max().item() <= 1e-4
    check(Runner(ours, [s]).step([(s, s.prompt_len)])[0], reference_logits(ref, s))


def test_mixed_sizes_chunked_prefill_through_images(models):
    """Three requests (two images of different sizes, one wide image, text only) in one packed encoder call; one
    prefill advances in chunks of 5 that cut through its images (DeepStack rows sliced by chunk) beside decodes."""
    ref, ours = models
    run_mixed_steps(ref, ours, seq([(64, 96), (160, 128)], seed=2), seq([(224, 64)], seed=3), seq([], seed=4))


def test_full_size_config_has_the_checkpoint_layout():
    """A Qwen3-VL-4B-shaped config (head_dim 128 != hidden / heads, three DeepStack taps) on the meta device: every
    weight transformers saves maps to one of ours with the same shape, and none of ours is left over."""
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rope_parameters={
                             "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]}),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                           deepstack_visual_indexes=[5, 11, 17]))
    with torch.device("meta"):
        theirs = Qwen3VLForConditionalGeneration._from_config(config)
        ours = Qwen3VLModel(config)
    expected = {checkpoint_key_to_param(k): tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert expected == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert ours.encoder_output_width == config.text_config.hidden_size * 4
