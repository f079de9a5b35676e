"""Micro-measure of the Cap'n Proto work per entry: building and dispatching each frame
kind of the per-entry path, and ``read_header``, in this process.

For every kind: ``build_message`` (the bytes a sender queues) and
``Connection._dispatch_message`` of those bytes on a serving connection whose handler
reads every field of the body (decode, body checks, the handler call); then
``read_header`` of a one-message entry.  Figures are CPU µs per call (``time.process_time``,
the best of ``--repeat`` rounds of ``--number`` calls), the figure to trust on a loaded
machine.  It only uses what every tree has, so an A/B runs it once per tree:

    PYTHONPATH=<tree>/packages/pigeon-core/src python -m bench.capnp_micro [--number 20000]
"""

from __future__ import annotations

import argparse
import time
import timeit
from typing import Any

import trio.testing

from pigeon.core._batch_encode import encode_batch
from pigeon.core._codecs import NONE
from pigeon.core._framing import build_message
from pigeon.core._rpc import Connection, Request
from pigeon.core._schema import BookieFrame, BrokerFrame
from pigeon.core.batch import read_header

POSITION = {"segmentId": 3, "entryId": 99, "batchIndex": 0, "offset": 12345}
DELIVERED = {"segmentId": 3, "entryId": 99, "size": 120, "redeliveryCount": 0, "ackedIndexes": []}
#: (frame, kind, fields) of each frame an entry crosses, as their senders fill them
KINDS: list[tuple[Any, str, dict[str, Any]]] = [
    (BrokerFrame, "send", {"producerId": 1, "sequenceId": 123456, "numMessages": 1}),
    (
        BrokerFrame,
        "sendReceipt",
        {"producerId": 1, "sequenceId": 123456, "segmentId": 3, "entryId": 99, "firstOffset": 7},
    ),
    (BookieFrame, "addEntry", {"segmentId": 3, "entryId": 99, "lac": 98}),
    (BookieFrame, "addResponse", {"segmentId": 3, "entryId": 99}),
    (BrokerFrame, "message", {"consumerId": 1, "entries": [DELIVERED]}),
    (BrokerFrame, "flow", {"consumerId": 1, "permits": 1000}),
    (BrokerFrame, "ack", {"consumerId": 1, "ackType": "individual", "positions": [POSITION]}),
]


def _reader(schema: Any) -> Any:
    """``read(body)``: reads every field of a body of struct ``schema``, and of the
    structs in its lists, as a handler that uses them all would."""
    plain: list[str] = []
    nested: list[tuple[str, Any]] = []
    for field in schema.node.struct.fields:
        slot_type = field.slot.type
        if slot_type.which() == "list" and slot_type.list.elementType.which() == "struct":
            nested.append((field.name, _reader(schema.fields[field.name].schema.elementType)))
        else:
            plain.append(field.name)

    def read(body: Any) -> None:
        for name in plain:
            getattr(body, name)
        for name, inner in nested:
            for item in getattr(body, name):
                inner(item)

    return read


class _ReadAll:
    """A serving connection's handler of one kind that reads every field of the body."""

    def __init__(self, frame: Any, kind: str) -> None:
        read = _reader(frame.schema.fields[kind].schema)

        def handle(conn: Connection, req: Request) -> None:
            read(req.body)

        setattr(self, "on_" + kind, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    def cost(fn: Any) -> float:
        best = min(
            timeit.repeat(fn, number=args.number, repeat=args.repeat, timer=time.process_time)
        )
        return best / args.number * 1e6

    empty = memoryview(b"")
    print("kind          build µs  dispatch µs")
    for frame, kind, fields in KINDS:
        stream = trio.testing.memory_stream_pair()[0]
        conn = Connection(stream, frame, handler=_ReadAll(frame, kind), serving=True)
        message = build_message(frame, 0, kind, fields)
        conn._dispatch_message(message, empty)  # warm up (and check it is handled)
        build = cost(lambda f=frame, k=kind, x=fields: build_message(f, 7, k, x))
        dispatch = cost(lambda c=conn, m=message: c._dispatch_message(m, empty))
        print(f"{kind:12s}  {build:8.2f}  {dispatch:11.2f}")
    entry = encode_batch(
        [b"x" * 100],
        producer_name="standalone-0-12",
        sequence_id=5,
        publish_time=1_700_000_000_000,
        codec=NONE,
    )
    print(f"read_header   {cost(lambda: read_header(entry)):8.2f}")


if __name__ == "__main__":
    main()
