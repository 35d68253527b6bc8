"""Build the arithmetic task shipped in titanctl/assets/arithmetic/ (recipes/llama3_debug_task_sft.toml and
recipes/llama3_debug_grpo.toml train on it).

Which of two two-digit numbers is larger: "Which is larger, 37 or 52?", answered "52". Short prompts and
answers with one exact right answer that is always one of the prompt's numbers: chat fine-tuning teaches
the debug model the format and to copy a number within minutes on 2 CPU cores, while choosing the right one
(the tens digits, then the units) takes longer, which is what reinforcement learning then improves. (Sums
of two numbers, tried first, are learned far too slowly from scratch.) A row holds the prompt, the answer
(what ``titanctl rl``'s rewards check, rl.answer_field) and the same answer as a completion (what chat
fine-tuning learns: ``chat:arithmetic`` reads prompt and completion). The 8,010 ordered pairs of distinct
numbers are shuffled with a fixed seed: 7,000 make train.jsonl.gz, the rest validation.jsonl.gz (a folder
laid out like a Hugging Face dataset). gzip'd JSON Lines with mtime 0 and no file name in the header:
rerunning gives byte-identical files.

Usage: python scripts/build_rl_task.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "titanctl" / "assets" / "arithmetic"
TRAIN = 7000


def rows() -> list[dict]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
    random.Random(0).shuffle(pairs)
    return [{"prompt": f"Which is larger, {a} or {b}?", "answer": str(max(a, b)), "completion": str(max(a, b))}
            for a, b in pairs]


def write(path: Path, items: list[dict]) -> None:
    data = "".join(json.dumps(item) + "\n" for item in items).encode()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="", mtime=0) as f:
        f.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    items = rows()
    write(args.out / "train.jsonl.gz", items[:TRAIN])
    write(args.out / "validation.jsonl.gz", items[TRAIN:])
    print(f"{args.out}: {TRAIN} train and {len(items) - TRAIN} validation rows")


if __name__ == "__main__":
    main()
