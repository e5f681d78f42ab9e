"""TLS on the listening socket: the server's SSL context, from `--ssl-certfile` and
`--ssl-keyfile` (uvicorn's names). asyncio terminates TLS; the protocol sees plain bytes.

Server process; standard library only.
"""

from __future__ import annotations

import datetime
import re
import ssl
from pathlib import Path

CERTIFICATE_PEM = re.compile(
    r"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL
)
# OpenSSL's reasons for a key that is not the certificate's: another key of the same kind,
# or one of another kind (an EC key beside an RSA certificate)
KEY_MISMATCHES = ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED")
PRIVATE_KEY_PEM = "PRIVATE KEY-----"  # PKCS#8's, RSA's and EC's own, encrypted or not
# DER tags read in a certificate: its explicit version ([0]), and UTCTime (a validity's
# two-digit years; GeneralizedTime, 0x18, has four)
EXPLICIT_VERSION, UTC_TIME = 0xA0, 0x17


class EncryptedKey(Exception):
    """The private key asks for a passphrase, which a server started unattended has no
    one to type (OpenSSL would otherwise prompt on the terminal, or fail obscurely)."""


def server_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A server context with the certificate chain (and key: in `keyfile`, or in `certfile`
    itself); ValueError saying what is wrong, and in which file, when they cannot be loaded
    (OpenSSL's own error names no file: "[SSL] PEM lib")."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["http/1.1"])  # the one protocol this server speaks
    for path in (certfile, keyfile):
        if path is not None and not Path(path).exists():
            raise ValueError(f"no such file: {path}")
        if path is not None and not Path(path).is_file():
            raise ValueError(f"not a file: {path}")
    keysource = keyfile or certfile
    certificates = read_text(certfile)
    if not CERTIFICATE_PEM.search(certificates):
        raise ValueError(f"{certfile} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if PRIVATE_KEY_PEM not in (read_text(keyfile) if keyfile else certificates):
        where = "" if keyfile else " (give the key with --ssl-keyfile)"
        raise ValueError(f"{keysource} holds no PEM private key{where}")
    try:
        context.load_cert_chain(certfile, keyfile, password=refuse_passphrase)
    except EncryptedKey:
        raise ValueError(
            f"the private key in {keysource} is encrypted: give it without a passphrase "
            "(openssl pkey -in KEY -out PLAIN_KEY)"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason in KEY_MISMATCHES:
            raise ValueError(
                f"the private key in {keysource} does not match the certificate in {certfile}"
            ) from None
        raise ValueError(f"cannot load the certificate and key: {exc.reason or exc}") from None
    except OSError as exc:
        raise ValueError(f"cannot load the certificate and key: {exc.strerror or exc}") from None
    return context


def refuse_passphrase() -> str:
    raise EncryptedKey


def read_text(path: str) -> str:
    """A PEM file's text (a DER file reads as text without any PEM block)."""
    try:
        return Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None


def validity_warning(certfile: str, now: datetime.datetime) -> str | None:
    """What to warn of when the server's certificate (the first in `certfile`) is not
    valid at `now`: served anyway (as nginx does), but every client that verifies it
    refuses the connection, which the operator would otherwise learn from them."""
    not_before, not_after = certificate_validity(certfile)
    if now > not_after:
        return f"the certificate in {certfile} expired on {not_after:%Y-%m-%d %H:%M} UTC"
    if now < not_before:
        return f"the certificate in {certfile} is not valid before {not_before:%Y-%m-%d %H:%M} UTC"
    return None


def certificate_validity(certfile: str) -> tuple[datetime.datetime, datetime.datetime]:
    """notBefore and notAfter of the first certificate in `certfile` (already loaded by
    OpenSSL, so well formed), read from its DER: Certificate ::= SEQUENCE { tbsCertificate
    SEQUENCE { [0] version OPTIONAL, serial, signature, issuer, validity SEQUENCE {...} } }."""
    block = CERTIFICATE_PEM.search(read_text(certfile))
    assert block is not None  # server_context found it
    der = ssl.PEM_cert_to_DER_cert(block.group(0))
    tbs = der_children(der, der_element(der, 0))[0]
    fields = der_children(der, tbs)
    if der[fields[0][0]] == EXPLICIT_VERSION:
        fields = fields[1:]
    not_before, not_after = der_children(der, fields[3])[:2]
    return der_time(der, not_before), der_time(der, not_after)


def der_element(der: bytes, offset: int) -> tuple[int, int, int]:
    """(tag offset, contents offset, end) of the DER element at `offset`."""
    length = der[offset + 1]
    contents = offset + 2
    if length & 0x80:  # the long form: the next (length & 0x7F) bytes say it
        size = length & 0x7F
        length = int.from_bytes(der[contents : contents + size], "big")
        contents += size
    return offset, contents, contents + length


def der_children(der: bytes, element: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """The elements inside a constructed DER `element` (a SEQUENCE)."""
    _, offset, end = element
    children = []
    while offset < end:
        children.append(der_element(der, offset))
        offset = children[-1][2]
    return children


def der_time(der: bytes, element: tuple[int, int, int]) -> datetime.datetime:
    """A UTCTime (YYMMDDHHMMSSZ, 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ)."""
    tag, contents, end = element
    value = der[contents:end].decode("ascii").rstrip("Z")
    if der[tag] == UTC_TIME:
        value = ("19" if int(value[:2]) >= 50 else "20") + value
    parsed = datetime.datetime.strptime(value[:14], "%Y%m%d%H%M%S")
    return parsed.replace(tzinfo=datetime.UTC)
