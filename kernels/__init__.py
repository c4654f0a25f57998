"""Attention and KV kernels with plain-torch references (installed as vlmq.kernels)."""
