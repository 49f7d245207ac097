"""llama.cpp's ``convert_hf_to_gguf.py``, the writer of the GGUF files people download, run on
Hugging Face directories.

The converter comes from the llama.cpp sources that PyPI's ``llama-cpp-python`` sdist vendors
(``make llama-convert`` unpacks it into ``.venv/llama.cpp``; it imports its own ``gguf-py``,
torch, transformers and sentencepiece). All directories of a call are converted in one child
process, so torch and transformers are imported once.

One change to the converter: it names the BPE pre-tokenizer (``tokenizer.ggml.pre``) by the
hash of a test string's tokens, and raises for a tokenizer whose hash it does not list, as any
tiny test vocabulary is. The child answers ``gpt2`` for every tokenizer, the split of the
byte-level tokenizers the tests use; everything else the converter does is its own.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

CONVERTER_DIR = Path(sys.prefix) / "llama.cpp"
"""Where ``make llama-convert`` puts the vendored converter (inside the virtualenv)."""
CONVERTER = CONVERTER_DIR / "convert_hf_to_gguf.py"
PRE_TOKENIZER = "gpt2"


class ConversionJob(NamedTuple):
    """One Hugging Face directory, the GGUF file to write from it and the converter's
    ``--outtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``)."""

    hf_dir: Path
    gguf_path: Path
    outtype: str = "f32"


def convert_with_llama_cpp(jobs: Sequence[ConversionJob], timeout_s: float = 120.0) -> None:
    """Writes each job's GGUF with llama.cpp's converter.

    Raises:
        RuntimeError: If the converter fails; the message holds the end of its output.
    """
    args = [str(part) for job in jobs for part in job]
    result = subprocess.run(
        [sys.executable, __file__, str(CONVERTER_DIR), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")


def _main(argv: list[str]) -> None:
    converter_dir, *paths = argv
    # NOTE: as the script itself does, its own gguf-py before the installed gguf package.
    sys.path[0:0] = [converter_dir, str(Path(converter_dir) / "gguf-py")]
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    script = str(Path(converter_dir) / "convert_hf_to_gguf.py")
    for hf_dir, gguf_path, outtype in zip(paths[::3], paths[1::3], paths[2::3], strict=True):
        sys.argv = [script, hf_dir, "--outtype", outtype, "--outfile", gguf_path]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1:])
