"""InternVL 2.5 / 3 (as transformers' `modeling_internvl` implements it) on a paged KV cache.

Vision: InternViT over fixed-size square tiles (a CLS token, absolute position embeddings, pre-norm blocks with
per-channel layer scales), the CLS token dropped, pixel shuffle by `downsample_ratio` (2×2 neighbouring patches
become one token of 4× the width), then an MLP projector. Every tile has the same shape, so the tiles of many
images run as one dense batch. Language model: Qwen2 or Llama (transformers' InternVL checkpoints use either) with
plain 1-D RoPE; positions are token indices, images included.

Parameter names follow the transformers checkpoints (`vision_tower.*`, `multi_modal_projector.*`, the LM's
`embed_tokens`/`layers`/`norm`, `lm_head`); `checkpoint_prefixes` maps both saved layouts onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from vlmq.workers.layers.mlp import PlainMLP
from vlmq.workers.layers.norm import RMSNorm
from vlmq.workers.layers.rotary import inv_frequencies
from vlmq.workers.models.qwen2_vl import DecoderLayer as Qwen2DecoderLayer
from vlmq.workers.models.qwen2_vl import Qwen2Attention, Qwen2VLModel, head_dim_of
from vlmq.workers.models.qwen2_vl import TextModel as Qwen2TextModel


# ---------------------------------------------------------------------------------------------- vision tower
def _vision_norm(vc) -> nn.Module:
    if vc.norm_type == "rms_norm":
        return RMSNorm(vc.hidden_size, vc.layer_norm_eps)
    return nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)


class VisionEmbeddings(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, (ph, pw), (ih, iw) = vc.hidden_size, vc.patch_size, vc.image_size
        if ph != pw or ih != iw or vc.use_mask_token:
            raise NotImplementedError("only square patches and tiles without mask tokens are supported")
        self.grid = ih // ph  # patches per tile side at the trained size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(vc.num_channels, dim, kernel_size=ph, stride=ph)
        self.position_embeddings = (nn.Parameter(torch.zeros(1, self.grid**2 + 1, dim))
                                    if vc.use_absolute_position_embeddings else None)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        # tiles: [B, C, S, S] -> [B, 1 + (S/p)², E]
        x = self.patch_embeddings.projection(tiles).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.position_embeddings is None:
            return x
        return x + self._positions(int((x.shape[1] - 1) ** 0.5))

    def _positions(self, side: int) -> torch.Tensor:
        pos = self.position_embeddings
        if side == self.grid:
            return pos
        # tiles of another size than trained: bicubic resampling of the patch grid, as the reference does
        grid = pos[:, 1:].reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
        return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, side * side, -1)], dim=1)


class VisionAttention(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, self.num_heads = vc.hidden_size, vc.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim, bias=vc.attention_bias)
        self.k_proj = nn.Linear(dim, dim, bias=vc.attention_bias)
        self.v_proj = nn.Linear(dim, dim, bias=vc.attention_bias)
        self.projection_layer = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim) if vc.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim) if vc.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, E] -> q, k, v: [B, H, N, D]; every tile attends over itself only
        b, n, _ = x.shape
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.projection_layer(out.transpose(1, 2).reshape(b, n, -1))


class VisionLayer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.attention = VisionAttention(vc)
        self.mlp = PlainMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)
        self.layernorm_before, self.layernorm_after = _vision_norm(vc), _vision_norm(vc)
        self.lambda_1 = nn.Parameter(torch.ones(vc.hidden_size))  # per-channel layer scales
        self.lambda_2 = nn.Parameter(torch.ones(vc.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class VisionEncoder(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layer = nn.ModuleList(VisionLayer(vc) for _ in range(vc.num_hidden_layers))


class InternVisionModel(nn.Module):
    def __init__(self, vc, feature_layer: int) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(vc)
        self.encoder = VisionEncoder(vc)
        self.layernorm = nn.Identity() if vc.use_mean_pooling else nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        n = vc.num_hidden_layers
        # hidden state k is the output of k layers (0: the embeddings); -1 is the last one, after the final norm
        self.num_layers = n if feature_layer == -1 else feature_layer % (n + 1)
        self.final_norm = feature_layer == -1

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(tiles)  # [B, 1 + N, E]
        for layer in self.encoder.layer[:self.num_layers]:
            x = layer(x)
        return self.layernorm(x) if self.final_norm else x


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """[B, W, H, C] -> [B, W·r, H·r, C/r²], the reference's view/permute sequence (r = 0.5 merges 2×2 patches)."""
    b, w, h, c = x.shape
    x = x.view(b, w, int(h * ratio), int(c / ratio)).permute(0, 2, 1, 3).contiguous()
    x = x.view(b, int(h * ratio), int(w * ratio), int(c / ratio**2))
    return x.permute(0, 2, 1, 3).contiguous()


class MultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        width = config.vision_config.hidden_size * int(1 / config.downsample_ratio) ** 2
        hidden = config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, hidden)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


# -------------------------------------------------------------------------------------------- language model
class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.inv_freq = inv_frequencies(head_dim, theta)  # a plain attribute: survives meta-device construction

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [1, T] or [T] -> cos, sin: [T, D], computed in float32 and cast like the reference
        self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.view(-1, 1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(Qwen2Attention):
    """Qwen2's attention (q, k, v biased) or Llama's (`attention_bias` on all four), head_dim from the config."""

    def __init__(self, tc) -> None:
        llama_bias = getattr(tc, "attention_bias", False)
        super().__init__(tc, tc.model_type == "qwen2" or llama_bias, tc.model_type != "qwen2" and llama_bias)


class DecoderLayer(Qwen2DecoderLayer):
    attention_cls = Attention


class TextModel(Qwen2TextModel):
    """Qwen2 or Llama decoder with 1-D RoPE (Qwen2-VL's forward over a flattened step on the paged cache)."""

    layer_cls = DecoderLayer

    def __init__(self, tc) -> None:
        if tc.model_type not in ("qwen2", "llama"):
            raise NotImplementedError(f"InternVL with a {tc.model_type!r} language model is not supported")
        super().__init__(tc)

    def _rotary(self, tc) -> nn.Module:
        return RotaryEmbedding(head_dim_of(tc), tc.rope_parameters["rope_theta"])


# ------------------------------------------------------------------------------------------------ the model
class InternVLModel(Qwen2VLModel):
    """The model runner's interface (see Qwen2VLModel) for InternVL. An image's grid row is (tiles, rows, cols):
    its pixel_values rows are its tiles ([tiles, 3, S, S]; the thumbnail last when rows·cols > 1), and it takes
    tiles × `tokens_per_tile` LM tokens."""

    checkpoint_prefixes = (  # transformers 5 writes the first layout, the Hub's -hf checkpoints the second
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "language_model."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config) -> None:
        nn.Module.__init__(self)  # not Qwen2-VL's parts; compute_logits and make_kv_caches are shared
        if config.vision_feature_select_strategy != "default" or not isinstance(config.vision_feature_layer, int):
            raise NotImplementedError("only vision_feature_select_strategy 'default' with one feature layer")
        self.config = config
        vc, tc = config.vision_config, config.text_config
        self.vision_tower = InternVisionModel(vc, config.vision_feature_layer)
        self.multi_modal_projector = MultiModalProjector(config)
        self.language_model = TextModel(tc)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.num_kv_heads, self.head_dim = tc.num_key_value_heads, head_dim_of(tc)
        self.max_positions = tc.max_position_embeddings
        self.patches_per_tile = (vc.image_size[0] // vc.patch_size[0]) ** 2
        self.tokens_per_tile = int(self.patches_per_tile * config.downsample_ratio**2)

    # -- seams the engine calls ---------------------------------------------------------------
    def pixel_rows(self, grid: torch.Tensor) -> list[int]:
        """Rows of pixel_values each image occupies: its tiles."""
        return grid[:, 0].tolist()

    def image_counts(self, grid: torch.Tensor) -> list[tuple[int, int]]:
        """(encoder patches, LM tokens) of each image: every tile is (S/p)² patches and `tokens_per_tile` tokens."""
        return [(n * self.patches_per_tile, n * self.tokens_per_tile) for n in grid[:, 0].tolist()]

    def prompt_positions(self, token_ids: list[int], grid: torch.Tensor) -> tuple[torch.Tensor, int]:
        """1-D positions [1, L] (token indices) and delta 0. Raises ValueError when the prompt's image tokens do not
        match the images' tiles."""
        expected = sum(tokens for _, tokens in self.image_counts(grid)) if grid.numel() else 0
        found = sum(1 for t in token_ids if t == self.config.image_token_id)
        if found != expected:
            raise ValueError(f"{found} image tokens in the prompt do not match the images' tiles {grid.tolist()} "
                             f"({expected} tokens)")
        return torch.arange(len(token_ids)).view(1, -1), 0

    def decode_positions(self, start: int, count: int, delta: int) -> torch.Tensor:
        return torch.arange(start + delta, start + delta + count).view(1, -1)

    def encode_images(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: [T, 3, S, S], the tiles of N images back to back; grid: [N, 3] -> N tensors
        [tiles_i · tokens_per_tile, hidden]. One dense batch over every tile."""
        dtype = self.vision_tower.embeddings.cls_token.dtype
        x = self.vision_tower(pixel_values.to(dtype))[:, 1:]  # [T, N, E], CLS dropped
        side = int(x.shape[1] ** 0.5)
        x = pixel_shuffle(x.reshape(x.shape[0], side, side, -1), self.config.downsample_ratio)
        x = self.multi_modal_projector(x.reshape(x.shape[0], -1, x.shape[-1]))  # [T, n, hidden]
        return list(x.reshape(-1, x.shape[-1]).split([n * x.shape[1] for n in grid[:, 0].tolist()]))
