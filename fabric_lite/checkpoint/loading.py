"""Reading one file of a checkpoint: checksum against the manifest, safe unpickling, one kind of error.

Every failure (a damaged file, what safe loading refuses, bytes torch cannot read) is a `CheckpointError`
that names the file; with `weights_only=False` nothing is unpickled before the whole file is verified."""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Dict, Optional

import torch

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint.files import CheckpointError, filesystem, member_path

__all__ = ["load_file"]


def load_file(
    url: str, name: str, manifest: Dict[str, Any], map_location: Any = "cpu",
    weights_only: bool = True, storage_options: Optional[dict] = None,
) -> Any:
    """Load one file of a checkpoint, checking its checksum against the manifest.

    With `weights_only=True` the checksum is computed on a helper thread while `torch.load` reads (safe:
    that unpickler builds nothing but tensors and containers), and a mismatch discards the result. With
    `weights_only=False` unpickling can run code, so the file is verified whole before anything reads it."""
    fs, path = filesystem(url, storage_options)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{url} has no file {name!r} in its manifest (it holds {sorted(manifest['files'])}).")
    full = member_path(fs, path, name, url)
    algorithm = manifest.get("checksum", "sha256")
    digests.digest(algorithm)  # an unknown algorithm is refused before anything is read
    if digests.is_local(fs):
        local = fs._strip_protocol(full)
        if not os.path.exists(local):
            raise CheckpointError(f"{url} is missing {name}, which its manifest lists.")
        source: Any = local
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
