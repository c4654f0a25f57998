"""The vlmq engine's pure core: sequences, scheduler, block manager, encoder cache.

One engine step (the model runner is the only part that touches the device)::

    scheduler = Scheduler(EngineConfig(num_blocks=4096, max_num_batched_tokens=4096))
    scheduler.add(Sequence(seq_id, token_ids, images=(ImagePlaceholder(key, offset, n_tok, n_patch),),
                           sampling=SamplingParams(max_new_tokens=128, eos_token_ids=(eos,)), priority=0))
    while scheduler.has_unfinished:
        out = scheduler.schedule()                  # SchedulerOutput: chunks, slots, images to encode
        runner_out = model_runner.execute(out)      # encode out.encoder_inputs, put in scheduler.encoder_cache,
                                                    # one LM forward, sample where ScheduledSeq.sample
        for seq in scheduler.update(runner_out):    # RunnerOutput or {seq_id: token_id}
            deliver(seq.seq_id, seq.completion_token_ids, seq.status)

See testing.FakeRunner (the runner contract's test double) for an executable statement of the contract.
"""
from .block_manager import BlockManager, slot_mapping
from .config import EngineConfig
from .encoder_cache import EncoderCache, make_key
from .errors import EngineError, RequestRejected
from .outputs import EncoderInput, RunnerOutput, ScheduledSeq, SchedulerOutput
from .scheduler import Scheduler
from .sequence import FinishReason, ImagePlaceholder, SamplingParams, SeqId, Sequence, SequenceStatus

__all__ = [
    "BlockManager", "EncoderCache", "EncoderInput", "EngineConfig", "EngineError", "FinishReason", "ImagePlaceholder",
    "RequestRejected", "RunnerOutput", "SamplingParams", "ScheduledSeq", "Scheduler", "SchedulerOutput", "SeqId",
    "Sequence", "SequenceStatus", "make_key", "slot_mapping",
]
