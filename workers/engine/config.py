"""Engine configuration: one slots dataclass, validated on construction, no I/O."""
from __future__ import annotations

from dataclasses import dataclass

# the decode attention route (layers/attention.py): "auto" = our Triton kernels on CUDA, torch elsewhere; "kernels" =
# the kernels on any device (on CPU through the Triton interpreter, TRITON_INTERPRET=1: tests of the CUDA path's
# wiring); "torch" = never the kernels (and no CUDA graphs, which capture the kernel path)
ATTENTION_BACKENDS = ("auto", "kernels", "torch")


@dataclass(slots=True)
class EngineConfig:
    # KV cache: fixed-size blocks of `block_size` token slots; `num_blocks` is the hard budget.
    block_size: int = 16
    num_blocks: int = 1024
    # Continuous batching limits per step.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # LM tokens (prefill chunks + decodes) per step
    max_num_encoder_patches: int = 16384  # ViT patches per step; Qwen2-VL: patches = merge_size² × LM tokens
    long_prefill_chunk_size: int = 512  # most prompt tokens one sequence prefills in one step
    # Waiting order: effective priority = priority − aging_rate × steps waited (lower runs first).
    aging_rate: float = 0.05
    enable_prefix_caching: bool = True
    # Vision encoder output cache, bounded in bytes; an image's entry is num_tokens × encoder_bytes_per_token.
    encoder_cache_bytes: int = 256 * 2**20
    encoder_bytes_per_token: int = 3584 * 2  # hidden size × dtype size (Qwen2-VL-7B, bf16)
    # CUDA only: decode steps of up to this many sequences replay a captured CUDA graph (cuda_graphs.py); 0 = off
    cuda_graph_max_seqs: int = 64
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_num_encoder_patches", "long_prefill_chunk_size", "encoder_bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.cuda_graph_max_seqs, int) or self.cuda_graph_max_seqs < 0:
            raise ValueError(f"EngineConfig.cuda_graph_max_seqs must be an int >= 0, got {self.cuda_graph_max_seqs!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"EngineConfig.encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        if not self.aging_rate >= 0:  # also rejects NaN
            raise ValueError(f"EngineConfig.aging_rate must be >= 0, got {self.aging_rate}")
        if self.long_prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_chunk_size ({self.long_prefill_chunk_size}) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}); lower the chunk size or raise the token budget")

    @property
    def max_num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size
