"""The pre-flight: every check that needs no process group, run once before any worker starts.

``python launch/pretrain_rl.py`` runs it before it starts torchrun's workers (``--check`` runs only it), so a bad
config costs seconds and prints one line per problem, with no torchrun trailer after them. Workers started by
torchrun directly run it too (rank 0 prints). It collects every problem it can find in one pass:

* the config tree itself (unknown keys, types, choices: :func:`mcore_agentic.config.load_config`), then
* the cross-group rules for the world size (parallel split, batch sizes, rollout groups, the attention backend),
* the device (``trainer.device=cuda`` without a GPU) and the rollout engine's package,
* input paths (:mod:`mcore_agentic.config.paths`: key, path and the directories searched),
* the tools' and interactions' YAML (classes import, schemas valid), the reward function (imports, signature),
* the training data (every row valid; rows that ask for a tool or interaction the config does not have),
* the tracking backends' packages (wandb, TensorBoard).

Nothing here builds a model, an engine or a tool instance.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_agentic.config.paths import missing_inputs
from mcore_agentic.rollout.engines.registry import engine_kind, engines_on
from mcore_agentic.utils.errors import ConfigError, collect

LOGGER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def model_shape(model_path: str | os.PathLike) -> dict[str, Any] | None:
    """Heads, KV heads, layers and experts from the HF ``config.json`` at ``model_path`` (None if there is none yet).

    Read with ``transformers.AutoConfig`` from local files only (never the network).
    """
    path = Path(model_path)
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.model_path", f"{path}/config.json cannot be read by transformers ({exc})") from None
    heads = hf.num_attention_heads
    return {
        "num_attention_heads": heads,
        "num_query_groups": getattr(hf, "num_key_value_heads", None) or heads,
        "num_layers": hf.num_hidden_layers,
        "num_experts": int(getattr(hf, "num_experts", 0) or 0),
    }


def check_device(cfg: Any) -> str:
    """``cuda`` or ``cpu``: where the run trains (``trainer.device``), without touching the environment."""
    import torch

    requested = cfg.trainer.device
    available = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    if requested == "cuda" and not available:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(
            "trainer.device",
            f"cuda was asked for but torch sees no GPU ({build}); use trainer.device=cpu or auto, or run on a GPU node",
        )
    return "cuda" if requested == "cuda" or (requested == "auto" and available) else "cpu"


def check_packages(cfg: Any) -> list[ConfigError]:
    """The rollout engine's and the tracking backends' packages are installed."""
    problems = []
    engine = engine_kind(cfg.rollout.name)  # the engine table says which package it needs
    if engine.package is not None and importlib.util.find_spec(engine.package) is None:
        elsewhere = " or ".join(f"rollout.name={name}" for name in engines_on("cpu") if name != engine.name)
        problems.append(ConfigError(
            "rollout.name", f"{engine.name} is not installed here ({engine.install_hint()}); on CPU use {elsewhere}"))
    for backend in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(ConfigError("trainer.logger", f"{backend} is listed but not installed: pip install {package}, "
                                        f"or drop it from trainer.logger"))
    return problems


def _tokenizer(cfg: Any) -> Any:
    """The model's tokenizer when its checkpoint exists already (prompt lengths are checked with it), else None."""
    if not (Path(cfg.model.model_path) / "config.json").is_file():
        return None
    from mcore_agentic.trainer.build import build_tokenizer

    return build_tokenizer(cfg.model.model_path)


def check_teacher(cfg: Any) -> list[ConfigError]:
    """The distillation teacher shares the student's tokenizer and chat template, and its split (the actor's, or its
    own ``teacher.tensor_model_parallel_size``) splits it."""
    from mcore_agentic.config.rules import check_model_split
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.trainer.build import build_tokenizer, check_teacher_tokenizer

    problems: list[ConfigError] = []
    if (Path(cfg.model.model_path) / "config.json").is_file():
        student = collect(problems, lambda: build_tokenizer(cfg.model.model_path), "model.model_path")
        if student is not None:
            collect(problems, lambda: check_teacher_tokenizer(student, cfg.teacher.model_path), "teacher.model_path")
            top_k = cfg.algorithm.distillation.top_k
            if top_k > len(student):
                problems.append(ConfigError("algorithm.distillation.top_k", f"={top_k} is more than the tokenizer's "
                                            f"{len(student)} ids: use at most {len(student)} (8 to 64 is usual)"))
    shape = collect(problems, lambda: model_shape(cfg.teacher.model_path), "teacher.model_path")
    own_tp = cfg.teacher.tensor_model_parallel_size
    if shape is not None and own_tp is not None:  # its own split: TP only
        shape = {k: v for k, v in shape.items() if k != "num_experts"}
        collect(problems, lambda: check_model_split(ParallelConfig(tensor_model_parallel_size=own_tp), **shape,
                                                     field_prefix="teacher"), "teacher.tensor_model_parallel_size")
    elif shape is not None:
        shape = {k: v for k, v in shape.items() if k != "num_experts"}
        try:
            check_model_split(cfg.actor.parallel, **shape)
        except ConfigError as exc:
            message = str(exc)[len(exc.field) + 2 :]
            problems.append(ConfigError("teacher.model_path", f"the teacher runs with the actor's layout: {exc.field} "
                                        f"{message} (the teacher's config.json)"))
    return problems


def check_rows(cfg: Any, tools: dict[str, dict] | None, interactions: set[str] | None) -> list[ConfigError]:
    """Every training and validation row is valid and fits ``data.max_prompt_length`` (when the model's tokenizer is
    there to measure it), and names only tools and interactions the config has."""
    from mcore_agentic.data.dataset import RLDataset

    data = cfg.data
    problems_first: list[ConfigError] = []
    tokenizer = collect(problems_first, lambda: _tokenizer(cfg), "model.model_path")
    schemas = list(tools.values()) if tools and cfg.rollout.multi_turn.tool_schemas_in_prompt else None
    lengths: dict[str, Any] = {}
    if tokenizer is not None:
        lengths = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length,
                       filter_overlong_prompts=data.filter_overlong_prompts, tool_schemas=schemas or None)
    if data.synthetic.enable:
        return []
    problems: list[ConfigError] = problems_first
    rows: list[dict[str, Any]] = []
    sources: list[str] = []
    for field, files in (("data.train_files", data.train_file_list), ("data.val_files", data.val_file_list)):
        if not files:
            continue
        loaded = collect(problems, lambda f=files, k=field: RLDataset.from_files(
            f, field=k, prompt_key=data.prompt_key, **lengths), field)
        if loaded is not None:
            rows += list(loaded)
            sources += [str(f) for f in files]
    if not rows or tools is None:
        return problems
    where = ", ".join(sources)
    asked = [r.get("extra_info", {}).get("interaction_kwargs") or {} for r in rows]
    named = sorted({str(a.get("name", "")) for a in asked if a})
    if named and not interactions:
        n = sum(bool(a) for a in asked)
        problems.append(ConfigError(
            "rollout.multi_turn.interaction_config_path",
            f"is not set, but {n} of {len(rows)} rows of {where} ask for interaction {', '.join(map(repr, named))} "
            "(extra_info.interaction_kwargs): set it (e.g. configs/interactions/gsm8k_interaction_config.yaml), "
            "or write the data without interaction_kwargs"))
    elif named and interactions:
        unknown = [n for n in named if n and n not in interactions]
        if unknown:
            problems.append(ConfigError(
                "rollout.multi_turn.interaction_config_path",
                f"configures {sorted(interactions)}, but rows of {where} ask for {unknown} "
                "(extra_info.interaction_kwargs.name): add them or fix the data"))
    wanted = sorted({name for r in rows for name in (r.get("extra_info", {}).get("tools_kwargs") or {})})
    # An agent program runs its own tools (rollout.agent): the rows' tools_kwargs are its data, not the loop's.
    unknown_tools = [] if cfg.rollout.agent.enabled else [n for n in wanted if n not in tools]
    if unknown_tools:
        problems.append(ConfigError(
            "rollout.multi_turn.tool_config_path",
            f"configures {sorted(tools) or 'no tools'}, but rows of {where} name {unknown_tools} "
            "(extra_info.tools_kwargs): add them to the tools YAML or fix the data"))
    return problems


def preflight(
    cfg: Any, world_size: int, *, local_world_size: int | None = None, dirs: Sequence[Path] = (), light: bool = False,
) -> list[ConfigError]:
    """Every problem found in ``cfg`` (a built :class:`RLConfig`) for a run on ``world_size`` ranks; empty: go.

    ``dirs``: where relative input paths were looked up (:func:`mcore_agentic.config.paths.search_dirs`).
    ``light``: skip what reads files or imports plug-ins (the workers the launcher started after its pre-flight).
    """
    from mcore_agentic.config.rules import validate
    from mcore_agentic.feed import check_agent, check_plugins, check_reward_fn
    from mcore_agentic.models.transformer_impl import use_te_for
    from mcore_agentic.parallel.layout import check_cpu_support

    problems: list[ConfigError] = []
    device = collect(problems, lambda: check_device(cfg), "trainer.device")
    before = len(problems)
    collect(problems, lambda: use_te_for(cfg.model.transformer_impl), "model.transformer_impl")
    if len(problems) > before:  # no TransformerEngine here: the rules that go with it are moot
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl="local"))
    shape = collect(problems, lambda: model_shape(cfg.model.model_path), "model.model_path")
    collect(problems, lambda: validate(cfg, world_size, model_shape=shape, local_world_size=local_world_size,
                                        device=device))
    if device == "cpu":
        collect(problems, lambda: check_cpu_support(cfg.actor.parallel, field_prefix="actor"), "actor")
    problems += check_packages(cfg)
    if light:
        return problems
    missing = missing_inputs(cfg, list(dirs))
    problems += missing
    absent = {e.field for e in missing}
    plugins = None
    if not absent & {"rollout.multi_turn.tool_config_path", "rollout.multi_turn.interaction_config_path"}:
        plugins = collect(problems, lambda: check_plugins(cfg.rollout), "rollout.multi_turn.tool_config_path")
    if cfg.teacher.enabled and "teacher.model_path" not in absent:
        problems += check_teacher(cfg)
    if "reward.custom_reward_function" not in absent:
        collect(problems, lambda: check_reward_fn(cfg.reward), "reward.custom_reward_function")
    problems += check_agent(cfg.rollout.agent)
    if not absent & {"data.train_files", "data.val_files"}:
        tools, interactions = plugins if plugins is not None else (None, None)
        problems += check_rows(cfg, tools, interactions)
    return problems
