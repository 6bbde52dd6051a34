"""Who may call what: roles, the tokens file, and the caller's credential.

Each RPC of the proxy belongs to exactly one role (METHOD_ROLES); a credential (a name and one or
more roles) may call the methods of its roles, and every credential may call the reader methods.

The tokens file (`brigade proxy --tokens-file PATH`, BRIGADE_TOKENS_FILE) has one credential per line:

    # role[,role...]  name  token
    operator          alice     3f9c...
    learner,operator  learner   a1b2...
    worker            fleet-a   77aa...
    worker            fleet-a   88bb...   <- a second token of the same credential: rotation
    reader            dashboard 5e5e...

Blank lines and lines starting with `#` are skipped. A name (letters, digits, `.`, `_`, `-`, at
most 64) is the credential's identity in logs and per-credential quotas; several tokens may share
it. A token is at least 16 characters without spaces, and appears once in the file. The file is read
again on SIGHUP and when its modification time changes (checked at most once a second): a token
added works, a token removed stops working, without a restart. A file that no longer parses keeps
the previous table (logged). The token itself is never logged.

Without a tokens file, `--token` is one-token mode (a laptop, `brigade up`): that one token has
every role and there are no per-credential quotas (one credential is everyone).

The servicers learn the caller's credential from `name_of(context)`: the interceptor that checked
the token also records its name for the call.
"""

from __future__ import annotations

import contextvars
import hmac
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog

from brigade.rpc import OPEN_METHOD_PREFIXES, refusal
from brigade.v1 import brigade_pb2 as pb

log = structlog.get_logger("brigade.proxy")

OPERATOR, LEARNER, WORKER, READER = "operator", "learner", "worker", "reader"
ROLES = (OPERATOR, LEARNER, WORKER, READER)

# every RPC of the proxy, in exactly one role (tests/unit/test_credentials.py checks the proto has no other)
_ROLE_METHODS = {
    OPERATOR: ("RunService/CreateRun",),
    LEARNER: ("LearnerService/PullRollouts", "LearnerService/AckRollouts", "LearnerService/PublishAdapter",
              "LearnerService/PullContributions"),
    WORKER: ("LeaseService/AcquireLease", "LeaseService/Heartbeat", "LeaseService/CompleteLease",
             "LeaseService/FailLease", "LeaseService/SubmitContribution"),
    READER: ("RunService/GetRun", "RunService/ListRuns", "RunService/WatchRun", "RunService/ListLeases",
             "RunService/ListWorkers", "RunService/ListAdapters", "RunService/GetMetrics",
             "RunService/ListDeadLetters"),
}
METHOD_ROLES: dict[str, str] = {f"/{pb.DESCRIPTOR.package}.{m}": role
                                for role, methods in _ROLE_METHODS.items() for m in methods}

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_TOKEN_CHARS = 16
RELOAD_CHECK_S = 1.0


class CredentialsError(ValueError):
    """A tokens file that cannot be used (its message names the file and line, never a token)."""


@dataclass(frozen=True)
class Credential:
    name: str
    roles: frozenset[str]

    def may_call(self, method: str) -> bool:
        role = METHOD_ROLES.get(method)
        return role is not None and (role == READER or role in self.roles)


def parse_tokens(text: str, source: str = "tokens file") -> list[tuple[str, Credential]]:
    """(token, credential) of each line of a tokens file; CredentialsError for a bad line."""
    entries: list[tuple[str, Credential]] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise CredentialsError(f"{source}:{n}: expected `role[,role...] name token`, got {len(parts)} fields")
        roles_text, name, token = parts
        roles = frozenset(r.strip() for r in roles_text.split(","))
        if unknown := sorted(roles - set(ROLES)):
            raise CredentialsError(f"{source}:{n}: unknown role {', '.join(unknown)} (roles: {', '.join(ROLES)})")
        if not NAME_RE.fullmatch(name):
            raise CredentialsError(f"{source}:{n}: the name must be 1-64 of letters, digits, '.', '_', '-'")
        if len(token) < MIN_TOKEN_CHARS:
            raise CredentialsError(f"{source}:{n}: the token is shorter than {MIN_TOKEN_CHARS} characters")
        if token in seen:
            raise CredentialsError(f"{source}:{n}: this token is on an earlier line too")
        seen.add(token)
        entries.append((token, Credential(name, roles)))
    if not entries:
        raise CredentialsError(f"{source}: no credentials (lines `role[,role...] name token`)")
    return entries


class TokenTable:
    """Credentials by token, from a tokens file, reloaded when it changes or on `reload()`; or, with
    `token` instead (one-token mode), that one token with every role and no name (no quotas)."""

    def __init__(self, path: str = "", token: str = ""):
        self.path = path
        self._lock = threading.Lock()
        self._entries: list[tuple[bytes, Credential]] = []
        self._mtime: int | None = None
        self._checked = 0.0
        if path:
            self._load()  # CredentialsError at start: the proxy refuses to serve
        else:
            self._entries = [(f"Bearer {token}".encode(), Credential("", frozenset(ROLES)))]

    def _load(self) -> None:
        try:
            st = os.stat(self.path)
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise CredentialsError(f"cannot read the tokens file {self.path}: {e.strerror}") from None
        entries = [(f"Bearer {token}".encode(), c) for token, c in parse_tokens(text, self.path)]
        with self._lock:
            self._entries, self._mtime = entries, st.st_mtime_ns

    def reload(self) -> bool:
        """Read the file again (SIGHUP); a file that does not parse keeps the current table."""
        try:
            self._load()
        except CredentialsError as e:
            log.error("tokens file not reloaded; the previous tokens stay in force", error=str(e))
            return False
        log.info("tokens file loaded", path=self.path, credentials=len({c.name for _, c in self._entries}),
                 tokens=len(self._entries))
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if not self.path or now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return  # gone for a moment (an editor's rename): keep the current table
        if mtime != self._mtime:
            self.reload()

    def lookup(self, authorization: str) -> Credential | None:
        """The credential of an `authorization` header value, or None. Every token is compared, each
        in constant time: the answer's timing says nothing about how close a guess was."""
        self._maybe_reload()
        given = authorization.encode() if isinstance(authorization, str) else b""
        found = None
        for token, credential in self._entries:
            if hmac.compare_digest(given, token) and found is None:
                found = credential
        return found


# the credential of the call being served: set by the interceptor, in the call's own task
_CALLER: contextvars.ContextVar[Credential | None] = contextvars.ContextVar("brigade_caller", default=None)


def caller(context: grpc.aio.ServicerContext | None = None) -> Credential | None:
    """The credential of the call being served (one-token mode: the one, unnamed; no auth: None)."""
    return _CALLER.get()


def name_of(context: grpc.aio.ServicerContext | None = None) -> str:
    """The caller's credential name, for quotas and logs; "" without a tokens file (one-token mode or
    no auth: every caller is the same credential, and per-credential quotas do not apply)."""
    c = _CALLER.get()
    return c.name if c is not None else ""


class RoleAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for a
    method outside the credential's roles, both before the request is read; health and reflection
    stay open."""

    def __init__(self, table: TokenTable):
        self.table = table
        self._unauthenticated = refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self._unauthenticated_stream = refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token",
                                               streaming=True)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        authorization = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        credential = self.table.lookup(authorization)
        if credential is None:
            handler = await continuation(handler_call_details)
            if handler is not None and handler.response_streaming:
                return self._unauthenticated_stream
            return self._unauthenticated
        if not credential.may_call(method):
            role = METHOD_ROLES.get(method)
            need = f"the {role} role" if role else "a role no credential has (not a method of the proxy's roles)"
            log.warning("rpc denied by role", method=method, credential=credential.name, need=role)
            handler = await continuation(handler_call_details)
            return refusal(grpc.StatusCode.PERMISSION_DENIED,
                           f"{method} needs {need}; credential {credential.name!r} has "
                           f"{', '.join(sorted(credential.roles))}",
                           streaming=handler is not None and handler.response_streaming)
        _CALLER.set(credential)
        return await continuation(handler_call_details)
