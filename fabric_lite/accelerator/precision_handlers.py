"""Accelerate's precision kwargs handlers: `AutocastKwargs` and the fp8 recipes.

```python
accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])       # torchao
accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(fp8_format="HYBRID")])
accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(cache_enabled=True)])
with accelerator.autocast(AutocastKwargs(enabled=False)):   # this block in fp32
    ...
```

Field names and defaults are Accelerate's. Differences: a handler is built without its library installed (the
library is asked for when the Accelerator starts, and its absence named there with the `pip install`); fields
left None take their default here, not from `ACCELERATE_FP8_*` environment variables; MS-AMP is refused (use
torchao); torchao's fp8 all-gather for FSDP2 is not used. The conversion lives in `fabric_lite.strategies.fp8`.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Dict, Optional, Sequence, Tuple

from fabric_lite.accelerator.configs import KwargsHandler
from fabric_lite.strategies.fp8 import INSTALL, FP8Recipe, default_ao_config, package_problem

__all__ = ["AutocastKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs",
           "FP8_RECIPE_HANDLERS", "fp8_recipe_from_handlers", "autocast_kwargs", "autocast_context"]

FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_COMPUTE_ALGORITHMS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2")
FP8_RECIPE_BACKENDS = ("MSAMP", "TE")


@dataclass
class AutocastKwargs(KwargsHandler):
    """Keywords for every `torch.autocast` the run opens (the prepared model's forward, `accelerator.autocast()`).

    Given in `kwargs_handlers` it applies to the whole run; given to `accelerator.autocast(handler)` it replaces
    that one for the block: ``AutocastKwargs(enabled=False)`` runs the block without autocast. Without mixed
    precision (`mixed_precision="no"`) there is no autocast, and it changes nothing."""

    accelerator_attribute: ClassVar[str] = "autocast_handler"

    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 training with torchao (`pip install 'fabric-lite[fp8]'`): eligible `nn.Linear` layers become torchao's
    `Float8Linear`.

    `config`: a `torchao.float8.Float8LinearConfig`; None builds one with `pad_inner_dim` and
    `enable_fsdp_float8_all_gather` (both default True, as in Accelerate; the fp8 all-gather is then turned off
    when the model is converted, see `fabric_lite.strategies.fp8`). `module_filter_func(module, name) -> bool`
    chooses the layers; None: every `nn.Linear` with sizes divisible by 16 but the model's first and last.
    """

    accelerator_attribute: ClassVar[str] = "ao_recipe_handler"

    config: Any = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(f"AORecipeKwargs(module_filter_func={self.module_filter_func!r}): pass a function "
                            f"(module, name) -> bool, or None.")
        if self.config is None:
            self.pad_inner_dim = True if self.pad_inner_dim is None else self.pad_inner_dim
            if self.enable_fsdp_float8_all_gather is None:
                self.enable_fsdp_float8_all_gather = True
            self.config = self._default_config()

    def _default_config(self) -> Any:
        """torchao's config for these fields, or None where torchao is not installed (refused when the run starts)."""
        if package_problem("ao") is not None:
            return None
        return default_ao_config(bool(self.pad_inner_dim), bool(self.enable_fsdp_float8_all_gather))

    def to_fp8_recipe(self) -> FP8Recipe:
        config = self.config if self.config is not None else self._default_config()
        return FP8Recipe("ao", config=config, module_filter=self.module_filter_func)


_TE_DEFAULTS: Dict[str, Any] = {
    "use_autocast_during_eval": False, "margin": 0, "interval": 1, "fp8_format": "HYBRID", "amax_history_len": 1024,
    "amax_compute_algo": "most_recent", "override_linear_precision": (False, False, False),
    "use_mxfp8_block_scaling": False,
}


@dataclass
class TERecipeKwargs(KwargsHandler):
    """fp8 training with NVIDIA TransformerEngine (`pip install 'transformer_engine[pytorch]'`): eligible
    `nn.Linear` layers become `transformer_engine.pytorch.Linear`, and the forward runs in its fp8 autocast with
    a `DelayedScaling` recipe of these fields (`MXFP8BlockScaling` with `use_mxfp8_block_scaling`). Fields left
    None take Accelerate's defaults: margin 0, interval 1, fp8_format "HYBRID", amax_history_len 1024,
    amax_compute_algo "most_recent", override_linear_precision (False, False, False), fp8 off in eval mode."""

    accelerator_attribute: ClassVar[str] = "te_recipe_handler"

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[Tuple[bool, bool, bool]] = None
    use_mxfp8_block_scaling: Optional[bool] = None

    def __post_init__(self) -> None:
        for name, default in _TE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.fp8_format = str(self.fp8_format).upper()
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"{type(self).__name__}(fp8_format={self.fp8_format!r}): must be one of "
                             f"{', '.join(FP8_FORMATS)}.")
        self.amax_compute_algo = str(self.amax_compute_algo).lower()
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGORITHMS:
            raise ValueError(f"{type(self).__name__}(amax_compute_algo={self.amax_compute_algo!r}): must be one of "
                             f"{', '.join(AMAX_COMPUTE_ALGORITHMS)}.")
        if self.use_mxfp8_block_scaling:
            for name in ("amax_history_len", "amax_compute_algo"):
                if getattr(self, name) != _TE_DEFAULTS[name]:
                    raise ValueError(f"{type(self).__name__}({name}=...) does not apply to MXFP8 block scaling "
                                     f"(use_mxfp8_block_scaling=True); drop one of them.")

    def to_fp8_recipe(self) -> FP8Recipe:
        # Only what differs from the defaults goes to TransformerEngine's recipe (its own defaults apply otherwise).
        recipe = {name: getattr(self, name) for name in ("margin", "interval", "fp8_format", "amax_history_len",
                                                         "amax_compute_algo", "override_linear_precision")
                  if getattr(self, name) != _TE_DEFAULTS[name]}
        if "override_linear_precision" in recipe:
            recipe["override_linear_precision"] = tuple(recipe["override_linear_precision"])
        return FP8Recipe("te", te_recipe=recipe, use_autocast_during_eval=bool(self.use_autocast_during_eval),
                         use_mxfp8_block_scaling=bool(self.use_mxfp8_block_scaling))


def _msamp_refusal(given: str) -> ValueError:
    return ValueError(f"{given}: MS-AMP is not supported here (its package is unmaintained and needs its own CUDA "
                      f"build). Train fp8 with torchao instead: kwargs_handlers=[AORecipeKwargs()], after "
                      f"{INSTALL['ao']}; or with TransformerEngine: TERecipeKwargs().")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """Accelerate's MS-AMP recipe (`opt_level` "O1" or "O2"). Accepted as a value; an Accelerator given it refuses
    to start: MS-AMP is not supported here, use `AORecipeKwargs` (torchao)."""

    accelerator_attribute: ClassVar[str] = "msamp_recipe_handler"

    opt_level: Optional[str] = None

    def __post_init__(self) -> None:
        if self.opt_level is None:
            self.opt_level = "O2"
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"{type(self).__name__}(opt_level={self.opt_level!r}): must be one of "
                             f"{', '.join(OPT_LEVELS)} (the letter O).")

    def to_fp8_recipe(self) -> FP8Recipe:
        raise _msamp_refusal(f"MSAMPRecipeKwargs(opt_level={self.opt_level!r})")


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Accelerate's older fp8 recipe (deprecated there): `backend` "TE" (TransformerEngine, with TERecipeKwargs'
    fields) or "MSAMP" (refused here). None picks MS-AMP where installed, else TransformerEngine, as Accelerate
    does. Prefer `AORecipeKwargs` or `TERecipeKwargs`."""

    accelerator_attribute: ClassVar[str] = "fp8_recipe_handler"

    backend: Optional[str] = None

    def __post_init__(self) -> None:
        warnings.warn("FP8RecipeKwargs is deprecated (as in Accelerate): use AORecipeKwargs (torchao) or "
                      "TERecipeKwargs (TransformerEngine).", FutureWarning, stacklevel=3)
        if self.backend is None:
            self.backend = "MSAMP" if importlib.util.find_spec("msamp") is not None else "TE"
        self.backend = str(self.backend).upper()
        if self.backend not in FP8_RECIPE_BACKENDS:
            raise ValueError(f"FP8RecipeKwargs(backend={self.backend!r}): must be 'MSAMP' or 'TE' (TransformerEngine); "
                             f"for torchao use AORecipeKwargs().")
        TERecipeKwargs.__post_init__(self)
        MSAMPRecipeKwargs.__post_init__(self)

    def to_kwargs(self) -> Dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return super().to_kwargs()

    def to_fp8_recipe(self) -> FP8Recipe:
        if self.backend == "MSAMP":
            raise _msamp_refusal("FP8RecipeKwargs(backend='MSAMP')")
        return TERecipeKwargs.to_fp8_recipe(self)


#: The handler classes that say how fp8 trains (one of them at most per Accelerator).
FP8_RECIPE_HANDLERS = (AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs, FP8RecipeKwargs)


def fp8_recipe_from_handlers(handlers: Sequence[Any]) -> Optional[FP8Recipe]:
    """The fp8 recipe the kwargs handlers give (None: none given), for `connect(fp8_recipe=...)`.

    Refuses two fp8 recipes (only one library can convert the model) and MS-AMP."""
    given = [h for h in handlers if isinstance(h, FP8_RECIPE_HANDLERS)]
    if len(given) > 1:
        names = ", ".join(type(h).__name__ for h in given)
        raise ValueError(f"kwargs_handlers has several fp8 recipes ({names}); pass one: AORecipeKwargs for torchao "
                         f"or TERecipeKwargs for TransformerEngine.")
    return given[0].to_fp8_recipe() if given else None


def autocast_kwargs(handler: Optional[AutocastKwargs]) -> Optional[Dict[str, Any]]:
    """The `torch.autocast` keywords an AutocastKwargs sets (those changed from its defaults); None for None."""
    return None if handler is None else handler.to_kwargs()


def autocast_context(precision: Any, handler: Optional[AutocastKwargs] = None) -> ContextManager:
    """The context of `accelerator.autocast(handler)`: the run's autocast (its precision's dtype and the
    AutocastKwargs given in kwargs_handlers), or, with `handler`, autocast with that handler's settings instead
    (``AutocastKwargs(enabled=False)``: none in the block). Without mixed precision: nothing."""
    return precision.autocast(autocast_kwargs(handler))
