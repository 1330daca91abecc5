"""Accelerate's ``accelerate.inference``: `prepare_pippy` (pipeline-parallel inference through PiPPy). fabric_lite
does not do it; the name imports and calling it raises `NotSupportedError`."""

from __future__ import annotations

from fabric_lite.refusals import refused

prepare_pippy = refused(
    "prepare_pippy", "pipeline-parallel inference (PiPPy)",
    "run the whole model on each process and split the inputs with "
    "accelerator.split_between_processes(inputs), then gather the outputs with accelerator.gather_object")

__all__ = ["prepare_pippy"]
