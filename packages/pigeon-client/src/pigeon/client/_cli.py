"""``pigeon produce``, ``pigeon consume`` and ``pigeon perf produce|consume``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from array import array
from typing import Any

import click
import pluggy

from pigeon.client._admin_cli import admin_cmd
from pigeon.client._cli_security import client_security, security_options
from pigeon.client._units import plural

hookimpl = pluggy.HookimplMarker("pigeon")

_URL = click.option(
    "--service-url",
    "-u",
    default="pigeon://127.0.0.1:6650",
    show_default=True,
    envvar="PIGEON_SERVICE_URL",
    help="Broker to connect to (pigeon+ssl://host:port for TLS).",
)
_INITIAL_POSITION = click.option(
    "--initial-position",
    default="earliest",
    show_default=True,
    type=click.Choice(["earliest", "latest"]),
)


def _props(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--property")
        k, _, v = pair.partition("=")
        out[k] = v
    return out


@click.command("produce")
@click.argument("topic")
@click.argument("messages", nargs=-1)
@_URL
@click.option("--key", "-k", help="Key of every message.")
@click.option(
    "--property", "-p", "properties", multiple=True, help="key=value property (repeatable)."
)
@click.option("--compression", default="none", show_default=True, help="Codec name.")
@security_options
def produce_cmd(
    topic: str,
    messages: tuple[str, ...],
    service_url: str,
    key: str | None,
    properties: tuple[str, ...],
    compression: str,
    **security: Any,
) -> None:
    """Send MESSAGES (or, without any, each line of stdin) to TOPIC."""
    from pigeon.client import Client

    props = _props(properties)
    lines: Any = messages if messages else (line.rstrip("\n") for line in sys.stdin)
    count = 0
    with (
        Client(service_url, **client_security(security)) as client,
        client.create_producer(topic, compression=compression) as producer,
    ):
        futures = []
        for text in lines:
            futures.append(producer.send_async(text.encode(), key=key, properties=props or None))
            count += 1
        producer.flush()
        for f in futures:
            f.result()
    click.echo(f"{plural(count, 'message')} produced to {topic}", err=True)


@click.command("consume")
@click.argument("topic")
@_URL
@click.option("--subscription", "-s", required=True, help="Subscription name.")
@click.option(
    "--subscription-type",
    "-t",
    default="exclusive",
    show_default=True,
    type=click.Choice(["exclusive", "shared", "failover", "key_shared"]),
)
@_INITIAL_POSITION
@click.option(
    "--num-messages",
    "-n",
    default=0,
    type=click.IntRange(min=0),
    show_default=True,
    help="Stop after N messages (0: run until Ctrl-C).",
)
@click.option(
    "--timeout",
    default=0.0,
    type=click.FloatRange(min=0.0),
    help="Stop when no message came for this many seconds (0: wait forever).",
)
@click.option("--show-key/--no-show-key", default=False, help="Print key and properties too.")
@security_options
def consume_cmd(
    topic: str,
    service_url: str,
    subscription: str,
    subscription_type: str,
    initial_position: str,
    num_messages: int,
    timeout: float,
    show_key: bool,
    **security: Any,
) -> None:
    """Print messages of TOPIC (one per line) and acknowledge them."""
    from pigeon.client import Client, Timeout

    got = 0
    with (
        Client(service_url, **client_security(security)) as client,
        client.subscribe(
            topic,
            subscription,
            subscription_type=subscription_type,
            initial_position=initial_position,
        ) as consumer,
    ):
        try:
            while num_messages <= 0 or got < num_messages:
                try:
                    msg = consumer.receive(timeout=timeout or None)
                except Timeout:
                    break
                text = msg.value.decode("utf-8", "replace")
                if show_key:
                    click.echo(
                        f"key={msg.key!r} properties={msg.properties}"
                        f" offset={msg.offset} value={text}"
                    )
                else:
                    click.echo(text)
                consumer.acknowledge(msg)
                got += 1
        except KeyboardInterrupt:
            pass
    click.echo(f"{plural(got, 'message')} consumed from {topic}", err=True)


# ----------------------------------------------------------------------------- perf


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[i]


@click.group("perf")
def perf_cmd() -> None:
    """Measure produce and consume throughput and latency."""


@perf_cmd.command("produce")
@click.argument("topic", default="perf")
@_URL
@click.option("--size", "-s", default=1024, show_default=True, help="Message size in bytes.")
@click.option(
    "--rate",
    "-r",
    default=0.0,
    show_default=True,
    help="Messages/s over all producers (0: as fast as possible).",
)
@click.option("--duration", "-d", default=30.0, show_default=True, help="Seconds to run.")
@click.option(
    "--producers", "-p", default=1, show_default=True, help="Producers, each in its own thread."
)
@click.option("--batch-max-messages", default=1000, show_default=True)
@click.option("--batch-max-bytes", default=1024 * 1024, show_default=True)
@click.option("--batch-delay-ms", default=5.0, show_default=True)
@click.option(
    "--max-pending", default=50_000, show_default=True, help="Pending messages per producer."
)
@click.option("--compression", default="none", show_default=True)
@click.option(
    "--arrow",
    is_flag=True,
    help="Send pyarrow tables with send_arrow (one message per row) instead of send_async.",
)
@click.option("--arrow-rows", default=10_000, show_default=True, help="Rows per send_arrow table.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Write the result as JSON here.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line.")
@security_options
def perf_produce(json_out: str | None, quiet: bool, **options: Any) -> None:
    """Produce SIZE-byte messages to TOPIC; report msg/s, MB/s and publish latency."""
    security = client_security(options, pop=True)
    _report(run_perf_produce(progress=not quiet, client_options=security, **options), json_out)


@perf_cmd.command("consume")
@click.argument("topic", default="perf")
@_URL
@click.option("--subscription", default="perf-sub", show_default=True)
@_INITIAL_POSITION
@click.option(
    "--duration", "-d", default=30.0, show_default=True, help="Stop after this many seconds."
)
@click.option(
    "--max-messages",
    "-n",
    default=0,
    show_default=True,
    help="Stop after N messages (0: no limit).",
)
@click.option(
    "--idle-timeout",
    default=5.0,
    show_default=True,
    help="Stop when nothing arrived for this long.",
)
@click.option("--receiver-queue-size", default=20_000, show_default=True)
@click.option(
    "--arrow",
    is_flag=True,
    help="Receive pyarrow record batches with receive_arrow instead of batch_receive.",
)
@click.option("--json-out", type=click.Path(dir_okay=False), help="Write the result as JSON here.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line.")
@security_options
def perf_consume(json_out: str | None, quiet: bool, **options: Any) -> None:
    """Consume TOPIC, acknowledging cumulatively; report msg/s and MB/s."""
    security = client_security(options, pop=True)
    _report(run_perf_consume(progress=not quiet, client_options=security, **options), json_out)


def _progress(line: str) -> None:
    """Overwrite the progress line on stderr."""
    print(f"\r{line}   ", end="", file=sys.stderr, flush=True)


def _report(result: dict[str, Any], json_out: str | None) -> None:
    lines = [f"{k}: {v}" for k, v in result.items()]
    click.echo("\n".join(lines))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)


def run_perf_produce(
    service_url: str,
    topic: str,
    *,
    size: int = 1024,
    rate: float = 0.0,
    duration: float = 30.0,
    producers: int = 1,
    batch_max_messages: int = 1000,
    batch_max_bytes: int = 1024 * 1024,
    batch_delay_ms: float = 5.0,
    max_pending: int = 50_000,
    compression: str = "none",
    arrow: bool = False,
    arrow_rows: int = 10_000,
    progress: bool = True,
    sample_every: int = 64,
    client_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the produce benchmark in this process (also used by bench/);
    ``client_options``: more ``Client`` keywords (credentials, TLS). ``arrow``: each
    producer sends ``arrow_rows``-row tables with ``send_arrow`` (the publish latency is
    then per entry: from the call to the entry's receipt)."""
    from pigeon.client import Client

    payload = os.urandom(size) if compression == "none" else (b"pigeon-" * (size // 7 + 1))[:size]
    table = _arrow_table(payload, arrow_rows) if arrow else None
    sent = [0] * producers
    latencies: list[list[float]] = [[] for _ in range(producers)]
    errors: list[BaseException] = []
    stop = threading.Event()
    start = time.perf_counter()
    per_producer_rate = rate / producers if rate > 0 else 0.0

    with Client(service_url, **(client_options or {})) as client:

        def work(i: int, producer: Any) -> None:
            n = 0
            lat = latencies[i]
            send = producer.send_async
            perf = time.perf_counter
            t0 = perf()
            try:
                while table is not None and not stop.is_set():
                    if _behind_schedule(t0, n, per_producer_rate):
                        continue
                    began = perf()
                    for fut in producer.send_arrow(table):
                        fut.add_done_callback(lambda f, b=began: lat.append(perf() - b))
                    n += table.num_rows
                    sent[i] = n
                while table is None and not stop.is_set():
                    if _behind_schedule(t0, n, per_producer_rate):
                        continue
                    for _ in range(100):
                        if n % sample_every == 0:
                            began = perf()
                            fut = send(payload)
                            fut.add_done_callback(lambda f, b=began: lat.append(perf() - b))
                        else:
                            send(payload)
                        n += 1
                        if per_producer_rate:
                            break
                    sent[i] = n
                producer.flush()
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        prods = [
            client.create_producer(
                topic if producers == 1 else f"{topic}-{i}",
                batching_max_messages=batch_max_messages,
                batching_max_bytes=batch_max_bytes,
                batching_max_delay_ms=batch_delay_ms,
                max_pending_messages=max_pending,
                compression=compression,
            )
            for i in range(producers)
        ]
        threads = [
            threading.Thread(target=work, args=(i, p), daemon=True) for i, p in enumerate(prods)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        last_report = start
        last_count = 0
        while time.perf_counter() - start < duration and not stop.is_set():
            time.sleep(0.1)
            now = time.perf_counter()
            if progress and now - last_report >= 1.0:
                total = sum(sent)
                r = (total - last_count) / (now - last_report)
                _progress(f"produced {total:,} msgs  {r:,.0f} msg/s  {r * size / 1e6:,.1f} MB/s")
                last_report, last_count = now, total
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        for p in prods:
            p.close()
    if progress:
        print(file=sys.stderr)
    if errors:
        raise errors[0]
    total = sum(sent)
    lat = sorted(x for lst in latencies for x in lst)
    return {
        "scenario": "produce",
        "topic": topic,
        "message_size": size,
        "producers": producers,
        "messages": total,
        "seconds": round(elapsed, 3),
        "msg_per_s": round(total / elapsed, 1),
        "mb_per_s": round(total * size / elapsed / 1e6, 2),
        "latency_ms_p50": round(_percentile(lat, 0.50) * 1000, 3),
        "latency_ms_p99": round(_percentile(lat, 0.99) * 1000, 3),
        "latency_ms_p999": round(_percentile(lat, 0.999) * 1000, 3),
        "latency_samples": len(lat),
        "batch_max_messages": batch_max_messages,
        "batch_delay_ms": batch_delay_ms,
        "compression": compression,
        "rate_limit": rate,
        "api": "send_arrow" if arrow else "send_async",
    }


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise click.UsageError(
            "--arrow needs pyarrow: pip install 'pigeon-client[arrow]'"
        ) from None
    return pyarrow


def _arrow_table(payload: bytes, rows: int) -> Any:
    """A one-column (``value``) table of ``rows`` copies of ``payload``, built from
    buffers (the payload repeated, offsets a multiple of its size)."""
    pa = _pyarrow()
    size = len(payload)
    offsets = pa.py_buffer(array("i", range(0, size * (rows + 1), size)))
    values = pa.Array.from_buffers(pa.binary(), rows, [None, offsets, pa.py_buffer(payload * rows)])
    return pa.table({"value": values})


def run_perf_consume(
    service_url: str,
    topic: str,
    *,
    subscription: str = "perf-sub",
    initial_position: str = "earliest",
    duration: float = 30.0,
    max_messages: int = 0,
    idle_timeout: float = 5.0,
    receiver_queue_size: int = 20_000,
    arrow: bool = False,
    progress: bool = True,
    client_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the consume benchmark in this process; ``arrow``: record batches from
    ``receive_arrow``, each acknowledged cumulatively by its last row."""
    from pigeon.client import Client, MessageId, Timeout

    if arrow:
        _pyarrow()  # fails with the install hint before connecting

    count = 0
    nbytes = 0
    with (
        Client(service_url, **(client_options or {})) as client,
        client.subscribe(
            topic,
            subscription,
            initial_position=initial_position,
            receiver_queue_size=receiver_queue_size,
        ) as consumer,
    ):
        start = time.perf_counter()
        first_at = None
        last_report = start
        last_count = 0
        end_at = start
        while time.perf_counter() - start < duration:
            try:
                if arrow:
                    rb = consumer.receive_arrow(10_000, timeout=idle_timeout)
                else:
                    msgs = consumer.batch_receive(10_000, timeout=idle_timeout)
            except Timeout:
                break
            if first_at is None:
                first_at = time.perf_counter()
            if arrow:
                count += rb.num_rows
                nbytes += _binary_bytes(rb.column("value"))
                last = rb.column("message_id")[rb.num_rows - 1].as_py()
                consumer.acknowledge_cumulative(MessageId.deserialize(last))
            else:
                count += len(msgs)
                nbytes += sum(len(m.value) for m in msgs)
                consumer.acknowledge_cumulative(msgs[-1])
            end_at = time.perf_counter()
            if progress and end_at - last_report >= 1.0:
                r = (count - last_count) / (end_at - last_report)
                _progress(f"consumed {count:,} msgs  {r:,.0f} msg/s")
                last_report, last_count = end_at, count
            if max_messages and count >= max_messages:
                break
    if progress:
        print(file=sys.stderr)
    elapsed = max(end_at - (first_at or start), 1e-9)
    return {
        "scenario": "consume",
        "topic": topic,
        "messages": count,
        "bytes": nbytes,
        "seconds": round(elapsed, 3),
        "msg_per_s": round(count / elapsed, 1),
        "mb_per_s": round(nbytes / elapsed / 1e6, 2),
        "api": "receive_arrow" if arrow else "batch_receive",
    }


def _binary_bytes(values: Any) -> int:
    """The bytes of a binary column's values (its last offset less its first)."""
    if not len(values):
        return 0
    offsets = memoryview(values.buffers()[1]).cast("i")
    return int(offsets[values.offset + len(values)] - offsets[values.offset])


@hookimpl
def pigeon_cli_commands(group: click.Group) -> None:
    group.add_command(admin_cmd)
    group.add_command(produce_cmd)
    group.add_command(consume_cmd)
    group.add_command(perf_cmd)


def _behind_schedule(t0: float, sent: int, rate: float) -> bool:
    """At ``rate`` messages/s from ``t0``, is it too early for message ``sent``? If so,
    sleep a little (at most 10 ms) and say so; ``rate`` 0 never waits."""
    if not rate:
        return False
    wait = t0 + sent / rate - time.perf_counter()
    if wait <= 0:
        return False
    time.sleep(min(wait, 0.01))
    return True
