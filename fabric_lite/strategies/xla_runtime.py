"""XLA's runtime (torch_xla's PJRT), as the Runtime the XLA strategies hold: it owns the world (it starts, numbers and
places the replicas), feeds batches and marks steps.

torch_xla records operations lazily and runs them as one compiled graph at each step marker (`torch_xla.sync()`):
after each optimizer step, and at each batch the prepared loader hands over (what torch_xla's MpDeviceLoader does:
the device runs step k while the host builds batch k+1). Replicas may be threads of one process (XLA's CPU device,
TPU v2/v3): they enter each marker together. `XLASPMDRuntime`: one process drives every XLA device.

torch_xla is optional and must match torch's version exactly: `import_torch_xla` says which to install.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from fabric_lite.strategies.environments import LaunchSettings, ProcessInfo, read_launch_environment
from fabric_lite.strategies.runtime import REPLICAS, SPMD, Runtime
from fabric_lite.strategies.xla_env import XLASettings, detect_xla_process, xla_settings

__all__ = ["XLARuntime", "XLASPMDRuntime", "import_torch_xla", "torch_xla_problem", "torch_xla_runs_here",
           "abort_replica_barriers", "NEWEST_TORCH_XLA", "INSTALL", "THREAD_BARRIER_TIMEOUT_S"]

#: The newest torch_xla release, and so the torch it needs (torch_xla X.Y runs only on torch X.Y).
NEWEST_TORCH_XLA = "2.9.0"
INSTALL = f"pip install torch=={NEWEST_TORCH_XLA} torch_xla=={NEWEST_TORCH_XLA} (in an environment of its own: `make venv-xla`)"


def _release(version: str) -> Tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def torch_xla_problem() -> Optional[str]:
    """Why torch_xla cannot run next to this torch (one sentence with the fix), or None when it can.
    Reads package metadata only: no import, so it is cheap."""
    from importlib import metadata

    try:
        xla_version = metadata.version("torch_xla")
    except metadata.PackageNotFoundError:
        return f"XLA (accelerator='tpu') needs torch_xla, which is not installed here (torch {torch.__version__}): {INSTALL}."
    if _release(xla_version) != _release(torch.__version__):
        return (f"torch_xla {xla_version} is installed next to torch {torch.__version__}, but torch_xla runs only on "
                f"the torch of its own version: pip install torch=={xla_version.split('+')[0]} torch_xla=={xla_version.split('+')[0]} "
                f"(in an environment of its own: `make venv-xla`).")
    return None


def import_torch_xla() -> Any:
    """`import torch_xla`, or an ImportError of one sentence naming torch's and torch_xla's versions and the fix."""
    problem = torch_xla_problem()
    if problem is not None:
        raise ImportError(problem)
    try:
        import torch_xla
    except (ImportError, OSError) as err:
        raise ImportError(f"torch_xla failed to import next to torch {torch.__version__} ({err}); reinstall the pair "
                          f"that matches: {INSTALL}.") from err
    return torch_xla


def torch_xla_runs_here(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla is installed for this torch; `check_is_tpu` / `check_is_gpu`: and PJRT_DEVICE names a TPU / a GPU.
    torch_xla itself is not imported (that would start its runtime)."""
    if torch_xla_problem() is not None:
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    kind = xla_settings(read_launch_environment()).pjrt_device  # (asked with no run: the launch environment)
    return (check_is_tpu and kind == "TPU") or (check_is_gpu and kind in ("GPU", "CUDA"))


def _check_devices(devices: Any, process: ProcessInfo, runtime: Any, spmd: bool, settings: XLASettings) -> None:
    if devices is None or devices == "auto":
        return
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices={devices!r} is not valid: pass a positive integer or 'auto'.")
    kind = settings.pjrt_device or "TPU"
    available = runtime.global_runtime_device_count()
    hint = "set CPU_NUM_DEVICES (or pass --nproc-per-node to `fabric-lite launch --tpu`)" if kind == "CPU" else \
        "check TPU_VISIBLE_CHIPS"
    if devices > available:
        raise ValueError(f"devices={devices} was asked for, but the XLA runtime (PJRT_DEVICE={kind}) has {available} "
                         f"device(s). Pass devices<={available}, or {hint}.")
    if spmd:
        if devices != available:
            raise ValueError(f"devices={devices}: strategy='xla_spmd' spreads each batch over all {available} XLA "
                             f"devices of this process. Leave devices out (or pass {available}), or {hint}.")
        return
    if process.world_size == 1 and devices > 1:
        raise ValueError(
            f"devices={devices} needs {devices} XLA replicas, but this is a lone one. Start them with "
            f"`fabric-lite launch --tpu --nproc-per-node {devices} train.py` or notebook_launcher(fn, num_processes="
            f"{devices}) with PJRT_DEVICE set; or use strategy='xla_spmd', which drives every device from one process.")
    if process.world_size > 1 and devices != process.world_size:
        raise ValueError(f"devices={devices} disagrees with the launch, which started {process.world_size} XLA "
                         f"replicas. Drop `devices` or make them match.")


class XLARuntime(Runtime):
    """Data-parallel replicas, one per XLA device, placed by torch_xla's runtime."""

    kind: ClassVar[str] = REPLICAS
    device_type: ClassVar[Optional[str]] = "xla"
    #: XLA has no inference tensors: evaluation runs under torch.no_grad.
    inference_tensors: ClassVar[bool] = False
    launch_flags: ClassVar[str] = " --tpu"

    def __init__(self, strategy: Any = None) -> None:
        super().__init__(strategy)
        self.torch_xla: Any = None  # set by `start`
        self.xm: Any = None  # torch_xla.core.xla_model
        #: No work was traced since the last step marker (see `device_feed`); start and resume count as marked.
        self.marked = True
        #: The replicas are threads of one process (see `sync`), and how many there are.
        self.threads = False
        self.replicas = 1
        self.step_marker = self.mark_step

    @property
    def started(self) -> bool:
        return self.torch_xla is not None

    def start(self, launched: ProcessInfo, devices: Any, settings: Any = None) -> Tuple[ProcessInfo, torch.device]:
        torch_xla = import_torch_xla()
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self.torch_xla, self.xm = torch_xla, xm
        spmd = self.drives_all_devices
        if spmd:
            xr.use_spmd()  # before any tensor reaches a device
            if xr.process_count() > 1:
                raise RuntimeError(
                    f"strategy='xla_spmd' over {xr.process_count()} hosts is not supported: each host would feed and "
                    f"save the whole global batch. Use strategy='xla' (one replica per device) on a multi-host TPU.")
        process = detect_xla_process(xr, spmd=spmd)
        if launched.world_size > 1 and process.world_size != launched.world_size:
            raise RuntimeError(
                f"{launched.world_size} processes were started by {launched.source}, but torch_xla sees "
                f"{process.world_size} replica(s) in this one: XLA replicas are started by torch_xla's own launcher. "
                f"Use `fabric-lite launch --tpu --nproc-per-node N train.py`.")
        _check_devices(devices, process, xr, spmd, settings if isinstance(settings, XLASettings) else XLASettings())
        from fabric_lite.rng_state import add_runtime_rng

        # From now on XLA's random stream is seeded, saved and restored with the others.
        add_runtime_rng("xla", lambda: int(xm.get_rng_state()), xm.set_rng_state)
        self.threads = not spmd and xr.addressable_device_count() > 1
        self.replicas = process.world_size
        return process, torch_xla.device()

    def check_precision(self, precision: str) -> None:
        if precision == "16-mixed":
            raise ValueError(
                f"precision={precision!r} (float16 with loss scaling) is not supported on XLA devices (TPU): they "
                f"compute in bfloat16. Use precision='bf16-mixed' (or 'bf16-true').")

    def sync(self) -> None:
        """Run the pending graph (the step marker). Replicas that are threads of one process enter it together:
        a replica waiting in a collective holds Python's lock, so a peer still running Python would never
        arrive (see the strategy's collectives)."""
        if self.threads:
            _thread_barrier(self.replicas)
        self.torch_xla.sync()
        self.marked = False

    def mark_step(self) -> None:
        """The step marker after each optimizer step."""
        self.sync()
        self.marked = True

    def device_feed(self, non_blocking: bool = False) -> Optional[Callable[[Any], Any]]:
        to_device = self.strategy.batch_to_device

        def feed(batch: Any) -> Any:
            # The pending work (an evaluation batch, a micro-step) is dispatched while this batch is built, as
            # MpDeviceLoader does; not right after an optimizer step's marker: a marker with nothing new waits for
            # the step before to finish, and the host could not prepare the next step meanwhile. (Start, and
            # resume, count as marked: a resumed run marks the same steps as one that never stopped.)
            if self.marked:
                self.marked = False
            else:
                self.sync()
            return to_device(batch)

        return feed

    @classmethod
    def started_by_launcher(cls, launch: LaunchSettings) -> bool:
        """A replica that torch_xla's launcher started (replicas that are threads share one environment)."""
        return launch.accelerator == cls.device_type

    @classmethod
    def relaunch_command(cls, devices: int, num_nodes: int, script: str, args: List[str]) -> List[str]:
        # torch_xla's launcher, without `fabric-lite launch`'s config file (as torchrun for the default runtime)
        return [sys.executable, "-m", "fabric_lite.launch.xla_launch", str(devices), script, *args]


class XLASPMDRuntime(XLARuntime):
    """One process drives every XLA device (SPMD): nothing to re-launch."""

    kind: ClassVar[str] = SPMD


_BARRIERS: Dict[int, threading.Barrier] = {}
_BARRIERS_LOCK = threading.Lock()
#: How long a replica thread waits for its peers at a step marker before giving up (as DDP's default timeout).
THREAD_BARRIER_TIMEOUT_S = 1800.0


def _thread_barrier(parties: int) -> None:
    """Wait until every replica thread of this process is here (one barrier per process: they are its threads)."""
    with _BARRIERS_LOCK:
        barrier = _BARRIERS.setdefault(parties, threading.Barrier(parties, timeout=THREAD_BARRIER_TIMEOUT_S))
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(
            f"An XLA replica thread waited {THREAD_BARRIER_TIMEOUT_S:.0f} s for its {parties - 1} peer(s) at a step "
            f"marker, or a peer failed: every replica must run the same steps (same number of batches and optimizer "
            f"steps, the same collectives in the same order).") from None


def abort_replica_barriers() -> None:
    """A replica thread failed: its peers waiting at a step marker get an error now instead of after the timeout."""
    with _BARRIERS_LOCK:
        for barrier in _BARRIERS.values():
            barrier.abort()
