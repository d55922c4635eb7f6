"""Who may use a published A2A server (docs/protocol/a2a.md §9.7): ``a2a publish``'s
``--allow-*`` rules are ``mcp publish``'s, parsed by the one ``access_rule``, and the
forwarder checks them against the caller the owner's node authenticated (the message's
``caller``), never against what the request says, before the server is asked."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from a2a.types import Part, StreamResponse, Task, TaskState, TaskStatus
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.agent.definition import Message as AgentMessage
from p2pnode.agent.tools import Access, Caller
from p2pnode.bridges.a2a.publish import Forwarder
from p2pnode.cli import mcp as mcp_cli
from p2pnode.cli import options
from p2pnode.cli.a2a import cmd_a2a_publish
from p2pnode.cli.main import build_parser
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

# -- a server that answers "ok" to anything, counting what it is sent --------------------------


class CountingClient:
    """The A2A client's SendMessage: a completed task with one "ok" artifact."""

    def __init__(self) -> None:
        self.sent = 0

    async def send_message(self, request: Any, *, context: Any = None) -> Any:
        self.sent += 1
        done = Task(id="t1", status=TaskStatus(state=TaskState.TASK_STATE_COMPLETED))
        done.artifacts.add(artifact_id="a", parts=[Part(text="ok")])
        yield StreamResponse(task=done)


def caller(
    agent: str = "ana",
    *,
    tier: int = 2,
    sandbox: str | None = None,
    peer: str = "p1",
    roles: tuple[str, ...] = (),
) -> Caller:
    return Caller(agent, peer, tier, sandbox, frozenset(roles))


def asked(by: Caller | None, payload: Any = "hi", sender: str = "ana") -> AgentMessage:
    """A request from ``sender``, with ``by`` the caller its node authenticated."""
    envelope = Envelope("e1", sender, "desk", MessageType.REQUEST, 1, payload)
    return AgentMessage(envelope, by)


def call(forwarder: Forwarder, message: AgentMessage, skill: str | None = "s") -> Any:
    return anyio.run(forwarder.handler(skill), message)


def forwarder_of(
    access: Access | None, callers: Callable[[str], Caller | None] | None = None
) -> tuple[Forwarder, CountingClient]:
    client = CountingClient()
    return Forwarder(client, access=access, callers=callers), client  # type: ignore[arg-type]


# -- the rule, kind by kind --------------------------------------------------------------------

#: Per kind: the rule, a caller it lets in, and one it refuses (with the reason's words).
KINDS: dict[str, tuple[Access, Caller, Caller, str]] = {
    "tier": (Access(tiers=[1]), caller(tier=1), caller(tier=2), "tier L2 is not one of L1"),
    "sandbox": (
        Access(sandboxes=["lab"]),
        caller(sandbox="lab"),
        caller(sandbox="yard"),
        "sandbox 'yard' is not one of lab",
    ),
    "agent": (Access(agents=["ana"]), caller("ana"), caller("bo"), "agent 'bo' is not allowed"),
    "peer": (Access(peers=["p1"]), caller(peer="p1"), caller(peer="p2"), "peer p2 is not allowed"),
    "role": (
        Access(roles=["admin"]),
        caller(roles=("admin", "ops")),
        caller(roles=("ops",)),
        "no endorsed role among admin",
    ),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_lets_a_matching_caller_reach_the_server_and_refuses_another(kind: str) -> None:
    access, allowed, refused, reason = KINDS[kind]
    forwarder, client = forwarder_of(access)
    assert call(forwarder, asked(allowed, sender=allowed.agent_id)) == "ok"
    assert client.sent == 1
    with pytest.raises(RemoteError) as denied:
        call(forwarder, asked(refused, sender=refused.agent_id), "shout")
    error = denied.value
    assert error.code is ErrorCode.PERMISSION_DENIED
    assert error.message == (
        f"{refused.agent_id} may not use skill 'shout' of the A2A server: {reason}"
    )
    assert error.details == {"caller": refused.agent_id}
    assert client.sent == 1  # the server was not asked


def test_every_kind_given_must_hold() -> None:
    forwarder, client = forwarder_of(Access(tiers=[1], roles=["admin"]))
    for wrong in (caller(tier=2, roles=("admin",)), caller(tier=1, roles=("ops",))):
        with pytest.raises(RemoteError) as denied:
            call(forwarder, asked(wrong))
        assert denied.value.code is ErrorCode.PERMISSION_DENIED
    assert client.sent == 0
    assert call(forwarder, asked(caller(tier=1, roles=("admin",)))) == "ok"
    assert client.sent == 1


def test_what_the_request_claims_counts_not_only_the_authenticated_caller() -> None:
    # A payload dressed as a caller, and no caller from the node: refused, not read.
    claim = {"caller": {"agentId": "ana", "tier": 0, "roles": ["admin"]}, "tier": 0}
    forwarder, client = forwarder_of(Access(tiers=[0], roles=["admin"]))
    with pytest.raises(RemoteError) as denied:
        call(forwarder, asked(None, claim), None)
    assert denied.value.message == (
        "an unknown caller may not use the A2A server: the caller is not authenticated"
    )
    assert denied.value.details == {"caller": "an unknown caller"}
    assert client.sent == 0


@pytest.mark.parametrize("access", [None, Access()], ids=["no-rule", "empty-rule"])
def test_without_a_rule_anyone_the_node_delivers_is_served(access: Access | None) -> None:
    forwarder, client = forwarder_of(access)
    assert call(forwarder, asked(None)) == "ok"
    assert call(forwarder, asked(caller(tier=3))) == "ok"
    assert client.sent == 2


def test_the_nodes_lookup_names_a_caller_only_when_none_came_with_the_request() -> None:
    looked: list[str] = []

    def lookup(agent_id: str) -> Caller | None:
        looked.append(agent_id)
        return caller(agent_id, tier=1) if agent_id == "ana" else None

    forwarder, client = forwarder_of(Access(tiers=[1]), lookup)
    assert call(forwarder, asked(None, sender="ana")) == "ok"
    with pytest.raises(RemoteError):
        call(forwarder, asked(None, sender="bo"))  # no card: not authenticated
    # The caller the node passed wins over the lookup.
    with pytest.raises(RemoteError):
        call(forwarder, asked(caller("ana", tier=2), sender="ana"))
    assert looked == ["ana", "bo"]
    assert client.sent == 1


NAMES = st.sampled_from(["ana", "bo", "lab", "yard", "p1", "p2", "admin", "ops"])
ACCESS = st.builds(
    Access,
    tiers=st.none() | st.frozensets(st.integers(0, 3), max_size=3),
    sandboxes=st.none() | st.frozensets(NAMES, max_size=3),
    agents=st.none() | st.frozensets(NAMES, max_size=3),
    peers=st.none() | st.frozensets(NAMES, max_size=3),
    roles=st.none() | st.frozensets(NAMES, max_size=3),
)
CALLERS = st.none() | st.builds(
    Caller, NAMES, NAMES, st.integers(0, 3), st.none() | NAMES, st.frozensets(NAMES, max_size=3)
)


@given(access=ACCESS, who=CALLERS, payload=st.none() | st.dictionaries(NAMES, NAMES))
def test_a_caller_is_refused_exactly_when_the_tool_rule_would_refuse_it(
    access: Access, who: Caller | None, payload: Any
) -> None:
    forwarder, _ = forwarder_of(access)
    message = asked(who, payload, sender=who.agent_id if who is not None else "ana")
    refusal = access.refusal(who)
    if refusal is None:
        forwarder.check(message, "s")
        return
    with pytest.raises(RemoteError) as denied:
        forwarder.check(message, "s")
    assert denied.value.code is ErrorCode.PERMISSION_DENIED
    assert denied.value.message.endswith(f": {refusal}")


# -- the command line --------------------------------------------------------------------------


def subcommand(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def allow_actions(parser: argparse.ArgumentParser) -> list[tuple[Any, ...]]:
    return [
        (tuple(a.option_strings), a.dest, a.metavar, a.help, type(a).__name__)
        for a in parser._actions
        if any(s.startswith("--allow-") for s in a.option_strings)
    ]


def test_a2a_publish_takes_mcp_publishs_five_allow_options_as_they_are() -> None:
    a2a, mcp = subcommand("a2a", "publish"), subcommand("mcp", "publish")
    assert allow_actions(a2a) == allow_actions(mcp)
    assert [a[0] for a in allow_actions(a2a)] == [
        (f"--allow-{kind}",) for kind in ("tier", "sandbox", "agent", "peer", "role")
    ]
    assert mcp_cli.access_rule is options.access_rule  # one parser of the rules, not two


def test_the_options_become_one_access_rule() -> None:
    rules = ["--allow-tier", "1", "--allow-tier", "2", "--allow-role", "admin"]
    rules += ["--allow-peer", "p1", "--allow-sandbox", "lab", "--allow-agent", "ana"]
    args = build_parser().parse_args(
        ["a2a", "publish", "http://127.0.0.1:9/", "--agent-id", "desk", *rules]
    )
    access = options.access_rule(options.allow_rules(args))
    assert access is not None
    assert (access.tiers, access.roles, access.peers, access.sandboxes, access.agents) == (
        frozenset({1, 2}),
        frozenset({"admin"}),
        frozenset({"p1"}),
        frozenset({"lab"}),
        frozenset({"ana"}),
    )
    bare = build_parser().parse_args(["a2a", "publish", "http://h/", "--agent-id", "desk"])
    assert options.access_rule(options.allow_rules(bare)) is None


@pytest.mark.parametrize(
    ("flag", "value"), [("--allow-tier", "7"), ("--allow-tier", "L1"), ("--allow-role", "")]
)
def test_a_bad_rule_ends_a2a_publish_before_anything_runs(flag: str, value: str) -> None:
    args = build_parser().parse_args(
        ["a2a", "publish", "http://127.0.0.1:9/", "--agent-id", "desk", flag, value]
    )
    with pytest.raises(LocalError) as bad:
        cmd_a2a_publish(args)
    assert bad.value.code is ErrorCode.INVALID_ARGUMENT


def test_the_warning_without_a_rule_is_mcp_publishs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "p2pnode.test"):
        options.warn_open(logging.getLogger("p2pnode.test"), "desk", "the A2A server")
    assert caplog.messages == [
        "desk: no --allow-* rule: any agent the node's policy lets send desk a request may "
        "use the A2A server"
    ]


def test_a_message_keeps_the_caller_it_was_made_with() -> None:
    who = caller(roles=("admin",))
    message = asked(who)
    assert message.caller is who
    assert dataclasses.replace(message, caller=None).caller is None
    assert asked(None).caller is None
