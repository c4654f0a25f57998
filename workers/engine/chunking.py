"""How many tokens of one sequence to run this step, and which images that needs encoded.

KV is per token, so a chunk may end inside an image's span. The encoder runs once per
image, on the whole image, in the step whose chunk first reaches it: if the image is
not in the encoder cache, its whole patch count must fit the remaining patch budget
(and its output must fit the encoder cache), otherwise the chunk ends just before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .encoder_cache import EncoderCache
from .sequence import Sequence


@dataclass(slots=True)
class ChunkPlan:
    num_new_tokens: int
    encode: list[int] = field(default_factory=list)  # image indices to encode this step (cache misses)
    hits: list[int] = field(default_factory=list)  # image indices already encoded, newly needed by this seq


def plan_chunk(seq: Sequence, start: int, max_tokens: int, max_patches: int, cache: EncoderCache,
               bytes_per_token: int) -> ChunkPlan:
    plan = ChunkPlan(max(0, min(seq.num_tokens - start, max_tokens)))
    patches = nbytes = 0
    keep: list[str] = []  # hit keys: held from this step on, so no longer evictable
    for i, img in enumerate(seq.images):  # sorted by offset
        key = img.content_hash
        if img.end <= start or cache.holds(key, seq.seq_id):
            continue
        if img.offset >= start + plan.num_new_tokens:
            break
        if key in keep or any(seq.images[j].content_hash == key for j in plan.encode):
            continue  # the same image earlier in this chunk: already held or being encoded
        hit = key in cache  # encoded by an earlier request, or reserved earlier this step
        img_patches = 0 if hit else img.num_patches
        img_bytes = 0 if hit else img.num_tokens * bytes_per_token
        if patches + img_patches > max_patches or not cache.can_reserve(nbytes + img_bytes, keep + [key]):
            plan.num_new_tokens = max(0, img.offset - start)  # stop before the image; never split its encoding
            break
        if hit:
            plan.hits.append(i)
            keep.append(key)
        else:
            plan.encode.append(i)
            patches, nbytes = patches + img_patches, nbytes + img_bytes
    return plan
