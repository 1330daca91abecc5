"""Reading one file of a checkpoint: checksum against the manifest, safe unpickling, one kind of error.

Every failure (a damaged file, what safe loading refuses, bytes torch cannot read) is a `CheckpointError`
that names the file; with `weights_only=False` nothing is unpickled before the whole file is verified."""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint.files import CheckpointError, filesystem, member_path

__all__ = ["load_file", "start_reading"]

_READERS: Any = None


def start_reading(url: str, names: Iterable[str], manifest: Dict[str, Any],
                  storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Begin reading and checksumming the files `names` of a checkpoint, all at once, on helper threads; what
    `load_file(..., started=...)` takes. A local file is checksummed where it lies (torch.load maps it); a file of
    another store is fetched whole, then checksummed while the next ones download. Nothing is unpickled here:
    `load_file` decides when (for `weights_only=False`, only after the checksum matched). A file this cannot
    start (not in the manifest, a link out of the checkpoint, a checksum it does not know) is left to `load_file`,
    which says what is wrong."""
    fs, path = filesystem(url, storage_options)
    algorithm = manifest.get("checksum", "sha256")
    local = digests.is_local(fs)
    started: Dict[str, Any] = {}
    try:
        digests.digest(algorithm)
    except CheckpointError:
        return started
    for name in names:
        expected = manifest["files"].get(name)
        if expected is None or name in started:
            continue
        try:
            full = member_path(fs, path, name, url)
        except CheckpointError:
            continue
        try:
            started[name] = _readers().submit(_read_and_check, fs, full, local, expected, algorithm)
        except RuntimeError:  # the interpreter is shutting down: load_file reads it in place
            break
    return started


def _read_and_check(fs: Any, full: str, local: bool, expected: str, algorithm: str) -> Tuple[Any, Any]:
    """(the file's source for torch.load: a local path or its bytes, the checksum's Future); a file that is
    not there gives (None, None)."""
    if local:
        source: Any = fs._strip_protocol(full)
        if not os.path.exists(source):
            return None, None
    else:
        try:
            # (a file's read, not fs.cat_file: s3fs's cat_file took 4-5x as long for large objects)
            with fs.open(full, "rb") as f:
                source = f.read()
        except FileNotFoundError:
            return None, None
    # (on the same threads: this task does not wait for it, so the pool never waits on itself)
    return source, _readers().submit(_checksum, source, expected, algorithm)


def _readers() -> Any:
    global _READERS
    if _READERS is None or _READERS[0] != os.getpid():  # a forked child makes its own (see checksums._pool)
        from concurrent.futures import ThreadPoolExecutor

        _READERS = (os.getpid(), ThreadPoolExecutor(4, thread_name_prefix="fabric_lite_read"))
    return _READERS[1]


def load_file(
    url: str, name: str, manifest: Dict[str, Any], map_location: Any = "cpu",
    weights_only: bool = True, storage_options: Optional[dict] = None, started: Optional[Dict[str, Any]] = None,
) -> Any:
    """Load one file of a checkpoint, checking its checksum against the manifest.

    With `weights_only=True` the checksum is computed on a helper thread while `torch.load` reads (safe:
    that unpickler builds nothing but tensors and containers), and a mismatch discards the result. With
    `weights_only=False` unpickling can run code, so the file is verified whole before anything reads it.
    `started` (from `start_reading`) holds files already being read and checked: this one is taken from it."""
    fs, path = filesystem(url, storage_options)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{url} has no file {name!r} in its manifest (it holds {sorted(manifest['files'])}).")
    full = member_path(fs, path, name, url)
    algorithm = manifest.get("checksum", "sha256")
    digests.digest(algorithm)  # an unknown algorithm is refused before anything is read
    early = started.pop(name, None) if started is not None else None
    if early is not None:
        source, pending = early.result()
        if source is None:
            raise CheckpointError(f"{url} is missing {name}, which its manifest lists.")
    elif digests.is_local(fs):
        local = fs._strip_protocol(full)
        if not os.path.exists(local):
            raise CheckpointError(f"{url} is missing {name}, which its manifest lists.")
        source = local
        pending = digests.on_helper_thread(_checksum, source, expected, algorithm)
    else:
        try:
            with fs.open(full, "rb") as f:
                source = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{url} is missing {name}, which its manifest lists.") from None
        pending = digests.on_helper_thread(_checksum, source, expected, algorithm)
    corrupt = f"{url}/{name} does not match its checksum: the file is corrupt. Load an earlier checkpoint."
    if not weights_only and not digests.matches(pending.result(), expected):
        raise CheckpointError(corrupt)
    try:
        # A local file is mapped, not read: tensors are views of the page cache until something
        # writes to them, and load_state_dict copies weights into the existing parameters.
        obj = torch.load(source if isinstance(source, str) else io.BytesIO(source), map_location=map_location,
                         weights_only=weights_only, mmap=isinstance(source, str))
    except Exception as err:
        if not digests.matches(pending.result(), expected):  # a damaged file explains it better than the unpickler
            raise CheckpointError(corrupt) from None
        if isinstance(err, pickle.UnpicklingError) and weights_only:
            raise CheckpointError(
                f"{url}/{name} holds objects that safe loading (weights_only=True) refuses: {_refused(err)}. If you trust "
                f"this checkpoint, call load_state(..., weights_only=False).") from None
        raise CheckpointError(f"{url}/{name} cannot be read ({type(err).__name__}: {str(err)[:200]}); nothing was "
                              f"loaded. Load an earlier checkpoint.") from None
    if not digests.matches(pending.result(), expected):
        raise CheckpointError(corrupt)
    return obj


def _checksum(source: Any, expected: str, algorithm: str) -> str:
    """The file's checksum, or a value that matches nothing where the file cannot be read (a directory, no
    permission): it is then refused as not matching, before or instead of being unpickled."""
    try:
        return digests.checksum_of(source, expected, algorithm)
    except OSError:
        return digests.ZIP_DAMAGED


def _refused(err: BaseException) -> str:
    """What torch's weights_only unpickler refused ("Unsupported global: GLOBAL mod.Class ..."), without the
    paragraph of advice (and terminal colours) around it."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    mark = text.find("WeightsUnpickler error:")
    fact = text[mark + len("WeightsUnpickler error:"):].strip() if mark >= 0 else text.strip()
    fact = fact.splitlines()[0] if fact else type(err).__name__
    cut = fact.find(" Please use ")
    return (fact[:cut] if cut >= 0 else fact).strip().rstrip(".")
