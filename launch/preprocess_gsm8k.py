"""Turn GSM8K (local jsonl or parquet with ``question`` and ``answer``) into multi-turn tool-use RL parquet.

    python launch/preprocess_gsm8k.py --train gsm8k/train.jsonl --test gsm8k/test.jsonl --out data/gsm8k
    python launch/preprocess_gsm8k.py --train data/gsm8k_sample.jsonl --test-size 10 --out data/gsm8k_sample

Each answer must end with ``#### <number>``; that number (commas removed) is the ground truth.
Rows follow ``mcore_agentic.data.dataset``: a system prompt telling the model to check its answer
with the ``calc_gsm8k_reward`` tool (and/or to use the ``calculator``) and to finish with
``#### <answer>``, ``data_source=openai/gsm8k``, the ground truth in ``reward_model`` and in the
tool's ``create_kwargs``. ``--interaction`` adds ``interaction_kwargs`` for the GSM8K interaction (a simulated
user that checks the answer): train such data with
``rollout.multi_turn.interaction_config_path=configs/interactions/gsm8k_interaction_config.yaml``.
Reads local files only; prints the command that trains on what it wrote.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_agentic.data.dataset import normalize_row, write_parquet  # noqa: E402
from mcore_agentic.utils.errors import ConfigError  # noqa: E402

DATA_SOURCE = "openai/gsm8k"
_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)\s*$")

INSTRUCTIONS = {
    "gsm8k": (
        "You are a careful math tutor. Work through the problem step by step. Before giving your final "
        "answer, submit it with the `calc_gsm8k_reward` tool at least once and revise it if the tool says "
        "it is wrong. End your reply with the final answer in the form `#### <answer>`."
    ),
    "calculator": (
        "You are a careful math tutor. Work through the problem step by step and use the `calculator` tool "
        "for every arithmetic operation. End your reply with the final answer in the form `#### <answer>`."
    ),
    "both": (
        "You are a careful math tutor. Work through the problem step by step, using the `calculator` tool "
        "for arithmetic. Before giving your final answer, submit it with the `calc_gsm8k_reward` tool and "
        "revise it if the tool says it is wrong. End your reply with the final answer in the form `#### <answer>`."
    ),
}
USER_SUFFIX = "Show your steps, then give the final answer after `####`."


def extract_ground_truth(answer: str, where: str) -> str:
    """The number after the final ``####`` of a GSM8K solution, commas removed."""
    m = _ANSWER.search(answer.strip())
    if not m:
        raise ConfigError("answer", f"{where}: does not end with '#### <number>' (got ...{answer.strip()[-40:]!r})")
    return m.group(1).replace(",", "")


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a local ``.jsonl``/``.json`` or ``.parquet`` file."""
    if not path.is_file():
        raise ConfigError("input", f"{path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        records = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ConfigError("input", f"{path} line {n}: not JSON ({e.msg})") from None
        return records
    raise ConfigError("input", f"{path}: use a .jsonl or .parquet file")


def to_row(
    record: dict[str, Any], index: int, split: str, tools: str, source: str, interaction: bool = False
) -> dict[str, Any]:
    where = f"record {index} of {source}"
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ConfigError(key, f"{where}: missing or not a string (GSM8K records need question and answer)")
    question = record["question"].strip()
    truth = extract_ground_truth(record["answer"], where)
    tools_kwargs: dict[str, Any] = {}
    if tools in ("gsm8k", "both"):
        tools_kwargs["calc_gsm8k_reward"] = {"create_kwargs": {"ground_truth": truth}}
    if tools in ("calculator", "both"):
        tools_kwargs["calculator"] = {"create_kwargs": {}}
    row = {
        "prompt": [
            {"role": "system", "content": INSTRUCTIONS[tools]},
            {"role": "user", "content": f"{question} {USER_SUFFIX}"},
        ],
        "data_source": DATA_SOURCE,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": record["answer"],
            "need_tools_kwargs": True,
            "tools_kwargs": tools_kwargs,
        },
    }
    if interaction:
        row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": truth}
    normalize_row(row, index, source)  # the reader's own check, so a bad file is never written
    return row


def convert(path: Path, split: str, tools: str, interaction: bool = False) -> list[dict[str, Any]]:
    return [to_row(r, i, split, tools, str(path), interaction) for i, r in enumerate(read_records(path))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, required=True, help="local GSM8K train split (.jsonl or .parquet)")
    parser.add_argument("--test", type=Path, help="local GSM8K test split; or use --test-size")
    parser.add_argument("--test-size", type=int, default=0, help="hold out the last N train records as test")
    parser.add_argument("--tools", choices=sorted(INSTRUCTIONS), default="gsm8k", help="tools the prompt mentions")
    parser.add_argument("--interaction", action="store_true",
                        help="add interaction_kwargs for the GSM8K interaction (a simulated user checks the answer)")
    parser.add_argument("--out", type=Path, required=True, help="output directory for train/test parquet")
    args = parser.parse_args(argv)
    try:
        train = convert(args.train, "train", args.tools, args.interaction)
        if args.test is not None:
            test = convert(args.test, "test", args.tools, args.interaction)
        elif args.test_size > 0:
            if args.test_size >= len(train):
                raise ConfigError("--test-size", f"{args.test_size} leaves no training records of {len(train)}")
            train, test = train[: -args.test_size], train[-args.test_size :]
            for i, row in enumerate(test):
                row["extra_info"].update(split="test", index=i)
        else:
            test = []
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_parquet(train, args.out / "train.parquet")
    if test:
        write_parquet(test, args.out / "test.parquet")
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out}")
    print("train on them with:\n  " + " ".join(train_command(args)))
    return 0


def train_command(args: argparse.Namespace) -> list[str]:
    """The launcher command line that trains on what ``args`` wrote (its tools, its interaction)."""
    tools = {"gsm8k": "gsm8k_tool_config.yaml", "calculator": "calculator_tool_config.yaml",
             "both": "gsm8k_calculator_tool_config.yaml"}
    cmd = ["python", "launch/pretrain_rl.py", "--nproc_per_node", "8", "--config-name", "gsm8k_multiturn_grpo",
           f"data.train_files={args.out / 'train.parquet'}"]
    cmd.append(f"data.val_files={args.out / 'test.parquet'}" if (args.test is not None or args.test_size > 0)
               else "data.val_files=[]")
    cmd.append(f"rollout.multi_turn.tool_config_path=configs/tools/{tools[args.tools]}")
    if args.interaction:
        cmd += ["rollout.multi_turn.interaction_config_path=configs/interactions/gsm8k_interaction_config.yaml",
                "rollout.multi_turn.max_user_turns=2"]
    return cmd


if __name__ == "__main__":
    sys.exit(main())
