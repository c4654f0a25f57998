"""Qwen2-VL on a paged KV cache: vision tower (packed images), M-RoPE positions and the language model.

Parameter names follow the Hugging Face checkpoints (`visual.*`, `language_model.*`, `lm_head.*`) so the
loader maps keys without renaming layers. transformers' `modeling_qwen2_vl` is the numerical reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmq.workers.layers.attention import AttentionMetadata, Segments, paged_attention
from vlmq.workers.layers.mlp import GatedMLP, PlainMLP
from vlmq.workers.layers.norm import RMSNorm, layer_norm
from vlmq.workers.layers.rotary import MRotaryEmbedding, VisionRotaryEmbedding, apply_rotary, vision_patch_positions
from vlmq.workers.layers.vision import PatchEmbed, PatchMerger, VisionBlock

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]


# ----------------------------------------------------------------------------------------------- positions
def get_mrope_positions(
    input_ids: torch.Tensor | list[int], image_grid_thw: torch.Tensor | None, config
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt, as transformers' `get_rope_index` computes them.

    Text tokens count up on all three axes; an image's pad tokens get (t, row, col) of their merged patch
    offset by the running position; the text after an image continues at start + max(rows, cols).
    Returns positions [3, L] long and `delta` = max position + 1 - L: decode token i (i >= L) sits at i + delta.
    """
    ids = torch.as_tensor(input_ids).view(-1).cpu()
    merge = config.vision_config.spatial_merge_size
    pos = torch.empty(3, ids.numel(), dtype=torch.long)
    image_at = (ids == config.image_token_id).nonzero().view(-1).tolist()
    grids = [] if image_grid_thw is None else torch.as_tensor(image_grid_thw).view(-1, 3).tolist()
    if len(image_at) != sum(t * h * w // merge**2 for t, h, w in grids):
        raise ValueError(f"{len(image_at)} image tokens in the prompt do not match image_grid_thw {grids}")
    i = seen = nxt = 0  # i: token index, seen: image tokens consumed, nxt: next position value
    for t, h, w in grids:
        start, n = image_at[seen], t * h * w // merge**2
        if image_at[seen + n - 1] != start + n - 1:
            raise ValueError(f"the {n} image tokens of image {t, h, w} at index {start} are not contiguous")
        pos[:, i:start] = torch.arange(nxt, nxt + start - i)
        nxt += start - i
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        pos[:, start : start + n] = torch.stack([tt, hh, ww]).view(3, -1) + nxt
        nxt += max(h, w) // merge
        i, seen = start + n, seen + n
    pos[:, i:] = torch.arange(nxt, nxt + ids.numel() - i)
    delta = int(pos.max()) + 1 - ids.numel() if ids.numel() else 0
    return pos, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions [3, count] of tokens at sequence indices start..start+count-1 after the prompt (all text)."""
    return torch.arange(start + delta, start + delta + count).expand(3, -1)


# ---------------------------------------------------------------------------------------------- vision tower
def segment_bounds(grid_thw: torch.Tensor) -> torch.Tensor:
    # one attention segment per frame: cu_seqlens [sum t + 1] int32
    lens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, self.merge = self._dim(vc), vc.spatial_merge_size
        self.patch_embed = PatchEmbed(vc.patch_size, vc.temporal_patch_size, vc.in_channels, dim)
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary_pos_emb = VisionRotaryEmbedding(dim // vc.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(dim, vc.num_heads, *self._block_parts(vc)) for _ in range(vc.depth))
        self.merger = PatchMerger(self._out_dim(vc), dim, self.merge, self._norm(dim))

    # family hooks (Qwen2.5-VL overrides them)
    def _dim(self, vc) -> int:
        return vc.embed_dim

    def _out_dim(self, vc) -> int:
        return vc.hidden_size

    def _norm(self, dim: int) -> nn.Module:
        return layer_norm(dim)

    def _block_parts(self, vc) -> tuple[nn.Module, nn.Module, nn.Module]:
        dim = vc.embed_dim
        return self._norm(dim), self._norm(dim), PlainMLP(dim, int(dim * vc.mlp_ratio), vc.hidden_act)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode many images packed in one call.

        pixel_values: [P, C*Tp*p*p] patches of all images back to back (processor layout); grid_thw: [N, 3].
        Returns [P / merge², out_dim]: the LM embeddings of every image, in order.
        """
        x = self.patch_embed(pixel_values)  # [P, E]
        cos, sin = self.rotary_pos_emb(vision_patch_positions(grid_thw, self.merge).to(x.device))
        cu_seqlens = Segments.of(segment_bounds(grid_thw).to(x.device))
        for blk in self.blocks:
            x = blk(x, cu_seqlens, cos, sin)
        return self.merger(x)


# -------------------------------------------------------------------------------------------- language model
def head_dim_of(tc) -> int:
    return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads  # Qwen3 sets it apart


class Qwen2Attention(nn.Module):
    def __init__(self, tc, qkv_bias: bool = True, out_bias: bool = False) -> None:
        super().__init__()  # Qwen2's biases by default; InternVL's Llama and Qwen3 bias otherwise
        self.num_heads, self.num_kv_heads = tc.num_attention_heads, tc.num_key_value_heads
        self.head_dim = head_dim_of(tc)
        self.q_proj = nn.Linear(tc.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(tc.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(tc.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, tc.hidden_size, bias=out_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: KVCache):
        # x: [T, hidden] -> q: [T, H, D], k, v: [T, Hkv, D]
        q = apply_rotary(self.q_proj(x).view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = Qwen2Attention  # Qwen3-VL's q/k-normed one, InternVL's Llama-biased one

    def __init__(self, tc) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(tc)
        self.mlp = GatedMLP(tc.hidden_size, tc.intermediate_size, tc.hidden_act, bias=getattr(tc, "mlp_bias", False))
        self.input_layernorm = RMSNorm(tc.hidden_size, tc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(tc.hidden_size, tc.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    # family hooks: layer_cls, rotary_cls, default_mrope_section (Qwen3-VL); _rotary (InternVL: 1-D RoPE)
    layer_cls: type[nn.Module] = DecoderLayer
    rotary_cls: type[MRotaryEmbedding] = MRotaryEmbedding
    default_mrope_section = (16, 24, 24)

    def __init__(self, tc) -> None:
        super().__init__()
        if "sliding_attention" in (getattr(tc, "layer_types", None) or []):
            raise NotImplementedError("sliding-window attention layers are not supported")
        rope = tc.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r} is not supported")
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(tc) for _ in range(tc.num_hidden_layers))
        self.norm = RMSNorm(tc.hidden_size, tc.rms_norm_eps)
        self.rotary_emb = self._rotary(tc)

    def _rotary(self, tc) -> nn.Module:
        rope = tc.rope_parameters
        section = list(rope.get("mrope_section", self.default_mrope_section))
        return self.rotary_cls(head_dim_of(tc), rope["rope_theta"], section)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]):
        # embeds: [T, hidden]; positions: [3, T] -> hidden states [T, hidden]
        cos, sin = self.rotary_emb(positions, embeds.dtype)
        x = embeds
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)


class Qwen2VLModel(nn.Module):
    """What the model runner drives: `prompt_positions` once per request, `encode_images` (packed), then
    `language_model` over a flattened step of many sequences on the paged cache, then `compute_logits` on the rows
    it samples from; `pixel_rows` and `image_counts` describe an image's input layout and cost from its grid row.
    Another family plugs in with the same methods (a 1-D family returns positions [1, L]; InternVL's pixel rows
    are tiles)."""

    vision_cls: type[nn.Module] = Qwen2VisionTransformer
    text_cls: type[nn.Module] = TextModel

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        tc = config.text_config
        self.visual = self.vision_cls(config.vision_config)
        self.language_model = self.text_cls(tc)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.num_kv_heads, self.head_dim = tc.num_key_value_heads, head_dim_of(tc)
        self.max_positions = tc.max_position_embeddings

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        """Rows of pixel_values each image occupies (its vision input layout): one per patch."""
        return grid_thw.prod(-1).tolist()

    def image_counts(self, grid_thw: torch.Tensor) -> list[tuple[int, int]]:
        """(encoder patches, LM tokens) of each image: merge² patches make one token."""
        return [(n, n // self.visual.merge**2) for n in grid_thw.prod(-1).tolist()]

    def prompt_positions(self, token_ids: list[int], grid_thw: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rotary positions of a prompt: M-RoPE [3, L] and delta (generated token i sits at i + delta).

        Raises ValueError when the prompt's image tokens do not match `grid_thw` ([N, 3], one row per image)."""
        return get_mrope_positions(token_ids, grid_thw if grid_thw.numel() else None, self.config)

    def decode_positions(self, start: int, count: int, delta: int) -> torch.Tensor:
        """Positions [3, count] of generated tokens start..start+count-1."""
        return decode_positions(start, count, delta)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: [P, patch_dim] of N images; grid_thw: [N, 3] -> N tensors [t*h*w/merge², hidden]."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        embeds = self.visual(pixel_values.to(dtype), grid_thw)
        return list(embeds.split((grid_thw.prod(-1) // self.visual.merge**2).tolist()))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, hidden] -> [T, vocab]

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None) -> list[KVCache]:
        w = self.lm_head.weight
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kw = {"dtype": dtype or w.dtype, "device": device or w.device}
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in self.language_model.layers]
