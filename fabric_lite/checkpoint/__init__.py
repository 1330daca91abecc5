"""Checkpoints: files on any fsspec store (staged, checksummed, published atomically) in `files`, and
what a training checkpoint holds and how it is saved and restored (`state`)."""
