"""Expert load of a mixture-of-experts model: how evenly its routers spread tokens over the experts.

:class:`RouterLoad` hooks every Megatron ``TopKRouter`` of a model and counts, per MoE layer, the tokens
each expert was chosen for (the routing map's column sums) over the passes since the last
:meth:`RouterLoad.pop`. ``pop`` sums the counts over the ranks that route different tokens (data and
context parallel; expert-parallel ranks are among them) and returns:

* ``moe/load_imbalance``: per layer the busiest expert's tokens over the mean, averaged over the layers
  (1.0: perfectly even; ``num_experts / top_k`` at worst);
* ``moe/load_imbalance_max``: the same for the worst layer;
* ``moe/idle_experts``: experts that got no token, summed over the layers.

The routing is dropless (no capacity factor), so no token is dropped and none is reported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm


class RouterLoad:
    """Token counts per expert of each MoE layer of ``chunks`` (see the module docstring)."""

    def __init__(self, chunks: list[Any]):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[int, torch.Tensor] = {}
        self.handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._hook))

    @property
    def enabled(self) -> bool:
        return bool(self.handles)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        routing_map = output[1]
        layer = int(module.layer_number or 0)
        counts = routing_map.detach().sum(dim=0, dtype=torch.float64)  # stays on the device: no sync per layer
        self.counts[layer] = self.counts[layer] + counts if layer in self.counts else counts

    def pop(self, token_group: Any = None, pp_group: Any = None) -> dict[str, float]:
        """The metrics of the counts so far (reset). Collective over ``token_group`` (the ranks whose tokens
        differ: DP x CP) and ``pp_group`` (each stage holds other layers); {} for a dense model."""
        if not self.enabled:
            return {}
        layers = sorted(self.counts)
        # Host calls: one copy of the step's count table to the host, then gloo (the metrics are floats).
        table = comm.to_host(torch.stack([self.counts[k] for k in layers]) if layers else torch.zeros(0, 0), torch.float64)
        self.counts = {}
        if token_group is not None and table.numel():
            comm.all_reduce_host(table, group=token_group)
        mean = table.mean(dim=1).clamp(min=1e-12) if table.numel() else table.new_zeros(0)
        ratio = table.max(dim=1).values / mean if table.numel() else table.new_zeros(0)
        sums = comm.to_host([float(ratio.sum()), float(len(layers)), float((table == 0).sum())], torch.float64)
        worst = comm.to_host([float(ratio.max()) if len(layers) else 0.0], torch.float64)
        if pp_group is not None:
            comm.all_reduce_host(sums, group=pp_group)
            comm.all_reduce_host(worst, op=dist.ReduceOp.MAX, group=pp_group)
        if sums[1] == 0:
            return {}
        return {
            "moe/load_imbalance": float(sums[0] / sums[1]),
            "moe/load_imbalance_max": float(worst[0]),
            "moe/idle_experts": float(sums[2]),
        }
