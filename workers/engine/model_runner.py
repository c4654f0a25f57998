"""The only part of the engine that touches the device: paged KV caches, encoder, one LM forward, sampling.

Per step (see fake_runner.FakeRunner for the contract):
1. every `EncoderInput` of the step is encoded in ONE packed varlen vision call; each image's output
   [num_tokens, hidden] goes into the encoder cache under its key;
2. the scheduled chunks are flattened into one token batch with M-RoPE positions, slot mapping, block
   tables and context lengths, and run through the LM in one forward;
3. the last row of every chunk with `sample=True` goes through the LM head and is sampled.

Image rows are filled from the encoder cache by the sequences' `ImagePlaceholder` spans, not by matching
the image-pad token id: a generated token that happens to be `<|image_pad|>` is text (as in transformers,
which only scatters image features at prefill). So `Qwen2VLModel.embed` is bypassed on purpose.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.models.qwen2_vl import decode_positions, get_mrope_positions

from .config import EngineConfig
from .encoder_cache import EncoderCache
from .outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from .sequence import SeqId, Sequence


@dataclass(slots=True)
class SeqInputs:
    pixel_values: torch.Tensor  # [P, C*Tp*p*p] float32 patches of the sequence's images, back to back
    grid_thw: torch.Tensor  # [N, 3] int64, one row per image, in placeholder order
    patch_offsets: list[int]  # [N + 1] row offsets of each image in pixel_values
    positions: torch.Tensor | None = None  # [3, num_prompt_tokens] M-RoPE positions, computed on first sight
    rope_delta: int = 0  # decode token i (i >= prompt length) sits at position i + rope_delta


@dataclass(slots=True)
class _Batch:
    input_ids: list[int]  # [T] flattened tokens
    positions: list[torch.Tensor]  # per sequence [3, n]
    image_rows: list[int]  # rows of the flattened batch that take image embeddings
    image_embeds: list[torch.Tensor]  # per image slice [k, hidden], in image_rows order
    sample_rows: list[int]  # last row of each sampled chunk
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model, config: EngineConfig, encoder_cache: EncoderCache, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, seed: int = 0) -> None:
        self.model = model
        self.config = config
        self.encoder_cache = encoder_cache
        self.device = torch.device(device)
        self.kv_caches = model.make_kv_caches(config.num_blocks, config.block_size, dtype=dtype, device=self.device)
        self.inputs: dict[SeqId, SeqInputs] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_encoded_images = 0
        self.num_encoder_calls = 0
        self.timings = {"encode": 0.0, "prepare": 0.0, "forward": 0.0}  # seconds, for benchmarks

    # -- per-sequence inputs ------------------------------------------------------------------
    def add_inputs(self, seq_id: SeqId, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        """Register a sequence's images (kept until it finishes: a preempted one may need them again)."""
        sizes = grid_thw.prod(-1).tolist()
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self.inputs[seq_id] = SeqInputs(pixel_values, grid_thw, offsets)

    def drop(self, seq_ids: list[SeqId]) -> None:
        for seq_id in seq_ids:
            self.inputs.pop(seq_id, None)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.drop(out.finished_seq_ids)
        t0 = time.perf_counter()
        if out.encoder_inputs:
            self._encode(out)
        if not out.scheduled:
            return RunnerOutput()
        t1 = time.perf_counter()
        batch = self._build(out.scheduled)
        meta = self._metadata(out.scheduled)
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)  # [T]
        x = self.model.language_model.embed_tokens(ids)  # [T, hidden]
        if batch.image_rows:
            rows = torch.tensor(batch.image_rows, dtype=torch.long, device=self.device)
            x = x.index_copy(0, rows, torch.cat(batch.image_embeds).to(x.dtype))
        positions = torch.cat(batch.positions, dim=1).to(self.device)  # [3, T]
        t2 = time.perf_counter()
        hidden = self.model.language_model(x, positions, meta, self.kv_caches)  # [T, hidden]
        tokens = self._sample_rows(hidden, batch)
        t3 = time.perf_counter()
        for name, a, b in (("encode", t0, t1), ("prepare", t1, t2), ("forward", t2, t3)):
            self.timings[name] += b - a
        return RunnerOutput({seq.seq_id: t for seq, t in zip(batch.sample_seqs, tokens, strict=True)})

    def _sample_rows(self, hidden: torch.Tensor, batch: _Batch) -> list[int]:
        # hidden: [T, hidden]; only the last row of each sampled chunk goes through the LM head
        if not batch.sample_rows:
            return []
        last = hidden[torch.tensor(batch.sample_rows, device=self.device)]  # [S, hidden]
        logits = self.model.compute_logits(last).float()  # [S, vocab]
        return self._sample(logits, batch.sample_seqs)

    def _encode(self, out: SchedulerOutput) -> None:
        # One packed call for every image of the step, whichever sequences they came from.
        pixels, grids = [], []
        for enc in out.encoder_inputs:
            inp = self.inputs[enc.seq_id]
            lo, hi = inp.patch_offsets[enc.image_index], inp.patch_offsets[enc.image_index + 1]
            pixels.append(inp.pixel_values[lo:hi])
            grids.append(inp.grid_thw[enc.image_index])
        pixel_values = torch.cat(pixels).to(self.device)  # [P, C*Tp*p*p]
        grid_thw = torch.stack(grids).to(self.device)  # [N, 3]
        embeds = self.model.encode_images(pixel_values, grid_thw)  # N x [n_i, hidden]
        for enc, emb in zip(out.encoder_inputs, embeds, strict=True):
            assert emb.shape[0] == enc.num_tokens, (emb.shape, enc)
            self.encoder_cache.put(enc.key, emb)
        self.num_encoded_images += len(embeds)
        self.num_encoder_calls += 1

    def _build(self, scheduled: list[ScheduledSeq]) -> _Batch:
        batch = _Batch([], [], [], [], [], [])
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
            if s.sample:
                batch.sample_rows.append(row0 + s.num_new_tokens - 1)
                batch.sample_seqs.append(s.seq)
        return batch

    def _positions(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        # -> [3, end - start]: prompt tokens from the cached M-RoPE array, generated ones at i + delta
        inp = self.inputs.get(seq.seq_id)
        if inp is None:  # text-only request
            inp = self.inputs[seq.seq_id] = SeqInputs(torch.empty(0), torch.empty(0, 3, dtype=torch.long), [0])
        if inp.positions is None:
            grid = inp.grid_thw if inp.grid_thw.numel() else None
            inp.positions, inp.rope_delta = get_mrope_positions(seq.token_ids[:seq.num_prompt_tokens], grid,
                                                                self.model.config)
        num_prompt = seq.num_prompt_tokens
        if end <= num_prompt:
            return inp.positions[:, start:end]
        tail_start = max(start, num_prompt)
        tail = decode_positions(tail_start, end - tail_start, inp.rope_delta)
        return torch.cat([inp.positions[:, start:num_prompt], tail], dim=1) if start < num_prompt else tail

    def _metadata(self, scheduled: list[ScheduledSeq]) -> AttentionMetadata:
        query_lens = [s.num_new_tokens for s in scheduled]
        context_lens = [s.start + s.num_new_tokens for s in scheduled]
        width = max(len(s.block_table) for s in scheduled)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in scheduled]
        slots = [slot for s in scheduled for slot in s.slot_mapping]

        def cu(xs: list[int]) -> torch.Tensor:  # [S + 1] int32 prefix sums
            return torch.tensor([0, *xs], dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)

        return AttentionMetadata(
            query_lens=query_lens, context_lens=context_lens,
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            cu_query_lens=cu(query_lens), cu_context_lens=cu(context_lens), block_size=self.config.block_size)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [S, vocab] float32 -> one token per row; greedy rows take the argmax
        tokens = logits.argmax(-1)
        temps = [seq.sampling.temperature for seq in seqs]
        if any(temps):
            t = torch.tensor([x or 1.0 for x in temps], device=logits.device)[:, None]
            probs = torch.softmax(logits / t, dim=-1)
            drawn = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
            greedy = torch.tensor([x == 0 for x in temps], device=logits.device)
            tokens = torch.where(greedy, tokens, drawn)
        return tokens.tolist()
