"""An elastic rollout pool (`rollout.elastic`, split placement): rollout workers that come and go
while a job runs.

Each rollout worker is a group of its own (one process, one device), so no collective ties them
together. Weights reach them by pull: after each update the training ranks put the new version in
their object stores (`publish_weights`) and every rollout worker pulls it from there
(`pull_weights`), a worker that joins later included. A generation call splits its prompts over
the live workers; a worker that dies (killed, its node lost) is dropped and its share of prompts
is generated again on the others, so each prompt's samples come from exactly one finished call;
finished rows are copied to the training ranks at once (`hold_rows`), so they outlive their worker.
Workers join on free devices of nodes that register with the coordinator while the job runs
(`asyncrl-launch --join HEAD:PORT`; looked for every second); below `rollout.min_workers` live
workers a call waits for one to join.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.single_controller.distbatch import DistBatch
from asyncrl.single_controller.group import DataFuture, WorkerCallError
from daemons.errors import WorkerDiedError
from transport import TransportError

log = logging.getLogger(__name__)

# (name, per-node device counts or None for any free device) -> (a one-worker group, its node id)
WATCH_S = 1.0  # how often the pool looks for devices of nodes that joined
Spawn = Callable[[str, list[int] | None], Awaitable[tuple[Any, str]]]


@dataclass
class Member:
    name: str
    group: Any
    node_id: str
    joined_s: float  # when it was started (monotonic)
    late: bool  # joined while the job ran
    version: int = 0  # the weights version it holds
    first_generate_s: float | None = None  # seconds from its start to the end of its first generation


@dataclass
class ElasticStats:
    lost: int = 0
    joined: int = 0
    regenerated_rows: int = 0
    join_to_first_generate_s: list[float] = field(default_factory=list)


class ElasticRollout:
    """The rollout workers of an elastic pool, seen by the trainer as one group."""

    def __init__(self, ctx: Any, spawn: Spawn, hold: Callable[[DistBatch], Any], min_workers: int,
                 wait_s: float) -> None:
        self.ctx, self.spawn, self.min_workers, self.wait_s = ctx, spawn, min_workers, wait_s
        self.hold = hold  # copies generated rows into the training ranks' stores (they outlive their worker)
        self.members: dict[str, Member] = {}
        self.rows: list[list[int]] | None = None  # each training rank's shard rows (FSDP alone)
        self.published: tuple[int, list[DistBatch]] | None = None  # the newest version in the stores
        self.pulled_bytes = 0  # what the live workers took of the last version, all together
        self.full_pulls = 0  # how many of them took it in full (the others: deltas)
        self.relayed_bytes = 0  # what workers took of the last version from another worker on their node
        self.copies_per_node = 0  # the most workers of one node that pulled the last version from another node
        self._remote: Counter = Counter()  # per node, its workers that pulled the last version from another
        self.delta_fallbacks = 0  # deltas that did not rebuild on a worker, pulled again in full
        self.stats = ElasticStats()
        self.ledger: Ledger | None = None  # what each step trained (the trainer sets it)
        self.changed = asyncio.Event()  # a worker joined
        self._joining: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None
        self._count = 0

    # membership -------------------------------------------------------------------------------
    async def start(self, n: int) -> None:
        """The first `n` workers, then a watch for nodes that join (every WATCH_S)."""
        await asyncio.gather(*(self._add(None, late=False) for _ in range(n)))
        self.ctx.coordinator.elastic.add(self.ctx.job_id)  # `asyncrl-launch --join` is welcome now
        self._watch = asyncio.ensure_future(self._watch_nodes())

    async def _watch_nodes(self) -> None:
        while True:
            self.admit()
            await asyncio.sleep(WATCH_S)

    def _free_devices(self) -> list[tuple[int, str, int]]:
        """(position among live nodes, node id, free devices) of every node with a free device."""
        coord = self.ctx.coordinator
        taken = {p for pool in coord.pools.values() for p in pool.placements}
        out = []
        for i, node in enumerate(coord.live_nodes()):
            free = sum(1 for d in node.devices if (node.node_id, d) not in taken)
            if free:
                out.append((i, node.node_id, free))
        return out

    def admit(self) -> None:
        """Start a rollout worker on every free device of the live nodes (in the background)."""
        for position, node_id, free in self._free_devices():
            for _ in range(free - sum(1 for k in self._joining if k.startswith(node_id + "/"))):
                key = f"{node_id}/{self._count}"
                self._count += 1
                per_node = [0] * position + [1]
                self._joining[key] = asyncio.ensure_future(self._join(key, per_node))

    async def _join(self, key: str, per_node: list[int]) -> None:
        try:
            await self._add(per_node, late=True)
            self.stats.joined += 1
        except Exception as e:  # noqa: BLE001 - a node that cannot host a worker leaves the job as it is
            log.warning("elastic rollout: a worker on %s could not join: %s", key.split("/")[0], e)
        finally:
            self._joining.pop(key, None)

    async def _add(self, per_node: list[int] | None, late: bool) -> None:
        t0 = time.monotonic()
        name = f"rollout-{self._count}"
        self._count += 1
        group, node_id = await self.spawn(name, per_node)
        version = 0
        if self.published is not None:  # a late worker takes the current version first
            version, pieces = self.published
            await group.pull_weights(version, pieces, self.rows)
        self.members[name] = Member(name, group, node_id, t0, late, version)
        self.changed.set()
        log.info("elastic rollout: %s on %s is live (%d workers, weights version %d)", name, node_id,
                 len(self.members), version)

    def _drop(self, name: str, err: BaseException) -> None:
        if self.members.pop(name, None) is not None:
            self.stats.lost += 1
            log.warning("elastic rollout: %s left (%s); %d workers remain", name, str(err).splitlines()[0],
                        len(self.members))

    async def _live(self) -> list[Member]:
        """The live workers, waiting (up to the wait limit) while fewer than rollout.min_workers."""
        deadline = time.monotonic() + self.wait_s
        while True:
            self.changed.clear()
            self.admit()
            if len(self.members) >= max(1, self.min_workers):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"elastic rollout: {len(self.members)} rollout workers live, fewer than "
                                   f"rollout.min_workers={self.min_workers}, for {self.wait_s:.0f} s; join a node "
                                   "(`asyncrl-launch --join HEAD:PORT ...`) or lower rollout.min_workers")
            log.warning("elastic rollout: %d of rollout.min_workers=%d workers live; waiting for one to join",
                        len(self.members), self.min_workers)
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 5.0))
            except TimeoutError:
                pass
        return list(self.members.values())

    # the group's calls ----------------------------------------------------------------------------
    def generate_sequences(self, prompts: DistBatch) -> DataFuture:
        return DataFuture(asyncio.ensure_future(self._generate(prompts, "generate_sequences")),
                          "rollout.generate_sequences")

    def generate_stream(self, prompts: DistBatch) -> DataFuture:
        return DataFuture(asyncio.ensure_future(self._generate(prompts, "generate_stream")), "rollout.generate_stream")

    async def _generate(self, prompts: DistBatch, method: str) -> DistBatch:
        """`prompts` split in contiguous shares over the live workers; a share whose worker dies is
        generated again on another. The shares' results in prompt order."""
        pending = [(0, len(prompts))]
        done: dict[int, DistBatch] = {}
        while pending:
            members = await self._live()
            shares = _split(pending, len(members))
            pending = []
            calls = [(members[i % len(members)], lo, hi, getattr(members[i % len(members)].group, method)(
                prompts.slice(lo, hi))) for i, (lo, hi) in enumerate(shares)]
            for m, lo, hi, call in calls:
                try:
                    done[lo] = await self.hold(await call)
                    if m.first_generate_s is None:
                        m.first_generate_s = time.monotonic() - m.joined_s
                        if m.late:
                            self.stats.join_to_first_generate_s.append(m.first_generate_s)
                except (WorkerDiedError, TransportError, WorkerCallError) as e:
                    if isinstance(e, WorkerCallError) and not e.remote_type.endswith("ObjectLostError"):
                        raise  # a fault of the call itself, not of a worker that left
                    self._drop(m.name, e)
                    self.stats.regenerated_rows += hi - lo
                    pending.append((lo, hi))
        parts = [done[lo] for lo in sorted(done)]
        timing = {k: max(float(p.meta.get(k, 0.0)) for p in parts) for p in parts for k in p.meta
                  if k.startswith("timing/")}
        return DistBatch.concat(parts).with_meta(**timing)

    async def sync(self, version: int, pieces: list[DistBatch], deltas: list[DistBatch] | None = None) -> None:
        """Every live worker takes `version` (a worker that dies meanwhile is dropped). One worker
        per node pulls it from the training ranks' stores: as `deltas` from the version before
        where it holds that one, else in full (a delta that does not rebuild there too, logged);
        the node's other workers then take that worker's copy through shared memory — one copy
        per node crosses the network (on a node that holds every piece, every worker pulls from
        there: that is shared memory already)."""
        self.published = (version, pieces)
        local = _local_nodes(pieces)
        first, relayed = _relays(list(self.members.values()), local)
        self.full_pulls, self.relayed_bytes, self._remote = 0, 0, Counter()
        pulled = await self._pull(first, version, pieces, deltas, self.rows, local)
        pulled += sum(await asyncio.gather(*(self._relay(leader, followers, version, pieces, deltas, local)
                                             for leader, followers in relayed)))
        self.pulled_bytes = int(pulled)
        self.copies_per_node = max(self._remote.values(), default=0)

    async def _relay(self, leader: Member, followers: list[Member], version: int, pieces: list[DistBatch],
                     deltas: list[DistBatch] | None, local: set[str]) -> float:
        """`followers` take `leader`'s copy of `version`; where that fails (the leader lost, its copy
        unreadable) they pull it themselves. Returns the bytes pulled across nodes."""
        if leader.name in self.members and leader.version == version:
            try:
                share = await leader.group.share_weights(version)  # a group of one: [its copy]
                self.relayed_bytes += int(await self._pull(followers, version, share, None, None, local, relayed=True))
                return 0.0
            except Exception as e:  # noqa: BLE001 - any failure of the relay: the followers pull for themselves
                log.warning("elastic rollout: %s could not hand version %d on (%s); its node's other workers "
                            "pull it themselves", leader.name, version, e)
                if isinstance(e, (WorkerDiedError, TransportError)):
                    self._drop(leader.name, e)
        behind = [m for m in followers if m.name in self.members and m.version != version]
        return await self._pull(behind, version, pieces, deltas, self.rows, local)

    async def _pull(self, members: list[Member], version: int, pieces: list[DistBatch],
                    deltas: list[DistBatch] | None, rows: list[list[int]] | None, local: set[str],
                    relayed: bool = False) -> float:
        """`members` pull `version` (deltas where they hold the version before; `rows`: each
        piece's shard rows, None for whole tensors; `local`: the nodes that hold every piece;
        `relayed`: from a worker on their node, not counted as pulled in full); the bytes they took."""
        by_delta = [deltas is not None and m.version == version - 1 for m in members]
        results = await asyncio.gather(*(m.group.pull_weight_deltas(version, deltas, rows) if d
                                         else m.group.pull_weights(version, pieces, rows)
                                         for m, d in zip(members, by_delta, strict=True)), return_exceptions=True)
        pulled = 0.0
        for m, d, r in zip(members, by_delta, results, strict=True):
            if d and isinstance(r, WorkerCallError) and r.remote_type.endswith("DeltaMismatchError"):
                self.delta_fallbacks += 1
                log.warning("elastic rollout: %s: %s; pulling version %d in full", m.name, r.remote_message, version)
                d, r = False, (await asyncio.gather(m.group.pull_weights(version, pieces, rows),
                                                    return_exceptions=True))[0]
            if isinstance(r, (WorkerDiedError, TransportError)):
                self._drop(m.name, r)
            elif isinstance(r, BaseException):
                raise r
            else:
                pulled += sum(r)  # a group of one: [bytes]
                self.full_pulls += not (d or relayed)
                self._remote[m.node_id] += not relayed and m.node_id not in local
                m.version = version
        return pulled

    def metrics(self) -> dict[str, float]:
        return {"rollout/workers": float(len(self.members)), "rollout/workers_lost": float(self.stats.lost),
                "rollout/workers_joined": float(self.stats.joined),
                "rollout/regenerated_prompts": float(self.stats.regenerated_rows),
                "rollout/weights_pulled_in_full": float(self.full_pulls),  # the others took deltas
                "rollout/weight_copies_per_node": float(self.copies_per_node),  # from another node, most on one
                "rollout/weights_relayed_mb": self.relayed_bytes / 2**20}  # within nodes, worker to worker

    def close(self) -> None:
        for task in [*self._joining.values(), *([self._watch] if self._watch else [])]:
            task.cancel()



def _local_nodes(pieces: list[DistBatch]) -> set[str]:
    """The nodes whose stores hold every non-empty piece of a version (where every worker pulls
    it through shared memory): none when the pieces live on several nodes."""
    held = [{ref.node_id for ref in p.refs().values() if ref.nbytes} for p in pieces]
    held = [h for h in held if h]
    return set.intersection(*held) if held else set()


def _relays(members: list[Member], sources: set[str]) -> tuple[list[Member], list[tuple[Member, list[Member]]]]:
    """Who pulls a version from the training ranks (every worker on a node that hosts them, one
    worker on each other node: one that holds the version before if any, so it can take deltas),
    and who takes it from that worker instead (the other workers on its node)."""
    by_node: dict[str, list[Member]] = {}
    for m in members:
        by_node.setdefault(m.node_id, []).append(m)
    first: list[Member] = []
    relayed: list[tuple[Member, list[Member]]] = []
    for node, here in by_node.items():
        if node in sources or len(here) == 1:
            first += here
            continue
        leader = max(here, key=lambda m: m.version)  # the newest version it holds: deltas, if any can
        first.append(leader)
        relayed.append((leader, [m for m in here if m is not leader]))
    return first, relayed


def _split(ranges: list[tuple[int, int]], parts: int) -> list[tuple[int, int]]:
    """`ranges` of rows cut into at most `parts` contiguous shares of near-equal size."""
    rows = [(lo, hi) for lo, hi in ranges if hi > lo]
    total = sum(hi - lo for lo, hi in rows)
    if not total:
        return []
    size = -(-total // parts)
    out = []
    for lo, hi in rows:
        for start in range(lo, hi, size):
            out.append((start, min(hi, start + size)))
    return out


class Ledger:
    """What each step trained (`trainer.output_dir/ledger.jsonl`, one line per step): the uids of
    the prompts drawn (and their data rows' `extra_info.index`, where the data numbers its rows:
    two rows with the same prompt text share a uid) and of the rows the actor's update consumed
    (every `update_actor` call of the step). With workers coming and going, the record that each drawn prompt was trained
    once: every step once, and its updated rows exactly n per drawn prompt (a lost worker's share
    replaced, never added)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def resume(self, step: int) -> None:
        """Forget the steps after `step` (a resumed run trains them again)."""
        if self.path.exists():
            keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in keep))

    async def record(self, step: int, prompts: DistBatch, updated: list[DistBatch]) -> None:
        """Step `step`'s drawn prompts and the rows of each batch its updates consumed."""
        has_info = "extra_info" in prompts
        drawn, *trained = await asyncio.gather(prompts.select("uid", *(["extra_info"] if has_info else []),
                                                              meta=False).fetch(),
                                               *(b.select("uid", meta=False).fetch() for b in updated))
        info = drawn["extra_info"] if has_info else [None] * len(drawn["uid"])
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "uids": [str(u) for u in drawn["uid"]],
                                # the data rows drawn, where the data numbers them (extra_info.index)
                                "data_rows": [e.get("index") if isinstance(e, dict) else None for e in info],
                                "rows": [str(u) for t in trained for u in t["uid"]]}) + "\n")


class UpdateRecorder:
    """The actor group as a step sees it, keeping each batch passed to `update_actor` (the rows
    the update consumed) for the ledger; everything else is the group's."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.updated: list[DistBatch] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def update_actor(self, batch: DistBatch, *args: Any, **kwargs: Any) -> Any:
        self.updated.append(batch)
        return self.group.update_actor(batch, *args, **kwargs)

    def take(self) -> list[DistBatch]:
        """The batches updated since the last call."""
        out, self.updated = self.updated, []
        return out
