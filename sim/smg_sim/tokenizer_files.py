"""The sim's tokenizer as HuggingFace files: ``tokenizer/tokenizer.json`` and ``tokenizer/tokenizer_config.json``.

A router (or any client) that tokenizes the way the engine does needs the engine's tokenizer; the sim's is
`tokens.encode` (UTF-8 bytes as ids 0-255), which HF ``tokenizers`` reproduces with a byte-level BPE that has
the 256 byte symbols and no merges (``ByteLevel`` pre-tokenizer without its split regex and without an added
prefix space).  The config's ``chat_template`` renders `openai_api.chat_prompt`'s text, so
``apply_chat_template`` gives the engine's chat prompt.  Load them with
``tokenizers.Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))`` or
``transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)``.

The files are generated, not hand-written: ``python -m smg_sim.tokenizer_files`` writes them (and
``--check`` fails if the shipped ones differ); the unit tests compare them with the sim on random text.
Needs nothing beyond the standard library: the sim does not depend on ``tokenizers`` or ``jinja2``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tokens import BYTE_SYMBOLS

__all__ = ["CHAT_TEMPLATE", "TOKENIZER_DIR", "main", "tokenizer_config", "tokenizer_json", "write"]

#: Where the package keeps the files (installed as package data).
TOKENIZER_DIR = Path(__file__).parent / "tokenizer"

#: `chat_prompt` in Jinja: ``<|role|>\\ncontent\\n`` per message (string content, or the text parts of a list),
#: then ``<|assistant|>\\n``.  The sim always adds the generation prompt, so the template does too, whatever
#: ``add_generation_prompt`` says.  Written with ``{%-``/``-%}`` and string literals so HF's
#: ``trim_blocks``/``lstrip_blocks`` have no whitespace to change.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- set content = message.get('content') -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part.get('type') == 'text' -%}{{- part.get('text', '') | string -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '<|assistant|>\\n' -}}"
)


def tokenizer_json() -> dict[str, Any]:
    """``tokenizer.json``: byte-level BPE, token id = byte value, no merges, no special tokens."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: byte for byte, symbol in enumerate(BYTE_SYMBOLS)},
            "merges": [],
        },
    }


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: a fast tokenizer with no BOS/EOS added and the sim's chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def _files() -> dict[str, str]:
    return {
        "tokenizer.json": json.dumps(tokenizer_json(), ensure_ascii=False, indent=1) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), ensure_ascii=False, indent=1) + "\n",
    }


def write(directory: Path = TOKENIZER_DIR) -> list[Path]:
    """Write both files into `directory`; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in _files().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def stale(directory: Path = TOKENIZER_DIR) -> list[str]:
    """Names of the files in `directory` that are missing or differ from what `write` would write."""
    return [
        name
        for name, text in _files().items()
        if not (directory / name).is_file() or (directory / name).read_text(encoding="utf-8") != text
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m smg_sim.tokenizer_files", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=TOKENIZER_DIR, help="where to write the files")
    p.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = p.parse_args(argv)
    if args.check:
        names = stale(args.dir)
        for name in names:
            print(f"{args.dir / name} is out of date: run python -m smg_sim.tokenizer_files", file=sys.stderr)
        return 1 if names else 0
    for path in write(args.dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
