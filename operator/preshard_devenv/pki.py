"""The local cluster's certificates and keys, made with the `cryptography` package.

One CA signs the API server's serving certificate and every client certificate; a client
certificate's common name is the user and its organizations are the groups, which is how the
API server authenticates the admin (`system:masters`), the controllers and test users. A
separate key pair signs ServiceAccount tokens. Keys are ECDSA P-256: quick to generate and
accepted by every component.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)
# Clock skew between the machine and the certificate's notBefore must not reject it.
_BACKDATE = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, *, ca: bool
) -> x509.CertificateBuilder:
    """A certificate valid from a moment ago for `_VALIDITY`: a CA's (signs certificates) or
    an end entity's (signs handshakes)."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self._cert = cert

    @classmethod
    def create(cls, common_name: str = "preshard-local-ca") -> CertificateAuthority:
        """A fresh CA."""
        key = _new_key()
        name = _name(common_name)
        cert = (
            _builder(name, name, key.public_key(), ca=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        """A CA written earlier by `write`."""
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{key_path} does not hold an ECDSA key")
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the CA certificate and (mode 0600) its key."""
        cert_path.write_bytes(self.cert_pem)
        write_private(key_path, _key_pem(self._key))

    def issue_serving(self, common_name: str, hosts: Sequence[str]) -> KeyPair:
        """A server certificate valid for the given DNS names and IP addresses."""
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        return self._issue(
            _name(common_name),
            ExtendedKeyUsageOID.SERVER_AUTH,
            x509.SubjectAlternativeName(names),
        )

    def issue_client(self, user: str, groups: Sequence[str] = ()) -> KeyPair:
        """A client certificate for `user` in `groups`."""
        return self._issue(_name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def _issue(
        self,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        san: x509.SubjectAlternativeName | None,
    ) -> KeyPair:
        key = _new_key()
        builder = (
            _builder(subject, self._cert.subject, key.public_key(), ca=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def service_account_keys(private_path: Path, public_path: Path) -> None:
    """Write the key pair that signs (private) and verifies (public) ServiceAccount tokens."""
    key = _new_key()
    write_private(private_path, _key_pem(key))
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable only by its owner, without a moment of wider permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write(data)
