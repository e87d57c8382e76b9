"""Pull paths: how a consumer gets an object from its owner, one module per path.

Each path is a `PullPath` holding both halves: the consumer's `fetch(ref, rows)` and the
owner's `serve(entry, rows, request)` behind the one `<kind>.pull` RPC endpoint. The GPU
paths import their CUDA/cupy machinery only when used.
"""

from objectstore.paths.base import PullKind, PullPath, PullRequest, TensorRegion
from objectstore.paths.cuda_ipc import CudaIpcPath
from objectstore.paths.inline import InlinePath
from objectstore.paths.local import LocalPath
from objectstore.paths.nccl import NcclPath
from objectstore.paths.shm import ShmPath
from objectstore.paths.tcp import TcpPath

PATHS: tuple[type[PullPath], ...] = (LocalPath, InlinePath, ShmPath, TcpPath, CudaIpcPath, NcclPath)

__all__ = ["PATHS", "CudaIpcPath", "InlinePath", "LocalPath", "NcclPath", "PullKind", "PullPath",
           "PullRequest", "ShmPath", "TcpPath", "TensorRegion"]
