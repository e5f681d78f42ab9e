"""Soak and chaos: mixed traffic and hostile clients for a while, with the workers killed
and frozen every minute; counts what was sent, answered, lost and duplicated.

Two servers on free loopback ports:
- the packaged all-MiniLM-L6-v2 (feature-extraction, the default model): single texts,
  lists of 4 to 48 texts, OpenAI `/v1/embeddings`, and the hostile clients;
- a tiny random GPT-2 built here (text-generation): token streams (`"stream": true`).

Every minute each server's worker is killed (`kill -9`) once and frozen (`SIGSTOP`, then
`SIGCONT` 5 s later) once. Every ordinary request carries its own `X-Request-Id`; an
answer must echo the id of the request it answers (else it is counted as duplicated: an
answer that belongs to another request), and a request whose connection ends, or whose
answer does not come within the client's timeout, is lost. Embeddings are checked
against the first answer seen for the same text (an answer mixed up between requests
would not match), lists for their length, streams for token indices 1, 2, 3, ... (TGI's
numbering) in order, ending with the final event or an error event.

Hostile clients (their answers are tallied by kind, not counted as traffic): a
slowloris head, binary garbage, an oversized Content-Length, JSON nested 5,000 deep, a
lone surrogate, a chunk size of 2^76, a burst of 100 pipelined requests (these are
counted: each must be answered once; those still unanswered when the hostile client's
60 s cap cuts the burst short are "abandoned", the client's doing), a client that never
reads a large answer, one that leaves mid-body, and 50 connections opened and dropped at
once.

The servers' and workers' RSS are read from /proc at the start (after a warm-up), every
half minute and at the end. Loopback only; stops by itself after `--minutes` plus a
drain of at most `CLIENT_TIMEOUT` seconds.

    python -m bench.chaos --minutes 30 --out bench/chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11

from bench import described, servers
from bench.workloads import texts

HOST = "127.0.0.1"  # loopback only, by design
CLIENT_TIMEOUT = 90.0  # seconds an ordinary request waits for its answer before it is lost
IDLE_RECONNECT = 2.0  # a keep-alive connection idle this long is replaced (server: 5 s)
FREEZE_SECONDS = 5.0
EMBED_TOLERANCE = 1e-3  # batch composition changes floats in the last digits only
RSS_INTERVAL = 30.0
RETRY_AFTER_CAP = 2.0  # seconds a client waits on a 503 (it honours Retry-After up to this)


@dataclass
class Ledger:
    """What ordinary traffic sent and what came back."""

    sent: Counter[str] = field(default_factory=Counter)  # by kind
    answered: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    # given up by the client before an answer came (a hostile burst cut short): not the
    # server's loss, but counted, so sent = answered + lost + abandoned at the end
    abandoned: Counter[str] = field(default_factory=Counter)
    duplicated: Counter[str] = field(default_factory=Counter)
    mismatched: Counter[str] = field(default_factory=Counter)  # wrong content for the request
    statuses: Counter[str] = field(default_factory=Counter)  # "kind status"
    hostile: Counter[str] = field(default_factory=Counter)  # "behaviour status"
    seen_ids: set[str] = field(default_factory=set)
    lost_ids: set[str] = field(default_factory=set)
    references: dict[str, list[float]] = field(default_factory=dict)
    lost_examples: list[str] = field(default_factory=list)

    def answer(self, kind: str, request_id: str, status: int, answer_id: str | None) -> bool:
        """Count an answer; False when it is not the answer to this request."""
        if answer_id != request_id or request_id in self.seen_ids:
            self.duplicated[kind] += 1
            return False
        self.seen_ids.add(request_id)
        self.answered[kind] += 1
        self.statuses[f"{kind} {status}"] += 1
        return True

    def lose(self, kind: str, request_id: str, why: str) -> None:
        self.lost[kind] += 1
        self.lost_ids.add(request_id)
        if len(self.lost_examples) < 20:
            self.lost_examples.append(f"{request_id}: {why}")

    def check_embedding(self, kind: str, text: str, vector: Any) -> None:
        if not isinstance(vector, list) or not vector or not isinstance(vector[0], float):
            self.mismatched[kind] += 1
            return
        reference = self.references.setdefault(text, vector)
        if len(reference) != len(vector) or any(
            abs(a - b) > EMBED_TOLERANCE for a, b in zip(reference, vector, strict=True)
        ):
            self.mismatched[kind] += 1


class Link:
    """One keep-alive HTTP/1.1 client connection, parsed with h11."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.conn = h11.Connection(h11.CLIENT)
        self.last_used = 0.0

    async def open(self) -> None:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        self.conn = h11.Connection(h11.CLIENT)
        self.last_used = time.monotonic()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def exchange(self, path: str, body: bytes, request_id: str) -> Answer:
        """One request and its whole answer."""
        stale = time.monotonic() - self.last_used > IDLE_RECONNECT
        if self.writer is None or stale or self.conn.our_state is not h11.IDLE:
            await self.open()
        assert self.writer is not None and self.reader is not None
        headers = [
            ("Host", HOST),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("X-Request-Id", request_id),
        ]
        self.writer.write(
            self.conn.send(h11.Request(method="POST", target=path, headers=headers))
            + self.conn.send(h11.Data(data=body))
            + self.conn.send(h11.EndOfMessage())
        )
        answer, chunks = Answer(), []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise ConnectionError("closed before the answer ended")
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                answer = Answer.of(event)
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before the answer")
        answer.body = b"".join(chunks)
        self.last_used = time.monotonic()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        else:
            self.close()
        return answer


@dataclass
class Answer:
    status: int = 0
    request_id: str | None = None  # the X-Request-Id it echoes
    retry_after: float = 0.0
    body: bytes = b""

    @classmethod
    def of(cls, response: h11.Response) -> Answer:
        retry_after = _header(response.headers, b"retry-after")
        return cls(
            response.status_code,
            _header(response.headers, b"x-request-id"),
            float(retry_after) if retry_after else 0.0,
        )


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Chaos:
    def __init__(self, args: argparse.Namespace, embed_port: int, stream_port: int):
        self.args = args
        self.embed_port = embed_port
        self.stream_port = stream_port
        self.ledger = Ledger()
        self.texts = texts("mixed", 256)
        self.rng = random.Random(14)
        self.ids = iter(range(10**12))
        self.end = 0.0
        self.events: list[str] = []

    def new_id(self, kind: str) -> str:
        return f"chaos-{kind}-{next(self.ids)}"

    # --- ordinary traffic --------------------------------------------------------------

    async def one(
        self, link: Link, kind: str, path: str, body: bytes, check, decode: bool = True
    ) -> None:
        request_id = self.new_id(kind)
        self.ledger.sent[kind] += 1
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT):
                answer = await link.exchange(path, body, request_id)
        except (ConnectionError, OSError, h11.ProtocolError, TimeoutError) as exc:
            link.close()
            self.ledger.lose(kind, request_id, f"{type(exc).__name__}: {exc}")
            return
        if self.ledger.answer(kind, request_id, answer.status, answer.request_id):
            if answer.status == 200:
                check(json.loads(answer.body) if decode else answer.body)
            elif answer.retry_after:  # as a well-behaved client does, within reason
                await asyncio.sleep(min(answer.retry_after, RETRY_AFTER_CAP))

    async def embed_client(self) -> None:
        link = Link(self.embed_port)
        while time.monotonic() < self.end:
            text = self.rng.choice(self.texts)
            body = json.dumps({"inputs": text}).encode()
            await self.one(
                link,
                "embed",
                "/",
                body,
                lambda a, t=text: self.ledger.check_embedding("embed", t, a),
            )
        link.close()

    async def list_client(self) -> None:
        link = Link(self.embed_port)
        while time.monotonic() < self.end:
            batch = self.rng.sample(self.texts, self.rng.randint(4, 48))
            body = json.dumps({"inputs": batch}).encode()
            await self.one(link, "list", "/", body, lambda a, b=batch: self.check_list(b, a))
        link.close()

    def check_list(self, batch: list[str], answer: Any) -> None:
        if not isinstance(answer, list) or len(answer) != len(batch):
            self.ledger.mismatched["list"] += 1
            return
        for text, vector in zip(batch, answer, strict=True):
            self.ledger.check_embedding("list", text, vector)

    async def openai_client(self) -> None:
        link = Link(self.embed_port)
        while time.monotonic() < self.end:
            batch = self.rng.sample(self.texts, self.rng.randint(1, 8))
            body = json.dumps({"input": batch}).encode()  # the default model
            await self.one(
                link, "openai", "/v1/embeddings", body, lambda a, b=batch: self.check_openai(b, a)
            )
            await asyncio.sleep(0.05)
        link.close()

    def check_openai(self, batch: list[str], answer: Any) -> None:
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or [d.get("index") for d in data] != list(range(len(batch))):
            self.ledger.mismatched["openai"] += 1
            return
        for text, entry in zip(batch, data, strict=True):
            self.ledger.check_embedding("openai", text, entry.get("embedding"))

    async def stream_client(self) -> None:
        link = Link(self.stream_port)
        prompts = ["hello world", "the city of", "i like the", "what is the name of"]
        while time.monotonic() < self.end:
            document = {
                "inputs": self.rng.choice(prompts),
                "stream": True,
                "parameters": {"max_new_tokens": self.rng.randint(8, 48)},
            }
            body = json.dumps(document).encode()
            await self.one(link, "stream", "/", body, self.check_stream, decode=False)
        link.close()

    def check_stream(self, answer: bytes) -> None:
        events = stream_events(answer)
        if not stream_whole(events):
            self.ledger.mismatched["stream"] += 1
        if events and "error" in events[-1]:
            self.ledger.statuses["stream error-event"] += 1

    # --- hostile clients ---------------------------------------------------------------

    async def hostile_client(self) -> None:
        behaviours = [
            self.slowloris,
            self.garbage,
            self.oversized,
            self.deep_json,
            self.surrogate,
            self.huge_chunk,
            self.pipeline_burst,
            self.never_reads,
            self.leaves_mid_body,
            self.connection_burst,
        ]
        while time.monotonic() < self.end:
            behaviour = self.rng.choice(behaviours)
            try:
                async with asyncio.timeout(60):
                    outcome = await behaviour()
            except (ConnectionError, OSError, TimeoutError) as exc:
                outcome = type(exc).__name__
            self.ledger.hostile[f"{behaviour.__name__} {outcome}"] += 1
            await asyncio.sleep(0.2)

    async def raw(self, data: bytes, read: bool = True, wait: float = 15.0) -> str:
        """Send bytes on a connection of their own; the status of the first answer."""
        reader, writer = await asyncio.open_connection(HOST, self.embed_port)
        try:
            writer.write(data)
            if not read:
                return "sent"
            async with asyncio.timeout(wait):
                head = await reader.readuntil(b"\r\n")
            return head.split()[1].decode() if head.startswith(b"HTTP/") else "garbled"
        except asyncio.IncompleteReadError:
            return "closed"
        finally:
            writer.close()

    async def slowloris(self) -> str:
        return await self.raw(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Ty", wait=20)

    async def garbage(self) -> str:
        return await self.raw(bytes(self.rng.randrange(256) for _ in range(512)))

    async def oversized(self) -> str:
        return await self.raw(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2000000\r\n\r\n")

    async def deep_json(self) -> str:
        body = b'{"inputs": ' + b"[" * 5000 + b'"x"' + b"]" * 5000 + b"}"
        return await self.raw(_post_bytes(body))

    async def surrogate(self) -> str:
        return await self.raw(_post_bytes(b'{"inputs": "a\\ud800b"}'))

    async def huge_chunk(self) -> str:
        head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        return await self.raw(head + b"%x\r\nabc" % 2**76, wait=40)

    async def pipeline_burst(self) -> str:
        """100 pipelined requests in one write: each answered once, in order (counted).

        When the server answers one with `Connection: close` (a 5xx other than 503), the
        ones after it were never read: they are sent again on a new connection, as an
        HTTP client does."""
        pending = []
        for _ in range(100):
            request_id = self.new_id("pipelined")
            self.ledger.sent["pipelined"] += 1
            body = json.dumps({"inputs": self.rng.choice(self.texts)}).encode()
            pending.append((request_id, _post_bytes(body, request_id)))
        ids = [request_id for request_id, _ in pending]
        connections = 0
        try:
            while pending and connections < 10:
                connections += 1
                answered = await self.one_burst(pending)
                pending = pending[answered:]
        finally:  # cut short (the hostile client's time cap) or out of connections
            ledger = self.ledger
            for request_id in ids:
                if request_id not in ledger.seen_ids and request_id not in ledger.lost_ids:
                    ledger.abandoned["pipelined"] += 1
        return f"{connections}-connections"

    async def one_burst(self, burst: list[tuple[str, bytes]]) -> int:
        """Send `burst` pipelined on a new connection; how many were answered in order."""
        reader, writer = await asyncio.open_connection(HOST, self.embed_port)
        writer.write(b"".join(data for _, data in burst))
        conn = h11.Connection(h11.CLIENT)
        answered = 0
        try:
            for request_id, _ in burst:
                conn.send(h11.Request(method="POST", target="/", headers=[("Host", "a")]))
                conn.send(h11.EndOfMessage())  # (the client's bookkeeping of what it sent)
                answer = Answer()
                async with asyncio.timeout(CLIENT_TIMEOUT):
                    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                        if event is h11.NEED_DATA:
                            chunk = await reader.read(1 << 16)
                            if not chunk:
                                raise ConnectionError("closed mid-burst")
                            conn.receive_data(chunk)
                        elif isinstance(event, h11.Response):
                            answer = Answer.of(event)
                self.ledger.answer("pipelined", request_id, answer.status, answer.request_id)
                answered += 1
                if conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                    return answered  # the server closes: the rest were never read
                conn.start_next_cycle()
        except (ConnectionError, OSError, TimeoutError, h11.ProtocolError) as exc:
            for request_id, _ in burst[answered:]:
                self.ledger.lose("pipelined", request_id, f"{type(exc).__name__}: {exc}")
            return len(burst)
        finally:
            writer.close()
        return answered

    async def never_reads(self) -> str:
        batch = self.rng.sample(self.texts, 48)
        reader, writer = await asyncio.open_connection(HOST, self.embed_port)
        writer.write(_post_bytes(json.dumps({"inputs": batch * 4}).encode()))
        await asyncio.sleep(10)  # never reads; then leaves
        writer.close()
        return "left"

    async def leaves_mid_body(self) -> str:
        head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        return await self.raw(head + b'Content-Length: 1000\r\n\r\n{"inputs": "ha', read=False)

    async def connection_burst(self) -> str:
        opened = await asyncio.gather(
            *(asyncio.open_connection(HOST, self.embed_port) for _ in range(50)),
            return_exceptions=True,
        )
        for pair in opened:
            if not isinstance(pair, BaseException):
                pair[1].close()
        return f"{sum(not isinstance(p, BaseException) for p in opened)}-opened"

    # --- chaos -------------------------------------------------------------------------

    async def worker_pid(self, port: int) -> int | None:
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(b"GET /info HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                data = await reader.read()
                writer.close()
            pids = json.loads(data.split(b"\r\n\r\n", 1)[1])["worker_pids"]
            return pids[0] if pids else None
        except (OSError, TimeoutError, ValueError, KeyError, IndexError):
            return None

    async def chaos(self, started: float) -> None:
        minute = 0
        while True:
            for offset, port, action in (
                (20, self.embed_port, "kill"),
                (25, self.stream_port, "kill"),
                (40, self.embed_port, "freeze"),
                (45, self.stream_port, "freeze"),
            ):
                at = started + 60 * minute + offset
                if at > self.end - 5:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                pid = await self.worker_pid(port)
                name = "embed" if port == self.embed_port else "stream"
                if pid is None:
                    self.events.append(f"{at - started:.0f}s {name}: no worker to {action}")
                    continue
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    await asyncio.sleep(FREEZE_SECONDS)
                    os.kill(pid, signal.SIGCONT)
                self.events.append(f"{time.monotonic() - started:.0f}s {name}: {action} {pid}")
            minute += 1


def stream_events(answer: bytes) -> list[dict[str, Any]]:
    """A server-sent event stream's `data:` events, decoded (comments left out)."""
    return [
        json.loads(line.removeprefix(b"data:"))
        for line in answer.split(b"\n\n")
        if line.startswith(b"data:")
    ]


def stream_whole(events: list[dict[str, Any]]) -> bool:
    """Whether a token stream is whole and in order: its tokens numbered 1, 2, 3, ... as
    TGI numbers them (the README's example), ending with the final event (the whole text)
    or with an error event."""
    tokens = [event for event in events if "index" in event]
    finished = bool(events) and (
        "error" in events[-1] or events[-1].get("generated_text") is not None
    )
    return finished and [event["index"] for event in tokens] == list(range(1, len(tokens) + 1))


def _post_bytes(body: bytes, request_id: str | None = None) -> bytes:
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    if request_id:
        head += b"X-Request-Id: " + request_id.encode() + b"\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def memory(process: servers.ServerProcess) -> dict[str, int]:
    """RSS of the server process and of its model worker(s), bytes."""
    below = [pid for pid in servers.descendants(process.pid) if pid != process.pid]
    workers = [pid for pid in below if _is_worker(pid)]
    return {
        "server": servers.rss_bytes(process.pid),
        "workers": sum(servers.rss_bytes(pid) for pid in workers),
    }


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"resource_tracker" not in cmdline.read()
    except OSError:
        return False


async def wait_ready(port: int, process: servers.ServerProcess, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not process.alive():
            raise RuntimeError(f"{process.name} exited; see {process.log_path}")
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"GET /ready HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            head = await reader.read()
            writer.close()
            if head.startswith(b"HTTP/1.1 200"):
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{process.name} not ready in {timeout:.0f} s")


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sys.path.insert(0, str(servers.REPO_ROOT))
    from tests import tiny_models  # a tiny random GPT-2, built locally (nothing downloaded)

    gpt2 = tiny_models.build("text-generation", workdir / "tiny-gpt2")
    server_args = ["--no-access-log", "--threads", "1"]
    embed = servers.rawserve(None, workdir / "embed.log", server_args)
    stream = servers.rawserve(str(gpt2), workdir / "stream.log", server_args)
    embed.name, stream.name = "minilm", "tiny-gpt2"
    for process in (embed, stream):
        process.start()
    try:
        await wait_ready(embed.port, embed)
        await wait_ready(stream.port, stream)
        chaos = Chaos(args, embed.port, stream.port)
        chaos.end = time.monotonic() + 20  # warm-up: every kind once, references taken
        await asyncio.gather(chaos.embed_client(), chaos.list_client(), chaos.stream_client())
        chaos.ledger = Ledger(references=chaos.ledger.references)
        rss = {"start": {"minilm": memory(embed), "tiny-gpt2": memory(stream)}}
        series = []
        started = time.monotonic()
        chaos.end = started + 60 * args.minutes

        async def watch_memory() -> None:
            while time.monotonic() < chaos.end:
                await asyncio.sleep(RSS_INTERVAL)
                series.append(
                    {
                        "t": round(time.monotonic() - started),
                        "minilm": memory(embed),
                        "tiny-gpt2": memory(stream),
                    }
                )
                ledger = chaos.ledger  # progress so far, one line (lost: so far, not final)
                counts = {
                    "sent": sum(ledger.sent.values()),
                    "answered": sum(ledger.answered.values()),
                    "lost": sum(ledger.lost.values()),
                    "abandoned": sum(ledger.abandoned.values()),
                    "duplicated": sum(ledger.duplicated.values()),
                    "mismatched": sum(ledger.mismatched.values()),
                }
                print(json.dumps({**series[-1], **counts}), flush=True)

        clients = [
            *(chaos.embed_client() for _ in range(args.embed_clients)),
            chaos.list_client(),
            chaos.openai_client(),
            *(chaos.stream_client() for _ in range(2)),
            chaos.hostile_client(),
            chaos.hostile_client(),
            chaos.chaos(started),
            watch_memory(),
        ]
        await asyncio.gather(*clients)
        seconds = time.monotonic() - started
        rss["end"] = {"minilm": memory(embed), "tiny-gpt2": memory(stream)}
    finally:
        exit_codes = {p.name: servers.terminate(p.process, 60) for p in (embed, stream)}
    ledger = chaos.ledger
    return {
        "command": " ".join(["python -m bench.chaos", *sys.argv[1:]]),
        "minutes": args.minutes,
        "seconds": round(seconds, 1),
        "sent": dict(ledger.sent),
        "answered": dict(ledger.answered),
        "lost": dict(ledger.lost),
        "abandoned": dict(ledger.abandoned),
        "duplicated": dict(ledger.duplicated),
        "mismatched": dict(ledger.mismatched),
        "statuses": dict(sorted(ledger.statuses.items())),
        "hostile": dict(sorted(ledger.hostile.items())),
        "chaos_events": chaos.events,
        "lost_examples": ledger.lost_examples,
        "rss": rss,
        "rss_series": series,
        "exit_codes": exit_codes,
        "logs": {
            "minilm": _log_facts(workdir / "embed.log"),
            "tiny-gpt2": _log_facts(workdir / "stream.log"),
        },
    }


def _log_facts(path: Path) -> dict[str, int]:
    text = path.read_text(errors="replace")
    return {
        "tracebacks": text.count("Traceback"),
        "worker_exits": len(servers.worker_ended().findall(text)),
        "leaked_semaphores": text.count("leaked semaphore"),
    }


def report(result: dict[str, Any]) -> str:
    def mb(value: int) -> str:
        return f"{value / 2**20:.0f} MB"

    kinds = sorted(result["sent"])
    lines = [
        "| traffic | sent | answered | lost | abandoned | duplicated | wrong content |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        lines.append(
            f"| {kind} | {result['sent'][kind]} | {result['answered'].get(kind, 0)} | "
            f"{result['lost'].get(kind, 0)} | {result.get('abandoned', {}).get(kind, 0)} | "
            f"{result['duplicated'].get(kind, 0)} | {result['mismatched'].get(kind, 0)} |"
        )
    total = {k: sum(result.get(k, {}).values()) for k in ("sent", "answered", "lost", "abandoned")}
    lines.append(
        f"| **all** | **{total['sent']}** | **{total['answered']}** | **{total['lost']}** | "
        f"**{total['abandoned']}** | **{sum(result['duplicated'].values())}** | "
        f"**{sum(result['mismatched'].values())}** |"
    )
    lines += ["", "| process | RSS at start | RSS at end |", "|---|---|---|"]
    for server in ("minilm", "tiny-gpt2"):
        for part in ("server", "workers"):
            start, end = result["rss"]["start"][server][part], result["rss"]["end"][server][part]
            lines.append(f"| {server} {part} | {mb(start)} | {mb(end)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=described(__doc__))
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="of traffic (the workers killed every minute)"
    )
    parser.add_argument(
        "--embed-clients",
        type=int,
        default=4,
        help="single-text clients (beside a list, an OpenAI and two stream clients)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the servers' logs here (else removed)"
    )
    args = parser.parse_args(argv)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(args, args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="rawserve-chaos-") as workdir:
            result = asyncio.run(run(args, Path(workdir)))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_series",)}, indent=1))
    print(report(result))
    lost = sum(result["lost"].values())
    duplicated = sum(result["duplicated"].values())
    return 0 if lost == 0 and duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
