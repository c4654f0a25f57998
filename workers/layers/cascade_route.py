"""CUDA decode steps whose sequences share an image prefix: route them to the Triton cascade kernel.

The grouping is the CPU path's (`paged_torch._shared_prefix_groups`): sequences whose block tables start with the
same cached blocks (prefix caching hands them the same physical blocks: one image, several questions) form a
group when the gathers it saves outweigh `cost` tokens. The kernel wants each group's rows adjacent, so the step's
decode rows are permuted (grouped sequences group after group, then the rest as groups of one with no prefix),
attended, and put back in step order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlmq.kernels import CascadePlan, cascade_decode_attention
from vlmq.workers.layers.paged_torch import _shared_prefix_groups

if TYPE_CHECKING:
    from vlmq.workers.layers.attention import AttentionMetadata

# A group runs the prefix pass when (members - 1) x shared tokens exceeds this. Not measured on a GPU yet: the
# cascade kernel costs one extra launch and an LSE merge; scripts/bench_kernels_gpu.py's cascade table sets it.
CUDA_SHARED_PREFIX_COST = 256


@dataclass(frozen=True, slots=True)
class CascadeLayout:
    """Host-side layout of a cascade decode batch (pure; `route_decode` builds it)."""

    order: list[int]  # row i of the cascade batch is sequence order[i] of the step
    group_sizes: list[int]  # consecutive rows per group; a sequence outside every group is a group of one
    prefix_lens: list[int]  # shared KV tokens of each group (0 for a group of one)


def route_decode(context_lens: list[int], block_tables: list[list[int]], block_size: int,
                 cost: float = CUDA_SHARED_PREFIX_COST) -> CascadeLayout | None:
    """The cascade layout of a decode-only step, or None when no group pays for its prefix pass."""
    cached = [(c - 1) // block_size for c in context_lens]  # blocks written before this step's token
    groups = _shared_prefix_groups(block_tables, cached, cost / block_size)
    if not groups:
        return None
    grouped = {i for seqs, _ in groups for i in seqs}
    rest = [i for i in range(len(context_lens)) if i not in grouped]
    return CascadeLayout(order=[i for seqs, _ in groups for i in seqs] + rest,
                         group_sizes=[len(seqs) for seqs, _ in groups] + [1] * len(rest),
                         prefix_lens=[n * block_size for _, n in groups] + [0] * len(rest))


@dataclass(slots=True)
class CascadeRoute:
    """Device tensors of a layout, built once per step and shared by every layer."""

    order: torch.Tensor  # [S] long
    inverse: torch.Tensor  # [S] long: sequence j of the step sits at row inverse[j]
    block_tables: torch.Tensor  # [S, max_blocks] int32, rows in cascade order
    context_lens: torch.Tensor  # [S] int32, cascade order
    group_indptr: torch.Tensor  # [G + 1] int32
    prefix_lens: torch.Tensor  # [G] int32
    plan: CascadePlan  # host maxima: no device sync per layer


def build_route(meta: AttentionMetadata, layout: CascadeLayout) -> CascadeRoute:
    device = meta.block_tables.device
    order = torch.tensor(layout.order, dtype=torch.long, device=device)
    ctx = [meta.context_lens[i] for i in layout.order]
    indptr = [0]
    for size in layout.group_sizes:
        indptr.append(indptr[-1] + size)
    suffix = [c - p for g, p in enumerate(layout.prefix_lens) for c in ctx[indptr[g]:indptr[g + 1]]]
    plan = CascadePlan(max(layout.prefix_lens), max(suffix), max(layout.group_sizes))

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return CascadeRoute(order, torch.argsort(order), meta.block_tables.index_select(0, order).contiguous(),
                        i32(ctx), i32(indptr), i32(layout.prefix_lens), plan)


def route_for(meta: AttentionMetadata) -> CascadeRoute | None:
    """The step's route, built by the first layer and cached on the metadata (False: no group pays). Reads the
    host block tables: no device sync (DecodeGraphs.run calls it before every replay)."""
    if meta.cascade is None:
        assert meta.host_block_tables is not None, "routing needs AttentionMetadata.build's host block tables"
        layout = route_decode(meta.context_lens, meta.host_block_tables, meta.block_size)
        meta.cascade = build_route(meta, layout) if layout is not None else False
    return meta.cascade or None


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, route: CascadeRoute,
                      scale: float, impl: str = "auto") -> torch.Tensor:
    """q: [S, H, D] in step order -> [S, H, D]; the cascade kernel on rows in cascade order."""
    out, _ = cascade_decode_attention(q.index_select(0, route.order), k_cache, v_cache, route.block_tables,
                                      route.context_lens, route.group_indptr, route.prefix_lens, scale=scale,
                                      plan=route.plan, impl=impl)
    return out.index_select(0, route.inverse)
