"""Routing-table snapshots: save the contacts, read them back for a rejoin without bootstrap.

A snapshot is msgpack ``[[id, host, port], ...]``, the contact triple of a
``find_node`` reply (docs/protocol/dht.md §3), so restoring reuses the reply
checks of :mod:`p2pnode.dht.rpcwire`. It is read from the node's own data
directory, yet checked as if a peer had sent it: a corrupt file is a
LocalError, never a half-read list of bad contacts.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted
from p2pnode.dht import rpcwire
from p2pnode.dht.routing import Contact

_SNAPSHOT_LIMITS = WireLimits(max_size=1 << 20, max_array_len=8192, max_depth=3)


def snapshot_contacts(contacts: Iterable[Contact]) -> bytes:
    """``contacts`` as bytes (``[[id, host, port], ...]``)."""
    return pack([rpcwire.contact_to_wire(c) for c in contacts])


def parse_snapshot(data: bytes) -> list[Contact]:
    """The contacts of a :func:`snapshot_contacts`, checked as a peer's reply would be.

    They are candidates, not table entries: the node admits each one only once it
    answers (docs/protocol/dht.md §5.1), so a snapshot cannot carry junk forward.
    Raises LocalError(CONFIG_ERROR) if ``data`` is not a snapshot.
    """
    try:
        items = unpack_untrusted(data, _SNAPSHOT_LIMITS)
        if not isinstance(items, list):
            raise LocalError(ErrorCode.CONFIG_ERROR, "snapshot is not a list")
        # Checked in reply-sized chunks, all before any is used.
        return [
            c
            for i in range(0, len(items), rpcwire.MAX_CONTACTS)
            for c in rpcwire.parse_contacts_untrusted(items[i : i + rpcwire.MAX_CONTACTS])
        ]
    except (WireError, rpcwire.RpcError) as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"corrupt snapshot: {exc.message}") from None


__all__ = ["parse_snapshot", "snapshot_contacts"]
