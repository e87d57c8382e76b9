"""`Worker`: the base class of a model's distributed workers, and `@register` for its methods.

A Worker subclass is instantiated once per rank inside worker processes (several classes may
share a process: actor, rollout and reference colocated on one device). Its `@register`ed
methods are what the driver calls through a `WorkerGroup`; the protocol says how a call's
arguments are split over ranks and how outputs are combined.

Inside a rank, a `DistBatch` argument arrives as refs and is pulled (only this rank's rows,
straight from their owners) into a `Batch` before the method runs; a `Batch` the method returns
is put in this process's object store and travels back as a `DistBatch` of refs.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncrl.batch import Batch
from asyncrl.dist import DistBatch, local_store, materialize, publish
from asyncrl.mesh import DEFAULT_ORDER, Mesh
from asyncrl.protocols import ONE_TO_ALL, get_protocol

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
    """Expose a Worker method to the driver with a transfer protocol (see asyncrl.protocols).

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
    return {n: s for n in dir(cls) if not n.startswith("_") and (s := method_spec(cls, n)) is not None}


class Worker:
    """Base class for distributed workers: rank, world size, device and parallel meshes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            from daemons.worker import current

            rt = current()
            self.rank, self.world_size, self.local_rank = rt.rank, rt.world_size, rt.local_rank
            self.device, self.node_id = rt.device, rt.node_id
        except RuntimeError:  # constructed outside a worker process (unit tests, notebooks)
            self.rank = int(os.environ.get("RANK", "0"))
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.device, self.node_id = os.environ.get("ASYNCRL_DEVICE", "cpu"), ""
        self.meshes: dict[str, Mesh] = {"train": Mesh.from_rank(self.rank, dp=self.world_size)}
        self._mesh_version, self._mesh_reported = 1, 0

    # meshes -------------------------------------------------------------------------------------
    def register_mesh(self, name: str = "train", *, coords: dict[str, int] | None = None,
                      order: tuple[str, ...] = DEFAULT_ORDER, **sizes: int) -> Mesh:
        """Declare this rank's place in a parallel mesh, e.g. `register_mesh(dp=2, tp=2)`.

        Sizes must multiply to the world size; coordinates follow `order` (outer first, tensor
        parallel innermost) unless given explicitly. Protocols read the "train" mesh
        (3D_PROTO, 3D_PP_ONLY) and the "rollout" mesh (3D_ALL_MICRO_DP: dims dp, micro_dp, tp).
        """
        total = 1
        for s in sizes.values():
            total *= s
        if total != self.world_size:
            raise ValueError(f"mesh {name!r} sizes {sizes} cover {total} ranks; this group has "
                             f"{self.world_size}")
        mesh = (Mesh(name, dict(sizes), dict(coords)) if coords is not None
                else Mesh.from_rank(self.rank, name, order, **sizes))
        self.meshes[name] = mesh
        self._mesh_version += 1
        return mesh

    @property
    def mesh(self) -> Mesh:
        return self.meshes["train"]

    # the framework's entry points (called by WorkerGroup, not by users) ---------------------------
    async def asyncrl_call(self, method: str, args: list, kwargs: dict) -> list[Any]:
        """Run registered `method` with pulled arguments; returns [output, mesh update or None]."""
        fn = getattr(self, method, None)
        spec = getattr(fn, REGISTER_ATTR, None)
        if fn is None or spec is None:
            known = sorted(registered_methods(type(self)))
            raise AttributeError(f"{type(self).__qualname__} has no registered method {method!r}; "
                                 f"registered: {known} (decorate it with @register)")
        return await self._run(fn, spec.materialize, args, kwargs)

    async def asyncrl_apply(self, fn_path: str, args: list, kwargs: dict) -> list[Any]:
        """Run the importable function `fn_path` here, on this rank's pulled data."""
        from daemons.worker import resolve

        return await self._run(resolve(fn_path), True, args, kwargs)

    def asyncrl_meshes(self) -> dict[str, Any]:
        self._mesh_reported = self._mesh_version
        return {n: m.to_wire() for n, m in self.meshes.items()}

    async def _run(self, fn: Callable, pull: bool, args: list, kwargs: dict) -> list[Any]:
        if pull:
            args, kwargs = await _materialize_all(args, kwargs)
        if inspect.iscoroutinefunction(fn):
            out = await fn(*args, **kwargs)
        else:
            out = await asyncio.to_thread(fn, *args, **kwargs)
        out = _publish_all(out)
        mesh = self.asyncrl_meshes() if self._mesh_reported != self._mesh_version else None
        return [out, mesh]


async def _materialize_all(args: list, kwargs: dict) -> tuple[list, dict]:
    store = local_store()
    todo = [v for v in [*args, *kwargs.values()] if isinstance(v, DistBatch)]
    pulled = dict(zip(map(id, todo), await asyncio.gather(*(materialize(d, store) for d in todo)), strict=True))
    return ([pulled.get(id(a), a) for a in args], {k: pulled.get(id(v), v) for k, v in kwargs.items()})


def _publish_all(out: Any) -> Any:
    if isinstance(out, Batch):
        return publish(out, local_store())
    if isinstance(out, tuple | list) and any(isinstance(o, Batch) for o in out):
        return type(out)(_publish_all(o) for o in out)
    if isinstance(out, dict) and any(isinstance(o, Batch) for o in out.values()):
        return {k: _publish_all(o) for k, o in out.items()}
    return out
