"""Parsing a CreateRun request (up to max_message_bytes, a million prompts) without stalling the proxy.

protobuf parses a message in one C call that holds the GIL: run in a thread or not, the event loop
(every other call) waits for it. 32 MiB of empty prompts are 16 million entries, over a second of
parsing before the prompt count could even be refused. So the request's top-level fields are walked
in Python first (interleaved with the event loop, which takes the GIL back every few milliseconds),
counting prompts: one more than `max_prompts` refuses the call there. Then the request is parsed
chunk by chunk, PARSE_CHUNK prompts per C call (a few milliseconds each): protobuf's merge of
concatenated pieces is exactly the parse of the whole."""

from __future__ import annotations

from typing import Any

import grpc

from brigade.store.runs import BREATHE_EVERY, BULK_WORK, breathe

PARSE_CHUNK = 5_000  # prompts per parse call: ~2 ms of C for short prompts
BULK = {"CreateRun": ("prompts", "max_prompts")}  # method -> (its big repeated field, the Limits field bounding it)


class Malformed(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise Malformed("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise Malformed("varint too long")


def split(data: bytes, field: int, limit: int, every: int = PARSE_CHUNK) -> tuple[int, list[int]]:
    """(entries of repeated `field` in the serialized message, offsets that cut the message between
    top-level fields every `every` entries, from 0 to len(data)). Stops counting at limit + 1 (the
    offsets are then empty). Malformed: not a sequence of fields."""
    tag_of_field = field << 3 | 2
    pos, end, n, cuts = 0, len(data), 0, [0]
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos)
        wire = tag & 7
        if wire == 2:
            b = data[pos] if pos < end else 0x80
            if b < 0x80:
                pos += 1 + b
            else:
                length, pos = _varint(data, pos)
                pos += length
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise Malformed(f"wire type {wire} at the top level")
        if tag == tag_of_field:
            n += 1
            if n > limit:
                return n, []
            if n % every == 0:
                cuts.append(pos)
            if n % BREATHE_EVERY == 0:
                breathe()
    if pos != end:
        raise Malformed("truncated field")
    if cuts[-1] != end:
        cuts.append(end)
    return n, cuts


def parse_chunked(cls: type, data: bytes, cuts: list[int]) -> Any:
    """`cls` parsed from `data` one piece (between two offsets of `split`) at a time."""
    msg = cls()
    for start, stop in zip(cuts, cuts[1:], strict=False):
        msg.MergeFromString(data[start:stop])
        breathe()
    return msg


def bulk_deserializer(cls: type, limit: int, field: str, max_entries: int, safe: Any, refused: Any) -> Any:
    """A deserializer for `cls` (run off the event loop by the gated handler) that refuses more than
    `max_entries` of repeated `field` before parsing and parses in pieces; `safe(data)` (the method's
    plain deserializer) for a request over its size limit; `refused(code, message)` what stands in for
    a refused request (calls.Refused)."""
    from brigade.wire import check_wire

    number = cls.DESCRIPTOR.fields_by_name[field].number

    def deserialize(data: bytes) -> Any:
        if len(data) > limit:
            return safe(data)  # refused for its size
        with BULK_WORK:  # one CreateRun's bulk work at a time (runs.BULK_WORK)
            return _deserialize(data)

    def _deserialize(data: bytes) -> Any:
        try:
            n, cuts = split(data, number, max_entries)
        except (Malformed, IndexError) as e:  # not parsed whole: that could be seconds of C
            return refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name}: {e or 'truncated'}")
        if n > max_entries:
            return refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"more than {max_entries} {field}; a run takes at most {max_entries}")
        try:
            return check_wire(parse_chunked(cls, data, cuts))
        except Exception as e:  # noqa: BLE001 - DecodeError and friends, InvalidArgument
            return refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name}: {e}")

    return deserialize
