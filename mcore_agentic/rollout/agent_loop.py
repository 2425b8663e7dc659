"""The per-request agent loop: generate -> parse tool calls -> run tools / ask the interaction -> repeat.

One module a little over ~500 lines: :class:`AgentSession` is one request's state machine (set-up, turns,
interaction, pause and checkpoint, scoring, release) whose steps share the session's state; its tool calls are
a mixin of their own (:mod:`~mcore_agentic.rollout.agent_tools`).

One :class:`AgentSession` drives one :class:`RolloutRequest` through its state machine:

* ``running``: sample an assistant turn within the remaining length budget; keep the
  sampled ids (loss mask 1) and decode them only to build the assistant message, whose
  content keeps the sampled text exactly (whitespace included) so the chat template
  re-renders the turn as it was sampled (:func:`assistant_message`);
* ``tool_calling``: parse calls (``rollout.multi_turn.format``), validate them against
  the sample's tools, run up to ``max_parallel_calls`` concurrently through
  ``safe_execute``; malformed / unknown / invalid / failing / timed-out calls become
  error observations the model reads, and each call's ``tool_log`` entry records what went
  wrong (``error_type``, and the traceback of an exception raised in the tool). Tool messages
  are delta-tokenized (mask 0);
* ``interacting``: after a turn without tool calls, the sample's interaction (selected
  by ``interaction_kwargs["name"]``) replies as the user, or ends the conversation;
* ``completed`` with a finish reason, or ``failed`` on an unexpected error (the batch
  still completes; the failed row trains on nothing; the request keeps the error's type,
  first line and traceback).

Tokenization is incremental (:class:`~mcore_agentic.rollout.tokenization.ConversationTokenizer`:
per turn only the new messages are rendered and tokenized). The CPU-heavy steps (the
prompt, each environment delta, the end-of-trajectory sanity check, an inference-template
prompt) run on ``AgentContext.cpu_pool`` when one is given, so one request's rendering and
tokenizing never stalls the event loop the other requests' generation and tools run on.

Tool instances are created per request with the sample's ``tools_kwargs``
(``{tool: {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}}``), scored
with ``calc_reward`` at the end, and always released, even on failure. Every lifecycle call goes
through :func:`~mcore_agentic.tools.base.call_tool`: a tool's own blocking code runs on a worker
thread, never on the event loop the other requests share.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.rollout.agent_tools import ToolCalls
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.engines.base import GenerationOutput, RolloutEngine, SamplingParams
from mcore_agentic.rollout.request import FinishReason, RequestState, RolloutRequest
from mcore_agentic.rollout.tokenization import ChatTokenizer, ConversationTokenizer, TokenizationPath
from mcore_agentic.rollout.tool_parser import (
    ToolCall,
    ToolCallError,
    ToolCallParser,
    parameters_schema,
)
from mcore_agentic.tools.base import (
    ToolProtocol,
    call_tool,
    format_traceback,
)
from mcore_agentic.tools.schema import openai_schemas

logger = logging.getLogger(__name__)

_TOOLS_KWARGS_KEYS = frozenset({"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"})


class RequestDataError(ValueError):
    """A sample's data cannot be rolled out (named field and fix); the request fails, the batch goes on."""


@dataclass
class AgentContext:
    """What every request of a batch shares."""

    engine: RolloutEngine
    chat: ChatTokenizer
    cfg: RolloutConfig
    parser: ToolCallParser
    tools: Mapping[str, ToolProtocol] = field(default_factory=dict)
    interactions: Mapping[str, Any] = field(default_factory=dict)
    cpu_pool: Executor | None = None
    """Threads for rendering, tokenizing and the sanity check (None: on the event loop)."""
    weight_version: int = 0
    """The engine's weight version: recorded on every token sampled in this rollout."""
    turn_budget: int | None = None
    """Partial rollouts: assistant turns a request may take in this rollout before it pauses (None: no limit)."""
    token_budget: int | None = None
    """Partial rollouts: tokens a request may sample in this rollout before it pauses, mid-turn if need be
    (None: no limit)."""


@dataclass
class _ToolInstance:
    tool: ToolProtocol
    instance_id: str
    kwargs: dict[str, dict[str, Any]]


class AgentSession(ToolCalls):
    """Runs one request to completion; see the module docstring for the turn structure."""

    def __init__(self, request: RolloutRequest, ctx: AgentContext):
        self.req = request
        self.ctx = ctx
        self.mt = ctx.cfg.multi_turn
        self.instances: dict[str, _ToolInstance] = {}
        self.schemas: list[dict[str, Any]] | None = None
        self.argument_schemas: dict[str, dict[str, Any]] = {}
        self.interaction: Any = None
        self.interaction_id: str | None = None
        self.num_prompt_messages = len(request.messages)
        self.tokens: ConversationTokenizer | None = None
        self.max_len = min(ctx.cfg.prompt_length + ctx.cfg.response_length, ctx.cfg.effective_max_model_len)
        self.paused = False
        self.turns_this_run = 0
        self.tokens_this_run = 0
        self.open_turn = 0
        """Tokens of an assistant turn cut by the token budget: the trajectory ends with them; the turn goes on."""
        self.budgeted = True
        """Whether this run's turn and token budgets apply (the partial-rollout buffer lifts them for a session at
        its staleness bound, so that it finishes)."""

    @property
    def done(self) -> bool:
        return self.req.done

    @property
    def rows(self) -> list[RolloutRequest]:
        """The row it trains: its request (a :class:`~mcore_agentic.rollout.source.Session`)."""
        return [self.req]

    async def run(self) -> RolloutRequest:
        """Run the request until it ends, or, under a turn or token budget, until it pauses: at a turn boundary,
        or mid-turn when the token budget cuts a generation.

        A paused session (:attr:`paused`) keeps its tool instances and interaction; calling ``run`` again
        (with a new :attr:`ctx`: the next step's engine and weights) continues where it stopped: a cut turn goes
        on from its exact ids (the engine prefills them and continues the turn's random stream).
        """
        req = self.req
        self.paused = False
        self.turns_this_run = 0
        self.tokens_this_run = 0
        try:
            if req.state is RequestState.PENDING:
                req.transition(RequestState.RUNNING)
                await self._start()
            reason = await self._turns()
            if reason is None:
                self.paused = True
                return req
            await self._score()
            await self._cpu(self._sanity_check, reason)
            req.complete(reason)
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not take the batch down
            first_line = (str(exc).strip().splitlines() or [""])[0]
            error = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
            if not req.done:
                req.fail(error, error_type=type(exc).__name__, traceback=format_traceback(exc))
            # The step's failure report says it once per step (rollout/failures.py), with the first traceback.
            logger.debug("rollout request %s failed: %s", req.request_id, error)
        finally:
            if not self.paused:
                await self.release()
        return req

    async def _cpu(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the context's CPU pool (the event loop stays free), or inline without one."""
        pool = self.ctx.cpu_pool
        if pool is None:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    # -- setup --------------------------------------------------------------------------------------

    async def _start(self) -> None:
        req, ctx = self.req, self.ctx
        selected = self._select_tools()
        for name, tool in selected.items():
            kwargs = req.tools_kwargs.get(name) or {}
            instance_id = await call_tool(tool, "create", instance_id=req.request_id, **(kwargs.get("create_kwargs") or {}))
            self.instances[name] = _ToolInstance(tool, instance_id, kwargs)
        in_prompt = self.mt.tool_schemas_in_prompt
        self.schemas = openai_schemas(selected) if in_prompt else None
        self.argument_schemas = {name: parameters_schema(tool) for name, tool in selected.items()}
        if req.interaction_kwargs and self.mt.enable:
            if not ctx.interactions:
                raise RequestDataError(
                    "extra_info.interaction_kwargs is set but no interactions are configured; "
                    "set rollout.multi_turn.interaction_config_path"
                )
            from mcore_agentic.interactions.registry import select_interaction

            self.interaction = select_interaction(ctx.interactions, req.interaction_kwargs)
            kwargs = {k: v for k, v in req.interaction_kwargs.items() if k != "name"}
            self.interaction_id = await self.interaction.start_interaction(instance_id=req.request_id, **kwargs)
        self.tokens = await self._cpu(ctx.chat.conversation, req.messages, tools=self.schemas)
        prompt = self.tokens.prompt_ids
        if len(prompt) > ctx.cfg.prompt_length:
            req.trajectory.set_prompt(prompt[-ctx.cfg.prompt_length :])  # a row for the batch; trains on nothing
            raise RequestDataError(
                f"prompt of {len(prompt)} tokens (chat template and tool schemas included) exceeds "
                f"rollout.prompt_length={ctx.cfg.prompt_length}; raise it or filter long prompts "
                "(data.filter_overlong_prompts)"
            )
        req.trajectory.set_prompt(prompt)

    def _select_tools(self) -> dict[str, ToolProtocol]:
        """The sample's tools: those its ``tools_kwargs`` names, or every configured tool if it names none."""
        tools, wanted = self.ctx.tools, self.req.tools_kwargs
        if not self.mt.enable:
            return {}
        if not wanted:
            return dict(tools)
        for name, kwargs in wanted.items():
            if name not in tools:
                raise RequestDataError(
                    f"extra_info.tools_kwargs.{name}: no such tool; configured tools: {sorted(tools) or 'none'} "
                    "(rollout.multi_turn.tool_config_path)"
                )
            if not isinstance(kwargs, Mapping) or set(kwargs) - _TOOLS_KWARGS_KEYS:
                raise RequestDataError(
                    f"extra_info.tools_kwargs.{name}: must be a mapping with keys among {sorted(_TOOLS_KWARGS_KEYS)}"
                )
        return {name: tools[name] for name in wanted}

    # -- turns --------------------------------------------------------------------------------------

    def _round_spent(self) -> bool:
        """Whether this run's turn or token budget is used up (the session pauses)."""
        ctx = self.ctx
        if not self.budgeted:
            return False
        if ctx.turn_budget is not None and self.turns_this_run >= ctx.turn_budget:
            return True
        return ctx.token_budget is not None and self.tokens_this_run >= ctx.token_budget

    async def _turns(self) -> FinishReason | None:
        """Turns until the request ends (its finish reason), or None when the rollout's turn or token budget
        pauses it (at a turn boundary: every environment reply is in, the next turn is the model's; or mid-turn)."""
        req, chat, mt = self.req, self.ctx.chat, self.mt
        traj = req.trajectory
        while True:
            budget = min(self.ctx.cfg.response_length - traj.response_len, self.max_len - len(traj))
            if budget <= 0:
                return FinishReason.LENGTH
            if self._round_spent():
                return None
            self.turns_this_run += 1
            cap = budget
            if self.budgeted and self.ctx.token_budget is not None:
                cap = min(budget, self.ctx.token_budget - self.tokens_this_run)
            context = len(traj)
            out, token_in = await self._generate(cap)
            ids, log_probs = out.token_ids[:cap], out.log_probs[:cap]
            self.tokens_this_run += len(ids)
            traj.append(ids, sampled=True, log_probs=log_probs, version=self.ctx.weight_version)
            if out.routed_experts is not None:
                self._record_routing(out, token_in, context)
            ended = bool(ids) and ids[-1] in chat.stop_token_ids
            if out.finish_reason == "length" and not ended and cap < budget and len(ids) >= cap:
                self.open_turn += len(ids)  # cut by the token budget: the turn goes on next run
                req.metrics.mid_turn_pauses += 1
                return None
            if self.open_turn:
                ids = traj.ids[len(traj) - self.open_turn - len(ids) :]
                self.open_turn = 0
            req.metrics.assistant_turns += 1
            req.start_turn()
            if out.finish_reason == "abort":
                return FinishReason.ABORTED
            text = chat.decode(ids[:-1] if ended else ids)
            assert self.tokens is not None
            turn_text = text + chat.stop_text(ids[-1]) if ended else text  # the stop token included
            self.tokens.sampled(turn_text)
            calls: list[ToolCall | ToolCallError] = []
            if self.instances:
                content, calls = self.ctx.parser.parse(text, schemas=self.argument_schemas)
                message = assistant_message(text, content, calls)
            else:
                message = {"role": "assistant", "content": text}
            req.messages.append(message)
            if (out.finish_reason == "length" and not (ended and cap < budget)) or len(out.token_ids) > cap:
                # (SGLang reports "length" for a stop token sampled as the cap's last token: not the response's end)
                return FinishReason.LENGTH
            if not mt.enable:
                return FinishReason.STOP
            sampled_eot: bool = bool(ids) and ids[-1] == chat.eot_id
            sampled_text = turn_text if sampled_eot else None
            if calls:
                if req.metrics.assistant_turns >= mt.max_assistant_turns:
                    return FinishReason.TOOL_CALLS
                req.transition(RequestState.TOOL_CALLING)
                tool_messages = await self._run_tools(calls)
                if not await self._append_env(tool_messages, sampled_eot, sampled_text):
                    return FinishReason.LENGTH
                req.transition(RequestState.RUNNING)
                continue
            if self.interaction is None or not self._user_turns_left():
                return FinishReason.STOP
            terminate, reply = await self._ask_user()
            if terminate or req.metrics.assistant_turns >= mt.max_assistant_turns:
                return FinishReason.STOP
            if not await self._append_env([{"role": "user", "content": str(reply)}], sampled_eot, sampled_text):
                return FinishReason.LENGTH
            req.transition(RequestState.RUNNING)

    def _record_routing(self, out: GenerationOutput, token_in: bool, context: int) -> None:
        """Record one engine call's routed experts on the trajectory (``context``: its length before the call)."""
        traj = self.req.trajectory
        # Rows of the prompt the engine fed (when it was the trajectory itself), then of the sampled ids
        # (from the cut turn's last id when the engine fed it as the end of a rendered prompt).
        prompt_rows = len(out.routed_experts) - max(len(out.token_ids) - 1, 0)
        if token_in:
            traj.record_routing(out.routed_experts[:prompt_rows])
        elif self.open_turn:
            prompt_rows, context = prompt_rows - 1, context - 1
        traj.record_routing(out.routed_experts[prompt_rows:], start=context)

    async def _ask_user(self) -> tuple[bool, Any]:
        """The interaction's reply to the conversation so far, its score recorded: whether it ends the conversation,
        and the user's next message."""
        req = self.req
        req.transition(RequestState.INTERACTING)
        terminate, reply, score, _extra = await self.interaction.generate_response(
            self.interaction_id, [dict(m) for m in req.messages]
        )
        req.metrics.user_turns += 1
        req.interaction_scores.append(float(score))
        if req.turn_interaction_scores:
            req.turn_interaction_scores[-1] += float(score)
        return terminate, reply

    def _user_turns_left(self) -> bool:
        own = getattr(self.interaction, "max_user_turns", None)
        limit = own if own is not None else self.mt.max_user_turns
        return limit is None or self.req.metrics.user_turns < limit

    async def _generate(self, budget: int) -> tuple[GenerationOutput, bool]:
        """The engine's turn (or the rest of a cut turn), and whether its prompt was the trajectory's ids (token-in)."""
        req, ctx = self.req, self.ctx
        cfg = ctx.cfg
        turn = req.metrics.assistant_turns
        seed = None if req.seed is None else (req.seed * 1_000_003 + turn) % (1 << 62)
        params = SamplingParams(
            max_new_tokens=budget,
            stop_token_ids=ctx.chat.stop_token_ids,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            seed=seed,
            draws_before=self.open_turn,
        )
        token_in = not (self.mt.use_inference_chat_template and turn > 0)
        if token_in:
            prompt = req.trajectory.ids
        else:
            # Production-style prompt (templates like Qwen3 drop earlier reasoning); trained ids keep it all.
            prompt = await self._cpu(ctx.chat.prompt_ids, list(req.messages), tools=self.schemas)
            if self.open_turn:
                prompt = list(prompt) + req.trajectory.ids[-self.open_turn :]
        started = time.perf_counter()
        out = await ctx.engine.generate(list(prompt), params)
        req.metrics.generate_seconds += time.perf_counter() - started
        return out, token_in

    async def _append_env(self, new_messages: list[dict[str, Any]], sampled_eot: bool, sampled_text: str | None) -> bool:
        """Append environment messages and their delta ids (+ next generation prompt); False if out of room."""
        req, traj = self.req, self.req.trajectory
        start = len(req.messages)
        req.messages.extend(new_messages)
        assert self.tokens is not None
        segment = await self._cpu(  # no copy of the history (quadratic): nothing changes it while this awaits
            self.tokens.env_segment, req.messages, start, sampled_text=sampled_text, sampled_eot=sampled_eot
        )
        req.metrics.template_fallback += int(segment.used_fallback)
        req.metrics.template_drift += int(segment.path is TokenizationPath.TWO_RENDERS)
        req.metrics.tokenization_full_context += int(segment.path is TokenizationPath.FULL_CONTEXT)
        traj.append(segment.ids, sampled=False)
        if len(traj) >= self.max_len or traj.response_len >= self.ctx.cfg.response_length:
            traj.truncate(min(self.max_len, traj.prompt_len + self.ctx.cfg.response_length))
            return False
        return True

    # -- end ----------------------------------------------------------------------------------------

    async def _score(self) -> None:
        req = self.req
        for name, inst in self.instances.items():
            reward = await call_tool(inst.tool, "calc_reward", inst.instance_id, **(inst.kwargs.get("calc_reward_kwargs") or {}))
            req.tool_rewards[name] = req.tool_rewards.get(name, 0.0) + float(reward)
        if self.interaction is not None:
            req.interaction_final_score = float(await self.interaction.calculate_score(self.interaction_id))

    def _sanity_check(self, reason: FinishReason) -> None:
        mode = self.mt.tokenization_sanity_check_mode
        if mode == "disable":
            return
        req, traj = self.req, self.req.trajectory
        diffs = self.ctx.chat.check_trajectory(
            traj.ids,
            traj.loss_mask,
            req.messages,
            tools=self.schemas,
            num_prompt_messages=self.num_prompt_messages,
            used_fallback=self.tokens is not None and self.tokens.used_fallback,
            mode=mode,
            truncated=reason in (FinishReason.LENGTH, FinishReason.ABORTED),
            ids_text=self.tokens.text if self.tokens is not None else None,
        )
        req.metrics.sanity_check_mismatch = int(bool(diffs))
        req.sanity_check_diffs = diffs

    # -- pause / checkpoint --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A paused session as plain data (pickled into checkpoints): the request, the incremental tokenizer's
        state and each tool instance's and the interaction's exported state. :meth:`restore` inverts it."""
        if not self.paused:
            raise RuntimeError(f"request {self.req.request_id} is not paused: only a paused session is snapshotted")
        tools = {}
        for name, inst in self.instances.items():
            export = getattr(inst.tool, "export_state", None)
            if export is None:
                raise TypeError(
                    f"tool {name!r} ({type(inst.tool).__name__}) has no export_state(instance_id): a checkpoint cannot "
                    "hold its in-flight instances; derive it from BaseTool or add export_state/import_state"
                )
            tools[name] = {"instance_id": inst.instance_id, "kwargs": inst.kwargs, "state": export(inst.instance_id)}
        interaction = None
        if self.interaction is not None:
            export = getattr(self.interaction, "export_state", None)
            if export is None:
                raise TypeError(f"interaction {type(self.interaction).__name__} has no export_state(instance_id)")
            interaction = {"instance_id": self.interaction_id, "state": export(self.interaction_id)}
        tokens = self.tokens
        assert tokens is not None
        return {
            "request": self.req,
            "tokens": {"prompt": tokens.prompt, "tools": tokens.tools, "texts": list(tokens._texts),
                       "used_fallback": tokens.used_fallback, "paths": dict(tokens.paths)},
            "schemas": self.schemas,
            "argument_schemas": self.argument_schemas,
            "num_prompt_messages": self.num_prompt_messages,
            "open_turn": self.open_turn,
            "tools": tools,
            "interaction": interaction,
        }

    @classmethod
    async def restore(cls, snap: dict[str, Any], ctx: AgentContext) -> AgentSession:
        """The paused session ``snap`` describes, its tool instances and interaction re-created in their saved state."""
        from mcore_agentic.interactions.registry import select_interaction
        from mcore_agentic.rollout.tokenization import ConversationTokenizer

        req: RolloutRequest = snap["request"]
        session = cls(req, ctx)
        session.num_prompt_messages = snap["num_prompt_messages"]
        session.open_turn = snap.get("open_turn", 0)
        session.schemas = snap["schemas"]
        session.argument_schemas = snap["argument_schemas"]
        for name, saved in snap["tools"].items():
            if name not in ctx.tools:
                raise RequestDataError(f"a paused request uses tool {name!r}, which this run does not configure")
            tool = ctx.tools[name]
            create = (saved["kwargs"].get("create_kwargs") or {})
            instance_id = await call_tool(tool, "create", instance_id=saved["instance_id"], **create)
            tool.import_state(instance_id, saved["state"])
            session.instances[name] = _ToolInstance(tool, instance_id, saved["kwargs"])
        if snap["interaction"] is not None:
            session.interaction = select_interaction(ctx.interactions, req.interaction_kwargs)
            saved = snap["interaction"]
            kwargs = {k: v for k, v in req.interaction_kwargs.items() if k != "name"}
            session.interaction_id = await session.interaction.start_interaction(instance_id=saved["instance_id"], **kwargs)
            session.interaction.import_state(session.interaction_id, saved["state"])
        t = snap["tokens"]
        tokens = ConversationTokenizer(ctx.chat, t["prompt"], tools=t["tools"])
        tokens._texts = list(t["texts"])
        tokens.used_fallback = t["used_fallback"]
        tokens.paths.update(t["paths"])
        session.tokens = tokens
        session.paused = True
        return session

    async def release(self) -> None:
        """Release the request's tool instances and finalize its interaction (at its end, or when a paused
        session is dropped)."""
        for name, inst in self.instances.items():
            try:
                await call_tool(inst.tool, "release", inst.instance_id, **(inst.kwargs.get("release_kwargs") or {}))
            except Exception as exc:  # noqa: BLE001 -- a leaky tool must not fail the batch
                logger.warning("releasing tool %s for request %s failed: %s", name, self.req.request_id, exc)
        if self.interaction is not None and self.interaction_id is not None:
            try:
                await self.interaction.finalize_interaction(self.interaction_id)
            except Exception as exc:  # noqa: BLE001
                logger.warning("finalizing interaction for request %s failed: %s", self.req.request_id, exc)


def assistant_message(text: str, content: str, calls: list[ToolCall | ToolCallError]) -> dict[str, Any]:
    """The assistant message of a sampled turn's ``text`` (the parser gave ``content`` and ``calls``).

    The message is what the chat template renders back into the history, so its content keeps
    what the model sampled, whitespace included: when all calls parsed and nothing but
    whitespace follows the first one, the content is the text before it, less the one newline
    the templates write between content and calls (``"Reasoning. \\n<tool_call>..."`` keeps
    ``"Reasoning. "``; the parser's content, SGLang's ``normal_text``, is edge-stripped). Text
    after or between calls cannot be rendered in place: the parser's joined content is kept.
    Malformed calls stay in the content as the model wrote them (their error observation
    tells the model what was wrong).
    """
    valid = [c for c in calls if isinstance(c, ToolCall)]
    if valid and len(valid) == len(calls):
        first = text.find(valid[0].raw)
        rest = text[first:]
        for c in valid:
            rest = rest.replace(c.raw, "", 1)
        if first >= 0 and not rest.strip():
            content = text[:first]
            content = content[:-1] if content.endswith("\n") else content
    elif valid:
        for c in valid:
            text = text.replace(c.raw, "", 1)
        content = text.strip()
    elif calls:
        content = text.strip()
    else:
        content = text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if valid:
        message["tool_calls"] = [c.to_openai() for c in valid]
    return message


async def run_request(request: RolloutRequest, ctx: AgentContext) -> RolloutRequest:
    """Drive one request to ``completed`` or ``failed``; never raises for a request's own errors."""
    return await AgentSession(request, ctx).run()
