"""GGUF model sources: what is one, where its conversion is cached, and the one-line refusals."""

import os
import sys

import pytest

from tandem.models.gguf import (
    CACHE_ENV,
    GGUFError,
    cache_dir_for,
    cache_root,
    gguf_file_of,
    resolve_model_path,
)
from tandem.models.loading import load_model


def write_gguf(path, architecture: str):
    """A small valid GGUF file (one f32 tensor) of ``architecture``, written by the gguf package."""
    gguf = pytest.importorskip("gguf")
    numpy = pytest.importorskip("numpy")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", numpy.zeros((4, 8), numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_with_another_magic_is_refused_in_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "home-cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(64))  # a zip, renamed
    with pytest.raises(GGUFError, match=r"model\.gguf: not a GGUF file \(it starts with b'PK") as caught:
        resolve_model_path(str(fake), tmp_path / "cache")
    assert "\n" not in str(caught.value)
    with pytest.raises(GGUFError, match="not a GGUF file"):  # the loaders go through the same resolver
        load_model(fake)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "home-cache").exists()  # nothing cached


def test_an_architecture_transformers_cannot_load_is_named(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "notanarchitecture")
    with pytest.raises(GGUFError, match=r"odd\.gguf: architecture 'notanarchitecture' is not one transformers"):
        resolve_model_path(str(path), tmp_path / "cache")


def test_a_missing_gguf_package_names_the_file_and_the_install(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when it is not installed
    with pytest.raises(GGUFError, match=r"m\.gguf: reading a GGUF file needs the 'gguf' package: pip install gguf"):
        resolve_model_path(str(path), tmp_path / "cache")


def test_which_paths_are_gguf_sources(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "extra.gguf").write_bytes(b"GGUF")  # a config.json wins: an HF directory
    one = tmp_path / "one"
    one.mkdir()
    only = write_gguf(one / "only.gguf", "llama")
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(two / "a.gguf", "llama")
    write_gguf(two / "b.gguf", "llama")
    assert gguf_file_of(hf_dir) is None and resolve_model_path(str(hf_dir)) == str(hf_dir)
    assert gguf_file_of(tmp_path / "missing") is None and resolve_model_path("org/hub-id") == "org/hub-id"
    assert gguf_file_of(one) == only and gguf_file_of(only) == only
    with pytest.raises(GGUFError, match=r"two holds several GGUF files \(a\.gguf, b\.gguf\)"):
        gguf_file_of(two)


def test_the_cache_key_follows_the_file_path_size_and_mtime(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    first = cache_dir_for(path, tmp_path / "cache")
    assert first == cache_dir_for(str(path), tmp_path / "cache")  # stable
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file changed
    assert cache_dir_for(path, tmp_path / "cache") != first


def test_the_cache_root_is_tandem_cache_or_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_root() == tmp_path / "gguf"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tandem" / "gguf"


def test_a_gguf_file_transformers_fails_on_is_one_line_naming_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    numpy = pytest.importorskip("numpy")
    path = tmp_path / "ternary.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")  # a llama header whose one tensor fits no llama weight
    for add, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("head_count", 4)):  # fmt: skip
        getattr(writer, f"add_{add}")(value)
    writer.add_tensor("token_embd.weight", numpy.zeros((4, 54), numpy.uint8), raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"ternary\.gguf: transformers cannot convert this GGUF file: ") as caught:
        resolve_model_path(str(path), tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not any((tmp_path / "cache").glob("*/config.json"))
