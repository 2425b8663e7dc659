"""Reading and writing Hugging Face checkpoints as safetensors (config + weights).

- :func:`load_hf_config` — ``transformers.AutoConfig`` from a checkpoint directory.
- :class:`SafetensorsState` — a lazy, read-only ``Mapping[str, Tensor]`` over a checkpoint's
  ``*.safetensors`` files (single file or sharded with ``model.safetensors.index.json``):
  a rank reads only the tensors it asks for.
- :func:`save_hf_checkpoint` — write ``(name, tensor)`` pairs plus the config as a
  (possibly sharded) safetensors checkpoint that ``transformers`` loads directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_hf_config(path: str | Path) -> Any:
    """The ``transformers`` config of the checkpoint at ``path`` (never reaches the network)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: model.model_path must be a Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


class SafetensorsState(Mapping[str, torch.Tensor]):
    """Lazy ``name -> tensor`` view of a checkpoint directory's safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.path / fname for name, fname in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors in {self.path}: convert the checkpoint with "
                    "save_pretrained(..., safe_serialization=True)"
                )
            self._file_of = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        self._file_of[name] = file
        self._handles: dict[Path, Any] = {}

    def _handle(self, file: Path) -> Any:
        # safe_open memory-maps the file; keep one handle per file instead of reopening per tensor.
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(name)
        return self._handle(self._file_of[name]).get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of


def moe_routing_shape(hf_config: Any) -> tuple[int, int] | None:
    """``(moe_layers, top_k)`` of one token's routed experts (what an engine records for routing replay); None for
    a dense model. Every layer is a MoE layer (the bridges refuse dense layers between sparse ones)."""
    if not int(getattr(hf_config, "num_experts", 0) or 0):
        return None
    return int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok)


def save_hf_checkpoint(
    path: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    hf_config: Any | None = None,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[Path]:
    """Write ``tensors`` as safetensors under ``path`` (and ``config.json`` when ``hf_config`` is given).

    Tensors are consumed one at a time and a shard is flushed when it would exceed
    ``max_shard_bytes``, so peak extra memory is one shard. One shard is written as
    ``model.safetensors``; more as ``model-0000i-of-0000n.safetensors`` with the index
    file ``transformers`` expects. Returns the written weight files.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    shards: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        file = path / f"_shard_{len(shards):05d}.safetensors"
        save_file(current, str(file), metadata={"format": "pt"})
        shards.append(file)
        for name in current:
            weight_map[name] = file.name
        current, current_bytes = {}, 0

    for name, tensor in items:
        if name in weight_map or name in current:
            raise ValueError(f"tensor {name!r} given twice: every checkpoint key must be unique")
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        # safetensors refuses views that share storage; a contiguous CPU copy is always safe.
        current[name] = tensor.detach().to("cpu").contiguous()
        current_bytes += nbytes
        total += nbytes
    flush()

    final: list[Path] = []
    if len(shards) == 1:
        target = path / SINGLE_FILE
        shards[0].replace(target)
        final.append(target)
    else:
        renames = {}
        for i, file in enumerate(shards):
            target = path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            file.replace(target)
            renames[file.name] = target.name
            final.append(target)
        index = {"metadata": {"total_size": total}, "weight_map": {k: renames[v] for k, v in weight_map.items()}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    if hf_config is not None:
        hf_config.save_pretrained(str(path))
    return final
