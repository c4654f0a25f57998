"""Qwen3-VL on a paged KV cache: vision tower with DeepStack taps, interleaved M-RoPE and the Qwen3 language model.

What differs from Qwen2-VL (transformers' `modeling_qwen3_vl` is the numerical reference):
- vision: 16-px patches with a biased patch conv; a learned square table of position embeddings, bilinearly
  resampled (align_corners) to each image's patch grid and added to the patch embeddings; LayerNorm blocks with a
  plain MLP; the same axial 2D rotary and packed per-image attention as Qwen2-VL.
- DeepStack: the outputs of the vision blocks in `deepstack_visual_indexes` go through their own mergers
  (LayerNorm over the merged 4·E features) and are ADDED to the LM hidden states at the image tokens after LM
  layers 0, 1, ... (one tap per layer).
- LM: RMSNorm on every head's q and k before the rotary; explicit head_dim; interleaved M-RoPE (frequency j takes
  its angle from axis j mod 3 while the h and w sections last, the rest from t) instead of contiguous sections.
- positions of a prompt: the same rule as Qwen2-VL for images (`get_mrope_positions`).

An image's encoder output is ONE tensor [num_tokens, hidden * (1 + num_taps)]: the LM input embeddings, then each
DeepStack tap, side by side. The encoder cache and chunked prefill slice it by token rows like any other family's
output, and `embed_inputs` splits it again; a prefix-cache hit skips the image's rows, so needs none of it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from vlmq.workers.layers.attention import AttentionMetadata, Segments, paged_attention
from vlmq.workers.layers.norm import RMSNorm, layer_norm
from vlmq.workers.layers.rotary import MRotaryEmbedding, VisionRotaryEmbedding, apply_rotary, vision_patch_positions
from vlmq.workers.layers.vision import PatchEmbed, VisionBlock
from vlmq.workers.models import qwen2_vl
from vlmq.workers.models.qwen2_vl import KVCache, Qwen2VLModel, segment_bounds

DeepStack = tuple[torch.Tensor, torch.Tensor]  # rows [K] long, features [K, num_taps, hidden]


# ----------------------------------------------------------------------------------------------- positions
class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with the axes interleaved over the frequencies: j = 1, 4, 7, ... < 3·h_section take the row axis,
    j = 2, 5, 8, ... < 3·w_section the column axis, all others the time axis."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, theta, mrope_section)
        axis = torch.zeros(head_dim // 2, dtype=torch.long, device="cpu")
        axis[1 : 3 * mrope_section[1] : 3] = 1
        axis[2 : 3 * mrope_section[2] : 3] = 2
        self.axis = axis


def bilinear_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n target points on a `side`-long source axis, corners aligned: low index, high index, weight of high."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    lo = src.floor().long()
    return lo, (lo + 1).clamp(max=side - 1), src - lo


def interpolate_pos_embed(table: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """The learned [side², E] table resampled to every image's (h, w) patch grid, rows in the processor's patch
    order (merge×merge blocks row-major), frames repeated -> [sum t*h*w, E] float32."""
    side = int(table.shape[0] ** 0.5)
    grid = table.float().view(side, side, -1)  # weights and sums in float32, as the reference (bf16 tables too)
    out = []
    for t, h, w in grid_thw.tolist():
        h0, h1, fh = (x.to(table.device) for x in bilinear_taps(h, side))
        w0, w1, fw = (x.to(table.device) for x in bilinear_taps(w, side))
        fh, fw = fh[:, None, None], fw[None, :, None]
        top = grid[h0][:, w0] * (1 - fw) + grid[h0][:, w1] * fw  # [h, w, E]
        bottom = grid[h1][:, w0] * (1 - fw) + grid[h1][:, w1] * fw
        emb = top * (1 - fh) + bottom * fh
        emb = emb.view(h // merge, merge, w // merge, merge, -1).transpose(1, 2).reshape(h * w, -1)
        out.append(emb.repeat(t, 1))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------- vision tower
class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.linear_fc2 = nn.Linear(hidden_dim, dim)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """merge×merge patch features (consecutive rows) -> one LM token. postshuffle: LayerNorm over the merged 4·E
    features (the DeepStack mergers) rather than over each patch's E (the final merger)."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden, self.postshuffle = dim * merge**2, postshuffle
        self.norm = layer_norm(self.hidden if postshuffle else dim)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, E] -> [P / merge², out_dim]
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, self.merge = vc.hidden_size, vc.spatial_merge_size
        self.patch_embed = PatchEmbed(vc.patch_size, vc.temporal_patch_size, vc.in_channels, dim, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, dim)
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary_pos_emb = VisionRotaryEmbedding(dim // vc.num_heads, theta)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, vc.num_heads, layer_norm(dim), layer_norm(dim),
                        VisionMLP(dim, vc.intermediate_size, vc.hidden_act))
            for _ in range(vc.depth))  # fmt: skip
        self.merger = PatchMerger(dim, vc.out_hidden_size, self.merge, postshuffle=False)
        self.taps = {layer: i for i, layer in enumerate(vc.deepstack_visual_indexes)}  # block index -> tap
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(dim, vc.out_hidden_size, self.merge, postshuffle=True) for _ in self.taps)
        if any(not 0 <= layer < vc.depth for layer in self.taps):
            raise ValueError(f"deepstack_visual_indexes {list(self.taps)} must be vision blocks 0..{vc.depth - 1}")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values: [P, C*Tp*p*p] patches of N images back to back; grid_thw: [N, 3].
        Returns [P / merge², out_dim * (1 + taps)]: the merger's output, then each DeepStack tap's."""
        x = self.patch_embed(pixel_values)  # [P, E]
        x = x + interpolate_pos_embed(self.pos_embed.weight, grid_thw, self.merge).to(x.dtype)
        cos, sin = self.rotary_pos_emb(vision_patch_positions(grid_thw, self.merge).to(x.device))
        cu_seqlens = Segments.of(segment_bounds(grid_thw).to(x.device))
        taps = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_seqlens, cos, sin)
            if i in self.taps:
                taps.append(self.deepstack_merger_list[self.taps[i]](x))
        return torch.cat([self.merger(x), *taps], dim=-1)


# -------------------------------------------------------------------------------------------- language model
class Qwen3Attention(qwen2_vl.Qwen2Attention):
    def __init__(self, tc) -> None:
        bias = bool(getattr(tc, "attention_bias", False))
        super().__init__(tc, bias, bias)
        self.q_norm = RMSNorm(self.head_dim, tc.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, tc.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: KVCache):
        # x: [T, hidden] -> q: [T, H, D], k, v: [T, Hkv, D]; per-head RMSNorm, then the rotary
        q = apply_rotary(self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(qwen2_vl.DecoderLayer):
    attention_cls = Qwen3Attention


class TextModel(qwen2_vl.TextModel):
    layer_cls = DecoderLayer
    rotary_cls = InterleavedMRotaryEmbedding
    default_mrope_section = (24, 20, 20)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], deepstack: DeepStack | None = None) -> torch.Tensor:
        # embeds: [T, hidden]; positions: [3, T] -> hidden states [T, hidden]
        cos, sin = self.rotary_emb(positions, embeds.dtype)
        x = embeds
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, meta, kv)
            if deepstack is not None and i < deepstack[1].shape[1]:  # tap i joins the image rows after layer i
                x = x.index_add(0, deepstack[0], deepstack[1][:, i])
        return self.norm(x)


class Qwen3VLModel(Qwen2VLModel):
    """The Qwen2-VL model interface (positions, packed encoder, paged LM, logits, KV caches) plus `embed_inputs`,
    which splits an encoder output into the image tokens' input embeddings and their DeepStack features."""

    vision_cls = Qwen3VisionTransformer
    text_cls = TextModel

    def __init__(self, config) -> None:
        tc, vc = config.text_config, config.vision_config
        if vc.out_hidden_size != tc.hidden_size:
            raise ValueError(f"vision out_hidden_size {vc.out_hidden_size} != text hidden_size {tc.hidden_size}")
        super().__init__(config)
        # width of one image token's encoder output: input embedding + one row per DeepStack tap
        self.encoder_output_width = tc.hidden_size * (1 + len(vc.deepstack_visual_indexes))

    def embed_inputs(self, input_ids: torch.Tensor, image_rows: torch.Tensor,
                     image_features: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """input_ids: [T]; image_rows: [K] rows of the batch that are image tokens; image_features: their encoder
        outputs [K, hidden * (1 + taps)]. -> input embeddings [T, hidden] and the LM's keyword arguments."""
        x = self.language_model.embed_tokens(input_ids)
        hidden = x.shape[-1]
        feats = image_features.to(x.dtype)
        x = x.index_copy(0, image_rows, feats[:, :hidden])
        return x, {"deepstack": (image_rows, feats[:, hidden:].reshape(len(image_rows), -1, hidden))}
