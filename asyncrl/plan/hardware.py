"""Hardware profiles: the numbers the cost model prices a plan with, kept as data.

GPU profiles ship in `asyncrl/plan/profiles/*.json` (public specifications, efficiencies
assumed); a CPU profile is measured on the machine by `asyncrl-plan profile` and written to
`~/.asyncrl/plan/cpu.json` (or where `--out` says), so a profile is a name or a file path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from asyncrl.config import ConfigError

PROFILE_DIR = Path(__file__).parent / "profiles"
CPU_PROFILE = Path("~/.asyncrl/plan/cpu.json")


@dataclass(frozen=True)
class DeviceProfile:
    """One device kind and the fabric between devices.

    Compute time of `f` FLOPs over `x` tokens per kernel call is
    `f / (peak_flops * efficiency * x / (x + half_efficiency_tokens))`: small calls run far below
    peak (REAL's profiler sees the same curve), and each layer call adds `layer_overhead_s`."""

    name: str
    description: str
    kind: str  # gpu | cpu
    devices_per_node: int
    peak_flops: float  # dense bf16 (GPU) or the measured float32 matmul rate (CPU), FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float  # per device
    intra_bw: float  # collective bandwidth per device inside a node, bytes/s
    inter_bw: float  # per device across nodes, bytes/s
    intra_latency_s: float
    inter_latency_s: float
    train_efficiency: float  # of peak, for forward + backward at large calls
    infer_efficiency: float  # of peak, for forward only
    mem_bw_efficiency: float
    half_efficiency_tokens: float  # tokens per call at which efficiency is half its large-call value
    layer_overhead_s: float  # per layer per forward (backward: twice)
    decode_step_overhead_s: float  # per decode step of a generation engine (scheduling, sampling)
    call_overhead_s: float  # per model function call through the runtime (RPC, batching)
    micro_batch_overhead_s: float = 0.0  # per micro-batch of a forward/backward (head, loss, framework)
    tp_latency_s: float = 0.0  # per tensor-parallel all-reduce inside a layer (0 = intra_latency_s)
    usable_memory_fraction: float = 0.9
    bytes_per_param: int = 2  # weights as the device computes with them (bf16 on GPU, fp32 on CPU)
    # pinned host <-> device copies per device, each way, with a node's devices copying at once
    # (actor.offload); 0: the device's memory is the host's (a CPU: a copy at mem_bw)
    host_bw: float = 0.0
    host_mem_bytes: float = 0.0  # a node's host memory, where offloaded state waits (0: not checked)

    def bandwidth(self, across_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency) of a collective inside one node or across nodes."""
        return (self.inter_bw, self.inter_latency_s) if across_nodes else (self.intra_bw, self.intra_latency_s)

    def tp_bandwidth(self, across_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency) of a tensor-parallel all-reduce inside a layer."""
        bw, latency = self.bandwidth(across_nodes)
        if not across_nodes and self.tp_latency_s:
            latency = self.tp_latency_s
        return bw, latency

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name (h100, h200, a100), `cpu` (the measured one), or a JSON file."""
    path = Path(name_or_path).expanduser()
    if name_or_path == "cpu":
        path = CPU_PROFILE.expanduser()
        if not path.is_file():
            raise ConfigError(f"no CPU profile at {path}: measure this machine first with `asyncrl-plan profile` "
                              "(about 15 seconds), or pick a GPU profile with plan.device="
                              f"{'|'.join(shipped_profiles())}")
    elif not path.suffix == ".json":
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ConfigError(f"plan.device={name_or_path!r}: no such profile; use one of "
                              f"{', '.join(shipped_profiles())}, cpu (measured by `asyncrl-plan profile`) or a "
                              "profile JSON file")
    if not path.is_file():
        raise ConfigError(f"plan.device={name_or_path!r}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(DeviceProfile)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown profile keys {unknown}; known: {sorted(known)}")
        return DeviceProfile(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"{path} is not a device profile ({e}); rerun `asyncrl-plan profile` or fix the file") from None
