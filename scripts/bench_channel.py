"""Benchmark: secure channel vs raw TCP and TLS 1.3, both ends on 127.0.0.1 in one trio process.

Usage: python scripts/bench_channel.py [--scale 1.0]

Every baseline is measured in the same run. The output names the AEAD backend
the channel used (p2pnode/transport/aead.py: OpenSSL when ``cryptography`` >= 47 is
installed, else libsodium) and says whether the target, bulk 64 KiB messages at
least as fast as TLS 1.3 in the same run, is met. Raw TCP and TLS carry messages
as ``len:u32be || message`` and are read through the same buffered reader,
so the comparison isolates the security layer. TLS authenticates only the
server (a self-signed P-256 certificate made with ``cryptography``); the
Noise channel authenticates both sides and checks the peer id.
"""

from __future__ import annotations

import argparse
import datetime
import ssl
import statistics
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import trio

from p2pnode.core.identity import Identity
from p2pnode.transport import aead
from p2pnode.transport.channel import (
    DEFAULT_CONFIG,
    ChannelConfig,
    SecureChannel,
    accept_secure,
    connect_secure,
)
from p2pnode.transport.secure import SecureIdentity

_u32 = struct.Struct(">I")
SMALL = b"s" * 256
BULK = b"b" * 65536
BULK_ROW = "bulk 64 KiB msgs (MB/s)"
BULK_TARGET = 1.0  # noise / TLS 1.3, same run


class Endpoint(Protocol):
    async def send(self, message: bytes) -> None: ...
    async def send_batch(self, messages: list[bytes]) -> None: ...
    async def receive(self) -> bytes: ...
    async def aclose(self) -> None: ...


class FramedStream:
    """``len:u32be || message`` over a trio stream with a buffered reader (the baseline)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._lock = trio.StrictFIFOLock()

    async def send(self, message: bytes) -> None:
        async with self._lock:
            await self._stream.send_all(_u32.pack(len(message)) + message)

    async def send_batch(self, messages: list[bytes]) -> None:
        parts = []
        for message in messages:
            parts.append(_u32.pack(len(message)))
            parts.append(message)
        async with self._lock:
            await self._stream.send_all(b"".join(parts))

    async def receive(self) -> bytes:
        buf = self._buf
        while True:
            if len(buf) >= 4:
                size = _u32.unpack_from(buf)[0]
                if len(buf) >= 4 + size:
                    message = bytes(buf[4 : 4 + size])
                    del buf[: 4 + size]
                    return message
            data = await self._stream.receive_some(256 * 1024)
            if not data:
                raise EOFError
            buf += data

    async def aclose(self) -> None:
        await self._stream.aclose()


class ChannelEndpoint:
    """A SecureChannel as an Endpoint; ``coalesce`` picks send_many vs one send each."""

    def __init__(self, channel: SecureChannel, coalesce: bool = True) -> None:
        self.channel = channel
        self.coalesce = coalesce

    async def send(self, message: bytes) -> None:
        await self.channel.send_message(message)

    async def send_batch(self, messages: list[bytes]) -> None:
        if self.coalesce:
            await self.channel.send_many(messages)
        else:
            for message in messages:
                await self.channel.send_message(message)

    async def receive(self) -> bytes:
        return await self.channel.receive_message()

    async def aclose(self) -> None:
        await self.channel.aclose()


def make_tls_contexts(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A self-signed P-256 certificate for ``localhost``; server and client contexts."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(cert_path, key_path)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.load_verify_locations(cert_path)
    return server, client


Connector = Callable[[], Awaitable[tuple[Endpoint, Endpoint]]]


class Harness:
    """A listener on 127.0.0.1 and one way per kind to get a connected (client, server) pair."""

    def __init__(self, nursery: trio.Nursery, listener: trio.SocketListener, tmp: Path) -> None:
        self.nursery = nursery
        self.listener = listener
        self.port = listener.socket.getsockname()[1]
        self.server_ctx, self.client_ctx = make_tls_contexts(tmp)
        self.server_id = SecureIdentity(Identity.generate())
        self.client_id = SecureIdentity(Identity.generate())

    async def tcp_pair(self) -> tuple[trio.SocketStream, trio.SocketStream]:
        client = await trio.open_tcp_stream("127.0.0.1", self.port)
        server = await self.listener.accept()
        return client, server

    async def raw(self) -> tuple[Endpoint, Endpoint]:
        client, server = await self.tcp_pair()
        return FramedStream(client), FramedStream(server)

    async def tls(self) -> tuple[Endpoint, Endpoint]:
        client_tcp, server_tcp = await self.tcp_pair()
        client = trio.SSLStream(client_tcp, self.client_ctx, server_hostname="localhost")
        server = trio.SSLStream(server_tcp, self.server_ctx, server_side=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.do_handshake)
            nursery.start_soon(server.do_handshake)
        return FramedStream(client), FramedStream(server)

    async def noise_channels(
        self, config: ChannelConfig = DEFAULT_CONFIG, ik: bool = False
    ) -> tuple[SecureChannel, SecureChannel]:
        client_tcp, server_tcp = await self.tcp_pair()
        result: list[SecureChannel] = []

        async def accept() -> None:
            result.append(await accept_secure(server_tcp, self.server_id, config=config))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            client = await connect_secure(
                client_tcp,
                self.client_id,
                expected_peer_id=self.server_id.peer_id,
                remote_static=self.server_id.static_public if ik else None,
                config=config,
            )
        return client, result[0]

    async def noise_ik(self) -> tuple[Endpoint, Endpoint]:
        client, server = await self.noise_channels(ik=True)
        return ChannelEndpoint(client), ChannelEndpoint(server)

    async def noise_no_idle(self) -> tuple[Endpoint, Endpoint]:
        client, server = await self.noise_channels(ChannelConfig(idle_timeout=None))
        return ChannelEndpoint(client), ChannelEndpoint(server)

    async def noise(self) -> tuple[Endpoint, Endpoint]:
        client, server = await self.noise_channels()
        return ChannelEndpoint(client), ChannelEndpoint(server)

    async def noise_no_coalesce(self) -> tuple[Endpoint, Endpoint]:
        client, server = await self.noise_channels()
        return ChannelEndpoint(client, coalesce=False), ChannelEndpoint(server, coalesce=False)


async def stream_rate(connect: Connector, message: bytes, count: int, batch: int) -> float:
    """Messages per second from client to server; ``batch`` > 1 uses send_batch."""
    client, server = await connect()
    try:
        for _ in range(50):  # warm up
            await client.send(message)
            await server.receive()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:

            async def produce() -> None:
                if batch == 1:
                    for _ in range(count):
                        await client.send(message)
                else:
                    chunk = [message] * batch
                    for _ in range(count // batch):
                        await client.send_batch(chunk)

            nursery.start_soon(produce)
            for _ in range(count // batch * batch):
                await server.receive()
        return (count // batch * batch) / (time.perf_counter() - start)
    finally:
        await client.aclose()
        await server.aclose()


async def concurrent_rate(connect: Connector, message: bytes, count: int, senders: int) -> float:
    """Messages per second with ``senders`` tasks calling send() at once."""
    client, server = await connect()
    per = count // senders
    try:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:

            async def produce() -> None:
                for _ in range(per):
                    await client.send(message)

            for _ in range(senders):
                nursery.start_soon(produce)
            for _ in range(per * senders):
                await server.receive()
        return per * senders / (time.perf_counter() - start)
    finally:
        await client.aclose()
        await server.aclose()


async def round_trips(connect: Connector, count: int) -> tuple[float, float]:
    """p50 and p99 request/response latency in microseconds (256-byte messages)."""
    client, server = await connect()
    samples: list[float] = []
    try:
        async with trio.open_nursery() as nursery:

            async def echo() -> None:
                for _ in range(count + 100):
                    await server.send(await server.receive())

            nursery.start_soon(echo)
            for i in range(count + 100):
                start = time.perf_counter()
                await client.send(SMALL)
                await client.receive()
                if i >= 100:
                    samples.append((time.perf_counter() - start) * 1e6)
    finally:
        await client.aclose()
        await server.aclose()
    quantiles = statistics.quantiles(samples, n=100)
    return quantiles[49], quantiles[98]


async def setups(connect: Connector, count: int) -> float:
    """Connections per second: TCP connect + handshake (+ identity check), then close."""
    start = time.perf_counter()
    for _ in range(count):
        client, server = await connect()
        await client.aclose()
        await server.aclose()
    return count / (time.perf_counter() - start)


def fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


Row = tuple[str, float, float, float, str]


async def best(
    kinds: list[Connector], measure: Callable[[Connector], Awaitable[float]], rounds: int, low: bool
) -> list[float]:
    """Interleave ``rounds`` runs of every kind and keep each kind's best result.

    Interleaving spreads background load evenly over the kinds compared.
    """
    results: list[list[float]] = [[] for _ in kinds]
    for _ in range(rounds):
        for i, kind in enumerate(kinds):
            results[i].append(await measure(kind))
    return [min(r) if low else max(r) for r in results]


async def main(scale: float, rounds: int) -> None:
    def n(base: int) -> int:
        return max(64, int(base * scale))

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            h = Harness(nursery, listeners[0], Path(tmp))
            kinds: list[Connector] = [h.raw, h.tls, h.noise]

            async def row(
                name: str,
                measure: Callable[[Connector], Awaitable[float]],
                low: bool = False,
                note: str = "",
            ) -> list[float]:
                values = await best(kinds, measure, rounds, low)
                rows.append((name, values[0], values[1], values[2], note))
                return values

            await row(BULK_ROW, lambda c: _mbps(stream_rate(c, BULK, n(3000), 1)))
            single = await row(
                "256 B, one send each (msg/s)",
                lambda c: stream_rate(c, SMALL, n(25000), 1),
                note="default config (idle timer armed)",
            )
            no_idle = await best(
                [h.noise_no_idle], lambda c: stream_rate(c, SMALL, n(25000), 1), rounds, False
            )
            rows.append(
                (
                    "256 B, one send each, idle_timeout=None",
                    single[0],
                    single[1],
                    no_idle[0],
                    "no cancel scope per receive",
                )
            )
            coalesced = await row(
                "256 B pipelined x64, coalesced (msg/s)",
                lambda c: stream_rate(c, SMALL, n(128000), 64),
                note="send_many / one write per batch",
            )
            before = await best(
                [h.noise_no_coalesce], lambda c: stream_rate(c, SMALL, n(25000), 64), rounds, False
            )
            rows.append(
                (
                    "256 B pipelined x64, NOT coalesced",
                    coalesced[0],
                    coalesced[1],
                    before[0],
                    "before: one frame + write per message",
                )
            )
            await row(
                "256 B, 8 concurrent senders (msg/s)",
                lambda c: concurrent_rate(c, SMALL, n(40000), 8),
                note="automatic coalescing behind the send lock",
            )
            rtts: list[list[tuple[float, float]]] = [[] for _ in kinds]
            for _ in range(rounds):
                for i, kind in enumerate(kinds):
                    rtts[i].append(await round_trips(kind, n(3000)))
            p50 = [min(r[0] for r in k) for k in rtts]
            p99 = [min(r[1] for r in k) for k in rtts]
            rows.append(("RTT p50 (us)", p50[0], p50[1], p50[2], "lower is better"))
            rows.append(("RTT p99 (us)", p99[0], p99[1], p99[2], "lower is better"))
            setup = await row(
                "setups/s (TCP + handshake + id check)",
                lambda c: setups(c, n(600)),
                note="noise: XX, mutual auth; TLS: server auth only",
            )
            ik = await best([h.noise_ik], lambda c: setups(c, n(600)), rounds, False)
            rows.append(
                ("setups/s, noise IK", setup[0], setup[1], ik[0], "dialer knows static key")
            )
            h.client_id = SecureIdentity(h.client_id.identity, verified_cache=0)
            h.server_id = SecureIdentity(h.server_id.identity, verified_cache=0)
            uncached = await best([h.noise], lambda c: setups(c, n(600)), rounds, False)
            rows.append(
                (
                    "setups/s, XX, no verified-binding cache",
                    setup[0],
                    setup[1],
                    uncached[0],
                    "Ed25519 verify on both sides every time",
                )
            )
            nursery.cancel_scope.cancel()
    print_rows(rows)


def print_rows(rows: list[Row]) -> None:
    """The table, the AEAD backend and whether the bulk target is met."""
    print(f"AEAD backend: {aead.DEFAULT_BACKEND.name}")
    header = f"{'metric':44} {'raw TCP':>11} {'TLS 1.3':>11} {'noise':>11} {'/raw':>6} {'/TLS':>6}"
    print(header)
    print("-" * len(header))
    for name, raw, tls, noise, note in rows:
        print(
            f"{name:44} {fmt(raw):>11} {fmt(tls):>11} {fmt(noise):>11}"
            f" {noise / raw:6.2f} {noise / tls:6.2f}  {note}"
        )
    for name, _raw, tls, noise, _note in rows:
        if name == BULK_ROW:
            ratio = noise / tls
            verdict = "MET" if ratio >= BULK_TARGET else "NOT MET"
            print(
                f"target: bulk 64 KiB messages >= {BULK_TARGET:.1f}x TLS 1.3 in the same run:"
                f" {ratio:.2f}x, {verdict}"
            )


async def _mbps(rate: Awaitable[float]) -> float:
    return await rate * len(BULK) / 1e6


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply message counts")
    parser.add_argument("--rounds", type=int, default=3, help="runs per kind; best is kept")
    args = parser.parse_args()
    wall = time.perf_counter()
    trio.run(main, args.scale, args.rounds)
    print(f"(total {time.perf_counter() - wall:.1f} s)")
