"""One generation request inside the engine (not the user-facing job: see vlmq.JobStatus)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from .stopping import StopMatcher

if TYPE_CHECKING:
    from .grammar import GrammarState

SeqId = int | str
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs


class SequenceStatus(Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks; scheduled every step it has budget
    PREEMPTED = "preempted"  # blocks freed; waits to recompute its whole token history
    FINISHED_STOPPED = "finished_stopped"  # sampled an eos or stop token, or completed a stop string
    FINISHED_LENGTH = "finished_length"  # reached max_new_tokens
    FINISHED_ABORTED = "finished_aborted"  # abort() from the caller

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> FinishReason:
        return {SequenceStatus.FINISHED_STOPPED: FinishReason.STOP, SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                SequenceStatus.FINISHED_ABORTED: FinishReason.CANCELED}[self]


class FinishReason(str, Enum):
    """Why a request's generation ended; the value is what result JSON carries in ``finish_reason``."""

    STOP = "stop"  # sampled an eos token (the answer is complete)
    LENGTH = "length"  # reached max_new_tokens
    CANCELED = "canceled"  # aborted by the caller; the tokens so far are kept
    ERROR = "error"  # failed alone (bad input, over a limit); the request's error says why

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ImagePlaceholder:
    """Where one image's tokens sit in the prompt.

    `content_hash` is the image's exact identity, the encoder-cache key made by
    `encoder_cache.make_key(pixel_hash, model_id, processor_settings)`. It also enters
    the prefix-cache block hashes, because the pad tokens of two images are identical.
    """

    content_hash: str
    offset: int  # index in token_ids of the first image (pad) token
    num_tokens: int  # LM tokens the image occupies (merged patches)
    num_patches: int  # ViT patches the encoder processes (4 × num_tokens for Qwen2-VL)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.num_tokens < 1 or self.num_patches < 1 or not self.content_hash:
            raise ValueError(f"invalid image placeholder {self!r}")

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model's raw distribution (before any sampling control) and
    the most likely tokens' (id, logprob) there, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0 = greedy; read by the runner's sampler, not the scheduler
    seed: int | None = None  # streams keyed by (seed, position): spec_decode.verify_seeded (None: a shared one)
    # the logits pipeline (logits.py; defaults: off)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers': logits of seen tokens (prompt and answer) / or * it
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the answer
    presence_penalty: float = 0.0  # OpenAI's: minus this once the token is in the answer
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # eos (and stop tokens) masked until the answer has this many tokens
    logprobs: int | None = None  # None: none; n: each token's logprob and the n most likely (at most 20)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError(f"invalid sampling params {self!r}")
        for name, ok in (("top_p", 0 < self.top_p <= 1), ("top_k", self.top_k >= 0), ("min_p", 0 <= self.min_p <= 1),
                         ("repetition_penalty", self.repetition_penalty > 0),
                         ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
                         ("presence_penalty", -2 <= self.presence_penalty <= 2),
                         ("min_tokens", 0 <= self.min_tokens <= self.max_new_tokens),
                         ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                         ("logit_bias", all(-100 <= b <= 100 and t >= 0 for t, b in self.logit_bias))):
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)!r}")


class Sequence:
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "images", "sampling", "priority",
                 "arrival_step", "status", "num_computed_tokens", "num_cached_tokens", "block_table",
                 "block_hashes", "spec_token_ids", "cache_salt", "stopper", "logprobs", "grammar")

    def __init__(self, seq_id: SeqId, token_ids: list[int], *, images: tuple[ImagePlaceholder, ...] = (),
                 sampling: SamplingParams | None = None, priority: int = 0, cache_salt: str = "",
                 stopper: StopMatcher | None = None, grammar: GrammarState | None = None) -> None:
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        images = tuple(sorted(images, key=lambda im: im.offset))
        for i, img in enumerate(images):
            if img.end > len(token_ids) or (i and images[i - 1].end > img.offset):
                raise ValueError(f"sequence {seq_id!r}: image span {img.offset}..{img.end} is outside the prompt "
                                 "or overlaps another image")
        if priority < 0:
            raise ValueError(f"sequence {seq_id!r}: priority must be >= 0 (0 is highest), got {priority}")
        self.seq_id = seq_id
        self.token_ids = list(token_ids)  # prompt followed by generated tokens
        self.num_prompt_tokens = len(token_ids)
        self.images = images
        self.sampling = sampling or SamplingParams()
        self.priority = priority  # 0 = highest, like Celery on Redis
        self.arrival_step = 0  # scheduler step at add(); never reset, so aging survives preemption
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (reset by preemption)
        self.num_cached_tokens = 0  # of those, tokens taken from the prefix cache at the last admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of token_ids, filled lazily
        # proposed next tokens (speculative decoding) for the coming step; never part of token_ids until verified
        self.spec_token_ids: list[int] = []
        self.cache_salt = cache_salt  # enters the root of block_hashes: "" shares prefix blocks with every request
        self.stopper = stopper  # the request's stop strings, fed each completion token (None: it has none)
        # one per completion token where the request asked for logprobs (None: it did not)
        self.logprobs: list[TokenLogprob] | None = None if self.sampling.logprobs is None else []
        self.grammar = grammar  # the response format's matcher (grammar.py), fed each completion token

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_num_kv_tokens(self) -> int:
        # The last sampled token is never fed back, so it never needs a KV slot.
        return self.num_prompt_tokens + self.sampling.max_new_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)  # the step's mask allowed it
        if token_id in self.sampling.eos_token_ids or (self.grammar is not None and self.grammar.done):
            self.status = SequenceStatus.FINISHED_STOPPED
        elif self.stopper is not None and self.stopper.feed(token_id):
            self.status = SequenceStatus.FINISHED_STOPPED
        elif self.num_completion_tokens >= self.sampling.max_new_tokens:
            self.status = SequenceStatus.FINISHED_LENGTH
