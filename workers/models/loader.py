"""Load our Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL / LLaVA-NeXT model code from a local Hugging Face checkpoint
folder.

Reads `config.json` (through transformers' config classes) and every `*.safetensors` file. Both key layouts
are accepted: the original one (`model.layers.*`, `visual.*`, `lm_head.*`, which transformers 5.24 still
writes) and the transformers-5 module layout (`model.language_model.*`, `model.visual.*`, `lm_head.*`).
A model class with its own key layout says so in `checkpoint_prefixes` (InternVL).

With a tensor-parallel group (`tp`), the model is sharded while it is still on the meta device and each rank reads
only its slices of the LM's weights from the files (safetensors' sliced reads): no rank holds the whole model.
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
from vlmq.workers.parallel import TPGroup, shard_language_model

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
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    tp: TPGroup | None = None,
) -> torch.nn.Module:
    """Build the model for `model_dir`'s config on `device` in `dtype` and load its safetensors weights; with `tp`,
    this rank's shard of it (`vlmq.workers.parallel.shard_language_model`), reading only its slices.

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
        if tp is not None:
            shard_language_model(model, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    return tie_and_check(model, _copy_weights(model, files, _slices(model)), _tied(config), model_dir)


def _slices(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (dim, start, end) of the checkpoint tensor it holds (sharded modules' ``tp_slices``)."""
    return {f"{prefix}.{name}" if prefix else name: where for prefix, module in model.named_modules()
            for name, where in getattr(module, "tp_slices", {}).items()}


def tie_and_check(model: torch.nn.Module, loaded: set[str], tied: bool, model_dir: Path) -> torch.nn.Module:
    """Tie the LM head to the embeddings if the config says so; raise ValueError if a weight was not loaded."""
    if tied:
        model.lm_head.weight = model.language_model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = set(dict(model.named_parameters(remove_duplicate=False))) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {sorted(missing)[:8]}")
    return model.eval().requires_grad_(False)


def _copy_weights(model: torch.nn.Module, files: list[Path], slices: dict[str, tuple[int, int, int]]) -> set[str]:
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
                    if name in slices:  # a shard: rows or columns [start, end), zeros past the tensor's end
                        _copy_slice(params[name], f.get_slice(key), *slices[name])
                        loaded.add(name)
                        continue
                    tensor = f.get_tensor(key)
                    if tensor.shape != params[name].shape:
                        raise ValueError(
                            f"weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
    return loaded


def _copy_slice(param: torch.Tensor, source, dim: int, start: int, end: int) -> None:
    shape = list(source.get_shape())
    stop = min(end, shape[dim])
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, stop)
    part = source[tuple(index)]
    if param.shape[dim] != end - start or list(part.shape[:dim] + part.shape[dim + 1:]) != \
            list(param.shape[:dim] + param.shape[dim + 1:]):
        raise ValueError(f"a shard of shape {tuple(param.shape)} cannot hold {shape}[{start}:{end}] on dim {dim}")
    param.zero_()
    param.narrow(dim, 0, stop - start).copy_(part)
