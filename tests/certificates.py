"""Certificates made in the test, with the `cryptography` package: a CA, and server and
client certificates it signs (valid, expired, or from another CA), written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path
    serial: int

    def install(self, cert: Path, key: Path) -> None:
        """Copy over `cert` and `key` the way an operator rotates them (key first)."""
        tmp_key, tmp_cert = key.with_suffix(".new-key"), cert.with_suffix(".new-cert")
        shutil.copyfile(self.key, tmp_key)
        shutil.copyfile(self.cert, tmp_cert)
        tmp_key.replace(key)
        tmp_cert.replace(cert)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


class Authority:
    """A CA in `folder`: `ca.pem`, and `issue` writes NAME.pem / NAME.key."""

    def __init__(self, folder: Path, name: str = "loraplane test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(days=1))
                     .not_valid_after(now + datetime.timedelta(days=30))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                    critical=True)
                     .add_extension(x509.KeyUsage(
                         digital_signature=True, key_cert_sign=True, crl_sign=True,
                         content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca = folder / "ca.pem"
        self.ca.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, expired: bool = False, client: bool = False) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = ((now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
                      if expired else (now - datetime.timedelta(hours=1),
                                       now + datetime.timedelta(days=7)))
        serial = x509.random_serial_number()
        # a process's one certificate serves its listeners and is its client certificate
        usage = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else
                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        builder = (x509.CertificateBuilder().subject_name(_name(name))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(serial).not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if not client:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.DNSName("loraplane-worker"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pem = Pem(self.folder / f"{name}.pem", self.folder / f"{name}.key", serial)
        pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        return pem
