"""Contacts, shared by every routing table and lookup of one process.

Theory of operation: a :class:`Contact` is a node as the DHT knows it, an id
and a UDP address (docs/protocol/dht.md §3), immutable. The simulator runs a
hundred thousand routing tables in one process, each holding a hundred or more
contacts, so equal contacts are shared: :func:`shared` keeps one per id in a
weak map (a contact lives as long as some table or lookup holds it), and
:func:`make_contact` hands out the shared one when the process holds it. A
contact carries what is asked of it often, built once: its ``address`` tuple,
its id as an integer (every distance needs it) and the msgpack form a
``find_node`` reply carries of it.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

from p2pnode.core.wire import pack

ID_BYTES = 20
ID_BITS = 160


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Contact:
    """A node as the routing table knows it: id and UDP address."""

    node_id: bytes
    host: str
    port: int
    #: The ``(host, port)`` to send datagrams to (built once: it is asked for often).
    address: tuple[str, int] = field(init=False, repr=False, compare=False)
    #: The id as a big-endian integer (built once: every distance needs it).
    number: int = field(init=False, repr=False, compare=False)
    #: The msgpack ``[id, host, port]`` a find_node reply carries of this contact
    #: (docs/protocol/dht.md §3), built once: a shared contact is named in many replies.
    wire: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", (self.host, self.port))
        object.__setattr__(self, "number", int.from_bytes(self.node_id, "big"))
        object.__setattr__(self, "wire", pack((self.node_id, self.host, self.port)))


# Contacts held by the tables of this process, by id (see the module docstring): a
# weak map as WeakValueDictionary keeps one, read without its Python-level get (every
# contact of every reply is looked up here).
_SHARED: dict[bytes, weakref.KeyedRef[bytes, Contact]] = {}


def _forget(ref: weakref.KeyedRef[bytes, Contact]) -> None:
    """A shared contact died: drop its entry, unless another took the id since."""
    if _SHARED.get(ref.key) is ref:
        del _SHARED[ref.key]


def _held(node_id: bytes) -> Contact | None:
    ref = _SHARED.get(node_id)
    return None if ref is None else ref()


def shared(contact: Contact) -> Contact:
    """The contact equal to ``contact`` that this process holds already, else ``contact``
    (which is then the one shared). Equal contacts are interchangeable: they are frozen."""
    held = _held(contact.node_id)
    if held is None:
        _SHARED[contact.node_id] = weakref.KeyedRef(contact, _forget, contact.node_id)
        return contact
    return held if held == contact else contact


def make_contact(node_id: bytes, host: str, port: int) -> Contact:
    """The contact at ``(host, port)`` with ``node_id``: the shared one when this process
    holds it (nothing is built), else a new one with ``host`` interned (thousands of
    contacts share a handful of hosts)."""
    ref = _SHARED.get(node_id)  # _held, written out: every contact of every reply
    held = None if ref is None else ref()
    if held is not None and held.port == port and held.host == host:
        return held
    return Contact(node_id, sys.intern(host), port)


__all__ = ["ID_BITS", "ID_BYTES", "Contact", "make_contact", "shared"]
