"""Checkpoint files on any fsspec storage, written so that a crash never replaces a good checkpoint.

A checkpoint is a directory. Its files are written under a staging name next to it, each file's
checksum goes into ``manifest.json`` (written last), and only then is the staging directory moved
into place. Loading reads the manifest and refuses a file whose bytes do not match (`loading.load_file`),
or that is a link leading out of the checkpoint directory (`member_path`).

Next to the checkpoints of a run, ``latest`` names the newest whole one; it is rewritten only after
that checkpoint is published. `newest_whole_checkpoint` takes the newest checkpoint (by the time in
its manifest) that verifies, with a warning naming each one it skips.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
import uuid
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint import locks

__all__ = ["CheckpointError", "CheckpointWriter", "read_manifest", "manifest_problem", "save_file", "verify",
           "update_latest", "newest_whole_checkpoint", "copy_checkpoint", "member_path", "FORMAT_VERSION"]

FORMAT_VERSION = 3  # 2: main-process state in one training_state.pt; 3: "zip:" checksums (below)
#: Versions this code reads: 2 differs from 3 only in having no "zip:" checksums.
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial, corrupt or from an incompatible format."""


def filesystem(url: str, storage_options: Optional[dict] = None) -> Tuple[Any, str]:
    """The fsspec filesystem of `url` and the path inside it."""
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(url), **(storage_options or {}))


def _join(fs: Any, *parts: str) -> str:
    return "/".join(p.rstrip("/") if i == 0 else p.strip("/") for i, p in enumerate(parts))


def member_path(fs: Any, path: str, name: str, url: str) -> str:
    """The path of the file `name` of the checkpoint at `path`, for reading; a member that is a link leading out of
    the checkpoint directory is refused (loading never reads outside the checkpoint it was given)."""
    full = _join(fs, path, name)
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


def _move_dir(fs: Any, src: str, dst: str) -> None:
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
        with _naming_failures(f"writing {url}"):
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


def _parent_of(path: str) -> str:
    target = path.rstrip("/")
    return target.rsplit("/", 1)[0] if "/" in target else "."


class CheckpointWriter:
    """Write the files of one checkpoint directory; `commit` publishes them all at once.

    In a multi-process job every rank opens a writer on the same `staging` name (rank 0 chooses it
    and broadcasts it), writes its own files, and rank 0 commits with everyone's checksums.
    """

    def __init__(self, url: str, staging_token: Optional[str] = None, storage_options: Optional[dict] = None,
                 durable: bool = False):
        self.url = os.fspath(url)
        self.fs, self.path = filesystem(self.url, storage_options)
        #: fsync every file and directory before the checkpoint is published (local disks: power-loss safety)
        self.durable = durable
        self.token = staging_token or uuid.uuid4().hex[:12]
        self.staging = f"{self.path.rstrip('/')}.staging-{self.token}"
        self.checksums: Dict[str, str] = {}
        self._lock_fd: Optional[int] = None
        if digests.is_local(self.fs):
            import fcntl

            self.fs.makedirs(_parent_of(self.path), exist_ok=True)
            with locks.publishing(self.fs, _parent_of(self.path)):  # no cleanup sees it before it is locked
                self.fs.makedirs(self.staging, exist_ok=True)
                self._lock_fd = locks.lock(self.fs._strip_protocol(self.staging), fcntl.LOCK_SH)
        else:
            self.fs.makedirs(self.staging, exist_ok=True)

    def release(self) -> None:
        """Let go of the staging directory's lock (commit and abort do; other ranks call it when done)."""
        locks.unlock(self._lock_fd)
        self._lock_fd = None

    def clean_up_interrupted(self) -> None:
        """Recover or delete what an earlier, interrupted save left next to the target (main process)."""
        target = self.path.rstrip("/")
        parent, name = _parent_of(target), target.rsplit("/", 1)[-1]
        with locks.publishing(self.fs, parent):
            if not self.fs.exists(target):
                _recover(self.fs, target)
            try:
                siblings = self.fs.ls(parent, detail=False)
            except FileNotFoundError:  # an object store has no empty directories: nothing there yet
                siblings = []
            for p in siblings:
                base = p.rstrip("/").rsplit("/", 1)[-1]
                if base == f"{name}.staging-{self.token}":
                    continue
                # an `.old-` directory is only ever seen here when its commit died (commits hold the lock)
                if (base.startswith(f"{name}.staging-") and locks.is_stale(self.fs, p)) or base.startswith(f"{name}.old-"):
                    self.fs.rm(p, recursive=True)

    def write(self, name: str, obj: Any) -> None:
        """torch.save `obj` as `name` into the staging directory and record its checksum."""
        target = _join(self.fs, self.staging, name)
        if digests.is_local(self.fs):
            local = self.fs._strip_protocol(target)
            written = False
            try:
                # torch's own writer, straight to the file: as fast as a bare torch.save. The zip it writes has a
                # CRC-32 per record; the manifest records a digest of that listing, and loading checks both.
                torch.save(obj, local)
                written = True
            except Exception:
                pass  # (outside this block the failed writer, and the file it holds open, are let go)
            if not written:
                # torch's writer reports a failed write (a full disk) in its own words: write again through a
                # Python file, which says what the OS said (and succeeds if the failure was passing)
                if os.path.exists(local):
                    os.remove(local)
                self._write_streamed(name, obj, target)
                return
            self.checksums[name] = digests.zip_listing_digest(local)
            if self.durable:
                _fsync(self.fs, target)
            return
        self._write_streamed(name, obj, target)

    def _write_streamed(self, name: str, obj: Any, target: str) -> None:
        """Through the store's file object, checksummed as the bytes go (any fsspec store)."""
        out: Optional[digests.HashingWriter] = None
        try:
            with self.fs.open(target, "wb") as f:
                out = digests.HashingWriter(f)
                # streamed (no in-memory copy of the whole file); torch's many small records are gathered
                # into 64 KiB writes, large tensors pass straight through
                with io.BufferedWriter(out, 1 << 16) as buffered:
                    torch.save(obj, buffered)
        except Exception as err:
            cause = out.error if out is not None and out.error is not None else err
            if isinstance(cause, OSError):  # a full disk, a failed upload: say so, not the serializer's words
                raise _saying_what(cause, f"writing {name} of {self.url}") from err
            raise
        self.checksums[name] = out.hexdigest()
        if self.durable:
            _fsync(self.fs, target)

    def commit(self, checksums: Dict[str, str], meta: Optional[Dict[str, Any]] = None) -> None:
        meta = {"saved_at": time.time(), **(meta or {})}
        manifest = {"format_version": FORMAT_VERSION, "checksum": digests.CHECKSUM, "files": checksums, "meta": meta}
        target = self.path.rstrip("/")
        with locks.publishing(self.fs, _parent_of(target)):  # another run's save into this directory waits
            # under another name first: a manifest.json that exists is whole (a crash mid-write leaves no torn one)
            partial = _join(self.fs, self.staging, f"{MANIFEST}.partial")
            with _naming_failures(f"writing {MANIFEST} of {self.url}"):
                with self.fs.open(partial, "w") as f:
                    json.dump(manifest, f, indent=1, sort_keys=True)
                if self.durable:
                    _fsync(self.fs, partial)
            self.fs.mv(partial, _join(self.fs, self.staging, MANIFEST))
            if self.durable:  # the files and their names are on disk before the directory is renamed into place
                _fsync(self.fs, self.staging)
            old = None
            if self.fs.exists(target):
                old = f"{target}.old-{self.token}"
                _move_dir(self.fs, target, old)
            _move_dir(self.fs, self.staging, target)
            if self.durable:  # the rename itself
                _fsync(self.fs, _parent_of(target))
            if old is not None:
                self.fs.rm(old, recursive=True)
        self.release()

    def abort(self) -> None:
        try:
            if self.fs.exists(self.staging):
                self.fs.rm(self.staging, recursive=True)
        finally:
            self.release()


@contextlib.contextmanager
def _naming_failures(what: str) -> Iterator[None]:
    """An OSError inside says what was being written (a full disk names the file, not only its errno)."""
    try:
        yield
    except OSError as err:
        raise _saying_what(err, what) from err


def _saying_what(err: OSError, what: str) -> OSError:
    if err.errno is None:
        return OSError(f"{err} ({what})")
    return OSError(err.errno, f"{err.strerror or err} ({what})")


def _fsync(fs: Any, path: str) -> None:
    """Flush a local file or directory to the disk (other stores make an upload durable when it completes)."""
    if not digests.is_local(fs):
        return
    fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_checkpoint(src: str, dst: str, storage_options: Optional[dict] = None) -> None:
    """Publish a copy of the whole checkpoint `src` at `dst` (same store), with the same guarantee as a save:
    the files are staged next to `dst`, and the previous checkpoint there is replaced only once all are in."""
    fs, src_path = filesystem(src, storage_options)
    manifest = read_manifest(src, storage_options)
    writer = CheckpointWriter(dst, storage_options=storage_options)
    try:
        writer.clean_up_interrupted()
        for name in manifest["files"]:
            fs.copy(member_path(fs, src_path, name, src), _join(fs, writer.staging, name))
        writer.checksums = dict(manifest["files"])
        writer.commit(writer.checksums, manifest.get("meta"))
    except BaseException:
        writer.abort()
        raise


def _whole(fs: Any, path: str) -> bool:
    try:
        _verify_at(fs, path, path)
        return True
    except (CheckpointError, OSError):
        return False


def _recover(fs: Any, path: str) -> None:
    """Finish a publish that a crash interrupted between its two moves (see `CheckpointWriter.commit`)."""
    target = path.rstrip("/")
    parent = _parent_of(target)
    if not fs.exists(parent):
        return
    with locks.publishing(fs, parent):
        if not fs.exists(target):  # (a commit that held the lock may have just published it)
            _recover_unlocked(fs, target, parent)


def _recover_unlocked(fs: Any, target: str, parent: str) -> None:
    name = target.rsplit("/", 1)[-1]
    try:
        siblings = fs.ls(parent, detail=False)
    except FileNotFoundError:
        return
    staged = [p for p in siblings if p.rstrip("/").rsplit("/", 1)[-1].startswith(f"{name}.staging-")]
    # the manifest is written last, but only a staging directory whose manifest and files check out is published
    complete = [p for p in staged if _whole(fs, p)]
    old = [p for p in siblings if p.rstrip("/").rsplit("/", 1)[-1].startswith(f"{name}.old-")]
    if complete:
        _move_dir(fs, complete[0], target)
    elif old:
        _move_dir(fs, old[0], target)


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def read_manifest(url: str, storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """The manifest of the checkpoint at `url`, checked to be whole (CheckpointError otherwise)."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        _recover(fs, path)
    return _manifest_at(fs, path, url)


def _manifest_at(fs: Any, path: str, url: str) -> Dict[str, Any]:
    manifest_path = member_path(fs, path, MANIFEST, url)
    if not fs.exists(manifest_path):
        if fs.exists(path):
            raise CheckpointError(
                f"{url} has no {MANIFEST}: it is not a fabric_lite checkpoint, or its write did not finish. "
                f"Load an earlier checkpoint."
            )
        raise CheckpointError(f"No checkpoint at {url}.")
    try:
        with fs.open(manifest_path, "r") as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{url}/{MANIFEST} is not readable JSON ({err}): the checkpoint is damaged. "
                              f"Load an earlier checkpoint.") from None
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{url}/{MANIFEST} is damaged: {problem}. Load an earlier checkpoint; nothing was read.")
    return manifest


def _count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value < 2 ** 63


def manifest_problem(manifest: Any) -> Optional[str]:
    """What is wrong with a parsed manifest (its layout and field types), or None."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    version = manifest.get("format_version")
    if not _count(version, 0) or version not in READABLE_VERSIONS:
        return (f"format version {version!r}; this fabric_lite reads version {FORMAT_VERSION} "
                f"(and {', '.join(map(str, READABLE_VERSIONS[:-1]))})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"'files' is {files!r:.60}, not a map of file names to checksums"
    bad = [n for n in files if not _plain_name(n)]
    if bad:  # a name like "../x" or "/abs" would make loading read, or consolidation write, outside it
        return f"it lists file names that are not plain names: {bad[:5]} (was it written by fabric_lite?)"
    bad = [n for n, digest in files.items() if not isinstance(digest, str)]
    if bad:
        return f"the checksums of {bad[:5]} are not strings"
    if not isinstance(manifest.get("checksum", "sha256"), str):
        return f"'checksum' is {manifest['checksum']!r:.60}, not an algorithm's name"
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        return f"'meta' is {meta!r:.60}, not an object"
    for key, minimum in (("step", 0), ("world_size", 1), ("iteration", 0)):
        if key in meta and meta[key] is not None and not _count(meta[key], minimum):
            return f"meta {key!r} is {meta[key]!r:.60}, not an integer >= {minimum}"
    saved_at = meta.get("saved_at", 0.0)
    if isinstance(saved_at, bool) or not isinstance(saved_at, (int, float)) or not math.isfinite(saved_at):
        return f"meta 'saved_at' is {saved_at!r:.60}, not a time"
    if meta.get("engine") is not None and not isinstance(meta["engine"], str):
        return f"meta 'engine' is {meta['engine']!r:.60}, not a name"
    return None


def verify(url: str, storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Read every file of a checkpoint and check it against the manifest; returns the manifest."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        _recover(fs, path)
    return _verify_at(fs, path, url)


def _verify_at(fs: Any, path: str, url: str) -> Dict[str, Any]:
    manifest = _manifest_at(fs, path, url)
    for name, expected in sorted(manifest["files"].items()):
        digest = digests.digest(manifest.get("checksum", "sha256"))
        try:
            with fs.open(member_path(fs, path, name, url), "rb") as f:
                if expected.startswith(digests.ZIP_PREFIX):
                    found = digests.zip_digest(f)
                else:
                    for chunk in iter(lambda: f.read(digests.CHUNK), b""):
                        digest.update(chunk)
                    found = digest.hexdigest()
        except FileNotFoundError:
            raise CheckpointError(f"{url} is missing {name}, which its manifest lists.") from None
        if not digests.matches(found, expected):
            raise CheckpointError(f"{url}/{name} does not match its checksum: the file is corrupt.")
    return manifest


def update_latest(url: str, storage_options: Optional[dict] = None, durable: bool = False) -> None:
    """Point ``latest`` (next to the checkpoint at `url`) at it; call only once it is published."""
    fs, path = filesystem(url, storage_options)
    parent, name = path.rstrip("/").rsplit("/", 1) if "/" in path.rstrip("/") else (".", path.rstrip("/"))
    tmp = f"{parent}/{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with locks.publishing(fs, parent), _naming_failures(f"writing {parent}/{LATEST}"):
            with fs.open(tmp, "w") as f:
                json.dump({"name": name}, f)
            if durable:
                _fsync(fs, tmp)
            fs.mv(tmp, f"{parent}/{LATEST}")
    except BaseException:
        with contextlib.suppress(Exception):  # nothing half-written stays behind
            if fs.exists(tmp):
                fs.rm(tmp)
        raise
    if durable:
        _fsync(fs, parent)


def _saved_at(fs: Any, path: str) -> float:
    """When the checkpoint at `path` was saved: the time in its manifest, or, where that cannot be read
    (a damaged manifest, a staging directory), the time the store gives the directory, so that a
    damaged newest checkpoint is tried (and reported) before older ones."""
    try:
        with fs.open(_join(fs, path, MANIFEST), "r") as f:
            manifest = json.load(f)
        if manifest_problem(manifest) is None:
            return float(manifest["meta"].get("saved_at", 0.0))
    except (OSError, ValueError):
        pass
    try:
        when = fs.modified(path)
        return when.timestamp() if hasattr(when, "timestamp") else float(when)
    except (OSError, NotImplementedError, ValueError, TypeError, AttributeError):
        return 0.0


def newest_whole_checkpoint(root: str, storage_options: Optional[dict] = None) -> Optional[str]:
    """The newest checkpoint directly under `root` that verifies, or None if there is none.

    Candidates go newest first by the time in their manifests (``latest`` breaks ties). A candidate
    that does not verify (partial, corrupt, another format) is skipped with a warning.
    """
    fs, path = filesystem(root, storage_options)
    root = os.fspath(root).rstrip("/")
    if not fs.exists(path):
        return None
    pointed = None
    try:
        with fs.open(_join(fs, path, LATEST), "r") as f:
            pointed = json.load(f)["name"]
    except (OSError, ValueError, KeyError, TypeError):  # a damaged pointer only loses its say in ties
        pass
    dirs = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "directory"}
    # a save interrupted between its two moves leaves only X.staging-*/X.old-*: reading X recovers it
    bases = {d.split(".staging-")[0].split(".old-")[0] for d in dirs}
    # newest first by the time in the manifest (a crash between a publish and the `latest` update
    # must not lose the newer checkpoint); `latest` decides between equal times
    dated = sorted(((_saved_at(fs, _join(fs, path, b)), b == pointed, b) for b in bases), reverse=True)
    names = [name for _, _, name in dated]
    for name in names:
        candidate = f"{root}/{name}"
        try:
            verify(candidate, storage_options)
        except CheckpointError as err:
            warnings.warn(f"Skipping checkpoint {candidate}: {err} Trying an older one.", stacklevel=2)
            continue
        return candidate
    if names:
        warnings.warn(f"None of the {len(names)} checkpoint(s) under {root} is whole (each was named above): "
                      f"there is nothing to resume from.", stacklevel=2)
    return None
