"""Wake-ups between controller replicas: PostgreSQL LISTEN/NOTIFY on one channel.

Several controllers on one database each hold long polls (worker leases), result waits and event streams,
parked on in-process signals. A change committed on one replica must wake the waiters parked on every
other one at once, not when their periodic re-check comes round. Each replica publishes the names of the
signals it fires (`queue`, `changes`, `tasks`, `events`, `w=<worker id>`) with `pg_notify` after the change is
committed, and listens on the channel; what another replica published fires the same signals here.

Both directions run on threads of their own with their own autocommit connections, so neither the event
loop nor the database thread ever waits on them. Publishing coalesces: names fired while one NOTIFY is
on its way leave together in the next, so a burst costs a few round trips, not one per change. A
listener that loses its connection reconnects with backoff and then fires every signal (it may have
missed some); the waiters' periodic re-check covers the gap meanwhile, so a broken bus is slower, never
wrong.

Only psycopg lives here: this is the database edge of the wake-ups (`api/service.py` owns the signals).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import secrets
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger("turnout.replicas")

CHANNEL = "turnout"
ALL = "*"  # the payload that fires every signal: a listener that may have missed notifications
MAX_PAYLOAD = 7000  # PostgreSQL refuses a payload of 8000 bytes or more
ANY_WORKER = "w=*"  # stands for many worker names that would not fit in one payload


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (`postgresql+psycopg://...`) as psycopg itself takes it."""
    return "postgresql://" + url.split("://", 1)[1] if "://" in url else url


def encode(sender: str, names: Iterable[str]) -> str:
    """`sender names...`; worker names past what one payload holds become `w=*`."""
    out = sorted(set(names))
    text = f"{sender} {' '.join(out)}"
    if len(text) <= MAX_PAYLOAD:
        return text
    kept = [n for n in out if not n.startswith("w=")] + [ANY_WORKER]
    return f"{sender} {' '.join(kept)}"


def decode(payload: str) -> tuple[str, set[str]]:
    """(sender, names) of a payload written by `encode`; a malformed one fires everything."""
    sender, _, rest = payload.partition(" ")
    names = set(rest.split()) if rest else set()
    return sender, names or {ALL}


class ReplicaBus:
    """Publishes this replica's signal names and delivers other replicas' to `deliver` (on a thread of its own).

    `deliver` gets a set of names; `{"*"}` means fire everything. It must be cheap and thread-safe (the
    service hands it to its event loop).
    """

    def __init__(
        self, url: str, deliver: Callable[[set[str]], None] | None = None, *, reconnect_max_s: float = 5.0
    ) -> None:
        self.url = libpq_url(url)
        self.deliver: Callable[[set[str]], None] = deliver or (lambda names: None)  # the service sets its own
        self.sender = secrets.token_hex(6)  # our own notifications come back to us: this tells them apart
        self.reconnect_max_s = reconnect_max_s
        self._outbox: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._listening = threading.Event()  # set while a LISTEN connection is up
        self._threads: list[threading.Thread] = []
        self.published = 0  # NOTIFY statements sent (a burst of names shares one)
        self.received = 0  # notifications from other replicas delivered

    def start(self) -> None:
        for target, name in (
            (self._listen_forever, "turnout-listen"),
            (self._publish_forever, "turnout-notify"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_listening(self, timeout_s: float) -> bool:
        """Whether the LISTEN connection is up (tests, and startup logs)."""
        return self._listening.wait(timeout_s)

    def publish(self, name: str) -> None:
        """Queue one signal name for the other replicas; never blocks."""
        self._outbox.put(name)

    def close(self) -> None:
        self._stopping.set()
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    # ---- publishing ----------------------------------------------------------------------------

    def _publish_forever(self) -> None:
        import psycopg

        conn: psycopg.Connection | None = None
        delay_s = 0.1
        while not self._stopping.is_set():
            first = self._outbox.get()
            if first is None:
                break
            names = {first}
            with contextlib.suppress(queue.Empty):
                while len(names) < 1000:  # everything fired meanwhile leaves in this one NOTIFY
                    more = self._outbox.get_nowait()
                    if more is None:
                        self._outbox.put(None)
                        break
                    names.add(more)
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, encode(self.sender, names)))
                self.published += 1
                delay_s = 0.1
            except psycopg.Error as exc:
                # the others' re-checks cover a lost wake-up; the next change tries a fresh connection
                log.warning("could not wake the other replicas (%s); retrying with the next change", exc)
                with contextlib.suppress(Exception):
                    if conn is not None:
                        conn.close()
                conn = None
                self._stopping.wait(_jittered(delay_s))
                delay_s = min(delay_s * 2, self.reconnect_max_s)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # ---- listening -----------------------------------------------------------------------------

    def _listen_forever(self) -> None:
        import psycopg

        delay_s = 0.1
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._listening.set()
                    if not first:
                        self.deliver({ALL})  # what was published while we were away is lost: look again
                    first = False
                    delay_s = 0.1
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=0.5, stop_after=256):
                            sender, names = decode(note.payload)
                            if sender != self.sender:
                                self.received += 1
                                self.deliver(names)
            except psycopg.Error as exc:
                self._listening.clear()
                if self._stopping.is_set():
                    break
                log.warning("listening for the other replicas failed (%s); reconnecting", exc)
                self._stopping.wait(_jittered(delay_s))
                delay_s = min(delay_s * 2, self.reconnect_max_s)
        self._listening.clear()


def _jittered(delay_s: float) -> float:
    """Half to all of `delay_s`: replicas that lost the database together do not return in lockstep."""
    return delay_s * (0.5 + random.random() / 2)
