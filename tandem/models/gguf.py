"""GGUF files as a model source: de-quantized once through transformers into a cached HF directory.

A ``model_path`` may name a ``.gguf`` file, or a directory that holds exactly one and no
``config.json``. :func:`resolve_model_path` turns it into an ordinary ``save_pretrained``
directory (model, tokenizer, generation config) under ``$TANDEM_CACHE/gguf/<key>`` (default
``~/.cache/tandem/gguf``), where the key hashes the file's absolute path, size and modification
time: a changed file converts again, an unchanged one never does. Everything after that —
training, rollout, export, serving — reads that directory. The weights are de-quantized to
float32 (a quantized model is trained in float32 or bfloat16, never in its GGUF blocks).

The conversion holds a lock file beside the cache entry and writes through
:func:`tandem.files.atomic_directory`, so a second process waits for the first and never sees a
half-written directory. A file that cannot be converted (not GGUF, truncated, an architecture or
tensor type transformers cannot read, the ``gguf`` package missing) raises :class:`GGUFError`:
one line naming the file and the reason, before any model loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.config.paths import model_path_keys, replace_keys
from tandem.files import atomic_directory

T = TypeVar("T")

LOG = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_CACHE"  # the cache root; GGUF conversions go to its gguf/ folder
INSTALL_HINT = "pip install gguf accelerate (or the project's extra: pip install -e '.[gguf]')"
GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "tandem_gguf_source.json"  # written last into a conversion: what it was made from


class GGUFError(ValueError):
    """A GGUF model source that cannot be used; the message names the file and the reason."""


def gguf_file_of(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names (itself, or the only ``.gguf`` in a directory without a
    ``config.json``), or None when ``path`` is not a GGUF source."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(child for child in path.iterdir() if child.suffix.lower() == ".gguf" and child.is_file())
    if len(found) > 1:
        names = ", ".join(child.name for child in found)
        raise GGUFError(f"{path} holds several GGUF files ({names}): name one of them as the model path")
    return found[0] if found else None


def cache_root() -> Path:
    """Where conversions are kept: ``$TANDEM_CACHE/gguf``, by default ``~/.cache/tandem/gguf``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return Path(root) / "gguf"


def cache_dir_for(gguf_file: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The cache directory of ``gguf_file``: ``<stem>-<hash of its absolute path, size, mtime>``."""
    gguf_file = Path(gguf_file).resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(root if root is not None else cache_root()) / f"{gguf_file.stem}-{key}"


def resolve_model_path(path: str, root: str | os.PathLike | None = None) -> str:
    """``path`` itself, or, when it names a GGUF file, its converted HF directory (converted now
    if the cache lacks it). The one resolver every model loader and trainer goes through."""
    if not path:
        return path
    gguf_file = gguf_file_of(path)
    if gguf_file is None:
        return path
    target = cache_dir_for(gguf_file, root)
    if not (target / SOURCE_FILE).exists():
        check_magic(gguf_file)  # before the lock file: a wrong file leaves nothing in the cache
        with _locked(target.with_name(target.name + ".lock")):
            if not (target / SOURCE_FILE).exists():  # another process may have converted it meanwhile
                convert_gguf(gguf_file, target)
    return str(target)


def convert_gguf(gguf_file: str | os.PathLike, target: str | os.PathLike) -> Path:
    """De-quantize ``gguf_file`` to float32 and write model, tokenizer and generation config to
    ``target`` atomically; the conversion is logged with its time."""
    gguf_file = Path(gguf_file)
    check_gguf_file(gguf_file)
    try:  # deferred: only a conversion needs it, and older transformers lack it
        from transformers import GgufConfig
    except ImportError as error:
        raise GGUFError(f"{gguf_file}: this transformers cannot de-quantize GGUF files on load (no GgufConfig); upgrade it") from error

    LOG.warning("converting %s to an HF directory in %s (once per file)", gguf_file, target)
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent),
            gguf_file=gguf_file.name,
            quantization_config=GgufConfig(dequantize=True),  # plain float weights, never packed blocks
            dtype=torch.float32,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, TypeError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise GGUFError(f"{gguf_file}: transformers cannot convert this GGUF file: {reason}") from error
    with atomic_directory(target) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        seconds = time.perf_counter() - started
        stat = gguf_file.stat()
        source = {"file": str(gguf_file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (staging / SOURCE_FILE).write_text(json.dumps({**source, "seconds": round(seconds, 2)}) + "\n")
    LOG.warning("converted %s in %.1f s", gguf_file, seconds)
    return Path(target)


def check_gguf_file(gguf_file: Path) -> None:
    """Raise :class:`GGUFError` when ``gguf_file`` is no GGUF file, is truncated, names an
    architecture transformers cannot load, or when ``gguf``/``accelerate`` are not installed."""
    check_magic(gguf_file)
    try:  # deferred: optional dependencies, needed only for GGUF sources
        import accelerate  # noqa: F401  (transformers loads GGUF files only with it)
        import gguf
    except ImportError as error:
        raise GGUFError(f"{gguf_file}: reading a GGUF file needs the {error.name!r} package: {INSTALL_HINT}") from error

    size = gguf_file.stat().st_size
    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except (ValueError, IndexError, KeyError, OSError) as error:
        raise GGUFError(f"{gguf_file}: truncated or corrupt GGUF file ({size} bytes): {error}") from error
    end = max((tensor.data_offset + int(tensor.n_bytes) for tensor in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{gguf_file}: truncated GGUF file: {size} bytes, its tensors need {end}")
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    supported = transformers_gguf_architectures()
    if architecture not in supported:
        raise GGUFError(
            f"{gguf_file}: architecture {architecture!r} is not one transformers can load from GGUF "
            f"(it reads {', '.join(sorted(supported))})"
        )


def check_magic(gguf_file: Path) -> None:
    """Raise :class:`GGUFError` when ``gguf_file`` does not start with the GGUF magic bytes."""
    with open(gguf_file, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{gguf_file}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")


def transformers_gguf_architectures() -> set[str]:
    """The GGUF ``general.architecture`` names the installed transformers can convert."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # the mapping's other sections
    with contextlib.suppress(ImportError):  # transformers >= 5.24 has a second, native GGUF path
        from transformers.integrations.gguf.utils import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    return names


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (made if missing): one conversion per file at a time."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)



def with_gguf_resolved(config: T) -> T:
    """``config`` with each model path that names a GGUF file (every field marked
    :data:`~tandem.config.paths.MODEL_PATH`, :func:`~tandem.config.paths.model_path_keys`) replaced
    by its converted directory. The trainers call it on the controller before any worker starts,
    so every worker loads that one directory."""
    changed: dict[str, str] = {}
    for key in model_path_keys(config):
        value: object = config
        for name in key.split("."):
            value = getattr(value, name)
        resolved = resolve_model_path(value) if isinstance(value, str) and value else value
        if resolved != value:
            changed[key] = resolved
    return replace_keys(config, changed) if changed else config
