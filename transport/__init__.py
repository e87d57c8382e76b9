"""Asynchronous RPC on ZeroMQ + msgpack. Knows nothing of RL."""

from transport.auth import CurveConfig, generate_keys
from transport.codec import Blob, register_type
from transport.errors import (
    AuthenticationError,
    CodecError,
    ConnectionLost,
    RemoteError,
    RpcTimeout,
    TransportError,
)
from transport.rpc import RpcClient, RpcServer, expose

__all__ = [
    "AuthenticationError", "Blob", "CodecError", "ConnectionLost", "CurveConfig", "RemoteError",
    "RpcClient", "RpcServer", "RpcTimeout", "TransportError", "expose", "generate_keys",
    "register_type",
]
