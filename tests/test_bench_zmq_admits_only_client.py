"""The ZeroMQ CURVE baseline of scripts/bench_node.py is a real deployment's: its ZAP
authenticator admits the client's key and refuses any other (a CURVE server without
one admits every key, and the comparison would be against a weaker peer).

pyzmq is the ``bench`` extra, and in the ``test`` one for these tests.
"""

from __future__ import annotations

import asyncio

import bench_zmq
import pytest
import zmq
import zmq.asyncio
import zmq.auth.asyncio
from bench_agents import HOST

pytestmark = pytest.mark.slow


async def _echo_and_stranger() -> tuple[bytes, bool]:
    keys = zmq.curve_keypair()
    async with bench_zmq.zmq_server(keys[0]) as (port, server_public):
        context = zmq.asyncio.Context()
        try:
            refused = await bench_zmq.stranger_refused(context, port, server_public)
            sock = bench_zmq.dealer(context, port, server_public, keys)
            message = bench_zmq.ECHO + b"m" * 10
            async with asyncio.timeout(10):
                await sock.send(message)
                echoed: bytes = await sock.recv()
            sock.close(linger=0)
            return echoed, refused
        finally:
            context.term()


def test_client_key_is_served_and_another_key_refused() -> None:
    echoed, refused = asyncio.run(_echo_and_stranger())
    assert echoed == bench_zmq.ECHO + b"m" * 10
    assert refused


async def _allow_any_admits_stranger() -> bool:
    """The control: a CURVE server whose authenticator admits any key lets the stranger in."""
    public, secret = zmq.curve_keypair()
    server_context, context = zmq.asyncio.Context(), zmq.asyncio.Context()
    auth = zmq.auth.asyncio.AsyncioAuthenticator(server_context)
    auth.start()
    auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    router = server_context.socket(zmq.ROUTER)
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, public, secret
    try:
        port = router.bind_to_random_port(f"tcp://{HOST}")
        refused: bool = await bench_zmq.stranger_refused(context, port, public)
        return refused
    finally:
        auth.stop()
        router.close(linger=0)
        context.term()
        server_context.term()


def test_refusal_check_sees_an_admitted_stranger() -> None:
    assert not asyncio.run(_allow_any_admits_stranger())
