"""The embedded metadata store's SQLite database: its layout and every transaction on it.

Plain functions on a ``sqlite3.Connection``, called by
:class:`~pigeon.core.metadata.EmbeddedMetadataStore` inside its ``BEGIN IMMEDIATE …
COMMIT`` (they neither begin nor commit).  Layout (``<dir>/metadata.db``, WAL journal,
``synchronous=FULL``, schema version in ``PRAGMA user_version``)::

    nodes(path TEXT PK, parent TEXT, value BLOB, version INT,
          owner TEXT NULL   -- session id of an ephemeral node, NULL if persistent
          ctime REAL, mtime REAL,   -- wall clock
          cseq INT)         -- next sequential counter for this node's children
    sessions(id TEXT PK, heartbeat REAL, timeout REAL, pid INT, started REAL)
    changes(seq INT PK AUTOINCREMENT, ts REAL, kind INT, path TEXT, value BLOB, version INT)

The root ``/`` is a row of ``nodes`` (its parent is ``''``).  Every write transaction
appends one ``changes`` row per node it creates, changes or deletes, in the order it
does so; ``seq`` is therefore the global commit order (writers are serialised and an
AUTOINCREMENT rolled back with its transaction leaves no gap).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from pigeon.core import errors
from pigeon.core.metadata._store import SEQUENCE_DIGITS, EventType, Op, OpKind, parent_path

log = logging.getLogger(__name__)

DB_NAME = "metadata.db"
SCHEMA_VERSION = 1

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS nodes (
        path TEXT PRIMARY KEY,
        parent TEXT NOT NULL,
        value BLOB NOT NULL,
        version INTEGER NOT NULL,
        owner TEXT,
        ctime REAL NOT NULL,
        mtime REAL NOT NULL,
        cseq INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS nodes_by_parent ON nodes(parent)",
    "CREATE INDEX IF NOT EXISTS nodes_by_owner ON nodes(owner) WHERE owner IS NOT NULL",
    """CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        heartbeat REAL NOT NULL,
        timeout REAL NOT NULL,
        pid INTEGER NOT NULL,
        started REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind INTEGER NOT NULL,
        path TEXT NOT NULL,
        value BLOB,
        version INTEGER NOT NULL
    )""",
)

CREATED, CHANGED, DELETED = 1, 2, 3
EVENT_TYPES = {CREATED: EventType.CREATED, CHANGED: EventType.CHANGED, DELETED: EventType.DELETED}

_EXPIRED = "the metadata session expired; call new_session()"


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says another connection holds the lock (try again later)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return "locked" in str(exc) or "busy" in str(exc)
    return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


# --- opening ---------------------------------------------------------------------------


def connect(db_path: str, *, check_same_thread: bool = True) -> sqlite3.Connection:
    directory = os.path.dirname(db_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    try:
        return sqlite3.connect(
            db_path, timeout=0.0, isolation_level=None, check_same_thread=check_same_thread
        )
    except sqlite3.Error as exc:
        raise errors.MetadataError(f"cannot open metadata database {db_path}: {exc}") from exc


def configure(conn: sqlite3.Connection, db_path: str) -> None:
    """WAL journal and full fsync (outside a transaction)."""
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchall()[0][0]
    if str(mode).lower() != "wal":
        log.warning("metadata database %s: journal_mode is %s, not wal", db_path, mode)
    conn.execute("PRAGMA synchronous=FULL")


def create_schema(conn: sqlite3.Connection, db_path: str) -> int:
    """Create what is missing (refusing a newer schema); return the newest change seq."""
    (found,) = conn.execute("PRAGMA user_version").fetchall()[0]
    if found > SCHEMA_VERSION:
        raise errors.MetadataError(
            f"metadata database {db_path} has schema version {found}; "
            f"this PigeonMQ knows {SCHEMA_VERSION}"
        )
    for statement in _SCHEMA:
        conn.execute(statement)
    if found < SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    now = time.time()
    conn.execute(
        "INSERT OR IGNORE INTO nodes (path, parent, value, version, owner, ctime, mtime)"
        " VALUES ('/', '', x'', 0, NULL, ?, ?)",
        (now, now),
    )
    return max_seq(conn)


# --- the change log --------------------------------------------------------------------


def log_change(
    conn: sqlite3.Connection, kind: int, path: str, value: bytes | None, version: int, wall: float
) -> None:
    conn.execute(
        "INSERT INTO changes (ts, kind, path, value, version) VALUES (?, ?, ?, ?, ?)",
        (wall, kind, path, value, version),
    )


def max_seq(conn: sqlite3.Connection) -> int:
    rows = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchall()
    return int(rows[0][0]) if rows else 0


def changes_after(conn: sqlite3.Connection, seq: int, limit: int) -> list[Any]:
    """``(seq, kind, path, value, version)`` rows after ``seq``, in commit order."""
    return conn.execute(
        "SELECT seq, kind, path, value, version FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
        (seq, limit),
    ).fetchall()


def trim(conn: sqlite3.Connection, wall: float, *, keep_rows: int, retention: float) -> None:
    """Delete changes older than ``retention`` seconds, but keep the newest ``keep_rows``."""
    cut = max_seq(conn) - max(1, keep_rows) + 1
    rows = conn.execute(
        "SELECT seq FROM changes WHERE ts >= ? ORDER BY seq LIMIT 1", (wall - retention,)
    ).fetchall()
    if rows:
        cut = min(cut, rows[0][0])
    conn.execute("DELETE FROM changes WHERE seq < ?", (cut,))


# --- sessions --------------------------------------------------------------------------


def add_session(conn: sqlite3.Connection, session: str, timeout: float, wall: float) -> None:
    conn.execute(
        "INSERT INTO sessions (id, heartbeat, timeout, pid, started) VALUES (?, ?, ?, ?, ?)",
        (session, wall, timeout, os.getpid(), wall),
    )


def heartbeat(conn: sqlite3.Connection, session: str, wall: float) -> bool:
    """Refresh a session's heartbeat; False if its row is gone."""
    cur = conn.execute("UPDATE sessions SET heartbeat = ? WHERE id = ?", (wall, session))
    return cur.rowcount != 0


def delete_session(conn: sqlite3.Connection, session: str, wall: float) -> None:
    """Delete a session and its ephemeral nodes (logged, deepest first)."""
    rows = conn.execute(
        "SELECT path, version FROM nodes WHERE owner = ? ORDER BY path DESC", (session,)
    ).fetchall()
    conn.execute("DELETE FROM nodes WHERE owner = ?", (session,))
    for path, version in rows:
        log_change(conn, DELETED, path, None, version, wall)
    conn.execute("DELETE FROM sessions WHERE id = ?", (session,))


def reap(conn: sqlite3.Connection, wall: float, *, keep: str | None) -> list[str]:
    """Delete the sessions (but ``keep``) whose heartbeat is older than their timeout,
    and ephemeral nodes of sessions that are gone; return the sessions deleted."""
    stale = [
        session
        for (session,) in conn.execute(
            "SELECT id FROM sessions WHERE id != ? AND heartbeat + timeout < ?",
            (keep or "", wall),
        ).fetchall()
    ]
    for session in stale:
        delete_session(conn, session, wall)
    orphans = conn.execute(
        "SELECT path, version FROM nodes WHERE owner IS NOT NULL"
        " AND owner NOT IN (SELECT id FROM sessions) ORDER BY path DESC"
    ).fetchall()
    for path, version in orphans:
        conn.execute("DELETE FROM nodes WHERE path = ?", (path,))
        log_change(conn, DELETED, path, None, version, wall)
    return stale


# --- reads -----------------------------------------------------------------------------


def select_node(conn: sqlite3.Connection, path: str) -> list[Any]:
    return conn.execute(
        "SELECT value, version, owner, ctime, mtime FROM nodes WHERE path = ?", (path,)
    ).fetchall()


def select_children(conn: sqlite3.Connection, path: str) -> list[Any]:
    return conn.execute("SELECT path FROM nodes WHERE parent = ?", (path,)).fetchall()


def _version(conn: sqlite3.Connection, path: str, expected: int | None) -> int:
    """The node's version; ``NoSuchNode`` if it is missing, ``BadVersion`` if it is not
    ``expected`` (when given)."""
    rows = conn.execute("SELECT version FROM nodes WHERE path = ?", (path,)).fetchall()
    if not rows:
        raise errors.NoSuchNode(path)
    current = int(rows[0][0])
    if expected is not None and expected != current:
        raise errors.BadVersion(f"{path}: version is {current}, expected {expected}")
    return current


# --- writes ----------------------------------------------------------------------------


def multi(conn: sqlite3.Connection, ops: Iterable[Op], owner: str | None) -> list[object]:
    """Apply ``ops`` in order (the caller's transaction makes them all or nothing);
    ``owner`` is the live session's id, or None."""
    results: list[object] = []
    for op in ops:
        if op.kind is OpKind.CREATE:
            results.append(create(conn, op.path, op.value, op.ephemeral, False, owner))
        elif op.kind is OpKind.SET:
            results.append(set_value(conn, op.path, op.value, op.version))
        elif op.kind is OpKind.DELETE:
            delete(conn, op.path, op.version, False)
            results.append(None)
        else:
            _version(conn, op.path, op.version)
            results.append(None)
    return results


def create(
    conn: sqlite3.Connection,
    path: str,
    value: bytes,
    ephemeral: bool,
    sequential: bool,
    owner: str | None,
) -> str:
    """Create a node (and its missing parents); an ephemeral one belongs to ``owner``,
    the live session (None: expired)."""
    wall = time.time()
    if path == "/" and not sequential:
        raise errors.NodeExists("/")
    parent = parent_path(path + "0" if sequential else path)
    if not ephemeral:
        owner = None
    elif owner is None:
        raise errors.SessionExpired(_EXPIRED)
    elif not conn.execute("SELECT 1 FROM sessions WHERE id = ?", (owner,)).fetchall():
        raise errors.SessionExpired("the metadata session was expired by another process")
    _ensure_parents(conn, parent, wall)
    if sequential:
        (counter,) = conn.execute("SELECT cseq FROM nodes WHERE path = ?", (parent,)).fetchall()[0]
        conn.execute("UPDATE nodes SET cseq = cseq + 1 WHERE path = ?", (parent,))
        path = f"{path}{counter:0{SEQUENCE_DIGITS}d}"
    if conn.execute("SELECT 1 FROM nodes WHERE path = ?", (path,)).fetchall():
        raise errors.NodeExists(path)
    conn.execute(
        "INSERT INTO nodes (path, parent, value, version, owner, ctime, mtime)"
        " VALUES (?, ?, ?, 0, ?, ?, ?)",
        (path, parent, value, owner, wall, wall),
    )
    log_change(conn, CREATED, path, value, 0, wall)
    return path


def _ensure_parents(conn: sqlite3.Connection, parent: str, wall: float) -> None:
    missing: list[str] = []
    node = parent
    while True:
        rows = conn.execute("SELECT owner FROM nodes WHERE path = ?", (node,)).fetchall()
        if rows:
            if rows[0][0] is not None:
                raise errors.InvalidArgument(f"{node!r} is ephemeral and cannot have children")
            break
        missing.append(node)
        node = parent_path(node)  # the root always exists: this ends
    for node in reversed(missing):
        conn.execute(
            "INSERT INTO nodes (path, parent, value, version, owner, ctime, mtime)"
            " VALUES (?, ?, x'', 0, NULL, ?, ?)",
            (node, parent_path(node), wall, wall),
        )
        log_change(conn, CREATED, node, b"", 0, wall)


def set_value(conn: sqlite3.Connection, path: str, value: bytes, version: int | None) -> int:
    current = _version(conn, path, version)
    wall = time.time()
    conn.execute(
        "UPDATE nodes SET value = ?, version = ?, mtime = ? WHERE path = ?",
        (value, current + 1, wall, path),
    )
    log_change(conn, CHANGED, path, value, current + 1, wall)
    return current + 1


def delete(conn: sqlite3.Connection, path: str, version: int | None, recursive: bool) -> None:
    if path == "/":
        raise errors.InvalidArgument("the root node cannot be deleted")
    current = _version(conn, path, version)
    wall = time.time()
    if conn.execute("SELECT 1 FROM nodes WHERE parent = ? LIMIT 1", (path,)).fetchall():
        if not recursive:
            raise errors.NotEmpty(path)
        # every path below `path` sorts between `path/` and `path0` ('0' follows '/');
        # descending order puts each child before its parent.
        low, high = path + "/", path + "0"
        below = conn.execute(
            "SELECT path, version FROM nodes WHERE path > ? AND path < ? ORDER BY path DESC",
            (low, high),
        ).fetchall()
        conn.execute("DELETE FROM nodes WHERE path > ? AND path < ?", (low, high))
        for child, child_version in below:
            log_change(conn, DELETED, child, None, child_version, wall)
    conn.execute("DELETE FROM nodes WHERE path = ?", (path,))
    log_change(conn, DELETED, path, None, current, wall)
