"""Attention and KV kernels with plain-torch references (installed as vlmq.kernels).

Every public function validates its arguments, then runs a Triton kernel on CUDA
tensors or the plain-torch reference (``vlmq.kernels.reference``) otherwise;
``impl="triton" | "torch" | "auto"`` overrides the choice. Triton is imported only
when a Triton kernel is about to run, so this package imports without it.

Imported as a top-level ``kernels`` (a checkout's root on sys.path), this folder steps aside for the
installed package of that name (Hugging Face's, which transformers imports): see vlmq/_toplevel.py.
"""
if __name__ != "vlmq.kernels":
    from vlmq._toplevel import step_aside

    step_aside(__name__, __file__)
else:
    from . import reference
    from .attention import CascadePlan, cascade_decode_attention, merge_attn_states, paged_decode_attention
    from .kv import dequantize_kv_blocks, quantize_kv_blocks, store_kv
    from .reference import attention

__all__ = [
    "CascadePlan",
    "attention",
    "cascade_decode_attention",
    "dequantize_kv_blocks",
    "merge_attn_states",
    "paged_decode_attention",
    "quantize_kv_blocks",
    "reference",
    "store_kv",
]
