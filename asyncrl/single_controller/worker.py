"""`Worker`: the base class of a model's distributed workers, and `@register` for its methods.

A Worker subclass is instantiated once per rank inside worker processes (several classes may
share a process: actor, rollout and reference colocated on one device). Its `@register`ed
methods are what the driver calls through a `WorkerGroup`; the protocol says how a call's
arguments are split over ranks and how outputs are combined.

A Worker gets its process's `WorkerRuntime` (rank, device, object store) as a value: the worker
process builds it with `Worker.create_hosted(runtime, *args, **kwargs)`, which binds the
runtime before the subclass's `__init__` runs, so `super().__init__()` takes no arguments.

Inside a rank, a `DistBatch` argument arrives as refs and is pulled (only this rank's rows,
straight from their owners) through `self.store` into a `Batch` on the worker's device (a GPU
worker's rows move there once, in `Worker._run`) before the method runs; a
`Batch` the method returns is published into `self.store` and travels back as a `DistBatch`.

Each worker declares its parallel layouts (`register_mesh(layout)`); a changed layout rides
back to the driver on the next call's result, so driver-side protocols see the current one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from asyncrl.single_controller.memory import process_memory
from asyncrl.single_controller.parallel import TRAIN, LayoutError, ParallelLayout, pure_dp
from asyncrl.single_controller.peers import Peers
from asyncrl.single_controller.pipeline import CallOutputs, PipelineError, Promised
from asyncrl.single_controller.protocols import ONE_TO_ALL, get_protocol
from asyncrl.single_controller.transfer import materialize_all, publish_all, to_device
from asyncrl.single_controller.tree import tree_leaves
from daemons.worker import WorkerRuntime, takes, wants_runtime
from objectstore import ObjectStore
from transport import trace


class WarningRelay(logging.Handler):
    """Warnings logged in a worker process, each distinct one once, held until the next call's
    reply carries them to the driver (which prints them on the job's console): a reward
    function's "no rule for data_source" would otherwise sit in a worker log file."""

    MAX_DISTINCT = 1000  # messages remembered (a warning seen before is not sent again)
    MAX_PENDING = 50  # per reply

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[tuple[str, str]] = set()
        self.pending: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format is not this handler's to raise
            return
        key = (record.name, message[:300])
        if key in self.seen or len(self.seen) >= self.MAX_DISTINCT:
            return
        self.seen.add(key)
        if len(self.pending) < self.MAX_PENDING:
            self.pending.append(f"{record.levelname} {record.name}: {message[:2000]}")

    def drain(self) -> list[str]:
        out, self.pending = self.pending, []
        return out


_relay: WarningRelay | None = None


def warning_relay() -> WarningRelay:
    """This process's relay, installed on the root logger the first time it is asked for."""
    global _relay
    if _relay is None:
        _relay = WarningRelay()
        logging.getLogger().addHandler(_relay)
    return _relay

# per method, the bytes this process pulled: [from its own store, from other stores]
PULLED: dict[str, list[int]] = {}


F = TypeVar("F", bound=Callable[..., Any])
REGISTER_ATTR = "__asyncrl_register__"


@dataclass(frozen=True)
class MethodSpec:
    """How a registered method is called: its protocol, and whether it takes its turn in the
    pool's call order (`blocking=True`) or may overlap other calls (`blocking=False`)."""

    protocol: str
    blocking: bool = True
    materialize: bool = True


def register(protocol: str = ONE_TO_ALL, blocking: bool = True, materialize: bool = True) -> Callable[[F], F]:
    """Expose a Worker method to the driver with a transfer protocol (see asyncrl.single_controller.protocols).

    `materialize=False` hands DistBatch arguments to the method as refs instead of pulling them.
    """
    get_protocol(protocol)  # fail at class definition on a misspelt protocol

    def decorate(fn: F) -> F:
        setattr(fn, REGISTER_ATTR, MethodSpec(protocol, blocking, materialize))
        return fn
    return decorate


def method_spec(cls: type, name: str) -> MethodSpec | None:
    return getattr(getattr(cls, name, None), REGISTER_ATTR, None)


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """The methods the driver may call on a group of `cls`: its own registered ones and those of
    the parts it holds (`Worker.parts`)."""
    out = {n: s for n in dir(cls) if not n.startswith("_") and (s := method_spec(cls, n)) is not None}
    for attr, part in getattr(cls, "parts", {}).items():
        for name, spec in registered_methods(part).items():
            if name in out:
                raise TypeError(f"{cls.__qualname__}: {name!r} is registered twice (by the worker or another "
                                f"part, and by its part {attr!r}, a {part.__qualname__}); rename one")
            out[name] = spec
    return out


def registered_method(worker: Any, name: str) -> Callable | None:
    """The bound registered method `name` of `worker` or of one of its parts; None if neither has it."""
    if name.startswith("_"):
        return None
    if method_spec(type(worker), name) is not None:
        return getattr(worker, name)
    for attr, part in type(worker).parts.items() if isinstance(worker, Worker) else ():
        if method_spec(part, name) is not None:
            return getattr(getattr(worker, attr), name)
    return None


class Worker:
    """Base class for distributed workers: rank, world size, device, store and parallel layouts.

    `runtime` is None when a Worker is constructed outside a worker process (unit tests,
    notebooks): rank and world size then come from the environment and there is no store.
    """

    runtime: WorkerRuntime | None = None
    # objects a worker holds whose registered methods are the worker's, by attribute:
    # e.g. {"pool": PoolWeights} (the driver calls them on the group like the worker's own)
    parts: ClassVar[dict[str, type]] = {}

    @classmethod
    def create_hosted(cls, runtime: WorkerRuntime, *args: Any, **kwargs: Any) -> Worker:
        """Build this class inside a worker process, bound to that process's `runtime`."""
        self = cls.__new__(cls)
        self.runtime = runtime
        self.__init__(*args, **kwargs)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        rt = self.runtime
        if rt is not None:
            self.rank, self.world_size, self.local_rank = rt.rank, rt.world_size, rt.local_rank
            self.device, self.node_id = rt.device, rt.node_id
        else:
            self.rank = int(os.environ.get("RANK", "0"))
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.device, self.node_id = os.environ.get("ASYNCRL_DEVICE", "cpu"), ""
        self.layouts: dict[str, ParallelLayout] = {TRAIN: pure_dp(self.world_size)}
        self._layout_version, self._layout_reported = 1, 0
        if rt is not None:  # a hosted worker: its warnings go back with its replies
            warning_relay()

    @property
    def store(self) -> ObjectStore:
        """This process's object store: where pulled rows arrive and returned Batches go."""
        if self.runtime is None:
            raise RuntimeError(f"{type(self).__qualname__} runs outside a worker process and has no "
                               "object store; build it with Worker.create_hosted(runtime, ...)")
        return self.runtime.store

    # layouts ------------------------------------------------------------------------------------
    def register_mesh(self, layout: ParallelLayout) -> ParallelLayout:
        """Declare this group's parallel layout (under `layout.name`: "train" for 3D_PROTO and
        3D_PP_ONLY, "rollout" for 3D_ALL_MICRO_DP). Every rank registers the same value."""
        if layout.world_size != self.world_size:
            raise LayoutError(f"layout {layout.name!r} ({layout.describe()}) covers "
                              f"{layout.world_size} ranks; this group has {self.world_size}")
        self.layouts[layout.name] = layout
        self._layout_version += 1
        return layout

    @property
    def layout(self) -> ParallelLayout:
        """The "train" layout."""
        return self.layouts[TRAIN]

    def coords(self, name: str = TRAIN) -> dict[str, int]:
        """This rank's coordinates in layout `name`."""
        return self.layouts[name].coords(self.rank)

    # every worker's own methods ------------------------------------------------------------------
    @register(ONE_TO_ALL)
    def memory_stats(self) -> dict:
        """This worker process's memory in bytes: resident now (`rss`), its peak so far
        (`peak_rss`), on a GPU torch's peak allocation (`cuda_peak_allocated`), and the peaks of
        the phases its methods recorded (`phases`; see `asyncrl.single_controller.memory`)."""
        return process_memory(self.device)

    @register(ONE_TO_ALL)
    def pulled_bytes(self) -> dict[str, list[int]]:
        """Bytes this process has pulled for each method (an apply call: its function's module)
        since it started, as [from its own store, from other stores]."""
        return {k: list(v) for k, v in PULLED.items()}

    # the framework's entry points (called by WorkerGroup, not by users) ---------------------------
    async def asyncrl_call(self, method: str, args: list, kwargs: dict, seq: int | None = None,
                           after: int | None = None) -> list[Any]:
        """Run registered `method` with pulled arguments; returns [output, layouts update or None,
        the warnings this process logged since the last reply]. `seq`: the call's number on its
        processes (an ordered call), under which its output is kept for calls sent ahead;
        `after`: the call it was sent behind, which must end here first."""
        fn = registered_method(self, method)
        spec = getattr(fn, REGISTER_ATTR, None)
        if fn is None or spec is None:
            known = sorted(registered_methods(type(self)))
            self._not_run(seq, AttributeError(method))
            raise AttributeError(f"{type(self).__qualname__} has no registered method {method!r}; "
                                 f"registered: {known} (decorate it with @register)")
        return await self._run(fn, spec.materialize, args, kwargs, label=method, seq=seq, after=after)

    async def asyncrl_apply(self, fn_path: str, ranks: list[int], args: list, kwargs: dict,
                            seq: int | None = None, after: int | None = None) -> list[Any]:
        """Run the importable function `fn_path` here, on this rank's pulled data (a `runtime`
        parameter gets this process's runtime, a `peers` parameter the `Peers` of the ranks
        called)."""
        if self.runtime is None:
            raise RuntimeError("apply() runs inside a worker process; this Worker has no runtime")
        try:
            fn = self.runtime.resolve(fn_path)
        except BaseException as e:
            self._not_run(seq, e)
            raise
        if wants_runtime(fn):
            kwargs = {**kwargs, "runtime": self.runtime}
        if takes(fn, "peers"):
            kwargs = {**kwargs, "peers": Peers(ranks, self.rank, self.world_size)}
        label = fn_path.partition(":")[0].rpartition(".")[2]
        return await self._run(fn, True, args, kwargs, label=label, seq=seq, phase=True, after=after)

    def _not_run(self, seq: int | None, error: BaseException) -> None:
        """An ordered call refused before it ran: a call sent behind it must not wait for it."""
        if seq is not None and self.runtime is not None:
            outputs = self.runtime.state.setdefault("call_outputs", CallOutputs())
            outputs.begin(seq)
            outputs.ended(seq, error=error)

    def asyncrl_layouts(self) -> dict[str, Any]:
        self._layout_reported = self._layout_version
        return {n: m.to_wire() for n, m in self.layouts.items()}

    async def _run(self, fn: Callable, pull: bool, args: list, kwargs: dict, label: str = "",
                   seq: int | None = None, phase: bool = False, after: int | None = None) -> list[Any]:
        """`_run_pulled` once the call it was sent behind (`after`) ended here and the inputs
        promised by earlier calls are here; `phase`: the output's meta gets its time as a phase
        of the step (`timing/<label>_s`, e.g. the advantage)."""
        promised = tree_leaves((args, kwargs), Promised)  # inputs of calls sent before they ended
        outputs = (self.runtime.state.setdefault("call_outputs", CallOutputs())
                   if self.runtime is not None and (seq is not None or promised or after is not None) else None)
        if after is not None:
            if outputs is None:
                raise PipelineError("a call sent behind another reached a worker that runs outside a worker process")
            try:
                if pull and not promised:  # its rows come while the call before it runs
                    args, kwargs, pull = *await self._pull(args, kwargs, label), False
                await outputs.wait_ended(after)
            except BaseException as e:
                self._not_run(seq, e)
                raise
        if seq is not None and outputs is not None:
            outputs.begin(seq)
        try:
            if promised:
                if outputs is None:
                    raise PipelineError("a call sent ahead reached a worker that runs outside a worker process")
                args, kwargs = await outputs.resolve((args, kwargs), self.store.endpoint)
            t0 = time.perf_counter()
            reply = await self._run_pulled(fn, pull, args, kwargs, label)
            if phase and reply[0] is not None and hasattr(reply[0], "meta"):
                reply[0].meta[f"timing/{label}_s"] = time.perf_counter() - t0
        except BaseException as e:
            if seq is not None and outputs is not None:
                outputs.ended(seq, error=e)
            raise
        if seq is not None and outputs is not None:
            outputs.ended(seq, reply[0])
        return reply

    async def _pull(self, args: list, kwargs: dict, label: str) -> tuple[list, dict]:
        """The arguments with their refs' rows pulled, on this worker's device (the one place
        pulled rows move to it)."""
        tally = PULLED.setdefault(label, [0, 0])
        with trace.span("pull", "store") as s:
            before = sum(tally)
            args, kwargs = to_device(await materialize_all((args, kwargs), self.store, tally), self.device)
            s.note(bytes=sum(tally) - before)
        return args, kwargs

    async def _run_pulled(self, fn: Callable, pull: bool, args: list, kwargs: dict, label: str) -> list[Any]:
        if pull:
            args, kwargs = await self._pull(args, kwargs, label)
        if inspect.iscoroutinefunction(fn):
            out = await fn(*args, **kwargs)
        else:
            out = await asyncio.to_thread(_traced, label, fn, args, kwargs)
        with trace.span("publish", "store"):
            out = publish_all(out, self.store)  # returned Batches stay here; refs go back
        layouts = self.asyncrl_layouts() if self._layout_reported != self._layout_version else None
        return [out, layouts, warning_relay().drain() if _relay is not None else []]


def _traced(label: str, fn: Callable, args: list, kwargs: dict) -> Any:
    """`fn` run in the call's worker thread, as one span."""
    with trace.span(label, "method"):
        return fn(*args, **kwargs)
