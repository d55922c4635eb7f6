"""The swarm document: a swarm's plan and journal in one CRDT document, and its fold.

Theory of operation (docs/protocol/tasks.md §4):

* A swarm ``S`` lives in the shared document ``swarm.S`` that every
  participant replicates (seed R8.3). Its root map holds:

  - ``plan/meta`` and ``plan/c<k>``: LWW registers of JSON text, written once
    by the opener: the :class:`~p2pnode.services.swarms.plan.Plan` (sub-tasks with
    their capabilities, complexity and input; the aggregation; the lease), in
    chunks under the 64 KiB register limit (:mod:`p2pnode.services.swarms.plan`);
  - ``coord``: an LWW register ``{"agent", "epoch", "beat"}``: the
    coordinator's lease, renewed by rewriting it with ``beat`` + 1;
  - ``log/<epoch>:<agent>/<seq>``: the coordinator's journal, one register of
    JSON text per key, each key written once by one writer (the coordinator
    of that epoch), so replicas never conflict on it;
  - ``cancel``: an LWW register, set by the opener to cancel the swarm.

* A journal :class:`Record` lists what the coordinator decided in one tick:
  participants joined (``j``), sub-tasks assigned (``a``), results accepted
  (``d``, with the result: R8.4), failed attempts (``f``), participants
  whose lease expired (``x``), leases (``l``, wall-clock ms, for readers),
  sub-tasks escalated (``e``), the swarm's status (``s``) and outcome (``o``).
* :func:`fold` replays the records in key order (epoch, then writer, then
  sequence) into a :class:`SwarmView`. The first ``d`` of a sub-task in that
  order is its accepted result; later ones are duplicates (a result is
  accepted exactly once, even when two coordinators overlapped during a
  takeover). :class:`DocReader` does it incrementally as a replica changes.
  Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from p2pnode.agent.task import TaskError, valid_id
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.jsonutil import dumps, is_json_value
from p2pnode.crdt.types import LWWRegister, ORMap
from p2pnode.services.swarms.plan import (
    AGGREGATIONS,
    CHUNK_CHARS,
    DOC_PREFIX,
    MAX_SUBTASKS,
    Plan,
    SubTask,
    aggregate,
    doc_name,
    loads_register,
)

#: A single sub-task's result, as JSON text, at most (it must fit a journal record).
MAX_RESULT_CHARS = 16 * 1024

PENDING, ASSIGNED, DONE, ESCALATED = "pending", "assigned", "done", "escalated"
WORKING, INPUT_REQUIRED, COMPLETED, CANCELED = "working", "input-required", "completed", "canceled"
SWARM_STATES = frozenset({WORKING, INPUT_REQUIRED, COMPLETED, CANCELED})


def member_address(agent: str, peer: str) -> str:
    """How the swarm document names a member: its agent id with its owner's peer id,
    ``agent@peer`` (an agent id alone can be squatted; the pair cannot)."""
    return f"{agent}@{peer}"


def split_member(address: str) -> tuple[str, str]:
    """``(agent id, peer id)`` of a member address. Raises ValueError."""
    agent, sep, peer = address.rpartition("@")
    if not sep or not valid_id(agent) or len(peer) != 32:
        raise ValueError("not agent@peer")
    try:
        PeerId.parse(peer)
    except LocalError:
        raise ValueError("not a peer id") from None
    return agent, peer


def peer_of(address: str) -> str | None:
    """The peer id of a member address; None when it is not one."""
    try:
        return split_member(address)[1]
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Breach:
    """A register of the swarm document that breaks a rule of §4.6: ignored by the fold,
    reported as a security event."""

    #: Where: ``log/<term>/<seq>``, ``coord``, ``cancel`` or ``plan/<key>``.
    key: str
    #: The peer id that wrote it (authenticated by the delta's signature).
    writer: str
    #: The rule it breaks.
    rule: str


class Authored(NamedTuple):
    """A register's value with the peer id of the replica that wrote it."""

    value: Any
    writer: str


def authored(root: ORMap) -> dict[str, Any]:
    """A document's value with each register as :class:`Authored` (its writer from the
    register's replica id, which the delta's signature binds to the writing peer:
    gossip.md §3.1)."""
    out: dict[str, Any] = {}
    for key, entry in root.entries.items():
        if not entry.dots:
            continue  # removed
        value = entry.value
        if isinstance(value, ORMap):
            out[key] = authored(value)
        elif isinstance(value, LWWRegister):
            out[key] = Authored(value.val, value.replica)
        else:
            out[key] = Authored(value.value(), "")
    return out


@dataclass(slots=True)
class Record:
    """One journal entry of a coordinator (the keys are in the module docstring)."""

    joined: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    assigned: list[tuple[int, str, int]] = field(default_factory=list)
    done: list[tuple[int, int, str, Any]] = field(default_factory=list)
    failed: list[tuple[int, str, int, str]] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    leases: dict[str, int] = field(default_factory=dict)
    escalated: list[int] = field(default_factory=list)
    status: str | None = None
    outcome: Any = None
    #: False when a completed record leaves the outcome out (too large for a
    #: register): readers compute it from the results.
    has_outcome: bool = True

    def __bool__(self) -> bool:
        return bool(
            self.joined
            or self.assigned
            or self.done
            or self.failed
            or self.dead
            or self.leases
            or self.escalated
            or self.status is not None
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        pairs: list[tuple[str, Any]] = [
            ("j", [[a, list(c), n] for a, c, n in self.joined]),
            ("a", [list(x) for x in self.assigned]),
            ("d", [list(x) for x in self.done]),
            ("f", [list(x) for x in self.failed]),
            ("x", self.dead),
            ("l", self.leases),
            ("e", self.escalated),
        ]
        for key, value in pairs:
            if value:
                out[key] = value
        if self.status is not None:
            out["s"] = self.status
            if self.status == COMPLETED and self.has_outcome:
                out["o"] = self.outcome
        return out

    def split(self, limit: int = CHUNK_CHARS) -> list[Record]:
        """This record as records whose JSON text is at most ``limit`` characters each
        (a register holds 64 KiB), entries in order; the status (and outcome) go in
        the last. An outcome too large is left out (readers compute it). Raises
        LocalError(MESSAGE_TOO_LARGE) for one entry larger than ``limit``."""
        if len(dumps(self.to_json())) <= limit:
            return [self]
        parts = [Record()]
        size = 0
        pairs: list[tuple[str, list[Any]]] = [
            ("joined", self.joined),
            ("assigned", self.assigned),
            ("done", self.done),
            ("failed", self.failed),
            ("dead", self.dead),
            ("escalated", self.escalated),
        ]
        for name, entries in pairs:
            for entry in entries:
                length = len(dumps(entry)) + 1
                if length + 64 > limit:
                    raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, f"a journal entry of {length}")
                if size + length + 64 > limit:
                    parts.append(Record())
                    size = 0
                getattr(parts[-1], name).append(entry)
                size += length
        last = parts[-1]
        last.leases = dict(self.leases)
        last.status, last.outcome = self.status, self.outcome
        if len(dumps(last.to_json())) > limit:
            last.has_outcome = False
            if len(dumps(last.to_json())) > limit:
                last.leases = {}
                parts.append(Record(leases=dict(self.leases), status=self.status,
                                    has_outcome=False))  # fmt: skip
        return parts

    @classmethod
    def from_json_untrusted(cls, data: object, count: int) -> Record:
        """A record read from a replica (``count``: sub-tasks in the plan). Raises
        TaskError(MALFORMED_MESSAGE)."""
        try:
            return _parse_record(data, count)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            raise TaskError(ErrorCode.MALFORMED_MESSAGE, "a journal record is malformed") from None


def _index(value: object, count: int) -> int:
    if type(value) is not int or not 0 <= value < count:
        raise ValueError("bad index")
    return value


def _agent(value: object) -> str:
    if not valid_id(value):
        raise ValueError("bad agent")
    assert isinstance(value, str)
    return value


def _member(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("bad member")
    split_member(value)
    return value


def _ms(value: object) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        raise ValueError("bad time")
    return value


def _count(value: object) -> int:
    if type(value) is not int or not 0 <= value < 2**31:
        raise ValueError("bad count")
    return value


def _parse_record(data: object, count: int) -> Record:
    if not isinstance(data, dict) or set(data) - set("jadfxleso"):
        raise ValueError("not a record")
    record = Record()
    for agent, caps, capacity in data.get("j", []):
        capabilities = tuple(_agent(c) for c in caps)
        record.joined.append((_member(agent), capabilities, max(1, _count(capacity))))
    for index, agent, attempt in data.get("a", []):
        record.assigned.append((_index(index, count), _member(agent), _count(attempt)))
    for index, attempt, agent, result in data.get("d", []):
        if not is_json_value(result):
            raise ValueError("bad result")
        record.done.append((_index(index, count), _count(attempt), _member(agent), result))
    for index, agent, attempt, code in data.get("f", []):
        record.failed.append((_index(index, count), _member(agent), _count(attempt), _agent(code)))
    record.dead = [_member(a) for a in data.get("x", [])]
    record.leases = {_member(a): _ms(ms) for a, ms in data.get("l", {}).items()}
    record.escalated = [_index(i, count) for i in data.get("e", [])]
    status = data.get("s")
    if status is not None and status not in SWARM_STATES:
        raise ValueError("bad status")
    record.status = status
    record.outcome = data.get("o")
    record.has_outcome = "o" in data
    if not is_json_value(record.outcome):
        raise ValueError("bad outcome")
    return record


@dataclass(slots=True)
class SubState:
    """One sub-task as the journal says: its status, assignee and attempt, and once done
    its accepted result and where it was accepted (the record's key)."""

    status: str = PENDING
    assignee: str | None = None
    attempt: int = 0
    result: Any = None
    ref: str | None = None
    failures: int = 0
    escalated: bool = False
    #: Every ``(attempt, member)`` the journal assigned it: who may report each attempt.
    attempts: set[tuple[int, str]] = field(default_factory=set)


@dataclass(slots=True)
class Member:
    """A participant as the journal says."""

    capabilities: frozenset[str]
    capacity: int = 1
    alive: bool = True
    lease_ms: int = 0


@dataclass(slots=True)
class SwarmView:
    """The swarm as a replica's journal says (:func:`fold`)."""

    subtasks: list[SubState]
    members: dict[str, Member] = field(default_factory=dict)
    status: str = WORKING
    outcome: Any = None
    #: Results accepted for a sub-task already done (dropped: counted once).
    duplicates: int = 0
    #: Coordinator terms the rules admit: epoch -> members that claimed it.
    terms: dict[int, set[str]] = field(default_factory=dict)
    #: The live members when each epoch's records began (after every record of the
    #: epochs before it): who may claim that epoch.
    live_at: dict[int, frozenset[str]] = field(default_factory=dict)
    #: Journal records (or their entries) that break a rule, by key: ignored.
    breaches: dict[str, Breach] = field(default_factory=dict)
    #: An admitted ``completed`` read before every result was: it holds until they are
    #: (an overlapping term's records, sorting later, hold the rest), or a later status.
    completing: bool = False

    @property
    def done(self) -> int:
        return sum(1 for s in self.subtasks if s.status == DONE)

    @property
    def complete(self) -> bool:
        return all(s.status == DONE for s in self.subtasks)

    def results(self) -> list[Any]:
        """The accepted results in plan order (None for a sub-task not done)."""
        return [s.result for s in self.subtasks]

    def live_members(self) -> list[str]:
        return sorted(a for a, m in self.members.items() if m.alive)


def fold(count: int, records: Iterable[tuple[str, Record]]) -> SwarmView:
    """Replay ``records`` (``(key, record)``; sorted here by key) into a view of a plan of
    ``count`` sub-tasks (see the module docstring)."""
    view = SwarmView([SubState() for _ in range(count)])
    for key, record in sorted(records, key=lambda kr: kr[0]):
        apply(view, key, record)
    return view


def apply(view: SwarmView, key: str, record: Record) -> None:
    """Replay one record onto ``view`` (what :func:`fold` does for each). Deaths come
    first: a participant declared dead and joining again in one tick is alive."""
    for agent in record.dead:
        if agent in view.members:
            view.members[agent].alive = False
    for agent, caps, capacity in record.joined:
        member = view.members.get(agent)
        if member is None:
            view.members[agent] = Member(frozenset(caps), capacity)
        else:
            member.capabilities, member.capacity, member.alive = frozenset(caps), capacity, True
    for index, agent, attempt in record.assigned:
        sub = view.subtasks[index]
        sub.attempts.add((attempt, agent))
        # Assignee and attempt come from one entry, the latest attempt's: an earlier
        # attempt journaled later (an overlapping term's) only adds who may report it.
        if sub.status != DONE and attempt >= sub.attempt:
            sub.status, sub.assignee, sub.escalated = ASSIGNED, agent, False
            sub.attempt = attempt
    for index, attempt, agent, result in record.done:
        sub = view.subtasks[index]
        if sub.status == DONE:
            view.duplicates += 1
            continue
        sub.status, sub.assignee, sub.attempt = DONE, agent, attempt
        sub.result, sub.ref, sub.escalated = result, key, False
    for index, agent, attempt, _code in record.failed:
        sub = view.subtasks[index]
        sub.failures += 1
        if sub.status == ASSIGNED and (sub.attempt, sub.assignee) == (attempt, agent):
            sub.status = PENDING
    for agent, ms in record.leases.items():
        if agent in view.members:
            view.members[agent].lease_ms = ms
    for index in record.escalated:
        sub = view.subtasks[index]
        if sub.status != DONE:
            sub.status, sub.escalated = ESCALATED, True
    if record.status is not None:
        view.status = record.status
        if record.status == COMPLETED and record.has_outcome:
            view.outcome = record.outcome


@dataclass(frozen=True, slots=True)
class CoordLease:
    """The ``coord`` register: who coordinates, in which epoch, and its renewal count."""

    agent: str
    epoch: int
    beat: int

    def to_json(self) -> str:
        return dumps({"agent": self.agent, "epoch": self.epoch, "beat": self.beat})

    @classmethod
    def from_register_untrusted(cls, text: object) -> CoordLease:
        data = loads_register(text)
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("agent"), str)
            or peer_of(data["agent"]) is None
            or type(data.get("epoch")) is not int
            or type(data.get("beat")) is not int
        ):
            raise TaskError(ErrorCode.MALFORMED_MESSAGE, "coord register is malformed")
        return cls(data["agent"], data["epoch"], data["beat"])


def lease_stamp(epoch: int, now_ms: int) -> int:
    """The LWW timestamp of a ``coord`` write: the epoch first, so a later term's claim
    wins over every renewal of an earlier one whatever the clocks say."""
    return min(epoch, 900_000) * 10**13 + now_ms % 10**13


def log_key(epoch: int, agent: str) -> str:
    """The journal map of one coordinator term (sorts by epoch, then writer); ``agent``:
    the coordinator's member address."""
    return f"{epoch:010d}:{agent}"


def _term_of(key: str) -> tuple[int, str] | None:
    """``(epoch, member)`` of a journal key ``<epoch>:<member>/<seq>``; None if malformed."""
    term, _, _seq = key.partition("/")
    epoch, sep, member = term.partition(":")
    if not sep or len(epoch) != 10 or not epoch.isdigit() or peer_of(member) is None:
        return None
    return int(epoch), member


def claim_breach(view: SwarmView, opener: str, epoch: int, member: str) -> str | None:
    """Why coordinator term ``(epoch, member)`` is not admitted by the fold so far (§4.6
    rule 3); None when it is (an admitted term, the opener's epoch 1, or the claim of
    a member live after the earlier epochs' records, for the highest epoch or the
    next)."""
    if member in view.terms.get(epoch, ()):
        return None
    if epoch == 1:
        return None if member == opener else "epoch 1 is the opener's"
    if epoch < 1:
        return "an epoch below 1"
    top = max(view.terms, default=0)
    if epoch not in (top, top + 1) or top == 0:
        return f"epoch {epoch} is not the next after {top}"
    # Judged on the records of the earlier epochs only: an overlapping term of this
    # epoch journals a claimant dead when it beats to itself, not to that term.
    live = view.live_at.get(epoch)
    if live is None:
        live = frozenset(view.live_members())
    if member not in live:
        return "a claim by an agent that is not a live member"
    return None


def admit(view: SwarmView, opener: str, key: str, record: Record, writer: str) -> None:
    """Fold one authored journal record under the rules (§4.6): a record outside an
    admitted term, or written by another peer than its term's coordinator, is ignored;
    so are its results and failures not reported by the assignee of that attempt,
    assignments to non-members, and a ``completed`` status with sub-tasks not done.
    Each is noted in ``view.breaches``. A journaled outcome is never taken: readers
    compute it from the results."""
    term = _term_of(key)
    if term is not None and term[0] not in view.live_at:
        view.live_at[term[0]] = frozenset(view.live_members())  # records sort by epoch
    why: str | None
    if term is None:
        why = "a journal key that names no term"
    elif peer_of(term[1]) != writer:
        why = "written by another peer than its term's coordinator"
    else:
        why = claim_breach(view, opener, *term)
    if why is not None or term is None:
        view.breaches[key] = Breach("log/" + key, writer, why or "")
        return
    view.terms.setdefault(term[0], set()).add(term[1])
    clean = Record(dead=record.dead, joined=record.joined, leases=record.leases,
                   escalated=record.escalated)  # fmt: skip
    members = set(view.members) | {a for a, _, _ in record.joined}
    clean.assigned = [a for a in record.assigned if a[1] in members]
    apply(view, key, clean)  # joins and assignments first: a record may report on them
    late = Record(has_outcome=False)
    for entry in record.done:
        if (entry[1], entry[2]) in view.subtasks[entry[0]].attempts:
            late.done.append(entry)
    for fail in record.failed:
        if (fail[2], fail[1]) in view.subtasks[fail[0]].attempts:
            late.failed.append(fail)
    apply(view, key, late)
    refused = (len(record.assigned) - len(clean.assigned) + len(record.done) - len(late.done)
               + len(record.failed) - len(late.failed))  # fmt: skip
    if record.status is not None:
        view.completing = record.status == COMPLETED and not view.complete
        if not view.completing:
            view.status = record.status
    if view.completing and view.complete:
        view.status, view.completing = COMPLETED, False
    if refused:
        rule = f"{refused} entries not by the assignee or to a non-member"
        view.breaches[key] = Breach("log/" + key, writer, rule)


def fold_checked(
    count: int, opener: str, records: Iterable[tuple[str, Record, str]]
) -> SwarmView:
    """Replay authored records ``(key, record, writer)``, sorted here by key, under the
    rules (:func:`admit`); ``opener``: the opener's member address."""
    view = SwarmView([SubState() for _ in range(count)])
    for key, record, writer in sorted(records, key=lambda krw: krw[0]):
        admit(view, opener, key, record, writer)
    return view


class DocReader:
    """Successive values of one replica's swarm document (as :func:`authored` gives it),
    read incrementally: the plan once, each journal record once (a key is written once),
    and the checked fold extended in place while records arrive in key order (refolded
    when one arrives out of order, since what an entry may do depends on the records
    sorting before it)."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        #: The peer that wrote the plan: the opener's node.
        self.owner = ""
        self.coord: CoordLease | None = None
        self.canceled = False
        self.view: SwarmView | None = None
        self.records: dict[str, tuple[Record, str]] = {}
        #: Registers that did not parse (skipped).
        self.bad = 0
        #: Breaches outside the journal (``coord``, ``cancel``, ``plan``), by where.
        self.breaches: dict[str, Breach] = {}
        self._coord_seen: object = None
        self._coord_refused = False
        self._last = ""

    @property
    def opener(self) -> str:
        """The opener's member address (the plan's opener on the plan's writer)."""
        return member_address(self.plan.opener, self.owner) if self.plan is not None else ""

    def read_untrusted(self, value: Mapping[str, Any]) -> list[tuple[str, Record]]:
        """Take the document's current authored ``value``; the records new since the last
        read that the rules admit, in key order. Raises TaskError when the plan is
        malformed."""
        if self.plan is None and not self._read_plan(value.get("plan")):
            return []
        assert self.plan is not None
        cancel = value.get("cancel")
        if isinstance(cancel, Authored) and cancel.value is True:
            if cancel.writer == self.owner:
                self.canceled = True
            else:
                self.breaches["cancel"] = Breach("cancel", cancel.writer, "not the opener's")
        new = sorted(self._new_records(value.get("log")), key=lambda krw: krw[0])
        count = len(self.plan.subtasks)
        if self.view is None or (new and new[0][0] < self._last):
            self.records.update((k, (r, w)) for k, r, w in new)
            entries = ((k, r, w) for k, (r, w) in self.records.items())
            self.view = fold_checked(count, self.opener, entries)
        else:
            for key, record, writer in new:
                self.records[key] = (record, writer)
                admit(self.view, self.opener, key, record, writer)
        if new:
            self._last = max(self._last, new[-1][0])
        self._read_coord(value.get("coord"), bool(new))
        view = self.view
        if view.status == COMPLETED and view.outcome is None and view.complete:
            try:  # never the journaled outcome: the same aggregation here
                view.outcome = aggregate(self.plan.aggregate, self.plan.ids, view.results())
            except LocalError:
                self.bad += 1
        return [(k, r) for k, r, _w in new if k not in view.breaches]

    def _read_plan(self, plan: object) -> bool:
        if not isinstance(plan, dict) or not plan:
            return False
        writers = {v.writer for v in plan.values() if isinstance(v, Authored)}
        meta = plan.get("meta")
        if not isinstance(meta, Authored) or len(writers) != 1:
            if isinstance(meta, Authored):
                self.breaches["plan"] = Breach("plan", meta.writer, "plan registers of 2 writers")
            return False
        self.plan = Plan.from_doc_untrusted({k: v.value for k, v in plan.items()
                                             if isinstance(v, Authored)})  # fmt: skip
        self.owner = meta.writer
        return self.plan is not None

    def check_coord(self, text: object) -> tuple[CoordLease | None, str | None]:
        """The ``coord`` register (authored) as a lease and, when the rules do not admit
        its claim (§4.6), why; (None, None) for nothing to read."""
        if not isinstance(text, Authored) or self.view is None:
            return None, None
        try:
            lease = CoordLease.from_register_untrusted(text.value)
        except RemoteError:
            return None, "malformed"
        if peer_of(lease.agent) != text.writer:
            return lease, "written by another peer"
        return lease, claim_breach(self.view, self.opener, lease.epoch, lease.agent)

    def _read_coord(self, text: object, grown: bool) -> None:
        """Take the ``coord`` register only when the rules admit its claim. A claim
        refused is checked again when the journal grew (``grown``): whether its
        claimant is a live member depends on records that may still be in flight."""
        if text == self._coord_seen and not (grown and self._coord_refused):
            return
        self._coord_refused = False
        lease, why = self.check_coord(text)
        if lease is None or self.view is None:
            self.bad += why is not None
            self._coord_seen = text
            return
        where = f"coord/{lease.epoch:010d}:{lease.agent}"
        if why is None:
            self._coord_seen = text
            self.coord = lease
            self.breaches.pop(where, None)
        elif not (why.startswith("epoch") and lease.epoch == max(self.view.terms, default=0) + 2):
            # (A claim one epoch ahead of this replica may wait on a record in flight.)
            assert isinstance(text, Authored)
            self._coord_seen = text
            self._coord_refused = True
            self.breaches[where] = Breach("coord", text.writer, why)

    def _new_records(self, log: object) -> list[tuple[str, Record, str]]:
        assert self.plan is not None
        if not isinstance(log, dict):
            return []
        count = len(self.plan.subtasks)
        out: list[tuple[str, Record, str]] = []
        for term, entries in log.items():
            if not isinstance(entries, dict):
                self.bad += 1
                continue
            for seq, text in entries.items():
                key = f"{term}/{seq}"
                if key in self.records or not isinstance(text, Authored):
                    continue
                try:
                    record = Record.from_json_untrusted(loads_register(text.value), count)
                except RemoteError:
                    self.records[key] = (Record(), text.writer)  # skipped, not parsed again
                    self.bad += 1
                    continue
                out.append((key, record, text.writer))
        return out


def encode_result(result: Any) -> Any:
    """``result`` checked to be JSON data small enough for the journal. Raises
    LocalError(MESSAGE_TOO_LARGE) or LocalError(INVALID_ARGUMENT)."""
    if not is_json_value(result):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "a sub-task's result must be JSON data")
    if len(dumps(result)) > MAX_RESULT_CHARS:
        raise LocalError(
            ErrorCode.MESSAGE_TOO_LARGE, f"a sub-task's result is over {MAX_RESULT_CHARS} chars"
        )
    return result


__all__ = [
    "AGGREGATIONS",
    "ASSIGNED",
    "CANCELED",
    "CHUNK_CHARS",
    "COMPLETED",
    "DOC_PREFIX",
    "DONE",
    "ESCALATED",
    "INPUT_REQUIRED",
    "MAX_SUBTASKS",
    "PENDING",
    "WORKING",
    "Authored",
    "Breach",
    "CoordLease",
    "DocReader",
    "Member",
    "Plan",
    "Record",
    "SubState",
    "SubTask",
    "SwarmView",
    "admit",
    "aggregate",
    "apply",
    "authored",
    "claim_breach",
    "doc_name",
    "encode_result",
    "fold",
    "fold_checked",
    "lease_stamp",
    "log_key",
    "member_address",
    "peer_of",
    "split_member",
]
