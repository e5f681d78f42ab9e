"""TLS on the listening socket (`--ssl-certfile`, `--ssl-keyfile`) and CORS for browsers
(`--cors-allow-origin`), end to end against the real server.

TLS: certificates come from `trustme` (a throwaway CA); real clients (http.client with the
CA trusted, and curl) talk to the server over TLS, and plain HTTP sent to the TLS port is
refused cleanly (closed at once, no HTTP answer, nothing in the log but a line, the server
unharmed). CORS: requests are sent as a browser sends them: a preflight `OPTIONS` with
`Origin` and `Access-Control-Request-*`, then the request itself with `Origin`.
"""

from __future__ import annotations

import datetime
import http.client
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time

import pytest

from rawserve.http.tls import validity_warning
from tests.server import REPO_ROOT, RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

ECHO = ["--handler", "tests.handlers:echo"]
ORIGIN = "https://app.example"
OTHER_ORIGIN = "https://other.example"
API_KEY = "cors-secret"


@pytest.fixture(scope="module")
def ca():
    import trustme

    return trustme.CA()


@pytest.fixture(scope="module")
def certificate_files(ca, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    issued = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile, cafile = folder / "cert.pem", folder / "key.pem", folder / "ca.pem"
    issued.private_key_pem.write_to_path(str(keyfile))
    for index, blob in enumerate(issued.cert_chain_pems):
        blob.write_to_path(str(certfile), append=index > 0)
    ca.cert_pem.write_to_path(str(cafile))
    return certfile, keyfile, cafile


def serving_tls(certificate_files) -> RunningServer:
    certfile, keyfile, _ = certificate_files
    args = [*ECHO, "--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]
    return RunningServer([*args, "--head-timeout", "2"])


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together."""
    origins = ["--cors-allow-origin", ORIGIN, "--cors-allow-origin", OTHER_ORIGIN]
    with started_as_used(
        request,
        {
            "tls_server": lambda: serving_tls(request.getfixturevalue("certificate_files")),
            "combined_tls_server": lambda: RunningServer(
                [*ECHO, "--ssl-certfile", str(request.getfixturevalue("combined_certificate"))]
            ),
            "cors_server": lambda: RunningServer([*ECHO, *origins, "--api-key", API_KEY]),
            "any_origin_server": lambda: RunningServer([*ECHO, "--cors-allow-origin", "*"]),
        },
    ) as server:
        yield server


tls_server = module_server("tls_server")


def https(server, ca, method, path, body=None, headers=None):
    context = ssl.create_default_context()
    ca.configure_trust(context)
    connection = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


# --- TLS ------------------------------------------------------------------------------


def test_a_client_over_tls_is_served(tls_server, ca):
    status, _, body = https(tls_server, ca, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = https(
        tls_server, ca, "POST", "/", json.dumps({"inputs": "over tls"}),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 200 and json.loads(body)["input"] == "over tls"


def test_the_log_says_the_server_listens_on_https(tls_server):
    assert any("listening on https://" in line for line in tls_server.lines)


def test_one_tls_connection_carries_several_requests(tls_server, ca):
    context = ssl.create_default_context()
    ca.configure_trust(context)
    connection = http.client.HTTPSConnection("127.0.0.1", tls_server.port, context=context)
    try:
        for text in ("one", "two", "three"):
            connection.request("POST", "/", body=text)
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["input"] == text
    finally:
        connection.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_over_tls_with_the_ca(tls_server, certificate_files):
    _, _, cafile = certificate_files
    done = subprocess.run(
        ["curl", "-sS", "--cacert", str(cafile), "-d", "curl says hi",
         f"https://localhost:{tls_server.port}/"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["input"] == "curl says hi"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_refuses_a_server_it_cannot_verify(tls_server):
    done = subprocess.run(
        ["curl", "-sS", f"https://localhost:{tls_server.port}/health"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0  # our CA is not in the system's trust store


def test_plain_http_to_the_tls_port_is_refused_cleanly(tls_server, ca):
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        started = time.monotonic()
        received = b""
        while chunk := sock.recv(4096):  # until the server closes
            received += chunk
        assert time.monotonic() - started < 5  # at once, not at a timeout
    assert not received.startswith(b"HTTP/")  # no plain answer; at most a TLS alert
    # A request after it, over TLS: its access line follows whatever the refused
    # connection logged, so once it is there the log can be checked.
    marker = {"X-Request-Id": "after-plain-http"}
    assert https(tls_server, ca, "POST", "/", "still served", marker)[0] == 200
    tls_server.wait_for_log(re.compile(r"after-plain-http$"))  # reads every line up to it
    assert not any("Traceback" in line for line in tls_server.lines)


def test_a_client_that_never_says_hello_is_closed_at_the_head_timeout(tls_server):
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=15) as sock:
        started = time.monotonic()
        assert sock.recv(4096) == b""
        assert time.monotonic() - started < 10  # --head-timeout 2, not asyncio's 60 s


def test_without_cors_options_is_405(tls_server, ca):
    status, headers, _ = https(tls_server, ca, "OPTIONS", "/", headers={"Origin": ORIGIN})
    assert status == 405 and "Access-Control-Allow-Origin" not in headers


BAD_OPTIONS = {
    "missing-file": ["--ssl-certfile", "/nonexistent/cert.pem"],
    "key-only": ["--ssl-keyfile", "/nonexistent/key.pem"],  # a key without a certificate
}


@pytest.fixture(scope="module")
def refused_starts(wrong_tls_files):
    """`refused_starts[case]`: how `python -m rawserve` with the TLS options of that case
    (BAD_OPTIONS, `wrong_tls_files`) ended. Every case runs at once on first use: each
    exits before it listens, and none waits for another."""
    started = {}

    def start(case, args, **options):
        started[case] = subprocess.Popen(
            [sys.executable, "-m", "rawserve", *ECHO, "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, **options,
        )  # fmt: skip

    for case, args in BAD_OPTIONS.items():
        start(case, args)
    for case, ((certfile, keyfile), _) in wrong_tls_files.items():
        args = ["--ssl-certfile", str(certfile)]
        if keyfile is not None:
            args += ["--ssl-keyfile", str(keyfile)]
        start(case, args, stdin=subprocess.DEVNULL)
    ended = {}
    try:
        for case, process in started.items():
            stdout, stderr = process.communicate(timeout=60)
            ended[case] = subprocess.CompletedProcess(
                process.args, process.returncode, stdout, stderr
            )
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return ended


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_tls_options_stop_the_server_with_a_clear_message(refused_starts, case):
    done = refused_starts[case]
    assert done.returncode != 0
    assert "ssl" in done.stderr.lower() and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def wrong_tls_files(ca, tmp_path_factory):
    return bad_tls_files(ca, tmp_path_factory.mktemp("wrong-tls"))


def bad_tls_files(ca, folder):
    """Certificate and key files an operator gets wrong, each with the words its error
    must say."""
    from cryptography.hazmat.primitives import serialization

    issued, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    cert, key = folder / "cert.pem", folder / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    other_key = folder / "other-key.pem"
    other.private_key_pem.write_to_path(str(other_key))
    encrypted = folder / "encrypted-key.pem"
    loaded = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    encrypted.write_bytes(
        loaded.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    der = folder / "cert.der"
    der.write_bytes(ssl.PEM_cert_to_DER_cert(issued.cert_chain_pems[0].bytes().decode()))
    return {
        "encrypted-key": ([cert, encrypted], ["encrypted", "passphrase", str(encrypted)]),
        "key-of-another": ([cert, other_key], ["does not match", str(other_key)]),
        "der-certificate": ([der, key], ["no PEM certificate", str(der)]),
        "key-as-certificate": ([key, cert], ["no PEM certificate", str(key)]),
        "no-key-anywhere": ([cert, None], ["no PEM private key", "--ssl-keyfile"]),
        "a-folder": ([folder, key], ["not a file", str(folder)]),
    }


@pytest.mark.parametrize(
    "case",
    ["encrypted-key", "key-of-another", "der-certificate", "key-as-certificate",
     "no-key-anywhere", "a-folder"],
)  # fmt: skip
def test_wrong_tls_files_are_one_line_naming_the_file_and_what_is_wrong(
    wrong_tls_files, refused_starts, case
):
    _, words = wrong_tls_files[case]
    done = refused_starts[case]  # its stdin /dev/null
    # never OpenSSL's prompt for a passphrase, nor its "[SSL] PEM lib (_ssl.c:3905)"
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("rawserve: error: --ssl-certfile/--ssl-keyfile: ")
    assert all(word in done.stderr for word in words), done.stderr


@pytest.mark.parametrize(
    ("valid", "warning"),
    [
        ((-10, -1), "expired on"),
        ((1, 10), "is not valid before"),
        ((-1, 10), None),
    ],
    ids=["expired", "not-yet-valid", "valid"],
)
def test_a_certificate_out_of_its_dates_is_warned_of(ca, tmp_path, valid, warning):
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = (now + datetime.timedelta(days=days) for days in valid)
    issued = ca.issue_cert("127.0.0.1", not_before=not_before, not_after=not_after)
    certfile = tmp_path / "cert.pem"
    for index, blob in enumerate(issued.cert_chain_pems):  # the leaf first, then its CA
        blob.write_to_path(str(certfile), append=index > 0)
    said = validity_warning(str(certfile), now)
    if warning is None:
        assert said is None
    else:
        day = (not_after if warning == "expired on" else not_before).strftime("%Y-%m-%d")
        assert said is not None and warning in said and day in said and str(certfile) in said


@pytest.fixture(scope="module")
def combined_certificate(certificate_files, tmp_path_factory):
    """The key and the certificate chain in one file, and no --ssl-keyfile."""
    certfile, keyfile, _ = certificate_files
    combined = tmp_path_factory.mktemp("combined") / "combined.pem"
    combined.write_bytes(keyfile.read_bytes() + certfile.read_bytes())
    return combined


combined_tls_server = module_server("combined_tls_server")


def test_a_certificate_file_that_holds_the_key_too_is_enough(combined_tls_server, ca):
    assert https(combined_tls_server, ca, "GET", "/health")[0] == 200


# --- CORS -----------------------------------------------------------------------------


cors_server = module_server("cors_server")
any_origin_server = module_server("any_origin_server")


def preflight(server, path="/", origin=ORIGIN, method="POST", headers="content-type", timeout=60):
    request = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        request["Access-Control-Request-Headers"] = headers
    return server.request("OPTIONS", path, headers=request, timeout=timeout)


def vary(headers):
    return {v.strip().lower() for v in headers.get("vary", "").split(",")}


@pytest.mark.parametrize("origin", [ORIGIN, OTHER_ORIGIN])
def test_preflight_from_an_allowed_origin_allows_the_method_and_headers(cors_server, origin):
    status, headers, body = preflight(
        cors_server, origin=origin, headers="content-type, authorization, x-request-timeout"
    )
    assert status == 204 and body == b""  # no API key: a browser's preflight carries none
    assert "content-length" not in headers  # a 204 says none (RFC 9110 section 8.6)
    assert headers["access-control-allow-origin"] == origin
    assert "POST" in [m.strip() for m in headers["access-control-allow-methods"].split(",")]
    allowed = {h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}
    assert {"content-type", "authorization", "x-request-timeout"} <= allowed
    assert int(headers["access-control-max-age"]) > 0
    assert "origin" in vary(headers)


def test_preflight_for_every_route_the_server_serves(cors_server):
    for path, method in [("/", "POST"), ("/v1/embeddings", "POST"), ("/info", "GET")]:
        status, headers, _ = preflight(cors_server, path, method=method, headers=None)
        assert status == 204, path
        assert headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("asked", ["x-\xff\xfe", "x-\x1b[2J", "x-key\x7f"])
def test_preflight_headers_that_are_not_header_names_are_not_echoed(cors_server, asked):
    """The headers a preflight asks for come back only as header names: bytes outside
    ASCII cannot be written in a head (the answer never came), control characters are no
    header's (they came back raw)."""
    status, headers, _ = preflight(cors_server, headers=asked, timeout=10)
    assert status == 204
    assert "access-control-allow-headers" not in headers


def test_preflight_from_another_origin_is_refused_without_cors_headers(cors_server):
    status, headers, body = preflight(cors_server, origin="https://evil.example")
    assert status == 403
    assert "access-control-allow-origin" not in headers
    assert "evil.example" in json.loads(body)["error"]


def test_preflight_for_a_method_the_route_does_not_serve_is_405(cors_server):
    status, headers, _ = preflight(cors_server, "/health", method="DELETE")
    assert status == 405 and "GET" in headers["allow"]


def test_preflight_for_an_unknown_path_is_404(cors_server):
    assert preflight(cors_server, "/nowhere")[0] == 404


def test_the_answer_to_an_allowed_origin_carries_the_cors_headers(cors_server):
    status, headers, body = cors_server.request(
        "POST", "/", json.dumps({"inputs": "from a page"}),
        {"Origin": ORIGIN, "Content-Type": "application/json",
         "Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    assert status == 200 and json.loads(body)["input"] == "from a page"
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "origin" in vary(headers)
    exposed = {h.strip().lower() for h in headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "server-timing"} <= exposed


def test_an_error_answer_carries_them_too_so_the_page_can_read_it(cors_server):
    status, headers, body = cors_server.request("POST", "/", "no key", {"Origin": ORIGIN})
    assert status == 401 and json.loads(body)["error"]
    assert headers["access-control-allow-origin"] == ORIGIN
    # and its headers: what to send (WWW-Authenticate), when to come back (Retry-After),
    # which methods a path takes (a 405's Allow)
    exposed = {h.strip().lower() for h in headers["access-control-expose-headers"].split(",")}
    assert {"www-authenticate", "retry-after", "allow", "x-request-id"} <= exposed


def test_an_answer_to_another_origin_or_to_no_origin_has_no_cors_headers(cors_server):
    key = {"Authorization": f"Bearer {API_KEY}"}
    for extra in ({"Origin": "https://evil.example"}, {}):
        status, headers, _ = cors_server.request("POST", "/", "hello", {**key, **extra})
        assert status == 200
        assert "access-control-allow-origin" not in headers
        # a shared cache must not hand this answer to an allowed page, nor theirs to this one
        assert "origin" in vary(headers)


def test_an_options_that_is_no_preflight_is_an_ordinary_request(cors_server):
    status, headers, _ = cors_server.request("OPTIONS", "/", headers={"Origin": ORIGIN})
    assert status == 401  # not a preflight: it needs the key like any request
    key = {"Authorization": f"Bearer {API_KEY}"}
    status, headers, _ = cors_server.request("OPTIONS", "/", headers={"Origin": ORIGIN, **key})
    assert status == 405 and headers["allow"] == "POST"


def test_star_allows_any_origin(any_origin_server):
    status, headers, _ = preflight(any_origin_server, origin="https://anywhere.example")
    assert status == 204 and headers["access-control-allow-origin"] == "*"
    status, headers, _ = any_origin_server.request(
        "POST", "/", "hi", {"Origin": "https://anywhere.example"}
    )
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "vary" not in headers  # the same answer for every origin


def raw_exchange(server, head: bytes) -> tuple[int, dict[str, str]]:
    """Send `head` alone and read the one answer (the server closes after it)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    lines = received.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers


def test_the_413_for_an_announced_body_too_large_carries_them(cors_server):
    head = (
        b"POST / HTTP/1.1\r\nHost: x\r\nOrigin: " + ORIGIN.encode() + b"\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 99999999\r\n\r\n"
    )
    status, headers = raw_exchange(cors_server, head)
    assert status == 413 and headers["access-control-allow-origin"] == ORIGIN.lower()


def test_two_authorization_headers_are_400_in_either_order(cors_server):
    for tokens in ([API_KEY, "wrong"], ["wrong", API_KEY]):
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n"
        head += b"".join(b"Authorization: Bearer %s\r\n" % t.encode() for t in tokens)
        status, _ = raw_exchange(cors_server, head + b"\r\nhi")
        assert status == 400
