"""Authorized-but-hostile callers and leaked secrets: the worker allow-list, where keys live,
bind addresses and the limits servers take from the config."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from daemons.cluster import ClusterConfig, ClusterSpec, HeadNode
from daemons.worker import AllowList, NotAllowedError, entry_package, resolve_allowed
from transport import CurveConfig, RemoteError, RpcClient
from transport.peers import ServerLimits


# the allow-list, in-process ---------------------------------------------------------------------
@pytest.mark.parametrize("path", [
    "os:system", "subprocess:Popen", "builtins:eval",
    "asyncrl.launch:os.system",            # an allowed module re-exporting a foreign function
    "asyncrl.jobs.smoke:torch.save",
    "asyncrl.jobs.smoke:__builtins__",     # private attributes on the way
    "asyncrl:__loader__.load_module",
    "asyncrl.jobs.smoke:torch",            # a module, not a function
])
def test_allow_list_refuses_foreign_code_before_importing(path):
    with pytest.raises(NotAllowedError, match="asyncrl"):
        resolve_allowed(path, AllowList())


def test_allow_list_admits_listed_packages_and_names_them():
    assert resolve_allowed("asyncrl.jobs.smoke:make_batch", AllowList()).__name__ == "make_batch"
    allowed = AllowList(("asyncrl", "json"))
    assert resolve_allowed("json:loads", allowed)("[1]") == [1]
    with pytest.raises(NotAllowedError) as info:
        resolve_allowed("jsonx:loads", allowed)  # a prefix is not a package
    assert "asyncrl, json" in str(info.value) and "cluster.allowed_packages" in str(info.value)
    assert entry_package("my_pkg.train:main") == "my_pkg"
    assert entry_package("jobs/my_script.py:main") == "my_script"
    assert AllowList.from_env({"ASYNCRL_ALLOWED_PACKAGES": "a,b.c"}).packages == ("asyncrl", "a", "b.c")


# a live head node with CurveZMQ keys ------------------------------------------------------------
async def test_worker_refuses_foreign_code_and_holds_no_cluster_secret(tmp_path):
    cluster = CurveConfig.ephemeral()
    spec = ClusterSpec(ClusterConfig(cpu_devices=1, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=0.5,
                                     max_message_bytes=1 << 20),
                       curve=cluster, write_state=True, state_dir=tmp_path / "st")
    marker = tmp_path / "pwned"
    async with HeadNode.start(spec) as head:
        (worker,) = await head.coordinator.spawn_workers(head.coordinator.create_pool("p"))
        # the attack: any authorized key ran any importable function
        with pytest.raises(RemoteError) as info:
            await worker.run("os:system", f"touch {marker}", timeout=10)
        assert info.value.remote_type == "daemons.errors.NotAllowedError"
        assert "cluster.allowed_packages" in info.value.remote_message
        with pytest.raises(RemoteError, match="NotAllowedError"):
            await worker.call("create_instance", "x", "subprocess:Popen", [["touch", str(marker)]], {},
                              timeout=10)
        assert not marker.exists()
        ref = await worker.run("asyncrl.jobs.smoke:make_batch", 4, 2, 0, timeout=30)  # allowed: works
        assert ref.nbytes > 0
        # the per-message limit comes from the spec (the config), not a constant in the worker
        with pytest.raises(RemoteError, match="MessageTooLarge"):
            await worker.call("ping", torch.zeros(1 << 19), timeout=10)
        assert await worker.call("ping", timeout=10) == worker.info.worker_id
        # the cluster secret is neither in the worker's environment nor in the state file
        environ = Path(f"/proc/{worker.info.pid}/environ").read_bytes()
        state_path = head.state_path  # <state dir>/<job id>.json
        state = state_path.read_text()
        assert cluster.secret_key not in environ
        assert cluster.secret_key.decode() not in state
        # nor its own (worker) key pair: that came through a pipe on its stdin
        assert b"ASYNCRL_CURVE" not in environ and head.coordinator.worker_curve.secret_key not in environ
        assert (state_path.stat().st_mode & 0o777) == 0o600
        assert json.loads(state)["curve"]["ASYNCRL_CURVE_SERVER"] == cluster.public_key.decode()
        # the key a worker does hold (code running in it can read it from its memory) cannot
        # stop or submit jobs at the coordinator: it may only report readiness
        own = head.coordinator.worker_curve
        stolen = CurveConfig(own.public_key, own.secret_key, cluster.public_key)
        async with RpcClient(head.coordinator.endpoint, curve=stolen) as c:
            with pytest.raises(RemoteError, match="NotPermitted"):
                await c.call("stop", "hijack", timeout=5)
        assert not head.coordinator.stop_requested.is_set()


# bind addresses and limits from the config ------------------------------------------------------
def _spec(*overrides: str, daemon: bool = False) -> ClusterSpec:
    from asyncrl.jobs.nodes import cluster_spec
    from asyncrl.launch import load_config

    return cluster_spec(load_config("smoke", list(overrides)), daemon)


def test_daemon_mode_listens_on_loopback_unless_told_otherwise(caplog):
    from asyncrl.jobs.nodes import explain_bind

    spec = _spec(daemon=True)
    assert spec.cluster.bind == "127.0.0.1"
    level, line = explain_bind(spec, daemon=True)
    assert level == logging.WARNING and "cluster.host=" in line
    spec = _spec("cluster.bind=0.0.0.0", daemon=True)
    assert spec.cluster.bind == "0.0.0.0"
    level, line = explain_bind(spec, daemon=True)
    assert level == logging.WARNING and "every interface" in line
    spec = _spec("cluster.nnodes=2", "cluster.insecure=true")
    assert spec.cluster.bind not in ("0.0.0.0", None)
    assert _spec("cluster.host=10.1.2.3").cluster.bind == "10.1.2.3"


def test_server_limits_come_from_the_config_with_one_default():
    assert ClusterConfig().max_message_bytes == ServerLimits().max_message_bytes
    assert ClusterConfig().max_connections_per_peer == ServerLimits().max_connections_per_peer
    spec = _spec("cluster.max_message_bytes=12345", "cluster.max_connections_per_peer=7",
                 "cluster.allowed_packages=[my_pkg]")
    assert spec.cluster.limits == ServerLimits(max_message_bytes=12345, max_connections_per_peer=7)
    assert spec.allowed_packages == ("my_pkg", "asyncrl")  # and the smoke job's own package
    assert ServerLimits.from_env(spec.cluster.limits.to_env()) == spec.cluster.limits
    assert "ASYNCRL_NET_MAX_MESSAGE_BYTES" in spec.cluster.limits.to_env()


async def test_a_restricted_client_key_calls_only_its_methods():
    from transport import RpcServer

    server_keys = CurveConfig.ephemeral()
    worker = CurveConfig.identity(server_keys.public_key)
    server = RpcServer("tcp://127.0.0.1:0", curve=server_keys.authorizing(worker.public_key), name="coord")
    server.register("worker_ready", lambda: True)
    server.register("submit", lambda: "ran a job")
    server.restrict_client(worker.public_key, {"worker_ready"})
    await server.start()
    try:
        async with RpcClient(server.endpoint, curve=worker) as c:
            assert await c.call("worker_ready", timeout=5) is True
            with pytest.raises(RemoteError, match="NotPermitted"):
                await c.call("submit", timeout=5)
        async with RpcClient(server.endpoint, curve=server_keys) as c:  # others are unaffected
            assert await c.call("submit", timeout=5) == "ran a job"
    finally:
        await server.close()


async def test_a_joining_node_gives_its_workers_no_cluster_secret(tmp_path):
    """Node 1 in its own process, with the cluster key directory: its workers get the
    coordinator's worker key pair in their spawn request, never the node's cluster key."""
    import signal
    import subprocess
    import sys

    from daemons.coordinator import Coordinator
    from transport import generate_keys

    generate_keys(tmp_path / "keys")
    cluster = CurveConfig.load(tmp_path / "keys")
    coordinator = Coordinator(curve=cluster, node_timeout=5)
    await coordinator.start()
    port = coordinator.endpoint.rsplit(":", 1)[1]
    node = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch", "--config-name", "smoke", f"cluster.coordinator=127.0.0.1:{port}",
         "cluster.node_rank=1", "cluster.nnodes=2", f"cluster.key_dir={tmp_path / 'keys'}", "cluster.cpu_devices=1",
         "cluster.heartbeat_interval_s=0.3", f"cluster.log_dir={tmp_path}/logs"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # Hydra's outputs/ lands there
        env={**os.environ, "ASYNCRL_STATE_DIR": str(tmp_path / "st"),
             "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH")]))}, start_new_session=True)
    try:
        await coordinator.wait_for_nodes(1, timeout=60)
        (worker,) = await coordinator.spawn_workers(coordinator.create_pool("p", world_size=1))
        assert (await worker.run("asyncrl.jobs.smoke:make_batch", 4, 2, 0, timeout=30)).nbytes > 0
        environ = Path(f"/proc/{worker.info.pid}/environ").read_bytes()
        assert cluster.secret_key not in environ and b"ASYNCRL_CURVE" not in environ
        await coordinator.shutdown_workers(grace_s=2)
        await coordinator.shutdown_nodes()
        node.wait(timeout=30)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        await coordinator.close()
