"""Node liveness on threads of their own.

The coordinator, the head's node daemon and the driver share one event loop, so a user's
blocking code in `async def main` (a `time.sleep`, a long CPU step) would stop heartbeats in
both directions and get healthy nodes marked dead. Heartbeats therefore never touch that loop:
`HeartbeatServer` (coordinator side) answers them and watches for silent nodes on an event loop
in a thread of its own, and `HeartbeatSender` (node side) sends them from another. What they
learn reaches the owner's loop through `call_soon_threadsafe`, whenever that loop runs again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from transport import CurveConfig, RpcClient, RpcServer, TransportError
from transport.peers import ServerLimits

log = logging.getLogger(__name__)


def _tell(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on `loop` (the owner's), unless that loop has already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the owner is gone: nobody left to tell
        pass


class LoopThread:
    """An event loop running in a daemon thread; coroutines are submitted to it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on this thread's loop and await its result from another loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class HeartbeatServer:
    """The coordinator's heartbeat endpoint and silent-node watch, off the coordinator's loop.

    `on_silent(node_id, silent_s)` runs on the owner's loop once per tracked node that has
    sent nothing for `node_timeout` seconds; the node is then untracked (its heartbeats get
    False, which tells it to register again).
    """

    def __init__(self, bind_host: str, *, curve: CurveConfig | None, insecure: bool, node_timeout: float,
                 on_silent: Callable[[str, float], None], limits: ServerLimits | None = None,
                 restricted: list[bytes] | None = None) -> None:
        self.bind_host, self.curve, self.insecure = bind_host, curve, insecure
        self.limits = limits
        self.restricted = list(restricted or [])  # client keys that may call nothing here
        self.node_timeout = node_timeout
        self.on_silent = on_silent
        self._seen: dict[str, float] = {}  # node id -> monotonic time of its last heartbeat
        self._lock = threading.Lock()
        self._thread: LoopThread | None = None
        self._server: RpcServer | None = None
        self._watch: asyncio.Task | None = None
        self._owner: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self) -> int:
        """Start serving; returns the port nodes send heartbeats to."""
        self._owner = asyncio.get_running_loop()
        self._thread = LoopThread("coordinator-liveness")
        self.port = await self._thread.run(self._serve())
        return self.port

    async def _serve(self) -> int:
        self._server = RpcServer(f"tcp://{self.bind_host}:0", curve=self.curve, insecure=self.insecure,
                                 limits=self.limits, name="liveness")
        self._server.register("heartbeat", self._heartbeat)
        for key in self.restricted:
            self._server.restrict_client(key, frozenset())
        endpoint = await self._server.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_nodes(), name="liveness-watch")
        return int(endpoint.rsplit(":", 1)[1])

    def _heartbeat(self, node_id: str) -> bool:
        with self._lock:
            if node_id not in self._seen:
                return False
            self._seen[node_id] = time.monotonic()
            return True

    def track(self, node_id: str) -> None:
        with self._lock:
            self._seen[node_id] = time.monotonic()

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._seen.pop(node_id, None)

    def silence(self, node_id: str) -> float | None:
        """Seconds since `node_id`'s last heartbeat, or None when it is not tracked."""
        with self._lock:
            seen = self._seen.get(node_id)
        return None if seen is None else time.monotonic() - seen

    async def _watch_nodes(self) -> None:
        tick = min(0.5, self.node_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            with self._lock:
                if now - last > self.node_timeout / 2:
                    # this thread itself did not run (the process was stopped or starved):
                    # the silence is ours, not the nodes'
                    for node_id in self._seen:
                        self._seen[node_id] = max(self._seen[node_id], now)
                silent = [(n, now - t) for n, t in self._seen.items() if now - t > self.node_timeout]
                for node_id, _ in silent:
                    del self._seen[node_id]
            last = now
            for node_id, seconds in silent:
                _tell(self._owner, self.on_silent, node_id, seconds)

    async def _shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._server is not None:
            await self._server.close()

    async def close(self) -> None:
        if self._thread is None:
            return
        try:
            await asyncio.wait_for(self._thread.run(self._shutdown()), 5)
        except (TimeoutError, RuntimeError) as e:  # pragma: no cover - a wedged liveness thread
            log.warning("liveness server did not stop cleanly: %s", e)
        self._thread.stop()
        self._thread = None


class HeartbeatSender:
    """A node's heartbeats to the coordinator's `HeartbeatServer`, off the node's loop.

    `last_ok` is the monotonic time of the last answered heartbeat; `on_unknown()` runs on the
    owner's loop when the coordinator answers that it does not know this node (it restarted, or
    declared the node dead): the node must register again.
    """

    def __init__(self, node_id: str, *, curve: CurveConfig | None, insecure: bool, interval: float,
                 on_unknown: Callable[[], None]) -> None:
        self.node_id, self.curve, self.insecure = node_id, curve, insecure
        self.interval = interval
        self.on_unknown = on_unknown
        self.last_ok = time.monotonic()
        self._endpoint: str | None = None
        self._thread: LoopThread | None = None
        self._task: asyncio.Task | None = None
        self._owner: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._owner = asyncio.get_running_loop()
        self._thread = LoopThread(f"node-heartbeat-{self.node_id}")
        self._thread.submit(self._start_beating()).result(timeout=5)

    async def _start_beating(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="node-heartbeat")

    def target(self, endpoint: str | None) -> None:
        """Send heartbeats to `endpoint` from now on (None: stop sending)."""
        self._endpoint = endpoint
        if endpoint is not None:
            self.last_ok = time.monotonic()

    async def _beat(self) -> None:
        client: RpcClient | None = None
        endpoint: str | None = None
        try:
            while True:
                if self._endpoint != endpoint:
                    if client is not None:
                        await client.close()
                    endpoint, client = self._endpoint, None
                    if endpoint is not None:
                        client = RpcClient(endpoint, curve=self.curve, insecure=self.insecure,
                                           name="node->liveness", heartbeat_interval=self.interval,
                                           heartbeat_timeout=max(2.0, 3 * self.interval))
                if client is not None:
                    try:
                        known = await client.call("heartbeat", self.node_id, timeout=max(1.0, 3 * self.interval))
                    except TransportError:
                        pass
                    else:
                        if known:
                            self.last_ok = time.monotonic()
                        elif self._endpoint == endpoint:
                            self._endpoint = None
                            _tell(self._owner, self.on_unknown)
                await asyncio.sleep(self.interval)
        finally:
            if client is not None:
                await client.close()

    async def close(self) -> None:
        if self._thread is None:
            return
        try:
            await asyncio.wait_for(self._thread.run(self._stop_beating()), 5)
        except TimeoutError:  # pragma: no cover - a wedged heartbeat thread
            log.warning("heartbeat thread of node %s did not stop cleanly", self.node_id)
        self._thread.stop()
        self._thread = None

    async def _stop_beating(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
