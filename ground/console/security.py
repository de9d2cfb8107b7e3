"""Who may use the console, and over what.

On loopback the console needs nothing more (the operator's own machine). Bound beyond loopback
it refuses to start without a token and TLS: a console that can uplink and cancel tasks must not
be open to anyone on the network, nor its token readable on the wire. Every request that changes
anything (every method but GET and HEAD: the actions' POST, the upload chunks' PUT) needs the
token in the `X-Console-Token` header and an `Origin` equal to the console's own, so a page from
another site cannot drive an operator's browser into commanding the payload (the browser sends
`Origin` on every cross-site POST and PUT, and scripts cannot forge it).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

TOKEN_HEADER = "X-Console-Token"


class SecurityError(Exception):
    """The console refuses to start as configured."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SecurityError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise SecurityError(f"the token file {path} is empty")
    return token


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class ConsoleSecurity:
    host: str = "127.0.0.1"
    token: str | None = None
    read_only: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None

    def check_startup(self) -> None:
        """Refuse a configuration that would expose the console; called before binding."""
        if is_loopback(self.host):
            return
        if not self.token:
            raise SecurityError(
                f"refusing to serve on {self.host} (beyond loopback) without a token: give --token or --token-file"
            )
        if not (self.tls_cert and self.tls_key):
            raise SecurityError(
                f"refusing to serve on {self.host} (beyond loopback) without TLS: give --tls-cert and --tls-key, "
                "or --tls-self-signed DIR"
            )

    def token_ok(self, given: str | None) -> bool:
        if not self.token:
            return True  # loopback without a token: the operator's own machine
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.tls_cert and self.tls_key):
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


def self_signed(directory: str, host: str) -> tuple[str, str, str]:
    """Make (or reuse) a self-signed certificate for `host` in `directory`; returns
    (cert path, key path, SHA-256 fingerprint) -- the operator compares the fingerprint with
    what the browser shows, since no authority vouches for it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "console-cert.pem", folder / "console-key.pem"
    if not (cert_path.exists() and key_path.exists()):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_path.chmod(0o600)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    from cryptography import x509 as _x509

    cert = _x509.load_pem_x509_certificate(cert_path.read_bytes())
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return str(cert_path), str(key_path), ":".join(fingerprint[i : i + 2].upper() for i in range(0, 64, 2))
