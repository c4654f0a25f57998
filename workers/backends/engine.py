"""The vlmq engine as a worker backend (``--backend engine``): continuous batching, paged KV, caches."""
from __future__ import annotations

from typing import Any

from vlmq.workers.backends.base import Backend, GenOutput, GenRequest
from vlmq.workers.engine.engine import Engine, Request, RequestOutput


class EngineBackend(Backend):
    def __init__(self, model_dir: str, device: str = "cpu", *, cancel_poll_every: int = 8,
                 **engine_config: Any) -> None:
        """`engine_config`: EngineConfig fields and Engine.from_model_dir options (num_blocks, dtype, ...)."""
        self.model_dir = str(model_dir)
        self.engine = Engine.from_model_dir(model_dir, device, **engine_config)
        self.cancel_poll_every = cancel_poll_every  # steps between polls of GenRequest.canceled

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        engine = self.engine
        live = {engine.add_request(Request(r.image, r.prompt, r.max_new_tokens, r.ignore_eos)): r for r in requests}
        order = list(live)
        results: dict[str, RequestOutput] = {}
        num_steps = 0
        while len(results) < len(order):
            if num_steps % self.cancel_poll_every == 0:
                for request_id, r in list(live.items()):
                    if r.canceled is not None and r.canceled():
                        engine.abort(request_id)
                        del live[request_id]
            for out in engine.step():
                results[out.request_id] = out
                live.pop(out.request_id, None)
            num_steps += 1
        return [_gen_output(results[i]) for i in order]

    def close(self) -> None:
        self.engine.close()


def _gen_output(out: RequestOutput) -> GenOutput | Exception:
    if out.error is not None:
        return out.error
    return GenOutput(out.text, out.token_ids, out.finish_reason, out.prompt_tokens, out.image_tokens)
