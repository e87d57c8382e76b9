"""The actor worker's weights between pools (trainer.placement=split): the training pool
sends its weights (with LoRA: only the adapters) over bridge groups, each rank its own shards
where FSDP alone shards them (rank 0 the gathered whole otherwise); a rollout-only worker stages a
version beside a running generate and applies it before the next one, or between decode steps
(`rollout.interrupt_on_update`). `PoolWeights` is a part of
`asyncrl.roles.actor.ActorRolloutRefWorker` (`Worker.parts`): its registered methods are the
worker's, and it holds what it reads."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch

from asyncrl.rollout.base import OwnWeightsRollout, Rollout
from asyncrl.single_controller.batch import Batch
from asyncrl.single_controller.protocols import ONE_TO_ALL
from asyncrl.single_controller.worker import register
from asyncrl.train.common import full_tensor
from asyncrl.train.delta import DeltaMismatchError, apply, encode, frame, unframe
from asyncrl.train.engine import TrainEngine
from asyncrl.train.lora import merged_weight
from asyncrl.train.weight_sync import (
    Sending,
    TensorSpec,
    WeightBridge,
    WeightSyncError,
    bridge_host,
    bridge_plan,
    digest,
    full_tensors,
    local_pieces,
    piece_offsets,
    source_rows,
)

log = logging.getLogger(__name__)


def adapter_settings(cfg: Any, sync_specs: list[TensorSpec]) -> dict[str, Any]:
    """What vLLM needs besides the LoRA tensors: the rank, alpha and adapted leaf modules."""
    leaves = sorted({spec.name.rsplit(".", 2)[-2] for spec in sync_specs})  # sync_specs: the adapters
    return {"rank": cfg.actor.lora.rank, "alpha": cfg.actor.lora.alpha, "targets": leaves}


def whole_rows(specs: list[TensorSpec]) -> list[list[int]]:
    """The shard rows of one source that holds every tensor whole (a scalar counts as a row)."""
    return [[s.shape[0] if len(s.shape) else 1 for s in specs]]


def staging_copy(specs: list[TensorSpec], device: torch.device) -> list[torch.Tensor]:
    """Empty tensors for a version of `specs`: views of one flat buffer when they share a dtype
    (the whole copy can then be handed on as one object, `PoolWeights.share_weights`)."""
    if len({s.dtype for s in specs}) != 1:
        return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
    flat = torch.empty(sum(math.prod(s.shape) for s in specs), dtype=specs[0].dtype, device=device)
    return [t.view(s.shape) for s, t in zip(specs, flat.split([math.prod(s.shape) for s in specs]), strict=True)]


def _hold(held: list[torch.Tensor], i: int, piece: torch.Tensor) -> None:
    """Keep `piece` as `held[i]` (a host copy, reused from the version before when there is one)."""
    if i < len(held):
        held[i].copy_(piece)
    else:
        held.append(piece.detach().to("cpu", copy=True))


class PoolWeights:
    """What a sync between pools carries (`sync_specs`, in `sync_dtype`) and where each version
    is: the bridge groups, an overlapped push in flight, a rollout-only worker's staging copy and
    the version it generates with. Also the decode loop's `Weights` (asyncrl.rollout.continuous).

    `steps()` counts the actor's updates (the worker's); `pristine` holds, for LoRA on a
    rollout-only worker, the adapted weights' base values."""

    def __init__(self, cfg: Any, rank: int, device: torch.device, actor: TrainEngine | None,
                 rollout: Rollout | None, sync_dtype: torch.dtype, sync_specs: list[TensorSpec],
                 pristine: dict[str, torch.Tensor], steps: Callable[[], int]) -> None:
        self.cfg, self.rank, self.device, self.actor, self.rollout = cfg, rank, device, actor, rollout
        self.sync_dtype, self.sync_specs, self.pristine, self.steps = sync_dtype, sync_specs, pristine, steps
        self.interrupt = cfg.rollout.interrupt_on_update
        self.bridge: WeightBridge | None = None
        self._bridge_store: Any = None
        self._source_rows: list[list[int]] | None = None  # every training rank sends its own shards
        self._pushing: Sending | None = None  # an overlapped push's sends in flight
        self.weights_version = 0
        self._staged: list[torch.Tensor] | None = None
        self._staged_version: int | None = None
        # rollout.weight_sync=delta: a training rank's shards as last sent (host copies in the sync
        # dtype) and their version; a rollout rank's version of what `_staged` holds
        self._sent: tuple[int, list[torch.Tensor]] | None = None
        self._held_version: int | None = None
        self._weights_lock = threading.Lock()

    def policy_version(self) -> int:
        """The policy version generating now: the updates this worker's actor has made, or the
        version a rollout-only worker last applied."""
        return self.steps() if self.actor is not None else self.weights_version

    @property
    def version(self) -> int:
        return self.weights_version

    def pending(self) -> bool:
        """A staged version waits to be applied."""
        return self._staged_version is not None

    def apply(self) -> None:
        self.apply_staged()

    @register(ONE_TO_ALL)
    def weight_sync_digest(self) -> str:
        """A fingerprint of the tensors a sync carries (both pools must agree)."""
        return digest(self.sync_specs)

    def synced_weights(self) -> list[str]:
        """The rollout model's weights a sync sets (LoRA: the adapted ones, merged)."""
        if self.pristine:
            return [f"{m}.weight" for m in self.pristine]
        return [s.name for s in self.sync_specs]

    @register(ONE_TO_ALL)
    def bridge_listen(self, size: int) -> list | None:
        """Training rank 0: open the bridge's rendezvous; returns [host, port]."""
        if self.rank != 0:
            return None
        self._bridge_store = WeightBridge.listen(size, self.cfg.worker.collective_timeout_s)
        return [bridge_host(), self._bridge_store.port]

    @register(ONE_TO_ALL)
    def source_rows(self) -> list[int] | None:
        """Training pool: this rank's rows of each synced tensor when it can send its own shards
        (FSDP alone), else None (`asyncrl.train.weight_sync.source_rows`)."""
        return source_rows(self._sync_tensors())

    @register(ONE_TO_ALL)
    def bridge_join(self, host: str, port: int, rows: list[list[int]] | None, nodes: list[str],
                    train_nodes: list[str]) -> None:
        """Build the bridge groups: with `rows` (every training rank's shard rows) one group per
        training rank, each sending its shards; without, training rank 0's alone (the others take
        part in the gathers of `push_weights`). `nodes`/`train_nodes`: each rollout / training
        rank's node; a node's rollout ranks share one copy of each update (`bridge_plan`)."""
        timeout = self.cfg.worker.collective_timeout_s
        receivers, relays = bridge_plan(nodes, set(train_nodes))
        size, sources = 1 + len(receivers), len(rows) if rows else 1
        self._source_rows = rows
        if self.actor is not None:
            if self.rank == 0 or rows:
                store = self._bridge_store if self.rank == 0 else WeightBridge.connect(host, port, size, timeout)
                self.bridge = WeightBridge(store, 0, size, self.device, timeout, sources, source=self.rank)
            return
        store = WeightBridge.connect(host, port, size, timeout)
        rank = 1 + receivers.index(self.rank) if self.rank in receivers else None
        relay = relays.get(self.rank)
        self.bridge = WeightBridge(store, rank, size, self.device, timeout, sources, relay=relay)
        if relay is not None and relay.rank == 0:
            log.info("weight sync: rollout rank %d takes each update for the %d rollout ranks of node %s and "
                     "relays it to the others", self.rank, relay.size, nodes[self.rank])

    def _sync_tensors(self) -> list[torch.Tensor]:
        """The training weights a sync carries, as this rank holds them (sharded), in sync order."""
        if self.cfg.actor.lora.enabled:
            state = self.actor.model.state_dict()
            return [state[spec.name] for spec in self.sync_specs]
        return [p.data for _, p in self.actor.model.named_parameters()]

    @register(ONE_TO_ALL)
    def push_weights(self, bucket_mb: int, overlap: bool = False, delta: bool = False,
                     version: int | None = None) -> dict[str, float]:
        """Training pool: every rank broadcasts its own shards to the rollout pool (FSDP alone),
        or gathers each weight in full with rank 0 broadcasting it, bucketed; returns the version
        sent and the time taken. With `overlap` (own shards only) it returns once the sends are
        queued: they run beside this pool's next calls (the log-probs), and the next that changes
        the weights (an update, a load, the next push) waits for them first (`wait_pushed`), so
        the update's memory peak is the same as without. With `delta` each shard (in a gathering layout
        rank 0's each gathered tensor) goes as its difference from the version this rank sent
        last (`asyncrl.train.delta`; in full, compressed, when it has none; `version`: the number
        the receivers know it by)."""
        self.wait_pushed()
        t0, version = time.perf_counter(), self.steps() if version is None else version
        keep = self.cfg.rollout.weight_sync == "delta"  # what is sent is the next delta's base
        if delta:
            sent = self._push_deltas(version)
        elif self._source_rows and overlap and not keep:
            self._pushing = self.bridge.queue_pieces(local_pieces(self._sync_tensors(), self.sync_dtype))
            sent = self._pushing.nbytes
        elif self._source_rows:  # every rank sends its own shards: no gather
            pieces = list(local_pieces(self._sync_tensors(), self.sync_dtype))
            sent = self.bridge.send_pieces(pieces)
            if keep:
                self._keep_sent(pieces, version)
        elif self.bridge is not None:  # rank 0 of a gathering layout
            tensors = self._keeping(self._gathered(), version) if keep else self._gathered()
            sent = self.bridge.send(self.sync_specs, tensors, bucket_mb << 20)
            for _ in tensors:  # to its end: the last tensor kept too
                pass
        else:
            sent = self._join_gathers()
        return {"version": float(self.steps()), "timing/weight_sync_s": time.perf_counter() - t0,
                "bytes": float(sum(s.nbytes for s in self.sync_specs)), "sent_bytes": float(sent)}

    def _gathered(self) -> Iterator[torch.Tensor]:
        """Every synced tensor in full, in the rollout's dtype, one at a time (a collective over
        the training pool: every rank walks the list)."""
        full = self._adapter_tensors() if self.cfg.actor.lora.enabled else full_tensors(self.actor.model)
        return (t.to(self.sync_dtype) for t in full)

    def _join_gathers(self) -> int:
        """A training rank other than 0 of a gathering layout: its part in the gathers; sends nothing."""
        for _ in self._gathered():
            pass
        return 0

    def _push_deltas(self, version: int) -> int:
        """Send this rank's part of a version (its own shards; in a gathering layout rank 0 each
        gathered tensor) as deltas from the version it sent last; keep what it sent."""
        if not self._source_rows and self.bridge is None:
            return self._join_gathers()
        pieces = local_pieces(self._sync_tensors(), self.sync_dtype) if self._source_rows else self._gathered()
        base_version, held = self._sent or (None, [])
        self._sent, deltas = None, []  # no base until every piece is kept
        for i, p in enumerate(pieces):
            if p.numel():  # as the receiver counts (a scalar is one row)
                deltas.append(encode(self.sync_specs[i].name, p, held[i] if held else None, version, base_version))
            _hold(held, i, p)
        self._sent = (version, held)
        return self.bridge.send_deltas(deltas)

    def _keeping(self, pieces: Iterable[torch.Tensor], version: int) -> Iterator[torch.Tensor]:
        """`pieces` (this rank's part of a version, in sync order), each kept as it passes (host
        copies: the base of the next delta); the base is this version's once the last has passed,
        none before (a sync cut short is followed by a full one)."""
        held = self._sent[1] if self._sent is not None else []
        self._sent = None
        for i, p in enumerate(pieces):
            _hold(held, i, p)
            yield p
        self._sent = (version, held)

    def _keep_sent(self, pieces: list[torch.Tensor], version: int) -> None:
        """This version's pieces as sent: the base of the next delta."""
        for _ in self._keeping(pieces, version):
            pass

    def wait_pushed(self) -> None:
        """Before the training weights change: the sends of an overlapped push finished."""
        if self._pushing is not None:
            pushing, self._pushing = self._pushing, None
            pushing.wait()

    @register(ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int, bucket_mb: int, delta: bool = False) -> dict[str, float]:
        """Rollout pool, beside a running generate: receive a version into the staging copy; it
        is applied before the next generate (or decode step, with rollout.interrupt_on_update).
        With `delta`, each shard's difference is applied to the version the staging copy holds
        and checked against the sender's checksum: a `DeltaMismatchError` (after every delta was
        received) means the trainer syncs this version in full. Returns the bytes received."""
        specs = self.sync_specs
        with self._weights_lock:
            if self._staged is None:
                self._staged = staging_copy(specs, self.device)
            if delta:
                received = self._receive_deltas(version)
            elif self._source_rows:
                received = self.bridge.receive_pieces(specs, self._source_rows, self._staged)
            else:
                received = self.bridge.receive(specs, self._staged, bucket_mb << 20)
            self._staged_version = self._held_version = version
        return {"bytes": float(received)}

    def _receive_deltas(self, version: int) -> int:
        rows = self._source_rows or whole_rows(self.sync_specs)  # a gathering layout: rank 0 sends each whole
        per_source, received = self.bridge.receive_deltas(self.sync_specs, rows, version)
        self._apply_deltas(per_source, rows, version)
        return received

    def _apply_deltas(self, per_source: list[list[Any]], rows: list[list[int]], version: int) -> None:
        """Every source's deltas (for its non-empty shards, in order) applied to the staging copy
        at the version it holds; one `DeltaMismatchError` naming how many did not rebuild. The
        staged version is dropped first: a delta that fails leaves the copy half-built."""
        held, self._held_version, self._staged_version, wrong = self._held_version, None, None, []
        for r, starts, deltas in zip(rows, piece_offsets(self.sync_specs, rows), per_source, strict=True):
            for (t, n), d in zip([(t, n) for t, n in enumerate(r) if n], deltas, strict=True):
                whole = not len(self.sync_specs[t].shape)
                try:
                    apply(d, self._staged[t] if whole else self._staged[t].narrow(0, starts[t], n), held)
                except DeltaMismatchError as e:
                    wrong.append(str(e))
        if wrong:
            raise DeltaMismatchError(f"{len(wrong)} of the update's tensors did not rebuild here (first: {wrong[0]}); "
                                     f"version {version} has to come in full")

    @register(ONE_TO_ALL)
    def publish_weights(self) -> Batch:
        """Training pool (rollout.elastic): this version's weights in this rank's object store, for
        rollout workers to pull: its own shards (FSDP alone: `source_rows`), or on rank 0 every
        tensor in full (the other ranks join the gathers); one flat row in the rollout's dtype."""
        self.wait_pushed()
        pieces = self._published_pieces()
        flat = (torch.cat([p.reshape(-1) for p in pieces]) if pieces
                else torch.zeros(0, dtype=self.sync_dtype, device=self.device))
        return Batch({"weights": flat.unsqueeze(0)})

    @register(ONE_TO_ALL)
    def publish_deltas(self, version: int) -> Batch:
        """Training pool (rollout.elastic, rollout.weight_sync=delta): this rank's part of
        `publish_weights` as deltas from the version it published deltas for last (the first:
        compressed in full), framed (`asyncrl.train.delta.frame`) as one row of two columns."""
        pieces = self._published_pieces()
        base_version, base = self._sent or (None, [None] * len(pieces))
        deltas = [encode(spec.name, p, b, version, base_version)
                  for spec, p, b in zip(self.sync_specs, pieces, base, strict=False) if p.numel()]
        header, payload = frame(deltas)
        self._keep_sent(pieces, version)
        return Batch({"delta_header": header.reshape(1, -1), "delta_payload": payload.reshape(1, -1)})

    def _published_pieces(self) -> list[torch.Tensor]:
        """What this rank publishes: its own shards (FSDP alone), or on rank 0 every tensor in
        full (the other ranks join the gathers and publish nothing)."""
        tensors = self._sync_tensors()
        if source_rows(tensors) is not None:
            return list(local_pieces(tensors, self.sync_dtype))
        full = list(self._gathered())
        return full if self.rank == 0 else []

    @register(ONE_TO_ALL, blocking=False)
    def pull_weight_deltas(self, version: int, deltas: list[Batch], rows: list[list[int]] | None) -> float:
        """Rollout-only worker (rollout.elastic, rollout.weight_sync=delta): `version` as the
        training ranks' deltas (`publish_deltas`) applied to the staging copy, which must hold
        the version before; a `DeltaMismatchError` otherwise (the pool then pulls it in full).
        Returns the bytes it took."""
        specs = self.sync_specs
        if rows is None:
            rows, deltas = whole_rows(specs), deltas[:1]
        with self._weights_lock:
            if self._staged is None:
                raise DeltaMismatchError("this worker holds no version to apply deltas to; pull the full weights")
            shapes = [[(specs[t].name, specs[t].dtype, tuple(specs[t].shape) if not len(specs[t].shape)
                        else (n, *specs[t].shape[1:])) for t, n in enumerate(r) if n] for r in rows]
            per_source = [unframe(b["delta_header"][0].view(-1, 4), b["delta_payload"][0], pieces, version)
                          for b, pieces in zip(deltas, shapes, strict=True)]
            self._apply_deltas(per_source, rows, version)
            self._staged_version = self._held_version = version
        return float(sum(b["delta_header"].numel() * 8 + b["delta_payload"].numel() for b in deltas))

    @register(ONE_TO_ALL, blocking=False)
    def pull_weights(self, version: int, pieces: list[Batch], rows: list[list[int]] | None) -> float:
        """Rollout-only worker (rollout.elastic): `version`, pulled from the training ranks' stores
        (`publish_weights`; `rows`: each rank's shard rows, None for rank 0's whole tensors), into
        the staging copy; applied before the next generate. Returns the bytes it took."""
        specs = self.sync_specs
        with self._weights_lock:
            if self._staged is None:
                self._staged = staging_copy(specs, self.device)
            if rows is None:
                rows, pieces = whole_rows(specs), pieces[:1]
            for piece, r, starts in zip(pieces, rows, piece_offsets(specs, rows), strict=True):
                flat, at = piece["weights"][0], 0
                for t, n in enumerate(r):
                    if not n:
                        continue
                    inner = specs[t].shape[1:]
                    size = n * math.prod(inner)
                    view = self._staged[t].view(-1, *inner) if len(specs[t].shape) else self._staged[t].view(1)
                    view.narrow(0, starts[t], n).copy_(flat[at:at + size].view(n, *inner))
                    at += size
                if at != flat.numel():
                    raise WeightSyncError(f"a training rank published {flat.numel()} values, its shards hold {at}: "
                                          "both pools must hold the same model")
            self._staged_version = self._held_version = version
        return float(sum(p["weights"].numel() * p["weights"].element_size() for p in pieces))

    @register(ONE_TO_ALL, blocking=False)
    def share_weights(self, version: int) -> Batch:
        """Rollout-only worker (rollout.elastic): the staged `version` as one flat row, for the other
        workers on its node to pull through shared memory (`pull_weights` with rows=None) instead of
        each taking it from another node. No copy where the staging copy is one buffer."""
        with self._weights_lock:
            if self._held_version != version or self._staged is None:
                raise WeightSyncError(f"this worker holds version {self._held_version}, not {version}: "
                                      "it cannot hand that version on")
            base = self._staged[0]._base if self._staged and self._staged[0]._base is not None else None
            flat = (base if base is not None and base.numel() == sum(t.numel() for t in self._staged)
                    else torch.cat([t.reshape(-1) for t in self._staged]))
        return Batch({"weights": flat.unsqueeze(0)})

    def _adapter_tensors(self) -> Iterator[torch.Tensor]:
        """The actor's adapters in full, in `sync_specs` order (collectives over the training pool)."""
        state = self.actor.model.state_dict()
        for spec in self.sync_specs:
            t = state[spec.name]
            yield full_tensor(t)

    def apply_staged(self) -> None:
        """Load the staged version into the rollout engine (nothing when none is staged)."""
        with self._weights_lock:
            if self._staged_version is None:  # checked under the lock: two callers may race to apply one version
                return
            staged = [(spec.name, t) for spec, t in zip(self.sync_specs, self._staged, strict=True)]
            if self.cfg.actor.lora.enabled and self.rollout.lora_rank:  # vLLM serves the adapter
                cast(OwnWeightsRollout, self.rollout).load_adapter(self._staged_version, dict(staged),
                                                                   **adapter_settings(self.cfg, self.sync_specs))
                self.weights_version, self._staged_version = self._staged_version, None
                return
            if self.pristine:  # LoRA: W0 + (alpha / rank) B A from the untouched base, cast once
                scale = self.cfg.actor.lora.alpha / self.cfg.actor.lora.rank
                modules = [name.rsplit(".", 1)[0] for name, _ in staged[::2]]  # each module's lora_A, then B
                staged = [(f"{m}.weight", merged_weight(self.pristine[m], a, b, scale))
                          for m, (_, a), (_, b) in zip(modules, staged[::2], staged[1::2], strict=True)]
            self.rollout.load_weights(staged)
            self.weights_version, self._staged_version = self._staged_version, None

