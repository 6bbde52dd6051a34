"""The error of a bad setting or run spec. The settings themselves are declared in
`brigade.settings`, the run spec in `brigade.spec`."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting or run spec; the message says which field and why."""
