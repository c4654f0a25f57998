"""The vision-aware proposer head (EAGLE-style): one transformer layer over the target's own last hidden states.

The target's hidden state at position j (after its final norm) already carries what the target read from the
image. The head reads, at each position j, the pair (h_j, x_{j+1}) (hidden state, next token):

    f_{j+1} = norm(layer(fc([h_j ; embed(x_{j+1})])))      # a guess of the target's next hidden state
    x_{j+2} ~ lm_head(f_{j+1})                             # the target's own embedding and LM head

and proposes k tokens by feeding its own guesses back: (f_{j+1}, x_{j+2}) -> f_{j+2} -> x_{j+3} ... Its attention
runs over its own paged KV of the sequence's positions, with the sequence index as rotary position (the target's
hidden states carry the M-RoPE layout). Positions whose KV came from the prefix cache have no target hidden state
here: the head starts after them. Trained by scripts/train_spec_head.py; shipped as `<model>/spec-head`.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from torch import nn

from vlmq.workers.layers.attention import AttentionMetadata
from vlmq.workers.layers.norm import RMSNorm
from vlmq.workers.layers.rotary import MRotaryEmbedding
from vlmq.workers.models.qwen2_vl import DecoderLayer, Qwen2VLModel

from .proposers import PagedProposer, PagedState
from .sequence import SeqId, Sequence

CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
               "rope_theta", "hidden_act")


class SpecHead(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        tc = SimpleNamespace(**cfg)
        self.config = cfg
        self.fc = nn.Linear(2 * tc.hidden_size, tc.hidden_size)
        self.layer = DecoderLayer(tc)
        self.norm = RMSNorm(tc.hidden_size, tc.rms_norm_eps)
        head_dim = tc.hidden_size // tc.num_attention_heads
        self.rotary = MRotaryEmbedding(head_dim, tc.rope_theta, [head_dim // 2, 0, 0])
        self.num_kv_heads, self.head_dim = tc.num_key_value_heads, head_dim

    @classmethod
    def config_for(cls, target_text_config, intermediate_size: int | None = None) -> dict:
        tc = target_text_config
        return dict(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                    num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps,
                    intermediate_size=intermediate_size or tc.intermediate_size, rope_theta=10000.0,
                    hidden_act=tc.hidden_act)

    def inputs(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([features, embeds], dim=-1))  # [n, 2H] -> [n, H]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, meta, kv))

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None):
        w = self.fc.weight
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kw = {"dtype": dtype or w.dtype, "device": device or w.device}
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw))]


def load_head(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> SpecHead:
    cfg = json.loads((path / "config.json").read_text())
    head = SpecHead({k: cfg[k] for k in CONFIG_KEYS})
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


class HeadProposer(PagedProposer):
    name = "head"

    def __init__(self, head: SpecHead, target: Qwen2VLModel, num_blocks: int, device: torch.device | str = "cpu",
                 block_size: int = 16) -> None:
        super().__init__(head, num_blocks, block_size, device)
        self.target = target

    @classmethod
    def from_dir(cls, path: Path, target: Qwen2VLModel, num_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> HeadProposer:
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"no proposer head in {path}; train one with scripts/train_spec_head.py, or use "
                             "speculative='ngram' or 'draft:<path>'")
        return cls(load_head(path, device, dtype), target, num_blocks, device)

    # -- what the target computed ----------------------------------------------------------------
    def observe(self, out, runner_out, hidden: torch.Tensor | None) -> None:
        row = 0
        for s in out.scheduled:
            rows, row = hidden[row:row + s.num_new_tokens], row + s.num_new_tokens
            if s.seq.is_finished:
                continue
            valid = s.num_new_tokens - s.num_spec_tokens
            if s.sample:
                valid += len(runner_out.more_token_ids.get(s.seq_id, ()))
            self._add_features(s.seq_id, s.start, rows[:valid])

    def _add_features(self, seq_id: SeqId, start: int, rows: torch.Tensor) -> None:
        # rows: the target's hidden states of positions start .. start + len(rows) - 1
        st = self.state.get(seq_id)
        have = st.first + num_features(st) if st is not None else -1
        if st is None or start > have:  # first sight, or a gap (readmitted after a prefix-cache hit): start over
            self.drop(seq_id)
            st = self.state[seq_id] = PagedState([], first=start)
            have = start
        if start + len(rows) > have:
            st.features = [torch.cat([*st.features, rows[have - start:]])]

    def propose(self, seqs: list[Sequence], ks: list[int]):
        known = {seq.seq_id: num_features(self.state[seq.seq_id]) for seq in seqs if seq.seq_id in self.state}
        out = super().propose(seqs, ks)
        for seq_id, n in known.items():  # positions fed with the head's own guesses are recomputed next time
            st = self.state[seq_id]
            self._truncate(st, min(st.num_computed_tokens, n))
        return out

    # -- hooks of PagedProposer ------------------------------------------------------------------------
    def _state(self, seq: Sequence) -> PagedState | None:
        return self.state.get(seq.seq_id)

    def _tokens(self, seq: Sequence, st: PagedState) -> list[int]:
        # position j reads (h_j, x_{j+1}) for every j with a target hidden state; the last one gives proposal 1
        return seq.token_ids[st.first + 1:st.first + 1 + num_features(st)]

    def _inputs(self, st: PagedState, tokens: list[int]) -> torch.Tensor:
        start, n = st.num_computed_tokens, len(tokens)
        if start + n <= num_features(st):
            feats = st.features[0][start:start + n]
        else:  # past the target's hidden states (a proposal): the head's own guess of the last one
            feats = st.spec_feature[None]
        embeds = self.target.language_model.embed_tokens(torch.tensor(tokens, device=self.device))
        return self.model.inputs(feats, embeds)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(x, positions, meta, self.kv_caches[0])

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(last).float()


def num_features(st: PagedState) -> int:
    return len(st.features[0]) if st.features else 0
