"""Vision-tower building blocks shared by the Qwen2-VL family: patch embedding, attention block, merger."""

import torch
import torch.nn.functional as F
from torch import nn

from vlmq.workers.layers.attention import Segments, varlen_attention
from vlmq.workers.layers.rotary import apply_rotary


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int,
                 bias: bool = False) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, C*Tp*p*p]; a conv with stride == kernel over one patch is a matmul with the flattened kernel
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)  # [P, E]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, seg: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, E] -> q, k, v: [N, H, D]; rotary in float32 like the reference
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = varlen_attention(q, k, v, seg, self.head_dim**-0.5)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, norm1: nn.Module, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm1, norm2
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, seg: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seg, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge×merge block of patch features (consecutive in the packed order) and project."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, ln_q: nn.Module) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = ln_q
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))  # [P, E] -> [P/merge², out_dim]
