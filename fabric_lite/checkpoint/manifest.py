"""What a checkpoint's ``manifest.json`` must hold (`manifest_problem`), reading it (`read_manifest`), checking every
file against it (`verify`), finishing a publish a crash interrupted (`recover_publish`), and the ``latest`` pointer
with the newest whole checkpoint of a run (`update_latest`, `newest_whole_checkpoint`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
import warnings
from typing import Any, Dict, Optional

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint import locks
from fabric_lite.checkpoint.store import (
    MANIFEST, CheckpointError, filesystem, fsync_path, join_path, member_path, move_dir, naming_failures, parent_of,
)

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "LATEST", "manifest_problem", "read_manifest", "verify",
           "recover_publish", "update_latest", "newest_whole_checkpoint"]

FORMAT_VERSION = 3  # 2: main-process state in one training_state.pt; 3: "zip:" checksums (below)
#: Versions this code reads: 2 differs from 3 only in having no "zip:" checksums.
READABLE_VERSIONS = (2, 3)
LATEST = "latest"


def _whole(fs: Any, path: str) -> bool:
    try:
        _verify_at(fs, path, path)
        return True
    except (CheckpointError, OSError):
        return False


def recover_publish(fs: Any, path: str) -> None:
    """Finish a publish that a crash interrupted between its two moves (see `CheckpointWriter.commit`)."""
    target = path.rstrip("/")
    parent = parent_of(target)
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
        move_dir(fs, complete[0], target)
    elif old:
        move_dir(fs, old[0], target)


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def read_manifest(url: str, storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """The manifest of the checkpoint at `url`, checked to be whole (CheckpointError otherwise)."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        recover_publish(fs, path)
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
    layout = meta.get("layout")
    if layout is not None and not (isinstance(layout, dict) and all(
            isinstance(k, str) and _count(v, 1) for k, v in layout.items())):
        return f"meta 'layout' is {layout!r:.60}, not sizes by mesh dimension"
    return None


def verify(url: str, storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Read every file of a checkpoint and check it against the manifest; returns the manifest."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        recover_publish(fs, path)
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
        with locks.publishing(fs, parent), naming_failures(f"writing {parent}/{LATEST}"):
            with fs.open(tmp, "w") as f:
                json.dump({"name": name}, f)
            if durable:
                fsync_path(fs, tmp)
            fs.mv(tmp, f"{parent}/{LATEST}")
    except BaseException:
        with contextlib.suppress(Exception):  # nothing half-written stays behind
            if fs.exists(tmp):
                fs.rm(tmp)
        raise
    if durable:
        fsync_path(fs, parent)


def _saved_at(fs: Any, path: str) -> float:
    """When the checkpoint at `path` was saved: the time in its manifest, or, where that cannot be read
    (a damaged manifest, a staging directory), the time the store gives the directory, so that a
    damaged newest checkpoint is tried (and reported) before older ones."""
    try:
        with fs.open(join_path(fs, path, MANIFEST), "r") as f:
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
        with fs.open(join_path(fs, path, LATEST), "r") as f:
            pointed = json.load(f)["name"]
    except (OSError, ValueError, KeyError, TypeError):  # a damaged pointer only loses its say in ties
        pass
    dirs = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "directory"}
    # a save interrupted between its two moves leaves only X.staging-*/X.old-*: reading X recovers it
    bases = {d.split(".staging-")[0].split(".old-")[0] for d in dirs}
    # newest first by the time in the manifest (a crash between a publish and the `latest` update
    # must not lose the newer checkpoint); `latest` decides between equal times
    dated = sorted(((_saved_at(fs, join_path(fs, path, b)), b == pointed, b) for b in bases), reverse=True)
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
