"""Routing-table snapshots: save the contacts, restore them for a rejoin without bootstrap.

A snapshot is msgpack ``[[id, host, port], ...]``, the contact triple of a
``find_node`` reply (docs/protocol/dht.md §3), so restoring reuses the reply
checks of :mod:`p2pnode.dht.rpcwire`. It is read from the node's own data
directory, yet checked as if a peer had sent it: a corrupt file is a
LocalError, never a half-restored table of bad contacts.
"""

from __future__ import annotations

from p2pnode.dht import rpcwire
from p2pnode.dht.routing import RoutingTable
from p2pnode.errors import ErrorCode, LocalError
from p2pnode.wire import WireError, WireLimits, pack, unpack_untrusted

_SNAPSHOT_LIMITS = WireLimits(max_size=1 << 20, max_array_len=8192, max_depth=3)


def snapshot_table(table: RoutingTable) -> bytes:
    """The contacts of ``table`` as bytes (``[[id, host, port], ...]``)."""
    return pack([rpcwire.contact_to_wire(c) for c in table.contacts()])


def restore_table(table: RoutingTable, data: bytes, now: float) -> int:
    """Add the contacts of a :func:`snapshot_table` to ``table``; returns how many.

    Raises LocalError(CONFIG_ERROR) if ``data`` is not a snapshot; the table is
    then unchanged.
    """
    try:
        items = unpack_untrusted(data, _SNAPSHOT_LIMITS)
        if not isinstance(items, list):
            raise LocalError(ErrorCode.CONFIG_ERROR, "snapshot is not a list")
        # Checked in reply-sized chunks, all before the first contact is added.
        contacts = [
            c
            for i in range(0, len(items), rpcwire.MAX_CONTACTS)
            for c in rpcwire.parse_contacts_untrusted(items[i : i + rpcwire.MAX_CONTACTS])
        ]
    except (WireError, rpcwire.RpcError) as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"corrupt snapshot: {exc.message}") from None
    for c in contacts:
        table.observe(c, now)
    return len(contacts)


__all__ = ["restore_table", "snapshot_table"]
