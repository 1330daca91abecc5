"""Accelerate's file-name constants (``accelerate.utils.MODEL_NAME``, ...), for scripts that build paths from them.

`Accelerator.save_model` writes the weight files these name (``model.safetensors``, ``pytorch_model.bin``, their
sharded index). `Accelerator.save_state` writes fabric_lite's own checkpoint layout (a manifest with a checksum per
file): the save_state names below (``optimizer``, ``random_states``, ...) are Accelerate's, kept for scripts that
read them, not the names of files in a fabric_lite checkpoint.
"""

MODEL_NAME = "pytorch_model"
OPTIMIZER_NAME = "optimizer"
RNG_STATE_NAME = "random_states"
SCALER_NAME = "scaler.pt"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_MODEL_NAME = "model"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
FSDP_MODEL_NAME = "pytorch_model_fsdp"

__all__ = [name for name in dir() if name.isupper()]
