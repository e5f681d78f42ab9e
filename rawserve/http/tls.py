"""TLS on the listening socket: the server's SSL context, from `--ssl-certfile` and
`--ssl-keyfile` (uvicorn's names). asyncio terminates TLS; the protocol sees plain bytes.

Server process; standard library only.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def server_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A server context with the certificate chain (and key: in `keyfile`, or in `certfile`
    itself); ValueError saying what is wrong when they cannot be loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["http/1.1"])  # the one protocol this server speaks
    for path in (certfile, keyfile):  # load_cert_chain's error names no file
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot load the certificate and key: {reason}") from None
    return context
