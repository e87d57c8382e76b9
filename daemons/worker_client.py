"""`WorkerHandle`: the driver's client for one worker process.

Calls go straight to the worker's RPC server; when the worker dies they fail with
`WorkerDiedError` (its exit reason and log tail), and refs in replies are noted in the
coordinator's object directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daemons.errors import CallTimeoutError, WorkerDiedError
from daemons.messages import WorkerState
from transport import ConnectionLost, RpcClient, RpcTimeout

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
        if self.info.state is WorkerState.DEAD:
            raise self.death_error()
        if self.client.connection_dropped:  # between calls: ask its node before sending into the void
            await self.coordinator.check_workers([self.info])
            if self.info.state is WorkerState.DEAD:
                raise self.death_error()
        deadline = timeout if timeout is not None else (self.default_timeout_s or None)
        try:
            result = await self.client.call_with(method, args, kwargs, timeout=deadline)
        except (ConnectionLost, WorkerDiedError) as e:
            raise await self.coordinator.explain_loss(self.info, e) from None
        except RpcTimeout:
            if timeout is not None:  # the caller's own deadline: its own error
                raise
            raise CallTimeoutError(f"{method} on worker {self.info.worker_id}", [self.rank], deadline, []) from None
        self.coordinator.note_refs(result, self.info)
        return result

    async def run(self, fn: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run the importable function `fn` ("module:name") in this worker."""
        return await self.call("run", fn, list(args), kwargs, timeout=timeout)

    def death_error(self) -> WorkerDiedError:
        i = self.info
        return WorkerDiedError(i.worker_id, i.node_id, i.rank, i.exit_reason or "unknown", i.log_tail)

    def __repr__(self) -> str:
        return f"WorkerHandle({self.info.worker_id}, rank={self.rank}, {self.info.state.value})"
