"""Files on any fsspec store, as checkpoints use them: the store of a URL, the paths of a checkpoint's members,
one file written whole or not at all (`save_file`, `save_bytes`), a directory moved into place (`move_dir`),
fsync on local disks, and OS errors that say what was being written."""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from typing import Any, Iterator, Optional, Tuple

import torch

from fabric_lite.checkpoint import checksums as digests

__all__ = ["CheckpointError", "MANIFEST", "filesystem", "join_path", "member_path", "move_dir", "save_file",
           "save_bytes", "parent_of", "naming_failures", "saying_what", "fsync_path"]

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial, corrupt or from an incompatible format."""


def filesystem(url: str, storage_options: Optional[dict] = None) -> Tuple[Any, str]:
    """The fsspec filesystem of `url` and the path inside it."""
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(url), **(storage_options or {}))


def join_path(fs: Any, *parts: str) -> str:
    """`parts` joined with single slashes (the store's paths are always "/"-separated)."""
    return "/".join(p.rstrip("/") if i == 0 else p.strip("/") for i, p in enumerate(parts))


def member_path(fs: Any, path: str, name: str, url: str) -> str:
    """The path of the file `name` of the checkpoint at `path`, for reading; a member that is a link leading out of
    the checkpoint directory is refused (loading never reads outside the checkpoint it was given)."""
    full = join_path(fs, path, name)
    if digests.is_local(fs):
        local = fs._strip_protocol(full)
        if os.path.islink(local):
            root = os.path.realpath(fs._strip_protocol(path))
            target = os.path.realpath(local)
            if os.path.commonpath([root, target]) != root:
                raise CheckpointError(
                    f"{url}/{name} is a link to {target}, outside the checkpoint directory; nothing was read. A "
                    f"checkpoint holds its own files: copy the file in instead of linking it.")
    return full


def _renames(fs: Any) -> bool:
    """Whether the store moves a directory in one step (local disks, fsspec's memory store)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local", "memory"} & set(protocol))


def move_dir(fs: Any, src: str, dst: str) -> None:
    """Move a checkpoint directory. A rename where the store has one; on object stores (no
    directories, no rename) a copy of every file, the manifest last, then the source is deleted, so
    the copy never looks whole before it is."""
    if _renames(fs):
        fs.mv(src, dst, recursive=True)
        return
    files = sorted(fs.find(src), key=lambda p: p.rstrip("/").endswith("/" + MANIFEST))
    for path in files:
        fs.copy(path, dst.rstrip("/") + "/" + path[len(src.rstrip("/")) + 1:])
    fs.rm(src, recursive=True)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_file(obj: Any, url: str, storage_options: Optional[dict] = None) -> None:
    """torch.save `obj` to one fsspec URL, through a temporary name (atomic where the store renames)."""
    save_bytes(_to_bytes(obj), url, storage_options)


def save_bytes(data: bytes, url: str, storage_options: Optional[dict] = None) -> None:
    """Write `data` as one file at an fsspec URL (its directory made if missing), through a temporary name:
    a failed write leaves neither a partial file nor the temporary one."""
    fs, path = filesystem(url, storage_options)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with naming_failures(f"writing {url}"):
            if parent:
                fs.makedirs(parent, exist_ok=True)
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(tmp):
                fs.rm(tmp)
        raise


def parent_of(path: str) -> str:
    """The directory that holds `path` ("." for a bare name)."""
    target = path.rstrip("/")
    return target.rsplit("/", 1)[0] if "/" in target else "."


@contextlib.contextmanager
def naming_failures(what: str) -> Iterator[None]:
    """An OSError inside says what was being written (a full disk names the file, not only its errno)."""
    try:
        yield
    except OSError as err:
        raise saying_what(err, what) from err


def saying_what(err: OSError, what: str) -> OSError:
    """`err` with `what` was being done appended to its message (same errno)."""
    if err.errno is None:
        return OSError(f"{err} ({what})")
    return OSError(err.errno, f"{err.strerror or err} ({what})")


def fsync_path(fs: Any, path: str) -> None:
    """Flush a local file or directory to the disk (other stores make an upload durable when it completes)."""
    if not digests.is_local(fs):
        return
    fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
