"""Fully sharded data parallel training with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each process keeps 1/W of every parameter, gradient and optimizer state; a block's parameters are
gathered for its forward and backward and freed after. Blocks are chosen by class (or a callable),
sharded bottom-up, then the root. What the doors see stays the same as for DDP: accumulation skips
the gradient reduce-scatter on micro-steps (`set_requires_gradient_sync`), clipping returns a plain
number, checkpoints keep the user's parameter names (sharded through torch.distributed.checkpoint by
default, or gathered whole), and an optimizer built before `prepare` is pointed at the shards by name.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from fabric_lite.strategies.base import Mesh, Traits
from fabric_lite.strategies.checkpoint_format import DCP, STATE_DICT
from fabric_lite.strategies.fsdp_state import FSDPCheckpointFormat
from fabric_lite.strategies.mesh_shape import MeshShape
from fabric_lite.strategies.moved_params import MovedParameters
from fabric_lite.strategies.parallel import ParallelStrategy
from fabric_lite.strategies.process_group import ProcessGroup, ProcessGroupSetting
from fabric_lite.strategies.fsdp_blocks import (
    CheckpointedForward, WrapPolicy, is_dtensor, local_bytes, materialize, parameter_owners, resolve_wrap_policy,
    shares_outside,
)
from fabric_lite.strategies.precision import Precision

__all__ = ["FSDPStrategy", "WrapPolicy", "STATE_DICT_TYPES"]

#: "sharded": each process writes its own shards (torch.distributed.checkpoint), reloadable on any number
#: of processes; "full": the whole state is gathered to rank 0 and written as for DDP.
STATE_DICT_TYPES = ("sharded", "full")
_STATE_DICT_ALIASES = {"sharded": "sharded", "sharded_state_dict": "sharded", "full": "full",
                       "full_state_dict": "full"}


def _fsdp() -> Any:
    try:
        from torch.distributed import fsdp
    except ImportError as err:  # pragma: no cover - torch without distributed
        raise RuntimeError(f"strategy='fsdp' needs torch.distributed.fsdp, which this torch lacks ({err}).") from None
    if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
        raise RuntimeError(f"strategy='fsdp' needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); this is "
                           f"torch {torch.__version__}. Upgrade torch or use strategy='ddp'.")
    return fsdp


class FSDPStrategy(ParallelStrategy):
    """Shard parameters, gradients and optimizer state over the processes with FSDP2.

    Examples:
        >>> FSDPStrategy(auto_wrap_policy={"TransformerBlock"}, activation_checkpointing=True)  # doctest: +SKIP

    `auto_wrap_policy`: the blocks that each get their own `fully_shard` (classes, class names, or a
    callable); None shards the model as one group (a Hugging Face model's `_no_split_modules` are used
    when it has them). `reshard_after_forward`: free gathered parameters after each block's forward
    (less memory, one more all-gather in backward). `cpu_offload`: keep shards in CPU memory between uses
    (CUDA only). `activation_checkpointing`: True (the wrapped blocks) or classes/names to recompute in
    backward. `state_dict_type`: "sharded" (default) or "full". `mixed_precision_policy`: a
    `torch.distributed.fsdp.MixedPrecisionPolicy` that replaces the one derived from `precision`.
    `mesh_shape`: a `MeshShape` for N-D parallelism: FSDP shards over `dp_shard` (and replicates over `dp_replicate`:
    HSDP), a model whose weights are already tensor-parallel DTensors on `torch_mesh["tp"]` keeps that layout, and
    the doors shard data and gather metrics over the data-parallel ranks only.
    """

    traits = Traits(names=("fsdp",), accelerate_type="FSDP", initializes_on_meta=True, syncs_gradients_per_forward=True)
    process_group: ProcessGroup
    #: The process group's settings, as strategy attributes (the constructor's names).
    process_group_backend = ProcessGroupSetting("requested_backend")
    timeout = ProcessGroupSetting("timeout")
    backend = ProcessGroupSetting("backend", writable=False)

    def __init__(
        self,
        auto_wrap_policy: WrapPolicy = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: Union[bool, WrapPolicy] = False,
        state_dict_type: str = "sharded",
        mixed_precision_policy: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Any = None,
        mesh_shape: Optional[MeshShape] = None,
    ) -> None:
        super().__init__()
        # one process is one shard: FSDP still needs a (one-member) process group for its mesh
        self.process_group = ProcessGroup(self, process_group_backend, timeout, lone_group=True, name="fsdp")
        kind = _STATE_DICT_ALIASES.get(str(state_dict_type).lower())
        if kind is None:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not valid: allowed values are 'sharded' "
                             f"(SHARDED_STATE_DICT) and 'full' (FULL_STATE_DICT).")
        self.auto_wrap_policy = auto_wrap_policy
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = bool(cpu_offload)
        self.activation_checkpointing = activation_checkpointing
        self.state_dict_type = kind
        self.user_mp_policy = mixed_precision_policy
        # "sharded": shard by shard (torch.distributed.checkpoint, checkpoint/sharded.py); full state dicts are
        # gathered to rank 0 and scattered back (fsdp_state.py).
        self.checkpoint_format = FSDPCheckpointFormat(self, DCP if kind == "sharded" else STATE_DICT)
        #: What `setup_module` did, per prepared model (for `explain`): wrapped block paths, skipped ones.
        self.plans: List[Dict[str, Any]] = []
        # old parameter id -> (weakref to it, its sharded replacement): re-points optimizers built before prepare
        self._replaced = MovedParameters()
        self._syncing: Dict[int, bool] = {}  # id(model) -> whether its backward reduce-scatters now
        #: N-D parallelism: how the world is laid out (dp_replicate x dp_shard x tp; None: one dimension, every
        #: process a shard), and torch's DeviceMesh over it once the process group started (None without a shape).
        self.mesh_shape = mesh_shape
        self.torch_mesh: Any = None

    @property
    def sharded_checkpoints(self) -> bool:
        """Checkpoints are written shard by shard (torch.distributed.checkpoint), see checkpoint/sharded.py."""
        return self.checkpoint_format.kind == DCP

    # -- set-up ------------------------------------------------------------------------------------
    def adapt_precision(self, precision: Precision) -> Precision:
        if precision.scaler is not None:  # fp16: the inf check must see every shard (all-reduced found_inf)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            old = precision.scaler
            scaler = ShardedGradScaler(device=precision.device_type, enabled=old.is_enabled())
            if old.is_enabled():
                scaler.load_state_dict(old.state_dict())
            precision.scaler = scaler
        return precision

    def mp_policy(self) -> Any:
        """The MixedPrecisionPolicy this run trains with: fp32 master weights, compute in the autocast
        dtype, gradients reduced in fp32 (or the user's own policy)."""
        if self.user_mp_policy is not None:
            return self.user_mp_policy
        fsdp = _fsdp()
        compute = self.precision.autocast_dtype
        if compute is None:
            return fsdp.MixedPrecisionPolicy()
        return fsdp.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

    def setup_environment(self) -> None:
        if self.cpu_offload and self.root_device.type != "cuda":
            raise ValueError(
                f"cpu_offload=True keeps the shards in CPU memory and moves them to the GPU for each block; this run "
                f"trains on {self.root_device.type!r}, where everything already is in CPU memory (torch "
                f"{torch.__version__}, CUDA available: {torch.cuda.is_available()}). Drop cpu_offload, or train on CUDA."
            )
        _fsdp()
        if self.mesh_shape is not None:
            self.mesh_shape.check_world(self.world_size)
        self.process_group.start()
        if self.mesh_shape is not None:
            self.torch_mesh = self.build_torch_mesh(self.mesh_shape)

    def build_torch_mesh(self, shape: MeshShape) -> Any:
        """torch's DeviceMesh over `shape` (Accelerate's dimension names; a subclass may name them its own way)."""
        return shape.build(self.root_device.type)

    def fsdp_mesh_dimensions(self, shape: MeshShape) -> Tuple[str, ...]:
        """The dimensions of `torch_mesh` that FSDP shards (and replicates) over."""
        return shape.fsdp_dimensions

    @property
    def device_mesh(self) -> Mesh:
        if self.mesh_shape is None:
            return super().device_mesh
        return self.mesh_shape.mesh(self.global_rank, self.torch_mesh)

    def teardown(self) -> None:
        self.process_group.destroy()

    def _mesh(self) -> Any:
        """The mesh `fully_shard` works over: every process, or the data-parallel dimensions of `torch_mesh`."""
        if self.torch_mesh is not None and self.mesh_shape is not None:
            return self.torch_mesh[self.fsdp_mesh_dimensions(self.mesh_shape)]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, (self.world_size,))

    def setup_module(self, module: nn.Module) -> nn.Module:
        fsdp = _fsdp()
        sharded_already = isinstance(module, fsdp.FSDPModule) or (
            self.torch_mesh is None and any(isinstance(m, fsdp.FSDPModule) for m in module.modules()))
        if sharded_already:
            raise ValueError(f"{type(module).__name__} is already sharded; prepare each model once.")
        if self.torch_mesh is None and any(is_dtensor(p) for p in module.parameters()):
            raise ValueError(f"{type(module).__name__}'s weights are already distributed tensors (tensor parallel?), "
                             f"but this strategy has no tensor-parallel dimension. Pass "
                             f"parallelism_config=ParallelismConfig(tp_size=..., dp_shard_size=...), or prepare the "
                             f"model before distributing it.")
        model_name = type(module).__name__
        if self.torch_mesh is not None:
            self._check_distributed_on_this_mesh(module, model_name)
        module = self.precision.convert_module(module)
        tensors = [*module.parameters(), *module.buffers()]
        on_meta = any(t.is_meta for t in tensors)
        dp = self.collectives.over("dp")
        sharded_over = self.fsdp_mesh_dimensions(self.mesh_shape) if self.mesh_shape is not None else ()
        with torch.no_grad():
            for t in tensors:  # (a model built partly on the meta device keeps its real tensors, moved here)
                if not t.is_meta and t.device != self.root_device:
                    t.data = t.data.to(self.root_device)
                if t.is_meta or self.world_size == 1:
                    continue
                # every process starts from rank 0's values, as under DDP (each keeps its slice of them); a
                # tensor-parallel slice, from data-parallel rank 0 of its own tensor-parallel rank
                if is_dtensor(t):
                    if set(t.device_mesh.mesh_dim_names or ()) & set(sharded_over):
                        continue  # (sharded over the data-parallel ranks already, in the script's configure_model)
                    local = cast(Any, t.data).to_local()
                    local.copy_(dp.broadcast(local.contiguous()))
                else:
                    t.data = self.collectives.broadcast(t.data.contiguous())
        old = {n: p for n, p in module.named_parameters()}
        wrap = resolve_wrap_policy(self.auto_wrap_policy, module)
        checkpointed = self._checkpoint_policy(module, wrap)
        owners = parameter_owners(module)
        kwargs: Dict[str, Any] = {"mesh": self._mesh(), "reshard_after_forward": self.reshard_after_forward,
                                  "mp_policy": self.mp_policy()}
        if self.cpu_offload:
            kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
        blocks = [(path, sub) for path, sub in module.named_modules() if path and wrap(sub)]
        # a weight a block shares with a module outside it (tied embeddings) must stay in one group: the root's
        kept_whole = [path for path, sub in blocks if shares_outside(path, sub, owners)]
        blocks = [(path, sub) for path, sub in blocks if path not in kept_whole]
        recomputed = []
        for path, sub in module.named_modules():
            if path and checkpointed(sub) and not isinstance(sub.__dict__.get("forward"), CheckpointedForward):
                sub.forward = CheckpointedForward(sub.forward)
                recomputed.append(path)
        # bottom-up: a block inside another block is sharded first, so each parameter lands in its innermost group
        for _, sub in reversed(blocks):
            fsdp.fully_shard(sub, **kwargs)
        wrapped = [path for path, _ in blocks]
        fsdp.fully_shard(module, **kwargs)
        if on_meta:
            materialize(module, self.root_device)
        new = dict(module.named_parameters())
        self._replaced.record(old, new)
        self.plans.append({"model": model_name, "wrapped": wrapped,
                           "kept_whole": kept_whole, "recomputed": recomputed, "meta_init": on_meta})
        return module

    def _check_distributed_on_this_mesh(self, module: nn.Module, model_name: str) -> None:
        """Refuse, in one sentence, weights distributed on a device mesh of their own: FSDP composes with tensor
        parallelism only over dimensions of one mesh (torch's error would name neither the weight nor the fix)."""
        for name, p in module.named_parameters():
            if not is_dtensor(p):
                continue
            mesh = p.device_mesh
            # equal, not identical: torch's DTensor keeps the first of equal meshes it met, so the weights of a model
            # distributed on a later run's mesh in the same process (the same layout) name an earlier run's object
            if mesh._get_root_mesh() != self.torch_mesh:  # (torch names no public way to ask)
                dims = ", ".join(self.torch_mesh.mesh_dim_names or ())
                raise ValueError(
                    f"{model_name}'s weight {name!r} is distributed on a device mesh of its own ({mesh}); FSDP can "
                    f"shard it only on this run's mesh (dimensions {dims}). Distribute it on a dimension of that "
                    f"mesh: accelerator.torch_device_mesh['tp'] (a TrainModule: self.device_mesh['tensor_parallel']).")
            sharded_over = set(self.fsdp_mesh_dimensions(self.mesh_shape)) if self.mesh_shape is not None else set()
            for axis, placement in enumerate(p.placements):
                dimension = (mesh.mesh_dim_names or ())[axis] if mesh.mesh_dim_names else str(axis)
                if not placement.is_shard() or dimension in sharded_over:
                    continue  # (FSDP's own dimensions pad uneven shards; a tensor-parallel split must be even)
                dim, ranks = cast(Any, placement).dim, mesh.size(axis)
                if p.shape[dim] % ranks:
                    fits = [k for k in range(ranks - 1, 0, -1) if p.shape[dim] % k == 0 and self.world_size % k == 0]
                    raise ValueError(
                        f"{model_name}'s weight {name!r} (shape {tuple(p.shape)}) is split along its dimension {dim} "
                        f"over {ranks} ranks of mesh dimension {dimension!r}, but {p.shape[dim]} does not divide by "
                        f"{ranks}: the ranks would hold slices of different sizes (and activations of different "
                        f"widths). Use a {dimension} size that divides {p.shape[dim]} (the largest below {ranks}: "
                        f"{fits[0] if fits else 1}), or leave this weight out of the tensor-parallel plan.")

    def _checkpoint_policy(self, module: nn.Module, wrap: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
        ac = self.activation_checkpointing
        if ac is False or ac is None:
            return lambda sub: False
        if ac is True:
            if self.auto_wrap_policy is None and not getattr(module, "_no_split_modules", None):
                raise ValueError("activation_checkpointing=True recomputes the wrapped blocks, but auto_wrap_policy "
                                 "names none. Name the blocks: activation_checkpointing={'Block'} or auto_wrap_policy.")
            return wrap
        return resolve_wrap_policy(ac, module)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the unsharded model at the sharded parameters (by name)."""
        self._replaced.repoint(optimizer, "the unsharded model", is_dtensor, "fsdp")
        for group in optimizer.param_groups:
            # Left to torch's default, an optimizer steps CPU tensors one at a time, and on sharded tensors each
            # op of each parameter goes through Python dispatch: the multi-tensor path does the same arithmetic
            # with half the Python calls of a whole training step (benchmarks/README.md, FSDP).
            if ("foreach" in group and group["foreach"] is None and not group.get("fused")
                    and any(is_dtensor(p) and p.device.type == "cpu" for p in group["params"])):
                group["foreach"] = True
        return optimizer

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard works in place: the user's module, its names unchanged

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if not enabled or not hasattr(module, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return self._gradient_sync(module, False)

    @contextlib.contextmanager
    def _gradient_sync(self, module: Any, sync: bool) -> Any:  # an FSDP2 module: set_requires_gradient_sync
        previous = self._syncing.get(id(module), True)  # (nested contexts restore what they found)
        self._syncing[id(module)] = sync
        module.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            self._syncing[id(module)] = previous
            module.set_requires_gradient_sync(previous)

    def force_backward_sync(self, module: nn.Module) -> ContextManager:
        if not hasattr(module, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return self._gradient_sync(module, True)

    # -- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        # a peer that left shows here first, in the gradient reduction
        self.process_group.run_guarded("the gradient all-reduce in backward()",
                                       lambda: ParallelStrategy.backward(self, loss, module, **kwargs))

    def clip_gradients(self, parameters: Iterable[torch.Tensor], optimizer: Optional[torch.optim.Optimizer], *,
                       max_norm: Optional[float] = None, norm_type: float = 2.0,
                       clip_value: Optional[float] = None) -> Optional[torch.Tensor]:
        params = list(parameters)
        meshes = {g.device_mesh if is_dtensor(g) else None for g in (p.grad for p in params) if g is not None}
        if clip_value is None and max_norm is not None and len(meshes) > 1:
            return self._clip_over_meshes(params, optimizer, max_norm, norm_type)
        norm = super().clip_gradients(params, optimizer, max_norm=max_norm, norm_type=norm_type, clip_value=clip_value)
        return norm.full_tensor() if is_dtensor(norm) else norm  # the norm over every shard, a plain tensor

    def _clip_over_meshes(self, params: List[torch.Tensor], optimizer: Optional[torch.optim.Optimizer],
                          max_norm: float, norm_type: float) -> torch.Tensor:
        """One norm over gradients that live on several meshes (a tensor-parallel model's sharded and replicated
        weights after FSDP: 2-D and 1-D DTensors), where torch's clip_grad_norm_ cannot stack their norms."""
        if optimizer is not None:
            self.precision.unscale_gradients(optimizer)
        by_mesh: Dict[Any, List[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p.grad)
        norms = []
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type)
            norms.append((norm.full_tensor() if is_dtensor(norm) else norm).to(self.root_device))
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        with torch.no_grad():
            for grads in by_mesh.values():
                for g in grads:
                    g.mul_(coefficient)
        return total

    # -- what `explain` shows ----------------------------------------------------------------------
    def explain_lines(self, modules: Sequence[nn.Module], optimizers: Sequence[Any], world: int) -> List[Tuple[str, str, str]]:
        """The sharding plan, the dtype of each kind of state, and the bytes each of `world` processes holds."""
        lines: List[Tuple[str, str, str]] = []
        for plan in self.plans:
            wrapped = plan["wrapped"]
            shown = ", ".join(wrapped[:8]) + (f" and {len(wrapped) - 8} more" if len(wrapped) > 8 else "")
            groups = f"{len(wrapped)} block(s) with their own fully_shard ({shown}) + the root" if wrapped else \
                "the whole model as one group (auto_wrap_policy names no blocks: all of it is gathered for each forward)"
            lines.append(("hardware", f"sharding ({plan['model']})" if len(self.plans) > 1 else "sharding", groups))
            if plan["kept_whole"]:
                lines.append(("hardware", "kept in the root's group",
                              f"{', '.join(plan['kept_whole'][:8])}: they share (tie) a weight with a module outside"))
            if plan["recomputed"]:
                lines.append(("hardware", "activation checkpointing", ", ".join(plan["recomputed"][:8])))
            if plan["meta_init"]:
                lines.append(("hardware", "initialization", "built on the meta device; each process materialized its "
                                                             "shards and ran reset_parameters()"))
        policy = self.mp_policy()
        master = next((p.dtype for m in modules for p in m.parameters()), torch.float32)
        name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
        lines.append(("precision", "FSDP dtypes",
                      f"parameters {name(master)} (sharded master copy), compute {name(policy.param_dtype or master)}, "
                      f"gradient reduce-scatter {name(policy.reduce_dtype or policy.param_dtype or master)}, "
                      f"optimizer state {name(master)}"))
        whole = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        shards = max(1, world)
        optim = sum(local_bytes(v) for o in optimizers for s in o.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)) * self.world_size
        if optim:
            optim_words = f"{_size(optim / shards)} optimizer state"
        else:
            factor = {"Adam": 2, "AdamW": 2, "SGD": 1, "RMSprop": 1, "Adagrad": 1}
            kinds = {type(getattr(o, "optimizer", o)).__name__ for o in optimizers}
            guess = sum(factor.get(k, 0) for k in kinds)
            optim_words = (f"~{_size(guess * whole / shards)} optimizer state once it exists ({', '.join(sorted(kinds))})"
                           if guess else "optimizer state: none yet")
        lines.append(("hardware", "bytes per process",
                      f"{_size(whole / shards)} parameters + {optim_words} (1/{shards} of "
                      f"{_size(whole)} of parameters; DDP would hold all of it in each process)"))
        lines.append(("hardware", "FSDP settings",
                      f"reshard_after_forward={self.reshard_after_forward}, cpu_offload={self.cpu_offload}, "
                      f"checkpoints {self.state_dict_type} ({'each process writes its shards' if self.sharded_checkpoints else 'gathered to rank 0'})"))
        return lines


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"

