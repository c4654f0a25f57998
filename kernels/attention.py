"""Validating wrappers for decode attention: LSE merge, paged split-KV decode, shared-prefix decode.

Each picks the Triton kernel for CUDA tensors and the plain-torch reference
otherwise; ``impl="triton"`` / ``"torch"`` forces one (Triton on CPU tensors
needs TRITON_INTERPRET=1). All log-sum-exps are float32 in natural-log units.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Tensor,
    check,
    check_block_tables,
    check_last_contiguous,
    check_lens_fit,
    check_paged_cache,
    check_shape,
    check_tensor,
    pick_num_splits,
    use_triton,
)

SPLIT_ALIGN = 64  # split boundaries fall on KV-tile boundaries of the Triton kernel


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                      impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Merge two attention results over disjoint KV sets A and B (exactly attention over A ∪ B).

    Parameters
    ----------
    out_a, out_b : Tensor
        [num_tokens, num_heads, head_dim], float16 / bfloat16 / float32, same dtype.
    lse_a, lse_b : Tensor
        [num_tokens, num_heads], float32, natural-log log-sum-exp of the scaled scores.
        -inf marks an empty KV set (its output is ignored).
    impl : str
        "auto", "triton" or "torch".

    Returns
    -------
    out : Tensor
        [num_tokens, num_heads, head_dim], dtype of out_a (zeros where both sides are empty).
    lse : Tensor
        [num_tokens, num_heads], float32 (-inf where both sides are empty).
    """
    check_tensor("out_a", out_a, 3, FLOAT_DTYPES, out_a.device)
    check_tensor("out_b", out_b, 3, (out_a.dtype,), out_a.device)
    check_shape("out_b", out_b, tuple(out_a.shape))
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, x, 2, (torch.float32,), out_a.device)
        check_shape(name, x, tuple(out_a.shape[:2]))
    for name, x in (("out_a", out_a), ("out_b", out_b)):
        check_last_contiguous(name, x)
    if not use_triton(impl, out_a):
        out, lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
        return out, lse.float()
    from . import _triton_attn

    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
    if out.numel():
        _triton_attn.merge_pair(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


def _check_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor) -> None:
    check_paged_cache(q, k_cache, v_cache)
    check_block_tables(block_tables, context_lens, q.shape[0], q.device)
    check_lens_fit(context_lens, block_tables, k_cache.shape[1], "context_lens")


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, *, scale: float | None = None, num_splits: int | None = None,
                           max_context_len: int | None = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """One new query token per sequence over its paged KV (flash-decoding: split along KV, LSE-merged).

    Parameters
    ----------
    q : Tensor
        [num_seqs, num_heads, head_dim], float16 / bfloat16 / float32, unit stride on head_dim.
    k_cache, v_cache : Tensor
        [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; num_heads % num_kv_heads == 0.
    block_tables : Tensor
        [num_seqs, max_blocks_per_seq], int32 / int64: block ids of each sequence, in order.
    context_lens : Tensor
        [num_seqs], int32 / int64: KV tokens of each sequence (0 allowed: out 0, lse -inf).
    scale : float, optional
        Softmax scale; default head_dim ** -0.5.
    num_splits : int, optional
        KV splits per sequence; default fills the device.
    max_context_len : int, optional
        Host-side max(context_lens); pass it to avoid a device sync.
    impl : str
        "auto", "triton" or "torch".

    Returns
    -------
    out : Tensor
        [num_seqs, num_heads, head_dim], q's dtype.
    lse : Tensor
        [num_seqs, num_heads], float32.
    """
    _check_paged(q, k_cache, v_cache, block_tables, context_lens)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if not use_triton(impl, q):
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale)
    max_len = int(context_lens.max()) if max_context_len is None and q.shape[0] else (max_context_len or 0)
    indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _split_attention(q, k_cache, v_cache, block_tables, indptr, None, context_lens,
                            max_len=max_len, max_group_size=1, num_splits=num_splits, scale=scale, out_dtype=q.dtype)


@dataclass(slots=True, frozen=True)
class CascadePlan:
    """Host-side sizes of one cascade batch; build once per engine step, reuse for every layer."""

    max_prefix_len: int  # max(prefix_lens)
    max_suffix_len: int  # max(context_lens[i] - prefix length of i's group)
    max_group_size: int  # max sequences sharing one prefix

    @classmethod
    def from_lens(cls, context_lens: Tensor, group_indptr: Tensor, prefix_lens: Tensor) -> CascadePlan:
        """Compute the plan (a device sync when the tensors live on a GPU)."""
        ctx, indptr, pre = (x.detach().cpu().long() for x in (context_lens, group_indptr, prefix_lens))
        sizes = indptr[1:] - indptr[:-1]
        suffix = ctx - torch.repeat_interleave(pre, sizes)
        return cls(_max(pre), _max(suffix), _max(sizes))


def _max(x: Tensor) -> int:
    return int(x.max()) if x.numel() else 0


def cascade_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                             context_lens: Tensor, group_indptr: Tensor, prefix_lens: Tensor, *,
                             scale: float | None = None, num_splits: int | None = None,
                             plan: CascadePlan | None = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Decode attention where groups of sequences share a KV prefix; the prefix is read once per group.

    Sequences group_indptr[g] .. group_indptr[g+1]-1 (contiguous rows of q) share their
    first prefix_lens[g] KV tokens: for those positions every block table of the group
    must resolve to identical KV (normally the same block ids; a partly shared last
    block copied on write must hold the same prefix tokens). The prefix is read through
    the group's first block table with all of the group's queries at once; each
    sequence's suffix [prefix_lens[g], context_lens[i]) is paged decode; the two are
    merged by :func:`merge_attn_states`. The result equals attention over the whole
    context. A group of one, or prefix_lens[g] = 0, is plain decode.

    Parameters
    ----------
    q, k_cache, v_cache, block_tables, context_lens : Tensor
        As in :func:`paged_decode_attention`.
    group_indptr : Tensor
        [num_groups + 1], int32 / int64, non-decreasing, 0 first and num_seqs last.
    prefix_lens : Tensor
        [num_groups], int32 / int64; prefix_lens[g] <= context_lens[i] for every i in g.
    scale : float, optional
        Softmax scale; default head_dim ** -0.5.
    num_splits : int, optional
        KV splits for both parts; default fills the device.
    plan : CascadePlan, optional
        Host-side maxima; computed (with a device sync) when omitted.
    impl : str
        "auto", "triton" or "torch".

    Returns
    -------
    out : Tensor
        [num_seqs, num_heads, head_dim], q's dtype.
    lse : Tensor
        [num_seqs, num_heads], float32.
    """
    _check_paged(q, k_cache, v_cache, block_tables, context_lens)
    check_tensor("group_indptr", group_indptr, 1, INDEX_DTYPES, q.device)
    check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES, q.device)
    check_shape("prefix_lens", prefix_lens, (group_indptr.shape[0] - 1,))
    _check_groups(group_indptr, prefix_lens, context_lens)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if not use_triton(impl, q):
        out, lse = reference.cascade_decode_attention(q.float(), k_cache, v_cache, block_tables, context_lens,
                                                      group_indptr, prefix_lens, scale=scale)
        return out.to(q.dtype), lse.float()
    plan = plan or CascadePlan.from_lens(context_lens, group_indptr, prefix_lens)
    seq_prefix = torch.repeat_interleave(prefix_lens, (group_indptr[1:] - group_indptr[:-1]).long(),
                                         output_size=q.shape[0])
    out_p, lse_p = _split_attention(q, k_cache, v_cache, block_tables, group_indptr, None, prefix_lens,
                                    max_len=plan.max_prefix_len, max_group_size=plan.max_group_size,
                                    num_splits=num_splits, scale=scale, out_dtype=torch.float32)
    indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    out_s, lse_s = _split_attention(q, k_cache, v_cache, block_tables, indptr, seq_prefix, context_lens,
                                    max_len=plan.max_suffix_len, max_group_size=1,
                                    num_splits=num_splits, scale=scale, out_dtype=torch.float32)
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s, impl="triton")
    return out.to(q.dtype), lse


def _check_groups(group_indptr: Tensor, prefix_lens: Tensor, context_lens: Tensor) -> None:
    """Value checks, on CPU tensors only (a GPU check would sync the device)."""
    check(group_indptr.shape[0] >= 1, "group_indptr needs at least one entry")
    if group_indptr.is_cuda:
        return
    sizes = group_indptr[1:] - group_indptr[:-1]
    check(int(group_indptr[0]) == 0 and int(group_indptr[-1]) == context_lens.shape[0],
          f"group_indptr must run from 0 to num_seqs={context_lens.shape[0]}")
    check(bool((sizes >= 0).all()), "group_indptr must be non-decreasing")
    seq_prefix = torch.repeat_interleave(prefix_lens.long(), sizes.long())
    check(bool(((seq_prefix >= 0) & (seq_prefix <= context_lens.long())).all()),
          "prefix_lens[g] must lie in [0, context_lens[i]] for every sequence i of group g")


def _split_attention(q, k_cache, v_cache, block_tables, indptr, kv_starts, kv_ends, *,
                     max_len, max_group_size, num_splits, scale, out_dtype):
    from . import _triton_attn

    num_groups = indptr.shape[0] - 1
    num_tokens, num_heads, head_dim = q.shape
    if num_splits is None:
        num_splits = pick_num_splits(num_groups * k_cache.shape[2], max_len, q.device)
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    tokens_per_split = -(-max(max_len, 1) // num_splits)
    tokens_per_split = -(-tokens_per_split // SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = -(-max(max_len, 1) // tokens_per_split)
    parts = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    _triton_attn.group_attention(q, k_cache, v_cache, block_tables, indptr, kv_starts, kv_ends, parts, part_lse,
                                 scale=scale, tokens_per_split=tokens_per_split,
                                 max_group_size=max(1, max_group_size))
    _triton_attn.merge_splits(parts, part_lse, out, lse)
    return out, lse
