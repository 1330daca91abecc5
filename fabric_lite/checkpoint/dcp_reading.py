"""Reading torch.distributed.checkpoint (DCP) files without running code from them.

DCP's own reader unpickles the ``.metadata`` index with plain `pickle.load`, and its default load planner
reads non-tensor values with ``torch.load(weights_only=False)``: a crafted file would run its code in
every process that loads the checkpoint. Here the index is read once, verified against the manifest,
and unpickled by an unpickler that builds only DCP's metadata classes and the few torch and standard
types they hold; it is then checked for shape (every storage entry names a shard file of this
checkpoint) and handed to DCP, and non-tensor values load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, Set

import torch

from fabric_lite.checkpoint.files import CheckpointError

__all__ = ["read_metadata", "reader", "safe_load_planner", "metadata_problem"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP's metadata pickles refer to (its dataclasses, torch.Size, dtypes, layouts, the checkpoint id's
# path type): each is inert, building it runs no code of the file's choosing.
_ALLOWED: Dict[str, Set[str]] = {
    _DCP_METADATA: {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                    "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP's metadata")


def metadata_problem(metadata: Any, shard_files: Set[str]) -> str:
    """What is wrong with an unpickled DCP index ('' when nothing): its types, and that every storage entry
    reads a shard file the manifest lists (not a path of the file's choosing)."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                       TensorStorageMetadata)

    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return "its state_dict_metadata is not a map"
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"its entry {key!r:.60} is a {type(entry).__name__}, not a tensor's or a value's description"
        if isinstance(entry, TensorStorageMetadata) and not (
                isinstance(entry.size, torch.Size) and isinstance(getattr(entry.properties, "dtype", None), torch.dtype)):
            return f"its entry {key!r:.60} has no size or dtype"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage_data is not a map"
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or relative not in shard_files:
            return f"a storage entry reads {relative!r:.80}, which is not one of this checkpoint's shard files"
        if not all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length")):
            return f"the storage entry of {index.fqn!r:.60} has no valid offset and length"
    return ""


def read_metadata(data: bytes, shard_files: Set[str], url: str) -> Any:
    """DCP's index from the bytes of a ``.metadata`` file (already checked against the manifest)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # a crafted or damaged file: refused, nothing of it was built
        raise CheckpointError(f"{url}/.metadata is not a DCP index this can read safely ({err}); nothing was "
                              f"loaded. Load an earlier checkpoint.") from None
    problem = metadata_problem(metadata, shard_files)
    if problem:
        raise CheckpointError(f"{url}/.metadata is damaged: {problem}. Nothing was loaded.")
    return metadata


def reader(local: bool, path: str, metadata: Any) -> Any:
    """A DCP storage reader over `path` (a local path or an fsspec URL) that hands out `metadata` instead of
    unpickling the index itself."""
    import torch.distributed.checkpoint as dcp

    if local:
        base: Any = dcp.FileSystemReader
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as base

    class _VerifiedIndexReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _VerifiedIndexReader(path)


def safe_load_planner() -> Any:
    """DCP's default load planner, except that values which are not tensors load with weights_only=True."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"the value {read_item.dest_index.fqn!r} holds objects that safe loading "
                                      f"refuses ({err}); nothing of it was built.") from None
            # DCP's planner places the value where it belongs (and unpickles it in full): it gets a copy
            # written from what safe loading built, which holds nothing but plain data
            again = io.BytesIO()
            torch.save(obj, again)
            again.seek(0)
            super().load_bytes(read_item, again)

    return _SafeLoadPlanner()
