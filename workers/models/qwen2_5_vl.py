"""Qwen2.5-VL: the Qwen2-VL language model and M-RoPE, with a different vision tower.

Vision differences: RMSNorm and a gated (SwiGLU, with bias) MLP in every block and in the merger's norm;
attention inside windows of `window_size` pixels (window×window merged tokens) except in the blocks listed in
`fullatt_block_indexes`, which attend over the whole image. Tokens are reordered window by window before the
blocks (so every window is a contiguous segment) and put back in raster order after the merger.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmq.workers.layers.attention import Segments
from vlmq.workers.layers.mlp import GatedMLP
from vlmq.workers.layers.norm import RMSNorm
from vlmq.workers.layers.rotary import vision_patch_positions
from vlmq.workers.models.qwen2_vl import (
    Qwen2VisionTransformer,
    Qwen2VLModel,
    decode_positions,
    get_mrope_positions,
    segment_bounds,
)

__all__ = ["Qwen2_5_VLModel", "decode_positions", "get_mrope_positions"]


def window_partition(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group merged tokens into window×window tiles (row-major tiles, row-major inside a tile; edge tiles smaller).

    Returns order: [P/merge²] long, the merged-token index at each reordered slot, and cu_windows: [W + 1] int32
    patch offsets of the windows in the reordered sequence.
    """
    order, counts, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        rows, cols = h // merge, w // merge
        n_row, n_col = math.ceil(rows / window), math.ceil(cols / window)
        tile = (torch.arange(rows)[:, None] // window) * n_col + torch.arange(cols)[None, :] // window  # [rows, cols]
        tile = tile.flatten().repeat(t) + torch.arange(t).repeat_interleave(rows * cols) * (n_row * n_col)
        order.append(torch.argsort(tile, stable=True) + base)
        counts.append(torch.bincount(tile, minlength=t * n_row * n_col))
        base += t * rows * cols
    cu_windows = F.pad((torch.cat(counts) * merge**2).cumsum(0, dtype=torch.int32), (1, 0))
    return torch.cat(order), cu_windows


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    def __init__(self, vc) -> None:
        super().__init__(vc)
        self.full_attention_blocks = set(vc.fullatt_block_indexes)
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size  # tile side in merged tokens

    def _dim(self, vc) -> int:
        return vc.hidden_size

    def _out_dim(self, vc) -> int:
        return vc.out_hidden_size

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, eps=1e-6)

    def _block_parts(self, vc) -> tuple[nn.Module, nn.Module, nn.Module]:
        dim = vc.hidden_size
        return self._norm(dim), self._norm(dim), GatedMLP(dim, vc.intermediate_size, vc.hidden_act, bias=True)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [P, E]
        unit, dim = self.merge**2, x.shape[-1]
        order, cu_windows = window_partition(grid_thw, self.merge, self.window)
        order, cu_windows = order.to(x.device), Segments.of(cu_windows.to(x.device))
        # reorder whole merge units (merge² consecutive patches) so each window is one contiguous segment
        x = x.view(-1, unit, dim)[order].view(-1, dim)
        pos = vision_patch_positions(grid_thw, self.merge).to(x.device)
        cos, sin = self.rotary_pos_emb(pos.view(-1, unit, 2)[order].view(-1, 2))
        cu_images = Segments.of(segment_bounds(grid_thw).to(x.device))
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_images if i in self.full_attention_blocks else cu_windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]  # [P/merge², out_dim] back in raster order


class Qwen2_5_VLModel(Qwen2VLModel):
    vision_cls = Qwen2_5VisionTransformer
