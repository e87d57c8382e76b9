"""`WorkerHandle`: the driver's client for one worker process.

Calls go straight to the worker's RPC server; when the worker dies they fail with
`WorkerDiedError` (its exit reason and log tail), and refs in replies are noted in the
coordinator's object directory.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from daemons.errors import CallTimeoutError, WorkerDiedError
from daemons.messages import WorkerState
from transport import ConnectionLost, RpcClient, RpcTimeout
from transport.rpc import encode_request

if TYPE_CHECKING:
    from daemons.coordinator import Coordinator, WorkerInfo


class WorkerHandle:
    """The driver's view of one worker process; calls fail with WorkerDiedError when it dies."""

    def __init__(self, coordinator: Coordinator, info: WorkerInfo, client: RpcClient) -> None:
        self.coordinator = coordinator
        self.info = info
        self.client = client
        # a call's deadline when it gives none: the job's worker.call_timeout_s (0 = none)
        self.default_timeout_s = 0.0

    @property
    def rank(self) -> int:
        return self.info.rank

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        req_id, frames = encode_request(method, args, kwargs)
        return await self.call_encoded(req_id, frames, method, timeout)

    async def call_encoded(self, req_id: int, frames: list[Any], method: str, timeout: float | None = None) -> Any:
        """`call` with a request made by `transport.rpc.encode_request` (a group call encodes its
        arguments once for every rank)."""
        if self.info.state is WorkerState.DEAD:
            raise self.death_error()
        if self.client.connection_dropped:  # ask its node before sending into the void
            await self.coordinator.check_workers([self.info])
            if self.info.state is WorkerState.DEAD:
                raise self.death_error()
        try:
            result = await self.client.send_request(req_id, frames, method, self.deadline(timeout))
        except Exception as e:
            raise await self.failure(e, method, timeout) from None
        self.coordinator.note_refs(result, self.info)
        return result

    def start(self, req_id: int, frames: list[Any], method: str, timeout: float | None = None) -> asyncio.Future | None:
        """Send the request and return its reply's future (errors as `failure` turns them), or None
        when this worker must be checked first (dead or disconnected): then use `call_encoded`."""
        if self.info.state is WorkerState.DEAD or self.client.connection_dropped:
            return None
        return self.client.send_request(req_id, frames, method, self.deadline(timeout))

    def deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else (self.default_timeout_s or None)

    async def failure(self, e: BaseException, method: str, timeout: float | None) -> BaseException:
        """The error a failed call raises: its death explained, or the deadline it missed."""
        if isinstance(e, (ConnectionLost, WorkerDiedError)):
            return await self.coordinator.explain_loss(self.info, e)
        if isinstance(e, RpcTimeout) and timeout is None:  # the job's default deadline, not the caller's
            return CallTimeoutError(f"{method} on worker {self.info.worker_id}", [self.rank], self.deadline(None), [])
        return e

    async def run(self, fn: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run the importable function `fn` ("module:name") in this worker."""
        return await self.call("run", fn, list(args), kwargs, timeout=timeout)

    def death_error(self) -> WorkerDiedError:
        i = self.info
        return WorkerDiedError(i.worker_id, i.node_id, i.rank, i.exit_reason or "unknown", i.log_tail)

    def __repr__(self) -> str:
        return f"WorkerHandle({self.info.worker_id}, rank={self.rank}, {self.info.state.value})"
