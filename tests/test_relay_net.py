"""A circuit relay on real sockets (127.0.0.1): reserve, dial through, secure channel
end to end, data both ways."""

from __future__ import annotations

import pytest
import trio

from p2pnode.core.identity import Identity
from p2pnode.transport.channel import accept_secure, connect_secure
from p2pnode.transport.net import TrioNetwork
from p2pnode.transport.relay import RelayAddress
from p2pnode.transport.relayserve import RelayServer, connect_via_relay, reserve
from p2pnode.transport.secure import SecureIdentity

RELAY = Identity(b"\x50" * 32)


@pytest.mark.slow
async def test_relay_happy_path_on_loopback() -> None:
    alice, bob = SecureIdentity(Identity(b"\x51" * 32)), SecureIdentity(Identity(b"\x52" * 32))
    net = TrioNetwork()
    server = RelayServer(net, RELAY.peer_id)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, ("127.0.0.1", 0))
            relay = RelayAddress(address, RELAY.peer_id)
            async with reserve(net, relay, alice.identity) as reservation:

                async def answer() -> None:
                    async with await accept_secure(await reservation.accept(), alice) as channel:
                        for _ in range(3):
                            message = await channel.receive_message()
                            await channel.send_message(message.upper())

                nursery.start_soon(answer)
                stream = await connect_via_relay(net, relay, alice.peer_id)
                async with await connect_secure(
                    stream, bob, expected_peer_id=alice.peer_id
                ) as channel:
                    for message in (b"hello", b"x" * 100_000, b"bye"):
                        await channel.send_message(message)
                        assert await channel.receive_message() == message.upper()
            stats = server.statistics()
            assert stats.circuits_opened == 1 and stats.bytes_relayed > 200_000
            nursery.cancel_scope.cancel()
