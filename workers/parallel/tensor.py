"""Megatron-style parallel layers over a ``torch.distributed`` group (NCCL on CUDA, gloo on CPU).

A column-parallel projection is a plain ``nn.Linear`` holding its rank's output rows (its input is replicated, so
it needs no communication); a row-parallel one holds its rank's input columns and all-reduces the partial sums,
adding the bias once after the reduction. The embedding and the LM head split the vocabulary: each rank embeds
the ids in its range (zeros elsewhere, then an all-reduce) and computes its range's logits (then an all-gather).
Usage::

    tp = TPGroup.world()
    layer.o_proj = RowParallelLinear.from_linear(layer.o_proj, tp)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, over ``group`` (None: the world)."""

    rank: int
    size: int
    group: Any = None

    @classmethod
    def world(cls) -> TPGroup:
        """The default process group, already initialised (``dist.init_process_group``)."""
        return cls(dist.get_rank(), dist.get_world_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` joined along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``n`` items split evenly; ``n`` must divide by the size."""
        if n % self.size:
            raise ValueError(f"{n} does not split across {self.size} ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


def column_slice(linear: nn.Linear, start: int, end: int) -> nn.Linear:
    """A new ``nn.Linear`` with output rows ``[start, end)`` of ``linear`` (its bias sliced alike); on the meta
    device it holds no data, and ``tp_slices`` tells the shard loader what to read."""
    out = nn.Linear(linear.in_features, end - start, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:end])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:end])
    out.tp_slices = {"weight": (0, start, end), "bias": (0, start, end)}
    return out


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W[:, cols].T) + b``: the input arrives split by columns (heads, MLP channels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, start: int, end: int) -> RowParallelLinear:
        """Input columns ``[start, end)`` of ``linear`` (the bias whole)."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        out = cls(linear.weight.detach()[:, start:end].clone(), bias, tp)
        out.tp_slices = {"weight": (1, start, end)}
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + per_rank)`` of the embedding table (zero rows pad the last rank's range)."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, embedding.num_embeddings
        self.start, self.weight = _vocab_rows(embedding.weight, tp)
        self.tp_slices = {"weight": (0, self.start, self.start + self.weight.shape[0])}  # past the vocab: zeros

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabParallelHead(nn.Module):
    """The LM head's rows for this rank's vocabulary range; ``forward`` returns every rank's logits joined."""

    def __init__(self, head: nn.Linear, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, head.out_features
        self.start, self.weight = _vocab_rows(head.weight, tp)
        self.tp_slices = {"weight": (0, self.start, self.start + self.weight.shape[0])}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., :self.vocab_size]


def _vocab_rows(weight: torch.Tensor, tp: TPGroup) -> tuple[int, nn.Parameter]:
    vocab = weight.shape[0]
    per = -(-vocab // tp.size)
    start = tp.rank * per
    rows = torch.zeros(per, weight.shape[1], dtype=weight.dtype, device=weight.device)
    taken = weight.detach()[start:start + per]
    rows[:taken.shape[0]] = taken
    return start, nn.Parameter(rows, requires_grad=False)
