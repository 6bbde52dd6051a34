"""adapters.decode reads safetensors without copying the tensors, and refuses what safetensors itself
refuses: the real library's files (bf16, int8 with scales) read back equal, broken ones are InvalidAdapter."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from brigade import adapters


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(4 + i, 8, generator=g)
            for i in range(3) for ab in "AB"}


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_decode_reads_what_safetensors_reads(payload):
    files, _ = adapters.encode(_state(), b"{}", payload)
    weights = files[adapters.WEIGHTS if payload == "bf16" else adapters.WEIGHTS_INT8]
    views = adapters._load_safetensors(weights, "w")
    reference = st_load(weights)
    assert views.keys() == reference.keys()
    assert all(views[k].dtype == reference[k].dtype and torch.equal(views[k], reference[k]) for k in reference)
    as_sent = adapters.decode(files, float32=False)
    assert all(v.dtype == (torch.bfloat16 if payload == "bf16" else torch.float32) for v in as_sent.values())
    assert all(torch.equal(as_sent[k].float(), v) for k, v in adapters.decode(files).items())


def _file(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.parametrize("data", [
    b"",                                                                              # no header length
    struct.pack("<Q", 10**9) + b"{}",                                                 # header past the end
    _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),  # data past the end
    _file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),  # size != shape
    _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # a gap
    _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # an overlap
    _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),  # bytes left over
    _file({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),   # unknown dtype
    _file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), # negative shape
    _file({"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}, b"\0" * 4),    # shape not a list
    _file([1, 2], b""),                                                               # header not an object
    struct.pack("<Q", 3) + b"{x}",                                                    # header not JSON
])
def test_broken_files_are_invalid_adapters(data):
    with pytest.raises(adapters.InvalidAdapter, match="not a valid safetensors file"):
        adapters._load_safetensors(data, "w")
    with pytest.raises(Exception):  # noqa: B017 - the library refuses them too (its own error types)
        st_load(data)


def test_metadata_and_empty_tensors_are_fine():
    data = st_save({"a": torch.zeros(0, 3), "b": torch.ones(2, dtype=torch.bfloat16)}, metadata={"format": "pt"})
    out = adapters._load_safetensors(data, "w")
    assert out["a"].shape == (0, 3) and torch.equal(out["b"], torch.ones(2, dtype=torch.bfloat16))
