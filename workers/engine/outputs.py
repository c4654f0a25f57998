"""What the scheduler hands the model runner each step, and what it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import SeqId, Sequence, TokenLogprob


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence  # the live sequence: images, sampling params, full token_ids
    num_new_tokens: int  # tokens to run this step: a prefill chunk, or 1 decode token + num_spec_tokens
    start: int  # position of the first new token = tokens whose KV is already cached
    token_ids: list[int]  # seq.token_ids[start:] + the proposed tokens (a prefill chunk has none)
    block_table: list[int]  # KV blocks covering positions [0, start + num_new_tokens)
    slot_mapping: list[int]  # KV slot for each new token: block_table[p // block_size] * block_size + p % block_size
    num_cached_tokens: int  # prefix-cache hit tokens; > 0 only on the step a sequence is (re)admitted
    sample: bool  # the chunk reaches the last known token: sample the next token from its logits
    # proposals to verify (the last num_spec_tokens of token_ids; speculative decoding): the runner samples at
    # each of the 1 + num_spec_tokens rows and keeps the longest prefix the target agrees with, plus one token
    num_spec_tokens: int = 0

    @property
    def seq_id(self) -> SeqId:
        return self.seq.seq_id

    @property
    def is_prefill(self) -> bool:
        return self.start < self.seq.num_prompt_tokens or self.num_new_tokens > 1 + self.num_spec_tokens


@dataclass(slots=True)
class EncoderInput:
    key: str  # encoder-cache key (ImagePlaceholder.content_hash); the runner must put(key, output)
    seq_id: SeqId  # a sequence whose request carries this image's pixels
    image_index: int  # index into that sequence's images
    num_patches: int  # ViT patches, counted against max_num_encoder_patches
    num_tokens: int  # LM tokens the encoder output covers


@dataclass(slots=True)
class SchedulerOutput:
    step: int  # scheduler step number, 0-based; arrival and aging are counted in steps
    # Sequences to run, best effective priority first. The runner runs every encoder
    # input below, puts each output in the encoder cache, then one LM forward over these.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    encoder_inputs: list[EncoderInput] = field(default_factory=list)  # images to encode this step (cache misses)
    num_scheduled_tokens: int = 0  # sum of num_new_tokens; <= max_num_batched_tokens
    num_encoder_patches: int = 0  # sum of encoder_inputs' num_patches; <= max_num_encoder_patches
    num_prefix_cached_tokens: int = 0  # tokens skipped this step thanks to the prefix cache
    num_encoder_cache_hits: int = 0  # images needed this step that were already encoded
    preempted_seq_ids: list[SeqId] = field(default_factory=list)  # KV dropped this step; they will recompute
    # Finished, aborted or rejected since the previous step: the runner drops their per-sequence state.
    finished_seq_ids: list[SeqId] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    # One sampled token per scheduled sequence with sample=True (none for mid-prompt chunks).
    sampled_token_ids: dict[SeqId, int] = field(default_factory=dict)
    # Speculative decoding: the tokens after the sampled one, i.e. the accepted proposals but the first, then the
    # bonus token. len(...) = accepted proposals <= num_spec_tokens; absent when none was accepted.
    more_token_ids: dict[SeqId, list[int]] = field(default_factory=dict)
    # for sequences that asked for logprobs: one (logprob, top alternatives) per token above, in order
    logprobs: dict[SeqId, list[TokenLogprob]] = field(default_factory=dict)
