"""Attacks seen against running daemons, replayed on simulated nodes: a requester that
leaves with replies owed, a squatter on an agent id, a flood of cards, and large
envelopes flooded to fill memory. Each test shows the node's bound holding and the
honest peers still served."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType, envelope_size, wall_clock_ms
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.registry import DEFAULT_MAX_CARDS_PER_PEER, Registry
from p2pnode.core.threadstore import ThreadStore
from p2pnode.node.frames import encode_hello
from p2pnode.node.inbox import DEFAULT_INBOX_BYTES_PER_PEER
from p2pnode.node.observability import EventKind
from p2pnode.node.router import pinned_address, split_address
from p2pnode.runtime import Node
from tests.sim import FAST_NODE, Inbox, connect_all, make_card, open_swarm, wait_until


def received(node: Node) -> int:
    return int(node.events.metrics().to_dict()["totalMessagesReceived"])


# -- 1. agents are not held hostage by a requester that left --------------------------------------


async def test_replies_owed_to_a_vanished_peer_do_not_delay_other_requesters(
    autojump_clock: Any,
) -> None:
    gate = trio.Event()

    async def worker(envelope: Envelope) -> Any:
        if envelope.payload == "hold":
            await gate.wait()
        return envelope.payload

    # One waiting handler at a time: the held request keeps the rest in the inbox.
    async with open_swarm(3, dataclasses.replace(FAST_NODE, agent_concurrency=1)) as sw:
        a, b, c = sw.nodes
        await a.add_agent("worker", worker, tier=3)
        await b.add_agent("leaver", Inbox(), tier=3)
        await c.add_agent("honest", Inbox(), tier=3)
        await connect_all([a, b, c])
        # 250 requests whose replies nobody will read: the first holds the agent until
        # the requester is gone, the others wait in its inbox.
        asks = [b.envelope("leaver", "worker", MessageType.REQUEST, "hold")]
        asks += [b.envelope("leaver", "worker", MessageType.REQUEST, n) for n in range(249)]
        before = received(a)
        await b.send_many(asks)
        await wait_until(lambda: received(a) >= before + 250)
        sw.sim.kill(sw.members[1].host)
        gate.set()
        start = trio.current_time()
        reply = await c.request("honest", "worker", "me")
        assert reply.payload == "me"
        assert trio.current_time() - start < 1.0
        # The answer came while replies to the vanished requester were still pending.
        replies = a.hosting.replies
        assert replies.queued(str(b.peer_id)) > 0
        await wait_until(lambda: replies.queued(str(b.peer_id)) == 0)
        stats = replies.statistics()
        # The first reply found the link idle and was written by the agent's own task: it
        # could not leave within INLINE_REPLY_WAIT and was abandoned, and the 249 after it
        # met a link no longer writable at once. Bounded per peer: what did not fit the
        # queue was dropped at once, the rest abandoned after the first failed delivery.
        assert stats["refused"] == 249 - 64
        assert stats["abandoned"] == 1 + 64
        assert (await c.request("honest", "worker", "again")).payload == "again"


# -- 2. names that cannot be squatted -------------------------------------------------------------


async def test_a_squatter_never_receives_the_messages_of_the_real_owner(
    autojump_clock: Any,
) -> None:
    async with open_swarm(3) as sw:
        alice, squatter, carol = sw.nodes
        alice_inbox, squatter_inbox, carol_inbox = Inbox(), Inbox(), Inbox()
        await alice.add_agent("alice", alice_inbox, tier=3)
        await squatter.add_agent("carol", squatter_inbox, tier=3)
        await carol.add_agent("carol", carol_inbox, tier=3)
        # The real carol is met first; then the squatter claims "carol" on alice's node.
        await carol.connect(alice.listen_address)
        await wait_until(lambda: alice.registry.find("carol") is not None)
        await squatter.connect(alice.listen_address)
        await wait_until(
            lambda: (
                alice.registry.find_owned("carol", squatter.peer_id) is not None
                and carol.registry.find("alice") is not None
            )
        )
        owners = [c.peer_id for c in alice.registry.owners("carol")]
        assert owners == [carol.peer_id, squatter.peer_id]
        # The squat is a security event naming both owners.
        [squat] = alice.events.recent(kind=EventKind.SECURITY)
        assert str(squatter.peer_id) in squat.detail and str(carol.peer_id) in squat.detail
        # A reply to the squatter does not hand it the name.
        asked = squatter.envelope("carol", "alice", MessageType.REQUEST, "hi")
        answer_to_squatter = alice.envelope(
            "alice",
            pinned_address("carol", squatter.peer_id),
            MessageType.RESPONSE,
            "hello",
            correlation_id=asked.id,
        )
        alice.routing.router.pin(answer_to_squatter)
        # By name alone the id stays with the owner met first: the real carol.
        reply = await alice.request("alice", "carol", "secret")
        assert reply.payload == {"echo": "secret"}
        reply = await alice.request("alice", pinned_address("carol", carol.peer_id), "again")
        assert reply.payload == {"echo": "again"}
        assert [e.payload for e in carol_inbox.received] == ["secret", "again"]
        # The real carol is not refused: her requests reach alice, and the answer goes
        # back to her, not to the first claimant of her name.
        answer = await carol.request("carol", "alice", "hello")
        assert answer.payload == {"echo": "hello"}
        # Any reply to her request (a service's, an attached agent's) is pinned to her.
        [asked] = alice_inbox.received
        late = alice.envelope(
            "alice", "carol", MessageType.RESPONSE, "late", correlation_id=asked.id
        )
        assert alice.routing.router.reply_recipient(late) == pinned_address("carol", carol.peer_id)
        await alice.send(late)
        # Her bare "carol" still goes there (a reply never pins, or answering the
        # squatter would hand it the name).
        note = alice.envelope("alice", "carol", MessageType.NOTIFICATION, "bare")
        await alice.send(note)
        await wait_until(lambda: [e.payload for e in carol_inbox.received][-1] == "bare")
        assert squatter_inbox.received == []
        assert received(squatter) == 0


def test_addresses_pin_an_owner_only_with_a_whole_peer_id() -> None:
    peer = Identity(b"\x07" * 32).peer_id
    assert split_address(f"carol@{peer}") == ("carol", peer)
    assert split_address("carol@home") == ("carol@home", None)
    assert split_address(f"@{peer}") == (f"@{peer}", None)
    assert split_address(f"a@b@{peer}") == ("a@b", peer)


def test_a_rival_takes_over_when_the_holder_expires() -> None:
    now = wall_clock_ms()
    first, second = Identity.generate(), Identity.generate()
    registry = Registry()

    def card(owner: Identity, ttl_ms: int) -> AgentCard:
        base = make_card(owner, ["x.y"], ttl_ms=ttl_ms, now_ms=now)
        return dataclasses.replace(base, id="carol").signed(owner)

    assert registry.merge_remote(card(first, 60_000), now)
    assert registry.merge_remote(card(second, 600_000), now)
    assert len(registry.owners("carol", now)) == 2
    assert registry.find("carol") is not None
    assert registry.find("carol").peer_id == first.peer_id  # type: ignore[union-attr]
    registry.prune_expired(now + 120_000)
    assert [c.peer_id for c in registry.owners("carol")] == [second.peer_id]
    assert registry.cards_of(first.peer_id) == 0 and registry.cards_of(second.peer_id) == 1
    registry.unregister("carol")
    assert registry.cards_of(second.peer_id) == 0 and registry.rival_count() == 0


# -- 3. registry: a quota per peer and a cap on card lifetime -------------------------------------


def flood(owner: Identity, count: int, ttl_ms: int, now: int) -> list[AgentCard]:
    base = make_card(owner, ["flood.x"], ttl_ms=ttl_ms, now_ms=now)
    return [dataclasses.replace(base, id=f"f{n}").signed(owner) for n in range(count)]


def test_a_card_flood_stops_at_the_peer_quota_and_far_expiries_are_refused() -> None:
    now = wall_clock_ms()
    flooder, newcomer = Identity.generate(), Identity.generate()
    registry = Registry(max_cards=DEFAULT_MAX_CARDS_PER_PEER + 10)
    ten_years = 10 * 365 * 86400 * 1000
    for forged in flood(flooder, 5, ten_years, now):
        with pytest.raises(RemoteError) as info:
            registry.merge_remote(forged, now)
        assert info.value.code is ErrorCode.INVALID_CARD
        assert "too far ahead" in info.value.message
    refused = 0
    for card in flood(flooder, 600, 3600_000, now):
        try:
            registry.merge_remote(card, now)
        except RemoteError as exc:
            assert "quota" in exc.message
            refused += 1
    assert registry.cards_of(flooder.peer_id) == DEFAULT_MAX_CARDS_PER_PEER
    assert refused == 600 - DEFAULT_MAX_CARDS_PER_PEER
    assert registry.merge_remote(make_card(newcomer, ["honest.x"], now_ms=now), now)


async def test_new_peers_are_admitted_after_a_card_flood(autojump_clock: Any) -> None:
    async with open_swarm(2) as sw:
        victim, evil = sw.nodes
        await victim.add_agent("io", Inbox(), tier=3)
        await evil.add_agent("mallory", Inbox(), tier=3)
        await connect_all([victim, evil])
        link = evil.links.link(victim.peer_id)
        now = wall_clock_ms()
        ten_years = 10 * 365 * 86400 * 1000
        cards = flood(evil.identity, 640, ten_years, now) + flood(evil.identity, 640, 3600_000, now)
        frames_before = victim.links.get(evil.peer_id).frames_received  # type: ignore[union-attr]
        for start in range(0, len(cards), 64):
            await link.send(encode_hello(cards[start : start + 64], []))
        await wait_until(
            lambda: (
                victim.links.get(evil.peer_id).frames_received  # type: ignore[union-attr]
                >= frames_before + 20
            )
        )
        assert victim.registry.cards_of(evil.peer_id) == DEFAULT_MAX_CARDS_PER_PEER
        assert all(victim.registry.find(f"f{n}") is None for n in range(300, 640))
        newcomer = await sw.add(agent="newcomer")
        await connect_all([victim, newcomer.node])  # type: ignore[list-item]
        assert victim.registry.find("newcomer") is not None
        assert newcomer.node is not None
        reply = await newcomer.node.request("newcomer", "io", "hi")
        assert reply.payload == {"echo": "hi"}


# -- 4. memory bounded by bytes -------------------------------------------------------------------

BIG = ["x" * 900_000, "y" * 900_000]  # about 1.7 MiB: strings are at most 1 MiB on the wire


def test_thread_store_keeps_each_owner_under_its_budget_and_forgets_it() -> None:
    store = ThreadStore(max_bytes=10_000, max_bytes_per_owner=4_000, entry_overhead=0)

    def env(n: int, size: int) -> Envelope:
        return Envelope(f"e{n}", "s", "r", MessageType.NOTIFICATION, n, "x" * size, f"c{n}")

    for n in range(50):
        store.add(env(n, 900), owner="evil")
    store.add(env(100, 900), owner="honest")
    assert store.bytes_of("evil") <= 4_000
    assert store.thread("c49") and not store.thread("c0")  # its own oldest went first
    assert store.thread("c100")
    store.add(env(101, 5_000), owner="evil")  # larger than a budget: not kept
    assert not store.thread("c101")
    assert store.forget("evil") > 0
    assert store.bytes_of("evil") == 0
    assert store.bytes == envelope_size(env(100, 900)) == store.bytes_of("honest")


async def test_a_flood_of_large_envelopes_stays_under_the_budgets_and_is_released(
    autojump_clock: Any,
) -> None:
    gate = trio.Event()

    async def slow(envelope: Envelope) -> Any:
        await gate.wait()
        return "ok"

    async with open_swarm(3) as sw:
        victim, honest, evil = sw.nodes
        await victim.add_agent("io", slow, tier=3)
        await honest.add_agent("honest", Inbox(), tier=3)
        await evil.add_agent("mallory", Inbox(), tier=3)
        await connect_all([victim, honest, evil])
        peer = str(evil.peer_id)
        notes = [
            evil.envelope(
                "mallory", "io", MessageType.NOTIFICATION, BIG, correlation_id=f"note-{n}"
            )
            for n in range(24)
        ]
        asks = [evil.envelope("mallory", "io", MessageType.REQUEST, BIG) for _ in range(24)]
        before = received(victim)
        for envelope in notes + asks:
            await evil.send(envelope)
        await wait_until(lambda: received(victim) >= before + 48)
        threads, inboxes = victim.threads, victim.hosting.inbox_budget
        assert 0 < threads.bytes_of(peer) <= 8 * 1024 * 1024
        assert 0 < inboxes.bytes_of(peer) <= DEFAULT_INBOX_BYTES_PER_PEER
        busy = victim.events.metrics().security_by_code.get("BUSY", 0)
        assert busy > 0  # what did not fit was refused, not buffered
        # An honest request still passes (queued behind the attacker's, within its own
        # budget), and the attacker's leftovers go once it has left.
        honest_ask = trio.Event()

        async def ask() -> None:
            try:
                await honest.request("honest", "io", "mine")
            except LocalError:
                pass
            honest_ask.set()

        sw.nursery.start_soon(ask)
        await wait_until(lambda: inboxes.bytes_of(str(honest.peer_id)) > 0)
        await sw.stop(sw.members[2])
        await wait_until(lambda: threads.bytes_of(peer) == 0, timeout=30)
        gate.set()
        await wait_until(lambda: inboxes.bytes_of(peer) == 0)
        await honest_ask.wait()
        assert inboxes.total == 0
