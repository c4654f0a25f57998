"""The engine: preprocessing threads feeding a scheduler, and the step loop that drives the model runner.

    engine = Engine.from_model_dir("workers/assets/tiny-shapes", device="cpu", num_blocks=2048)
    engine = Engine.from_model_dir(model_dir, device="cuda", kv_cache_memory_fraction=0.8)  # KV sized from memory
    outputs = engine.generate([Request(image, "Describe the image.", max_new_tokens=64)])   # batch
    rid = engine.add_request(Request(...)); while engine.has_unfinished: done = engine.step()  # streaming

Preprocessing (chat template, tokenizer, fast image preprocessing, pixel hash; intake.py) runs on a thread pool;
prepared requests join the scheduler at the start of a step, so the model waits for it only when it has nothing
to run.

Speculative decoding (`speculative="ngram" | "draft:<path>" | "head"`): before each step a proposer guesses the
next tokens of the decoding sequences (proposers.py, spec_head.py; how many: spec_decode.AdaptiveK); the scheduler
runs each guess as a (k+1)-token chunk, the runner keeps what the target agrees with (spec_decode.verify: greedy
outputs unchanged, sampled ones exactly the target's law), and the rejected tokens' KV slots are released.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from vlmq.workers.kvstore.identity import weights_identity
from vlmq.workers.kvstore.store import KVStore
from vlmq.workers.models.loader import load_model
from vlmq.workers.models.processor import load_processor

from .config import EngineConfig
from .cuda_profile import profiled_kv_bytes
from .device_defaults import default_block_size, default_dtype, flash_attn_installed
from .encoder_cache import encoder_output_width
from .errors import EngineError
from .intake import Prepared, Preprocessor, Request, RequestOutput
from .kv_budget import kv_cache_num_blocks
from .kv_tiers import KVTiers
from .model_runner import ModelRunner
from .proposers import Proposer, make_proposer, speculative_config
from .scheduler import Scheduler
from .sequence import FinishReason, Sequence
from .spec_decode import AdaptiveK, SpecConfig, SpecStats
from .tiling import TilingPreprocessor, image_preprocessor_for

__all__ = ["Engine", "EngineStats", "Request", "RequestOutput", "default_model_id"]


def largest_image_patches(image_processor: Any, model: Any = None) -> int:
    """ViT patches of the largest image the processor emits: its max_pixels over the patch area or, for a tiling
    processor, its most tiles (thumbnail included) as the model counts them."""
    fast = image_preprocessor_for(image_processor.to_dict())
    if isinstance(fast, TilingPreprocessor):
        return model.image_counts(fast.largest_grid())[0][0]
    size = getattr(image_processor, "size", None)
    max_pixels = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None) or 0
    return int(max_pixels) // image_processor.patch_size ** 2


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_deferred_admissions: int = 0  # requests held back until another one computed their shared image
    num_encoder_calls: int = 0
    num_encoded_images: int = 0
    encoder_cache_hits: int = 0  # images served from the encoder cache (another request encoded them)
    encoder_cache_misses: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefix_cache_query_tokens: int = 0
    speculative: SpecStats = field(default_factory=SpecStats)  # proposals, acceptance, tokens per target forward
    # seconds per phase of step(); "wait_preprocess" is time the step loop waited for preprocessing
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("wait_preprocess", "schedule", "execute", "update"), 0.0))


def _check_tp(speculative: Any, kv_store: Any, kv_cache_memory_fraction: float | None) -> None:
    """What a tensor-parallel engine does not do yet, refused by name."""
    if speculative not in (None, "none"):
        raise ValueError("speculative decoding under tensor parallelism is not built yet: speculative='none'")
    if kv_store is not None:
        raise ValueError("KV tiers and the KV archive under tensor parallelism are not built yet: kv_store=None")
    if kv_cache_memory_fraction is not None:
        raise ValueError("kv_cache_memory_fraction under tensor parallelism is not built yet: give num_blocks or "
                         "kv_cache_bytes")


class Engine:
    def __init__(self, model, processor, config: EngineConfig, *, device: str | torch.device = "cpu",
                 model_id: str = "model", eos_token_ids: tuple[int, ...] = (), share_encoder_outputs: bool = True,
                 num_preprocess_threads: int = 1, kv_store: KVStore | None = None, proposer: Proposer | None = None,
                 spec_config: SpecConfig | None = None, tp: Any = None) -> None:
        self._args = (model, processor, config, dict(device=device, model_id=model_id, eos_token_ids=eos_token_ids,
                      share_encoder_outputs=share_encoder_outputs, num_preprocess_threads=num_preprocess_threads,
                      kv_store=kv_store, proposer=proposer, spec_config=spec_config))
        self.config = config
        self.scheduler = Scheduler(config)
        self.tp = tp  # a tensor-parallel group's rank 0 (vlmq.workers.parallel): the runner leads the others
        if tp is not None and tp.size > 1:
            from vlmq.workers.parallel.lockstep import LeaderRunner
            self.runner: ModelRunner = LeaderRunner(model, config, self.scheduler.encoder_cache, device, tp=tp)
        else:
            self.runner = ModelRunner(model, config, self.scheduler.encoder_cache, device)
        self.tokenizer = processor.tokenizer
        image_pre = image_preprocessor_for(processor.image_processor.to_dict())  # tiles or native resolution
        self.preprocessor = Preprocessor(processor, image_pre, model, model_id, eos_token_ids, share_encoder_outputs)
        self.eos_token_ids = eos_token_ids
        self.stats = EngineStats()
        self._pool = ThreadPoolExecutor(num_preprocess_threads, thread_name_prefix="vlmq-preprocess")
        self._ready: queue.SimpleQueue[tuple[str, Future]] = queue.SimpleQueue()
        self._preparing: set[str] = set()  # on the preprocessing threads; the scheduler has not seen them
        self._meta: dict[str, RequestOutput] = {}  # request_id -> output being filled
        self._done: list[RequestOutput] = []  # finished since the last step() returned
        self._num_added = 0
        self.tiers: KVTiers | None = None  # host / disk / archive tiers below the caches (kv_tiers.py)
        if kv_store is not None:
            self.tiers = KVTiers(kv_store, self.scheduler, self.runner, self.runner.kv_caches[0][0].dtype)
            self.tiers.wake = lambda: self._ready.put(("", None))
        self.proposer = proposer  # speculative decoding (None: off)
        if proposer is not None:
            proposer.reset()
            self.stats.speculative.proposer = proposer.name
            cfg = spec_config
            self.adaptive_k = AdaptiveK(cfg.max_k, cfg.max_batch, adaptive=cfg.adaptive) if cfg else AdaptiveK()
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._propose_cost = (0.0, 0)  # CPU seconds the proposer took this step, for this many proposals

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", *,
                       dtype: torch.dtype | None = None, model_id: str | None = None,
                       share_encoder_outputs: bool = True, num_preprocess_threads: int = 1,
                       kv_cache_bytes: int | None = None, kv_cache_memory_fraction: float | None = None,
                       max_model_len: int | None = None, kv_store: KVStore | None = None,
                       speculative: str | SpecConfig | None = None, tp: Any = None,
                       **config: Any) -> Engine:
        """Load model, processor and generation config; `config` holds EngineConfig fields.

        speculative: "ngram", "draft:<path>" (a text-only causal LM with the same tokenizer) or "head" (the
        model folder's `spec-head`), or a SpecConfig; "model": the proposer the model folder names in its vlmq.json
        (proposers.model_default_proposer; the worker's default), off if none; None or "none": off.

        The KV cache has `num_blocks` blocks, or as many as fit in `kv_cache_bytes`, or (CUDA only) in
        `kv_cache_memory_fraction` of the device memory free once the weights are loaded, less the activation peak
        of a profiling forward at the largest step (cuda_profile.py); a budget must hold
        at least one `max_model_len`-token sequence (default: the model's max_position_embeddings).
        """
        sized = kv_cache_bytes is not None or kv_cache_memory_fraction is not None
        if tp is not None and tp.size > 1:
            _check_tp(speculative, kv_store, kv_cache_memory_fraction)
        if sized and "num_blocks" in config:
            raise ValueError("give num_blocks or a KV cache budget (kv_cache_bytes or kv_cache_memory_fraction)")
        model_dir, device = Path(model_dir), torch.device(device)
        dtype = default_dtype(device.type, dtype)  # float32 on CPU, bfloat16 on CUDA (device_defaults.py)
        model = load_model(model_dir, device, dtype, tp=tp if tp is not None and tp.size > 1 else None)
        config.setdefault("encoder_bytes_per_token", encoder_output_width(model) * torch.finfo(dtype).bits // 8)
        processor = load_processor(model_dir)
        # the largest image the processor can produce must fit one step's encoder budget, or it is refused
        config.setdefault("max_num_encoder_patches", max(EngineConfig().max_num_encoder_patches,
                                                         largest_image_patches(processor.image_processor, model)))
        config.setdefault("block_size", default_block_size(device.type, flash_attn_installed()))
        engine_config = EngineConfig(**config)
        if kv_cache_memory_fraction is not None and device.type == "cuda":  # less a profiling forward's peak
            kv_cache_bytes = profiled_kv_bytes(model, engine_config, device, kv_cache_memory_fraction)
            kv_cache_memory_fraction = None
        if sized:
            num_blocks = kv_cache_num_blocks(model, device, engine_config.block_size, kv_cache_bytes,
                                             kv_cache_memory_fraction, max_model_len)
            engine_config = replace(engine_config, num_blocks=num_blocks)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        spec = speculative_config(speculative, model_dir)
        proposer = make_proposer(spec.method, model_dir, model, engine_config, device, dtype) if spec else None
        return cls(model, processor, engine_config, device=device,
                   model_id=model_id or default_model_id(model_dir),
                   eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                   share_encoder_outputs=share_encoder_outputs, num_preprocess_threads=num_preprocess_threads,
                   kv_store=kv_store, proposer=proposer, spec_config=spec, tp=tp)

    def add_request(self, request: Request, request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{self._num_added}"
        self._num_added += 1
        if request_id in self._meta:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._meta[request_id] = RequestOutput(request_id, [], "", "", arrival_time=time.perf_counter())
        self._preparing.add(request_id)
        future = self._pool.submit(self.preprocessor, request_id, request)
        future.add_done_callback(lambda f: self._ready.put((request_id, f)))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; its output (finish_reason "canceled", tokens so far) comes from the next step()."""
        if request_id in self._preparing:
            self._preparing.discard(request_id)  # dropped when its preprocessing completes
            self._finish(request_id, FinishReason.CANCELED)
        elif self.tiers is not None and self.tiers.drop(request_id):  # parked while its KV is looked up
            self._finish(request_id, FinishReason.CANCELED)
        elif (seq := self.scheduler.abort(request_id)) is not None:
            self._finish(request_id, FinishReason.CANCELED, seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._meta) or bool(self._done)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def fresh(self) -> Engine:
        """Close this engine and return a new one on the same weights, with empty scheduler, caches and KV.

        For recovery: a step whose model call raised leaves the scheduler mid-step. This engine's KV cache is
        released before the new one is allocated."""
        if self.tp is not None and self.tp.size > 1:
            raise EngineError("a tensor-parallel group is restarted whole, never one engine of it")
        model, processor, config, kwargs = self._args
        self.close()
        del self.runner, self.scheduler
        self.tiers = None  # it holds the old runner (and so its KV cache) too
        return Engine(model, processor, config, **kwargs)

    def step(self) -> list[RequestOutput]:
        """Admit preprocessed requests, run one scheduler step; returns requests finished since the last call."""
        t0 = time.perf_counter()
        self._admit()
        t1 = time.perf_counter()
        if self.scheduler.has_unfinished:
            self._propose()
            out = self.scheduler.schedule()
            if self.tiers is not None:
                self.tiers.before_execute()
            t2, c2 = time.perf_counter(), time.thread_time()
            runner_out = self.runner.execute(out, self._draft_probs) if self._draft_probs else self.runner.execute(out)
            t3, c3 = time.perf_counter(), time.thread_time()
            if self.tiers is not None:
                self.tiers.after_execute(out)
            before = {s.seq_id: s.seq.num_completion_tokens for s in out.scheduled if s.sample and not s.is_prefill}
            finished = self.scheduler.update(runner_out)
            self._after_step(out, finished, t3)
            self._count_speculation(out, runner_out, before)
            if self.proposer is not None:
                decode_only = not out.encoder_inputs and not any(s.is_prefill for s in out.scheduled)
                self.adaptive_k.observe_cost(*self._propose_cost, c3 - c2, out.num_scheduled_tokens, decode_only)
                self.proposer.observe(out, runner_out, self.runner.last_hidden)
            marks = (t0, t1, t2, t3, time.perf_counter())
            for name, a, b in zip(self.stats.timings, marks[:-1], marks[1:], strict=True):
                self.stats.timings[name] += b - a
        done, self._done = self._done, []
        return done

    def generate(self, requests: Seq[Request], prepare_all_first: bool = False) -> list[RequestOutput]:
        """Run a batch to completion (continuously batched); outputs in request order.

        prepare_all_first: the first step waits until every image is preprocessed, so the scheduler sees the whole
        batch at once (otherwise steps start as soon as one request is ready and the rest join as they arrive)."""
        ids = [self.add_request(r) for r in requests]
        if prepare_all_first:
            self._wait_prepared()
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            results.update((o.request_id, o) for o in self.step())
        return [results[i] for i in ids]

    def _wait_prepared(self) -> None:
        # block on the ready queue (no polling: a sleep would add its quantum to every call) until every request
        # being preprocessed is ready, then put what was taken back in order for _admit
        taken: list[tuple[str, Future | None]] = []
        while sum(f is not None and r in self._preparing for r, f in taken) < len(self._preparing):
            taken.append(self._ready.get())
        for item in taken:
            self._ready.put(item)

    def _admit(self) -> None:
        tiers = self.tiers
        while True:
            for request_id, prepared in tiers.ready() if tiers is not None else ():
                self._add_or_fail(request_id, lambda p=prepared: p, park=False)
            parked = tiers is not None and bool(tiers.parked)
            # nothing to run: wait for input (a parked request: until its lookups finish or its deadline)
            block = not self.scheduler.has_unfinished and (bool(self._preparing) or parked)
            timeout = tiers.seconds_to_deadline() if block and parked else None
            try:
                request_id, future = self._ready.get(block=block, timeout=timeout)
            except queue.Empty:
                if block:
                    continue  # a parked request's deadline passed: admitted above
                return
            if future is None or request_id not in self._preparing:  # a lookup finished; aborted while preparing
                continue
            self._preparing.discard(request_id)
            self._add_or_fail(request_id, future.result)

    def _add_or_fail(self, request_id: str, prepared, park: bool = True) -> None:
        try:
            prep = prepared()
            if not park or self.tiers is None or not self.tiers.park(request_id, prep):
                self._add(prep)
        except Exception as e:  # bad image, prompt too long, too long for the KV budget: it fails alone
            self._finish(request_id, FinishReason.ERROR, error=e)

    def _add(self, prepared: Prepared) -> None:
        seq = prepared.seq
        self.scheduler.add(seq)
        self.runner.add_inputs(seq.seq_id, prepared.pixel_values, prepared.grid_thw, prepared.positions,
                               prepared.rope_delta)
        meta = self._meta[seq.seq_id]
        meta.prompt_tokens, meta.image_tokens = seq.num_prompt_tokens, sum(img.num_tokens for img in seq.images)

    def _propose(self) -> None:
        # proposals for this step's decodes; the scheduler keeps those that fit, the runner verifies them
        self._draft_probs, self._propose_cost = {}, (0.0, 0)
        if self.proposer is None:
            return
        decodes = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in decodes:
            seq.spec_token_ids = []  # proposals live for one step (with their laws in self._draft_probs)
        if len(decodes) > self.adaptive_k.max_batch:  # off for a batch this large: nothing more to pay per sequence
            return
        ks = [self.adaptive_k.k_for(s.seq_id, len(decodes), s.sampling.max_new_tokens - s.num_completion_tokens)
              for s in decodes]
        chosen = [(s, k) for s, k in zip(decodes, ks, strict=True) if k > 0]
        if not chosen:
            return
        t0 = time.thread_time()  # CPU time of this thread: what other processes run does not count
        proposals = self.proposer.propose([s for s, _ in chosen], [k for _, k in chosen])
        # a sequence's first proposals also read its whole prompt: a one-off, not the cost per proposal
        if all(s.num_completion_tokens > 1 for s, _ in chosen):
            self._propose_cost = (time.thread_time() - t0, sum(k for _, k in chosen))
        for (seq, _), p in zip(chosen, proposals, strict=True):
            seq.spec_token_ids = p.token_ids
            if p.probs is not None and p.token_ids:
                self._draft_probs[seq.seq_id] = p.probs

    def _count_speculation(self, out, runner_out, before: dict) -> None:
        st = self.stats.speculative
        for s in out.scheduled:
            if s.seq_id in before:
                accepted = len(runner_out.more_token_ids.get(s.seq_id, ()))
                st.num_decode_forwards += 1
                st.num_decode_tokens += s.seq.num_completion_tokens - before[s.seq_id]  # past an eos: not emitted
                st.num_proposed += s.num_spec_tokens
                st.num_accepted += accepted
                if self.proposer is not None:
                    self.adaptive_k.observe(s.seq_id, s.num_spec_tokens, accepted)

    def _after_step(self, out, finished: list[Sequence], now: float) -> None:
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(out.preempted_seq_ids)
        for s in out.scheduled:
            meta = self._meta.get(s.seq_id)
            if s.sample and meta is not None and meta.first_token_time is None:
                meta.first_token_time = now
        for seq in finished:
            self._finish(seq.seq_id, seq.status.finish_reason, seq)
        st, cache, bm = self.stats, self.scheduler.encoder_cache, self.scheduler.block_manager
        st.num_deferred_admissions = self.scheduler.admission.num_deferred
        st.num_encoder_calls, st.num_encoded_images = self.runner.num_encoder_calls, self.runner.num_encoded_images
        st.encoder_cache_hits, st.encoder_cache_misses = cache.hits, cache.misses
        st.prefix_cache_hit_tokens, st.prefix_cache_query_tokens = bm.num_prefix_hits, bm.num_prefix_queries

    def _finish(self, request_id: str, reason: FinishReason, seq: Sequence | None = None,
                error: Exception | None = None) -> None:
        out = self._meta.pop(request_id)
        if self.proposer is not None:
            self.proposer.drop(request_id)
            self.adaptive_k.forget(request_id)
        ids = seq.completion_token_ids if seq is not None else []
        if reason is FinishReason.STOP and ids and ids[-1] in seq.sampling.eos_token_ids:
            ids = ids[:-1]
        out.token_ids, out.finish_reason, out.error = ids, reason, error
        out.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if seq is not None and seq.logprobs is not None:
            out.logprobs = seq.logprobs[:len(ids)]  # the eos's left out with it
        if seq is not None and seq.stopper is not None and seq.stopper.cut is not None:
            out.text = out.text[:seq.stopper.cut]  # the answer ends before its stop string
        out.finish_time = time.perf_counter()
        self._done.append(out)


def default_model_id(model_dir: Path) -> str:
    # The weights' identity (config, safetensors headers and data samples; kvstore/identity.py): equal for two
    # copies of one checkpoint wherever they sit, so image keys, prefix-block hashes and the KV archive are shared
    # across the fleet, and different for another checkpoint.
    return f"weights@{weights_identity(model_dir)}"
