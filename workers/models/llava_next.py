"""LLaVA-NeXT (as transformers' `modeling_llava_next` implements it) on a paged KV cache.

Vision: anyres. An image is a base tile (the whole image resized to one tile) plus the tiles of its best-fit canvas
(`image_grid_pinpoints`), all S×S, through a CLIP vision tower (pre-norm, CLS token, absolute positions); the
features of `vision_feature_layer` lose their CLS (strategy "default") and go through a two-layer projector. The
canvas tiles' features are laid out as one (rows·s)×(cols·s) map, the rows or columns that only saw padding are
cut off (`unpad`), and every remaining row ends with the learned `image_newline`; the base tile's s² features come
first. Every tile has the same shape, so the tiles of many images run as one dense batch. Language model: Llama,
Mistral or Qwen2 with plain 1-D RoPE (InternVL's text model); positions are token indices, images included.

The LM token count of an image is the SDK's price (`vlmq.families.llava_next_num_features`), not a second copy of
the rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from vlmq.families import llava_next_num_features
from vlmq.workers.models.internvl import InternVLModel
from vlmq.workers.models.internvl import TextModel as InternVLTextModel
from vlmq.workers.models.qwen2_vl import TextModel as Qwen2TextModel
from vlmq.workers.models.qwen2_vl import head_dim_of


# ---------------------------------------------------------------------------------------------- vision tower
class ClipEmbeddings(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, p = vc.hidden_size, vc.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.patch_embedding = nn.Conv2d(vc.num_channels, dim, kernel_size=p, stride=p, bias=False)
        self.position_embedding = nn.Embedding((vc.image_size // p) ** 2 + 1, dim)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        # tiles: [B, C, S, S] -> [B, 1 + (S/p)², E]
        x = self.patch_embedding(tiles).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight[: x.shape[1]]


class ClipAttention(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim, self.num_heads = vc.hidden_size, vc.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, E]; every tile attends over itself only
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class ClipMLP(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.act = ACT2FN[vc.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.self_attn, self.mlp = ClipAttention(vc), ClipMLP(vc)
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(vc) for _ in range(vc.num_hidden_layers))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer returning the hidden states LLaVA-NeXT selects (hidden state k: after k layers,
    0 is the pre-norm output); layers past the deepest selected one never run. post_layernorm is loaded, unused."""

    def __init__(self, vc, feature_layers: list[int]) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)  # sic: the checkpoints' name
        self.encoder = ClipEncoder(vc)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.selected = [k % (vc.num_hidden_layers + 1) for k in feature_layers]

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(tiles))  # [B, 1 + N, E]
        states = [x]
        for layer in self.encoder.layers[: max(self.selected)]:
            x = layer(x)
            states.append(x)
        return torch.cat([states[k] for k in self.selected], dim=-1)


class MultiModalProjector(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        width, hidden = config.vision_config.hidden_size * num_layers, config.text_config.hidden_size
        bias = config.multimodal_projector_bias
        self.linear_1 = nn.Linear(width, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def unpad(features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """features [E, H, W] of an image resized into H×W and centre-padded -> the rows or columns it covers (the
    reference's rounding: the same rule `llava_next_num_features` counts)."""
    rows, cols = features.shape[1:]
    kept, kept_rows = llava_next_num_features(height, width, rows, cols)
    kept_cols = kept // kept_rows
    top, left = (rows - kept_rows) // 2, (cols - kept_cols) // 2
    return features[:, top:top + kept_rows, left:left + kept_cols]


# -------------------------------------------------------------------------------------------- language model
class TextModel(InternVLTextModel):
    """Llama, Mistral or Qwen2 decoder with 1-D RoPE and full causal attention (a Mistral sliding window bounds the
    model's positions instead, see LlavaNextModel.max_positions)."""

    def __init__(self, tc) -> None:
        if tc.model_type not in ("llama", "mistral", "qwen2"):
            raise NotImplementedError(f"LLaVA-NeXT with a {tc.model_type!r} language model is not supported")
        Qwen2TextModel.__init__(self, tc)


# ------------------------------------------------------------------------------------------------ the model
class LlavaNextModel(InternVLModel):
    """The model runner's interface (see Qwen2VLModel) for LLaVA-NeXT. An image's grid row is
    (tiles, rows, cols, height, width): its pixel_values rows are its tiles ([tiles, 3, S, S], the base tile first,
    then the rows × cols canvas tiles row by row), and (height, width) is the original image's size for unpadding."""

    checkpoint_prefixes = (  # the Hub's checkpoints and transformers 5's layout
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "language_model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.image_newline", "image_newline"),
        ("image_newline", "image_newline"),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config) -> None:
        nn.Module.__init__(self)  # InternVL's seams, not its parts
        if config.vision_feature_select_strategy != "default":
            raise NotImplementedError("only vision_feature_select_strategy 'default' (CLS dropped) is supported")
        vc, tc = config.vision_config, config.text_config
        if vc.model_type != "clip_vision_model":
            raise NotImplementedError(f"LLaVA-NeXT with a {vc.model_type!r} vision tower is not supported")
        self.config = config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.vision_tower = ClipVisionTower(vc, layers)
        self.multi_modal_projector = MultiModalProjector(config, len(layers))
        self.image_newline = nn.Parameter(torch.zeros(tc.hidden_size))
        self.language_model = TextModel(tc)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.num_kv_heads, self.head_dim = tc.num_key_value_heads, head_dim_of(tc)
        # a sequence no longer than Mistral's sliding window attends over all of it, as full attention does; intake
        # refuses longer ones (prompt_too_long)
        window = getattr(tc, "sliding_window", None) if tc.model_type == "mistral" else None
        self.max_positions = min(tc.max_position_embeddings, window or tc.max_position_embeddings)
        self.side = vc.image_size // vc.patch_size  # feature rows (and columns) of one tile
        self.patches_per_tile = self.side**2

    # -- seams the engine calls ---------------------------------------------------------------
    def image_counts(self, grid: torch.Tensor) -> list[tuple[int, int]]:
        """(encoder patches, LM tokens) of each image: the base tile's s² features, the canvas's unpadded features
        and one newline per kept feature row (vlmq.families' price)."""
        counts = []
        for tiles, rows, cols, height, width in grid.tolist():
            unpadded, newlines = llava_next_num_features(height, width, rows * self.side, cols * self.side)
            counts.append((tiles * self.patches_per_tile, self.patches_per_tile + unpadded + newlines))
        return counts

    def encode_images(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: [T, 3, S, S], the tiles of N images back to back; grid: [N, 5] -> N tensors
        [tokens_i, hidden]. One dense batch over every tile, then each image's unpadding and newlines."""
        dtype = self.vision_tower.embeddings.class_embedding.dtype
        feats = self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype))[:, 1:])  # [T, s², hidden]
        out = []
        for image, (_, rows, cols, height, width) in zip(feats.split(grid[:, 0].tolist()), grid.tolist(),
                                                         strict=True):
            s = self.side
            canvas = image[1:].view(rows, cols, s, s, -1).permute(4, 0, 2, 1, 3).reshape(-1, rows * s, cols * s)
            canvas = unpad(canvas, height, width)  # [hidden, h, w]
            newline = self.image_newline.to(canvas.dtype)[:, None, None].expand(-1, canvas.shape[1], 1)
            canvas = torch.cat([canvas, newline], dim=-1).flatten(1).transpose(0, 1)  # [h·(w+1), hidden]
            out.append(torch.cat([image[0], canvas]))
        return out
