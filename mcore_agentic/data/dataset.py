"""The RL prompt dataset: parquet rows in verl's layout, validated once at load time.

A row (one prompt) holds::

    prompt        [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]
    data_source   str                  selects the reward rule (e.g. "openai/gsm8k")
    ability       str                  free-form tag (e.g. "math"); optional
    reward_model  {"ground_truth": ..., "style": "rule"}; optional
    extra_info    {"index": int,
                   "tools_kwargs": {tool_name: {"create_kwargs": {...}, "execute_kwargs": {...},
                                                "calc_reward_kwargs": {...}, "release_kwargs": {...}}},
                   "interaction_kwargs": {"name": ..., ...},
                   ...any other keys, passed through}

A bad row raises :class:`ConfigError` naming the field and the row. Prompts
longer than the budget (measured with the tokenizer's chat template, tool
schemas included, generation prompt added) are dropped and counted, or refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.data.config import DataConfig

ROLES = ("system", "user", "assistant", "tool")
TOOL_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def _fail(field: str, where: str, message: str) -> ConfigError:
    return ConfigError(field, f"{where}: {message}")


def _mapping_or_json(value: Any, field: str, where: str) -> dict[str, Any]:
    """A dict from a mapping or a JSON object string (some writers store nested kwargs as JSON text)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _fail(field, where, f"is a string but not JSON ({e.msg}); store a mapping") from None
    if not isinstance(value, Mapping):
        raise _fail(field, where, f"must be a mapping, got {type(value).__name__}")
    return dict(value)


def _drop_nones(value: dict[str, Any]) -> dict[str, Any]:
    # Parquet struct columns unify keys across rows and fill the missing ones with null:
    # a null entry means "absent in this row".
    return {k: v for k, v in value.items() if v is not None}


def normalize_row(row: Mapping[str, Any], index: int, source: str, prompt_key: str = "prompt") -> dict[str, Any]:
    """Check one row and return it in canonical form (``extra_info.index`` defaults to ``index``)."""
    where = f"row {index} of {source}"
    if not isinstance(row, Mapping):
        raise _fail("row", where, f"must be a mapping, got {type(row).__name__}")
    if prompt_key not in row or row[prompt_key] is None:
        raise _fail(prompt_key, where, f"missing; every row needs a list of chat messages, has keys {sorted(row)}")
    prompt = row[prompt_key]
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise _fail(prompt_key, where, 'must be a non-empty list of {"role", "content"} messages')
    messages = []
    for j, msg in enumerate(prompt):
        key = f"{prompt_key}[{j}]"
        if not isinstance(msg, Mapping):
            raise _fail(key, where, f'must be a {{"role", "content"}} mapping, got {type(msg).__name__}')
        msg = _drop_nones(dict(msg))
        if msg.get("role") not in ROLES:
            raise _fail(f"{key}.role", where, f"got {msg.get('role')!r}; use one of {', '.join(ROLES)}")
        if not isinstance(msg.get("content"), str):
            raise _fail(f"{key}.content", where, f"must be a string, got {type(msg.get('content')).__name__}")
        messages.append(msg)

    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise _fail("data_source", where, "missing or not a string; it selects the reward rule (e.g. openai/gsm8k)")
    ability = row.get("ability") or ""
    if not isinstance(ability, str):
        raise _fail("ability", where, f"must be a string, got {type(ability).__name__}")

    reward_model = _mapping_or_json(row.get("reward_model"), "reward_model", where)
    reward_model.setdefault("ground_truth", None)

    extra = _mapping_or_json(row.get("extra_info"), "extra_info", where)
    idx = extra.get("index", index)
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise _fail("extra_info.index", where, f"must be an integer, got {idx!r}")
    extra["index"] = idx

    tools_kwargs = _drop_nones(_mapping_or_json(extra.get("tools_kwargs"), "extra_info.tools_kwargs", where))
    for tool, kwargs in tools_kwargs.items():
        field = f"extra_info.tools_kwargs.{tool}"
        kwargs = _drop_nones(_mapping_or_json(kwargs, field, where))
        unknown = sorted(set(kwargs) - set(TOOL_KWARGS_KEYS))
        if unknown:
            raise _fail(f"{field}.{unknown[0]}", where, f"unknown sub-key; allowed: {', '.join(TOOL_KWARGS_KEYS)}")
        for sub, value in kwargs.items():
            kwargs[sub] = _drop_nones(_mapping_or_json(value, f"{field}.{sub}", where))
        tools_kwargs[tool] = kwargs
    extra["tools_kwargs"] = tools_kwargs
    extra["interaction_kwargs"] = _drop_nones(
        _mapping_or_json(extra.get("interaction_kwargs"), "extra_info.interaction_kwargs", where)
    )

    known = {prompt_key, "data_source", "ability", "reward_model", "extra_info"}
    out = {k: v for k, v in row.items() if k not in known}  # other columns pass through untouched
    out.update(prompt=messages, data_source=data_source, ability=ability, reward_model=reward_model, extra_info=extra)
    return out


def prompt_token_length(tokenizer: Any, messages: list[dict[str, Any]], tool_schemas: list[dict] | None) -> int:
    """Tokens of the prompt as the engine sees it: chat template, tool schemas, generation prompt."""
    ids = tokenizer.apply_chat_template(messages, tools=tool_schemas or None, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


@dataclass
class RLDataset(Sequence):
    """Validated rows; ``num_dropped_overlong`` counts prompts removed for length."""

    rows: list[dict[str, Any]]
    source: str
    num_dropped_overlong: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Mapping[str, Any]],
        source: str,
        *,
        prompt_key: str = "prompt",
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        filter_overlong_prompts: bool = True,
        tool_schemas: list[dict] | None = None,
    ) -> RLDataset:
        """Validate ``rows``; with a tokenizer and ``max_prompt_length``, drop (or refuse) overlong prompts."""
        checked = [normalize_row(r, i, source, prompt_key) for i, r in enumerate(rows)]
        if not checked:
            raise ConfigError("data", f"{source} has no rows")
        dropped = 0
        if tokenizer is not None and max_prompt_length is not None:
            kept = []
            for i, row in enumerate(checked):
                length = prompt_token_length(tokenizer, row["prompt"], tool_schemas)
                if length <= max_prompt_length:
                    kept.append(row)
                elif filter_overlong_prompts:
                    dropped += 1
                else:
                    raise _fail(
                        prompt_key,
                        f"row {i} of {source}",
                        f"{length} tokens exceed data.max_prompt_length={max_prompt_length}: raise it or set "
                        "data.filter_overlong_prompts=true",
                    )
            if not kept:
                raise ConfigError(
                    "data.max_prompt_length",
                    f"={max_prompt_length} drops all {len(checked)} prompts of {source}: raise it",
                )
            checked = kept
        return cls(rows=checked, source=source, num_dropped_overlong=dropped)

    @classmethod
    def from_parquet(cls, files: str | os.PathLike | Sequence[str | os.PathLike], **kwargs: Any) -> RLDataset:
        """Rows of one or more parquet files, in file order (see :meth:`from_rows` for ``kwargs``)."""
        import pyarrow.parquet as pq

        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not paths:
            raise ConfigError("data.train_files", "no parquet files given")
        rows: list[dict[str, Any]] = []
        for path in paths:
            if not os.path.isfile(path):
                raise ConfigError("data.train_files", f"{path} does not exist (run the preprocessing script first?)")
            rows.extend(pq.read_table(path).to_pylist())
        return cls.from_rows(rows, source=", ".join(str(p) for p in paths), **kwargs)


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Write rows in the layout above.

    ``extra_info.tools_kwargs`` and ``extra_info.interaction_kwargs`` are stored as JSON text: parquet
    structs cannot hold an empty mapping (``{"create_kwargs": {}}``) and would merge the keys of all
    rows (every tool name in every row, as nulls). :func:`normalize_row` reads both forms.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    encoded = []
    for row in rows:
        row = dict(row)
        extra = dict(row.get("extra_info") or {})
        for key in ("tools_kwargs", "interaction_kwargs"):
            extra[key] = json.dumps(extra.get(key) or {}, sort_keys=True)
        row["extra_info"] = extra
        encoded.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(encoded), path)


def load_datasets(
    cfg: DataConfig,
    *,
    tokenizer: Any = None,
    tool_schemas: list[dict] | None = None,
) -> tuple[RLDataset, RLDataset | None]:
    """Training and (if configured) validation datasets of ``data``: parquet files or the synthetic task.

    With a ``tokenizer``, prompts longer than ``data.max_prompt_length`` (chat template and
    ``tool_schemas`` included) are dropped (counted in ``num_dropped_overlong``) or refused.
    """
    from mcore_agentic.data.synthetic import make_rows

    common: dict[str, Any] = dict(
        prompt_key=cfg.prompt_key,
        tokenizer=tokenizer,
        max_prompt_length=cfg.max_prompt_length if tokenizer is not None else None,
        filter_overlong_prompts=cfg.filter_overlong_prompts,
        tool_schemas=tool_schemas,
    )
    if cfg.synthetic.enable:
        train_rows, val_rows = make_rows(cfg.synthetic)
        train = RLDataset.from_rows(train_rows, "synthetic/tool_arith train", **common)
        val = RLDataset.from_rows(val_rows, "synthetic/tool_arith val", **common) if val_rows else None
        return train, val
    if not cfg.train_file_list:
        raise ConfigError("data.train_files", "no training data: set data.train_files or data.synthetic.enable=true")
    train = RLDataset.from_parquet(cfg.train_file_list, **common)
    val = RLDataset.from_parquet(cfg.val_file_list, **common) if cfg.val_file_list else None
    return train, val
