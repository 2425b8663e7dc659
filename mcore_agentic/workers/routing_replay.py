"""Routing replay for a mixture-of-experts actor: its routers take the experts the rollout engine chose.

The engine and the trainer run the same weights through different kernels and precisions, so some tokens'
routers pick different experts; the trainer's log-probs of the sampled tokens then jump and the update
destabilises. Replay ("R3": slime, verl, NeMo-RL, AReaL) records the engine's top-k per token and MoE
layer (``routed_experts``, see :mod:`mcore_agentic.rollout.engines.base`) and routes the trainer's forward
through exactly those experts; the router's gate weights are still computed from the trainer's own scores
at the chosen experts, so its gradient flows as usual.

:class:`EngineRouting` plugs into megatron-core's router-replay hook (``TopKRouter.router_replay``, which
``topk_routing_with_score_function`` asks for the top-k) as one object per router, so the actor, reference
and critic of one process never share state (megatron's own ``RouterReplay`` keeps a process-wide list of
every router). Per micro-batch it gets the engine's experts of the tokens this rank's router sees; it always
computes the router's own top-k too and counts the tokens whose top-k *set* agrees with the engine's
(``rollout/routing_agreement``), then returns the engine's (replay) or its own. Tokens the engine never fed
(the last sampled token, padding) carry -1 and keep the router's own choice: their outputs predict nothing
that is trained.

Token order: a router sees ``[s, b]`` flattened (``s`` the CP-local sequence; packed micro-batches have
``b = 1``), and with sequence parallelism only this tensor-parallel rank's ``s / tp`` slice. MoE layer ``i``
of the record is the model's layer ``i`` (every layer is a MoE layer: the bridge refuses mixed ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mcore_agentic.parallel import comm

ROUTING_REPLAY_MODES = ("disable", "measure", "rollout")


class EngineRouting:
    """One router's replay target and agreement counts (the module docstring)."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        """``[tokens, top_k]`` long, the engine's experts of the tokens this router sees (-1: unknown)."""
        self.replay = False
        self.measure = False
        self.agree = torch.zeros((), dtype=torch.float64)
        self.known = torch.zeros((), dtype=torch.float64)

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, own
        target = self.target.to(scores.device)
        if target.shape != own.shape:
            raise RuntimeError(
                f"routing replay: the engine's record has {tuple(target.shape)} expert ids for this micro-batch's "
                f"router, which routes {tuple(own.shape)}: the rows' routed_experts do not match their tokens"
            )
        known = (target >= 0).all(dim=-1)
        if self.measure:
            same = (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1) & known
            self.agree = self.agree.to(scores.device) + same.sum(dtype=torch.float64)
            self.known = self.known.to(scores.device) + known.sum(dtype=torch.float64)
        if not self.replay:
            return probs, own
        chosen = torch.where(known.unsqueeze(-1), target, own)
        return scores.gather(1, chosen), chosen


class RoutingReplay:
    """The :class:`EngineRouting` of every router of a model's chunks, and the per-pass switches."""

    def __init__(self, chunks: list[Any], *, sequence_parallel: bool, tp_size: int, tp_rank: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers: dict[int, list[tuple[int, EngineRouting]]] = {}
        for chunk in chunks:
            own = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if getattr(module.config, "moe_router_fusion", False):
                        raise ValueError("actor.moe.routing_replay needs the unfused router (moe_router_fusion=False)")
                    module.router_replay = EngineRouting()
                    own.append((int(module.layer_number) - 1, module.router_replay))
            self.routers[id(chunk)] = own
        self.split = tp_size if sequence_parallel else 1
        self.tp_rank = tp_rank if sequence_parallel else 0
        self.replay = False
        self.measure = False

    @property
    def enabled(self) -> bool:
        return any(self.routers.values())

    @contextlib.contextmanager
    def use(self, *, replay: bool, measure: bool) -> Iterator[None]:
        """Within: micro-batches that carry routing replay it and/or count agreement with it."""
        self.replay, self.measure = replay, measure
        try:
            yield
        finally:
            self.replay = self.measure = False
            for routers in self.routers.values():
                for _, router in routers:
                    router.target = None

    def set_micro_batch(self, chunk: Any, routing: torch.Tensor | None) -> None:
        """Before ``chunk``'s forward of a micro-batch: its routing ``[s, b, moe_layers, top_k]`` (the router
        token order; None: route freely)."""
        active = routing is not None and (self.replay or self.measure)
        if active and self.split > 1:
            s = routing.shape[0] // self.split
            routing = routing[self.tp_rank * s : (self.tp_rank + 1) * s]
        for layer, router in self.routers.get(id(chunk), []):
            router.replay, router.measure = self.replay, self.measure
            router.target = routing[:, :, layer].reshape(-1, routing.shape[-1]) if active else None

    def pop_agreement(self) -> dict[str, float]:
        """``rollout/routing_agreement`` over the tokens measured since the last call, over every rank (a
        rank's duplicates, e.g. tensor-parallel peers without sequence parallelism, count on both sides of
        the ratio); {} when nothing was measured. Collective over the world."""
        routers = [r for rs in self.routers.values() for _, r in rs]
        local = torch.zeros(2, dtype=torch.float64)
        for r in routers:  # once per step: a host copy of each router's two counters
            local += torch.stack([r.agree.detach().double().cpu(), r.known.detach().double().cpu()])
        for r in routers:
            r.agree = torch.zeros((), dtype=torch.float64)
            r.known = torch.zeros((), dtype=torch.float64)
        sums = comm.all_reduce_host(comm.to_host(local, torch.float64))
        if float(sums[1]) == 0:
            return {}
        return {"rollout/routing_agreement": float(sums[0] / sums[1])}


def model_layout_routing(packed: Any, routed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """A micro-batch's ``routed_experts`` ``[b, P+R, L, k]`` in its routers' token layout ``[s, b, L, k]`` (this CP
    rank's tokens: ``packed.tokens`` order, -1 on padding)."""
    from mcore_agentic.parallel.cp_split import cp_packed_indices, cp_split

    full = packed.gather_tokens(routed.long(), fill=-1)  # [b, S, L, k] or [1, T, L, k]
    if packed.is_packed:
        local = cp_packed_indices(packed.cu_seqlens, cp_size, cp_rank, device=full.device)
        full = full[:, local]
    else:
        full = cp_split(full, cp_size, cp_rank, seq_dim=1)
    return full.transpose(0, 1).contiguous()
