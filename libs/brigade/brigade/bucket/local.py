"""The local-folder backend (`file:///path`): one machine, same semantics as S3.

Readers never see a partial object: every write goes to a temporary file in the destination
folder, is fsynced, then renamed (overwrite) or hard-linked (create-only) into place. Blocking
file IO runs in worker threads so a 34 MiB adapter does not stall the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from brigade.bucket.base import (
    CHUNK_SIZE,
    TEMP_MARKER,
    Bucket,
    BucketError,
    ObjectExists,
    ObjectNotFound,
    check_key,
    check_prefix,
)


class LocalBucket(Bucket):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))

    def __repr__(self) -> str:
        return f"LocalBucket({str(self.root)!r})"

    def url(self, key: str) -> str:
        return (self.root / check_key(key)).as_uri()

    def describe(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        """The file of `key`, never outside the root: a symlink under the root that leads out (put
        there by anyone with write access to the folder) is answered as no such object."""
        path = self.root / check_key(key)
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise ObjectNotFound("the key resolves outside the bucket's folder (a symlink); not followed",
                                 key=key, uri=self.url(key))
        return path

    async def ensure(self) -> None:
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)

    # -- writes ---------------------------------------------------------------------------

    async def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        return await asyncio.to_thread(self._write, key, path, data, False)

    async def put_new(self, key: str, data: bytes) -> str:
        path = self._path(key)
        return await asyncio.to_thread(self._write, key, path, data, True)

    def _write(self, key: str, path: Path, data: bytes, create_only: bool) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if create_only and path.exists():
            # Cheap early exit; the link below is what actually guarantees create-only.
            raise ObjectExists("key already exists", key=key, uri=self.url(key))
        # Unique per writer, in the same folder (rename/link must not cross filesystems).
        tmp = path.parent / f"{TEMP_MARKER}{uuid.uuid4().hex}-{path.name}"
        try:
            for attempt in range(3):
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    f = open(tmp, "xb")
                    break
                except FileNotFoundError:  # a delete removed the folder, empty, just now
                    if attempt == 2:
                        raise
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if create_only:
                self._link_new(key, tmp, path)
            else:
                os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as e:
            raise BucketError(f"write failed: {e}", key=key, uri=self.url(key)) from e
        finally:
            # After a link, or a failed write, the temp name is still there; after a
            # successful rename it is gone.
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return digest

    def _link_new(self, key: str, tmp: Path, path: Path) -> None:
        """Publish `tmp` at `path` only if `path` does not exist, atomically: link(2) fails
        with EEXIST when the name is taken, so of two concurrent writers exactly one wins and
        the winner's bytes are complete when the name appears."""
        try:
            os.link(tmp, path)
        except FileExistsError as e:
            raise ObjectExists("key already exists", key=key, uri=self.url(key)) from e
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # Filesystems without hard links (some FUSE/SMB mounts): O_EXCL still gives
            # create-only, at the price of readers possibly seeing a partial file while it
            # is copied.
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError as e2:
                raise ObjectExists("key already exists", key=key, uri=self.url(key)) from e2
            with os.fdopen(fd, "wb") as out, open(tmp, "rb") as src:
                while block := src.read(CHUNK_SIZE * 8):
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())

    # -- reads ----------------------------------------------------------------------------

    async def get(self, key: str, sha256: str | None = None) -> bytes:
        return await self._get(key, sha256, into_buffer=False)

    async def get_buffer(self, key: str, sha256: str | None = None) -> bytearray:
        return await self._get(key, sha256, into_buffer=True)

    async def _get(self, key: str, sha256: str | None, into_buffer: bool) -> bytes | bytearray:
        path = self._path(key)
        data, digest = await asyncio.to_thread(self._read, key, path, sha256 is not None, into_buffer)
        if sha256 is not None:
            self._check_digest(key, sha256, digest)
        return data

    def _read(self, key: str, path: Path, want_digest: bool, into_buffer: bool) -> tuple[bytes | bytearray, str]:
        try:
            with open(path, "rb") as f:
                if into_buffer:
                    # objects are renamed into place whole, never changed: the size is the object's
                    data = bytearray(os.fstat(f.fileno()).st_size)
                    del data[f.readinto(data):]
                else:
                    data = f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFound("no such key", key=key, uri=self.url(key)) from e
        except OSError as e:
            raise BucketError(f"read failed: {e}", key=key, uri=self.url(key)) from e
        return data, hashlib.sha256(data).hexdigest() if want_digest else ""

    async def stream(self, key: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
        path = self._path(key)
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFound("no such key", key=key, uri=self.url(key)) from e
        except OSError as e:
            raise BucketError(f"read failed: {e}", key=key, uri=self.url(key)) from e
        try:
            while chunk := await asyncio.to_thread(f.read, chunk_size):
                yield chunk
        finally:
            f.close()

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._path(key).is_file)

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> list[str]:
        # Walk only the deepest folder the prefix fully names, then filter by string prefix
        # (S3 semantics: "adapters/v0" matches "adapters/v00000001/...").
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / folder if folder else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_MARKER)]
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            base = "" if rel_dir == "." else rel_dir + "/"
            for name in filenames:
                if name.startswith(TEMP_MARKER):  # an in-progress (or crashed) write
                    continue
                k = base + name
                if k.startswith(prefix):
                    keys.append(k)
        keys.sort()
        return keys

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(os.unlink, path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # missing, or only a "folder" of other keys: no object of that name
        except OSError as e:
            raise BucketError(f"delete failed: {e}", key=key, uri=self.url(key)) from e
        await asyncio.to_thread(self._remove_empty_folders, path.parent)

    def _remove_empty_folders(self, folder: Path) -> None:
        # S3 has no folders: a prefix whose last key is deleted is gone, and so it is here
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or already gone): the folders above are in use too
                return
            folder = folder.parent


def _fsync_dir(path: Path) -> None:
    """Make a rename/link durable across a crash (the directory entry lives in the folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
