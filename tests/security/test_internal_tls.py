"""Internal TLS (`--internal-tls-cert/--internal-tls-key/--internal-tls-ca`): instances and the
router serve HTTPS, and every internal client (the router's legs and probes, the KV side
channel's handshake, registrations) verifies the peer's certificate against the CA. One
self-signed certificate for 127.0.0.1, made here with the openssl command, is the CA.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
import requests

from disagg.config import KVTransferConfig, RouterConfig, ServerConfig
from tests.e2e.client import completion_body, prompt_ids
from tests.e2e.cluster import assert_pools_full, running_cluster
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key): self-signed, for IP 127.0.0.1 and localhost, valid for a day."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=disagg-test", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key_file), "-out", str(cert_file)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert_file, key_file


def test_a_certificate_needs_its_key_and_files_must_exist(cert: tuple[Path, Path]) -> None:
    cert_file, key_file = (str(path) for path in cert)
    with pytest.raises(ValueError, match="together"):
        ServerConfig(tls_cert_file=cert_file)
    with pytest.raises(ValueError, match="tls_ca_file"):
        KVTransferConfig(tls_ca_file="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="tls_key_file"):
        RouterConfig(decode_urls=("http://h:1",), tls_cert_file=cert_file,
                     tls_key_file="/nonexistent/key.pem")  # fmt: skip
    with pytest.raises(ValueError, match="advertise_url"):
        RouterConfig(decode_urls=("http://h:1",), advertise_url="router:8000")
    ServerConfig(tls_cert_file=cert_file, tls_key_file=key_file)  # both: fine


@pytest.mark.slow
def test_a_pull_cluster_runs_over_internal_tls(
    request: pytest.FixtureRequest, tiny_qwen3_dir: Path, cert: tuple[Path, Path]
) -> None:
    """P, D and the router speak HTTPS only: a request is served (D's handshake with P went
    over TLS), an instance registers with the https router, and plain HTTP gets nothing."""
    cert_file, key_file = cert
    flags = ["--internal-tls-cert", str(cert_file), "--internal-tls-key", str(key_file),
             "--internal-tls-ca", str(cert_file)]  # fmt: skip
    with running_cluster(request, "tls", tiny_qwen3_dir) as cluster:
        cluster.tls_context = ssl.create_default_context(cafile=str(cert_file))
        prefill = cluster.serve("p", role="prefill", transport="tcp", args=flags)
        decode = cluster.serve("d", role="decode", transport="tcp", args=flags)
        cluster.wait_ready()
        assert prefill.url.startswith("https://") and decode.url.startswith("https://")
        router = cluster.route("router", [prefill], [decode], mode="pull", args=flags)
        body = completion_body(prompt_ids(1, 40), 8)
        answer = requests.post(f"{router.url}/v1/completions", json=body, verify=str(cert_file),
                               timeout=60)  # fmt: skip
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        assert decode.stats()["handshakes"] == 1  # over https: the side channel verified P
        assert_pools_full(prefill, decode)
        joined = cluster.serve("d-joined", role="decode", transport="tcp",
                               args=[*flags, "--router", router.url])  # fmt: skip
        cluster.wait_ready(joined)
        wait_until(lambda: _is_listed_healthy(router.url, joined.url, cert_file),
                   f"{joined.url} registers healthy", 30.0)  # fmt: skip
        with pytest.raises(requests.ConnectionError):
            requests.get(prefill.url.replace("https://", "http://") + "/health", timeout=5)


def _is_listed_healthy(router_url: str, url: str, cert_file: Path) -> bool:
    rows = requests.get(f"{router_url}/instances", verify=str(cert_file), timeout=5).json()
    return any(row["url"] == url and row["healthy"] for row in rows)
