"""Run spec files (YAML or TOML) into a validated `RunSpec`, with messages in the file's terms.

Each key is checked against the declarations in `brigade.spec`, so an unknown or misspelt key is
reported as the user wrote it (with the nearest declared field as a suggestion), and a value that
does not parse is reported by its dotted snake_case path; every bad field gets its own line.
"""

from __future__ import annotations

import copy
import difflib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from brigade.config import ConfigError
from brigade.spec import BY_PATH, FIELDS, SECTIONS, assign, episodic, refuse, short_repr, validate_spec
from brigade.trl_names import TRL_NAMES, from_trl_names
from brigade.v1 import brigade_pb2 as pb

# "Failed to parse seed field: Value out of range: -1 at RunSpec.seed." -> "Value out of range: -1"
_PARSE_ERROR = re.compile(r"^Failed to parse \w+ field: (.*?)(?: at [\w.\[\]]*)?\.?$", re.S)


def merge_spec_data(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, section by section (a nested mapping merges, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_spec_data(out[key], value)
        else:
            out[key] = value
    return out


def read_spec_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read run spec {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"run spec {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"run spec {path} must be a mapping of fields, got {type(data).__name__}")
    return data


def _unknown(prefix: str, key: str, known: list[str]) -> str:
    """The line for a key no field declares, with the field the user most likely meant."""
    same_letters = {k.replace("_", "").lower(): k for k in known}  # promptsPerBatch -> prompts_per_batch
    near = same_letters.get(key.replace("_", "").lower()) or next(iter(difflib.get_close_matches(key, known, 1, 0.75)), "")
    guess = prefix + near if near else next((f.path for f in FIELDS if f.name == key), "")  # in another section
    hint = f"; did you mean {guess!r}?" if guess else ""
    return f"{prefix}{key[:64]}: no field named {short_repr(key)} here{hint}"


def _parse_fields(data: Any, holder: Message, section: str, prefix: str, problems: list[str]) -> None:
    """Every field of `section` from the mapping `data` (defaults where absent) into `holder`."""
    if data is None:  # an empty section in YAML (`lora:` with nothing under it)
        data = {}
    if not isinstance(data, Mapping):
        problems.append(f"{prefix.rstrip('.')}: must be a mapping of fields, got {type(data).__name__}")
        return
    declared = {f.name: f for f in FIELDS if f.section == section}
    nested = SECTIONS if section == "" else ()
    # at the top level, a misspelt TRL name is suggested as TRL spells it (brigade.trl_names)
    trl = TRL_NAMES if section == "" else ()
    for key in map(str, data):  # YAML keys may be numbers
        if key not in declared and key not in nested:
            problems.append(_unknown(prefix, key, [*declared, *nested, *trl]))
    for name, field in declared.items():
        if name == "rewards":
            continue  # a list of sections, parsed by parse_spec
        try:
            assign(holder, name, data.get(name, field.default), field.as_json)
        except json_format.ParseError as e:
            m = _PARSE_ERROR.match(str(e))
            problems.append(f"{prefix}{name}: {m[1] if m else e}")


def parse_spec(data: Mapping[str, Any]) -> pb.RunSpec:
    """A spec file's mapping over the declared defaults, as a RunSpec (not yet validated)."""
    spec = pb.RunSpec()
    problems: list[str] = []
    _parse_fields(data, spec, "", "", problems)
    for section in SECTIONS:
        _parse_fields(data.get(section), getattr(spec, section), section, f"{section}.", problems)
    # an environment may own the reward (get_reward): then no reward function is implied
    rewards = data.get("rewards", [] if episodic(spec) else BY_PATH["rewards"].default)
    if isinstance(rewards, list):
        for i, entry in enumerate(rewards):
            _parse_fields(entry, spec.rewards.add(), "rewards[]", f"rewards[{i}].", problems)
    else:
        problems.append(f"rewards: must be a list of reward mappings, got {type(rewards).__name__}")
    refuse(problems)
    return spec


def build_spec(overrides: dict[str, Any] | None = None, path: str | Path | None = None) -> pb.RunSpec:
    """The declared defaults, then the file at `path`, then `overrides`; parsed and validated."""
    data = from_trl_names(read_spec_file(path)) if path is not None else {}
    if overrides:
        data = merge_spec_data(data, from_trl_names(overrides))
    spec = parse_spec(data)
    validate_spec(spec)
    return spec


def spec_to_dict(spec: pb.RunSpec) -> dict[str, Any]:
    return json_format.MessageToDict(spec, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
