"""The torch path of `paged_attention`: CPU steps, and CUDA steps that neither kernel takes.

Per step, a plan (built by the first layer, reused by the rest) says which cache blocks to gather and which query
rows attend to them: the sequences of a step that have the same query length (all decodes, say) gather their
blocks into one padded batch and run one masked SDPA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vlmq.workers.layers.attention import AttentionMetadata

# The torch path copies each batch's K/V blocks into one padded tensor, and splits a batch to keep that copy
# under these sizes. On CPU the copy is most of the cost: a small one stays in cache and in malloc's reusable heap
# (allocations over ~32 MiB are fresh mmaps that page-fault on every call). Measured on a 30M Qwen2-VL, 32
# decodes of ~500 tokens: 0.5-2 MiB tiles ran the step about 2x faster than one 50 MiB batch. On CUDA (mixed
# steps without flash-attn) only memory matters.
_MAX_GATHER_BYTES = {"cpu": 2 * 2**20, "cuda": 256 * 2**20}


@dataclass(slots=True)
class _Tile:
    """Sequences of one query length that run as one padded, masked SDPA (the same in every layer of a step)."""

    rows: torch.Tensor  # [B * Q] rows of their queries in the flattened batch
    block_ids: torch.Tensor  # [B * nb] cache blocks to gather, nb blocks each (padding points at block 0, masked)
    mask: torch.Tensor  # [B, 1, Q, nb * block_size]: query r of sequence b sees keys j <= ctx_b - Q + r
    batch: int
    q_len: int


def torch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if meta.torch_tiles is None:
        token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K and V of one cached token
        meta.torch_tiles = _plan_tiles(meta, token_bytes, _gather_cap(q), q.device)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    for t in meta.torch_tiles:
        # index_select copies whole blocks (contiguous rows); much faster on CPU than advanced indexing
        k = k_cache.index_select(0, t.block_ids).view(t.batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, t.block_ids).view(t.batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        qt = q.index_select(0, t.rows).view(t.batch, t.q_len, *q.shape[1:]).transpose(1, 2)  # [B, H, Q, D]
        # enable_gqa: query head h reads KV head h // (H / Hkv) without repeating K/V
        res = F.scaled_dot_product_attention(qt, k, v, attn_mask=t.mask, scale=scale,
                                             enable_gqa=q.shape[1] != num_kv_heads)
        out.index_copy_(0, t.rows, res.transpose(1, 2).flatten(0, 1))
    return out


def _gather_cap(q: torch.Tensor) -> int:
    return _MAX_GATHER_BYTES.get(q.device.type, _MAX_GATHER_BYTES["cuda"])


def _plan_tiles(meta: AttentionMetadata, token_bytes: int, cap: int, device: torch.device) -> list[_Tile]:
    # Sequences with the same query length run batched: all decodes (length 1) together, and prefill chunks of
    # equal length together. Grouping by length pads only the keys, never the queries, so a 512-token chunk
    # next to 31 decodes does not turn them into 32 x 512 query rows. Within a group, sequences sorted by
    # context length are cut into tiles of similar lengths (little key padding) under _MAX_GATHER_BYTES.
    groups: dict[int, list[int]] = {}
    for i, q_len in enumerate(meta.query_lens):
        groups.setdefault(q_len, []).append(i)
    starts = [0, *itertools.accumulate(meta.query_lens)]
    tiles = []
    for q_len, seqs in groups.items():
        by_length = sorted(seqs, key=meta.context_lens.__getitem__)
        for part in _split_by_gather_size(by_length, meta.context_lens, token_bytes, cap):
            arange_q = torch.arange(q_len, device=device)
            rows = (torch.tensor([starts[i] for i in part], device=device)[:, None] + arange_q).view(-1)
            ctx = torch.tensor([meta.context_lens[i] for i in part], device=device)
            num_blocks = -(-int(ctx.max()) // meta.block_size)
            block_ids = meta.block_tables[torch.tensor(part, device=device), :num_blocks].long().reshape(-1)
            keys = torch.arange(num_blocks * meta.block_size, device=device)
            last = (ctx - q_len)[:, None] + arange_q  # [B, Q] last visible key
            mask = (keys[None, None, :] <= last[:, :, None])[:, None]
            tiles.append(_Tile(rows, block_ids, mask, len(part), q_len))
    return tiles


def _split_by_gather_size(seqs: list[int], context_lens: list[int], token_bytes: int, cap: int) -> list[list[int]]:
    # Consecutive runs of sequences whose padded K/V copy (run length x its longest context) stays under the cap;
    # a sequence longer than the cap runs alone.
    parts: list[list[int]] = []
    longest = 0
    for i in seqs:
        longest = max(longest, context_lens[i])
        if parts and (len(parts[-1]) + 1) * longest * token_bytes <= cap:
            parts[-1].append(i)
        else:
            parts.append([i])
            longest = context_lens[i]
    return parts
