"""A throwaway CA, server and client certificate for TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_pki(
    root: Path,
    *,
    server_valid: tuple[datetime.timedelta, datetime.timedelta] = (-DAY / 288, DAY),
    server_names: tuple[str, ...] = ("localhost", "127.0.0.1"),
    server_client_auth: bool = False,
) -> dict[str, Path]:
    """Write ca.pem, server.pem/-key.pem (for 127.0.0.1, localhost), client.pem/-key.pem.

    ``server_valid`` is the server certificate's (not before, not after) from
    now, so a test can make one that has expired or is not valid yet;
    ``server_names`` are its subject alternative names (IP addresses or DNS
    names), so one can name another host.
    """
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("edgecache test CA"))
        .issuer_name(_name("edgecache test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - 2 * DAY)
        .not_valid_after(now + 2 * DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out = {"ca": root / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        start, end = server_valid if role == "server" else (-DAY / 288, DAY)
        usages = [usage]
        if role == "server" and server_client_auth:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(f"edgecache test {role}"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + start)
            .not_valid_after(now + end)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if role == "server":
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_alt_name(n) for n in server_names]),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        out[role] = root / f"{role}.pem"
        out[f"{role}_key"] = root / f"{role}-key.pem"
        out[role].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{role}_key"].write_bytes(_pem_key(key))
    return out


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
