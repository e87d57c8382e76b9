"""The Kubernetes manifests under examples/k8s/ against the Kubernetes API schemas (offline, with
`kubernetes-validate`; no cluster runs here), and the launch command each pod runs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "examples" / "k8s").glob("*.yaml"))
VERSIONS = ["1.30.0", None]  # an older supported release and the newest the package knows


@pytest.mark.parametrize("version", VERSIONS, ids=["k8s-1.30", "latest"])
@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_manifest_validates_strictly(path, version):
    kv = pytest.importorskip("kubernetes_validate")
    version = version or kv.latest_version()
    for doc in yaml.safe_load_all(path.read_text()):
        kv.validate(doc, version, strict=True)


def test_the_validation_catches_a_misspelt_field():
    kv = pytest.importorskip("kubernetes_validate")
    job = yaml.safe_load((REPO / "examples" / "k8s" / "job.yaml").read_text())
    job["spec"]["template"]["spec"]["restartPolicyy"] = job["spec"]["template"]["spec"].pop("restartPolicy")
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.latest_version(), strict=True)


def test_each_pod_runs_a_launch_the_config_check_accepts():
    """The shell in job.yaml as pod 0 and pod 1 would run it: the overrides compose and check."""
    from asyncrl.launch import check_config, load_config

    job = yaml.safe_load((REPO / "examples" / "k8s" / "job.yaml").read_text())
    service = yaml.safe_load((REPO / "examples" / "k8s" / "service.yaml").read_text())
    spec = job["spec"]["template"]["spec"]
    assert spec["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"]["job-name"] == job["metadata"]["name"]
    script = spec["containers"][0]["args"][0]
    launch = script[script.index("exec asyncrl-launch"):].replace("\\\n", " ")
    for index, role in [("0", "cluster.host=10.1.2.3 cluster.bind=0.0.0.0 cluster.port=29400"),
                        ("1", f"cluster.coordinator={job['metadata']['name']}-0.asyncrl:29400")]:
        words = shlex.split(launch.replace("$JOB_COMPLETION_INDEX", index).replace("$ROLE", role))
        assert role.split()[0] in script.replace("$(hostname -i)", "10.1.2.3")
        overrides = words[words.index("grpo") + 1:]
        cfg = check_config(load_config("grpo", overrides))
        assert cfg.cluster.nnodes == job["spec"]["completions"] and cfg.cluster.node_rank == int(index)
