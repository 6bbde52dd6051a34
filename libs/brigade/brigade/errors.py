"""The refusals of a request, by the wire checks (`brigade.wire`) or the store, each named after the
gRPC status the proxy answers with."""

from __future__ import annotations


class StoreError(Exception):
    """A request the store refuses; `code` names the gRPC status the proxy answers with."""

    code = "INTERNAL"


class InvalidArgument(StoreError):
    code = "INVALID_ARGUMENT"


class NotFound(StoreError):
    code = "NOT_FOUND"


class FailedPrecondition(StoreError):
    code = "FAILED_PRECONDITION"


class AlreadyExists(StoreError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(StoreError):
    code = "RESOURCE_EXHAUSTED"


# the `kind` of a script's {'err', kind, message} reply
BY_KIND = {
    "invalid": InvalidArgument,
    "not_found": NotFound,
    "failed_precondition": FailedPrecondition,
    "exists": AlreadyExists,
    "exhausted": ResourceExhausted,
}


class LegacyKeys(RuntimeError):
    """This Redis holds runs in the key layout before hash tags (Runs.check_layout): not a refusal of
    one request but a deployment to migrate, so services refuse to start on it."""
