"""Continued generations on vLLM's worker (:func:`install_draws_before`), for the vLLM adapter
(:mod:`~mcore_agentic.rollout.engines.vllm`).

Continued generations (``SamplingParams.draws_before``): a seeded request in vLLM samples from its own
``torch.Generator`` seeded once with ``seed``, one draw per sampled token (on CPU one ``randint`` that seeds the
fused Gumbel-argmax kernel; elsewhere, and with fp64 Gumbel noise, one ``exponential_`` over a vocabulary-wide
row). A request that continues a cut one (its sampled ids end the prompt) must start from that generator
advanced past ``draws_before`` draws. The engine passes the count in vLLM's ``SamplingParams.extra_args``
(only when it is > 0, the request seeded and not greedy: other requests reach vLLM unchanged) and installs once,
through ``collective_rpc`` on the in-process worker, :func:`install_draws_before`: a wrapper around the V1 model
runner's ``_update_states`` that, after vLLM created a new request's generator, makes those draws with the same
op, width and dtype as the runner's sampler. vLLM internals it relies on: the runner's ``_update_states``,
``requests[id].generator`` (shared with the persistent batch), ``input_batch.vocab_size`` and which
``TopKTopPSampler.forward_*`` the sampler bound. With a sampler it does not know, the engine warns once and
continuations sample from their seed's fresh stream: valid samples, but not bitwise the uncut run. The V2 model
runner (vLLM's default on GPUs with Triton) keys its seeded noise by (seed, position in the sequence), so a
continuation already draws as the uncut request: nothing is installed.
Speculative decoding (the rejection sampler's draws) is not covered.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_agentic.rollout.engines.base import SamplingParams

DRAWS_BEFORE_ARG = "mcore_agentic_draws_before"
"""Key of ``vllm.SamplingParams.extra_args`` that carries ``SamplingParams.draws_before`` to the worker."""

def continues_draws(params: SamplingParams) -> bool:
    """Whether ``params`` asks a seeded sampler to start ``draws_before`` draws into its seed's stream."""
    return params.draws_before > 0 and params.seed is not None and params.temperature > 0


def install_draws_before(worker: Any) -> bool:
    """Runs on vLLM's worker (idempotent): a new seeded request whose ``extra_args`` carry :data:`DRAWS_BEFORE_ARG`
    starts from its generator advanced past that many draws (module docstring). False when this runner's
    sampling is not one this adapter knows how to advance."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

    runner = worker.model_runner
    if not isinstance(runner, V1ModelRunner):
        try:
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner
        except ImportError:
            return False
        return isinstance(runner, V2ModelRunner)  # (seed, position)-keyed noise: nothing to advance
    if getattr(runner, "_mcore_draws_before", False):
        return True
    advance = _draw_advancer(runner)
    if advance is None:
        return False
    update_states = runner._update_states

    def update_states_continuing_draws(scheduler_output: Any) -> Any:
        fresh = [
            (new.req_id, draws)
            for new in scheduler_output.scheduled_new_reqs
            if (draws := _draws_before(new.sampling_params)) and new.req_id not in runner.requests
        ]
        result = update_states(scheduler_output)  # creates each new request's generator, seeded
        for req_id, draws in fresh:
            state = runner.requests.get(req_id)
            if state is not None and state.generator is not None:
                advance(state.generator, draws)
        return result

    runner._update_states = update_states_continuing_draws
    runner._mcore_draws_before = True
    return True


def _draws_before(sampling_params: Any) -> int:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return int(extra.get(DRAWS_BEFORE_ARG, 0))


def _draw_advancer(runner: Any) -> Any:
    """``advance(generator, n)``: the draws ``n`` sampled tokens make on a request's generator in this runner's
    sampler (``vllm.v1.sample.ops.topk_topp_sampler``), or None for a sampler not known here."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = runner.sampler.topk_topp_sampler
    forward = getattr(sampler.forward, "__func__", None)
    fp64 = bool(sampler.use_fp64_gumbel)
    if forward is TopKTopPSampler.forward_cpu and not fp64:

        def advance(generator: torch.Generator, n: int) -> None:
            # forward_cpu: one randint(0, 2**31, (1,)) per token; n of them in one call draw the same numbers
            torch.randint(0, 2**31, (n,), generator=generator, dtype=torch.long)

        return advance
    # Every other sampler takes random_sample's path for seeded rows: q[i].exponential_(generator) over a row.
    native = [getattr(TopKTopPSampler, f"forward_{name}", None) for name in ("native", "cpu", "cuda", "hip", "xpu")]
    if forward is None or forward not in native:
        return None
    width, dtype = runner.input_batch.vocab_size, torch.float64 if fp64 else torch.float32

    def advance(generator: torch.Generator, n: int) -> None:
        row = torch.empty(width, dtype=dtype, device=generator.device)
        for _ in range(n):
            row.exponential_(generator=generator)

    return advance


__all__ = ["DRAWS_BEFORE_ARG", "continues_draws", "install_draws_before"]
