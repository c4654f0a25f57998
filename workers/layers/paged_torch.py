"""The torch path of `paged_attention`: CPU steps, and CUDA steps that neither kernel takes.

Per step, a plan (built by the first layer, reused by the rest) says which cache blocks to gather and which query
rows attend to them:
- tiles: the sequences of a step that have the same query length (all decodes, say) gather their blocks into one
  padded batch and run one masked SDPA;
- shared prefixes (cascade attention, CPU only): sequences whose block tables start with the same blocks (prefix
  caching hands them the same physical blocks, e.g. one image asked several questions) gather those blocks once,
  and all of their queries attend to them in one call. Each sequence's tile then covers only its own remaining
  blocks, and the two partial results are merged exactly by their log-sum-exps (DESIGN §4).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vlmq.kernels.reference import merge_attn_states

if TYPE_CHECKING:
    from vlmq.workers.layers.attention import AttentionMetadata

# The torch path copies each batch's K/V blocks into one padded tensor, and splits a batch to keep that copy
# under these sizes. On CPU the copy is most of the cost: a small one stays in cache and in malloc's reusable heap
# (allocations over ~32 MiB are fresh mmaps that page-fault on every call). Measured on a 30M Qwen2-VL, 32
# decodes of ~500 tokens: 0.5-2 MiB tiles ran the step about 2x faster than one 50 MiB batch. On CUDA (mixed
# steps without flash-attn) only memory matters.
_MAX_GATHER_BYTES = {"cpu": 2 * 2**20, "cuda": 256 * 2**20}

# A shared prefix saves (sequences - 1) x its length in gathered (and attended) key tokens, and costs a call of its
# own plus an LSE merge; it runs when the saving exceeds this cost, in tokens. Measured on the 30 M shape (4 KV
# heads x 64, fp32, one thread, old and new plans back to back): pairs of decodes broke even at ~300 shared tokens,
# groups of six at ~64-96; 8 groups of 6 on ~1,750 tokens ran a decode step's attention ~3x faster. Wider KV heads
# make gathers dearer, so this errs high for larger models. None: no cascade on that device (CUDA steps come here
# only without the kernels, and keep the plain tiles).
_SHARED_PREFIX_COST: dict[str, int | None] = {"cpu": 384}


@dataclass(slots=True)
class _Tile:
    """Sequences of one query length that run as one padded, masked SDPA (the same in every layer of a step)."""

    rows: torch.Tensor  # [B * Q] rows of their queries in the flattened batch
    block_ids: torch.Tensor  # [B * nb] cache blocks to gather, nb blocks each (padding points at block 0, masked)
    # [B, 1, Q, nb * block_size]: query r of sequence b sees gathered key j iff j <= ctx_b - skip_b - Q + r, where
    # skip_b is the tokens its shared prefix covers. Bool (True = visible), or, in a merge tile, additive (0 / -inf)
    # in q's dtype, as the LSE-returning kernel wants.
    mask: torch.Tensor
    batch: int
    q_len: int
    # a merge tile (its sequences start after a shared prefix): [B * Q] where its rows sit in TorchPlan.prefix_rows,
    # to merge with the prefix part by log-sum-exp
    prefix_pos: torch.Tensor | None = None


@dataclass(slots=True)
class _Prefix:
    """Leading blocks that a group of sequences shares; every query of the group sees all of their keys."""

    block_ids: torch.Tensor  # [nb] the shared blocks
    num_rows: int  # the group's queries: the next num_rows of TorchPlan.prefix_rows


@dataclass(slots=True)
class TorchPlan:
    prefixes: list[_Prefix]  # run first, one call each
    prefix_rows: torch.Tensor  # [R] rows of the queries of every group's sequences, group after group
    tiles: list[_Tile]


def torch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if meta.torch_plan is None:
        meta.torch_plan = _plan(meta, q, k_cache)
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    prefix_out, prefix_lse = _attend_prefixes(q, k_cache, v_cache, meta.torch_plan, scale)
    for t in meta.torch_plan.tiles:
        k, v = _gather(k_cache, t.block_ids, t.batch), _gather(v_cache, t.block_ids, t.batch)
        qt = q.index_select(0, t.rows).view(t.batch, t.q_len, *q.shape[1:]).transpose(1, 2)  # [B, H, Q, D]
        if t.prefix_pos is not None:
            res, lse = _sdpa_lse(qt, k, v, t.mask, scale)
            res, lse = res.transpose(1, 2).flatten(0, 1), lse.transpose(1, 2).flatten(0, 1)  # [B*Q, H, D], [B*Q, H]
            # out = (e^lse_p out_p + e^lse out) / (e^lse_p + e^lse): softmax over prefix and tile keys together
            res, _ = merge_attn_states(prefix_out.index_select(0, t.prefix_pos),
                                       prefix_lse.index_select(0, t.prefix_pos), res, lse)
            out.index_copy_(0, t.rows, res)
            continue
        # enable_gqa: query head h reads KV head h // (H / Hkv) without repeating K/V
        res = F.scaled_dot_product_attention(qt, k, v, attn_mask=t.mask, scale=scale,
                                             enable_gqa=q.shape[1] != num_kv_heads)
        out.index_copy_(0, t.rows, res.transpose(1, 2).flatten(0, 1))
    return out


def _attend_prefixes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchPlan,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Each group's queries, as one batch of rows, over its shared keys (all visible: no mask) -> out [R, H, D] and
    # lse [R, H] float32 of that part, at the rows of plan.prefix_rows
    if not plan.prefixes:
        return q[:0], q.new_empty(0, q.shape[1], dtype=torch.float32)
    queries = q.index_select(0, plan.prefix_rows).transpose(0, 1)[None]  # [1, H, R, D]
    outs, lses = [], []
    start = 0
    for p in plan.prefixes:
        k, v = _gather(k_cache, p.block_ids, 1), _gather(v_cache, p.block_ids, 1)  # [1, Hkv, L, D]
        res, lse = _sdpa_lse(queries[:, :, start:start + p.num_rows], k, v, None, scale)
        outs.append(res)
        lses.append(lse)
        start += p.num_rows
    return torch.cat(outs, dim=2)[0].transpose(0, 1), torch.cat(lses, dim=2)[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, batch: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D] -> [batch, Hkv, L, D]; index_select copies whole blocks (contiguous
    # rows), much faster on CPU than advanced indexing
    return cache.index_select(0, block_ids).view(batch, -1, *cache.shape[2:]).transpose(1, 2)


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [B, H, M, D]; k, v: [B, Hkv, L, D], query head h reading KV head h // (H / Hkv); mask: [B, 1, M, L]
    # additive in q's dtype, or None -> out [B, H, M, D], lse [B, H, M] float32. The CPU flash-attention kernel
    # that F.scaled_dot_product_attention runs on CPU; called directly (a private op, torch >= 2.3) because it
    # also returns the log-sum-exp.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out, lse.float()


def _gather_cap(q: torch.Tensor) -> int:
    return _MAX_GATHER_BYTES.get(q.device.type, _MAX_GATHER_BYTES["cuda"])


def _plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> TorchPlan:
    skip = [0] * len(meta.query_lens)  # leading blocks of each sequence that its group's prefix covers
    prefix_starts = [0] * len(meta.query_lens)  # where a grouped sequence's queries start in prefix_rows
    prefixes, members, num_rows = [], [], 0
    cost = _SHARED_PREFIX_COST.get(q.device.type)
    if cost is not None:
        # only blocks cached before this step can be shared: then every query of the group sees all their keys
        cached = [(c - n) // meta.block_size for c, n in zip(meta.context_lens, meta.query_lens, strict=True)]
        tables = meta.block_tables.tolist()
        for seqs, num_blocks in _shared_prefix_groups(tables, cached, cost / meta.block_size):
            for i in seqs:
                skip[i], prefix_starts[i] = num_blocks, num_rows
                num_rows += meta.query_lens[i]
            prefixes.append(_Prefix(meta.block_tables[seqs[0], :num_blocks].long(),
                                    num_rows=sum(meta.query_lens[i] for i in seqs)))
            members += seqs
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K and V of one cached token
    tiles = _plan_tiles(meta, skip, prefix_starts, token_bytes, _gather_cap(q), q.dtype)
    return TorchPlan(prefixes, _query_rows(meta, members), tiles)


def _query_rows(meta: AttentionMetadata, seqs: list[int], starts: list[int] | None = None) -> torch.Tensor:
    # rows of the queries of seqs, in that order, in the flattened batch (or from the given starts)
    if starts is None:
        starts = list(itertools.accumulate(meta.query_lens, initial=0))
    rows = [r for i in seqs for r in range(starts[i], starts[i] + meta.query_lens[i])]
    return torch.tensor(rows, dtype=torch.long, device=meta.block_tables.device)


def _shared_prefix_groups(tables: list[list[int]], cached: list[int], cost: float) -> list[tuple[list[int], int]]:
    # Groups of two or more sequences whose tables start with the same blocks (within each one's `cached` leading
    # blocks), and how many blocks each group shares; cost: of a group, in blocks. A sequence joins at most one.
    return _best_groups(list(range(len(tables))), 0, tables, cached, cost)[1]


def _best_groups(seqs: list[int], depth: int, tables: list[list[int]], cached: list[int],
                 cost: float) -> tuple[float, list[tuple[list[int], int]]]:
    # A walk down the prefix tree of the block tables; seqs share their first `depth` blocks. At each branch point
    # either the whole group shares its common blocks, or its branches share their longer prefixes separately,
    # whichever gains more: a group of n sharing d blocks gains (n - 1) * d block gathers, less its cost. Returns
    # (gain, groups).
    if len(seqs) < 2:
        return 0.0, []
    while all(cached[i] > depth for i in seqs) and len({tables[i][depth] for i in seqs}) == 1:
        depth += 1
    branches: dict[int, list[int]] = {}
    for i in seqs:
        if cached[i] > depth:
            branches.setdefault(tables[i][depth], []).append(i)
    gain, groups = 0.0, []
    for branch in branches.values():
        branch_gain, branch_groups = _best_groups(branch, depth + 1, tables, cached, cost)
        gain, groups = gain + branch_gain, groups + branch_groups
    here = (len(seqs) - 1) * depth - cost
    if here > 0 and here >= gain:
        return here, [(seqs, depth)]
    return gain, groups


def _plan_tiles(meta: AttentionMetadata, skip: list[int], prefix_starts: list[int], token_bytes: int, cap: int,
                dtype: torch.dtype) -> list[_Tile]:
    # Sequences with the same query length run batched: all decodes (length 1) together, and prefill chunks of
    # equal length together. Grouping by length pads only the keys, never the queries, so a 512-token chunk
    # next to 31 decodes does not turn them into 32 x 512 query rows. Within a group, sequences sorted by
    # key length are cut into tiles of similar lengths (little key padding) under _MAX_GATHER_BYTES. Sequences
    # after a shared prefix gather only their own blocks, in tiles of their own (they merge by LSE).
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, q_len in enumerate(meta.query_lens):
        groups.setdefault((q_len, skip[i] > 0), []).append(i)
    key_lens = [c - s * meta.block_size for c, s in zip(meta.context_lens, skip, strict=True)]
    tiles = []
    for (q_len, merge), seqs in groups.items():
        by_length = sorted(seqs, key=key_lens.__getitem__)
        for part in _split_by_gather_size(by_length, key_lens, token_bytes, cap):
            tile = _tile(meta, part, q_len, skip, key_lens)
            if merge:
                tile.mask = _additive(tile.mask, dtype)  # as the LSE kernel wants it
                tile.prefix_pos = _query_rows(meta, part, prefix_starts)
            tiles.append(tile)
    return tiles


def _tile(meta: AttentionMetadata, part: list[int], q_len: int, skip: list[int], key_lens: list[int]) -> _Tile:
    device = meta.block_tables.device
    lens = torch.tensor([key_lens[i] for i in part], device=device)
    num_blocks = -(-max(key_lens[i] for i in part) // meta.block_size)
    # blocks skip_b .. skip_b + num_blocks - 1 of each table (clamped: past a table's end they are padding, masked)
    cols = torch.tensor([skip[i] for i in part], device=device)[:, None] + torch.arange(num_blocks, device=device)
    tables = meta.block_tables[torch.tensor(part, device=device)]
    block_ids = tables.gather(1, cols.clamp(max=tables.shape[1] - 1)).long().reshape(-1)
    keys = torch.arange(num_blocks * meta.block_size, device=device)
    last = (lens - q_len)[:, None] + torch.arange(q_len, device=device)  # [B, Q] last visible key
    mask = (keys[None, None, :] <= last[:, :, None])[:, None]
    return _Tile(_query_rows(meta, part), block_ids, mask, len(part), q_len)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # bool mask (True = visible) -> 0 / -inf in dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


def _split_by_gather_size(seqs: list[int], key_lens: list[int], token_bytes: int, cap: int) -> list[list[int]]:
    # Consecutive runs of sequences whose padded K/V copy (run length x its longest key length) stays under the cap;
    # a sequence longer than the cap runs alone.
    parts: list[list[int]] = []
    longest = 0
    for i in seqs:
        longest = max(longest, key_lens[i])
        if parts and (len(parts[-1]) + 1) * longest * token_bytes <= cap:
            parts[-1].append(i)
        else:
            parts.append([i])
            longest = key_lens[i]
    return parts
