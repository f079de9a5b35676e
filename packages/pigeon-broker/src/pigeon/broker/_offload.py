"""The built-in offloaders: ``filesystem`` and ``s3`` (see :mod:`pigeon.core.offload`).

Both are :class:`pigeon.core.offload.BlobOffloader`\\ s: they supply the four object-store
primitives and inherit the layout (a data object, then an index object written last),
the ranged reads with read-ahead and the checksums.

``filesystem`` keeps objects as files under a directory (``file_system_uri`` +
``offload_directory``), typically a mounted NFS or HDFS (NFS gateway / FUSE) path; an
object is written to a temporary file, fsynced and renamed, so it appears whole or not
at all.

``s3`` talks to any S3-compatible store through ``obstore`` (the Rust ``object_store``
crate): its synchronous calls run in ``trio.to_thread`` and release the GIL while they
wait; a segment is uploaded as a multipart upload (visible only once completed), ranged
GETs read it back, and its retries and timeouts are bounded so that a store that is
down fails an offload within seconds (the broker retries it later).  Credentials come
from the usual AWS environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``).  Chosen over boto3 because it needs
no botocore (one compiled wheel), copies nothing through Python on reads (its ``Bytes``
is a buffer) and its multipart writer is a file object we feed chunk by chunk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import trio

from pigeon.core.errors import ConfigError, CorruptEntry, OffloadError
from pigeon.core.offload import BlobOffloader, StoredObject

__all__ = ["FileSystemOffloader", "S3Offloader", "make_filesystem", "make_s3"]

log = logging.getLogger(__name__)

#: the S3 client's bounds: a store that is down fails an offload within about this long
S3_CONNECT_TIMEOUT = "5s"
S3_REQUEST_TIMEOUT = "60s"
S3_MAX_RETRIES = 2
S3_RETRY_TIMEOUT = timedelta(seconds=10)
#: multipart part size of an upload
S3_PART_BYTES = 8 * 1024 * 1024


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


class FileSystemOffloader(BlobOffloader):
    """Offloaded segments as files under ``root``."""

    name = "filesystem"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)

    def _path(self, path: str) -> Path:
        return self.root / path

    def _location(self, key: str) -> dict[str, Any]:
        return {"root": str(self.root)}

    def _same_place(self, name: str, recorded: Any, ours: Any) -> bool:
        if name != "root":
            return super()._same_place(name, recorded, ours)
        return bool(os.path.abspath(str(recorded)) == os.path.abspath(str(ours)))

    async def _write_object(self, path: str, chunks: AsyncIterator[bytes | memoryview]) -> None:
        final = self._path(path)
        tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
        try:
            await trio.to_thread.run_sync(lambda: final.parent.mkdir(parents=True, exist_ok=True))
            f = await trio.to_thread.run_sync(open, tmp, "wb")
            try:
                async for chunk in chunks:
                    await trio.to_thread.run_sync(f.write, chunk)

                def finish() -> None:
                    f.flush()
                    os.fsync(f.fileno())

                await trio.to_thread.run_sync(finish)
            finally:
                f.close()
            await trio.to_thread.run_sync(os.replace, tmp, final)
            await trio.to_thread.run_sync(_fsync_dir, final.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise OffloadError(f"cannot write {final}: {_one_line(exc)}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    async def _read_range(self, path: str, start: int, end: int) -> bytes:
        def read() -> bytes:
            with open(self._path(path), "rb") as f:
                f.seek(start)
                return f.read(end - start)

        return await self._run(path, read)

    async def _read_object(self, path: str) -> bytes:
        return await self._run(path, self._path(path).read_bytes)

    async def _run(self, path: str, fn: Any) -> bytes:
        try:
            data: bytes = await trio.to_thread.run_sync(fn)
        except FileNotFoundError:
            raise CorruptEntry(f"offloaded object {self._path(path)} is missing") from None
        except OSError as exc:
            raise OffloadError(f"cannot read {self._path(path)}: {_one_line(exc)}") from None
        return data

    async def _list_objects(self, prefix: str, after: str, limit: int) -> list[StoredObject]:
        def walk() -> list[StoredObject]:
            found: list[str] = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames.sort()
                rel = os.path.relpath(dirpath, self.root)
                base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                found.extend(base + name for name in filenames)
            paths = sorted(p for p in found if p.startswith(prefix) and p > after)[:limit]
            out = []
            for path in paths:
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    mtime = self._path(path).stat().st_mtime
                    out.append(StoredObject(path, int(mtime * 1000)))
            return out

        try:
            return await trio.to_thread.run_sync(walk)
        except OSError as exc:
            raise OffloadError(f"cannot list {self.root}: {_one_line(exc)}") from None

    async def _delete_objects(self, paths: Sequence[str]) -> None:
        def delete() -> None:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self._path(path).unlink()
                # remove the segment's directory once empty (the topic's stays)
                with contextlib.suppress(OSError):
                    self._path(path).parent.rmdir()

        try:
            await trio.to_thread.run_sync(delete)
        except OSError as exc:
            raise OffloadError(f"cannot delete offloaded objects: {_one_line(exc)}") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Offloader(BlobOffloader):
    """Offloaded segments as objects in an S3 bucket (any S3-compatible store)."""

    name = "s3"

    def __init__(self, bucket: str, *, region: str = "", endpoint: str = "") -> None:
        super().__init__()
        from obstore.store import S3Store

        self.bucket = bucket
        self.region = region
        self.endpoint = endpoint
        options: dict[str, Any] = {
            "connect_timeout": S3_CONNECT_TIMEOUT,
            "timeout": S3_REQUEST_TIMEOUT,
        }
        if endpoint.startswith("http://"):
            options["allow_http"] = True
        config: dict[str, Any] = {}
        if region:
            config["region"] = region
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False
        try:
            self._store = S3Store(
                bucket,
                client_options=options,  # type: ignore[arg-type]
                retry_config={"max_retries": S3_MAX_RETRIES, "retry_timeout": S3_RETRY_TIMEOUT},
                **config,
            )
        except Exception as exc:  # obstore raises its own errors for bad settings
            raise ConfigError(f"bad s3 offload settings: {_one_line(exc)}") from None

    def _location(self, key: str) -> dict[str, Any]:
        return {"bucket": self.bucket}

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from obstore.exceptions import NotFoundError

        try:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
        except NotFoundError:
            raise CorruptEntry(f"offloaded object s3://{self.bucket}/{what} is missing") from None
        except Exception as exc:  # obstore's errors, OSError: the store failed
            raise OffloadError(f"s3://{self.bucket}/{what}: {_one_line(exc)}") from None

    async def _write_object(self, path: str, chunks: AsyncIterator[bytes | memoryview]) -> None:
        import obstore

        writer = await self._call(
            path, obstore.open_writer, self._store, path, buffer_size=S3_PART_BYTES
        )
        # not closed on failure: an upload never completed leaves no object
        async for chunk in chunks:
            await self._call(path, writer.write, chunk)
        await self._call(path, writer.close)

    async def _read_range(self, path: str, start: int, end: int) -> memoryview:
        import obstore

        data = await self._call(path, obstore.get_range, self._store, path, start=start, end=end)
        return memoryview(data)

    async def _read_object(self, path: str) -> bytes:
        import obstore

        def get() -> bytes:
            return bytes(obstore.get(self._store, path).bytes())

        data: bytes = await self._call(path, get)
        return data

    async def _delete_objects(self, paths: Sequence[str]) -> None:
        import obstore

        await self._call(",".join(paths), obstore.delete, self._store, list(paths))

    async def _list_objects(self, prefix: str, after: str, limit: int) -> list[StoredObject]:
        import obstore

        def page() -> list[StoredObject]:
            out: list[StoredObject] = []
            stream = obstore.list(
                self._store, prefix or None, offset=after or None, chunk_size=min(limit, 1000)
            )
            for chunk in stream:
                for meta in chunk:
                    out.append(
                        StoredObject(
                            str(meta["path"]), int(meta["last_modified"].timestamp() * 1000)
                        )
                    )
                if len(out) >= limit:
                    break
            out.sort(key=lambda o: o.path)
            return out[:limit]

        found: list[StoredObject] = await self._call(prefix or "(bucket)", page)
        return found


def filesystem_root(config: Any) -> Path:
    """The directory of the ``filesystem`` offloader: ``file_system_uri`` (``file://``
    or empty) joined with ``offload_directory``."""
    uri = str(getattr(config, "file_system_uri", "") or "")
    directory = str(getattr(config, "offload_directory", "") or "")
    base = ""
    if uri:
        parsed = urlparse(uri)
        if parsed.scheme not in ("", "file"):
            raise ConfigError(
                f"bad value for 'file_system_uri': {uri!r} (the filesystem offloader writes"
                " to a mounted directory: use file:///path, e.g. an NFS or HDFS mount)"
            )
        base = parsed.path if parsed.scheme else uri
    if not base and not directory:
        raise ConfigError(
            "managed_ledger_offload_driver = 'filesystem' needs 'offload_directory'"
            " (or 'file_system_uri')"
        )
    return Path(base or ".") / directory if directory else Path(base)


def make_filesystem(config: Any) -> FileSystemOffloader:
    """The ``filesystem`` factory (``pigeon_offloaders``)."""
    return FileSystemOffloader(filesystem_root(config))


def make_s3(config: Any) -> S3Offloader:
    """The ``s3`` factory (``pigeon_offloaders``)."""
    bucket = str(getattr(config, "s3_managed_ledger_offload_bucket", "") or "")
    if not bucket:
        raise ConfigError(
            "managed_ledger_offload_driver = 's3' needs 's3_managed_ledger_offload_bucket'"
        )
    endpoint = str(getattr(config, "s3_managed_ledger_offload_service_endpoint", "") or "")
    if endpoint and urlparse(endpoint).scheme not in ("http", "https"):
        raise ConfigError(
            "bad value for 's3_managed_ledger_offload_service_endpoint':"
            f" {endpoint!r} is not an http(s):// URL"
        )
    return S3Offloader(
        bucket,
        region=str(getattr(config, "s3_managed_ledger_offload_region", "") or ""),
        endpoint=endpoint,
    )
