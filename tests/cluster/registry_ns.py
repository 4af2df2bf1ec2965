"""A real image registry for the test cluster: Debian's ``docker-registry`` (distribution 2.8) in a
network namespace of its own on the cluster's bridge, served over TLS with a certificate from a CA
made for the session.

Every Docker daemon on this machine (the operator's and each node's) trusts that CA the way a team's
daemons trust an internal registry: the CA is placed at ``/etc/docker/certs.d/<host:port>/ca.crt``,
which dockerd reads at each pull and push. No credentials: teams that need them use ``docker login``
on the operator and on the nodes, which the deploy tool never touches.

| what | where |
|---|---|
| namespace | ``ddpreg``, address ``198.18.0.2``, veth ``ddpvreg`` on the bridge ``ddpbr0`` |
| registry | ``https://198.18.0.2:5000`` (``.host``), storage, config, certificates and log in the cluster's state directory |
| trust | ``/etc/docker/certs.d/198.18.0.2:5000/ca.crt`` (removed at stop) |

Helpers: ``.host``, ``.manifest(repository, reference)`` (the registry's own answer, read over HTTPS
with the CA; ``None`` when it holds no such manifest), ``.cut_off(node)`` / ``.reconnect(node)`` (a
node's packets to the registry rejected, in the node's namespace).
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .netcluster import (DAEMON_MARK, SUBNET_PREFIX, ClusterError, _kill_and_wait, _ns_path, plug_namespace,
                         _which)

NS = "ddpreg"
VETH = "ddpvreg"
ADDRESS = SUBNET_PREFIX + "2"
PORT = 5000
HOST = f"{ADDRESS}:{PORT}"
CERTS_D = Path("/etc/docker/certs.d")
TRUST_DIR = CERTS_D / HOST
MARK = TRUST_DIR / "ddpcluster-test-ca"  # ours to remove: a directory without it is left alone
PROGRAM = "docker-registry"
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.manifest.v1+json, "
                  "application/vnd.docker.distribution.manifest.list.v2+json, "
                  "application/vnd.oci.image.index.v1+json")


def missing_prerequisites() -> list[str]:
    return [] if _which(PROGRAM) else [f"{PROGRAM} not found (apt-get install docker-registry)"]


def _cut_rule(verb: str) -> list[str]:
    return ["iptables", verb, "OUTPUT", "-d", ADDRESS, "-p", "tcp", "--dport", str(PORT),
            "-j", "REJECT", "--reject-with", "icmp-host-unreachable"]


class RegistryNamespace:
    """The registry, started by :meth:`start` and removed (with its trust and storage) by :meth:`stop`."""

    host = HOST

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None
        self._cut: set[str] = set()

    @property
    def dir(self) -> Path:
        return Path(self.cluster.state_dir) / "registry"

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def start(self) -> "RegistryNamespace":
        cleanup_leftovers()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _make_certificates(self.dir)
            config = self.dir / "config.yml"
            config.write_text(json.dumps({  # YAML is a superset of JSON
                "version": 0.1,
                "log": {"level": "info", "accesslog": {"disabled": True}},
                "storage": {"filesystem": {"rootdirectory": str(self.dir / "storage")},
                            "delete": {"enabled": True}},
                "http": {"addr": HOST, "tls": {"certificate": str(self.dir / "server.crt"),
                                               "key": str(self.dir / "server.key")}},
            }))
            plug_namespace(NS, VETH, ADDRESS)
            with open(self.dir / "registry.log", "ab") as log:
                self.proc = subprocess.Popen(
                    ["nsenter", f"--net={_ns_path(NS)}", PROGRAM, "serve", str(config)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, DAEMON_MARK: "registry"})  # netcluster's teardown ends it too
            self._wait()
            TRUST_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.ca, TRUST_DIR / "ca.crt")
            MARK.write_text("made by tests/cluster/registry_ns.py; removed when its registry stops\n")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in list(self._cut):
            self.reconnect(node)
        if self.proc is not None:
            _kill_and_wait([self.proc.pid], grace=5)
            self.proc.wait()
            self.proc = None
        cleanup_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._get("/v2/")
                return
            except (OSError, urllib.error.URLError) as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "registry.log").read_text(errors="replace").splitlines()[-15:]
                    raise ClusterError(f"the registry did not answer at https://{HOST}/v2/ ({e}); "
                                       "last lines of its log:\n" + "\n".join(log)) from e
                time.sleep(0.1)

    def _get(self, path: str, accept: str | None = None) -> tuple[dict, dict]:
        request = urllib.request.Request(f"https://{HOST}{path}", headers={"Accept": accept} if accept else {})
        context = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(request, context=context, timeout=10) as r:
            body = r.read()
            return dict(r.headers), (json.loads(body) if body.strip() else {})

    def manifest(self, repository: str, reference: str) -> tuple[str, dict] | None:
        """(its digest, the manifest) as the registry holds it, or None where it holds none."""
        try:
            headers, body = self._get(f"/v2/{repository}/manifests/{reference}", MANIFEST_TYPES)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
        return headers.get("Docker-Content-Digest", ""), body

    def cut_off(self, node: str) -> None:
        """Node ``node`` can no longer reach the registry (its packets to it are rejected there)."""
        self.cluster.run_on(node, _cut_rule("-I"), check=True)
        self._cut.add(node)

    def reconnect(self, node: str) -> None:
        while self.cluster.run_on(node, _cut_rule("-C")).returncode == 0:
            self.cluster.run_on(node, _cut_rule("-D"), check=True)
        self._cut.discard(node)


def cleanup_leftovers() -> None:
    """The namespace (with its veth) and the trusted CA, also when a crashed run left them."""
    if subprocess.run(["ip", "netns", "pids", NS], capture_output=True).returncode == 0:
        r = subprocess.run(["ip", "netns", "pids", NS], capture_output=True, text=True)
        _kill_and_wait([int(p) for p in r.stdout.split() if p.isdigit()], grace=5)
        subprocess.run(["ip", "netns", "delete", NS], capture_output=True)
    subprocess.run(["ip", "link", "delete", VETH], capture_output=True)
    if MARK.exists():
        shutil.rmtree(TRUST_DIR, ignore_errors=True)
        try:
            CERTS_D.rmdir()  # only when nothing else is trusted there
        except OSError:
            pass


def _make_certificates(d: Path) -> None:
    """ca.crt (a CA made now, valid for a day) and server.crt/server.key for ADDRESS, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ddp test registry CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ADDRESS)]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(start).not_valid_after(end)
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ADDRESS))]),
                             critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "server.crt").write_bytes(server.public_bytes(pem))
    (d / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    os.chmod(d / "server.key", 0o600)
