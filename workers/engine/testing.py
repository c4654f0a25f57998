"""The runner contract's test double: a deterministic CPU stand-in for ModelRunner, and helpers that drive a
scheduler with it. Tests of the scheduler, block manager and caches use it; nothing in a worker does.

It keeps a fake paged KV cache (slot -> (position, feature)), writes each scheduled
token's feature into the slot the scheduler mapped it to, and samples the next token
as a hash of the features read back through the block table. A text token's feature
is its id; an image token's feature is the encoder output the runner put in the
encoder cache for that image. So any bookkeeping bug (a wrong slot, a prefix block
shared between different images, KV lost by preemption, an image read before it was
encoded) changes the sampled tokens or raises, and `reference_completion` gives the
tokens an unbatched, uncached run produces.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Sequence as Seq

from .block_manager import slot_mapping
from .encoder_cache import EncoderCache
from .outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from .scheduler import Scheduler
from .sequence import ImagePlaceholder, SeqId, Sequence

Feature = tuple[str, int | str]


def encode_image(img: ImagePlaceholder) -> tuple[Feature, ...]:
    return tuple(("img", f"{img.content_hash}:{j}") for j in range(img.num_tokens))


def next_token(features: Seq[Feature], vocab_size: int) -> int:
    h = hashlib.blake2b(repr(list(features)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % vocab_size


def reference_completion(seq: Sequence, vocab_size: int = 1000) -> list[int]:
    """What `seq` generates when run alone from scratch (no batching, caching or preemption)."""
    features: list[Feature] = [("tok", t) for t in seq.token_ids[:seq.num_prompt_tokens]]
    for img in seq.images:
        features[img.offset:img.end] = encode_image(img)
    out: list[int] = []
    while True:
        token = next_token(features, vocab_size)
        out.append(token)
        if token in seq.sampling.eos_token_ids or len(out) == seq.sampling.max_new_tokens:
            return out
        features.append(("tok", token))


class FakeRunner:
    def __init__(self, block_size: int, encoder_cache: EncoderCache, vocab_size: int = 1000) -> None:
        self.block_size = block_size
        self.encoder_cache = encoder_cache
        self.vocab_size = vocab_size
        self.kv: dict[int, tuple[int, Feature]] = {}
        self.num_encoded_images = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        seqs = {s.seq_id: s.seq for s in out.scheduled}
        for enc in out.encoder_inputs:  # all encoder work first, then the LM "forward"
            self.encoder_cache.put(enc.key, encode_image(seqs[enc.seq_id].images[enc.image_index]))
            self.num_encoded_images += 1
        result = RunnerOutput()
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            assert s.token_ids == s.seq.token_ids[s.start:end - s.num_spec_tokens] + s.seq.spec_token_ids
            for pos, slot in zip(range(s.start, end), s.slot_mapping, strict=True):
                self.kv[slot] = (pos, self._feature(s, pos))
            if s.sample:  # greedy verification: keep proposals while they equal the next token, plus one
                proposals, new = s.token_ids[s.num_new_tokens - s.num_spec_tokens:], []
                for i in range(s.num_spec_tokens + 1):
                    new.append(next_token(self._read_context(s.block_table, end - s.num_spec_tokens + i),
                                          self.vocab_size))
                    if i == s.num_spec_tokens or new[-1] != proposals[i]:
                        break
                result.sampled_token_ids[s.seq_id] = new[0]
                if len(new) > 1:
                    result.more_token_ids[s.seq_id] = new[1:]
        return result

    def _feature(self, s: ScheduledSeq, pos: int) -> Feature:
        for img in s.seq.images:
            if img.offset <= pos < img.end:
                features: tuple[Feature, ...] = self.encoder_cache.get(img.content_hash)  # raises if not encoded
                return features[pos - img.offset]
        return ("tok", s.token_ids[pos - s.start])

    def _read_context(self, block_table: list[int], num_tokens: int) -> list[Feature]:
        entries = [self.kv[slot] for slot in slot_mapping(block_table, self.block_size, 0, num_tokens)]
        assert [pos for pos, _ in entries] == list(range(num_tokens)), "KV slot holds another position"
        return [feature for _, feature in entries]


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
                   on_step: Callable[[SchedulerOutput], None] | None = None) -> dict[SeqId, list[int]]:
    """Drive schedule → execute → update until every sequence finished; returns seq_id -> completion."""
    done: dict[SeqId, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return done
        out = scheduler.schedule()
        if on_step is not None:
            on_step(out)
        for seq in scheduler.update(runner.execute(out)):
            done[seq.seq_id] = seq.completion_token_ids
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.running + scheduler.waiting}")


def check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Assert the budgets and bookkeeping invariants of one scheduled step."""
    cfg, bm, cache = scheduler.config, scheduler.block_manager, scheduler.encoder_cache
    assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert out.num_encoder_patches == sum(e.num_patches for e in out.encoder_inputs) <= cfg.max_num_encoder_patches
    assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    assert len({e.key for e in out.encoder_inputs}) == len(out.encoder_inputs)
    for s in out.scheduled:
        assert 1 <= s.num_new_tokens and s.start + s.num_new_tokens <= len(s.block_table) * cfg.block_size
    refs = [0] * bm.num_blocks
    for seq in scheduler.running:
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert refs == bm.ref_counts, "ref counts disagree with the running sequences' block tables"
    assert all(bm.ref_counts[b] == 0 for b in bm.free_blocks)
    assert bm.num_free_blocks + sum(1 for r in refs if r) == bm.num_blocks
    assert all(not seq.block_table for seq in scheduler.waiting)
    assert cache.num_used_bytes == sum(e.num_bytes for e in cache.entries.values()) <= cache.capacity_bytes
