"""TLS settings for ``transport="tls"``: mutual certificate authentication between ranks.

Every rank both accepts (server side) and connects (client side), so a rank needs a server
and a client context. :func:`contexts` builds both from one certificate, key and CA bundle;
``open_group(ssl=...)`` takes that pair, a :class:`TLSConfig`, or one
``ssl.SSLContext`` usable on both sides.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from aiocollect.errors import UsageError


@dataclass(frozen=True)
class TLSConfig:
    """The two contexts a rank needs: ``server`` for accepted links, ``client`` for links it
    opens.

    Attributes:
        server: the context of the links this rank accepts.
        client: the context of the links this rank opens.
    """

    server: ssl.SSLContext
    client: ssl.SSLContext


def contexts(certfile: str, keyfile: str, cafile: str) -> TLSConfig:
    """Mutual TLS: each rank presents ``certfile``/``keyfile`` and requires the peer's
    certificate to chain to ``cafile``. Peers are addressed by IP, so host names are not
    checked; the CA is the trust boundary.

    Args:
        certfile: this rank's certificate (PEM).
        keyfile: its private key (PEM).
        cafile: the CA bundle a peer's certificate must chain to (PEM).

    Returns:
        The server and client contexts, for ``open_group(transport="tls", ssl=...)``.

    Raises:
        UsageError: a file cannot be loaded.
    """
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_cert_chain(certfile, keyfile)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
        client.check_hostname = False
        client.verify_mode = ssl.CERT_REQUIRED
        client.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load TLS files: {exc}") from None
    return TLSConfig(server, client)


def as_config(value: Any) -> TLSConfig:
    """Normalise ``open_group``'s ``ssl=``.

    Args:
        value: a TLSConfig, a ``(server, client)`` pair of ``ssl.SSLContext`` or one
            context for both sides.

    Returns:
        The TLSConfig it stands for.

    Raises:
        UsageError: not a TLSConfig, a (server, client) pair or an SSLContext.
    """
    if isinstance(value, TLSConfig):
        return value
    if isinstance(value, ssl.SSLContext):
        return TLSConfig(value, value)
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, ssl.SSLContext) for v in value)
    ):
        return TLSConfig(value[0], value[1])
    raise UsageError(
        "ssl= must be aiocollect.tls.contexts(...), a (server, client) pair of "
        f"ssl.SSLContext, or one SSLContext; got {type(value).__name__}"
    )


__all__ = ["TLSConfig", "contexts"]
