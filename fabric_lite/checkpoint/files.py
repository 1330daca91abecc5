"""Checkpoint files on any fsspec storage, written so that a crash never replaces a good checkpoint.

A checkpoint is a directory. Its files are written under a staging name next to it, each file's
checksum goes into ``manifest.json`` (written last), and only then is the staging directory moved
into place. Loading reads the manifest and refuses a file whose bytes do not match (`loading.load_file`),
or that is a link leading out of the checkpoint directory (`member_path`).

Next to the checkpoints of a run, ``latest`` names the newest whole one; it is rewritten only after
that checkpoint is published. `newest_whole_checkpoint` takes the newest checkpoint (by the time in
its manifest) that verifies, with a warning naming each one it skips.

This module is the writer (`CheckpointWriter`, `copy_checkpoint`); the store's primitives are `store.py`, the
manifest, verification and ``latest`` are `manifest.py`. Their public names are importable from here too.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from typing import Any, Dict, Optional

import torch

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint import locks
from fabric_lite.checkpoint.manifest import (
    FORMAT_VERSION, LATEST, READABLE_VERSIONS, manifest_problem, newest_whole_checkpoint, read_manifest,
    recover_publish, update_latest, verify,
)
from fabric_lite.checkpoint.store import (
    MANIFEST, CheckpointError, filesystem, fsync_path, join_path, member_path, move_dir, naming_failures, parent_of,
    save_bytes, save_file, saying_what,
)

__all__ = ["CheckpointError", "CheckpointWriter", "read_manifest", "manifest_problem", "save_file", "verify",
           "update_latest", "newest_whole_checkpoint", "copy_checkpoint", "member_path", "FORMAT_VERSION",
           "READABLE_VERSIONS", "MANIFEST", "LATEST", "filesystem", "save_bytes"]


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

            self.fs.makedirs(parent_of(self.path), exist_ok=True)
            with locks.publishing(self.fs, parent_of(self.path)):  # no cleanup sees it before it is locked
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
        parent, name = parent_of(target), target.rsplit("/", 1)[-1]
        with locks.publishing(self.fs, parent):
            if not self.fs.exists(target):
                recover_publish(self.fs, target)
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
        target = join_path(self.fs, self.staging, name)
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
                fsync_path(self.fs, target)
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
                raise saying_what(cause, f"writing {name} of {self.url}") from err
            raise
        self.checksums[name] = out.hexdigest()
        if self.durable:
            fsync_path(self.fs, target)

    def commit(self, checksums: Dict[str, str], meta: Optional[Dict[str, Any]] = None) -> None:
        meta = {"saved_at": time.time(), **(meta or {})}
        manifest = {"format_version": FORMAT_VERSION, "checksum": digests.CHECKSUM, "files": checksums, "meta": meta}
        target = self.path.rstrip("/")
        with locks.publishing(self.fs, parent_of(target)):  # another run's save into this directory waits
            # under another name first: a manifest.json that exists is whole (a crash mid-write leaves no torn one)
            partial = join_path(self.fs, self.staging, f"{MANIFEST}.partial")
            with naming_failures(f"writing {MANIFEST} of {self.url}"):
                with self.fs.open(partial, "w") as f:
                    json.dump(manifest, f, indent=1, sort_keys=True)
                if self.durable:
                    fsync_path(self.fs, partial)
            self.fs.mv(partial, join_path(self.fs, self.staging, MANIFEST))
            if self.durable:  # the files and their names are on disk before the directory is renamed into place
                fsync_path(self.fs, self.staging)
            old = None
            if self.fs.exists(target):
                old = f"{target}.old-{self.token}"
                move_dir(self.fs, target, old)
            move_dir(self.fs, self.staging, target)
            if self.durable:  # the rename itself
                fsync_path(self.fs, parent_of(target))
            if old is not None:
                self.fs.rm(old, recursive=True)
        self.release()

    def abort(self) -> None:
        try:
            if self.fs.exists(self.staging):
                self.fs.rm(self.staging, recursive=True)
        finally:
            self.release()


def copy_checkpoint(src: str, dst: str, storage_options: Optional[dict] = None) -> None:
    """Publish a copy of the whole checkpoint `src` at `dst` (same store), with the same guarantee as a save:
    the files are staged next to `dst`, and the previous checkpoint there is replaced only once all are in."""
    fs, src_path = filesystem(src, storage_options)
    manifest = read_manifest(src, storage_options)
    writer = CheckpointWriter(dst, storage_options=storage_options)
    try:
        writer.clean_up_interrupted()
        for name in manifest["files"]:
            fs.copy(member_path(fs, src_path, name, src), join_path(fs, writer.staging, name))
        writer.checksums = dict(manifest["files"])
        writer.commit(writer.checksums, manifest.get("meta"))
    except BaseException:
        writer.abort()
        raise
