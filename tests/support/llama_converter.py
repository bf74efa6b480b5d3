"""llama.cpp's own converter (convert_hf_to_gguf.py) as an external tool for the oracle tests.

The converter, its `conversion` package and its gguf-py come from the source distribution of
llama-cpp-python on PyPI (vendor/llama.cpp/), fetched once with pip into a cache folder:
$MOERUN_TEST_TOOLS, else ~/.cache/moerun-test-tools. Nothing of it is kept in this repository.
It runs as a subprocess with its own gguf-py first on PYTHONPATH, never the `gguf` package
moerun runs with.

A tiny Hugging Face model needs a tokenizer the converter accepts. For byte-level BPE
(qwen2moe, qwen3moe, olmoe) the converter recognises a tokenizer only by the hash of its
tokens for a fixed text, so a tokenizer trained here is refused; the GPT-2 vocabulary that
llama.cpp ships for its own tokenizer tests (models/ggml-vocab-gpt-2.gguf, in the same
download) is rebuilt as a Hugging Face tokenizer instead, and those models get GPT-2's
50257-token vocabulary. Mixtral's converter reads a SentencePiece tokenizer.model first, so it
gets the small one trained on corpus.txt.
"""
from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf

from moerun.gguf.reader import GGUFFile
from tests.support.hf_models import tiny_model
from tests.support.vocabs import sentencepiece_processor

SDIST = "llama-cpp-python"
VERSION = "0.3.36"
_VENDOR = "vendor/llama.cpp/"
# What is taken out of the sdist, under vendor/llama.cpp/: the script, the package it imports, its
# gguf-py and the GPT-2 vocabulary.
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "models/ggml-vocab-gpt-2.gguf")
_COMPLETE = ".complete"


class ConverterUnavailable(RuntimeError):
    """The converter could not be fetched or unpacked."""


class ConversionFailed(RuntimeError):
    """The converter ran and exited with an error."""


def tools_dir() -> Path:
    if folder := os.environ.get("MOERUN_TEST_TOOLS"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moerun-test-tools"


@dataclass(frozen=True)
class Converter:
    root: Path                  # holds convert_hf_to_gguf.py, conversion/, gguf-py/, models/

    @property
    def script(self) -> Path:
        return self.root / "convert_hf_to_gguf.py"

    @property
    def gpt2_vocab(self) -> Path:
        return self.root / "models" / "ggml-vocab-gpt-2.gguf"

    def convert(self, model_dir: Path, outfile: Path, *options: str) -> Path:
        """convert_hf_to_gguf.py MODEL_DIR --outfile OUTFILE OPTIONS...; raises ConversionFailed."""
        env = {key: value for key, value in os.environ.items() if key != "NO_LOCAL_GGUF"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")      # everything it reads is in model_dir
        env["PYTHONPATH"] = os.pathsep.join([str(self.root / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
        command = [sys.executable, str(self.script), str(model_dir), "--outfile", str(outfile), *options]
        result = subprocess.run(command, env=env, cwd=self.root, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise ConversionFailed(f"{' '.join(command[1:])} exited with {result.returncode}:\n"
                                   f"{_tail(result.stderr + result.stdout)}")
        return outfile


def fetch_converter() -> Converter:
    """The converter, downloaded and unpacked into tools_dir() on first use (one process at a
    time, under a lock file); raises ConverterUnavailable with what went wrong."""
    base = tools_dir()
    root = base / f"llama.cpp-{SDIST}-{VERSION}"
    if (root / _COMPLETE).exists():
        return Converter(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
        with open(base / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (root / _COMPLETE).exists():
                _download_and_unpack(base, root)
    except OSError as err:
        raise ConverterUnavailable(f"cannot prepare llama.cpp's converter under {base}: {err}") from err
    return Converter(root)


def _download_and_unpack(base: Path, root: Path) -> None:
    with tempfile.TemporaryDirectory(dir=base) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   f"{SDIST}=={VERSION}", "-d", scratch]
        result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        archives = list(Path(scratch).glob("*.tar.gz"))
        if result.returncode != 0 or len(archives) != 1:
            raise ConverterUnavailable(
                f"these tests run llama.cpp's converter from the PyPI source distribution {SDIST}=={VERSION}, "
                f"fetched once into {root} (MOERUN_TEST_TOOLS sets the folder), but `pip download` failed "
                f"(exit {result.returncode}):\n{_tail(result.stderr)}")
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                relative = member.name.partition("/")[2]            # strip llama_cpp_python-VERSION/
                if not relative.startswith(_VENDOR) or not (member.isfile() or member.isdir()):
                    continue
                inside = relative.removeprefix(_VENDOR)
                if any(inside == wanted or (wanted.endswith("/") and inside.startswith(wanted))
                       for wanted in _MEMBERS):
                    member.name = inside
                    archive.extract(member, unpacked, filter="data")
        missing = [wanted for wanted in _MEMBERS if not (unpacked / wanted).exists()]
        if missing:
            raise ConverterUnavailable(f"{archives[0].name} has no vendor/llama.cpp/{', '.join(missing)}")
        (unpacked / _COMPLETE).write_text(f"{SDIST}=={VERSION}\n")
        if root.exists():
            shutil.rmtree(root)
        unpacked.rename(root)


def hf_checkpoint(arch: str, folder: Path, converter: Converter, seed: int = 0):
    """A tiny model of `arch` saved with save_pretrained into `folder`, with a tokenizer the
    converter accepts; returns the model (float32, eval mode)."""
    if arch == "mixtral":
        sp = sentencepiece_processor()
        model = tiny_model(arch, seed=seed, vocab_size=sp.vocab_size())
        model.save_pretrained(folder)
        (folder / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    else:
        tokenizer = gpt2_tokenizer(converter)
        model = tiny_model(arch, seed=seed, vocab_size=len(tokenizer))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return model


def gpt2_tokenizer(converter: Converter):
    """GPT-2's tokenizer as transformers loads it, rebuilt from llama.cpp's GPT-2 vocabulary file."""
    return _gpt2_tokenizer(converter.gpt2_vocab)


@functools.cache
def _gpt2_tokenizer(vocab: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    meta = GGUFFile(vocab).metadata             # gguf-py's reader takes seconds over these lists
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    control = [token for token, kind in zip(tokens, types) if kind == gguf.TokenType.CONTROL]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    eos = tokens[meta["tokenizer.ggml.eos_token_id"]]
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=eos, eos_token=eos)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
