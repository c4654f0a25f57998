"""Rotary embeddings: M-RoPE for the LM (three position axes) and the 2D (h, w) rotary of the vision tower."""

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] broadcast over heads
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def inv_frequencies(dim: int, theta: float) -> torch.Tensor:
    # inv_freq[i] = theta^(-2i/dim), i < dim/2 (same float32 expression as the reference)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


class MRotaryEmbedding(nn.Module):
    """M-RoPE: the D/2 rotary frequencies are split into sections [t, h, w]; section i takes its angle from
    position axis i. Text tokens carry equal positions on all three axes, so for them it is plain RoPE."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        # plain attributes (not buffers), built on the CPU so a model constructed on the meta device keeps them
        self.inv_freq = inv_frequencies(head_dim, theta)
        self.axis = torch.cat([torch.full((n,), i % 3, device="cpu") for i, n in enumerate(mrope_section)]).long()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, T] -> cos, sin: [T, D] in `dtype`
        if positions.ndim == 1:
            positions = positions.expand(3, -1)
        if self.inv_freq.device != positions.device:
            self.inv_freq, self.axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        index = self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        freqs = freqs.gather(0, index)[0]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2D rotary: a quarter of the head dim rotates with the patch row, a quarter with the column,
    and the pattern is repeated over the second half (rotate_half pairs i with i + D/2)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.inv_freq = inv_frequencies(head_dim // 2, theta)

    def forward(self, pos_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos_hw: [N, 2] (row, col) -> cos, sin: [N, D] float32
        self.inv_freq = self.inv_freq.to(pos_hw.device)
        freqs = (pos_hw[..., None].float() * self.inv_freq).flatten(1)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def vision_patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch in the order the processor emits them: merge×merge blocks row-major, patches
    row-major inside a block, frames repeated. grid_thw: [N, 3] -> [sum t*h*w, 2] long."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)
