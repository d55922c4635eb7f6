"""The shared documents a node's agents are subscribed to, saved across restarts in
``data_dir/crdt-subscriptions.json`` (see :mod:`p2pnode.services.shared.service`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import trio

from p2pnode.core.identity import write_private_file

logger = logging.getLogger("p2pnode.shared")

SUBSCRIPTIONS_FILE_NAME = "crdt-subscriptions.json"
_MAX_SUBSCRIPTIONS = 1024


class SubscriptionFile:
    """(agent, document) pairs in ``data_dir`` (nothing is saved without one)."""

    def __init__(self, data_dir: Path | None) -> None:
        self._data_dir = data_dir
        self._lock = trio.Lock()

    def load(self) -> list[tuple[str, str]]:
        """The saved pairs; none when the file is missing or unreadable (logged)."""
        if self._data_dir is None:
            return []
        path = self._data_dir / SUBSCRIPTIONS_FILE_NAME
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return []
        items = data.get("subscriptions") if isinstance(data, dict) else None
        out = []
        for item in items[:_MAX_SUBSCRIPTIONS] if isinstance(items, list) else []:
            if isinstance(item, list) and len(item) == 2 and all(isinstance(s, str) for s in item):
                out.append((item[0], item[1]))
        return out

    async def save(self, pairs: set[tuple[str, str]]) -> None:
        """Save ``pairs`` and the saved ones (those of agents not hosted now are kept)."""
        if self._data_dir is None:
            return
        pairs = pairs | set(self.load())
        text = json.dumps({"subscriptions": sorted([list(p) for p in pairs])}, indent=1)
        async with self._lock:
            path = self._data_dir / SUBSCRIPTIONS_FILE_NAME
            await trio.to_thread.run_sync(write_private_file, path, text.encode())


__all__ = ["SUBSCRIPTIONS_FILE_NAME", "SubscriptionFile"]
