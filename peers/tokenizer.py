"""``swarm tokenizer``: train a byte-level BPE tokenizer on local text and print the hash that names it.

The organiser of a run that trains on tokens runs this once, then names the file in its run:
``tokenizer_sha256`` and the model's ``vocab_size`` in the manifest, and ``swarm bootstrap --manifest
run.yaml --tokenizer tokenizer.json`` to serve it to joining trainers. Bad input (a missing data file, a
vocab_size below 256 + special tokens, an output that cannot be written) exits with code 2 and one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from swarm.training.tokenizer import MIN_VOCAB_SIZE, TokenizerError, train_tokenizer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm tokenizer", description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="PATH",
        help="text/JSONL files or directories to train on (read as `swarm train --data` reads them)",
    )
    p.add_argument(
        "--vocab_size",
        type=int,
        default=32000,
        help=f"most tokens in the vocabulary, special tokens included (at least {MIN_VOCAB_SIZE}); "
        "fewer when the text holds too few repeated pairs",
    )
    p.add_argument("--out", default="tokenizer.json", help="where to write the tokenizer (a tokenizer.json)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tokenizer = train_tokenizer(args.data, args.vocab_size, args.out)
    except TokenizerError as e:
        print(f"swarm tokenizer: {e}", file=sys.stderr, flush=True)
        return 2
    fewer = (
        ""
        if tokenizer.vocab_size == args.vocab_size
        else f" (fewer than the {args.vocab_size} asked for: the text holds no more pairs seen twice)"
    )
    print(
        f"wrote {args.out}\n"
        f"vocabulary: {tokenizer.vocab_size} tokens{fewer}\n"
        f"SHA-256:    {tokenizer.sha256}\n"
        f"In the run's manifest: tokenizer_sha256: {tokenizer.sha256} and model: {{vocab_size: "
        f"{tokenizer.vocab_size}}}; serve it with: swarm bootstrap --manifest run.yaml --tokenizer {args.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
