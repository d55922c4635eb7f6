"""Hostile input against real ``p2pnode run`` daemons on 127.0.0.1.

Each test feeds one kind of bad input to a *victim* daemon (as the DHT
datagrams, peer frames, connections or control lines that anyone, a peer or
the owner can send), then shows that the victim is still running and still
serving an *honest* daemon: a request between the two gets its echo and each
finds the other's capability through the DHT. Where the input comes from a
peer, the victim's ``status`` must have counted it as a security event.
The last tests cover the daemon's own failure modes: SIGTERM while peers
connect, a second daemon on the same data directory, a busy port.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from p2pnode.core.card import CARD_SIGNING_DOMAIN, AgentCard, Capability
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata, wall_clock_ms
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.jsonutil import b64encode
from p2pnode.core.wire import canonical_pack, pack
from p2pnode.dht import rpcwire
from p2pnode.dht.records import (
    ProviderInfo,
    RecordKind,
    SignedRecord,
    capability_key,
    card_key,
    encode_value,
)
from p2pnode.node.config import parse_address
from p2pnode.node.frames import (
    FrameKind,
    Hello,
    decode_frame_untrusted,
    encode_envelope,
    encode_hello,
)
from p2pnode.transport.channel import SecureChannel, connect_secure
from p2pnode.transport.secure import SecureIdentity

pytestmark = pytest.mark.slow

TEST_TIMEOUT = 60.0
WAIT = 20.0  # bound of every wait for a condition
DOC = "hostile.board"
CONNECTS, VICTIM_FDS = 1100, 1024

# The fields a card signature does not cover (the card module's theory of operation).
_UNSIGNED_FIELDS = ("signature", "origin", "lastSeenAt", "endorsement")


# -- daemons --------------------------------------------------------------------------------


class Daemons:
    """The daemons of one test, in the test's nursery; all stopped at its end."""

    def __init__(self, nursery: trio.Nursery, root: Path) -> None:
        self.nursery = nursery
        self.root = root
        self.started: list[NodeProcess] = []

    def make(self, agent: str, *, fd_limit: int | None = None) -> NodeProcess:
        """A prepared daemon hosting one tier-3 agent offering ``<agent>.echo``."""
        node = NodeProcess(self.root / agent, log_lines=100_000, fd_limit=fd_limit)
        node.prepare(agent, 3, [{"id": f"{agent}.echo", "name": "Echo", "description": "echo"}])
        self.started.append(node)
        return node

    async def start(
        self, agent: str, *, bootstrap: NodeProcess | None = None, fd_limit: int | None = None
    ) -> NodeProcess:
        node = self.make(agent, fd_limit=fd_limit)
        await node.start(self.nursery, bootstrap.address if bootstrap else None)
        return node

    async def pair(self) -> tuple[NodeProcess, NodeProcess]:
        """The victim, and an honest daemon that joined the swarm through it."""
        victim = await self.start("victim")
        return victim, await self.start("honest", bootstrap=victim)

    async def stop_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.started:
                nursery.start_soon(node.stop)


@pytest.fixture
async def daemons(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Daemons]:
    pool = Daemons(nursery, tmp_path)
    try:
        yield pool
    finally:
        with trio.CancelScope(shield=True):
            await pool.stop_all()


async def wait_for(what: str, probe: Callable[[], Awaitable[Any]]) -> Any:
    """Poll ``probe`` until it returns something true; fail naming ``what`` after WAIT."""
    value: Any = None
    with trio.move_on_after(WAIT):
        while True:
            value = await probe()
            if value:
                return value
            await trio.sleep(0.1)
    pytest.fail(f"not within {WAIT:g} s: {what} (last: {value!r})")


async def security(node: NodeProcess) -> tuple[int, dict[str, int]]:
    metrics = (await node.call({"op": "status"}))["metrics"]
    return metrics["securityEvents"], metrics["securityByCode"]


async def wait_security(
    node: NodeProcess, before: tuple[int, dict[str, int]], count: int, code: str | None = None
) -> None:
    """Wait until ``node`` counted ``count`` more security events (of ``code``, if given)."""

    async def counted() -> bool:
        total, by_code = await security(node)
        if code is None:
            return total >= before[0] + count
        return by_code.get(code, 0) >= before[1].get(code, 0) + count

    await wait_for(f"{count} more security event(s) {code or ''} on {node.data_dir.name}", counted)


def assert_alive(node: NodeProcess) -> None:
    assert node.process is not None
    assert node.process.returncode is None, "\n".join(node.log[-40:])


async def find(node: NodeProcess, capability: str) -> list[str]:
    async def probe() -> list[str]:
        return [c["id"] for c in await node.call({"op": "find", "capability": capability})]

    found: list[str] = await wait_for(f"{node.data_dir.name} finds {capability}", probe)
    return found


async def assert_serves(victim: NodeProcess, honest: NodeProcess, nonce: int) -> None:
    """The victim runs, answers its owner, answers the honest daemon's request, and the
    two find each other's capability through the DHT."""
    assert_alive(victim)
    ask = {"op": "send", "from": "honest", "to": "victim", "type": "request"}
    reply = await honest.call({**ask, "payload": {"nonce": nonce}})
    assert reply["sender"] == "victim"
    assert reply["payload"]["echo"] == {"nonce": nonce}
    ask = {"op": "send", "from": "victim", "to": "honest", "type": "request"}
    reply = await victim.call({**ask, "payload": {"nonce": -nonce}})
    assert reply["payload"]["echo"] == {"nonce": -nonce}
    assert "victim" in await find(honest, "victim.echo")
    assert "honest" in await find(victim, "honest.echo")
    assert_alive(victim)


async def cli(data_dir: Path, *argv: str) -> tuple[int, str, str]:
    """Run ``p2pnode --data-dir DATA_DIR ARGV...``; (exit code, stdout, stderr)."""
    with trio.fail_after(WAIT):
        result = await trio.run_process(
            [sys.executable, "-m", "p2pnode", "--data-dir", str(data_dir), *argv],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def assert_one_error_line(err: str, *parts: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("p2pnode: error:"), err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0]
    return lines[0]


# -- hostile material -----------------------------------------------------------------------


def signed_card(identity: Identity, agent: str, capabilities: tuple[str, ...] = ()) -> AgentCard:
    now = wall_clock_ms()
    card = AgentCard(
        id=agent,
        name=agent.upper(),
        version="1.0.0",
        public_key=identity.public_key,
        capabilities=tuple(Capability(c, c) for c in capabilities),
        issued_at=now,
        expires_at=now + 3_600_000,
        revision=now,
    )
    return card.signed(identity)


def resigned(plain: dict[Any, Any], identity: Identity) -> bytes:
    """msgpack of a card's plain form, edited, with a valid owner signature over the
    edit, so that a node checking the signature first still has to parse the rest."""
    signed_part = {k: v for k, v in plain.items() if k not in _UNSIGNED_FIELDS}
    signature = identity.sign(CARD_SIGNING_DOMAIN + canonical_pack(signed_part))
    return pack({**plain, "signature": b64encode(signature)})


def card_with_bad_endpoints(identity: Identity, agent: str, capabilities: tuple[str, ...]) -> bytes:
    """Valid msgpack, invalid card: a transport that is a list (unhashable)."""
    plain = signed_card(identity, agent, capabilities).to_dict()
    plain["endpoints"] = [{"transport": []}]
    return resigned(plain, identity)


def card_with_mixed_capability_keys(identity: Identity, agent: str) -> bytes:
    """Valid msgpack, invalid card: a capability with unknown keys, bytes and str mixed
    (they do not sort together)."""
    plain: dict[Any, Any] = signed_card(identity, agent, ("mixed.keys",)).to_dict()
    plain["capabilities"][0].update({b"blob": 1, "zap": 2, b"\xff": [], "y": {}})
    return resigned(plain, identity)


async def evil_channel(victim: NodeProcess, identity: Identity) -> SecureChannel:
    """A Noise channel to the victim as a peer with ``identity``, as any node dials."""
    host, port = parse_address(victim.address)
    stream = await trio.open_tcp_stream(host, port)
    return await connect_secure(stream, SecureIdentity(identity))


def hello(cards: list[bytes]) -> bytes:
    return pack([FrameKind.HELLO, {"cards": cards, "addresses": []}])


async def store_datagrams(victim: NodeProcess, records: list[SignedRecord]) -> None:
    """Send one UDP ``store`` per record to the victim's DHT port; wait (bounded) for
    the replies, which only say the datagrams were processed."""
    peer_id = PeerId.parse((await victim.call({"op": "status"}))["peerId"])
    host, port = parse_address(victim.address)
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
        await sock.bind(("127.0.0.1", 0))
        for i, record in enumerate(records):
            msg_id = bytes([i + 1]) * rpcwire.MSG_ID_BYTES
            # The victim's own id as the caller id: it keeps this socket out of the
            # victim's routing table, so its later lookups do not wait on a contact
            # that never answers.
            args = [peer_id.raw, record.key, encode_value([record])]
            await sock.sendto(rpcwire.encode_request(msg_id, "store", args), (host, port))
        with trio.move_on_after(5):
            for _ in records:
                await sock.recv(rpcwire.MAX_DATAGRAM_BYTES)


def poisoned_records(identity: Identity, agent: str, capability: str) -> list[SignedRecord]:
    """A provider record for ``capability`` and the card record it points to, both
    validly signed; the card inside is invalid."""
    now = wall_clock_ms()
    expires = now + 600_000
    provider = ProviderInfo(capability, agent, (("127.0.0.1", 9),)).to_bytes()
    card = card_with_bad_endpoints(identity, agent, (capability,))
    return [
        SignedRecord.create(
            identity, RecordKind.PROVIDER, capability_key(capability), now, expires, provider
        ),
        SignedRecord.create(
            identity, RecordKind.CARD, card_key(identity.peer_id, agent), now, expires, card
        ),
    ]


async def doc_value(node: NodeProcess) -> Any:
    return (await node.call({"op": "doc.read", "doc": DOC}))["value"]


async def assert_doc_replicates(writer: NodeProcess, reader: NodeProcess, element: str) -> None:
    update = {"op": "set.add", "path": ["seen"], "element": element}
    await writer.call({"op": "doc.update", "doc": DOC, "update": update})

    async def arrived() -> bool:
        return element in (await doc_value(reader)).get("seen", [])

    await wait_for(f"{element!r} replicated to {reader.data_dir.name}", arrived)


# -- the table: one test per row ------------------------------------------------------------


async def test_dht_records_with_an_invalid_card(daemons: Daemons) -> None:
    """Anyone with UDP: a provider record and a card record (bad endpoints) stored into
    the victim's DHT, for a capability it is then asked to find and for the discovery
    key of a document it subscribes to."""
    with trio.fail_after(TEST_TIMEOUT):
        victim, honest = await daemons.pair()
        before = await security(victim)
        evil = Identity.generate()
        records = poisoned_records(evil, "evil", "bait.capability")
        records += poisoned_records(evil, "evil2", f"crdt:{DOC}")
        await store_datagrams(victim, records)

        found = await victim.call({"op": "find", "capability": "bait.capability"})
        assert found == []
        # The find has read the invalid card (synchronously): it is counted by now.
        after = await security(victim)
        assert after[0] > before[0], f"no security event for the invalid DHT card: {after}"
        await honest.call({"op": "doc.subscribe", "doc": DOC})
        # Subscribing looks the document's peers up at once: the poisoned key is read.
        await victim.call({"op": "doc.subscribe", "doc": DOC})
        assert_alive(victim)
        await assert_doc_replicates(victim, honest, "from victim")
        await assert_doc_replicates(honest, victim, "from honest")
        await assert_serves(victim, honest, 1)


async def test_hello_frames_with_invalid_cards(daemons: Daemons) -> None:
    """Any peer: after an ordinary handshake, a HELLO whose card has bad endpoints, and
    one whose card has capability keys mixing bytes and str."""
    with trio.fail_after(TEST_TIMEOUT):
        victim, honest = await daemons.pair()
        before = await security(victim)
        bad_endpoints, mixed_keys = Identity.generate(), Identity.generate()
        for identity, card in (
            (bad_endpoints, card_with_bad_endpoints(bad_endpoints, "evil", ("evil.echo",))),
            (mixed_keys, card_with_mixed_capability_keys(mixed_keys, "evil")),
        ):
            # Each from its own peer, on its own channel: the second must not depend
            # on the victim keeping a channel open after the first.
            channel = await evil_channel(victim, identity)
            async with channel:
                await channel.send_message(hello([card]))
                await wait_security(victim, before, 1, "INVALID_CARD")
                before = await security(victim)
        await assert_serves(victim, honest, 2)


async def test_gossip_message_that_is_not_a_gossip_frame(daemons: Daemons) -> None:
    """A subscribed peer whose card the victim knows sends gossip bytes
    ``82a17603a17490`` ({"v": 3, "t": []}: gossip version 3) to the victim's subscribed agent."""
    with trio.fail_after(TEST_TIMEOUT):
        victim, honest = await daemons.pair()
        await honest.call({"op": "doc.subscribe", "doc": DOC})
        await victim.call({"op": "doc.subscribe", "doc": DOC})
        evil = Identity.generate()
        card = signed_card(evil, "evil", (f"crdt:{DOC}",))
        channel = await evil_channel(victim, evil)
        async with channel:
            await channel.send_message(encode_hello([card], []))

            async def knows_evil() -> bool:
                return str(evil.peer_id) in (await victim.call({"op": "status"}))["peers"]

            await wait_for("the victim knows the evil card", knows_evil)
            before = await security(victim)
            payload = {"crdt": DOC, "frame": bytes.fromhex("82a17603a17490")}
            envelope = EnvelopeFactory(wall_clock_ms).create(
                "evil", "victim", MessageType.STREAM_DATA, payload, metadata=Metadata(tier=3)
            )
            await channel.send_message(encode_envelope(envelope))
            await wait_security(victim, before, 1, "MALFORMED_MESSAGE")
        await assert_doc_replicates(honest, victim, "after the bad frame")
        await assert_doc_replicates(victim, honest, "and back")
        await assert_serves(victim, honest, 3)


async def test_more_connections_than_file_descriptors(daemons: Daemons) -> None:
    """Anyone: 1,100 TCP connections to a victim limited to 1,024 descriptors, held
    open, then closed; the victim accepts again (a new honest daemon joins)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < CONNECTS + 256:
        if hard != resource.RLIM_INFINITY and hard < CONNECTS + 256:
            pytest.skip(
                f"the OS caps this process at {hard} descriptors, fewer than the "
                f"{CONNECTS + 256} the attack holds open"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (CONNECTS + 256, hard))
    with trio.fail_after(TEST_TIMEOUT):
        victim = await daemons.start("victim", fd_limit=VICTIM_FDS)
        host, port = parse_address(victim.address)
        sockets: list[trio.socket.SocketType] = []
        refused: OSError | None = None
        try:
            with trio.move_on_after(WAIT):
                for _ in range(CONNECTS):
                    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
                    sockets.append(sock)
                    try:
                        # Past the victim's descriptors the kernel still completes
                        # connections into the listen backlog.
                        await sock.connect((host, port))
                    except OSError as exc:
                        refused = exc
                        break
            connected = len(sockets) - (refused is not None)
            assert_alive(victim)
        finally:
            for sock in sockets:
                sock.close()
        assert refused is None, f"refused after {connected} connections: {refused}"
        # Past the victim's limit (the kernel may leave a few beyond its backlog pending).
        assert connected > VICTIM_FDS
        # It accepts again: a new peer's handshake completes and the victim says HELLO.
        with trio.fail_after(WAIT):
            channel = await evil_channel(victim, Identity.generate())
            async with channel:
                greeting = decode_frame_untrusted(await channel.receive_message())
        assert isinstance(greeting, Hello)
        assert [card.id for card in greeting.cards] == ["victim"]
        honest = await daemons.start("honest", bootstrap=victim)
        await assert_serves(victim, honest, 4)


async def test_control_line_of_5000_brackets(daemons: Daemons) -> None:
    """The owner: a control line of 5,000 ``[`` gets an error answer, and the same
    connection and the node go on serving."""
    with trio.fail_after(TEST_TIMEOUT):
        victim, honest = await daemons.pair()
        stream = await trio.open_unix_socket(str(victim.control))
        async with stream:
            await stream.send_all(b"[" * 5000 + b"\n")
            answer = await read_line(stream)
            assert answer["ok"] is False
            assert answer["error"]["code"] == "INVALID_ARGUMENT"
            await stream.send_all(b'{"op": "status"}\n')
            assert (await read_line(stream))["ok"] is True
        await assert_serves(victim, honest, 5)


async def read_line(stream: trio.SocketStream) -> Any:
    buffer = b""
    with trio.fail_after(WAIT):
        while b"\n" not in buffer:
            chunk = await stream.receive_some(65536)
            assert chunk, "the node closed the control connection"
            buffer += chunk
    return json.loads(buffer.split(b"\n", 1)[0])


async def test_send_to_everyone_with_nobody_reachable(daemons: Daemons) -> None:
    """The owner: ``p2pnode send '*'`` on a node alone is one error line, exit 1."""
    with trio.fail_after(TEST_TIMEOUT):
        victim = await daemons.start("victim")
        code, out, err = await cli(victim.data_dir, "send", "*", "--payload", '{"all": 1}')
        assert code == 1, out
        assert_one_error_line(err)
        assert_alive(victim)
        honest = await daemons.start("honest", bootstrap=victim)
        await assert_serves(victim, honest, 6)


async def test_sigterm_while_peers_connect(daemons: Daemons) -> None:
    """SIGTERM while peers are mid-handshake: exit 0, no traceback (5 daemons)."""
    with trio.fail_after(TEST_TIMEOUT):
        nodes = [daemons.make(f"node{i}") for i in range(5)]
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(node.start, daemons.nursery, None)
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(terminate_while_peers_connect, node)
        for node in nodes:
            assert node.process is not None
            log = "\n".join(node.log)
            assert node.process.returncode == 0, log
            assert "Traceback" not in log, log


async def terminate_while_peers_connect(node: NodeProcess) -> None:
    handshakes = 0
    enough = trio.Event()

    async def connect_forever() -> None:
        nonlocal handshakes
        while True:
            try:
                channel = await evil_channel(node, Identity.generate())
                await channel.send_message(encode_hello([], []))
                await channel.aclose()
            except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                # The node is going away mid-handshake: the moment under test. Keep
                # dialing until the test stops this loop.
                await trio.sleep(0.01)
                continue
            handshakes += 1
            if handshakes >= 10:
                enough.set()

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(connect_forever)
        with trio.fail_after(WAIT):
            await enough.wait()
        assert node.process is not None
        node.process.terminate()
        with trio.fail_after(WAIT):
            await node.wait()
        nursery.cancel_scope.cancel()


async def udp_port_free_on_tcp() -> trio.socket.SocketType:
    """A UDP socket bound on 127.0.0.1 to a port that TCP does not use there (so a daemon
    listening on it fails on UDP, not on TCP). Bounded: 50 tries."""
    for _ in range(50):
        udp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        await udp.bind(("127.0.0.1", 0))
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM) as tcp:
            try:
                await tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            except OSError:
                udp.close()
                continue
        return udp
    raise AssertionError("no UDP port whose TCP twin is free in 50 tries")


async def test_second_run_on_the_data_dir_and_run_on_a_busy_port(
    daemons: Daemons, tmp_path: Path
) -> None:
    """The owner: a second ``run`` on a data directory in use, and ``run`` on a TCP
    or UDP port in use, are one line and exit 1; the first daemon is untouched."""
    with trio.fail_after(TEST_TIMEOUT):
        victim = await daemons.start("victim")
        assert victim.process is not None
        code, out, err = await cli(victim.data_dir, "run", "--listen", "127.0.0.1:0")
        assert code == 1
        assert out == ""
        assert_one_error_line(err, "BUSY", f"pid {victim.process.pid}", str(victim.control))
        assert victim.control.is_socket()
        assert (await victim.call({"op": "status"}))["agents"] == ["victim"]

        other = tmp_path / "other"
        code, _, err = await cli(other, "run", "--listen", victim.address)
        assert code == 1
        assert_one_error_line(err, victim.address, "in use")
        with await udp_port_free_on_tcp() as udp:
            busy = f"127.0.0.1:{udp.getsockname()[1]}"
            code, _, err = await cli(other, "run", "--listen", busy)
        assert code == 1
        assert_one_error_line(err, f"UDP {busy}", "in use")

        honest = await daemons.start("honest", bootstrap=victim)
        await assert_serves(victim, honest, 8)
