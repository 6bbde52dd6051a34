"""Generation engines: the interface in `base`, transformers in `hf`, vLLM in `vllm`.

Both engines are imported only when one is made: `hf` pulls in transformers, and `vllm` needs the
optional vllm package and a CUDA GPU, which most processes importing this package never have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brigade.engine.base import Engine
    from brigade.v1 import brigade_pb2 as pb


def make_engine(name: str, spec: pb.RunSpec, **kw) -> Engine:
    if name == "hf":
        from brigade.engine.hf import HFEngine

        return HFEngine.from_spec(spec, **kw)
    if name == "vllm":
        from brigade.engine.vllm import VLLMEngine

        return VLLMEngine.from_spec(spec, **kw)
    raise ValueError(f"unknown engine {name!r}; use hf or vllm")
