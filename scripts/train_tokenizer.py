"""Train the bundled byte-level BPE tokenizer and write it in Llama 3's tiktoken format.

The `tokenizers` library does the training (fast and deterministic): Llama 3's split
regex as a `Split` pre-tokenizer, then `ByteLevel(use_regex=False)` so that merges work
on bytes. `tokenizers` spells bytes in GPT-2's printable alphabet; we map that back to
raw bytes and write one `base64(token_bytes) rank` line per token, the format of Meta's
`tokenizer.model`. Ranks 0..255 are the single bytes (rank = byte value) and rank
256 + i is the i-th merge, so merge priority equals rank, which is what tiktoken's
encoder assumes.

Usage: python scripts/train_tokenizer.py [--corpus FILE] [--val FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO_ROOT / "titanctl" / "assets" / "corpus"
DEFAULT_OUT = REPO_ROOT / "titanctl" / "assets" / "tokenizer" / "tokenizer.model"
N_RANKS = 4096  # 256 single bytes + 3840 merges

# Keep in step with titanctl.data.tokenizer.LLAMA3_PATTERN (the script must run without
# the package installed, so it does not import it; a unit test checks they agree).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_texts(path: Path) -> Iterator[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def gpt2_byte_alphabet() -> dict[str, int]:
    """The printable character GPT-2's byte-level BPE uses for each byte -> that byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...)
    are shifted to code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


def train_ranks(corpus: Path, n_ranks: int):
    """Returns (ranks, trained `tokenizers.Tokenizer`)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(corpus), trainer=trainer)

    merges = json.loads(tok.to_str())["model"]["merges"]
    to_byte = gpt2_byte_alphabet()
    if set(to_byte) != set(pre_tokenizers.ByteLevel.alphabet()):
        sys.exit("this tokenizers version uses a different byte alphabet than GPT-2's")
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(to_byte[c] for c in left + right)
        if token in ranks:
            sys.exit(f"merge {merge!r} repeats token {token!r}: ranks would not be a valid BPE")
        ranks[token] = len(ranks)
    if len(ranks) != n_ranks:
        sys.exit(f"training produced {len(ranks)} ranks, wanted {n_ranks}: corpus too small?")
    return ranks, tok


def load_titanctl_tokenizer(model_path: Path):
    """The runtime's Tokenizer, imported from this checkout (installed or not)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from titanctl.data.tokenizer import Tokenizer

    return Tokenizer(model_path)


def check_same_encoding(trained, ranks: dict[bytes, int], model_path: Path, texts: list[str]) -> None:
    """The tiktoken file must split text exactly as the trained `tokenizers` model does."""
    to_byte = gpt2_byte_alphabet()
    id_to_rank = {i: ranks[bytes(to_byte[c] for c in s)] for s, i in trained.get_vocab().items()}
    ours = load_titanctl_tokenizer(model_path).encode_batch(texts, bos=False, eos=False)
    for n, (text, got) in enumerate(zip(texts, ours, strict=True)):
        want = [id_to_rank[i] for i in trained.encode(text).ids]
        if got != want:
            sys.exit(f"document {n}: tiktoken and tokenizers disagree; the rank mapping is wrong")


def write_ranks(ranks: dict[bytes, int], out: Path) -> bytes:
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in ranks.items()]
    data = b"\n".join(lines) + b"\n"  # ranks are inserted in order 0..n-1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return data


def chars_per_token(model_path: Path, val: Path) -> tuple[float, int]:
    """Compression on held-out text, measured through the tiktoken encoder we ship."""
    tokenizer = load_titanctl_tokenizer(model_path)
    texts = list(read_texts(val))
    n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts, bos=False, eos=False))
    return sum(len(t) for t in texts) / n_tokens, n_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR / "train.jsonl.gz")
    parser.add_argument("--val", type=Path, default=CORPUS_DIR / "val.jsonl.gz")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--ranks", type=int, default=N_RANKS, help="base vocabulary size")
    args = parser.parse_args()

    start = time.perf_counter()
    ranks, trained = train_ranks(args.corpus, args.ranks)
    data = write_ranks(ranks, args.out)
    print(f"wrote {args.out}: {len(ranks)} ranks in {time.perf_counter() - start:.1f} s")
    print(f"sha256 {hashlib.sha256(data).hexdigest()}")
    check_same_encoding(trained, ranks, args.out, list(read_texts(args.val)))
    ratio, n_tokens = chars_per_token(args.out, args.val)
    print(f"val {args.val.name}: {n_tokens} tokens, {ratio:.3f} chars/token")


if __name__ == "__main__":
    main()
