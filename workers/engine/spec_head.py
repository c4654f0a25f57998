"""The vision-aware proposer head (EAGLE-style): one transformer layer over the target's own last hidden states.

The target's hidden state at position j (after its final norm) already carries what the target read from the
image. The head reads, at each position j, the pair (h_j, x_{j+1}) (hidden state, next token):

    f_{j+1} = norm(layer(fc([h_j ; embed(x_{j+1})])))      # a guess of the target's next hidden state
    x_{j+2} ~ lm_head(f_{j+1})                             # the target's own embedding and LM head

and proposes k tokens by feeding its own guesses back: (f_{j+1}, x_{j+2}) -> f_{j+2} -> x_{j+3} ... Its attention
runs over its own cache of the positions from the last prompt token on (that hidden state already sums up the
image and the question; reading the image tokens again costs a long first step and, per ViSpec, a shallow head
averages them away), with the sequence index as rotary position (the target's hidden states carry the M-RoPE
layout). A prompt served whole from the prefix cache has no hidden state here: the head starts after it.
Trained by scripts/train_spec_head.py; shipped as `<model>/spec-head`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from vlmq.workers.layers.norm import RMSNorm
from vlmq.workers.layers.rotary import MRotaryEmbedding, apply_rotary
from vlmq.workers.models.qwen2_vl import DecoderLayer, Qwen2VLModel

from .proposers import Proposal, Proposer
from .sequence import SeqId, Sequence

KV = tuple[torch.Tensor, torch.Tensor]

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

    @classmethod
    def config_for(cls, target_text_config, intermediate_size: int | None = None) -> dict:
        tc = target_text_config
        return dict(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                    num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps,
                    intermediate_size=intermediate_size or tc.intermediate_size, rope_theta=10000.0,
                    hidden_act=tc.hidden_act)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, start: int = 0,
                cache: HeadCache | None = None) -> torch.Tensor:
        """features, embeds: [B, n, H] (h_j and embed(x_{j+1}) of positions start .. start + n - 1) -> guesses of
        h_{j+1} [B, n, H]. cache (B = 1): the keys and values of the positions before; these n go after them."""
        x = self.fc(torch.cat([features, embeds], dim=-1))
        b, n, hidden = x.shape
        attn, layer = self.layer.self_attn, self.layer
        cos, sin = self._rope(start + n, x)
        cos, sin = cos[start:start + n], sin[start:start + n]  # [n, D]
        if b > 1:
            cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
        qkv_w, qkv_b, gate_up_w = self._fused()
        h = _rms_norm(x, layer.input_layernorm).view(b * n, -1)
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        qkv = F.linear(h, qkv_w, qkv_b).view(b * n, heads + 2 * kv_heads, -1)  # q, k and v heads in one call
        qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        if cache is not None:
            k, v = cache.append(k, v)  # [P + n, Hkv, D]
        groups, d = heads // kv_heads, q.shape[-1]
        # grouped-query attention as one batch per KV head: query rows (group, position) share its keys
        q = q.reshape(b, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
        k, v = (t.view(b, -1, kv_heads, d).transpose(1, 2) for t in (k, v))  # [B, Hkv, P + n, D]
        p = k.shape[2] - n  # causal within the new positions, all of the past visible
        mask = None
        if n > 1:
            mask = torch.arange(p + n, device=x.device)[None] <= p + torch.arange(n, device=x.device)[:, None]
            mask = mask.repeat(groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Hkv, G * n, D]
        x = x + attn.o_proj(o.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, -1))
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), gate_up_w).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return _rms_norm(x, self.norm)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # q/k/v and gate/up weights side by side: fewer tensor calls per token (cached when not training)
        fused = getattr(self, "_fused_weights", None)
        if fused is None or self.training:
            a, m = self.layer.self_attn, self.layer.mlp
            fused = (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                     torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                     torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            if not self.training:
                self._fused_weights = fused
        return fused

    def _rope(self, num_positions: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin of positions 0 .. at least num_positions - 1, computed once per doubling
        table = getattr(self, "_rope_table", None)
        if table is None or len(table[0]) < num_positions or table[0].dtype != x.dtype:
            positions = torch.arange(max(512, 2 * num_positions), device=x.device)
            table = self._rope_table = self.rotary(positions, x.dtype)
        return table


class HeadCache:
    """Keys and values of one sequence's head positions, in buffers that grow by doubling."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [capacity, Hkv, D]
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        # k, v: [n, Hkv, D] -> views of every position's keys and values [length + n, Hkv, D]
        end = self.length + len(k)
        if self.k is None or end > len(self.k):
            cap = max(64, 2 * end)
            grown = [torch.empty(cap, *k.shape[1:], dtype=k.dtype, device=k.device) for _ in range(2)]
            if self.k is not None:
                grown[0][:self.length], grown[1][:self.length] = self.k[:self.length], self.v[:self.length]
            self.k, self.v = grown
        self.k[self.length:end], self.v[self.length:end] = k, v
        self.length = end
        return self.k[:end], self.v[:end]


def _rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)  # one fused call (RMSNorm's math)


def load_head(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> SpecHead:
    cfg = json.loads((path / "config.json").read_text())
    head = SpecHead({k: cfg[k] for k in CONFIG_KEYS})
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


@dataclass(slots=True)
class _HeadSeq:
    first: int  # sequence position of the first target hidden state the head has (after any prefix-cache hit)
    # the target's hidden states of positions first .. first + num_features - 1: [n_i, H] pieces, joined when read
    pieces: list[torch.Tensor]
    num_features: int
    fed: list[int] = field(default_factory=list)  # x_{j+1} of each position j in the head's cache
    cache: HeadCache = field(default_factory=lambda: HeadCache())  # the head's keys/values of those positions


class HeadProposer(Proposer):
    """One sequence at a time on a plain per-sequence cache: a one-layer head costs less in tensor calls this way
    than through the paged path (which pays off for a batch; the head runs on small ones, see AdaptiveK)."""

    name = "head"

    def __init__(self, head: SpecHead, target: Qwen2VLModel, device: torch.device | str = "cpu") -> None:
        self.head, self.target, self.device = head, target, torch.device(device)
        self.state: dict[SeqId, _HeadSeq] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(0)

    @classmethod
    def from_dir(cls, path: Path, target: Qwen2VLModel, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> HeadProposer:
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"no proposer head in {path}; train one with scripts/train_spec_head.py, or use "
                             "speculative='ngram' or 'draft:<path>'")
        return cls(load_head(path, device, dtype), target, device)

    def drop(self, seq_id: SeqId) -> None:
        self.state.pop(seq_id, None)

    def reset(self) -> None:
        self.state.clear()

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
            # the head's context starts at the last prompt token (its hidden state sums up image and question)
            skip = max(0, s.seq.num_prompt_tokens - 1 - s.start)
            if skip < valid:
                self._add_features(s.seq_id, s.start + skip, rows[skip:valid])

    def _add_features(self, seq_id: SeqId, start: int, rows: torch.Tensor) -> None:
        # rows: the target's hidden states of positions start .. start + len(rows) - 1
        st = self.state.get(seq_id)
        if st is None or start > st.first + st.num_features:  # first sight, or a gap after a prefix-cache hit
            self.state[seq_id] = _HeadSeq(start, [rows], len(rows))
            return
        have = st.first + st.num_features
        if start + len(rows) > have:  # a view kept until the next proposal: no copy per step
            st.pieces.append(rows[have - start:])
            st.num_features += start + len(rows) - have

    # -- proposing ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._propose(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        st = self.state.get(seq.seq_id)
        if st is None or k < 1:
            return Proposal([])
        # position j reads (h_j, x_{j+1}) for every j with a target hidden state; the last one gives proposal 1
        ids = seq.token_ids[st.first + 1:st.first + 1 + st.num_features]
        # the cache keeps only positions fed with the target's states and real tokens: they stay valid
        same = min(len(st.fed), len(ids) - 1)
        self._truncate(st, same)
        tokens, temp, probs = [], seq.sampling.temperature, []
        if len(st.pieces) > 1:
            st.pieces = [torch.cat(st.pieces)]
        feats, new, known = st.pieces[0][same:], ids[same:], len(ids)
        for _ in range(k):
            guess = self._run(st, feats, new)  # [H]
            logits = self.target.compute_logits(guess).float()
            if temp > 0:
                probs.append(torch.softmax(logits / temp, dim=-1))
                tokens.append(int(torch.multinomial(probs[-1], 1, generator=self.generator)))
            else:
                tokens.append(int(logits.argmax()))
            feats, new = guess[None], [tokens[-1]]  # its own guess stands in for the target's next state
        self._truncate(st, known)  # positions fed with its own guesses are recomputed next time
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _run(self, st: _HeadSeq, feats: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        start = st.first + len(st.fed)
        embeds = self.target.language_model.embed_tokens(torch.tensor(tokens, device=self.device))
        out = self.head(feats[None], embeds[None], start, st.cache)
        st.fed += tokens
        return out[0, -1]

    @staticmethod
    def _truncate(st: _HeadSeq, n: int) -> None:
        del st.fed[n:]
        st.cache.length = n
