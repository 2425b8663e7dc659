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

Files are parquet (verl's layout), or JSON Lines (``.jsonl``: one row object per
line) and JSON (``.json``: a list of row objects), which slime and NeMo-RL users
bring. A file that cannot be read (empty, not parquet, not UTF-8, not JSON) or a
bad row raises :class:`ConfigError`: one line naming the config key, the file,
the row (or line) and the fix. Prompts longer than the budget (measured with
the tokenizer's chat template, tool schemas included, generation prompt added)
are dropped and counted, or refused; a prompt whose text alone cannot fit
(:func:`cannot_fit`) is dropped before it is tokenised, so a 10 MB row costs
microseconds, not a minute.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_agentic.data.config import DataConfig
from mcore_agentic.utils.errors import ConfigError, first_line

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


def normalize_row(
    row: Mapping[str, Any], index: int, source: str, prompt_key: str = "prompt", *, where: str | None = None
) -> dict[str, Any]:
    """Check one row and return it in canonical form (``extra_info.index`` defaults to ``index``).

    ``where`` names the row in errors (default ``row <index> of <source>``).
    """
    where = where or f"row {index} of {source}"
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


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (byte-level BPE: bytes), an upper bound per token."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def cannot_fit(messages: list[dict[str, Any]], max_prompt_length: int, tokenizer: Any) -> bool:
    """True when the prompt certainly exceeds ``max_prompt_length`` tokens, known without tokenising it.

    No token covers more than :func:`longest_token_chars` characters, so ``n`` tokens hold at most
    ``n * longest`` characters. System, user and tool content is rendered verbatim by chat templates
    (at most stripped; assistant content is not counted: templates may drop earlier reasoning).
    """
    chars = sum(len(m["content"].strip()) for m in messages if m["role"] in ("system", "user", "tool"))
    return chars > max_prompt_length * longest_token_chars(tokenizer)


def prompt_token_length(tokenizer: Any, messages: list[dict[str, Any]], tool_schemas: list[dict] | None) -> int:
    """Tokens of the prompt as the engine sees it: chat template, tool schemas, generation prompt."""
    ids = tokenizer.apply_chat_template(messages, tools=tool_schemas or None, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


@dataclass
class RLDataset(Sequence):
    """Validated rows; ``num_dropped_overlong`` counts prompts removed for length, ``longest_dropped`` is the
    longest of them in tokens (None when only prompts whose text alone cannot fit were dropped)."""

    rows: list[dict[str, Any]]
    source: str
    num_dropped_overlong: int = 0
    longest_dropped: int | None = None
    max_prompt_length: int | None = None

    def dropped_line(self) -> str | None:
        """One line about the dropped prompts (None when none was dropped)."""
        if not self.num_dropped_overlong:
            return None
        total = len(self.rows) + self.num_dropped_overlong
        longest = f"longest {self.longest_dropped} tokens" if self.longest_dropped is not None else "text too long to tokenise"
        return (
            f"{self.source}: dropped {self.num_dropped_overlong} of {total} prompts longer than "
            f"data.max_prompt_length={self.max_prompt_length} ({longest}; chat template and tool schemas included): "
            "raise data.max_prompt_length to keep them"
        )

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
        sources: Sequence[tuple[str, int]] | None = None,
    ) -> RLDataset:
        """Validate ``rows``; with a tokenizer and ``max_prompt_length``, drop (or refuse) overlong prompts.

        ``sources``: ``(file, row)`` of each row for messages (default: ``source`` and the position).
        """
        rows = list(rows)
        where = list(sources) if sources is not None else [(source, i) for i in range(len(rows))]
        checked = [
            normalize_row(r, n, source, prompt_key, where=f"row {i} of {src}") for n, (r, (src, i)) in enumerate(zip(rows, where))
        ]
        if not checked:
            raise ConfigError("data", f"{source} has no rows")
        dropped = 0
        longest: int | None = None
        if tokenizer is not None and max_prompt_length is not None:
            kept = []
            for row, (src, i) in zip(checked, where):
                too_long = cannot_fit(row["prompt"], max_prompt_length, tokenizer)
                length = None if too_long else prompt_token_length(tokenizer, row["prompt"], tool_schemas)
                if length is not None and length <= max_prompt_length:
                    kept.append(row)
                elif filter_overlong_prompts:
                    dropped += 1
                    if length is not None:
                        longest = max(longest or 0, length)
                else:
                    size = f"{length} tokens exceed" if length is not None else "its text alone cannot fit in"
                    raise _fail(
                        prompt_key,
                        f"row {i} of {src}",
                        f"{size} data.max_prompt_length={max_prompt_length}: raise it or set "
                        "data.filter_overlong_prompts=true",
                    )
            if not kept:
                raise ConfigError(
                    "data.max_prompt_length",
                    f"={max_prompt_length} drops all {len(checked)} prompts of {source}: raise it",
                )
            checked = kept
        dataset = cls(
            rows=checked, source=source, num_dropped_overlong=dropped, longest_dropped=longest,
            max_prompt_length=max_prompt_length,
        )
        return dataset

    @classmethod
    def from_files(
        cls, files: str | os.PathLike | Sequence[str | os.PathLike], *, field: str = "data.train_files", **kwargs: Any
    ) -> RLDataset:
        """Rows of parquet / JSONL / JSON files, in file order (see :meth:`from_rows` for ``kwargs``).

        ``field`` names the config key in errors (``data.train_files`` or ``data.val_files``).
        """
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not paths:
            raise ConfigError(field, "no data files given")
        rows: list[dict[str, Any]] = []
        sources: list[tuple[str, int]] = []
        for path in paths:
            file_rows = read_rows(path, field)
            rows.extend(file_rows)
            sources.extend((str(path), i) for i in range(len(file_rows)))
        return cls.from_rows(rows, source=", ".join(str(p) for p in paths), sources=sources, **kwargs)


JSON_SUFFIXES = (".jsonl", ".json")


def read_rows(path: str | os.PathLike, field: str = "data.train_files") -> list[Any]:
    """The rows of one data file by its suffix (``.jsonl``, ``.json``, else parquet); one-line errors."""
    if not os.path.isfile(path):
        raise ConfigError(field, f"{path} does not exist (run the preprocessing script first?)")
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(field, f"{path} is empty (0 bytes): regenerate it")
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(Path(path), field)
    if suffix == ".json":
        return _read_json(Path(path), field)
    return _read_parquet(Path(path), field, size)


def _read_parquet(path: Path, field: str, size: int) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise ConfigError(
            field,
            f"{path} is not a parquet file (no PAR1 magic at its start and end{'; truncated?' if head == b'PAR1' else ''}): "
            "regenerate it, or name a .jsonl / .json file",
        )
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ConfigError(field, f"{path} cannot be read as parquet ({first_line(exc)}): regenerate it") from None


def _read_jsonl(path: Path, field: str) -> list[Any]:
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    field, f"{path} line {number} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}): "
                    "re-encode the file as UTF-8",
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(field, f"{path} line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(field, f"{path} line {number} is a JSON {type(row).__name__}, not a row object")
            rows.append(row)
    if not rows:
        raise ConfigError(field, f"{path} holds no rows (only blank lines)")
    return rows


def _read_json(path: Path, field: str) -> list[Any]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(field, f"{path} is not UTF-8 text (byte offset {exc.start}): re-encode it as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(field, f"{path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(data, list):
        raise ConfigError(field, f"{path} holds a JSON {type(data).__name__}; a .json data file is a list of row objects")
    return data


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
        name = f"synthetic/{cfg.synthetic.task}"
        train = RLDataset.from_rows(train_rows, f"{name} train", **common)
        val = RLDataset.from_rows(val_rows, f"{name} val", **common) if val_rows else None
        return train, val
    if not cfg.train_file_list:
        raise ConfigError("data.train_files", "no training data: set data.train_files or data.synthetic.enable=true")
    train = RLDataset.from_files(cfg.train_file_list, field="data.train_files", **common)
    val = RLDataset.from_files(cfg.val_file_list, field="data.val_files", **common) if cfg.val_file_list else None
    return train, val
