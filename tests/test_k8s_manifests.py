"""deploy/k8s: every manifest valid against the Kubernetes API schema (strict, offline), and
every command in them one our own CLI accepts, with the wiring the membership design needs."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import kubernetes_validate  # a dev dependency: its schemas ship inside the package (offline)
import pytest
import yaml

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
K8S_VERSION = "1.37.0"


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def containers(kind: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file, pod spec, container) of every Deployment's containers."""
    out = []
    for name, doc in documents():
        if doc["kind"] == kind:
            spec = doc["spec"]["template"]["spec"]
            out += [(name, spec, c) for c in spec["containers"]]
    return out


def parse(command: list[str]) -> argparse.Namespace:
    """Parse `disagg CMD ...` with the real parser of that command."""
    assert command[0] == "disagg", command
    module = {"serve": "disagg.server.main", "route": "disagg.router.main"}[command[1]]
    parser = argparse.ArgumentParser(exit_on_error=False)
    importlib.import_module(module).add_arguments(parser)
    return parser.parse_args(command[2:])


def _id(value: object) -> str:
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize(("name", "doc"), documents(), ids=_id)
def test_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_rejects_a_misspelt_field() -> None:
    (_, router), *_ = [(n, d) for n, d in documents() if d["kind"] == "Deployment"]
    router["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # sic
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, K8S_VERSION, strict=True)


def test_every_pod_gets_the_token_from_the_secret_and_probes_health() -> None:
    (secret,) = [doc for _, doc in documents() if doc["kind"] == "Secret"]
    for name, _, container in containers("Deployment"):
        env = {e["name"]: e for e in container["env"]}
        ref = env["DISAGG_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", name


def test_instances_register_with_the_router_service_and_drain_within_the_grace() -> None:
    (service,) = [doc for _, doc in documents() if doc["kind"] == "Service"]
    router_url = f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    roles = set()
    for name, spec, container in containers("Deployment"):
        args = parse(container["command"])
        if container["command"][1] == "route":
            assert not args.prefill and not args.decode  # membership, not a fixed list
            assert args.advertise_url == router_url  # what registrations are signed for
            continue
        roles.add(getattr(args, "KVTransferConfig.role"))
        assert getattr(args, "ServerConfig.router_url") == router_url, name
        assert "$(POD_IP)" in getattr(args, "ServerConfig.advertise_url"), name
        assert spec["terminationGracePeriodSeconds"] > getattr(args, "ServerConfig.drain_timeout_s")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert roles == {"prefill", "decode"}
