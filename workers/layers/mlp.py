import torch
from torch import nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the Qwen2 LM MLP (no bias) and the Qwen2.5-VL vision MLP (bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))): the Qwen2-VL vision block MLP."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = ACT2FN[act]
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
