"""A fleet: a router (vllm-router) in front of several vLLM replicas, watched replica by replica.

Where the replicas come from: a small config (JSON or TOML: a router URL and its replicas, each optionally with the
loopback port its OpenTelemetry spans are exported to) or the router's own listing (vllm-router's `GET
/list_workers`: `{"urls": [...]}`). Per replica, each scrape of its `/metrics` gives waiting and running requests,
KV-cache use, the prefix-cache hit rate and generation tokens/s (the counter's change between two scrapes).

Which replica served a request: the router does not say (its answer is the replica's, unchanged), so each replica
exports its spans to a receiver of its own (engine.remote.otlp, one port each): the receiver a request's span arrives
at names the replica. Each replica's own request log and /metrics counters are left as the independent check.

Everything read from the router or a replica is bounded in bytes and time, and a bad answer is one FleetError
sentence; loopback only for what this module starts (start_router, launched).
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.remote.metrics import parse_prometheus
from engine.text import clean_text, display_url, server_address

MAX_REPLICAS = 16
MAX_CONFIG = 64 << 10  # a fleet's config file
MAX_LISTING = 256 << 10  # the router's /list_workers answer
MAX_METRICS = 4 << 20  # one replica's /metrics (vLLM's is tens of kB)
TIMEOUT_S = 5.0  # one GET, connection to last byte
POLICIES = ("round_robin", "cache_aware", "random", "power_of_two", "consistent_hash")


class FleetError(ValueError):
    """A fleet's config, listing or replica answered something unusable; the message is one sentence."""


@dataclass(frozen=True)
class Replica:
    url: str
    name: str
    spans_port: int | None = None  # where this replica exports its spans (OTLP/HTTP on 127.0.0.1)


@dataclass(frozen=True)
class FleetConfig:
    router: str
    replicas: tuple[Replica, ...]


def _url(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise FleetError(f"{what} is {type(value).__name__}, not a URL")
    try:
        parts, _ = server_address(value)
    except ValueError as e:
        raise FleetError(f"{what}: {e}") from None
    return f"{parts.scheme}://{parts.netloc}".rstrip("/")


def _replicas(items: object, what: str) -> tuple[Replica, ...]:
    if not isinstance(items, list):
        raise FleetError(f"{what} is {type(items).__name__}, not a list of replicas")
    if not items:
        raise FleetError(f"{what} lists no replica")
    if len(items) > MAX_REPLICAS:
        raise FleetError(f"{what} lists {len(items)} replicas; at most {MAX_REPLICAS} are watched")
    out = []
    for i, item in enumerate(items):
        port = None
        name = f"replica {i + 1}"
        if isinstance(item, dict):
            url = _url(item.get("url"), f"replica {i + 1}'s url")
            if "name" in item:
                if not isinstance(item["name"], str) or not item["name"].strip():
                    raise FleetError(f"replica {i + 1}'s name is not text")
                name = clean_text(item["name"], 40)
            if item.get("spans_port") is not None:
                port = item["spans_port"]
                if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                    raise FleetError(f"replica {i + 1}'s spans_port is {clean_text(repr(port), 40)}, not a port")
        else:
            url = _url(item, f"replica {i + 1}")
        out.append(Replica(url=url, name=name, spans_port=port))
    if len({r.url for r in out}) != len(out):
        raise FleetError(f"{what} names a replica twice")
    return tuple(out)


def parse_config(data: bytes | str) -> FleetConfig:
    """A fleet's config: JSON (`{"router": URL, "replicas": [URL | {"url", "name", "spans_port"}]}`) or the same as
    TOML (`router = "…"` and `[[replicas]]` tables)."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_CONFIG:
        raise FleetError(f"a fleet config is at most {MAX_CONFIG >> 10} KiB; this one is {len(raw) >> 10} KiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FleetError("a fleet config is UTF-8 text; this one is not") from None
    doc: object
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FleetError(f"the fleet config is not valid JSON ({clean_text(str(e), 80)})") from None
    else:
        import tomllib

        try:
            doc = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as e:
            raise FleetError(f"the fleet config is neither JSON nor valid TOML ({clean_text(str(e), 80)})") from None
    if not isinstance(doc, dict):
        raise FleetError(f"a fleet config is a table with router and replicas, not {type(doc).__name__}")
    if "router" not in doc:
        raise FleetError("the fleet config names no router")
    return FleetConfig(router=_url(doc["router"], "the router"),
                       replicas=_replicas(doc.get("replicas"), "the fleet config"))


def load_config(path: str | Path) -> FleetConfig:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG + 1)
    except OSError as e:
        raise FleetError(f"cannot read the fleet config {clean_text(str(p), 120)} ({e.strerror or e})") from None
    return parse_config(data)


def parse_listing(body: bytes) -> tuple[Replica, ...]:
    """vllm-router's `GET /list_workers` (`{"urls": [...]}`) as replicas named 1, 2, … in its order."""
    if len(body) > MAX_LISTING:
        raise FleetError(f"the router's worker listing is over {MAX_LISTING >> 10} KiB: not read")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise FleetError("the router's worker listing is not JSON (expected {\"urls\": [...]})") from None
    if not isinstance(doc, dict) or "urls" not in doc:
        raise FleetError("the router's worker listing has no \"urls\" (expected {\"urls\": [...]})")
    return _replicas(doc["urls"], "the router's worker listing")


# ------------------------------------------------------------------------------------------------ bounded GETs

def http_get(url: str, path: str, max_bytes: int, timeout_s: float = TIMEOUT_S) -> bytes:
    """The body of `GET url+path`: at most `max_bytes`, within `timeout_s` from connecting to the last byte, status
    200; FleetError in one sentence otherwise."""
    parts, port = server_address(url)
    shown = display_url(url) + path
    deadline = time.monotonic() + timeout_s
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, port, timeout=timeout_s)
    # a sender that drips its headers a byte at a time is cut at the deadline too: the socket is shut under it
    watchdog = threading.Timer(timeout_s, _shut, (conn,))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", path, headers={"Accept": "*/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise FleetError(f"{shown} answered HTTP {resp.status}")
        length = resp.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise FleetError(f"{shown} sent {int(length) >> 10} KiB; at most {max_bytes >> 10} KiB is read")
        chunks, n = [], 0
        while True:
            if time.monotonic() > deadline:
                raise FleetError(f"{shown} did not finish its answer within {timeout_s:g} s")
            piece = resp.read1(64 << 10) if hasattr(resp, "read1") else resp.read(64 << 10)
            if not piece:
                break
            n += len(piece)
            if n > max_bytes:
                raise FleetError(f"{shown} sent more than {max_bytes >> 10} KiB; at most that is read")
            chunks.append(piece)
        return b"".join(chunks)
    except FleetError:
        raise
    except (OSError, http.client.HTTPException) as e:
        if time.monotonic() >= deadline:
            raise FleetError(f"{shown} did not finish its answer within {timeout_s:g} s") from None
        raise FleetError(f"{shown} could not be read ({clean_text(str(e) or type(e).__name__, 80)})") from None
    finally:
        watchdog.cancel()
        conn.close()


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def list_workers(router: str, timeout_s: float = TIMEOUT_S) -> tuple[Replica, ...]:
    """The router's replicas, from its own listing."""
    return parse_listing(http_get(router, "/list_workers", MAX_LISTING, timeout_s))


# --------------------------------------------------------------------------------------------- replica figures

@dataclass(frozen=True)
class ReplicaFigures:
    """One scrape of one replica; None where it did not report the figure (or its scrape failed: `error`)."""

    name: str
    url: str
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0–1
    prefix_hit_rate: float | None = None  # hits / queries since it started
    tokens_per_s: float | None = None  # generation tokens/s since the previous scrape
    requests_done: float | None = None  # vllm:request_success_total
    generation_tokens: float | None = None
    prefix_queries: float | None = None  # tokens looked up in the prefix cache since it started
    prefix_hits: float | None = None  # of which found there
    served: int = 0  # requests attributed to it (its spans)
    error: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _num(m: dict[str, float], *names: str) -> float | None:
    for n in names:
        if n in m:
            return m[n]
    return None


def figures(name: str, url: str, m: dict[str, float], previous: tuple[float, float] | None,
            now_s: float) -> ReplicaFigures:
    """A replica's figures from its parsed /metrics; `previous` (time, generation tokens) of the scrape before."""
    gen = _num(m, "vllm:generation_tokens_total")
    q, h = _num(m, "vllm:prefix_cache_queries_total"), _num(m, "vllm:prefix_cache_hits_total")
    rate = None
    if gen is not None and previous is not None and now_s > previous[0] and gen >= previous[1]:
        rate = (gen - previous[1]) / (now_s - previous[0])
    kv = _num(m, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    return ReplicaFigures(
        name=name, url=url, waiting=_num(m, "vllm:num_requests_waiting"), running=_num(m, "vllm:num_requests_running"),
        kv_usage=kv if kv is None or 0 <= kv <= 1 else None,
        prefix_hit_rate=h / q if q and h is not None and 0 <= h <= q else None,
        tokens_per_s=rate if rate is None or math.isfinite(rate) else None,
        requests_done=_num(m, "vllm:request_success_total"), generation_tokens=gen, prefix_queries=q,
        prefix_hits=h)


# -------------------------------------------------------------------------------------------------- the fleet

@dataclass
class Fleet:
    """A router and its replicas; `scrape()` reads each replica once, `attribute()` names who served what."""

    router: str
    replicas: tuple[Replica, ...]
    receivers: dict[str, object] = field(default_factory=dict)  # replica url -> engine.remote.otlp.SpanReceiver
    _last: dict[str, tuple[float, float]] = field(default_factory=dict)
    served: dict[str, str] = field(default_factory=dict)  # response id -> replica name, as attributed

    @classmethod
    def from_config(cls, config: FleetConfig) -> Fleet:
        return cls(router=config.router, replicas=config.replicas)

    @classmethod
    def from_router(cls, router: str, timeout_s: float = TIMEOUT_S) -> Fleet:
        router = _url(router, "the router")
        return cls(router=router, replicas=list_workers(router, timeout_s))

    def listen(self) -> Fleet:
        """Start a span receiver for each replica that names a spans_port."""
        from engine.remote.otlp import receiver_on

        for r in self.replicas:
            if r.spans_port is not None and r.url not in self.receivers:
                self.receivers[r.url] = receiver_on(r.spans_port)
        return self

    def close(self) -> None:
        for rx in self.receivers.values():
            rx.stop()
        self.receivers.clear()

    def scrape(self, timeout_s: float = TIMEOUT_S) -> list[ReplicaFigures]:
        """Each replica's /metrics once (one after another, each bounded); a failed one carries its error."""
        out = []
        counts: dict[str, int] = {}
        for name in self.served.values():
            counts[name] = counts.get(name, 0) + 1
        for r in self.replicas:
            try:
                body = http_get(r.url, "/metrics", MAX_METRICS, timeout_s)
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError:
                    raise FleetError(f"{display_url(r.url)}/metrics is not UTF-8 text") from None
                m = parse_prometheus(text)
                if not any(k.startswith("vllm:") for k in m):
                    raise FleetError(f"{display_url(r.url)}/metrics has no vllm: figures (not a vLLM replica?)")
            except FleetError as e:
                out.append(ReplicaFigures(name=r.name, url=r.url, served=counts.get(r.name, 0), error=str(e)))
                continue
            now = time.monotonic()
            f = figures(r.name, r.url, m, self._last.get(r.url), now)
            if f.generation_tokens is not None:
                self._last[r.url] = (now, f.generation_tokens)
            out.append(ReplicaFigures(**{**f.to_dict(), "served": counts.get(r.name, 0)}))
        return out

    def attribute(self, response_ids: Iterable[str], wait_s: float = 5.0) -> dict[str, str]:
        """Response id -> the name of the replica whose span receiver got its span (waiting up to `wait_s`); ids
        no replica's span names are left out."""
        ids = [i for i in response_ids if i]
        found: dict[str, str] = {}
        deadline = time.monotonic() + wait_s
        for r in self.replicas:
            rx = self.receivers.get(r.url)
            if rx is None:
                continue
            got = rx.wait_for([i for i in ids if i not in found], max(0.0, deadline - time.monotonic()))
            for i in got:
                found.setdefault(i, r.name)
        self.served.update(found)
        return found

    def problems(self) -> list[str]:
        return [f"{r.name}: {p}" for r in self.replicas if (rx := self.receivers.get(r.url)) is not None
                for p in rx.problems()]


# ------------------------------------------------------------------------------------- prompts and what they show

_ROLES = (
    ("a library's help desk", "the library", ("opens at nine", "closes at six", "lends books for three weeks",
                                               "charges nothing for renewals", "keeps maps in the reading room")),
    ("a bicycle repair shop", "the shop", ("fixes brakes and gears", "trues wheels while you wait",
                                           "sells tubes of the common sizes", "replaces worn chains",
                                           "does not repair carbon frames")),
    ("a small bakery", "the bakery", ("bakes bread before dawn", "makes croissants on weekdays",
                                      "puts nuts in the almond cake only", "sells yesterday's loaves at half price",
                                      "takes orders a day ahead")),
    ("a train timetable office", "the railway", ("runs a train every twenty minutes by day",
                                                 "runs one an hour after ten at night", "carries bikes for free",
                                                 "sells day returns at the counter", "announces platforms late")),
)


def _prefix(role: str, place: str, facts: tuple[str, ...], rounds: int = 6) -> str:
    """A system prompt of a few hundred tokens: vLLM caches whole blocks only (128 tokens on its CPU build), so a
    shared prefix must span several for the cache, and the routing that keeps it, to matter."""
    lines = [f"You are a careful assistant for {role}. Answer in one short sentence and never invent what is not "
             "listed here."]
    for k in range(rounds):
        lines += [f"Fact {k * len(facts) + j + 1}: {place} {fact}." for j, fact in enumerate(facts)]
    return " ".join(lines) + " Question: "


PREFIXES = tuple(_prefix(*r) for r in _ROLES)
QUESTIONS = ("When do you open?", "Can I bring a friend?", "What does it cost?", "Is there a discount?",
             "What should I bring?", "Can I pay by card?", "How long does it take?", "Who do I ask?")


_SALTS = itertools.count(int(time.time()))  # another process (a later app) starts elsewhere


def next_salt() -> int:
    """A salt no earlier call in this process gave (shared_prefix_prompts): fresh prefixes for each run."""
    return next(_SALTS)


def shared_prefix_prompts(n: int, groups: int = len(PREFIXES), salt: int = 0) -> list[tuple[int, str]]:
    """`n` prompts as (group, text): `groups` long shared prefixes in turn, each with a different question. A
    `salt` opens every prefix with its own line, so prompts of another salt share no cached block with these."""
    if not 1 <= groups <= len(PREFIXES):
        raise ValueError(f"groups is 1..{len(PREFIXES)}")
    head = f"Session {salt}. " if salt else ""
    return [(i % groups, head + PREFIXES[i % groups] + QUESTIONS[(i // groups) % len(QUESTIONS)])
            for i in range(n)]


def prefix_affinity(groups: Sequence[int], replicas: Sequence[str | None]) -> float | None:
    """The share of attributed requests that went to their prefix group's most used replica (1: each group stayed
    on one replica; 1/replicas: spread evenly). None when no request was attributed."""
    by_group: dict[int, dict[str, int]] = {}
    for g, r in zip(groups, replicas, strict=True):
        if r is not None:
            by_group.setdefault(g, {})
            by_group[g][r] = by_group[g].get(r, 0) + 1
    total = sum(sum(c.values()) for c in by_group.values())
    return sum(max(c.values()) for c in by_group.values()) / total if total else None


def p50(xs: Sequence[float]) -> float | None:
    """The median, as numpy's percentile(…, 50) (vllm bench serve's median)."""
    if not xs:
        return None
    s = sorted(xs)
    mid = (len(s) - 1) / 2
    lo, hi = s[math.floor(mid)], s[math.ceil(mid)]
    return lo + (hi - lo) * (mid - math.floor(mid))


# --------------------------------------------------------------------------------- a fleet started on loopback

def router_python() -> Path | None:
    """vllm-router's launcher in the vLLM environment (`make servers`), or None."""
    from engine.remote.launch import VENVS

    p = VENVS / "vllm" / "bin" / "vllm-router"
    return p if p.exists() else None


def start_router(worker_urls: Sequence[str], policy: str, log_dir: Path, timeout_s: float = 60.0):
    """vllm-router on 127.0.0.1 in front of `worker_urls` with `policy`; RuntimeError when it cannot start."""
    from engine.remote import launch

    exe = router_python()
    if exe is None:
        raise RuntimeError(f"vllm-router is not installed in {launch.VENVS / 'vllm'} (make servers installs it)")
    if policy not in POLICIES:
        raise ValueError(f"policy is one of {', '.join(POLICIES)}")
    port = launch.free_port()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *worker_urls, "--worker-startup-timeout-secs", str(int(timeout_s)),
           "--prometheus-port", str(launch.free_port()), "--log-level", "warning"]
    return launch._start("vllm-router", cmd, env, Path(log_dir) / f"router-{policy}-{port}.log", port, timeout_s)


@contextmanager
def launched(hf_dir: Path, log_dir: Path, replicas: int = 2, timeout_s: float = 420.0) -> Iterator[list]:
    """`replicas` vLLMs of `hf_dir` on loopback, each exporting its spans to a receiver of its own and logging the
    ids of the requests it receives; yields [(RunningServer, SpanReceiver)], all stopped after."""
    from engine.remote import launch
    from engine.remote.otlp import SpanReceiver

    started: list = []
    try:
        for _ in range(replicas):
            rx = SpanReceiver().start()
            started.append([None, rx])
            started[-1][0] = launch.start_vllm(hf_dir, log_dir, otlp_endpoint=rx.endpoint, timeout_s=timeout_s,
                                               extra_args=["--enable-log-requests"])
        yield [tuple(s) for s in started]
    finally:
        for server, rx in started:
            if server is not None:
                server.stop()
            rx.stop()


def logged_requests(log: str) -> set[str]:
    """The engine request ids a vLLM log says it received (`--enable-log-requests`: "Received request ID: params…")."""
    import re

    return set(re.findall(r"Received request (\S+?): params", log))


# ------------------------------------------------------------------------------------------ a run through the router

def _done(figs: Sequence[ReplicaFigures]) -> dict[str, float | None]:
    return {f.name: f.requests_done for f in figs}


def _hit_rate(before: Sequence[ReplicaFigures], after: Sequence[ReplicaFigures]) -> float | None:
    """Prefix-cache hits over lookups (tokens) between two scrapes of every replica."""
    q = h = 0.0
    for b, a in zip(before, after, strict=True):
        if None in (b.prefix_queries, b.prefix_hits, a.prefix_queries, a.prefix_hits):
            return None
        q += a.prefix_queries - b.prefix_queries
        h += a.prefix_hits - b.prefix_hits
    return h / q if q > 0 else None


def run_policy(fleet: Fleet, router_url: str, policy: str, num_prompts: int = 64, max_new_tokens: int = 4,
               concurrency: int = 4, time_limit_s: float = 240.0, span_wait_s: float = 10.0,
               groups: int = len(PREFIXES), salt: int = 0) -> dict:
    """One bounded load run through the router on shared-prefix prompts (engine.remote.loadlab, as the Load lab
    measures), each request attributed to a replica by its span; with each replica's /metrics request counter
    before and after (its own count of what it served), for a check that does not use the spans."""
    from engine.remote import loadlab
    from engine.remote.backend import RemoteBackend

    prompts = shared_prefix_prompts(num_prompts, groups, salt)
    backend = RemoteBackend(router_url, timeout=60.0)
    backend.probe()
    first = fleet.scrape()
    before = _done(first)
    results: list = []
    run = loadlab.run_once(backend, concurrency, num_prompts, max_new_tokens, time_limit_s=time_limit_s,
                           prompts=[p for _, p in prompts], on_request=results.append)
    served = fleet.attribute([r.request_id for r in results if r.ok], span_wait_s)
    ok = sorted((r for r in results if r.ok), key=lambda r: r.index)
    # a replica counts a request as done as it finishes it, a moment after its last chunk: wait for the count
    deadline = time.monotonic() + span_wait_s
    while True:
        last = fleet.scrape()
        after = _done(last)
        counted = {k: (after[k] - before[k]) if after.get(k) is not None and before.get(k) is not None else None
                   for k in after}
        if sum(v or 0 for v in counted.values()) >= len(ok) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    names = [served.get(r.request_id) for r in ok]
    per: dict[str, int] = {r.name: 0 for r in fleet.replicas}
    for n in names:
        if n is not None:
            per[n] += 1
    ttft = [r.ttft_s * 1e3 for r in ok]
    return {
        "policy": policy, "router": display_url(router_url), "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens, "concurrency": concurrency, "prefix_groups": groups,
        "completed": run.completed, "failed": run.failed, "ttft_p50_ms": p50(ttft),
        "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
        "attributed": sum(per.values()), "served": per, "replica_counted": counted,
        "prefix_hit_rate": _hit_rate(first, last),
        "prefix_affinity": prefix_affinity([prompts[r.index][0] for r in ok], names),
        "requests": [{"index": r.index, "group": prompts[r.index][0], "response_id": r.request_id,
                      "replica": served.get(r.request_id), "ttft_ms": r.ttft_s * 1e3} for r in ok],
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "problems": fleet.problems(),
    }


def compare_policies(hf_dir: Path, log_dir: Path, policies: Sequence[str] = ("round_robin", "cache_aware"),
                     replicas: int = 2, **kw) -> dict:
    """Start `replicas` vLLMs of `hf_dir` on loopback, then for each policy a vllm-router in front of them and one
    run_policy through it; everything started is stopped before this returns. Each policy's run starts with the
    prefixes of its own (`salt`), so the first policy warms no replica's cache for the second."""
    log_dir = Path(log_dir)
    with launched(hf_dir, log_dir, replicas) as fleet_servers:
        reps = tuple(Replica(url=s.url, name=f"replica {i + 1}") for i, (s, _) in enumerate(fleet_servers))
        runs = []
        for policy in policies:
            router = start_router([r.url for r in reps], policy, log_dir)
            fleet = Fleet(router=router.url, replicas=reps,
                          receivers={r.url: rx for r, (_, rx) in zip(reps, fleet_servers, strict=True)})
            try:
                runs.append(run_policy(fleet, router.url, policy, salt=len(runs), **kw))
            finally:
                router.stop()
        logs = {r.name: len(logged_requests(s.log.read_text(errors="replace")))
                for r, (s, _) in zip(reps, fleet_servers, strict=True)}
    return {"replicas": [r.url for r in reps], "runs": runs, "requests_logged": logs}



# ------------------------------------------------------------------------------------- watched from the engine process

MAX_SERVED = 4096  # attributed requests a watcher reports (the newest)


def open_fleet(source: str) -> Fleet:
    """A fleet from `source`: a config file (a path that exists, or ends .toml/.json) or a router's URL (its
    replicas from its listing); FleetError in one sentence."""
    source = source.strip()
    if not source:
        raise FleetError("name a router's URL or a fleet config file")
    if source.lower().endswith((".toml", ".json")) or Path(source).expanduser().is_file():
        return Fleet.from_config(load_config(Path(source).expanduser()))
    return Fleet.from_router(source)


class FleetWatcher:
    """Scrapes a fleet every `interval_s` on a thread of its own and gives `send` one status each time: a
    FleetStatus-like dict of keyword arguments (router, replicas, served, error, problems)."""

    def __init__(self, source: str, send, interval_s: float = 1.0) -> None:
        self.source, self.send, self.interval_s = source, send, max(0.2, float(interval_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fleet-watch")
        self.fleet: Fleet | None = None

    def start(self) -> FleetWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * TIMEOUT_S + 1)

    def _run(self) -> None:
        try:
            fleet = open_fleet(self.source)
            fleet.listen()
        except (FleetError, ValueError, OSError) as e:  # the receivers' OTLPError is a ValueError
            self.send({"router": "", "error": clean_text(str(e), 300)})
            return
        self.fleet = fleet
        try:
            while not self._stop.is_set():
                figs = fleet.scrape()
                self.send({"router": display_url(fleet.router), "replicas": tuple(figs),
                           "served": tuple(self.served()), "problems": tuple(fleet.problems())})
                self._stop.wait(self.interval_s)
        finally:
            fleet.close()

    def served(self) -> list[tuple[str, str]]:
        """(the engine request id of each span a replica exported, that replica's name), the newest MAX_SERVED."""
        fleet = self.fleet
        if fleet is None:
            return []
        out = []
        for r in fleet.replicas:
            rx = fleet.receivers.get(r.url)
            if rx is not None:
                out += [(i, r.name) for i in rx.request_ids()[-MAX_SERVED:]]
        return out[-MAX_SERVED:]
