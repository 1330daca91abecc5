"""`fabric-lite estimate-memory`: how much memory a model needs, without allocating its weights.

The model is built with `fabric_lite.utils.init_empty_weights` (parameters on the meta device) in float32, and
its parameters and buffers are counted: the total, and the largest "layer" as Accelerate defines it (walking down
from the model's direct children, parameters and buffers: a module without children, or one whose class is in
the model's ``_no_split_modules``, is a layer; see `fabric_lite.utils.calculate_maximum_sizes`). Per dtype the
sizes are the float32 ones divided by 1, 2, 4 or 8 (float32, float16, int8, int4), and the training memory with
Adam is the largest of what training holds at once: in float32 the weights, gradients, two moments and the step's
work (4 x the model); in float16 mixed precision the float32 master weights, the gradients (1.5 x) and the two
moments (2 x); int8 and int4 are not trained (N/A).

MODEL_NAME is, as in Accelerate, a Hugging Face model (a Hub id, read from a local directory or the Hub cache; only
its config.json is needed), built with `transformers` or `timm`, or, fabric_lite's addition, a Python path
``package.module:factory`` whose call returns an ``nn.Module``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["DTYPES", "estimate_command", "build_empty_model", "memory_rows", "format_bytes", "ascii_table",
           "hub_cache_config"]

DTYPES = ("float32", "float16", "int8", "int4")
_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
HEADERS = ("dtype", "Largest Layer", "Total Size", "Training using Adam")
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def format_bytes(size: float) -> str:
    """`size` bytes in the largest unit (of 1024) that keeps it at or above 1, two decimals at most:
    ``format_bytes(1536) == '1.5 KB'``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024:
            return f"{round(size, 2)} {unit}"
        size /= 1024
    return f"{round(size, 2)} PB"


def training_bytes(total_fp32: int, dtype: str) -> Optional[int]:
    """Peak bytes of training with Adam at batch size 1 for a model of `total_fp32` bytes in float32, or None
    (int8 / int4 are not trained)."""
    if dtype == "float32":
        parts = {"model": total_fp32, "gradients": total_fp32, "optimizer": 2 * total_fp32, "step": 4 * total_fp32}
    elif dtype == "float16":
        parts = {"model": total_fp32, "gradients": total_fp32 + total_fp32 // 2, "optimizer": 2 * total_fp32,
                 "step": 2 * total_fp32}
    else:
        return None
    return max(parts.values())


def memory_rows(model: Any, dtypes: Sequence[str] = DTYPES) -> List[Tuple[str, float, float, Optional[int]]]:
    """(dtype, largest layer bytes, total bytes, training bytes or None) per dtype, from `model` counted in
    float32 (floating parameters and buffers as 4 bytes each, the others as their own dtype)."""
    import torch

    from fabric_lite.utils import calculate_maximum_sizes

    if any(t.is_floating_point() and t.dtype != torch.float32 for t in [*model.parameters(), *model.buffers()]):
        model = model.float()
    total, (largest, _names) = calculate_maximum_sizes(model)
    rows = []
    for dtype in dtypes:
        if dtype not in _DIVISOR:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
        rows.append((dtype, largest / _DIVISOR[dtype], total / _DIVISOR[dtype], training_bytes(total, dtype)))
    return rows


def ascii_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str) -> str:
    """A box-drawn table: `title` across the top, then the headers and rows, each cell centred."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    inner = sum(widths) + len(widths) - 1
    if len(title) > inner:  # the last column takes what the title needs
        widths[-1] += len(title) - inner
        inner = len(title)

    def rule(left: str, joint: str, right: str) -> str:
        return left + joint.join("─" * w for w in widths) + right

    def line(cells: Sequence[str]) -> str:
        return "│" + "│".join(str(c).center(w) for c, w in zip(cells, widths)) + "│"

    out = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", rule("├", "┬", "┤"), line(headers),
           rule("├", "┼", "┤"), *(line(r) for r in rows), rule("└", "┴", "┘")]
    return "\n".join(out)


# -- finding the model ------------------------------------------------------------------------------

def _offline(env: Mapping[str, str]) -> bool:
    return any(str(env.get(k, "")).strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """The Hugging Face Hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def hub_cache_config(model_name: str, env: Mapping[str, str]) -> Optional[Path]:
    """The snapshot directory of `model_name` in the Hub cache that holds a config.json (the one `refs/main`
    points to, else the newest), or None."""
    repo = hub_cache_dir(env) / ("models--" + model_name.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text(encoding="utf-8").strip()
        if (pinned / "config.json").is_file():
            return pinned
    found = sorted((p.parent for p in snapshots.glob("*/config.json")), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _library_of(config: Mapping[str, Any]) -> Optional[str]:
    if "model_type" in config or "architectures" in config:
        return "transformers"
    if "architecture" in config:  # timm's config.json
        return "timm"
    return None


def _factory_model(path: str) -> Any:
    """Call `package.module:factory` under init_empty_weights; the result must be an nn.Module."""
    from torch import nn

    from fabric_lite.utils import init_empty_weights

    module_name, _, attribute = path.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` finds modules in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"{path}: cannot import module {module_name!r} ({err}); pass package.module:factory "
                         f"for a module Python can import from here, or a Hugging Face model name.") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{path}: {module_name} has no {attribute!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path}: {attribute!r} is a {type(obj).__name__}, not a function or class to call.")
    with init_empty_weights():
        model = obj()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{path}: {attribute}() returned a {type(model).__name__}, not a torch.nn.Module.")
    return model


def _needs(package: str, model_name: str) -> ImportError:
    return ImportError(f"estimating `{model_name}` needs {package}: pip install {package}")


def _transformers_model(source: str, model_name: str, trust_remote_code: bool, config: Mapping[str, Any]) -> Any:
    try:
        import transformers
    except ImportError:
        raise _needs("transformers", model_name) from None
    import torch

    from fabric_lite.utils import init_empty_weights

    print(f"Loading pretrained config for `{model_name}` from `transformers`...")
    auto_config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    found = config.get("auto_map")
    auto_map: Dict[str, Any] = found if isinstance(found, dict) else {}
    name = next((key for key in auto_map if key.startswith("AutoModelFor")), None)  # remote code's own class
    constructor = getattr(transformers, name) if name and hasattr(transformers, name) else transformers.AutoModel
    with init_empty_weights():
        try:
            return constructor.from_config(auto_config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        except TypeError:  # transformers before `dtype` spelled it torch_dtype
            return constructor.from_config(auto_config, torch_dtype=torch.float32,
                                           trust_remote_code=trust_remote_code)


def _timm_model(model_name: str, config: Mapping[str, Any]) -> Any:
    try:
        import timm
    except ImportError:
        raise _needs("timm", model_name) from None
    from fabric_lite.utils import init_empty_weights

    print(f"Loading pretrained config for `{model_name}` from `timm`...")
    architecture = config.get("architecture") or model_name.split("/", 1)[-1]
    kwargs = {k: config[k] for k in ("num_classes", "in_chans") if isinstance(config.get(k), int)}
    with init_empty_weights():
        return timm.create_model(architecture, pretrained=False, **kwargs)


def build_empty_model(model_name: str, library_name: Optional[str] = None, trust_remote_code: bool = False,
                      env: Optional[Mapping[str, str]] = None) -> Any:
    """The model `model_name` names, its parameters on the meta device. See the module docstring for the forms of
    `model_name`; `library_name` ("transformers" or "timm") where the config does not tell."""
    env = os.environ if env is None else env
    local = Path(model_name).expanduser()
    if not local.exists() and _FACTORY.fullmatch(model_name):
        return _factory_model(model_name)
    source: Optional[Path] = local if local.is_dir() else hub_cache_config(model_name, env)
    if local.exists() and not local.is_dir():
        raise ValueError(f"{model_name} is a file; pass the model's directory (the one holding config.json).")
    config: Dict[str, Any] = {}
    if source is not None and (source / "config.json").is_file():
        try:
            config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{source / 'config.json'} is not valid JSON: {err}.") from None
    elif local.is_dir():
        raise ValueError(f"{local} holds no config.json; pass a model directory saved by transformers or timm.")
    library = library_name or _library_of(config) or ("timm" if model_name.startswith("timm/") else None)
    if library == "timm":  # timm builds its architectures without any file
        return _timm_model(model_name, config)
    if source is None and _offline(env):
        raise ValueError(f"`{model_name}` is not a local directory and its config.json is not in the Hugging Face "
                         f"cache ({hub_cache_dir(env)}), and the Hub is offline (HF_HUB_OFFLINE / "
                         f"TRANSFORMERS_OFFLINE is set): download the model's config.json once while online, or "
                         f"pass a local directory or package.module:factory.")
    if library not in (None, "transformers"):
        raise ValueError(f"--library_name {library!r} is not supported; choose transformers or timm.")
    try:
        return _transformers_model(str(source) if source is not None else model_name, model_name,
                                   trust_remote_code, config)
    except OSError as err:  # transformers could not find or fetch the config
        from fabric_lite.cli.main import one_line

        raise ValueError(f"could not load the config of `{model_name}` with transformers: {one_line(str(err))}"
                         ) from None


def estimate_command(args: List[str]) -> int:
    from fabric_lite.cli.parsing import CliParser

    parser = CliParser(
        prog="fabric-lite estimate-memory",
        description="Print how much memory a model takes per dtype (its largest layer, its total size, and training "
                    "it with Adam), from its config alone: no weights are downloaded or allocated. MODEL_NAME: a "
                    "Hugging Face model (a local directory, or a Hub id whose config.json is in the Hub cache or can "
                    "be fetched), or package.module:factory, a callable returning an nn.Module (fabric_lite's "
                    "addition).")
    parser.add_argument("model_name", metavar="MODEL_NAME")
    parser.add_argument("--library-name", "--library_name", choices=("transformers", "timm"), default=None,
                        help="the library that builds the model, where its config.json does not tell")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                        help="the dtypes to show (default: all four)")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let transformers run the model's own code from its repository (only for "
                             "repositories you trust)")
    parsed = parser.parse_args(args)
    try:
        model = build_empty_model(parsed.model_name, parsed.library_name, parsed.trust_remote_code)
    except ImportError as err:  # transformers / timm missing: the message says what to install
        print(f"fabric-lite estimate-memory: error: {err}", file=sys.stderr)
        return 2
    rows = [[dtype, format_bytes(largest), format_bytes(total), "N/A" if train is None else format_bytes(train)]
            for dtype, largest, total, train in memory_rows(model, parsed.dtypes)]
    print(ascii_table(HEADERS, rows, f"Memory Usage for loading `{parsed.model_name}`"))
    return 0
