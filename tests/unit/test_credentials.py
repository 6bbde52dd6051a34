"""The proxy's roles table and tokens file (brigade_proxy.credentials), without a server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from brigade.v1 import brigade_pb2 as pb
from brigade_proxy.calls import Slots, SlotsFull
from brigade_proxy.credentials import METHOD_ROLES, ROLES, CredentialsError, TokenTable, parse_tokens

TOKEN = "a-token-of-enough-length"


def test_every_rpc_of_the_proxy_is_in_exactly_one_role():
    methods = {f"/{service.full_name}/{m.name}" for service in pb.DESCRIPTOR.services_by_name.values()
               for m in service.methods}
    assert set(METHOD_ROLES) == methods  # a new RPC must be given a role (else no credential may call it)
    assert set(METHOD_ROLES.values()) == set(ROLES)
    assert METHOD_ROLES["/brigade.v1.RunService/CreateRun"] == "operator"
    assert METHOD_ROLES["/brigade.v1.LeaseService/AcquireLease"] == "worker"
    assert METHOD_ROLES["/brigade.v1.LearnerService/PublishAdapter"] == "learner"
    assert METHOD_ROLES["/brigade.v1.RunService/WatchRun"] == "reader"


@pytest.mark.parametrize(("text", "error"), [
    ("", "no credentials"),
    (f"worker fleet {TOKEN} extra", "expected `role[,role...] name token`"),
    (f"admin root {TOKEN}", "unknown role admin"),
    (f"worker,god fleet {TOKEN}", "unknown role god"),
    (f"worker fle/et {TOKEN}", "the name must be"),
    ("worker fleet short", "shorter than 16"),
    (f"worker a {TOKEN}\nreader b {TOKEN}", ":2: this token is on an earlier line too"),
])
def test_a_bad_tokens_file_is_refused_with_its_line_and_never_the_token(text, error):
    with pytest.raises(CredentialsError, match=error.replace("[", r"\[").replace("]", r"\]")) as info:
        parse_tokens(text, "tokens")
    assert TOKEN not in str(info.value)


def test_tokens_file_lookup(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# comment\n\nlearner,operator trainer {TOKEN}\nworker fleet {TOKEN}-2\nworker fleet {TOKEN}-3\n")
    table = TokenTable(str(path))
    trainer = table.lookup(f"Bearer {TOKEN}")
    assert trainer.name == "trainer" and trainer.roles == {"learner", "operator"}
    assert trainer.may_call("/brigade.v1.RunService/CreateRun") and trainer.may_call("/brigade.v1.RunService/GetRun")
    assert not trainer.may_call("/brigade.v1.LeaseService/AcquireLease")
    assert table.lookup(f"Bearer {TOKEN}-2").name == table.lookup(f"Bearer {TOKEN}-3").name == "fleet"
    assert table.lookup(TOKEN) is None and table.lookup("Bearer ") is None and table.lookup("") is None
    assert not trainer.may_call("/brigade.v1.RunService/NoSuchMethod")


def test_create_runs_in_flight_per_credential():
    slots = Slots("CreateRun calls", 2, 1, per="credential")
    with slots.hold("alice"):
        with pytest.raises(SlotsFull, match=r"this credential \(alice\) has 1 CreateRun calls in flight"), \
                slots.hold("alice"):
            pass
        with slots.hold("bob"):  # alice holds one slot, never both
            pass


def test_proxy_refuses_a_token_and_a_tokens_file_together(tmp_path):
    """The real command, in a process of its own (it configures logging for the whole process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("BRIGADE_TOKEN", "BRIGADE_TOKENS_FILE")}
    path = tmp_path / "tokens"
    path.write_text(f"reader dash {TOKEN}\n")

    def proxy(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "brigade_proxy", "--listen", "127.0.0.1:0", *args],
                              env=env, capture_output=True, text=True, timeout=60)

    result = proxy("--token", "x", "--tokens-file", str(path))
    assert result.returncode == 2 and "not both" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    path.write_text("reader dash short\n")
    result = proxy("--tokens-file", str(path))
    assert result.returncode == 2 and "shorter than 16" in result.stderr, result.stderr
