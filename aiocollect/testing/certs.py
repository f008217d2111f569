"""Throw-away certificates for TLS groups on one machine (tests, benchmarks): two
independent CAs and a certificate per rank for 127.0.0.1 and localhost, valid two days.

Made with the ``cryptography`` package when it is installed, else with the ``openssl``
command. Never use them outside a test: the keys are written unencrypted.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aiocollect.errors import UsageError
from aiocollect.tls import TLSConfig, contexts


@dataclass(frozen=True)
class Certs:
    """Files of two independent CAs: ``ranks[r]`` are (cert, key) signed by the main CA,
    ``stranger`` is (cert, key) signed by the other CA."""

    ca: str
    other_ca: str
    ranks: list[tuple[str, str]]
    stranger: tuple[str, str]

    def config(self, rank: int) -> TLSConfig:
        """Rank ``rank``'s contexts (``open_group(ssl=...)``), trusting the main CA; a
        spawned rank builds its own, since contexts cannot be pickled."""
        cert, key = self.ranks[rank]
        return contexts(cert, key, self.ca)


def _openssl_certs(d: Path, n: int) -> Certs:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    def new_key(name: str, key: Path, out: Path, *extra: str) -> None:
        """A P-256 key in ``key`` and, in ``out``, a request (or with ``-x509`` a
        self-signed certificate) for CN=``name``."""
        run(
            "req",
            *extra,
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(out),
            "-subj",
            f"/CN={name}",
        )

    def ca(name: str) -> tuple[Path, Path]:
        crt, key = d / f"{name}.pem", d / f"{name}.key"
        new_key(name, key, crt, "-x509", "-days", "2")
        return crt, key

    def leaf(name: str, ca_crt: Path, ca_key: Path) -> tuple[str, str]:
        crt, key, csr = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr"
        ext = d / f"{name}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        new_key(name, key, csr)
        run(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca_crt),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(crt),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        return str(crt), str(key)

    ca_crt, ca_key = ca("ca")
    other_crt, other_key = ca("other-ca")
    return Certs(
        str(ca_crt),
        str(other_crt),
        [leaf(f"rank{r}", ca_crt, ca_key) for r in range(n)],
        leaf("stranger", other_crt, other_key),
    )


def _cryptography_certs(d: Path, n: int) -> Certs:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write(
        name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
    ) -> tuple[str, str]:
        crt_path, key_path = d / f"{name}.pem", d / f"{name}.key"
        crt_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return str(crt_path), str(key_path)

    def build(
        name: str, issuer: x509.Name | None, signer: ec.EllipticCurvePrivateKey | None, is_ca: bool
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        )
        if is_ca:
            builder = builder.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        return builder.sign(signer or key, hashes.SHA256()), key

    ca_cert, ca_key = build("aiocollect test CA", None, None, True)
    other_cert, other_key = build("another CA", None, None, True)
    ranks = [
        write(f"rank{r}", *build(f"rank{r}", ca_cert.subject, ca_key, False)) for r in range(n)
    ]
    stranger = write("stranger", *build("stranger", other_cert.subject, other_key, False))
    return Certs(
        write("ca", ca_cert, ca_key)[0],
        write("other-ca", other_cert, other_key)[0],
        ranks,
        stranger,
    )


def make_certs(d: Path, n: int) -> Certs:
    """Certificates for ``n`` ranks in directory ``d``.

    Raises:
        UsageError: neither the ``cryptography`` package nor the ``openssl`` command is
            available.
    """
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            raise UsageError(
                "making test certificates needs the cryptography package or the openssl "
                "command (pip install cryptography)"
            ) from None
        return _openssl_certs(d, n)
    return _cryptography_certs(d, n)
