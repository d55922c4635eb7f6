"""Push notifications of the gateway (docs/protocol/a2a.md §6.1).

The swarm's agents have no public URL, so the gateway delivers the pushes of
the tasks it makes. The SDK's classes do the work: :class:`PushConfigStore` is
its in-memory config store with bounds and checks, and :class:`PushDelivery`
its webhook sender (the spec's ``X-A2A-Notification-Token`` and
``Authorization`` headers, a ``StreamResponse`` as the body) with retries, a
body limit and a queue. The SDK's request handler awaits the sender in the
task's event loop, so :class:`PushDelivery` only queues there: a worker per
task posts that task's events in order, and a slow or dead webhook delays
nothing but its own pushes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import urllib.parse
from collections import OrderedDict, deque
from typing import Final

import httpx
from a2a.server.context import ServerCallContext
from a2a.server.tasks import BasePushNotificationSender, InMemoryPushNotificationConfigStore
from a2a.server.tasks.push_notification_sender import PushNotificationEvent
from a2a.types import TaskPushNotificationConfig
from a2a.utils.errors import InvalidParamsError
from a2a.utils.proto_utils import to_stream_response
from google.protobuf.json_format import MessageToDict

logger = logging.getLogger("p2pnode.a2a.push")

#: Configs one task may have, and tasks with configs the gateway keeps (the oldest go first).
MAX_CONFIGS_PER_TASK: Final = 8
MAX_PUSH_TASKS: Final = 1000
#: Longest webhook URL, and longest config id, token, scheme or credentials.
MAX_URL: Final = 2048
MAX_FIELD: Final = 1024
#: Seconds one POST may take, attempts per push, and the wait before the second attempt
#: (doubling after).
PUSH_TIMEOUT: Final = 5.0
PUSH_ATTEMPTS: Final = 3
PUSH_BACKOFF: Final = 0.5
#: Largest body pushed (JSON bytes), and events waiting for delivery in the whole gateway.
MAX_PUSH_BODY: Final = 8 * 1024 * 1024
MAX_PENDING: Final = 1000


def push_config_problem(config: TaskPushNotificationConfig) -> str | None:
    """Why the gateway refuses ``config`` (None: it takes it)."""
    url = config.url
    if len(url) > MAX_URL:
        return f"the push URL is longer than {MAX_URL} characters"
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        return "the push URL does not parse"
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "the push URL must be an http:// or https:// URL with a host"
    fields = (config.id, config.token, config.authentication.scheme,
              config.authentication.credentials)  # fmt: skip
    if any(len(value) > MAX_FIELD for value in fields):
        return f"a push config's id, token, scheme or credentials is over {MAX_FIELD} characters"
    return None


class PushConfigStore(InMemoryPushNotificationConfigStore):
    """The SDK's in-memory config store, refusing a config :func:`push_config_problem`
    refuses or a task's config past the ``per_task``-th (InvalidParams), and keeping the
    configs of the ``limit`` tasks set last."""

    def __init__(
        self, *, limit: int = MAX_PUSH_TASKS, per_task: int = MAX_CONFIGS_PER_TASK
    ) -> None:
        super().__init__()
        self._limit = limit
        self._per_task = per_task
        self._order: OrderedDict[str, None] = OrderedDict()

    async def set_info(
        self,
        task_id: str,
        notification_config: TaskPushNotificationConfig,
        context: ServerCallContext,
    ) -> TaskPushNotificationConfig:
        problem = push_config_problem(notification_config)
        if problem is not None:
            logger.info("push config for task %s refused: %s", task_id, problem)
            raise InvalidParamsError(problem)
        config_id = notification_config.id or task_id
        held = await self.get_info_for_dispatch(task_id)
        if len(held) >= self._per_task and all(c.id != config_id for c in held):
            raise InvalidParamsError(f"a task has at most {self._per_task} push configs")
        stored = await super().set_info(task_id, notification_config, context)
        self._order[task_id] = None
        self._order.move_to_end(task_id)
        while len(self._order) > self._limit:
            self._forget(self._order.popitem(last=False)[0])
        return stored

    def _forget(self, task_id: str) -> None:
        """Drop every owner's configs of ``task_id`` (the parent keys them by owner)."""
        with self.lock:
            infos = self._push_notification_infos
            for owner in list(infos):
                infos[owner].pop(task_id, None)
                if not infos[owner]:
                    del infos[owner]

    def may_have_configs(self, task_id: str) -> bool:
        """Whether ``task_id`` has been given a config and not forgotten since (its
        configs may have been deleted after: a push's turn reads them again)."""
        return task_id in self._order

    def statistics(self) -> dict[str, int]:
        """How many tasks have configs."""
        return {"tasks": len(self._order)}


class PushDelivery(BasePushNotificationSender):
    """The SDK's webhook sender, queued: :meth:`send_notification` returns at once and a
    worker per task posts its events in order, each POST bounded by ``client``'s timeout
    and tried ``attempts`` times. A body over ``max_body`` is not sent; an event past
    ``max_pending`` waiting ones is dropped; both are logged, as is every failure."""

    def __init__(
        self,
        store: PushConfigStore,
        *,
        client: httpx.AsyncClient | None = None,
        attempts: int = PUSH_ATTEMPTS,
        backoff: float = PUSH_BACKOFF,
        max_body: int = MAX_PUSH_BODY,
        max_pending: int = MAX_PENDING,
    ) -> None:
        own = client or httpx.AsyncClient(timeout=PUSH_TIMEOUT, follow_redirects=False)
        super().__init__(own, store)
        self.store = store
        self._http = own
        self._attempts = attempts
        self._backoff = backoff
        self._max_body = max_body
        self._max_pending = max_pending
        self._queues: dict[str, deque[PushNotificationEvent]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._pending = 0
        self._closed = False
        self._stats = {"sent": 0, "failed": 0, "dropped": 0, "too_large": 0}

    async def send_notification(self, task_id: str, event: PushNotificationEvent) -> None:
        self.send_nowait(task_id, event)

    def send_nowait(self, task_id: str, event: PushNotificationEvent) -> None:
        """Queue ``event`` of ``task_id`` for its webhooks (a copy: the SDK goes on
        changing its task). An event of a task without a config is not queued: a
        blocking send's four events would otherwise each cost a copy, a task and a
        serialization for nothing. After :meth:`aclose` it does nothing."""
        if self._closed or not self.store.may_have_configs(task_id):
            return
        if self._pending >= self._max_pending:
            self._stats["dropped"] += 1
            logger.warning("push for task %s dropped: %d pushes wait", task_id, self._pending)
            return
        self._queues.setdefault(task_id, deque()).append(copy.deepcopy(event))
        self._pending += 1
        if task_id not in self._workers:
            worker = asyncio.create_task(self._drain(task_id), name=f"a2a-push:{task_id}")
            self._workers[task_id] = worker

    async def _drain(self, task_id: str) -> None:
        queue = self._queues[task_id]
        try:
            while queue:
                event = queue.popleft()
                self._pending -= 1
                await self._deliver(task_id, event)
        finally:  # nothing awaits between the empty check and this: no event is stranded
            self._pending -= len(queue)
            del self._queues[task_id]
            del self._workers[task_id]

    async def _deliver(self, task_id: str, event: PushNotificationEvent) -> None:
        size = len(json.dumps(MessageToDict(to_stream_response(event))).encode())
        if size > self._max_body:
            self._stats["too_large"] += 1
            logger.warning("push for task %s not sent: %d bytes (at most %d)", task_id,
                           size, self._max_body)  # fmt: skip
            return
        await super().send_notification(task_id, event)

    async def _dispatch_notification(
        self, event: PushNotificationEvent, push_info: TaskPushNotificationConfig, task_id: str
    ) -> bool:
        for attempt in range(self._attempts):
            if attempt:
                await asyncio.sleep(self._backoff * 2 ** (attempt - 1))
            if await super()._dispatch_notification(event, push_info, task_id):
                self._stats["sent"] += 1
                return True
        self._stats["failed"] += 1
        logger.warning("push to %s for task %s failed %d times: given up", push_info.url,
                       task_id, self._attempts)  # fmt: skip
        return False

    def statistics(self) -> dict[str, int]:
        """Pushes sent, failed (after every attempt), dropped (queue full), too large, and
        waiting now."""
        return {**self._stats, "pending": self._pending}

    async def wait_idle(self) -> None:
        """Return once no push waits or is being sent."""
        while self._workers:
            await asyncio.gather(*self._workers.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop the workers (their pushes are lost) and close the HTTP client."""
        self._closed = True
        workers = list(self._workers.values())
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await self._http.aclose()


__all__ = [
    "MAX_CONFIGS_PER_TASK",
    "MAX_PENDING",
    "MAX_PUSH_BODY",
    "MAX_PUSH_TASKS",
    "PUSH_ATTEMPTS",
    "PUSH_TIMEOUT",
    "PushConfigStore",
    "PushDelivery",
    "push_config_problem",
]
