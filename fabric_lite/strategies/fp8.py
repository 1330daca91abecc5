"""fp8 training: a model's linear layers compute their matrix products in float8, the rest under bf16 autocast.

Two libraries do the work, each imported only when an fp8 run starts:

* torchao (``pip install 'fabric-lite[fp8]'``): `torchao.float8.convert_to_float8_training` swaps eligible
  `nn.Linear` layers for its `Float8Linear` (dynamic scaling, weights stay fp32 master weights).
* NVIDIA TransformerEngine (``pip install 'transformer_engine[pytorch]'``): eligible `nn.Linear` layers become
  `transformer_engine.pytorch.Linear`, and the model's forward runs inside TransformerEngine's fp8 autocast.

torchao's fp8 all-gather for FSDP2 (`enable_fsdp_float8_all_gather`, on in Accelerate's default config) is turned
off here: it replaces each converted weight with a new Parameter of a tensor subclass, which optimizers built
before `prepare` would not hold and safetensors cannot save. FSDP2 gathers those weights in its bf16 param_dtype,
and each layer casts them to fp8 itself.

Which layers: by default every `nn.Linear` whose in and out features are multiples of 16 (what the fp8 matrix
product kernels take), except the first and the last `nn.Linear` the model registers (in `named_modules()`
order): the embedding-side and output-side projections are the most sensitive to fp8's range, and keeping them
in bf16 is what makes fp8 runs converge like bf16 ones. A recipe's `module_filter` (module, qualified name) ->
bool replaces that choice.

fp8 matrix products need an NVIDIA GPU of compute capability 8.9 or newer (Ada: L4, L40, RTX 40xx; Hopper:
H100, H200; Blackwell). `fp8_problem` says why a run cannot train in fp8 here, in one sentence with the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["FP8Recipe", "FP8_BACKENDS", "MIN_CAPABILITY", "INSTALL", "default_fp8_recipe", "default_ao_config", "fp8_problem",
           "hardware_problem", "machine_problem", "package_problem", "check_fp8", "convert_model_to_fp8", "find_first_last_linear_layers",
           "filter_linear_layers", "fp8_layer_names", "TORCHAO_MIN_VERSION"]

FP8_BACKENDS = ("ao", "te")
MIN_CAPABILITY = (8, 9)
TORCHAO_MIN_VERSION = (0, 6, 1)
#: What to install for each backend.
INSTALL = {"ao": "pip install 'fabric-lite[fp8]' (torchao)",
           "te": "pip install 'transformer_engine[pytorch]' (NVIDIA TransformerEngine, built for your torch and CUDA)"}
_GPU_EXAMPLES = "H100, H200, L4, L40, RTX 40xx"
_USE_BF16 = "Use bf16 mixed precision (mixed_precision='bf16', or precision='bf16-mixed')"


class FP8Recipe:
    """How to train in fp8: the library (`backend` "ao" or "te") and its settings.

    ao: `config` is a `torchao.float8.Float8LinearConfig` (None: `default_ao_config()`, Accelerate's default). te: `te_recipe` holds the
    keywords of TransformerEngine's `DelayedScaling` recipe (`margin`, `interval`, `fp8_format` as a name,
    `amax_history_len`, `amax_compute_algo`, `override_linear_precision`), `use_mxfp8_block_scaling` asks for its
    `MXFP8BlockScaling` instead, and `use_autocast_during_eval` keeps fp8 on while the model is in eval mode.
    `module_filter(module, qualified_name) -> bool` chooses the layers to convert (None: the default above).
    """

    def __init__(self, backend: str = "ao", config: Any = None, module_filter: Optional[Callable] = None,
                 te_recipe: Optional[Dict[str, Any]] = None, use_autocast_during_eval: bool = False,
                 use_mxfp8_block_scaling: bool = False) -> None:
        backend = str(backend).lower()
        if backend not in FP8_BACKENDS:
            raise ValueError(f"FP8Recipe(backend={backend!r}): allowed values are 'ao' (torchao) and 'te' "
                             f"(TransformerEngine).")
        if module_filter is not None and not callable(module_filter):
            raise TypeError(f"module_filter={module_filter!r} must be a function (module, name) -> bool, or None.")
        self.backend = backend
        self.config = config
        self.module_filter = module_filter
        self.te_recipe = dict(te_recipe or {})
        self.use_autocast_during_eval = bool(use_autocast_during_eval)
        self.use_mxfp8_block_scaling = bool(use_mxfp8_block_scaling)

    @property
    def emulated(self) -> bool:
        """torchao's emulation (`Float8LinearConfig(emulate=True)`): fp8 rounding computed with ordinary kernels,
        on any device, slowly; for tests."""
        return self.backend == "ao" and bool(getattr(self.config, "emulate", False))

    @property
    def library(self) -> str:
        return {"ao": "torchao", "te": "TransformerEngine"}[self.backend]

    def __repr__(self) -> str:
        return f"FP8Recipe(backend={self.backend!r}{', emulated' if self.emulated else ''})"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(distribution: str) -> Optional[Tuple[int, ...]]:
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts: List[int] = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def default_ao_config(pad_inner_dim: bool = True, enable_fsdp_float8_all_gather: bool = True) -> Any:
    """torchao's `Float8LinearConfig` as Accelerate makes it when none is given: inner dimensions padded to a
    multiple of 16 (so `torch._scaled_mm` takes any size), and FSDP2 all-gathering the weights in fp8."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(pad_inner_dim=pad_inner_dim, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)


def default_fp8_recipe() -> FP8Recipe:
    """The recipe `mixed_precision="fp8"` uses when none is given: torchao where it is installed, else
    TransformerEngine, else torchao (whose absence the check then names)."""
    if not _installed("torchao") and _installed("transformer_engine"):
        return FP8Recipe("te")
    return FP8Recipe("ao")


def hardware_problem(device_type: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why fp8 matrix products cannot run on this run's device (None: they can)."""
    need = f"fp8 needs an NVIDIA GPU with compute capability 8.9 or newer ({_GPU_EXAMPLES})"
    if device_type != "cuda":
        if torch.cuda.is_available():
            return (f"{need}; this run trains on {device_type!r} although a CUDA GPU is here: drop cpu=True / "
                    f"accelerator={device_type!r} (or --cpu), or use bf16 mixed precision.")
        return (f"{need}, this machine has none (torch {torch.__version__} sees no CUDA device; the run would train on "
                f"{device_type!r}). {_USE_BF16} here.")
    if not torch.cuda.is_available():
        return f"{need}, this machine has none (torch {torch.__version__} sees no CUDA device). {_USE_BF16} here."
    if torch.version.hip is not None:
        return f"{need}; this is an AMD GPU (ROCm {torch.version.hip}), whose fp8 formats differ. {_USE_BF16}."
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return (f"{need}, this machine has {name} (compute capability {capability[0]}.{capability[1]}). "
                f"{_USE_BF16} on it.")
    return None


def machine_problem() -> Optional[str]:
    """Why no GPU of this machine can train in fp8 (None: one can); checked before anything starts."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return hardware_problem("cuda")
    problems = [hardware_problem("cuda", torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    return None if any(p is None for p in problems) else problems[0]


def package_problem(backend: str) -> Optional[str]:
    """Why the library of `backend` cannot be used (None: it can)."""
    if backend == "ao":
        if not _installed("torchao"):
            return f"mixed_precision='fp8' with torchao needs the torchao package, which is not installed: {INSTALL['ao']}."
        found = _version("torchao")
        if found is not None and found < TORCHAO_MIN_VERSION:
            return (f"mixed_precision='fp8' needs torchao >= {'.'.join(map(str, TORCHAO_MIN_VERSION))}; "
                    f"{'.'.join(map(str, found))} is installed: {INSTALL['ao']}.")
        return None
    if not _installed("transformer_engine"):
        return (f"mixed_precision='fp8' with TransformerEngine (TERecipeKwargs) needs the transformer_engine package, "
                f"which is not installed: {INSTALL['te']}. Or use torchao: {INSTALL['ao']}.")
    return None


def fp8_problem(device_type: str, recipe: FP8Recipe, device: Optional[torch.device] = None) -> Optional[str]:
    """The first reason this run cannot train in fp8 with `recipe` (package, then hardware), or None."""
    problem = package_problem(recipe.backend)
    if problem is None and not recipe.emulated:
        problem = hardware_problem(device_type, device)
    return problem


def check_fp8(device_type: str, recipe: FP8Recipe, device: Optional[torch.device] = None) -> None:
    """Raise ImportError (a library is missing) or ValueError (the hardware cannot) where fp8 cannot run."""
    package = package_problem(recipe.backend)
    if package is not None:
        raise ImportError(package)
    if not recipe.emulated:
        hardware = hardware_problem(device_type, device)
        if hardware is not None:
            raise ValueError(hardware)


# -- which layers ------------------------------------------------------------------------------------------
def find_first_last_linear_layers(model: nn.Module) -> Tuple[Optional[str], Optional[str]]:
    """The qualified names of the first and the last `nn.Linear` in `model.named_modules()` order."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: nn.Module, fqn: str, layers_to_filter: Any = ()) -> bool:
    """The default choice: an `nn.Linear` whose in and out features are multiples of 16, not named in
    `layers_to_filter` (the first and last linear layers)."""
    if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def _layer_filter(model: nn.Module, recipe: FP8Recipe, converted: type) -> Callable[[nn.Module, str], bool]:
    first, last = find_first_last_linear_layers(model)
    chosen = recipe.module_filter or (lambda module, fqn: filter_linear_layers(module, fqn, (first, last)))

    def choose(module: nn.Module, fqn: str) -> bool:
        return not isinstance(module, converted) and bool(chosen(module, fqn))

    return choose


def fp8_layer_names(model: nn.Module) -> List[str]:
    """The qualified names of the layers of `model` that compute in fp8 (torchao's or TransformerEngine's)."""
    kinds: List[type] = []
    if _installed("torchao"):
        from torchao.float8.float8_linear import Float8Linear

        kinds.append(Float8Linear)
    if _installed("transformer_engine"):
        import transformer_engine.pytorch as te

        kinds.append(te.Linear)
    if not kinds:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, tuple(kinds))]


# -- conversion --------------------------------------------------------------------------------------------
def convert_model_to_fp8(model: nn.Module, recipe: FP8Recipe) -> nn.Module:
    """Convert `model`'s chosen linear layers in place for fp8 training with `recipe`; returns the model.

    Converting twice changes nothing (converted layers are left as they are). A model with no layer to convert
    trains in bf16, with a warning that says so.
    """
    if recipe.backend == "ao":
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        config = recipe.config if recipe.config is not None else default_ao_config()
        if config.enable_fsdp_float8_all_gather:
            # (its weight wrapper is a new Parameter of a tensor subclass: optimizers built before prepare would lose
            # their parameters, and safetensors cannot save it; FSDP2 all-gathers in its param_dtype instead)
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        model = convert_to_float8_training(model, module_filter_fn=_layer_filter(model, recipe, Float8Linear),
                                           config=config)
        count = sum(isinstance(m, Float8Linear) for m in model.modules())
    else:
        count = _convert_te(model, recipe)
        if not _has_te_forward(model):
            _install_te_forward(model, recipe)
    if count == 0:
        linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        warnings.warn(
            f"mixed_precision='fp8': no layer of {type(model).__name__} was converted to fp8 ({linears} nn.Linear "
            f"layer(s); the default keeps the first and the last and those whose sizes are not multiples of 16), so "
            f"it trains in bf16. Pass a module_filter_func to AORecipeKwargs to choose the layers.", stacklevel=3)
    return model


def _convert_te(model: nn.Module, recipe: FP8Recipe) -> int:
    import transformer_engine.pytorch as te

    choose = _layer_filter(model, recipe, te.Linear)
    chosen = [(name, module) for name, module in model.named_modules()
              if type(module) is nn.Linear and choose(module, name)]
    for name, linear in chosen:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        weight = linear.weight
        replacement = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                params_dtype=weight.dtype, device=weight.device)
        # The new layer takes over the user's Parameter objects (not copies of them): an optimizer built before
        # prepare(), as scripts do, holds those, and must go on training these layers.
        replacement.weight = weight
        if linear.bias is not None:
            replacement.bias = linear.bias
        replacement.train(linear.training)
        setattr(parent, name.rpartition(".")[2], replacement)
    return sum(isinstance(m, te.Linear) for m in model.modules())


class _TEForward:
    """The forward of a model converted for TransformerEngine: the user's forward inside its fp8 autocast (on in
    training; in eval mode only with `use_autocast_during_eval`)."""

    def __init__(self, func: Callable, te_recipe: Any, during_eval: bool) -> None:
        self.func = func
        self.te_recipe = te_recipe
        self.during_eval = during_eval

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        from transformer_engine.pytorch import fp8_autocast

        with fp8_autocast(enabled=module.training or self.during_eval, fp8_recipe=self.te_recipe):
            return self.func(module, *args, **kwargs)


def _has_te_forward(model: nn.Module) -> bool:
    return isinstance(getattr(model.__dict__.get("forward"), "__func__", None), _TEForward)


def _install_te_forward(model: nn.Module, recipe: FP8Recipe) -> None:
    import transformer_engine.common.recipe as te_recipe

    kwargs = dict(recipe.te_recipe)
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, str(kwargs["fp8_format"]).upper())
    if recipe.use_mxfp8_block_scaling:
        for key in ("amax_history_len", "amax_compute_algo"):
            kwargs.pop(key, None)
        built = te_recipe.MXFP8BlockScaling(**kwargs)
    else:
        built = te_recipe.DelayedScaling(**kwargs)
    current = model.forward
    func = getattr(current, "__func__", None)
    if func is None or getattr(current, "__self__", None) is not model:
        func = lambda _module, *a, **k: current(*a, **k)  # noqa: E731 (a plain callable set by the user)
    model.forward = types.MethodType(_TEForward(func, built, recipe.use_autocast_during_eval), model)
