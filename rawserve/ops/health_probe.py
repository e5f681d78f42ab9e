"""The container image's health check: `python -m rawserve.ops.health_probe` asks the
server in the container for /health, on the port and scheme it was started with.

It reads them (and the address, where one is bound) as the server did: its command
line (PID 1's, the image's entry point), then RAWSERVE_PORT, RAWSERVE_SSL_CERTFILE and
RAWSERVE_HOST (set empty: unset), then the defaults: 8000, or
for SageMaker's `serve` SAGEMAKER_BIND_TO_PORT, else 8080. (Read from the variables alone,
a server started with `--port` or as `serve` was reported unhealthy while it served, and
`RAWSERVE_PORT=` asked port 80.) Exit code 0: healthy. Standard library only: it runs
every few seconds.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request
from collections.abc import Sequence

# --port's default, and SageMaker's command and port (rawserve.options reads them here:
# one place for the server's choice and the probe's)
DEFAULT_PORT = 8000
SAGEMAKER_COMMAND, SAGEMAKER_PORT = "serve", 8080
TIMEOUT_SECONDS = 4
EVERY_INTERFACE = ("", "0.0.0.0", "::")


def server_arguments(cmdline_path: str = "/proc/1/cmdline") -> list[str]:
    """The arguments the server was started with (after `-m rawserve`, or the `rawserve`
    command), from its command line; none where it cannot be read."""
    try:
        with open(cmdline_path, "rb") as cmdline:
            words = [w.decode(errors="replace") for w in cmdline.read().split(b"\0") if w]
    except OSError:
        return []
    for index, word in enumerate(words):
        if os.path.basename(word) == "rawserve":  # (`-m rawserve`'s, or the command's)
            return words[index + 1 :]
    return []


def flag_value(arguments: Sequence[str], flag: str) -> str | None:
    """The last value given to `flag` (as `--flag V` or `--flag=V`), or None."""
    value = None
    for index, word in enumerate(arguments):
        if word == flag and index + 1 < len(arguments):
            value = arguments[index + 1]
        elif word.startswith(flag + "="):
            value = word.partition("=")[2]
    return value


def variable(name: str) -> str | None:
    """A variable's value; None where it is unset or blank (as the server reads it)."""
    value = os.environ.get(name, "").strip()
    return value or None


def health_url(arguments: Sequence[str]) -> str:
    serve = arguments[:1] == [SAGEMAKER_COMMAND]
    fallback = (variable("SAGEMAKER_BIND_TO_PORT") or SAGEMAKER_PORT) if serve else DEFAULT_PORT
    port = flag_value(arguments, "--port") or variable("RAWSERVE_PORT") or fallback
    tls = flag_value(arguments, "--ssl-certfile") or variable("RAWSERVE_SSL_CERTFILE")
    host = flag_value(arguments, "--host") or variable("RAWSERVE_HOST") or ""
    # every interface: its loopback answers; one address: that one (IPv6 in brackets)
    if host in EVERY_INTERFACE:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}/health"


def main() -> int:
    url = health_url(server_arguments())
    # its own certificate need not name 127.0.0.1; a proxy for the Hub must not take it
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(url, timeout=TIMEOUT_SECONDS) as answer:
            return 0 if answer.status == 200 else 1
    except (OSError, ValueError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
