"""Adapter payloads: the bytes that move between the learner and the workers.

An adapter version is a folder `runs/{run}/adapters/v{version:08d}/` in PEFT format
(`adapter_model.safetensors` + `adapter_config.json`, loadable by `PeftModel.from_pretrained` and by
vLLM's LoRA loader), or, with the int8 payload, `adapter_model.int8.safetensors` holding int8
tensors with one float32 scale each (a quarter of fp32, half of bf16). `manifest.pb` is written last,
so a version exists only once all its files do. Only safetensors is ever parsed: nothing pickled.
"""

from __future__ import annotations

import json
import math
import struct
import time
import warnings
from typing import TYPE_CHECKING

import torch
from google.protobuf.message import DecodeError
from safetensors.torch import save as st_save

from brigade import keys
from brigade.bucket import Bucket, ObjectExists, sha256_hex
from brigade.v1 import brigade_pb2 as pb

if TYPE_CHECKING:
    from peft import PeftModel

WEIGHTS = "adapter_model.safetensors"
WEIGHTS_INT8 = "adapter_model.int8.safetensors"
CONFIG = "adapter_config.json"
MANIFEST = "manifest.pb"
SCALE_SUFFIX = ".__scale__"


A_SUFFIX, B_SUFFIX = "lora_A.weight", "lora_B.weight"
MERGES = ("frozen_a", "factors")


def trained_names(names, merge: str) -> list[str]:
    """topology local_sgd: the adapter tensors the trainers train and send and the aggregator merges
    (local_sgd.merge frozen_a: B only, A stays the seeded v0; factors: A and B)."""
    if merge not in MERGES:
        raise ValueError(f"merge {merge!r} is not one of {MERGES}")
    suffixes = (B_SUFFIX,) if merge == "frozen_a" else (A_SUFFIX, B_SUFFIX)
    return sorted(n for n in names if n.endswith(suffixes))


class InvalidAdapter(ValueError):
    """Adapter files that are not safetensors, or whose tensors do not fit the model."""


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict  # here: peft imports transformers (seconds), which the
    # aggregator, reading and writing adapter files only, never needs

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def adapter_config_json(model: PeftModel) -> bytes:
    config = model.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps(config, indent=2, sort_keys=True, default=str).encode()


def encode(state: dict[str, torch.Tensor], config_json: bytes, payload: str = "bf16") -> tuple[dict[str, bytes], float]:
    """The files of one adapter version and the relative quantization error (0 for bf16)."""
    if payload == "bf16":
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
        return {WEIGHTS: st_save(tensors, metadata={"format": "pt"}), CONFIG: config_json}, 0.0
    if payload != "int8":
        raise ValueError(f"unknown adapter payload {payload!r}; use bf16 or int8")
    tensors: dict[str, torch.Tensor] = {}
    err_sq = ref_sq = 0.0
    for name, value in state.items():
        value = value.float()
        scale = value.abs().max().clamp(min=1e-12) / 127.0
        q = torch.round(value / scale).clamp(-127, 127).to(torch.int8)
        tensors[name] = q.contiguous()
        tensors[name + SCALE_SUFFIX] = scale.reshape(1)
        err_sq += float(((q.float() * scale) - value).pow(2).sum())
        ref_sq += float(value.pow(2).sum())
    rel_err = (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0
    return {WEIGHTS_INT8: st_save(tensors, metadata={"format": "brigade-int8"}), CONFIG: config_json}, rel_err


def decode(files: dict[str, bytes | bytearray], float32: bool = True) -> dict[str, torch.Tensor]:
    """Float32 adapter tensors from either payload; InvalidAdapter on anything else. float32=False
    keeps bf16 as sent (int8 is dequantized to float32 either way): for a caller that copies the
    tensors into its own parameters, which converts in the same pass."""
    if WEIGHTS in files:
        raw = _load_safetensors(files[WEIGHTS], WEIGHTS)
        return {k: v.float() for k, v in raw.items()} if float32 else raw
    if WEIGHTS_INT8 in files:
        raw = _load_safetensors(files[WEIGHTS_INT8], WEIGHTS_INT8)
        out = {}
        for name, q in raw.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            scale = raw.get(name + SCALE_SUFFIX)
            if scale is None or q.dtype != torch.int8:
                raise InvalidAdapter(f"int8 adapter tensor {name!r} lacks its scale or is not int8")
            out[name] = q.float() * scale.float()
        return out
    raise InvalidAdapter(f"adapter has neither {WEIGHTS} nor {WEIGHTS_INT8} (files: {sorted(files)})")


# safetensors dtype names -> torch; what the payloads hold, and what a PEFT file may
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I8": torch.int8}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _load_safetensors(data: bytes | bytearray, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of `data` (nothing may write to them, and nothing
    here does), checked as strictly as safetensors.torch.load checks them: its load
    copies every tensor, 34 MB for a 7B adapter, on every worker's path to a new policy."""
    try:
        if len(data) < 8:
            raise ValueError("shorter than its 8-byte header length")
        (n,) = struct.unpack_from("<Q", data)
        if n > min(MAX_HEADER_BYTES, len(data) - 8):
            raise ValueError(f"header of {n} bytes in a file of {len(data)}")
        header = json.loads(data[8:8 + n])
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        body, spans, out = len(data) - 8 - n, [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes: "the given buffer is not writable": on purpose
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                dtype = _ST_DTYPES.get(entry["dtype"])
                shape, (begin, end) = entry["shape"], entry["data_offsets"]
                if dtype is None or not all(type(x) is int and x >= 0 for x in (*shape, begin, end)):
                    raise ValueError(f"tensor {key!r}: bad dtype, shape or offsets {entry}")
                numel = math.prod(shape)
                if not begin <= end <= body or end - begin != numel * dtype.itemsize:
                    raise ValueError(f"tensor {key!r}: offsets {begin}..{end} do not hold {shape} {entry['dtype']}")
                spans.append((begin, end))
                out[key] = (torch.frombuffer(data, dtype=dtype, count=numel, offset=8 + n + begin).view(shape)
                            if numel else torch.empty(shape, dtype=dtype))
        spans.sort()
        if [b for b, _ in spans] != [0, *(e for _, e in spans[:-1])] or (spans and spans[-1][1] != body):
            raise ValueError("tensors do not tile the data section (a gap or an overlap)")
        return out
    except (ValueError, KeyError, TypeError, struct.error) as e:  # JSONDecodeError is a ValueError
        raise InvalidAdapter(f"{name} is not a valid safetensors file: {e}") from e


def apply(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors into the model's active adapter, refusing wrong names or shapes."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = get_peft_model_state_dict(model)
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise InvalidAdapter(f"adapter tensors do not match the model: missing {missing[:3]}, unknown {unknown[:3]}")
    for name, value in state.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise InvalidAdapter(f"adapter tensor {name} has shape {tuple(value.shape)}, the model needs {tuple(expected[name].shape)}")
        if not torch.isfinite(value).all():
            raise InvalidAdapter(f"adapter tensor {name} has NaN or infinite values")
    set_peft_model_state_dict(model, state)


# ---------------------------------------------------------------- bucket

async def write_version(
    bucket: Bucket, run: str, version: int, step: int, files: dict[str, bytes], payload: str, quant_error: float = 0.0
) -> pb.AdapterManifest:
    """Create-only writes of every file, then the manifest. Rewriting the same bytes after a crash is
    allowed (the version is re-derived from a checkpoint); different bytes under a version are not."""
    prefix = keys.adapter_prefix(run, version)
    manifest = pb.AdapterManifest(
        run_id=run, version=version, step=step, uri=bucket.url(prefix.rstrip("/")) + "/", payload=payload,
        created_ms=int(time.time() * 1000), quantization_error=quant_error,
    )
    for name in sorted(files):
        data = files[name]
        digest = await put_once(bucket, prefix + name, data)
        manifest.files.add(name=name, sha256=digest, size_bytes=len(data))
    try:
        await bucket.put_new(prefix + MANIFEST, manifest.SerializeToString())
    except ObjectExists:
        existing = pb.AdapterManifest.FromString(await bucket.get(prefix + MANIFEST))
        if [(f.name, f.sha256) for f in existing.files] != [(f.name, f.sha256) for f in manifest.files]:
            raise
        return existing
    return manifest


async def put_once(bucket: Bucket, key: str, data: bytes) -> str:
    """A create-only put that a retry may repeat: the same bytes already there are fine, other bytes
    raise ObjectExists. Returns the sha256."""
    try:
        return await bucket.put_new(key, data)
    except ObjectExists:
        digest = sha256_hex(data)
        if sha256_hex(await bucket.get(key)) != digest:
            raise
        return digest


async def read_manifest(bucket: Bucket, run: str, version: int) -> pb.AdapterManifest:
    """A version's manifest as written (the bytes PublishAdapter was sent)."""
    prefix = keys.adapter_prefix(run, version)
    try:
        manifest = pb.AdapterManifest.FromString(await bucket.get(prefix + MANIFEST))
    except DecodeError as e:  # permanent, unlike a bucket hiccup: the worker fails the lease, counted
        raise InvalidAdapter(f"manifest at {prefix} does not parse: {e}") from None
    if manifest.version != version or manifest.run_id != run:
        raise InvalidAdapter(f"manifest at {prefix} says run {manifest.run_id!r} version {manifest.version}")
    return manifest


async def read_version(bucket: Bucket, run: str, version: int) -> tuple[pb.AdapterManifest, dict[str, bytearray]]:
    """The manifest and every file of a version, each checked against its sha256. The files come
    as bytearrays (Bucket.get_buffer: no final copy of a 34 MB adapter on every worker's path to a
    new policy); every reader decodes them with `decode`, which takes any buffer."""
    prefix = keys.adapter_prefix(run, version)
    manifest = await read_manifest(bucket, run, version)
    files = {}
    for f in manifest.files:
        if "/" in f.name or f.name.startswith("."):
            raise InvalidAdapter(f"adapter manifest names a file outside its folder: {f.name!r}")
        files[f.name] = await bucket.get_buffer(prefix + f.name, sha256=f.sha256)
    return manifest, files
