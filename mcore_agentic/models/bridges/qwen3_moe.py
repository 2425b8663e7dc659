"""Bridge for ``Qwen3MoeForCausalLM``: the Qwen3 layout with a mixture-of-experts MLP in every layer.

Routing: softmax over all experts, top-k, renormalised when ``norm_topk_prob`` (HF). Megatron's
``moe_router_pre_softmax=False`` (top-k of the logits, then a softmax over the k) is the same
renormalised distribution; ``norm_topk_prob=False`` is ``pre_softmax=True``. No shared expert.

Experts. With the TransformerEngine spec (on CUDA) they are megatron-core's ``TEGroupedMLP``: one grouped GEMM per
projection over a rank's local experts (``moe_grouped_gemm``, as Megatron names it), whose parameters TE names
``weight<j>`` per local expert ``j``. With the local spec (CPU) they are ``SequentialMLP``, one MLP per expert: the
local spec's grouped alternative, megatron's ``GroupedMLP``, needs the ``grouped_gemm`` CUDA package and keeps all
experts in one ``weight1``/``weight2`` (see :meth:`Qwen3MoeBridge.layer_spec`). Either way the per-expert tensors
have the same layout, ``[2I, H]`` and ``[H, I]``.

Megatron (global names: the expert index is the *global* one, ``ep_rank * E / EP + j`` for local
expert ``j``)                                       HF (the per-expert names transformers writes to disk)
``decoder.layers.i.mlp.router.weight [E, H]``       ``model.layers.i.mlp.gate.weight``
``decoder.layers.i.mlp.experts.linear_fc1.weight<e> [2I, H]`` (grouped)
``decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight [2I, H]`` (sequential)
                                                    ``[model.layers.i.mlp.experts.e.gate_proj.weight; ...up_proj.weight]``
``decoder.layers.i.mlp.experts.linear_fc2.weight<e> [H, I]`` (grouped)
``decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight [H, I]`` (sequential)
                                                    ``model.layers.i.mlp.experts.e.down_proj.weight``

Experts are whole on each expert-parallel rank (expert TP = 1): a rank loads only its own experts,
and the export gathers them over the EP group (:class:`~mcore_agentic.models.bridge.Bridge`).
A second MoE family (DeepSeek-V3-style shared experts, GPT-OSS) is another subclass: its router
settings in :meth:`moe_kwargs`, its extra names in :meth:`hf_names` / :meth:`_hf_shape`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mcore_agentic.models.bridge import ParallelSizes, config_error
from mcore_agentic.models.bridges.qwen3 import Qwen3Bridge
from mcore_agentic.utils.errors import ConfigError

# An expert's parameter within its layer: SequentialMLP's ``local_experts.<e>.<fc>.weight`` or TEGroupedMLP's
# ``<fc>.weight<e>`` (TE's GroupedLinear names one weight per GEMM).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<seq_fc>linear_fc[12])\.weight"
    r"|(?P<grouped_fc>linear_fc[12])\.weight(?P<grouped>\d+))$"
)
# The same in a layer-local name, split around the local expert index that global_name makes global.
_LOCAL_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts\.(?:local_experts\.|linear_fc[12]\.weight))(\d+)(\..+)?$"
)
_HF_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeBridge(Qwen3Bridge):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): sparse MLP layers with ``num_experts`` experts, ``num_experts_per_tok`` active."""

    architecture = "Qwen3MoeForCausalLM"

    # ------------------------------------------------------------------ config
    def check_hf_config(self, hf_config: Any) -> None:
        super().check_hf_config(hf_config)
        if list(getattr(hf_config, "mlp_only_layers", None) or []) or int(getattr(hf_config, "decoder_sparse_step", 1)) != 1:
            raise config_error(
                "mlp_only_layers",
                "dense layers between sparse ones (mlp_only_layers / decoder_sparse_step != 1) are not supported yet: "
                "every layer must be a mixture of experts (as in Qwen3-30B-A3B)",
            )
        if int(hf_config.num_experts_per_tok) < 2 and bool(hf_config.norm_topk_prob):
            raise config_error(
                "num_experts_per_tok",
                "=1 with norm_topk_prob: Megatron's router renormalises only with top-k >= 2; use 2 or more",
            )

    def moe_kwargs(self, hf_config: Any, parallel: ParallelSizes) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of the experts and the router."""
        ep = int(getattr(parallel, "expert_model_parallel_size", 1))
        experts = int(hf_config.num_experts)
        if experts % ep:
            raise config_error("num_experts", f"{experts} experts do not split over expert_model_parallel_size={ep}")
        return dict(
            num_moe_experts=experts,
            moe_router_topk=int(hf_config.num_experts_per_tok),
            moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
            moe_layer_freq=[1] * int(hf_config.num_hidden_layers),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
            # RL trains with no load-balancing loss by default (the policy's routing is what it is); Megatron's
            # per-token loss scaling would also weigh it by the local token count.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=int(getattr(parallel, "expert_tensor_parallel_size", 1)),
        )

    def transformer_config(
        self, hf_config: Any, parallel: ParallelSizes, *, params_dtype: torch.dtype = torch.float32,
        use_te: bool | None = None, **overrides: Any
    ) -> Any:
        """The dense mapping, the MoE fields, and ``moe_grouped_gemm``: on with the TE spec (``use_te``; None: auto),
        off with the local spec (:meth:`layer_spec` builds the experts it names). An override wins."""
        from mcore_agentic.models.transformer_impl import te_spec_here

        grouped = {"moe_grouped_gemm": te_spec_here(use_te)}
        return super().transformer_config(
            hf_config, parallel, params_dtype=params_dtype, use_te=use_te,
            **{**self.moe_kwargs(hf_config, parallel), **grouped, **overrides},
        )

    # ------------------------------------------------------------------ model
    def layer_spec(self, tcfg: Any, *, use_te: bool | None = None) -> Any:
        from mcore_agentic.models.bridges._dense import _te_usable

        if use_te is None:
            use_te = _te_usable()
        experts = tcfg.num_moe_experts
        grouped = bool(tcfg.moe_grouped_gemm)
        if use_te:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
            from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

            # Grouped: TEGroupedMLP, one grouped GEMM per projection over the local experts (weight<j> per expert).
            spec = get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=grouped, qk_layernorm=self.qk_layernorm
            )
            built = spec.submodules.mlp.submodules.experts.module
            if built is not (TEGroupedMLP if grouped else SequentialMLP):  # megatron's legacy GroupedMLP (old TE)
                raise ConfigError("moe_grouped_gemm", f"megatron-core chose {built.__name__} for the experts: this "
                                  "TransformerEngine has no GroupedLinear (TE >= 1.9), and the bridge maps "
                                  "TEGroupedMLP's and SequentialMLP's parameters only")
            return spec
        if grouped:
            raise ConfigError("moe_grouped_gemm", "is TransformerEngine's grouped GEMM (TEGroupedMLP): the local spec "
                              "runs the experts as SequentialMLP (megatron's local GroupedMLP needs the grouped_gemm "
                              "CUDA package); build the transformer config with use_te=False, or leave it false")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if tcfg.sequence_parallel:  # the dense local spec takes it; its experts under SP are not tested on CPU
            raise config_error("sequence_parallel", "with experts needs the TransformerEngine layer spec (GPU): "
                               "set it to false")
        spec = get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=self.qk_layernorm, normalization="RMSNorm"
        )
        from mcore_agentic.models.bridges._dense import with_local_norms
        from mcore_agentic.parallel.local_attention import LocalDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = LocalDotProductAttention
        return with_local_norms(spec)

    # ------------------------------------------------------------------ naming
    def global_name(self, chunk: Any, local_name: str) -> str:  # type: ignore[override]
        """The base's global layer index, and the global expert index of a local expert (sequential or grouped)."""
        name = super().global_name(chunk, local_name)
        match = _LOCAL_EXPERT.match(name)
        if not match:
            return name
        local_layer = int(local_name.split(".")[2])
        indices = chunk.decoder.layers[local_layer].mlp.local_expert_indices
        return f"{match.group(1)}{indices[int(match.group(2))]}{match.group(3) or ''}"

    def expert(self, global_name: str) -> tuple[int, str] | None:
        """``(global expert index, "linear_fc1" | "linear_fc2")`` of an expert's parameter, else None."""
        _, suffix = self._split(global_name)
        match = _EXPERT.match(suffix)
        if match is None:
            return None
        if match.group("seq") is not None:
            return int(match.group("seq")), match.group("seq_fc")
        return int(match.group("grouped")), match.group("grouped_fc")

    def is_expert(self, global_name: str) -> bool:
        return self.expert(global_name) is not None

    def hf_names(self, global_name: str) -> list[str]:
        layer, suffix = self._split(global_name)
        if layer is not None:
            prefix = f"model.layers.{layer}.mlp."
            if suffix == "mlp.router.weight":
                return [prefix + "gate.weight"]
            found = self.expert(global_name)
            if found is not None:
                e, fc = found
                if fc == "linear_fc1":
                    return [f"{prefix}experts.{e}.gate_proj.weight", f"{prefix}experts.{e}.up_proj.weight"]
                return [f"{prefix}experts.{e}.down_proj.weight"]
        return super().hf_names(global_name)

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
        c = self.hf_config
        if leaf == "mlp.gate.weight":
            return (int(c.num_experts), int(c.hidden_size))
        match = _HF_EXPERT.match(leaf)
        if match:
            inner, hidden = int(c.moe_intermediate_size), int(c.hidden_size)
            return (hidden, inner) if match.group(1) == "down_proj" else (inner, hidden)
        return super()._hf_shape(hf_name)

    def _expert_fc1(self, global_name: str) -> bool:
        found = self.expert(global_name)
        return found is not None and found[1] == "linear_fc1"

    def hf_to_megatron_param(self, global_name: str, hf_state: Any, *, tp_size: int = 1) -> torch.Tensor:
        if self._expert_fc1(global_name):
            from mcore_agentic.models.bridge import hf_tensor

            names = self.hf_names(global_name)
            return torch.cat([hf_tensor(hf_state, n, self._hf_shape(n), global_name) for n in names], dim=0)
        return super().hf_to_megatron_param(global_name, hf_state, tp_size=tp_size)

    def megatron_param_to_hf(self, global_name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self._expert_fc1(global_name):
            names = self.hf_names(global_name)
            return [(n, t.contiguous()) for n, t in zip(names, full_tensor.chunk(2, dim=0), strict=True)]
        return super().megatron_param_to_hf(global_name, full_tensor)
