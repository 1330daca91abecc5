"""Accelerate's FSDP utilities that apply here: `merge_fsdp_weights` (the whole weights of a sharded
checkpoint as one file, what `fabric-lite merge-weights` and `fabric-lite consolidate` write) and the switches
of RAM-efficient loading (an environment variable that Hugging Face Transformers reads)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Tuple, Union

from fabric_lite.strategies import registry as _strategies  # noqa: F401 (registers the strategies' checkpoint engines)

__all__ = ["merge_fsdp_weights", "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading",
           "resolve_checkpoint"]

RAM_EFFICIENT_LOADING = "FSDP_CPU_RAM_EFFICIENT_LOADING"


def enable_fsdp_ram_efficient_loading() -> None:
    """Ask Hugging Face Transformers' `from_pretrained` to load weights on the first process only (the others get
    empty weights that FSDP fills): sets ``FSDP_CPU_RAM_EFFICIENT_LOADING=True``."""
    os.environ[RAM_EFFICIENT_LOADING] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo `enable_fsdp_ram_efficient_loading`: ``FSDP_CPU_RAM_EFFICIENT_LOADING=False``."""
    os.environ[RAM_EFFICIENT_LOADING] = "False"


def resolve_checkpoint(checkpoint_dir: Union[str, os.PathLike]) -> Tuple[str, int]:
    """(checkpoint directory, model index) for `checkpoint_dir`: a fabric_lite checkpoint (its model 0), or the
    directory of one model inside it named as Accelerate names them (``pytorch_model_fsdp_<i>``, ``model_<i>``),
    which means model i of the checkpoint above."""
    from fabric_lite.checkpoint.files import MANIFEST

    path = Path(os.fspath(checkpoint_dir))
    if (path / MANIFEST).is_file():
        return str(path), 0
    match = re.fullmatch(r"(?:pytorch_model_fsdp|model)_(\d+)", path.name)
    if match and (path.parent / MANIFEST).is_file():
        return str(path.parent), int(match.group(1))
    raise ValueError(f"{checkpoint_dir} is not a fabric_lite checkpoint (no {MANIFEST} in it or in its parent): "
                     f"merge_fsdp_weights reads the directory accelerator.save_state wrote. A checkpoint written "
                     f"by Accelerate itself is read by Accelerate's merge_fsdp_weights.")


def merge_fsdp_weights(checkpoint_dir: Union[str, os.PathLike], output_path: Union[str, os.PathLike],
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> str:
    """Write the whole weights of a (sharded, FSDP) checkpoint as ``{output_path}/model.safetensors``, or
    ``pytorch_model.bin`` without `safe_serialization`: one state dict a plain ``nn.Module`` loads. Runs on the CPU
    in this process, without a process group; launched on several processes, the main one writes and the others
    wait. `remove_checkpoint_dir` deletes the checkpoint afterwards. Returns the file written."""
    from fabric_lite.checkpoint.state import export_weights
    from fabric_lite.state import process_facts
    from fabric_lite.utils.constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    url, model_index = resolve_checkpoint(checkpoint_dir)
    out = os.path.join(os.fspath(output_path), SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
    facts = process_facts()
    if facts["process_index"] == 0:
        os.makedirs(os.fspath(output_path), exist_ok=True)
        export_weights(url, out, model_index)
        if remove_checkpoint_dir:
            shutil.rmtree(url)
    if facts["num_processes"] > 1:
        from fabric_lite.state import PartialState

        PartialState().wait_for_everyone()
    return out
