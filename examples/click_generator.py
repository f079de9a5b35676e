"""Produce click events to a PigeonMQ topic.

    python examples/click_generator.py --service-url pigeon://127.0.0.1:6650 --rate 500

Each event is a JSON object ``{"user": "user-7", "page": "/products/3", "ts": <ms>}``
sent with the user as the message key and ``ts`` as the event time. ``--count`` stops
after that many events (default: run until interrupted). ``--simulate-seconds S`` sends
``--count`` events as fast as possible with event times spread over the last S seconds,
which is handy to try the streaming job without waiting for real time to pass.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pigeon.client import Client

PAGES = ["/", "/search", "/cart", "/checkout"] + [f"/products/{i}" for i in range(20)]


def generate(
    service_url: str,
    topic: str,
    *,
    count: int,
    users: int = 50,
    rate: float = 0.0,
    simulate_seconds: float = 0.0,
    seed: int | None = None,
) -> int:
    """Send ``count`` events (0: until interrupted); returns how many were sent."""
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    start = now - int(simulate_seconds * 1000)
    sent = 0
    with Client(service_url) as client, client.create_producer(topic) as producer:
        t0 = time.monotonic()
        while count == 0 or sent < count:
            if simulate_seconds and count:
                ts = start + (now - start) * sent // count  # event times in order over the span
            else:
                ts = int(time.time() * 1000)
            user = f"user-{rnd.randrange(users)}"
            event = {"user": user, "page": rnd.choice(PAGES), "ts": ts}
            producer.send_async(json.dumps(event).encode(), key=user, event_time=ts)
            sent += 1
            if rate and not simulate_seconds:
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service-url", default="pigeon://127.0.0.1:6650")
    parser.add_argument("--topic", default="clicks")
    parser.add_argument("--count", type=int, default=0, help="events to send (0: forever)")
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--rate", type=float, default=200.0, help="events per second")
    parser.add_argument("--simulate-seconds", type=float, default=0.0)
    args = parser.parse_args()
    try:
        n = generate(
            args.service_url,
            args.topic,
            count=args.count,
            users=args.users,
            rate=args.rate,
            simulate_seconds=args.simulate_seconds,
        )
    except KeyboardInterrupt:
        return
    print(f"sent {n} click events to {args.topic}")


if __name__ == "__main__":
    main()
