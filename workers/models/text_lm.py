"""A text-only Qwen2 causal LM on the paged KV cache: the draft model of speculative decoding.

It reuses the VLM's text stack (`qwen2_vl.TextModel`): with the same position on all three M-RoPE axes, M-RoPE is
plain RoPE, so a text model gets positions [T] (expanded) and one rotary section.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from vlmq.workers.models.loader import _copy_weights, tie_and_check
from vlmq.workers.models.qwen2_vl import Qwen2VLModel, TextModel


class TextCausalLM(nn.Module):
    def __init__(self, tc) -> None:
        super().__init__()
        tc = copy.copy(tc)
        head_dim = tc.hidden_size // tc.num_attention_heads
        tc.rope_parameters = {**tc.rope_parameters, "mrope_section": [head_dim // 2, 0, 0]}
        self.config = tc
        self.language_model = TextModel(tc)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.num_kv_heads, self.head_dim = tc.num_key_value_heads, head_dim

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, hidden] -> [T, vocab]

    make_kv_caches = Qwen2VLModel.make_kv_caches


def load_text_lm(model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> TextCausalLM:
    """A `Qwen2ForCausalLM` checkpoint folder -> TextCausalLM. Raises ValueError for another model type."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "qwen2":
        raise ValueError(f"a draft model must be a qwen2 causal LM; {model_dir} has model type {config.model_type!r}")
    with torch.device("meta"):
        model = TextCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    loaded = _copy_weights(model, sorted(model_dir.glob("*.safetensors")))
    return tie_and_check(model, loaded, bool(config.tie_word_embeddings), model_dir)
