"""CurveZMQ keys and authentication.

The model is a cluster key: `generate_keys(dir)` writes one key pair (`cluster.key`,
`cluster.key_secret`) that every daemon and worker of a cluster presents as its server key
and uses as its client key, plus `authorized/` holding the public keys servers accept.
Extra client identities (a user submitting jobs from a laptop, say) get their own pair with
`generate_keys(dir, name="alice")`; their public key lands in `authorized/` too.

Copy the directory to every node (mode 0700). Keys are z85 text, as ZeroMQ expects.

The cluster secret stays in the processes that load it (the launcher, node daemons). Processes
that must not hold it get an identity of their own (`CurveConfig.identity`): workers share a
per-coordinator worker key pair, local tools (`asyncrl status|stop`) a per-run client pair.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from transport.errors import AuthenticationError

CLUSTER = "cluster"


@dataclass(frozen=True)
class CurveConfig:
    """Keys one process uses: its own pair, the servers' public key, and the keys it accepts."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes
    authorized_keys: frozenset[bytes] = field(default_factory=frozenset)

    @classmethod
    def load(cls, key_dir: str | os.PathLike, name: str = CLUSTER) -> CurveConfig:
        """Load keys written by `generate_keys`; `name` picks the client identity."""
        root = Path(key_dir).expanduser()
        try:
            public, secret = zmq.auth.load_certificate(root / f"{name}.key_secret")
            server_key, _ = zmq.auth.load_certificate(root / f"{CLUSTER}.key")
        except (OSError, ValueError) as e:
            raise AuthenticationError(
                f"cannot read CurveZMQ keys in {root} ({e}); create them with "
                f"`asyncrl keys generate {root}` and copy the directory to every node"
            ) from e
        if secret is None:
            raise AuthenticationError(f"{root / (name + '.key_secret')} holds no secret key")
        authorized: set[bytes] = set()
        auth_dir = root / "authorized"
        if auth_dir.is_dir():
            for path in sorted(auth_dir.glob("*.key")):
                key, _ = zmq.auth.load_certificate(path)
                authorized.add(key)
        authorized.add(server_key)
        return cls(public, secret, server_key, frozenset(authorized))

    @classmethod
    def identity(cls, server_key: bytes, authorized: frozenset[bytes] = frozenset()) -> CurveConfig:
        """A fresh key pair that talks to servers presenting `server_key` and, as a server,
        admits `authorized`."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret, server_key, frozenset(authorized))

    def authorizing(self, *keys: bytes) -> CurveConfig:
        """These keys, admitting `keys` as clients too."""
        return CurveConfig(self.public_key, self.secret_key, self.server_key,
                           self.authorized_keys | frozenset(keys))

    @classmethod
    def ephemeral(cls) -> CurveConfig:
        """A fresh in-memory cluster key pair, for an embedded single-machine run."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret, public, frozenset({public}))

    def to_env(self) -> dict[str, str]:
        """Environment variables that hand these keys to a child process."""
        return {
            "ASYNCRL_CURVE_PUBLIC": self.public_key.decode(),
            "ASYNCRL_CURVE_SECRET": self.secret_key.decode(),
            "ASYNCRL_CURVE_SERVER": self.server_key.decode(),
            "ASYNCRL_CURVE_AUTHORIZED": ",".join(sorted(k.decode() for k in self.authorized_keys)),
        }

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CurveConfig | None:
        env = os.environ if env is None else env
        if "ASYNCRL_CURVE_SECRET" not in env:
            return None
        authorized = frozenset(k.encode() for k in env.get("ASYNCRL_CURVE_AUTHORIZED", "").split(",") if k)
        return cls(env["ASYNCRL_CURVE_PUBLIC"].encode(), env["ASYNCRL_CURVE_SECRET"].encode(),
                   env["ASYNCRL_CURVE_SERVER"].encode(), authorized)


def generate_keys(key_dir: str | os.PathLike, name: str = CLUSTER) -> Path:
    """Write a key pair `name` into `key_dir` and authorize its public key; returns the secret file."""
    root = Path(key_dir).expanduser()
    (root / "authorized").mkdir(parents=True, exist_ok=True)
    os.chmod(root, stat.S_IRWXU)
    secret_path = root / f"{name}.key_secret"
    if secret_path.exists():
        raise FileExistsError(f"{secret_path} exists; remove it first to rotate the key")
    public_path, secret_path = (Path(p) for p in zmq.auth.create_certificates(root, name))
    os.chmod(secret_path, stat.S_IRUSR | stat.S_IWUSR)
    (root / "authorized" / public_path.name).write_bytes(public_path.read_bytes())
    return secret_path


class _KeySet:
    """ZAP credentials provider: accept exactly the configured client keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.keys


_authenticators: dict[int, ThreadAuthenticator] = {}
_auth_lock = threading.Lock()


def secure_server_socket(sock: zmq.Socket, curve: CurveConfig, domain: str) -> None:
    """Make `sock` a CURVE server that admits only `curve.authorized_keys` (before bind)."""
    ctx = sock.context
    with _auth_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            _authenticators[id(ctx)] = auth
    auth.configure_curve_callback(domain=domain, credentials_provider=_KeySet(curve.authorized_keys))
    sock.zap_domain = domain.encode()
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_server = True


def secure_client_socket(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Make `sock` a CURVE client presenting `curve`'s key pair (before connect)."""
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_serverkey = curve.server_key


def stop_authenticators() -> None:
    """Stop the ZAP threads (tests and clean shutdown)."""
    with _auth_lock:
        for auth in _authenticators.values():
            auth.stop()
        _authenticators.clear()
