"""The only part of the engine that touches the device: paged KV caches, encoder, one LM forward, sampling.

Per step (see testing.FakeRunner for the contract):
1. every `EncoderInput` of the step is encoded in ONE packed varlen vision call; each image's output
   [num_tokens, hidden] goes into the encoder cache under its key;
2. the scheduled chunks are flattened into one token batch with the model's positions (computed once per request
   by `model.prompt_positions` at intake), slot mapping, block tables and context lengths, and run through the LM
   in one forward;
3. the last row of every chunk with `sample=True` goes through the LM head and is sampled; a decode that carries
   proposals (speculative decoding) has its last 1 + k rows verified instead (spec_decode.verify).

Image rows are filled from the encoder cache by the sequences' `ImagePlaceholder` spans, not by matching
the image-pad token id: a generated token that happens to be `<|image_pad|>` is text (as in transformers,
which only scatters image features at prefill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate

import torch

from vlmq.workers.kvstore.store import compact
from vlmq.workers.layers.attention import AttentionMetadata

from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .encoder_cache import EncoderCache
from .grammar import apply_grammars
from .logits import needs_processing, process
from .outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from .sequence import SeqId, Sequence, TokenLogprob
from .spec_decode import verify, verify_greedy, verify_seeded


@dataclass(slots=True)
class SeqInputs:
    pixel_values: torch.Tensor  # the sequence's images back to back: [P, C*Tp*p*p] patches or [T, C, S, S] tiles
    grid_thw: torch.Tensor  # [N, 3] int64, one row per image, in placeholder order
    patch_offsets: list[int]  # [N + 1] row offsets of each image in pixel_values (model.pixel_rows)
    positions: torch.Tensor  # [R, num_prompt_tokens] the model's positions of the prompt (R = 3 for M-RoPE)
    rope_delta: int  # generated token i (i >= prompt length) sits at position i + rope_delta


@dataclass(slots=True)
class _Batch:
    input_ids: list[int]  # [T] flattened tokens
    positions: list[torch.Tensor]  # per sequence [R, n]
    image_rows: list[int]  # rows of the flattened batch that take image embeddings
    image_embeds: list[torch.Tensor]  # per image slice [k, hidden], in image_rows order


class ModelRunner:
    def __init__(self, model, config: EngineConfig, encoder_cache: EncoderCache, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, seed: int = 0) -> None:
        self.model = model
        self.config = config
        self.encoder_cache = encoder_cache
        self.device = torch.device(device)
        self.kv_caches = model.make_kv_caches(config.num_blocks, config.block_size, dtype=dtype, device=self.device)
        self.decode_graphs = DecodeGraphs.for_runner(model, config, self.kv_caches, self.device)  # None on CPU
        self.inputs: dict[SeqId, SeqInputs] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.last_hidden: torch.Tensor | None = None  # [T, hidden] of the last step
        self.num_encoded_images = 0
        self.num_encoder_calls = 0
        self.timings = {"encode": 0.0, "prepare": 0.0, "forward": 0.0}  # seconds, for benchmarks

    # -- per-sequence inputs ------------------------------------------------------------------
    def add_inputs(self, seq_id: SeqId, pixel_values: torch.Tensor, grid_thw: torch.Tensor, positions: torch.Tensor,
                   rope_delta: int) -> None:
        """Register a sequence's images and prompt positions (kept until it finishes: a preempted one may need
        them again)."""
        offsets = list(accumulate(self.model.pixel_rows(grid_thw), initial=0))  # the model's layout: patches, tiles
        self.inputs[seq_id] = SeqInputs(pixel_values, grid_thw, offsets, positions, rope_delta)

    def drop(self, seq_ids: list[SeqId]) -> None:
        for seq_id in seq_ids:
            self.inputs.pop(seq_id, None)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, draft_probs: dict[SeqId, torch.Tensor] | None = None) -> RunnerOutput:
        """draft_probs: for sequences whose proposals were sampled, the laws they were drawn from ([k, vocab])."""
        hidden = self.forward(out)  # [T, hidden]
        self.last_hidden = hidden  # for a proposer that reads the target's hidden states
        ends = list(accumulate(s.num_new_tokens for s in out.scheduled))
        sampled = [(s, end) for s, end in zip(out.scheduled, ends, strict=True) if s.sample]
        if not sampled:
            return RunnerOutput()
        # rows: the last prompt/decode token, then every proposal (its logits verify the next proposal)
        rows = logit_rows(out.scheduled)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()  # [R, vocab]
        starts = list(accumulate((1 + s.num_spec_tokens for s, _ in sampled), initial=0))
        raw = _raw_logprobs(logits, sampled, starts)  # before any sampling control
        grammar_rows = _grammar_rows(sampled, starts)
        if grammar_rows:  # first: the other controls choose among the tokens the response format allows
            apply_grammars(logits, grammar_rows)
        logits = process(logits, _processed_rows(sampled, starts))
        result, draft_probs = RunnerOutput(), draft_probs or {}
        # every greedy row's pick in one call (one device sync per step, not one per sequence)
        picks = logits.argmax(-1).tolist() if any(s.seq.sampling.temperature == 0 for s, _ in sampled) else []
        drawn = self._draw_unseeded(logits, [(s, r) for (s, _), r in zip(sampled, starts, strict=False)])
        for (s, _), row in zip(sampled, starts, strict=False):
            n = 1 + s.num_spec_tokens
            new = [drawn[s.seq_id]] if s.seq_id in drawn else \
                self._sample(logits[row:row + n], picks[row:row + n], s, draft_probs.get(s.seq_id))
            result.sampled_token_ids[s.seq_id] = new[0]
            if len(new) > 1:
                result.more_token_ids[s.seq_id] = new[1:]
        if raw is not None:
            result.logprobs = raw.entries(result)
        return result

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Encode the step's images, then one LM forward over its chunks; hidden states [T, hidden] of every
        scheduled token, in batch order (T = out.num_scheduled_tokens)."""
        self.drop(out.finished_seq_ids)
        t0 = time.perf_counter()
        if out.encoder_inputs:
            self._encode(out)
        t1 = time.perf_counter()
        if not out.scheduled:
            return torch.empty(0, self.model.config.text_config.hidden_size, device=self.device)
        batch = self._build(out.scheduled)
        meta = self._metadata(out.scheduled)
        positions = torch.cat(batch.positions, dim=1).to(self.device)  # [R, T]
        t2 = time.perf_counter()
        hidden = self._run_lm(out, batch, meta, positions)  # [T, hidden]
        t3 = time.perf_counter()
        for name, a, b in (("encode", t0, t1), ("prepare", t1, t2), ("forward", t2, t3)):
            self.timings[name] += b - a
        return hidden

    def _before_lm(self, out: SchedulerOutput, ids: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor | None,
                   positions: torch.Tensor) -> None:
        """Hook before the step's LM forward, given its inputs (a tensor-parallel leader sends them to its ranks)."""

    def _run_lm(self, out: SchedulerOutput, batch: _Batch, meta: AttentionMetadata,
                positions: torch.Tensor) -> torch.Tensor:
        """The LM over the step's flattened batch."""
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)  # [T]
        rows = torch.tensor(batch.image_rows, dtype=torch.long, device=self.device)
        feats = torch.cat(batch.image_embeds) if batch.image_embeds else None  # [K, encoder output width]
        self._before_lm(out, ids, rows, feats, positions)
        x, lm_kwargs = embed(self.model, ids, rows, feats)  # [T, hidden]
        graphs = self.decode_graphs if not lm_kwargs else None
        hidden = graphs.run(x, positions, meta) if graphs is not None else None  # a decode step, replayed
        if hidden is None:
            hidden = self.model.language_model(x, positions, meta, self.kv_caches, **lm_kwargs)  # [T, hidden]
        return hidden

    def _encode(self, out: SchedulerOutput) -> None:
        # One packed call for every image of the step, whichever sequences they came from.
        pixels, grids = [], []
        for enc in out.encoder_inputs:
            inp = self.inputs[enc.seq_id]
            lo, hi = inp.patch_offsets[enc.image_index], inp.patch_offsets[enc.image_index + 1]
            pixels.append(inp.pixel_values[lo:hi])
            grids.append(inp.grid_thw[enc.image_index])
        if self.device.type == "cuda":  # packed straight into pinned memory: the copy to the device is asynchronous
            first = pixels[0]
            staged = torch.empty((sum(p.shape[0] for p in pixels), *first.shape[1:]), dtype=first.dtype,
                                 pin_memory=True)
            pixel_values = torch.cat(pixels, out=staged)  # [P, C*Tp*p*p]
        else:
            pixel_values = torch.cat(pixels)
        pixel_values = pixel_values.to(self.device, non_blocking=True)
        grid_thw = torch.stack(grids).to(self.device)  # [N, 3]
        embeds = self.model.encode_images(pixel_values, grid_thw)  # N x [n_i, hidden]
        for enc, emb in zip(out.encoder_inputs, embeds, strict=True):
            assert emb.shape[0] == enc.num_tokens, (emb.shape, enc)
            self.encoder_cache.put(enc.key, compact(emb))  # its own memory, not a slice of the packed output
        self.num_encoded_images += len(embeds)
        self.num_encoder_calls += 1

    def _build(self, scheduled: list[ScheduledSeq]) -> _Batch:
        batch = _Batch([], [], [], [])
        for s in scheduled:
            row0, end = len(batch.input_ids), s.start + s.num_new_tokens
            batch.input_ids += s.token_ids
            batch.positions.append(self._positions(s.seq, s.start, end))
            for img in s.seq.images:
                lo, hi = max(s.start, img.offset), min(end, img.end)
                if lo < hi:  # the chunk overlaps this image: take rows [lo, hi) of its encoder output
                    emb = self.encoder_cache.get(img.content_hash)  # [num_tokens, hidden]
                    batch.image_embeds.append(emb[lo - img.offset:hi - img.offset])
                    batch.image_rows += range(row0 + lo - s.start, row0 + hi - s.start)
        return batch

    def _positions(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        # -> [R, end - start]: prompt tokens from the positions computed at intake, generated ones from the model
        inp, num_prompt = self.inputs[seq.seq_id], seq.num_prompt_tokens
        if end <= num_prompt:
            return inp.positions[:, start:end]
        tail_start = max(start, num_prompt)
        tail = self.model.decode_positions(tail_start, end - tail_start, inp.rope_delta)
        return torch.cat([inp.positions[:, start:num_prompt], tail], dim=1) if start < num_prompt else tail

    def _metadata(self, scheduled: list[ScheduledSeq]) -> AttentionMetadata:
        return AttentionMetadata.build(
            [s.num_new_tokens for s in scheduled], [s.start + s.num_new_tokens for s in scheduled],
            [s.block_table for s in scheduled], self.config.block_size, self.device,
            slot_mapping=[slot for s in scheduled for slot in s.slot_mapping], backend=self.config.attention_backend)

    def _draw_unseeded(self, logits: torch.Tensor, sampled: list[tuple[ScheduledSeq, int]]) -> dict[SeqId, int]:
        # unseeded sampled rows without proposals, from one shared stream: one batched draw for all of them
        plain = [(s, row) for s, row in sampled
                 if s.seq.sampling.temperature > 0 and s.seq.sampling.seed is None and not s.num_spec_tokens]
        if not plain:
            return {}
        rows = torch.tensor([row for _, row in plain], device=logits.device)
        t = torch.tensor([s.seq.sampling.temperature for s, _ in plain], device=logits.device)[:, None]
        drawn = torch.multinomial(torch.softmax(logits[rows] / t, dim=-1), 1, generator=self.generator)[:, 0]
        return dict(zip((s.seq_id for s, _ in plain), drawn.tolist(), strict=True))

    def _sample(self, logits: torch.Tensor, picks: list[int], s: ScheduledSeq,
                draft_probs: torch.Tensor | None) -> list[int]:
        # logits: [1 + k, vocab] float32 at the last token and each of the k proposals -> 1 to k + 1 tokens;
        # picks: their argmaxes where the request is greedy
        proposal = s.token_ids[len(s.token_ids) - s.num_spec_tokens:]
        sampling = s.seq.sampling
        if sampling.temperature == 0:
            return verify_greedy(picks, proposal)
        if sampling.seed is not None and sampling.temperature > 0:  # one answer per seed, speculated or not
            return verify_seeded(logits, proposal, sampling.temperature, sampling.seed, s.seq.num_completion_tokens)
        if draft_probs is not None:
            draft_probs = draft_probs[:len(proposal)]  # the scheduler may have kept only the first ones
        return verify(logits, proposal, draft_probs, sampling.temperature, self.generator)


def embed(model, ids: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """Input embeddings [T, hidden] of token ids [T], rows [K] taking the encoder outputs ``feats`` [K, width]
    (None: no image rows), and the LM's extra keyword arguments (Qwen3-VL's DeepStack)."""
    if feats is None:
        return model.language_model.embed_tokens(ids), {}
    if hasattr(model, "embed_inputs"):  # the encoder output holds more than input embeddings (DeepStack)
        return model.embed_inputs(ids, rows, feats)
    x = model.language_model.embed_tokens(ids)
    return x.index_copy(0, rows, feats.to(x.dtype)), {}


def logit_rows(scheduled: list[ScheduledSeq]) -> list[int]:
    """Rows of a step's hidden states whose logits ``execute`` computes: each sampled sequence's last prompt or
    decode token, then each of its proposals."""
    ends = list(accumulate(s.num_new_tokens for s in scheduled))
    return [r for s, end in zip(scheduled, ends, strict=True) if s.sample
            for r in range(end - 1 - s.num_spec_tokens, end)]


def _processed_rows(sampled: list[tuple[ScheduledSeq, int]], starts: list[int]) -> list:
    # logits.process rows: each of a sequence's 1 + k rows sees the tokens before it (its proposals included)
    rows = []
    for (s, _), start in zip(sampled, starts, strict=False):
        if needs_processing(s.seq.sampling):
            k, seq = s.num_spec_tokens, s.seq
            history, proposal = seq.token_ids, s.token_ids[len(s.token_ids) - k:] if k else []
            for j in range(k + 1):
                rows.append((start + j, seq.sampling, history + proposal[:j], seq.num_completion_tokens + j))
    return rows


class _RawLogprobs:
    """log_softmax of the raw logits at the rows of sequences that asked for logprobs; `entries` picks each emitted
    token's and the top-n there (two device reads in all)."""

    def __init__(self, logits: torch.Tensor, wanted: list[tuple[ScheduledSeq, int]]) -> None:
        self.wanted = wanted
        rows = [start + j for s, start in wanted for j in range(1 + s.num_spec_tokens)]
        self.at = dict(zip(((s.seq_id, j) for s, _ in wanted for j in range(1 + s.num_spec_tokens)), range(len(rows)),
                           strict=True))
        self.lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        n = max(s.seq.sampling.logprobs or 0 for s, _ in wanted)
        top = self.lp.topk(n, dim=-1) if n else None
        self.top = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    def entries(self, out: RunnerOutput) -> dict[SeqId, list[TokenLogprob]]:
        tokens = {s.seq_id: [out.sampled_token_ids[s.seq_id], *out.more_token_ids.get(s.seq_id, ())]
                  for s, _ in self.wanted}
        flat = [(self.at[(sid, j)], t) for sid, ts in tokens.items() for j, t in enumerate(ts)]
        picked = self.lp[torch.tensor([r for r, _ in flat]), torch.tensor([t for _, t in flat])].tolist()
        values, result = iter(picked), {}
        for s, _ in self.wanted:
            n = s.seq.sampling.logprobs or 0
            result[s.seq_id] = [TokenLogprob(next(values), self._top(self.at[(s.seq_id, j)], n))
                                for j in range(len(tokens[s.seq_id]))]
        return result

    def _top(self, row: int, n: int) -> tuple[tuple[int, float], ...]:
        if not n:
            return ()
        ids, values = self.top[row]
        return tuple(zip(ids[:n], values[:n], strict=True))


def _raw_logprobs(logits: torch.Tensor, sampled: list[tuple[ScheduledSeq, int]],
                  starts: list[int]) -> _RawLogprobs | None:
    wanted = [(s, start) for (s, _), start in zip(sampled, starts, strict=False)
              if s.seq.sampling.logprobs is not None]
    return _RawLogprobs(logits, wanted) if wanted else None


def _grammar_rows(sampled: list[tuple[ScheduledSeq, int]], starts: list[int]) -> list:
    # grammar.apply_grammars rows: each of a sequence's 1 + k rows after the proposals before it
    rows = []
    for (s, _), start in zip(sampled, starts, strict=False):
        if s.seq.grammar is not None:
            k = s.num_spec_tokens
            proposal = s.token_ids[len(s.token_ids) - k:] if k else []
            rows += [(start + j, s.seq.grammar, proposal[:j]) for j in range(k + 1)]
    return rows

