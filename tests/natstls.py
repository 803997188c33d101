"""A throwaway certificate authority for tests: a CA and one loopback server certificate, made with `openssl`."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shared.launcher.natsserver import Tls


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_tls(directory: Path, names: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)) -> Tls:
    """A CA, and a certificate for ``names`` and ``ips`` (127.0.0.1 / localhost) signed by it that serves as server and
    client certificate (nats-server routes verify both ends); EC keys, quick to make."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server-key.pem", "server.csr",
                                                             "server.pem"))
    ext = directory / "server.ext"
    alt = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{n}" for n in names)])
    ext.write_text(f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\n"
                   "keyUsage=digitalSignature,keyEncipherment\n")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-subj", "/CN=chorus-test-ca", "-keyout", str(ca_key), "-out", str(ca))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
             "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1",
             "-extfile", str(ext), "-out", str(cert))
    return Tls(cert=cert, key=key, ca=ca)
