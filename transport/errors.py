"""Typed errors of the transport layer. Each message says what to do next."""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by transport/."""


class CodecError(TransportError):
    """A value cannot be encoded, or received bytes cannot be decoded."""


class RpcTimeout(TransportError, TimeoutError):
    """A call did not complete within its timeout."""


class ConnectionLost(TransportError, ConnectionError):
    """The peer stopped answering heartbeats or the client was closed."""


class AuthenticationError(TransportError):
    """The CurveZMQ handshake failed: the server does not know our key, or we have the wrong server key."""


class RemoteError(TransportError):
    """An exception raised by a remote handler, re-raised on the caller.

    `remote_type` is the remote exception's qualified type name, `remote_traceback` its
    formatted traceback on the remote side.
    """

    def __init__(self, remote_type: str, message: str, remote_traceback: str = "") -> None:
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        text = f"{remote_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.remote_type, self.remote_message, self.remote_traceback))
