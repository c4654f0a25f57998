"""Proposers for speculative decoding: guess the next k tokens of a batch of sequences; the target verifies them.

    proposals = proposer.propose(seqs, ks)   # one Proposal per sequence, at most ks[i] tokens
    ...                                      # the engine verifies them in the step (spec_decode.verify)
    proposer.drop(seq_id)                    # the sequence finished: forget its state

- NgramProposer (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last
  n tokens (n from max_n down to min_n), in its prompt or output. No model.
- DraftProposer: a small text-only causal LM with the target's tokenizer (e.g. tiny-shapes-draft), with its own
  paged KV cache. It reads the sequence without the image's pad tokens and keeps the KV of the tokens it has seen
  as long as they stay in the sequence (accepted proposals included).
- HeadProposer (spec_head.py): the vision-aware head over the target's own hidden states; it reads them in
  `observe`, which the engine calls after every step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.models.text_lm import load_text_lm

from .block_manager import BlockManager, num_blocks_for, slot_mapping
from .sequence import SeqId, Sequence
from .spec_decode import SpecConfig


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] the laws they were drawn from; None: deterministic


class Proposer:
    name = "none"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        raise NotImplementedError

    def drop(self, seq_id: SeqId) -> None:
        """Forget a finished sequence."""

    def reset(self) -> None:
        """Forget every sequence (the engine starts afresh)."""

    def observe(self, out, runner_out, hidden: torch.Tensor | None) -> None:
        """After a step: what it ran (SchedulerOutput), what it emitted (RunnerOutput), and the target's hidden
        states of every scheduled token [T, H] (for a proposer that reads them)."""


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(seq.token_ids, k, self.max_n, self.min_n))
                for seq, k in zip(seqs, ks, strict=True)]


def ngram_lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    # Token ids as characters: str.rfind does the search in C. The match must end before the last token.
    text = "".join(map(chr, tokens))
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        start = text.rfind(text[-n:], 0, len(text) - 1)
        if start >= 0:
            return tokens[start + n:start + n + k]
    return []


@dataclass(slots=True)
class DraftState:
    """What the draft's KV holds for one sequence (duck-types the fields BlockManager uses)."""

    prefix: list[int]  # the prompt without image pad tokens
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in the proposer's cache, in order
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0


class DraftProposer(Proposer):
    """A small causal LM with its own paged KV cache, run k steps per call on all the sequences at once."""

    name = "draft"

    def __init__(self, model, num_blocks: int, block_size: int = 16, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        self.model, self.device, self.block_size = model, torch.device(device), block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = model.make_kv_caches(num_blocks, block_size, device=self.device)
        self.state: dict[SeqId, DraftState] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._reserved = 0  # blocks promised to this call's sequences, not yet taken

    def drop(self, seq_id: SeqId) -> None:
        st = self.state.pop(seq_id, None)
        if st is not None:
            self.blocks.free(st)

    def reset(self) -> None:
        for seq_id in list(self.state):
            self.drop(seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        live = [i for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)) if k > 0]
        chunks = {i: self._catch_up(seqs[i], ks[i]) for i in live}
        live = [i for i in live if chunks[i]]
        for step in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if ks[i] > step]
            tokens, probs = self._forward(seqs, live, chunks)
            for i, t, p in zip(live, tokens, probs, strict=True):
                out[i].token_ids.append(t)
                if p is not None:
                    out[i].probs = p[None] if out[i].probs is None else torch.cat([out[i].probs, p[None]])
                chunks[i] = [t]
        self._reserved = 0
        return out

    def _state(self, seq: Sequence) -> DraftState:
        st = self.state.get(seq.seq_id)
        if st is None:
            pads = {j for img in seq.images for j in range(img.offset, img.end)}
            prompt = [t for j, t in enumerate(seq.token_ids[:seq.num_prompt_tokens]) if j not in pads]
            st = self.state[seq.seq_id] = DraftState(prompt)
        return st

    def _tokens(self, seq: Sequence, st: DraftState) -> list[int]:
        # what the model reads, up to the sequence's last token (never fed yet: its output gives proposal 1)
        return st.prefix + seq.completion_token_ids

    def _catch_up(self, seq: Sequence, k: int) -> list[int]:
        # tokens to feed before the first proposal: what the sequence gained since the model last saw it
        st = self._state(seq)
        ids = self._tokens(seq, st)
        same = 0
        for a, b in zip(st.fed, ids[:-1], strict=False):  # the last token is fed again: its logits give proposal 1
            if a != b:
                break
            same += 1
        self._truncate(st, same)
        new = ids[same:]
        need = max(0, num_blocks_for(same + len(new) + k, self.block_size) - len(st.block_table))
        if need > self.blocks.num_free_blocks - self._reserved:  # the proposer's cache is full: no proposals now
            return []
        self._reserved += need
        return new

    def _truncate(self, st: DraftState, n: int) -> None:
        del st.fed[n:]
        st.num_computed_tokens = n
        self.blocks.truncate(st, n)

    def _forward(self, seqs: list[Sequence], live: list[int], chunks: dict[int, list[int]]):
        states = [self.state[seqs[i].seq_id] for i in live]
        ids, positions, slots = [], [], []
        for i, st in zip(live, states, strict=True):
            n, start = len(chunks[i]), st.num_computed_tokens
            self.blocks.append_slots(st, n)
            ids += chunks[i]
            positions += range(start, start + n)
            slots += slot_mapping(st.block_table, self.block_size, start, start + n)
            st.fed += chunks[i]
            st.num_computed_tokens += n
        meta = AttentionMetadata.build([len(chunks[i]) for i in live], [st.num_computed_tokens for st in states],
                                       [st.block_table for st in states], self.block_size, self.device, slots)
        lm = self.model.language_model
        x = lm.embed_tokens(torch.tensor(ids, device=self.device))  # [T, H]
        hidden = lm(x, torch.tensor(positions, device=self.device), meta, self.kv_caches)
        last = hidden[meta.cu_query_lens[1:].to(self.device).long() - 1]  # [S, H]
        logits = self.model.compute_logits(last).float()  # [S, vocab]
        return self._choose(logits, [seqs[i].sampling.temperature for i in live])

    def _choose(self, logits: torch.Tensor, temps: list[float]) -> tuple[list[int], list[torch.Tensor | None]]:
        # greedy requests take the proposer's argmax; sampled ones draw from it at their temperature
        tokens, probs = logits.argmax(-1).tolist(), [None] * len(temps)
        for j, t in enumerate(temps):
            if t > 0:
                probs[j] = torch.softmax(logits[j] / t, dim=-1)
                tokens[j] = int(torch.multinomial(probs[j], 1, generator=self.generator))
        return tokens, probs

    @classmethod
    def from_dir(cls, path: str | Path, vocab_size: int, num_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DraftProposer:
        model = load_text_lm(path, device, dtype)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model in {path} has {model.config.vocab_size} tokens, the target "
                             f"{vocab_size}; a draft must share the target's tokenizer")
        return cls(model, num_blocks, device=device)


HEAD_DIR = "spec-head"  # the vision-aware head's folder inside a model folder
MODEL_SETTINGS = "vlmq.json"  # a model folder's serving defaults, e.g. {"speculative": "head"}


def model_default_proposer(model_dir: str | Path) -> str | None:
    """The proposer a model folder names (`"speculative"` in its vlmq.json), or None: what the worker runs when
    --speculative / VLMQ_SPECULATIVE is not given. A bad name fails here, naming the file."""
    path = Path(model_dir, MODEL_SETTINGS)
    if not path.is_file():
        return None
    method = json.loads(path.read_text()).get("speculative") or None
    if method is not None:
        try:
            SpecConfig(method)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return method


def make_proposer(method: str, model_dir: Path, model, config, device: torch.device,
                  dtype: torch.dtype) -> Proposer:
    """`method` as in SpecConfig: "ngram", "draft:<path>" (relative paths from the model folder) or "head"."""
    kind, _, path = method.partition(":")
    if kind == "ngram":
        return NgramProposer()
    num_blocks = config.num_blocks + 2 * config.max_num_seqs
    if kind == "draft":
        vocab = model.config.text_config.vocab_size
        return DraftProposer.from_dir(Path(model_dir, path), vocab, num_blocks, device, dtype)
    from .spec_head import HeadProposer  # noqa: PLC0415 - only with a head

    return HeadProposer.from_dir(Path(model_dir, HEAD_DIR), model, device, dtype)


def speculative_config(speculative: str | SpecConfig | None, model_dir: str | Path) -> SpecConfig | None:
    """Engine.from_model_dir's `speculative`: a SpecConfig, a method, "model" (the folder's default) or None/"none"."""
    if speculative == "model":
        speculative = model_default_proposer(model_dir)
    if speculative is None or speculative == "none":
        return None
    return SpecConfig(speculative) if isinstance(speculative, str) else speculative
