"""The vlmq engine as a worker backend (the default; ``--backend engine``): continuous batching, paged KV, caches."""
from __future__ import annotations

import logging
from typing import Any

from vlmq.workers.backends.base import Backend, GenOutput, GenRequest, is_canceled
from vlmq.workers.engine.config import EngineConfig
from vlmq.workers.engine.engine import Engine, Request, RequestOutput

log = logging.getLogger(__name__)


class EngineBackend(Backend):
    def __init__(self, model_dir: str, device: str = "cpu", *, kv_tokens: int | None = None,
                 cancel_poll_every: int = 8, **engine_config: Any) -> None:
        """`kv_tokens`: tokens the KV cache must hold at once (the worker's budget), so that no job the worker
        may take is refused or preempted for room; `engine_config`: EngineConfig fields and
        Engine.from_model_dir options (num_blocks, dtype, ...), which win."""
        self.model_dir = str(model_dir)
        sized = {"num_blocks", "kv_cache_bytes", "kv_cache_memory_fraction"} & engine_config.keys()
        if kv_tokens is not None and not sized:
            engine_config["num_blocks"] = num_blocks_for_tokens(kv_tokens, engine_config)
        self.engine = Engine.from_model_dir(model_dir, device, **engine_config)
        self.cancel_poll_every = cancel_poll_every  # steps between polls of GenRequest.canceled

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        try:
            return self._run(requests)
        except Exception:  # a failed step leaves the engine mid-step: start a fresh one, then isolate the culprit
            log.exception("engine failed on a batch of %d; retrying one by one on a fresh engine", len(requests))
            self._reset()
            return [self._one(r) for r in requests]

    def close(self) -> None:
        self.engine.close()

    def _one(self, request: GenRequest) -> GenOutput | Exception:
        try:
            return self._run([request])[0]
        except Exception as e:  # returned in its slot; the worker fails this job alone
            log.exception("job %s failed alone on the engine", request.job_id)
            self._reset()
            return e

    def _run(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        engine = self.engine
        order = [engine.add_request(Request(r.image, r.prompt, r.max_new_tokens, r.ignore_eos)) for r in requests]
        pending = dict(zip(order, requests, strict=True))  # not finished yet
        aborted: set[str] = set()
        results: dict[str, RequestOutput] = {}
        num_steps = 0
        while pending:
            if num_steps % self.cancel_poll_every == 0:
                for request_id in [i for i, r in pending.items() if i not in aborted and is_canceled(r)]:
                    engine.abort(request_id)  # its output (tokens so far, "canceled") comes from the next step
                    aborted.add(request_id)
            for out in engine.step():
                if pending.pop(out.request_id, None) is not None:
                    results[out.request_id] = out
            num_steps += 1
        return [_gen_output(results[i]) for i in order]

    def _reset(self) -> None:
        self.engine = self.engine.fresh()


def _gen_output(out: RequestOutput) -> GenOutput | Exception:
    if out.error is not None:
        return out.error
    return GenOutput(out.text, out.token_ids, out.finish_reason, out.prompt_tokens, out.image_tokens)


def num_blocks_for_tokens(kv_tokens: int, engine_config: dict[str, Any]) -> int:
    # Each running sequence rounds its tokens up to whole blocks: one spare block per sequence slot.
    default = EngineConfig()
    block_size = int(engine_config.get("block_size", default.block_size))
    max_num_seqs = int(engine_config.get("max_num_seqs", default.max_num_seqs))
    return max(default.num_blocks, -(-kv_tokens // block_size) + max_num_seqs)
