"""The HF <-> Megatron bridge base class: building, loading and exporting a Megatron GPT model.

A bridge is bound to one Hugging Face config (``get_bridge(hf_config)`` in
:mod:`mcore_agentic.models.registry`) and owns, for that architecture:

- the config mapping (HF config -> Megatron ``TransformerConfig`` + ``GPTModel`` arguments);
- building this rank's pipeline chunk(s) with the local (or TransformerEngine) layer spec;
- per-parameter conversion between *global* Megatron names/tensors and HF names/tensors;
- the tensor-parallel split/merge rule of each parameter;
- loading an HF state dict into this rank's shards, and exporting full HF tensors
  (gathered over TP, broadcast over PP) identically on every rank.

Naming. A *global Megatron name* is a parameter name of the unsplit model: the name
``GPTModel.named_parameters()`` gives with the layer index renumbered to its global
index (``decoder.layers.{0..L-1}.…``). Its *full tensor* is the TP-agnostic tensor:
TP shards concatenated along :meth:`tp_split_dim` — except ``linear_fc1`` of gated MLPs,
whose full tensor is ``[gate; up]`` while each TP shard holds ``[gate_r; up_r]`` (see
:meth:`split_tp` / :meth:`merge_tp`). Vocabulary tensors keep Megatron's padding in
their full form; :meth:`megatron_param_to_hf` removes it.

Subclasses implement the mapping of one architecture family (see ``bridges/``).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm
from mcore_agentic.utils.errors import ConfigError

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class ParallelSizes(Protocol):
    """What the bridge reads from the parallel config (``mcore_agentic.parallel.config.ParallelConfig``)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    sequence_parallel: bool


class BridgeError(ValueError):
    """A checkpoint does not fit the model: a missing/unexpected key or a shape mismatch, named."""


def unwrap_model(chunk: Any) -> Any:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (anything exposing ``.module``)."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _group_rank_size(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class Bridge(ABC):
    """Base class: one subclass per HF ``architectures`` string (see ``registry.py``)."""

    architecture: ClassVar[str]
    """The exact HF ``config.architectures[0]`` this bridge serves."""

    def __init__(self, hf_config: Any, *, make_vocab_size_divisible_by: int = 128, lm_head: bool = True):
        """``lm_head=False``: the model's ``output_layer`` is not the language-model head (a critic's value
        head sits there), so it has no HF tensor and the export skips it."""
        self.hf_config = hf_config
        self.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        self.lm_head = lm_head
        self.check_hf_config(hf_config)

    # ------------------------------------------------------------------ config mapping (per architecture)
    @abstractmethod
    def check_hf_config(self, hf_config: Any) -> None:
        """Raise :class:`ConfigError` naming the HF field when ``hf_config`` uses a feature the bridge lacks."""

    @abstractmethod
    def transformer_config(
        self, hf_config: Any, parallel: ParallelSizes, *, params_dtype: torch.dtype = torch.float32,
        use_te: bool | None = None, **overrides: Any
    ) -> Any:
        """The Megatron ``TransformerConfig`` for ``hf_config`` under ``parallel``; ``overrides`` win.

        ``use_te``: the layer spec the model will be built with (as :meth:`build_model`'s; None: ``auto``), which
        decides the GPU fusions (``transformer_impl.fusion_settings``)."""

    @abstractmethod
    def build_model(self, hf_config: Any, tcfg: Any, *, vp_stage: int | None = None, **kwargs: Any) -> list[Any]:
        """This rank's ``GPTModel`` chunk(s): one per virtual pipeline stage (one when VP is off)."""

    # ------------------------------------------------------------------ per-parameter conversion (per architecture)
    @abstractmethod
    def hf_names(self, global_name: str) -> list[str]:
        """The HF keys the Megatron parameter ``global_name`` is made of (raise naming it if unknown)."""

    @abstractmethod
    def hf_to_megatron_param(
        self, global_name: str, hf_state: Mapping[str, torch.Tensor], *, tp_size: int = 1
    ) -> torch.Tensor:
        """The full Megatron tensor of ``global_name`` built from ``hf_state`` (vocab padded for ``tp_size``)."""

    @abstractmethod
    def megatron_param_to_hf(self, global_name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of one full Megatron tensor (padding removed); [] for a tied duplicate."""

    @abstractmethod
    def tp_split_dim(self, megatron_name: str) -> int | None:
        """Dim TP shards: 0 (column-parallel, vocab-parallel), 1 (row-parallel) or None (replicated)."""

    def is_expert(self, global_name: str) -> bool:
        """True for a parameter of one expert (mixture-of-experts bridges): held by one expert-parallel rank."""
        return False

    def is_gated_fc1(self, megatron_name: str) -> bool:
        """True for the fused ``[gate; up]`` MLP input projection (each TP shard holds ``[gate_r; up_r]``)."""
        return False

    def export_order_key(self, global_name: str) -> tuple:
        """Sort key for the export order: embedding, layers by index, final norm, output layer."""
        match = _LAYER_RE.match(global_name)
        if match:
            return (1, int(match.group(1)), match.group(2))
        if global_name.startswith("embedding."):
            return (0, 0, global_name)
        if global_name.startswith("output_layer."):
            return (3, 0, global_name)
        return (2, 0, global_name)

    # ------------------------------------------------------------------ vocabulary padding
    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron convention)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        vocab = int(self.hf_config.vocab_size)
        return -(-vocab // multiple) * multiple

    # ------------------------------------------------------------------ tensor-parallel split / merge
    def split_tp(self, global_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This TP rank's shard of a full Megatron tensor."""
        dim = self.tp_split_dim(global_name)
        if dim is None or tp_size == 1:
            return full
        if full.shape[dim] % tp_size:
            raise BridgeError(f"{global_name}: dim {dim} of shape {tuple(full.shape)} is not divisible by TP={tp_size}")
        if self.is_gated_fc1(global_name):
            gate, up = full.chunk(2, dim=dim)
            return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
        return full.chunk(tp_size, dim=dim)[tp_rank]

    def merge_tp(self, global_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full Megatron tensor from all TP shards (inverse of :meth:`split_tp`)."""
        dim = self.tp_split_dim(global_name)
        if dim is None or len(shards) == 1:
            return shards[0]
        if self.is_gated_fc1(global_name):
            halves = [s.chunk(2, dim=dim) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        return torch.cat(shards, dim=dim)

    @staticmethod
    def expert_group(chunks: list[Any]) -> Any:
        """The model's expert-parallel group when it has more than one rank, else None: the group the model was
        built with (``pg_collection``: the engine's ``ParallelLayout.process_groups()``), as TP and PP are read."""
        pgs = getattr(unwrap_model(chunks[0]), "pg_collection", None)
        group = getattr(pgs, "ep", None) if pgs is not None else None
        return group if _group_rank_size(group)[1] > 1 else None

    # ------------------------------------------------------------------ naming
    @staticmethod
    def global_name(chunk: Any, local_name: str) -> str:
        """``chunk``'s parameter name with the decoder layer index made global (``layer_number - 1``)."""
        match = _LAYER_RE.match(local_name)
        if not match:
            return local_name
        layer = chunk.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"

    def local_params(self, chunks: list[Any]) -> dict[str, torch.nn.Parameter]:
        """Global Megatron name -> this rank's parameter, over all chunks."""
        out: dict[str, torch.nn.Parameter] = {}
        for chunk in map(unwrap_model, chunks):
            for local_name, param in chunk.named_parameters():
                name = self.global_name(chunk, local_name)
                if name in out:
                    raise BridgeError(f"{name} appears in two model chunks of this rank")
                out[name] = param
        return out

    # ------------------------------------------------------------------ import
    def load_hf_weights(self, chunks: list[Any], hf_state: Mapping[str, torch.Tensor] | str | Path) -> None:
        """Copy ``hf_state`` (a mapping or a checkpoint directory) into this rank's shards of ``chunks``.

        Every parameter's HF source must exist with the HF shape, every shard must match
        the parameter's shape, and every HF key must be used by some pipeline stage
        (checked over the PP group); otherwise :class:`BridgeError` names the key.
        """
        if isinstance(hf_state, (str, Path)):
            from mcore_agentic.models.hf_io import SafetensorsState

            hf_state = SafetensorsState(hf_state)
        tp_rank, tp_size = _group_rank_size(unwrap_model(chunks[0]).tp_group)
        used: set[str] = set()
        error: str | None = None
        try:
            for name, param in self.local_params(chunks).items():
                full = self.hf_to_megatron_param(name, hf_state, tp_size=tp_size)
                shard = self.split_tp(name, full, tp_rank, tp_size)
                if tuple(shard.shape) != tuple(param.shape):
                    raise BridgeError(
                        f"{name} (from HF {self.hf_names(name)}): TP shard shape {tuple(shard.shape)} != "
                        f"model parameter shape {tuple(param.shape)}: the checkpoint does not match the config"
                    )
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
                used.update(self.hf_names(name))
        except BridgeError as exc:
            error = str(exc)
        # Exchange over PP even after an error, so every stage raises instead of one hanging in a collective
        # (TP and DP peers load the same names and fail alike). With expert parallelism each EP rank loads its
        # own experts: the exchange is then over the world (once, at load).
        group = None if self.expert_group(chunks) is not None else unwrap_model(chunks[0]).pp_group
        size = dist.get_world_size() if group is None and dist.is_initialized() else _group_rank_size(group)[1]
        stages: list[Any] = [(sorted(used), error)]
        if size > 1:
            stages = comm.all_gather_object((sorted(used), error), group=group)
        errors = [f"rank {i} of the pipeline/expert group: {err}" for i, (_, err) in enumerate(stages) if err is not None]
        if errors:
            raise BridgeError("; ".join(errors))
        used = set().union(*(set(names) for names, _ in stages))
        unused = sorted(set(hf_state) - used - set(self.ignored_hf_keys(hf_state)))
        if unused:
            raise BridgeError(
                f"HF checkpoint keys not mapped to any Megatron parameter: {unused[:8]}"
                f"{' …' if len(unused) > 8 else ''} (architecture {self.architecture}): the checkpoint has "
                "weights this bridge does not support"
            )

    def ignored_hf_keys(self, hf_state: Mapping[str, torch.Tensor]) -> list[str]:
        """HF keys that legitimately have no Megatron parameter (e.g. a tied ``lm_head.weight`` copy)."""
        return []

    # ------------------------------------------------------------------ export
    def export_hf_weights(self, chunks: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every HF ``(name, tensor)`` of the full model, identically on every rank.

        Parameters are visited in one global order agreed over the PP group; each is
        all-gathered over TP on its owning stage (an expert broadcast there from the expert-parallel
        rank that holds it), broadcast from there over PP, then
        converted by :meth:`megatron_param_to_hf` (vocabulary padding removed). Every rank
        must iterate the generator to the end (it runs collectives). Yielded tensors are
        fresh copies, never views of the parameters.
        """
        local = self.local_params(chunks)
        model = unwrap_model(chunks[0])
        tp_group, pp_group, ep_group = model.tp_group, model.pp_group, self.expert_group(chunks)
        _, tp_size = _group_rank_size(tp_group)
        pp_rank, pp_size = _group_rank_size(pp_group)
        ep_rank, ep_size = _group_rank_size(ep_group)
        # name -> (full shape, dtype, the EP rank holding it: None for a parameter every EP rank holds)
        meta = {
            name: (self._full_shape(name, p, tp_size), str(p.dtype).removeprefix("torch."),
                   ep_rank if self.is_expert(name) else None)
            for name, p in local.items()
        }
        if ep_size > 1:  # each EP rank lists its own experts: merge the lists within the stage
            per_ep = comm.all_gather_object(meta, group=ep_group)
            meta = {name: m for part in per_ep for name, m in part.items()}
        if pp_size > 1:
            per_stage = comm.all_gather_object(meta, group=pp_group)
        else:
            per_stage = [meta]
        owner: dict[str, int] = {}
        for stage, stage_meta in enumerate(per_stage):
            for name in stage_meta:
                owner.setdefault(name, stage)
        for name in sorted(owner, key=self.export_order_key):
            if self.skip_on_export(name):
                continue
            src = owner[name]
            shape, dtype, ep_src = per_stage[src][name]
            if src == pp_rank and name in local:
                full = self._gather_tp(name, local[name], tp_group, tp_size)
            else:
                full = comm.device_empty(*shape, dtype=getattr(torch, dtype), device=self._device(chunks))
            if src == pp_rank and ep_src is not None and ep_size > 1:  # an expert: from the EP rank that holds it
                comm.broadcast_device(full, group=ep_group, group_src=ep_src)
            if pp_size > 1:
                comm.broadcast_device(full, group=pp_group, group_src=src)
            yield from self.megatron_param_to_hf(name, full)

    def skip_on_export(self, global_name: str) -> bool:
        """True for parameters with no HF tensor of their own: the tied output layer on the last PP stage
        (a copy of the embedding), and the output layer of a model built with ``lm_head=False``."""
        return global_name == "output_layer.weight" and not self.lm_head

    def _full_shape(self, name: str, param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
        shape = list(param.shape)
        dim = self.tp_split_dim(name)
        if dim is not None:
            shape[dim] *= tp_size
        return tuple(shape)

    def _gather_tp(self, name: str, param: torch.Tensor, tp_group: Any, tp_size: int) -> torch.Tensor:
        data = param.detach()
        if self.tp_split_dim(name) is None or tp_size == 1:
            return data.clone()
        shards = [comm.device_empty(*data.shape, dtype=data.dtype, device=data.device) for _ in range(tp_size)]
        comm.all_gather_device(shards, data.contiguous(), group=tp_group)
        return self.merge_tp(name, shards)

    @staticmethod
    def _device(chunks: list[Any]) -> torch.device:
        return next(chunks[0].parameters()).device


def hf_tensor(hf_state: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...], owner: str) -> torch.Tensor:
    """``hf_state[key]`` checked against the expected HF ``shape``; raise naming the key otherwise."""
    if key not in hf_state:
        raise BridgeError(f"HF checkpoint lacks {key!r} (needed for Megatron {owner})")
    tensor = hf_state[key]
    if tuple(tensor.shape) != tuple(shape):
        raise BridgeError(f"HF {key!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} from the config")
    return tensor


def config_error(field: str, message: str) -> ConfigError:
    """A :class:`ConfigError` for an HF config field (``hf_config.<field>``)."""
    return ConfigError(f"hf_config.{field}", message)
