"""Load our Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL / LLaVA-NeXT model code from a local Hugging Face checkpoint
folder.

Reads `config.json` (through transformers' config classes) and every `*.safetensors` file. Both key layouts
are accepted: the original one (`model.layers.*`, `visual.*`, `lm_head.*`, which transformers 5.24 still
writes) and the transformers-5 module layout (`model.language_model.*`, `model.visual.*`, `lm_head.*`).
A model class with its own key layout says so in `checkpoint_prefixes` (InternVL).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from vlmq.workers.models.internvl import InternVLModel
from vlmq.workers.models.llava_next import LlavaNextModel
from vlmq.workers.models.qwen2_5_vl import Qwen2_5_VLModel
from vlmq.workers.models.qwen2_vl import Qwen2VLModel
from vlmq.workers.models.qwen3_vl import Qwen3VLModel

MODEL_CLASSES: dict[str, type[torch.nn.Module]] = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel,
                                                   "qwen3_vl": Qwen3VLModel, "internvl": InternVLModel,
                                                   "llava_next": LlavaNextModel}

# checkpoint key prefix -> our module prefix, first match wins (new layout before the old "model." catch-all)
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("lm_head.", "lm_head."),
    ("model.", "language_model."),
)


def checkpoint_key_to_param(key: str, prefixes: tuple[tuple[str, str], ...] = _PREFIXES) -> str | None:
    for old, new in prefixes:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def _tied(config) -> bool:
    tie = getattr(config, "tie_word_embeddings", None)
    return bool(tie if tie is not None else getattr(config.text_config, "tie_word_embeddings", False))


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """Build the model for `model_dir`'s config on `device` in `dtype` and load its safetensors weights.

    Raises:
        ValueError: unsupported model type, no safetensors files, unknown or missing weights.
    """
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    cls = MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; expected one of {list(MODEL_CLASSES)}")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}; save the checkpoint with safe_serialization")
    with torch.device("meta"):
        model = cls(config)  # no memory and no random init; real storage comes next
    model = model.to(dtype=dtype).to_empty(device=device)
    return tie_and_check(model, _copy_weights(model, files), _tied(config), model_dir)


def tie_and_check(model: torch.nn.Module, loaded: set[str], tied: bool, model_dir: Path) -> torch.nn.Module:
    """Tie the LM head to the embeddings if the config says so; raise ValueError if a weight was not loaded."""
    if tied:
        model.lm_head.weight = model.language_model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = set(dict(model.named_parameters(remove_duplicate=False))) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {sorted(missing)[:8]}")
    return model.eval().requires_grad_(False)


def _copy_weights(model: torch.nn.Module, files: list[Path]) -> set[str]:
    params = dict(model.named_parameters())
    prefixes = getattr(model, "checkpoint_prefixes", _PREFIXES)
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = checkpoint_key_to_param(key, prefixes)
                    if name not in params:
                        raise ValueError(f"unexpected weight {key!r} in {path.name} (maps to {name!r})")
                    tensor = f.get_tensor(key)
                    if tensor.shape != params[name].shape:
                        raise ValueError(
                            f"weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
    return loaded
