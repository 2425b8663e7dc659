"""Sanity-check mismatches: one line per step, with token ids where the two texts are equal."""

from __future__ import annotations

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.driver import mismatch_line
from mcore_agentic.rollout.tokenization import ChatTokenizer


def test_a_non_canonical_split_shows_its_token_ids():
    """A sampled ' name' as ' n' + 'ame' re-tokenizes as one token: the texts are equal, the ids are not."""
    tok = load_qwen_tokenizer("qwen2_5", 4096)
    chat = ChatTokenizer(tok)
    canonical = tok.encode(" name hello", add_special_tokens=False)
    pieces = tok.encode(" n", add_special_tokens=False) + tok.encode("ame", add_special_tokens=False)
    sampled = pieces + tok.encode(" hello", add_special_tokens=False)
    assert tok.decode(sampled) == tok.decode(canonical) and sampled != canonical
    diffs = chat.sanity_check(sampled, canonical, mode="strict")
    assert len(diffs) == 1 and diffs[0]["expected"] == diffs[0]["actual"] == " name"
    meta = {"request_metrics": [
        {"request_id": "r0", "sanity_check_mismatch": 0},
        {"request_id": "r1", "sanity_check_mismatch": 1, "sanity_check_diffs": diffs},
        {"request_id": "r2", "sanity_check_mismatch": 1, "sanity_check_diffs": diffs},
    ]}
    line = mismatch_line(meta)
    assert "\n" not in line
    assert line.startswith("tokenization sanity check: 2 of 3 trajectories differ from a full render of their messages")
    assert f"' name' -> ' name' (same text, token ids {canonical[:1]} -> {pieces})" in line, line
    assert mismatch_line({"request_metrics": [{"sanity_check_mismatch": 0}]}) is None
