"""Continuous batching over a token budget and an encoder-patch budget.

Each step: schedule() picks work, the runner runs it, update() commits it. Requests
join (add) and leave (finish, abort) between steps.

Policy, in order:
0. A new sequence whose image another sequence is still prefilling is held back until that KV is computed,
   then joins the waiting queue and takes it from the prefix cache (admission.py).
1. Running sequences' decode tokens, then their next prefill chunks, each group in rank
   order. A prefill chunk is at most long_prefill_chunk_size tokens and may end inside
   an image's span (KV is per token), but an image's encoder work is never split: a
   chunk that reaches an image whose output is not in the encoder cache must fit the
   image's whole patch count in this step's patch budget, else it ends before the
   image. Cached images cost no patches.
2. When KV blocks run out, the worst-ranked running sequence that has not run a prefill
   chunk this step is preempted (recompute: its blocks are freed and it waits again);
   a sequence is never preempted for a worse-ranked one.
3. If nothing was preempted, waiting sequences are admitted strictly in rank order
   (head-of-line: if the best one does not fit, nobody behind it jumps the queue).

Rank (lower runs first) is the effective priority with linear aging,
    effective(now) = priority − aging_rate × (now − arrival_step),
and since `now` is common to all sequences, ordering by it equals ordering by the
fixed key priority + aging_rate × arrival_step. Hence a sequence arriving at step t0
with priority p can only be overtaken by later arrivals of priority p' arriving before
t0 + (p − p') / aging_rate: the aging bound tested in tests/engine/test_scheduler.py.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from .admission import SharedImageAdmission
from .block_manager import BlockManager, num_blocks_for, slot_mapping
from .chunking import ChunkPlan, plan_chunk
from .config import EngineConfig
from .encoder_cache import EncoderCache
from .errors import RequestRejected
from .outputs import EncoderInput, RunnerOutput, ScheduledSeq, SchedulerOutput
from .sequence import SeqId, Sequence, SequenceStatus


@dataclass(slots=True)
class _Budget:
    tokens: int
    patches: int


class Scheduler:
    def __init__(self, config: EngineConfig, encoder_cache: EncoderCache | None = None) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache(config.encoder_cache_bytes)
        self.waiting: list[Sequence] = []  # sorted by rank
        self.running: list[Sequence] = []  # sorted by rank
        self.seqs: dict[SeqId, Sequence] = {}  # every unfinished sequence (held, waiting or running)
        self.admission = SharedImageAdmission(config.enable_prefix_caching)
        self.num_steps = 0
        self._rank: dict[SeqId, tuple[float, int]] = {}
        self._num_added = 0
        self._finished_ids: list[SeqId] = []  # reported in the next SchedulerOutput
        self._in_flight: SchedulerOutput | None = None  # scheduled, not yet updated

    # -- requests -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (or hold it back, see admission.py); raises RequestRejected if it can never run."""
        if seq.seq_id in self.seqs or seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id!r} is already in the scheduler or not new")
        self._check_fits(seq)
        seq.arrival_step = self.num_steps
        self._rank[seq.seq_id] = (seq.priority + self.config.aging_rate * seq.arrival_step, self._num_added)
        self._num_added += 1
        self.seqs[seq.seq_id] = seq
        if self.admission.admit(seq):
            bisect.insort(self.waiting, seq, key=self.rank)

    def _check_fits(self, seq: Sequence) -> None:
        cfg = self.config
        need = num_blocks_for(seq.max_num_kv_tokens, cfg.block_size)
        if need > cfg.num_blocks:
            raise RequestRejected(
                f"request {seq.seq_id!r} needs {need} KV blocks ({seq.max_num_kv_tokens} tokens) but the engine has "
                f"{cfg.num_blocks}; shorten the prompt or lower max_new_tokens", "exceeds_kv_capacity")
        for img in seq.images:
            if img.num_patches > cfg.max_num_encoder_patches:
                raise RequestRejected(
                    f"request {seq.seq_id!r} has an image of {img.num_patches} patches, over the per-step encoder "
                    f"budget of {cfg.max_num_encoder_patches}; resize it (lower max_pixels)", "image_too_large")
            if img.num_tokens * cfg.encoder_bytes_per_token > self.encoder_cache.capacity_bytes:
                raise RequestRejected(
                    f"request {seq.seq_id!r} has an image whose encoder output ({img.num_tokens} tokens) exceeds the "
                    "encoder cache; resize it or raise encoder_cache_bytes", "image_too_large")

    def abort(self, seq_id: SeqId) -> Sequence | None:
        """Drop a sequence (held, waiting, or running: then a step in flight discards its result); returns it, or
        None if unknown or already finished."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._finish(seq)
        return seq

    def rank(self, seq: Sequence) -> tuple[float, int]:
        return self._rank[seq.seq_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice; call update() with the runner's output first")
        out = SchedulerOutput(step=self.num_steps, finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        for seq in self.admission.release():  # their leaders computed the shared image (or went away)
            bisect.insort(self.waiting, seq, key=self.rank)
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_encoder_patches)
        self._schedule_running(budget, out)
        if not out.preempted_seq_ids:
            self._schedule_waiting(budget, out)
        self.num_steps += 1
        self._in_flight = out
        return out

    def update(self, output: RunnerOutput | Mapping[SeqId, int]) -> list[Sequence]:
        """Commit the step just run; returns the sequences that finished in it."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            raise RuntimeError("update() without a scheduled step; call schedule() first")
        sampled, more, logprobs = (output.sampled_token_ids, output.more_token_ids, output.logprobs) \
            if isinstance(output, RunnerOutput) else (output, {}, {})
        finished = []
        for s in step.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted after schedule()
                continue
            seq.spec_token_ids = []
            num_appended = 0
            entries = logprobs.get(seq.seq_id) if seq.logprobs is not None else None
            for token in self._take_tokens(s, sampled, more) if s.sample else ():
                seq.append_token(token)
                if entries is not None:
                    seq.logprobs.append(entries[num_appended])
                num_appended += 1
                if seq.is_finished:  # an eos or the length limit: later tokens are dropped
                    break
            # KV is valid for the chunk up to the last appended proposal; a rejected proposal's slot is released
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens + max(0, num_appended - 1)
            if s.num_spec_tokens:
                self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.cache_blocks(seq)
            self._release_encoded_images(seq)
            if seq.is_finished:
                self._finish(seq)
                finished.append(seq)
        return finished

    @staticmethod
    def _take_tokens(s: ScheduledSeq, sampled: Mapping[SeqId, int], more: Mapping[SeqId, list[int]]) -> list[int]:
        if s.seq_id not in sampled:
            raise KeyError(f"runner output has no token for sequence {s.seq_id!r}")
        new = [sampled[s.seq_id], *more.get(s.seq_id, ())]
        if len(new) > 1 + s.num_spec_tokens:
            raise ValueError(f"runner output has {len(new)} tokens for sequence {s.seq_id!r}, which verified "
                             f"{s.num_spec_tokens} proposals")
        return new

    # -- internals ----------------------------------------------------------------------------
    def _schedule_running(self, budget: _Budget, out: SchedulerOutput) -> None:
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        pending = decodes + prefills
        while pending:
            seq = pending.pop(0)
            plan = self._plan(seq, seq.num_computed_tokens, budget)
            if plan.num_new_tokens == 0:
                continue
            spec = self._fit_proposals(seq, plan, budget)
            if self._make_room(seq, plan.num_new_tokens + len(spec), pending, budget, out):
                self.block_manager.append_slots(seq, plan.num_new_tokens + len(spec))
                self._commit(seq, plan, budget, out, spec=spec)

    def _fit_proposals(self, seq: Sequence, plan: ChunkPlan, budget: _Budget) -> list[int]:
        # A decode verifies its proposals only if they fit the token budget and free blocks as they are: they
        # never cost another sequence its place (no preemption for them).
        spec = seq.spec_token_ids[:budget.tokens - 1] if seq.num_tokens - seq.num_computed_tokens == 1 else []
        if spec and not self.block_manager.can_append(seq, 1 + len(spec)):
            spec = []
        seq.spec_token_ids = spec
        return spec

    def _make_room(self, seq: Sequence, num_new_tokens: int, pending: list[Sequence], budget: _Budget,
                   out: SchedulerOutput) -> bool:
        # Candidates: seq itself, unprocessed running ones, and decodes already scheduled this step
        # (cheap to take back: one token, no encoder work). The worst-ranked goes first.
        while not self.block_manager.can_append(seq, num_new_tokens):
            decoded = [s.seq for s in out.scheduled if not s.is_prefill]
            victim = max([seq, *pending, *decoded], key=self.rank)
            if victim in pending:
                pending.remove(victim)
            elif victim is not seq:
                self._unschedule(victim, budget, out)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed = bm.get_computed_blocks(seq)
            plan = self._plan(seq, len(computed) * bm.block_size, budget)
            if plan.num_new_tokens == 0 or not bm.can_allocate(seq, plan.num_new_tokens, computed):
                break  # strict rank order: nobody overtakes the head
            self.waiting.pop(0)
            bm.allocate(seq, plan.num_new_tokens, computed)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.rank)
            out.num_prefix_cached_tokens += seq.num_cached_tokens
            self._commit(seq, plan, budget, out, seq.num_cached_tokens)

    def _plan(self, seq: Sequence, start: int, budget: _Budget) -> ChunkPlan:
        max_tokens = min(budget.tokens, self.config.long_prefill_chunk_size)
        return plan_chunk(seq, start, max_tokens, budget.patches, self.encoder_cache,
                          self.config.encoder_bytes_per_token)

    def _commit(self, seq: Sequence, plan: ChunkPlan, budget: _Budget, out: SchedulerOutput,
                num_cached_tokens: int = 0, spec: list[int] | None = None) -> None:
        cache, start, spec = self.encoder_cache, seq.num_computed_tokens, spec or []
        n = plan.num_new_tokens + len(spec)
        for i in plan.hits:  # hold hits first so reserving below cannot evict them
            if not cache.holds(seq.images[i].content_hash, seq.seq_id):
                cache.acquire(seq.images[i].content_hash, seq.seq_id)
                out.num_encoder_cache_hits += 1
        for i in plan.encode:
            img = seq.images[i]
            cache.reserve(img.content_hash, img.num_tokens * self.config.encoder_bytes_per_token, seq.seq_id)
            out.encoder_inputs.append(EncoderInput(img.content_hash, seq.seq_id, i, img.num_patches, img.num_tokens))
            out.num_encoder_patches += img.num_patches
            budget.patches -= img.num_patches
        out.scheduled.append(ScheduledSeq(
            seq=seq, num_new_tokens=n, start=start, token_ids=seq.token_ids[start:start + plan.num_new_tokens] + spec,
            block_table=list(seq.block_table),
            slot_mapping=slot_mapping(seq.block_table, self.config.block_size, start, start + n),
            num_cached_tokens=num_cached_tokens,
            sample=start + plan.num_new_tokens == seq.num_tokens, num_spec_tokens=len(spec)))
        out.num_scheduled_tokens += n
        budget.tokens -= n

    def _unschedule(self, seq: Sequence, budget: _Budget, out: SchedulerOutput) -> None:
        # Only decodes (with their proposals) are taken back: no encoder work to undo.
        (s,) = [s for s in out.scheduled if s.seq is seq]
        out.scheduled.remove(s)
        out.num_scheduled_tokens -= s.num_new_tokens
        budget.tokens += s.num_new_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.encoder_cache.release_all(seq.seq_id)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        bisect.insort(self.waiting, seq, key=self.rank)
        out.preempted_seq_ids.append(seq.seq_id)

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.admission.forget(seq)
        self.block_manager.free(seq)
        self.encoder_cache.release_all(seq.seq_id)
        del self.seqs[seq.seq_id], self._rank[seq.seq_id]
        self._finished_ids.append(seq.seq_id)

    def _release_encoded_images(self, seq: Sequence) -> None:
        # Hold an image's encoder output only while its span is partly computed. Holding it for a later
        # repeat of the same image could stall a sequence that waits for room for another image.
        held = self.encoder_cache.held_keys.get(seq.seq_id)
        if held:
            n = seq.num_computed_tokens
            needed = {img.content_hash for img in seq.images if img.offset < n < img.end}
            for key in held - needed:
                self.encoder_cache.release(key, seq.seq_id)
