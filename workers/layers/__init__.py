"""Shared model layers: norms, MLPs, rotary embeddings (M-RoPE, vision 2D) and the one attention interface."""
