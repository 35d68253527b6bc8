"""Build the small chat set shipped in titanctl/assets/chat/ (recipes/qwen3_debug_sft.toml trains on it).

Multi-turn conversations generated from the bundled public-domain corpus (titanctl/assets/corpus:
Shakespeare's plays, one document per scene, and the King James Bible, one per chapter), whose
answers can be read off the text, so a model can learn them:
  * verse lookup: "What does Genesis 1:3 say?", then "And the next verse?" (1-3 turns);
  * the next line of a speech in a play, then the one after (1-3 turns);
  * who speaks a line, and in which play;
  * how many words a line has (counted, so it is right);
  * which book a chapter's first verse opens.
Some conversations start with a system turn. The corpus's train split makes train.jsonl.gz and its
held-out plays and books make validation.jsonl.gz (a folder laid out like a Hugging Face dataset:
``chat:titanctl/assets/chat`` reads train, ``sft.validation_split`` names the other). The output is
gzip'd JSON Lines ({"messages": [...]}) with mtime 0 and no file name in the header, generated from a
fixed seed: rerunning gives byte-identical files.

Usage: python scripts/build_chat_data.py [--out DIR] [--conversations N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS = REPO_ROOT / "titanctl" / "assets" / "corpus"
DEFAULT_OUT = REPO_ROOT / "titanctl" / "assets" / "chat"
SYSTEM = ("You are a concise assistant who knows Shakespeare and the King James Bible.",
          "Answer with the text only.", "Be brief.")
_SCENE = re.compile(r"^(ACT [IVX]+(?:, SCENE [IVX]+)?|PROLOGUE|EPILOGUE|INDUCTION)\b.*$")
_SPEAKER = re.compile(r"^([A-Z][A-Z' ,.-]+):$")
_CHAPTER = re.compile(r"^(.+) (\d+)$")
MAX_LINE_CHARS = 160  # keeps every conversation well under the recipe's seq_len


def read(split: str) -> list[str]:
    with gzip.open(CORPUS / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def chapters(docs: list[str]) -> list[tuple[str, int, list[str]]]:
    """(book, chapter, verses) of the Bible's documents."""
    out = []
    for doc in docs:
        head, _, body = doc.partition("\n\n")
        match = _CHAPTER.match(head.strip())
        if match and not _SCENE.match(body.splitlines()[0] if body else ""):
            verses = [v.strip() for v in body.splitlines() if v.strip()]
            if verses and all(len(v) <= MAX_LINE_CHARS * 2 for v in verses[:1]):
                out.append((match.group(1), int(match.group(2)), verses))
    return out


def speeches(docs: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """(play, scene, speaker, lines) of every speech of two lines or more."""
    out = []
    for doc in docs:
        lines = doc.splitlines()
        if len(lines) < 2 or not _SCENE.match(lines[1]):
            continue
        play, scene = lines[0].strip(), lines[1].split(".")[0].strip()
        speaker, speech = None, []
        for line in [*lines[2:], ""]:
            match = _SPEAKER.match(line.strip())
            if match or not line.strip():
                if speaker and len(speech) >= 2:
                    out.append((play, scene, speaker, speech))
                speaker, speech = (match.group(1).title(), []) if match else (speaker if line.strip() else None, [])
                continue
            if speaker and len(line) <= MAX_LINE_CHARS:
                speech.append(line.strip())
    return out


def verse_lookup(rng, bible) -> list[dict]:
    book, chapter, verses = rng.choice(bible)
    v = rng.randrange(len(verses))
    turns = [{"role": "user", "content": rng.choice([f"What does {book} {chapter}:{v + 1} say?",
                                                     f"Quote {book} {chapter}:{v + 1}.",
                                                     f"{book} {chapter}:{v + 1}, please."])},
             {"role": "assistant", "content": verses[v]}]
    for _ in range(rng.randint(0, 2)):
        if v + 1 >= len(verses):
            break
        v += 1
        turns += [{"role": "user", "content": rng.choice(["And the next verse?", "Go on.", "What follows?"])},
                  {"role": "assistant", "content": verses[v]}]
    return turns


def next_line(rng, plays) -> list[dict]:
    play, scene, speaker, lines = rng.choice(plays)
    i = rng.randrange(len(lines) - 1)
    turns = [{"role": "user", "content": f'In {play}, {speaker} says: "{lines[i]}" What is the next line?'},
             {"role": "assistant", "content": lines[i + 1]}]
    for _ in range(rng.randint(0, 2)):
        if i + 2 >= len(lines):
            break
        i += 1
        turns += [{"role": "user", "content": rng.choice(["And after that?", "Continue.", "The next one?"])},
                  {"role": "assistant", "content": lines[i + 1]}]
    return turns


def who_speaks(rng, plays) -> list[dict]:
    play, scene, speaker, lines = rng.choice(plays)
    line = rng.choice(lines)
    return [{"role": "user", "content": f'Who says "{line}"?'},
            {"role": "assistant", "content": f"{speaker}, in {play} ({scene})."},
            {"role": "user", "content": "Which play is that?"},
            {"role": "assistant", "content": play}]


def word_count(rng, plays, bible) -> list[dict]:
    if rng.random() < 0.5:
        line = rng.choice(rng.choice(plays)[3])
    else:
        line = rng.choice(rng.choice(bible)[2])
    n = len(line.split())
    return [{"role": "user", "content": f'How many words are in: "{line}"'},
            {"role": "assistant", "content": f"{n} word{'s' if n != 1 else ''}."}]


def which_book(rng, bible) -> list[dict]:
    book, chapter, verses = rng.choice(bible)
    return [{"role": "user", "content": f'Which chapter of the Bible opens with "{verses[0]}"?'},
            {"role": "assistant", "content": f"{book} {chapter}."}]


def conversations(docs: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    bible, plays = chapters(docs), speeches(docs)
    makers = [lambda: verse_lookup(rng, bible), lambda: next_line(rng, plays), lambda: who_speaks(rng, plays),
              lambda: word_count(rng, plays, bible), lambda: which_book(rng, bible)]
    rows = []
    for _ in range(n):
        turns = rng.choice(makers)()
        if rng.random() < 0.3:
            turns = [{"role": "system", "content": rng.choice(SYSTEM)}, *turns]
        rows.append({"messages": turns})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--conversations", type=int, default=4000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, source, n, seed in (("train", "train", args.conversations, 0),
                                   ("validation", "val", max(200, args.conversations // 16), 1)):
        rows = conversations(read(source), n, seed)
        write(args.out / f"{split}.jsonl.gz", rows)
        size = (args.out / f"{split}.jsonl.gz").stat().st_size
        print(f"{args.out / f'{split}.jsonl.gz'}: {len(rows)} conversations, {size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
