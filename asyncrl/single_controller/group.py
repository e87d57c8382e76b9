"""`WorkerGroup`: the driver's handle on one Worker class running on every device of a pool.

`group.method(...)` returns a `DataFuture` at once. Awaiting it gives the collected result;
passing it to another call makes a dataflow edge (that call starts when its inputs are ready).
Calls on groups that share processes (colocated classes on one pool) run in the order they were
issued; groups on disjoint pools run concurrently.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import AsyncRLError
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.distbatch import DistBatch, RefTracker
from asyncrl.single_controller.fanout import Gather, Replies
from asyncrl.single_controller.parallel import LayoutError, ParallelLayout
from asyncrl.single_controller.pipeline import PipelineError, Promised
from asyncrl.single_controller.protocols import LOCAL_ROWS, CallContext, get_protocol
from asyncrl.single_controller.tree import tree_leaves, tree_map, tree_map_async
from asyncrl.single_controller.worker import MethodSpec, registered_methods
from daemons.coordinator import ResourcePool
from daemons.errors import CallTimeoutError, DaemonError, WorkerDiedError
from daemons.messages import WorkerState
from daemons.worker_client import WorkerHandle
from transport import RemoteError, RpcTimeout, trace
from transport.rpc import encode_request

log = logging.getLogger(__name__)
PIPELINE = True  # LOCAL_ROWS calls on the outputs of pending calls on their processes are sent at once
_relayed: set[str] = set()  # worker warnings already shown (the same one from every rank shows once)


def relay_warning(role: str, rank: int, warning: str) -> None:
    """A worker's warning on the driver's console, once per distinct message."""
    if warning in _relayed or len(_relayed) >= 10_000:
        return
    _relayed.add(warning)
    log.warning("from %s rank %d: %s", role, rank, warning)

# After a rank lost a peer in a collective, how long its node daemons are asked (every 0.2 s)
# whether a rank of the call died; the survivor's error often arrives before the death is known
DEATH_NOTICE_S = 3.0
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|NCCL (error|communicator)|"
                        r"ProcessGroup\w* .*(abort|timed out)|Socket Timeout|Connection refused|"
                        r"ObjectLostError|dead or unreachable",
                        re.IGNORECASE)
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ ?ms|Watchdog caught collective operation timeout",
                                 re.IGNORECASE)


class NotSentError(AsyncRLError):
    """A call failed before its requests went out (its inputs' call failed: that error is the one to read)."""


class WorkerCallError(AsyncRLError):
    """A rank raised inside a worker method; carries the group, method, rank and traceback."""

    def __init__(self, group: str, method: str, rank: int, remote: RemoteError,
                 collective_timeout_s: float | None = None) -> None:
        self.group, self.method, self.rank = group, method, rank
        self.remote_type = remote.remote_type.removeprefix("builtins.")
        self.remote_message, self.remote_traceback = remote.remote_message, remote.remote_traceback
        hint = ""
        if _COLLECTIVE_TIMEOUT.search(self.remote_message):
            value = f"={collective_timeout_s:g}s" if collective_timeout_s else ""
            hint = (f"\n(a collective waited longer than worker.collective_timeout_s{value}: "
                    "another rank never joined it — stuck, much slower, or calling a different "
                    "collective; see the other ranks' worker logs. Raise worker.collective_timeout_s "
                    "if a rank legitimately needs longer)")
        super().__init__(f"{group}.{method} failed on rank {rank}: {self.remote_type}: "
                         f"{self.remote_message}{hint}\n--- rank {rank} traceback ---\n"
                         f"{self.remote_traceback.rstrip()}")

    def summary(self) -> str:
        return f"rank {self.rank}: {self.remote_type}: {self.remote_message.splitlines()[0][:300]}"


@dataclass(eq=False)
class CallOutput:
    """An ordered call's output on its processes: its number there (`seq`) and, once its requests
    are out, whether every rank's output is its own part of the result (`sent`: True / False;
    the call's error if it failed before sending)."""

    procs: ProcessSet
    seq: int
    sent: asyncio.Future


class DataFuture:
    """The result of a group call that may not exist yet; await it, or pass it to another call.
    `source`: the ordered calls whose outputs make it (one; several for `union_all`), None for
    anything else."""

    __slots__ = ("task", "label", "awaited", "source")

    def __init__(self, task: asyncio.Task, label: str, source: tuple[CallOutput, ...] | None = None) -> None:
        self.task, self.label, self.awaited, self.source = task, label, False, source
        task.add_done_callback(_retrieved)  # reported below if nobody awaits it

    def __await__(self) -> Generator[Any, None, Any]:
        self.awaited = True
        return self.task.__await__()

    def done(self) -> bool:
        return self.task.done()

    def result(self) -> Any:
        self.awaited = True
        return self.task.result()

    def __del__(self) -> None:
        if not self.awaited:
            if self.task.done():
                _report_unawaited(self.task, self.label)
            else:
                self.task.add_done_callback(lambda t, label=self.label: _report_unawaited(t, label))

    def __repr__(self) -> str:
        state = "done" if self.task.done() else "pending"
        return f"DataFuture({self.label}, {state})"


async def _went_out(out: CallOutput) -> bool:
    """Whether an ordered call's requests reached every rank (False: it failed before sending)."""
    try:
        await out.sent
    except Exception:  # noqa: BLE001 - its own error is its caller's
        return False
    return True


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # asyncio would print a traceback per dropped future; see _report_unawaited


def _report_unawaited(task: asyncio.Task, label: str) -> None:
    """One line for a call that failed and was dropped unawaited. A worker's death is not
    repeated (the call that met it first reports it, and the coordinator logs it), nor is a call
    that never went out because the call making its inputs failed."""
    err = None if task.cancelled() else task.exception()
    if err is not None and not isinstance(err, (WorkerDiedError, NotSentError)):
        log.error("%s failed and was never awaited: %s: %s", label, type(err).__name__,
                  str(err).splitlines()[0] if str(err) else "")


def union_all(first: DistBatch | Awaitable, *rest: DistBatch | Awaitable) -> DistBatch | DataFuture:
    """The batches' columns side by side, row by row (`DistBatch.union`); given calls (or other
    awaitables) that may not have ended, a future of that, which a LOCAL_ROWS call on the same
    processes takes before they end (pipelined)."""
    parts = (first, *rest)
    if all(isinstance(p, DistBatch) for p in parts):
        out = first
        for other in rest:
            out = out.union(other)
        return out

    async def joined() -> DistBatch:
        return union_all(*[p if isinstance(p, DistBatch) else await p for p in parts])

    futures = [p for p in parts if isinstance(p, DataFuture)]
    source = (tuple(c for f in futures for c in f.source)
              if len(futures) == len(parts) and all(f.source for f in futures) else None)
    return DataFuture(asyncio.get_running_loop().create_task(joined(), name="union_all"), "union_all", source)


async def resolve_futures(value: Any) -> Any:
    """`value` with every DataFuture in it (nested in lists, tuples, dicts) awaited."""
    async def wait(f: DataFuture) -> Any:
        return await f
    return await tree_map_async(wait, value, DataFuture)


class ProcessSet:
    """The worker processes of one pool, shared by the groups colocated on it."""

    def __init__(self, pool: ResourcePool, handles: list[WorkerHandle], call_timeout_s: float = 0.0,
                 collective_timeout_s: float | None = None) -> None:
        self.pool, self.handles = pool, handles
        self.call_timeout_s = call_timeout_s  # per call, every rank (0 = none; worker.call_timeout_s)
        self.collective_timeout_s = collective_timeout_s  # what the workers' process groups use
        self.tail: asyncio.Future | None = None  # the last ordered call issued on these processes
        self.tail_seq = -1  # its number (`CallOutput.seq`)
        self.tail_out: CallOutput | None = None  # and its output
        self.unsettled: list[asyncio.Future] = []  # rank calls still running after a failed call
        # the task waiting for them (`WorkerGroup._settle`), held here: the loop keeps tasks weakly
        self.settling: asyncio.Task | None = None
        self.calls = 0

    @property
    def world_size(self) -> int:
        return len(self.handles)


class WorkerGroup:
    """One Worker class on all ranks of a pool; registered methods become driver calls.

    `tracker` (the JobContext's) tracks the DistBatches its calls return, so their objects are
    freed once the driver drops them; None leaves them untracked.
    """

    def __init__(self, role: str, cls: type, procs: ProcessSet, tracker: RefTracker | None = None) -> None:
        self.role, self.cls, self.procs, self.tracker = role, cls, procs, tracker
        self.methods: dict[str, MethodSpec] = registered_methods(cls)
        self.rank_layouts: list[dict[str, ParallelLayout]] = [{} for _ in procs.handles]
        # once each: run right after the named method's next call is issued (e.g. the trainer
        # sends the next step's generation behind the step's last update)
        self.after_issue: dict[str, Callable[[], Any]] = {}
        self.created_with: tuple[str, list, dict] | None = None  # the class path and arguments each rank got

    @property
    def layouts(self) -> dict[str, ParallelLayout]:
        """The group's parallel layouts by name (every rank must have registered the same)."""
        out: dict[str, ParallelLayout] = {}
        for rank, layouts in enumerate(self.rank_layouts):
            for name, layout in layouts.items():
                if out.setdefault(name, layout) != layout:
                    raise LayoutError(f"{self.role}: rank {rank} registered layout {name!r} as "
                                      f"{layout.describe()} but rank 0 as {out[name].describe()}; "
                                      "every rank of a group must register the same layout")
        return out

    def _update_layouts(self, rank: int, wire: dict[str, Any]) -> None:
        self.rank_layouts[rank] = {n: ParallelLayout.from_wire(v) for n, v in wire.items()}

    @property
    def world_size(self) -> int:
        return self.procs.world_size

    @property
    def handles(self) -> list[WorkerHandle]:
        return self.procs.handles

    def __getattr__(self, name: str) -> Callable[..., DataFuture]:
        if name.startswith("_") or name not in self.__dict__.get("methods", {}):
            methods = sorted(self.__dict__.get("methods", {}))
            raise AttributeError(f"{self.__dict__.get('role', '?')} group ({getattr(self.__dict__.get('cls'), '__qualname__', '?')}) "
                                 f"has no registered method {name!r}; registered: {methods}")
        spec = self.methods[name]

        def call(*args: Any, **kwargs: Any) -> DataFuture:
            return self.call(name, spec, "asyncrl_call", [name], args, kwargs)
        call.__name__ = name
        return call

    def behind(self, method: str, *args: Any, **kwargs: Any) -> DataFuture:
        """Call registered `method` now, to run on every rank right after the last ordered call
        on these processes: sent once that call's requests are out, not after its replies, so no
        driver round trip lies between the two. If that call fails on a rank, this one fails
        there without running."""
        spec = self.methods.get(method)
        if spec is None or not spec.blocking:
            raise AttributeError(f"{self.role}: {method!r} is not an ordered registered method; "
                                 f"registered: {sorted(self.methods)}")
        return self.call(method, spec, "asyncrl_call", [method], args, kwargs, behind=True)

    def apply(self, fn: Callable | str, *args: Any, protocol: str = LOCAL_ROWS, blocking: bool = True,
              **kwargs: Any) -> DataFuture:
        """Run an importable function on this group's ranks, where the data lives.

        The function gets the pulled `Batch`es (by default every rank the rows its own store
        holds, `LOCAL_ROWS`) and may return a Batch, which stays on the worker; e.g. advantage
        estimation without the driver ever holding tensors. A `peers` parameter gets the ranks
        called (`asyncrl.single_controller.peers.Peers`) for batch-wide sums.
        """
        path = fn if isinstance(fn, str) else importable_path(fn)
        spec = MethodSpec(protocol, blocking)
        return self.call(f"apply:{path}", spec, "asyncrl_apply", lambda plan: [path, sorted(plan)], args, kwargs)

    def call(self, label: str, spec: MethodSpec, entry: str, head: list | Callable[[dict], list], args: tuple,
             kwargs: dict, behind: bool = False) -> DataFuture:
        protocol = get_protocol(spec.protocol)
        loop = asyncio.get_running_loop()
        prev = self.procs.tail if spec.blocking else None
        before = self.procs.tail_out if spec.blocking and behind and prev is not None and not prev.done() else None
        out = CallOutput(self.procs, self.procs.calls, loop.create_future()) if spec.blocking else None
        ahead = self._inputs_ahead(spec, args, kwargs)

        async def ordered(after: int | None = None) -> Any:
            if after is None and prev is not None and not prev.done():
                with trace.span("wait for the pool", "call"):
                    await asyncio.wait([prev])  # call order on shared processes; its errors are its own
            with trace.span("wait for inputs", "call"):
                a, k = await resolve_futures((list(args), kwargs))
            with trace.span(f"{self.role}.{label}", "call"):
                ctx = self._context(label)
                plan = protocol.distribute(ctx, tuple(a), k)
                local = protocol.stays_local is not None and protocol.stays_local(ctx, plan)
                outputs = await self._fan_out(label, entry, head(plan) if callable(head) else head, plan, out, local,
                                              after)
                return protocol.collect(ctx, outputs)

        async def run() -> Any:
            try:
                if ahead is not None and all(await asyncio.gather(*(c.sent for c in ahead))):
                    return await self._run_ahead(label, entry, head, args, kwargs, protocol, out)
                if before is not None and await _went_out(before):  # the workers keep the order
                    return await ordered(after=before.seq)
                return await ordered()
            finally:
                if out is not None and not out.sent.done():  # failed before its requests went out
                    out.sent.set_exception(NotSentError(f"{self.role}.{label} failed before it was sent"))
                    out.sent.exception()  # retrieved: the call's own error is what its caller sees

        task = loop.create_task(run(), name=f"{self.role}.{label}")
        if spec.blocking:
            # the next call waits until this one has ended on *every* rank (after a failure the
            # other ranks may still be running it), without keeping its result alive
            self.procs.tail = self._turn(task, label)
            self.procs.tail_seq, self.procs.tail_out = out.seq, out
        self.procs.calls += 1
        future = DataFuture(task, f"{self.role}.{label}", (out,) if out is not None else None)
        hook = self.after_issue.pop(label, None)
        if hook is not None:
            loop.call_soon(hook)  # after this call's first turn, which sends it when its inputs are here
        return future

    def _context(self, label: str) -> CallContext:
        return CallContext(self.role, label, self.world_size, self.layouts,
                           stores=[h.info.store_endpoint for h in self.handles])

    def _inputs_ahead(self, spec: MethodSpec, args: tuple, kwargs: dict) -> tuple[CallOutput, ...] | None:
        """The calls a LOCAL_ROWS call may take its inputs from before they end: its batch
        arguments are all futures of ordered calls on these processes, among them the last one
        issued (so it still runs after every call before it); None otherwise."""
        if not PIPELINE or not spec.blocking or spec.protocol != LOCAL_ROWS:
            return None
        values = [*args, *kwargs.values()]
        futures = [v for v in values if isinstance(v, DataFuture)]
        if (not futures or all(f.done() for f in futures) or any(f.source is None for f in futures)
                or any(tree_leaves(v, (DataFuture, DistBatch, Batch)) for v in values if not isinstance(v, DataFuture))):
            return None
        sources = tuple(c for f in futures for c in f.source)
        if any(c.procs is not self.procs for c in sources) or self.procs.tail_seq not in {c.seq for c in sources}:
            return None
        return sources

    async def _run_ahead(self, label: str, entry: str, head: list | Callable[[dict], list], args: tuple,
                         kwargs: dict, protocol: Any, out: CallOutput) -> Any:
        """Send the call now, every rank taking its own outputs of the calls it reads (`Promised`);
        once the replies are in, plan it as the ordered path would, to collect."""
        def promised(v: Any) -> Any:
            return Promised(tuple(c.seq for c in v.source)) if isinstance(v, DataFuture) else v
        a, k = tuple(promised(v) for v in args), {n: promised(v) for n, v in kwargs.items()}
        plan = {r: (a, k) for r in range(self.world_size)}
        with trace.span(f"{self.role}.{label}", "call", ahead=True):
            outputs = await self._fan_out(label, entry, head(plan) if callable(head) else head, plan, out, True)
            ctx = self._context(label)
            real_a, real_k = await resolve_futures((list(args), kwargs))  # their replies came first
            real = protocol.distribute(ctx, tuple(real_a), real_k)
            for r, (ra, rk) in real.items():
                want = next((len(v) for v in [*ra, *rk.values()] if isinstance(v, (DistBatch, Batch))), None)
                got = outputs[r]
                if want is not None and isinstance(got, (DistBatch, Batch)) and len(got) != want:
                    raise PipelineError(f"{self.role}.{label} was sent ahead: rank {r} returned {len(got)} rows "
                                        f"where its part of the inputs has {want}")
            return protocol.collect(ctx, outputs)

    def _turn(self, task: asyncio.Task, label: str) -> asyncio.Future:
        """A future done once `task` has ended and no rank still runs a failed call."""
        turn = task.get_loop().create_future()

        def ended(_: asyncio.Task) -> None:
            if self.procs.unsettled:
                self.procs.settling = task.get_loop().create_task(self._settle(turn, label),
                                                                  name=f"{self.role}.{label}:turn")
            elif not turn.done():
                turn.set_result(None)

        task.add_done_callback(ended)
        return turn

    async def _settle(self, turn: asyncio.Future, label: str) -> None:
        waited = 0.0
        while self.procs.unsettled:
            pending, self.procs.unsettled = self.procs.unsettled, []
            _, still = await asyncio.wait(pending, timeout=30)
            if still:
                waited += 30
                log.warning("calls on pool %s wait: %d rank(s) are still running the failed call %s.%s "
                            "after %.0fs (blocked in a collective? restart the job if this persists)",
                            self.procs.pool.name, len(still), self.role, label, waited)
                self.procs.unsettled.extend(still)
        if not turn.done():
            turn.set_result(None)

    async def _fan_out(self, label: str, entry: str, head: list, plan: dict[int, tuple[tuple, dict]],
                       out: CallOutput | None = None, local: bool = False, after: int | None = None) -> dict[int, Any]:
        """Send every rank its request without waiting (a ONE_TO_ALL call's arguments encoded once
        for all; `out.sent` set to `local` once they are out; `after`: the call each rank ends
        first), then gather the replies as they come: with no future per rank while every rank
        is reachable (`Gather`), else with a future per rank, the unreachable ones checked first."""
        timeout = self.procs.call_timeout_s or None
        shared = len({(id(a), id(k)) for a, k in plan.values()}) == 1  # the same arguments for every rank
        numbered = {} if out is None else {"seq": out.seq}
        if after is not None:
            numbered["after"] = after
        requests: dict[int, tuple[int, list]] = {}
        request = None
        for r, (a, k) in plan.items():  # every request encoded before any is sent
            if request is None or not shared:
                request = encode_request("call_instance", [self.role, entry, [*head, list(a), k], numbered])
            requests[r] = request
        try:
            return await self._send_and_gather(label, requests, timeout, out, local)
        finally:
            if out is not None and not out.sent.done():
                out.sent.set_result(False)

    async def _send_and_gather(self, label: str, requests: dict[int, tuple[int, list]], timeout: float | None,
                               out: CallOutput | None, local: bool) -> dict[int, Any]:
        handles = [self.handles[r] for r in requests]
        deadlines = {h.deadline(timeout) for h in handles}
        if len(deadlines) == 1 and not any(h.info.state is WorkerState.DEAD or h.client.connection_dropped
                                           for h in handles):
            gather = Gather(self.handles, requests, deadlines.pop())
            if out is not None:
                out.sent.set_result(local)
            try:
                await gather.all_in_or_failed
            except asyncio.CancelledError:
                gather.cancel()
                raise
            if gather.futures is None:  # every rank answered
                return {r: self._received(r, gather.replies[r]) for r in requests}
            return await self._settle_failures(label, gather.futures, set(), timeout)
        return await self._fan_out_checked(label, requests, timeout, out, local)

    async def _fan_out_checked(self, label: str, requests: dict[int, tuple[int, list]], timeout: float | None,
                               out: CallOutput | None = None, local: bool = False) -> dict[int, Any]:
        """`_fan_out` with a future per rank, a dead or disconnected rank's worker checked first."""
        calls: dict[int, asyncio.Future] = {}
        checked: set[int] = set()  # ranks sent through WorkerHandle.call_encoded (errors already explained)
        replies = Replies(len(requests))
        for r, request in requests.items():
            handle = self.handles[r]
            try:
                fut = None if handle.info.state is WorkerState.DEAD else handle.start(*request, "call_instance", timeout)
            except Exception as e:  # noqa: BLE001 - a closed or unauthenticated client: this rank's failure
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(e)
            if fut is None:
                checked.add(r)
                fut = asyncio.ensure_future(handle.call_encoded(*request, "call_instance", timeout))
                handle = None  # call_encoded notes its refs
            # its refs noted as the reply arrives, also when another rank fails the call
            fut.add_done_callback(functools.partial(replies.arrived, handle))
            calls[r] = fut
        if out is not None:
            out.sent.set_result(local)
        try:
            await replies.all_in_or_failed
        except asyncio.CancelledError:
            for f in calls.values():
                f.cancel()
            raise
        return await self._settle_failures(label, calls, checked, timeout)

    async def _settle_failures(self, label: str, calls: dict[int, asyncio.Future], checked: set[int],
                               timeout: float | None) -> dict[int, Any]:
        """Every rank's output once all answered; else the root cause of the failure raised, the
        ranks still running left for the pool's next call to wait for."""
        failed = await self._failures(label, calls, checked, timeout)
        if failed and not any(isinstance(e, WorkerDiedError) for e in failed.values()):
            # a rank's death often reaches us second, as its peers' errors (a collective's
            # connection closed, an object it owned lost): ask the nodes whether a rank of this
            # pool died, so the error names the root cause
            lost_peer = any(_LOST_PEER.search(str(e)) for e in failed.values())
            await self._find_dead(DEATH_NOTICE_S if lost_peer else 0.0)
            dead = [f for r, f in calls.items() if not f.done() and self.handles[r].info.state is WorkerState.DEAD]
            if dead:
                await asyncio.wait(dead, timeout=1.0)  # their calls fail at once: let them
            failed = await self._failures(label, calls, checked, timeout)
        if failed:
            # raise at once; the other ranks finish (or fail) in the background and the pool's
            # next ordered call waits for them, so collectives never overlap two calls
            for f in calls.values():  # also those that ended while an error was being explained
                f.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
            self.procs.unsettled.extend(f for f in calls.values() if not f.done())
            raise self._root_cause(label, failed, calls)
        return {r: self._received(r, f.result()) for r, f in calls.items()}

    async def _failures(self, label: str, calls: dict[int, asyncio.Future], checked: set[int],
                        timeout: float | None) -> dict[int, BaseException]:
        """The ranks' errors so far, as the caller sees them (a death explained, a worker's own
        exception named by rank)."""
        failed = {r: f.exception() for r, f in calls.items()
                  if f.done() and not f.cancelled() and f.exception() is not None}

        async def explained(r: int, e: BaseException) -> BaseException:
            if r not in checked:
                e = await self.handles[r].failure(e, "call_instance", timeout)
            if isinstance(e, RemoteError):
                e = WorkerCallError(self.role, label, r, e, self.procs.collective_timeout_s)
            return e

        return dict(zip(failed, await asyncio.gather(*(explained(r, e) for r, e in failed.items())), strict=True))

    def _received(self, rank: int, reply: list) -> Any:
        """A rank's reply [output, layouts update, warnings] taken in: warnings relayed, layouts
        updated, outputs tracked (its refs were noted on arrival)."""
        out, layouts, *rest = reply
        for warning in (rest[0] if rest else []):
            relay_warning(self.role, rank, warning)
        if layouts is not None:
            self._update_layouts(rank, layouts)
        if self.tracker is not None:
            out = tree_map(self.tracker.track, out, DistBatch)
        return out

    async def _find_dead(self, patience_s: float) -> None:
        """Ask the pool's node daemons whether its ranks still run (marking the dead ones), again
        every 0.2 s for `patience_s` while all of them do."""
        coordinator = self.handles[0].coordinator
        infos = [h.info for h in self.handles]
        deadline = time.monotonic() + patience_s
        while True:
            if any(i.state is WorkerState.DEAD for i in infos) or await coordinator.check_workers(infos):
                return
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.2)

    def _root_cause(self, label: str, failed: dict[int, BaseException],
                    tasks: dict[int, asyncio.Future]) -> BaseException:
        """A dead rank first (the others' errors followed from it), then a deadline, then the
        first rank's own error."""
        died = {r: e for r, e in failed.items() if isinstance(e, WorkerDiedError)}
        if not died:  # a rank outside this call (the owner of an object it needed) died
            died = {h.rank: h.death_error() for h in self.handles if h.info.state is WorkerState.DEAD}
        if died:
            rank = min(died)
            err = died[rank]
            others = [e.summary() if isinstance(e, WorkerCallError) else f"rank {r}: {type(e).__name__}: {e}"
                      for r, e in sorted(failed.items()) if r != rank and not isinstance(e, WorkerDiedError)]
            if others:
                return WorkerDiedError(err.worker_id, err.node_id, err.rank, err.reason, err.log_tail,
                                       consequences=others, call=f"{self.role}.{label}")
            return err
        late = sorted(r for r, e in failed.items() if isinstance(e, RpcTimeout))
        if late:
            running = sorted(r for r, t in tasks.items() if not t.done())
            finished = sorted(r for r, t in tasks.items() if t.done() and r not in failed)
            return CallTimeoutError(f"{self.role}.{label}", sorted({*late, *running}),
                                    self.procs.call_timeout_s, finished)
        return failed[min(failed)]

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}: {self.cls.__qualname__} x {self.world_size})"


def importable_path(obj: Any) -> str:
    """`module:qualname` of a module-level class or function, as worker processes import it."""
    module = obj.__module__
    if module == "__main__":  # run as `python -m pkg.mod`: workers import it as pkg.mod
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    if module == "__main__" or "<locals>" in obj.__qualname__:
        raise ValueError(f"{obj.__qualname__} must be defined at module level in an importable "
                         "module (not a script's __main__) so worker processes can import it")
    return f"{module}:{obj.__qualname__}"


def _plain(value: Any) -> Any:
    """OmegaConf configs become plain dicts/lists so they can travel to workers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


async def create_groups(procs: ProcessSet, classes: dict[str, tuple[type, tuple, dict]],
                        tracker: RefTracker | None = None) -> dict[str, WorkerGroup]:
    """Instantiate each class on every rank of `procs` (colocated) and wrap them as groups whose
    returned DistBatches `tracker` tracks."""
    groups = {}
    for role, (cls, args, kwargs) in classes.items():
        path = importable_path(cls)
        a = [_plain(v) for v in args]
        k = {n: _plain(v) for n, v in kwargs.items()}
        t0 = time.monotonic()
        group = WorkerGroup(role, cls, procs, tracker)
        group.created_with = (path, a, k)  # what a rank's replacement is built from (JobContext.replace_rank)
        await instantiate(group, procs.handles)
        log.info("%s: %s on %d ranks of pool %s (%.1fs)", role, cls.__qualname__, procs.world_size,
                 procs.pool.name, time.monotonic() - t0)
        groups[role] = group
    return groups


async def instantiate(group: WorkerGroup, handles: list[WorkerHandle]) -> None:
    """Build `group`'s class (`group.created_with`) in each of `handles`' processes and take in
    the layouts each registered."""
    path, a, k = group.created_with
    try:
        await asyncio.gather(*(h.call("create_instance", group.role, path, a, k) for h in handles))
    except RemoteError as e:
        raise DaemonError(f"constructing {group.cls.__qualname__} for role {group.role!r} failed: "
                          f"{e.remote_type}: {e.remote_message}\n{e.remote_traceback}") from None
    layouts = await asyncio.gather(*(h.call("call_instance", group.role, "asyncrl_layouts", [], {}) for h in handles))
    for h, wire in zip(handles, layouts, strict=True):
        group._update_layouts(h.rank, wire)


def spec_of(value: Any) -> tuple[type, tuple, dict]:
    """Accept `Cls`, `(Cls, arg, ...)` or `(Cls, args_tuple, kwargs_dict)` for a role."""
    if inspect.isclass(value):
        return value, (), {}
    if isinstance(value, tuple) and value and inspect.isclass(value[0]):
        if len(value) == 3 and isinstance(value[1], tuple) and isinstance(value[2], dict):
            return value[0], value[1], value[2]
        return value[0], tuple(value[1:]), {}
    raise TypeError(f"a role must be a Worker class or (class, *args); got {value!r}")


async def gather(*futures: DataFuture | Awaitable) -> list[Any]:
    """Await several calls at once."""
    return list(await asyncio.gather(*futures))


__all__ = ["CallOutput", "DataFuture", "ProcessSet", "WorkerCallError", "WorkerGroup",
           "create_groups", "gather", "instantiate", "resolve_futures", "union_all"]
