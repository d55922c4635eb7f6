"""A tiny controller for stock ``kademlia`` Servers, run in a separate OS process.

Usage: python stock_peers.py N. Prints one JSON line
``{"nodes": [[id_hex, host, port], ...]}`` once N servers listen on 127.0.0.1
(each bootstrapped off the first), then answers JSON commands, one per line:
``{"op": "get", "node": i, "key": "..."}``, ``{"op": "set", ...,"value_hex": ...}``,
``{"op": "bootstrap", "node": i, "host": h, "port": p}``, ``{"op": "table", "node": i}``.
Also used by scripts/bench_dht.py as the baseline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from kademlia.network import Server


async def main(n: int) -> None:
    logging.getLogger("kademlia").setLevel(logging.CRITICAL)
    logging.getLogger("rpcudp").setLevel(logging.CRITICAL)
    servers: list[Any] = []
    for _ in range(n):
        s = Server()
        await s.listen(0, interface="127.0.0.1")
        servers.append(s)
    addrs = [s.transport.get_extra_info("sockname")[:2] for s in servers]
    for s in servers[1:]:
        await s.bootstrap([tuple(addrs[0])])
    nodes = [[s.node.id.hex(), a[0], a[1]] for s, a in zip(servers, addrs, strict=True)]
    print(json.dumps({"nodes": nodes}))
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        s = servers[cmd["node"]]
        out: dict[str, Any] = {}
        if cmd["op"] == "get":
            value = await s.get(cmd["key"])
            out["value_hex"] = value.hex() if isinstance(value, bytes) else None
            out["repr"] = repr(value)[:80]
        elif cmd["op"] == "set":
            out["ok"] = await s.set(cmd["key"], bytes.fromhex(cmd["value_hex"]))
        elif cmd["op"] == "bootstrap":
            await s.bootstrap([(cmd["host"], cmd["port"])])
            out["ok"] = True
        elif cmd["op"] == "table":
            out["ids"] = [
                node.id.hex() for b in s.protocol.router.buckets for node in b.get_nodes()
            ]
        print(json.dumps(out))
        sys.stdout.flush()
    for s in servers:
        s.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
