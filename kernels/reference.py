"""Plain-torch references for every kernel in this package.

They are the ground truth the Triton kernels are tested against and the CPU path of
the wrappers. Everything is computed in float32 (float64 when given float64), and
every log-sum-exp is in natural-log units. An empty KV set has ``lse = -inf`` and
an all-zero output.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor

# Largest representable magnitude per quantised dtype (symmetric int8: 127, not 128).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention over one sequence, returning the log-sum-exp as well.

    q: [num_q, num_heads, head_dim]; k, v: [num_kv, num_kv_heads, head_dim]
    (num_heads a multiple of num_kv_heads: grouped-query attention).
    ``causal`` aligns the queries with the *last* num_q keys (query i sees keys
    0 .. num_kv - num_q + i). Returns out [num_q, num_heads, head_dim] in q's dtype
    and lse [num_q, num_heads] in float32 (float64 for float64 inputs).
    """
    num_q, num_heads, head_dim = q.shape
    num_kv, num_kv_heads = k.shape[0], k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    cdt = _compute_dtype(q)
    group = num_heads // num_kv_heads
    kf = k.to(cdt).repeat_interleave(group, dim=1)
    vf = v.to(cdt).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(cdt), kf) * scale  # s: [H, num_q, num_kv]
    if causal:
        i = torch.arange(num_q, device=q.device)[:, None]
        j = torch.arange(num_kv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (num_kv - num_q), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, num_q]; -inf where nothing is visible
    p = torch.exp(s - _finite_or_zero(lse)[..., None])  # exp(-inf) = 0 on masked keys
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two attention results over disjoint KV sets A and B.

    lse = log(e^lse_a + e^lse_b); out = (e^lse_a out_a + e^lse_b out_b) / e^lse.
    out_*: [..., head_dim]; lse_*: [...]. An empty side (lse = -inf) gets weight 0;
    both empty gives out = 0, lse = -inf.
    """
    cdt = _compute_dtype(lse_a)
    lse_a, lse_b = lse_a.to(cdt), lse_b.to(cdt)
    m = _finite_or_zero(torch.maximum(lse_a, lse_b))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    out = out_a.to(cdt) * (w_a * inv)[..., None] + out_b.to(cdt) * (w_b * inv)[..., None]
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(total, float("-inf")))
    return out.to(out_a.dtype), lse


def merge_attn_states_n(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Fold :func:`merge_attn_states` over axis -2 of outs [..., S, D] / axis -1 of lses [..., S]."""
    out, lse = outs[..., 0, :], lses[..., 0]
    for i in range(1, outs.shape[-2]):
        out, lse = merge_attn_states(out, lse, outs[..., i, :], lses[..., i])
    return out, lse


def gather_kv(cache: Tensor, block_table: Tensor, start: int, end: int) -> Tensor:
    """Tokens start..end-1 of one sequence: cache [num_blocks, block_size, Hkv, D] -> [end-start, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, *, scale: float | None = None,
                           kv_starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One query token per sequence over KV positions [kv_starts[i], context_lens[i]).

    Shapes as in :func:`vlmq.kernels.paged_decode_attention`; out in q's dtype,
    lse float32.
    """
    outs, lses = [], []
    for i in range(q.shape[0]):
        start = 0 if kv_starts is None else int(kv_starts[i])
        end = int(context_lens[i])
        k = gather_kv(k_cache, block_tables[i], start, end)
        v = gather_kv(v_cache, block_tables[i], start, end)
        out, lse = attention(q[i:i + 1], k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses).float()


def cascade_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                             context_lens: Tensor, group_indptr: Tensor, prefix_lens: Tensor, *,
                             scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Shared prefix once per group, each sequence's own suffix, merged by log-sum-exp.

    Sequences group_indptr[g] .. group_indptr[g+1]-1 share their first prefix_lens[g]
    KV tokens (read through the block table of the group's first sequence).
    """
    seq_prefix = _seq_prefix_lens(group_indptr, prefix_lens)
    out_s, lse_s = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                          scale=scale, kv_starts=seq_prefix)
    out_p, lse_p = torch.empty_like(out_s), torch.empty_like(lse_s)
    for g in range(prefix_lens.shape[0]):
        lo, hi = int(group_indptr[g]), int(group_indptr[g + 1])
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[lo], 0, int(prefix_lens[g]))
        v = gather_kv(v_cache, block_tables[lo], 0, int(prefix_lens[g]))
        out_p[lo:hi], lse_p[lo:hi] = attention(q[lo:hi], k, v, scale=scale)  # all queries see all of the prefix
    return merge_attn_states(out_p, lse_p, out_s, lse_s)


def _seq_prefix_lens(group_indptr: Tensor, prefix_lens: Tensor) -> Tensor:
    sizes = (group_indptr[1:] - group_indptr[:-1]).long()
    return torch.repeat_interleave(prefix_lens.long(), sizes.to(prefix_lens.device))


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place: cache[slot // block_size, slot % block_size] = new token; slot < 0 skips the token."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = key[keep]
    v_cache[slots // block_size, slots % block_size] = value[keep]


def quantize_kv_blocks(blocks: Tensor, dtype: torch.dtype = torch.int8) -> tuple[Tensor, Tensor]:
    """Symmetric per-(block, head) quantisation: scale = amax / QMAX, q = round(x / scale).

    blocks: [num_blocks, block_size, Hkv, D] -> q (same shape, ``dtype``), scales [num_blocks, Hkv] float32.
    int8 rounds half away from zero; fp8 e4m3 rounds to nearest even (the cast).
    """
    qmax = QMAX[dtype]
    x = blocks.float()
    amax = x.abs().amax(dim=(1, 3))  # [num_blocks, Hkv]
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    y = x * inv[:, None, :, None]
    if dtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))
    q = y.clamp(-qmax, qmax).to(dtype)
    return q, amax / qmax


def dequantize_kv_blocks(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float16) -> Tensor:
    """q [num_blocks, block_size, Hkv, D], scales [num_blocks, Hkv] float32 -> blocks in ``dtype``."""
    return (q.float() * scales[:, None, :, None]).to(dtype)
