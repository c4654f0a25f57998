"""Tensor parallelism for the language model (issue 33): one model's LM split across the ranks of a process group.

Owns the parallel layers (``tensor.py``: row-parallel projections, vocabulary-parallel embedding and LM head) and
the rule that turns a loaded model into one rank's shard (``shard.py``). It imports torch and the model classes'
attribute names only; the scheduler side never imports it. Usage, on each rank of an initialised process group::

    from vlmq.workers.parallel import TPGroup, shard_language_model
    shard_language_model(model, TPGroup.world())  # then drive the model exactly as unsharded, in lockstep
"""
from .shard import shard_language_model
from .tensor import TPGroup

__all__ = ["TPGroup", "shard_language_model"]
