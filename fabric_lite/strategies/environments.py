"""Who this process is in the job, read once from the launch environment.

Every environment variable fabric_lite understands is read here and nowhere else; the rest of the
package receives plain values. `detect_process` is a pure function of a mapping, so tests pass a
dict instead of patching ``os.environ``. The doors read it once, with `read_launch_environment`, and
resolve their settings from that value (`fabric_lite.settings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["ProcessInfo", "LaunchSettings", "LaunchEnvironment", "NodeLayout", "detect_process", "detect_node_layout",
           "read_launch_environment", "read_launch_settings", "first_host", "torchrun_master_port"]

# Variables the `fabric-lite launch` command and `notebook_launcher` use to hand settings to the
# Accelerator running inside each worker.
ENV_MIXED_PRECISION = "FABRIC_LITE_MIXED_PRECISION"
ENV_GRAD_ACCUM = "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS"
#: Accelerate's variables for N-D parallelism (what `accelerate launch --use_parallelism_config` sets).
ENV_USE_PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"
PARALLELISM_PREFIX = "PARALLELISM_CONFIG_"
ENV_USE_CPU = "FABRIC_LITE_USE_CPU"
ENV_STRATEGY = "FABRIC_LITE_STRATEGY"
ENV_LAUNCHED = "FABRIC_LITE_LAUNCHED"  # set by `fabric-lite launch` / notebook_launcher in every worker
ENV_ACCELERATOR = "FABRIC_LITE_ACCELERATOR"  # what accelerator="auto" becomes in the workers (a runtime's device)
# `fabric-lite explain`: print the plan at the first prepare(dataloader) / Trainer.fit and exit (explain.py).
ENV_EXPLAIN = "FABRIC_LITE_EXPLAIN"


@dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job: ranks, sizes and where the rendezvous lives."""

    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    restart_count: int = 0
    uses_agent_store: bool = False
    source: str = "lone process"
    #: The engine that starts and restarts this job's processes when it is not a launcher of torch's: "ray_train"
    #: (a worker of Ray Train's TorchTrainer) or "ray" (one process Ray started: a Ray Tune trial, a task). A
    #: script under it must not start processes of its own.
    engine: Optional[str] = None
    #: The device the engine gave this process ("cuda:1"), where it says; None: the local rank picks one.
    device: Optional[str] = None

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def started_by_ray(self) -> bool:
        """Ray started this process (a Ray Train worker, a Tune trial, a task): Ray owns starting processes."""
        return self.engine in ("ray", "ray_train")


@dataclass(frozen=True)
class LaunchSettings:
    """Settings a launcher passed to the workers (None where the launcher said nothing)."""

    mixed_precision: Optional[str] = None
    gradient_accumulation_steps: Optional[int] = None
    use_cpu: bool = False
    strategy: Optional[str] = None
    accelerator: Optional[str] = None
    launched_by_fabric_lite: bool = False
    explain: Optional[str] = None  # FABRIC_LITE_EXPLAIN: None (off), "1", or the planned launch as JSON
    #: N-D parallelism sizes a launch passed down, Accelerate's way (ACCELERATE_USE_PARALLELISM_CONFIG=true and
    #: PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,TP,CP}_SIZE): (dp_replicate, dp_shard, tp, cp), or None.
    parallelism: Optional[Tuple[int, int, int, int]] = None

    @property
    def explain_dry_run(self) -> bool:
        """This lone process stands in for a planned launch (`fabric-lite explain`): the doors record the
        arguments they were given, and leave checks of the launch (devices, nodes) to the plan."""
        return self.explain is not None and self.explain.lstrip().startswith("{")


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={raw!r} is not an integer; the launcher that set it is "
            f"misconfigured. Unset it or set it to a whole number."
        ) from None


def detect_process(env: Mapping[str, str]) -> ProcessInfo:
    """Return this process's ranks: from torchrun / torch elastic (or plain RANK/WORLD_SIZE)
    variables (Ray Train's workers set those too; they are told apart by Ray's own variables), else from a
    SLURM step started by `srun`, else from OpenMPI or MPICH/Intel MPI (`mpirun`), else a lone process. The
    first that applies wins.

    >>> detect_process({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).global_rank
    1
    >>> detect_process({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
    ...                 "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1",
    ...                 "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}).master_addr
    'gpu07'

    Pure: `read_launch_environment` passes it the process environment.
    """
    world_size = _int(env, "WORLD_SIZE")
    if world_size is None:
        if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
            return _checked(_from_slurm(env), "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
        if "OMPI_COMM_WORLD_SIZE" in env:
            return _checked(_from_mpi(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE", "OpenMPI"),
                            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        if "PMI_SIZE" in env and "PMI_RANK" in env:
            return _checked(_from_mpi(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH/Intel MPI"),
                            "PMI_RANK", "PMI_SIZE")
        if _in_ray(env):
            return ProcessInfo(source="Ray, one process (a Ray Tune trial or a Ray task)", engine="ray")
        return ProcessInfo()
    rank = _int(env, "RANK", 0)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    assert rank is not None and local_rank is not None and local_world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"Inconsistent launch environment: RANK={rank}, WORLD_SIZE={world_size}. RANK must lie in "
            f"[0, WORLD_SIZE). Check the launcher command line."
        )
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"Inconsistent launch environment: LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size}."
        )
    node_rank = _int(env, "GROUP_RANK", None)
    if node_rank is None:
        node_rank = _int(env, "NODE_RANK", rank // local_world_size)
    elastic = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env
    ray = not elastic and _in_ray(env)
    if ray:
        source = f"Ray Train, {world_size} worker(s)"
    else:
        source = "torchrun" if elastic else "environment variables"
    return ProcessInfo(
        world_size=world_size,
        global_rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank or 0,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT"),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0) or 0,
        uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        source=source,
        engine="ray_train" if ray else None,
        # Ray Train names each worker's device (ray.train.torch.get_device) for Accelerate in this variable
        device=(env.get("ACCELERATE_TORCH_DEVICE") or None) if ray else None,
    )


def _in_ray(env: Mapping[str, str]) -> bool:
    """A process Ray started (a worker of Ray Train's, a Tune trial, a task): Ray's core sets these in them."""
    return bool(env.get("RAY_JOB_ID")) and bool(env.get("RAY_RAYLET_PID"))


def _checked(info: ProcessInfo, rank_var: str, size_var: str) -> ProcessInfo:
    if info.world_size < 1 or not 0 <= info.global_rank < info.world_size:
        raise ValueError(f"Inconsistent {info.source} environment: {rank_var}={info.global_rank}, "
                         f"{size_var}={info.world_size}. The rank must lie in [0, {size_var}).")
    if not 0 <= info.local_rank < info.local_world_size:
        raise ValueError(f"Inconsistent {info.source} environment: local rank {info.local_rank} of "
                         f"{info.local_world_size} processes on this node.")
    return info


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    head = nodelist.strip()
    bracket, comma = head.find("["), head.find(",")
    if comma != -1 and (bracket == -1 or comma < bracket):
        return head[:comma]
    if bracket == -1:
        return head
    first = head[bracket + 1:].split("]", 1)[0].split(",", 1)[0].split("-", 1)[0]
    return head[:bracket] + first


def _tasks_on_node(spec: str, node: int) -> Optional[int]:
    """Tasks on node `node` from a SLURM tasks-per-node spec such as "2(x3),1"."""
    index = 0
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        times = int(repeat.rstrip(")")) if repeat else 1
        if node < index + times:
            return int(count)
        index += times
    return None


def _from_slurm(env: Mapping[str, str]) -> ProcessInfo:
    node = _int(env, "SLURM_NODEID", 0) or 0
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", 1) or 1
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = _tasks_on_node(spec, node) if spec else None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job = _int(env, "SLURM_JOB_ID", 0) or 0
    return ProcessInfo(
        world_size=world_size,
        global_rank=_int(env, "SLURM_PROCID", 0) or 0,
        local_rank=_int(env, "SLURM_LOCALID", 0) or 0,
        local_world_size=local_size or world_size,
        node_rank=node,
        master_addr=env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1"),
        # every task derives the same port from the job id, unless MASTER_PORT says otherwise
        master_port=_int(env, "MASTER_PORT", 15000 + job % 20000),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0) or 0,
        source="SLURM (srun)",
    )


def _from_mpi(env: Mapping[str, str], rank: str, size: str, local_rank: str, local_size: str,
              name: str) -> ProcessInfo:
    world_size = _int(env, size, 1) or 1
    local_world_size = _int(env, local_size, world_size) or world_size
    global_rank = _int(env, rank, 0) or 0
    return ProcessInfo(
        world_size=world_size,
        global_rank=global_rank,
        local_rank=_int(env, local_rank, 0) or 0,
        local_world_size=local_world_size,
        node_rank=global_rank // local_world_size,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),  # set MASTER_ADDR/MASTER_PORT across nodes
        source=f"{name} (mpirun)",
    )


# -- the nodes of a job, as a cluster engine describes them (for a launcher to start on) -------------------------

#: The rendezvous port on the head node of a SkyPilot job where MASTER_PORT does not say one: every node must
#: compute the same port, so it is fixed (SkyPilot's own torchrun recipe uses 8008), never a free one searched for.
SKYPILOT_MASTER_PORT = 8008


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of a job as the cluster engine that started this node describes them: what a launcher
    (`fabric-lite launch`, the re-launch of `Trainer(devices=N)`) needs to start this node's processes.
    Unlike `ProcessInfo`, it describes the node before any worker process exists."""

    nnodes: int
    node_rank: int
    #: Processes to start on each node where the engine says (SkyPilot: the node's GPUs); None: not said.
    nproc_per_node: Optional[int]
    master_addr: str
    #: The head's rendezvous port; None: not said (a launcher picks: torchrun's own default).
    master_port: Optional[int]
    source: str


def detect_node_layout(env: Optional[Mapping[str, str]] = None) -> Optional[NodeLayout]:
    """The node layout a cluster engine set in the environment, or None where none did. The first that applies:

    - SkyPilot (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS: one IP a line, the first the head's; SKYPILOT_NUM_NODES and
      SKYPILOT_NUM_GPUS_PER_NODE): the head's port is MASTER_PORT where set, else `SKYPILOT_MASTER_PORT` (8008);
      processes per node are the node's GPUs, not said on a node without GPUs;
    - a Kubeflow Trainer TrainJob (torch runtime), or anything else that sets torchrun's PET_NNODES (with
      PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT).

    A value that cannot be right raises ValueError naming the variable. Pure: pass a dict to test it.

    >>> layout = detect_node_layout({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.4\\n10.0.0.5",
    ...                              "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8"})
    >>> (layout.nnodes, layout.node_rank, layout.nproc_per_node, layout.master_addr, layout.master_port)
    (2, 1, 8, '10.0.0.4', 8008)
    >>> detect_node_layout({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "trainjob-node-0-0",
    ...                     "PET_MASTER_PORT": "29400"}).master_addr
    'trainjob-node-0-0'
    >>> detect_node_layout({}) is None
    True
    """
    env = os.environ if env is None else env
    if "SKYPILOT_NODE_RANK" in env or "SKYPILOT_NODE_IPS" in env:
        return _from_skypilot(env)
    if "PET_NNODES" in env:
        return _from_pet(env)
    return None


def _layout_int(env: Mapping[str, str], name: str, fix: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not a whole number; {fix}") from None


def _checked_layout(layout: NodeLayout, rank_var: str, nodes: str, port_var: str) -> NodeLayout:
    """`nodes`: where the node count came from, for the messages ("PET_NNODES=2")."""
    if layout.nnodes < 1:
        raise ValueError(f"Environment variable {nodes} must be >= 1 ({layout.source}); set it to the number of "
                         f"nodes of the job.")
    if not 0 <= layout.node_rank < layout.nnodes:
        raise ValueError(f"Environment variable {rank_var}={layout.node_rank} must lie in 0..{layout.nnodes - 1}, "
                         f"as {nodes} ({layout.source}; nodes are numbered from 0); set it to this node's index.")
    if layout.master_port is not None and not 0 < layout.master_port < 65536:
        raise ValueError(f"Environment variable {port_var}={layout.master_port} must lie in 1..65535; set it to a "
                         f"free port on the head node.")
    return layout


def _from_skypilot(env: Mapping[str, str]) -> NodeLayout:
    fix = "SkyPilot sets it on every node of a task; unset it outside a SkyPilot job."
    raw_ips = env.get("SKYPILOT_NODE_IPS")
    if raw_ips is None:
        raise ValueError(f"SKYPILOT_NODE_RANK={env.get('SKYPILOT_NODE_RANK')!r} is set without SKYPILOT_NODE_IPS "
                         f"(one node IP a line, the head's first); {fix}")
    ips = [line.strip() for line in raw_ips.splitlines() if line.strip()]
    if not ips:
        raise ValueError(f"Environment variable SKYPILOT_NODE_IPS={raw_ips!r} names no node; it must hold one IP a "
                         f"line, the head node's first. {fix}")
    rank = _layout_int(env, "SKYPILOT_NODE_RANK", f"it must be this node's index (0 on the head node). {fix}")
    if rank is None:
        raise ValueError(f"SKYPILOT_NODE_IPS is set without SKYPILOT_NODE_RANK (this node's index); {fix}")
    nnodes = _layout_int(env, "SKYPILOT_NUM_NODES", f"it must be the number of nodes. {fix}")
    if nnodes is not None and nnodes != len(ips):
        raise ValueError(f"Environment variable SKYPILOT_NUM_NODES={env['SKYPILOT_NUM_NODES']!r} disagrees with "
                         f"SKYPILOT_NODE_IPS, which names {len(ips)} node(s) ({', '.join(ips)}); set both from the "
                         f"same task, or unset SKYPILOT_NUM_NODES.")
    gpus = _layout_int(env, "SKYPILOT_NUM_GPUS_PER_NODE", f"it must be the GPUs of each node (0 on CPU nodes). {fix}")
    if gpus is not None and gpus < 0:
        raise ValueError(f"Environment variable SKYPILOT_NUM_GPUS_PER_NODE={gpus} must be >= 0 (0 on CPU nodes); "
                         f"{fix}")
    port = _layout_int(env, "MASTER_PORT", "set it to a free port on the head node, or unset it for "
                                           f"{SKYPILOT_MASTER_PORT}.")
    layout = NodeLayout(nnodes=len(ips), node_rank=rank, nproc_per_node=gpus if gpus else None, master_addr=ips[0],
                        master_port=SKYPILOT_MASTER_PORT if port is None else port, source="SkyPilot")
    return _checked_layout(layout, "SKYPILOT_NODE_RANK", f"SKYPILOT_NODE_IPS names {len(ips)} node(s)", "MASTER_PORT")


def _from_pet(env: Mapping[str, str]) -> NodeLayout:
    source = "Kubeflow TrainJob (PET_* variables)"
    raw_nodes = env["PET_NNODES"]
    if ":" in raw_nodes:
        raise ValueError(f"Environment variable PET_NNODES={raw_nodes!r} is an elastic range of nodes, which only "
                         f"torchrun's own rendezvous handles: start the job with `fabric-lite launch train.py` "
                         f"(it reads the range), or set PET_NNODES to the number of nodes.")
    fix = "torchrun reads it too; set it to a whole number, or unset it."
    nnodes = _layout_int(env, "PET_NNODES", fix)
    if nnodes is None:
        raise ValueError(f"Environment variable PET_NNODES={raw_nodes!r} is empty; {fix}")
    rank = _layout_int(env, "PET_NODE_RANK", fix)
    raw_nproc = (env.get("PET_NPROC_PER_NODE") or "").strip()
    nproc: Optional[int] = None
    if raw_nproc.lstrip("+-").isdigit():  # auto / gpu / cpu: torchrun counts them; not said here
        nproc = int(raw_nproc)
        if nproc < 1:
            raise ValueError(f"Environment variable PET_NPROC_PER_NODE={raw_nproc!r} must be >= 1 (or auto, gpu, "
                             f"cpu); {fix}")
    layout = NodeLayout(nnodes=nnodes, node_rank=rank or 0, nproc_per_node=nproc,
                        master_addr=(env.get("PET_MASTER_ADDR") or "").strip() or "127.0.0.1",
                        master_port=_layout_int(env, "PET_MASTER_PORT", fix), source=source)
    return _checked_layout(layout, "PET_NODE_RANK", f"PET_NNODES={nnodes}", "PET_MASTER_PORT")


def torchrun_master_port(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """PET_MASTER_PORT, torchrun's own default for --master-port (None where unset): `fabric-lite launch`, which
    otherwise picks a free port, keeps it."""
    env = os.environ if env is None else env
    return env.get("PET_MASTER_PORT") or None


def read_launch_settings(env: Mapping[str, str]) -> LaunchSettings:
    """Settings that `fabric-lite launch --mixed-precision ...` passed down to this worker, in `env` (pure:
    `read_launch_environment` passes it the process environment)."""
    return LaunchSettings(
        mixed_precision=env.get(ENV_MIXED_PRECISION) or None,
        gradient_accumulation_steps=_int(env, ENV_GRAD_ACCUM),
        use_cpu=env.get(ENV_USE_CPU, "").lower() in {"1", "true", "yes"},
        strategy=env.get(ENV_STRATEGY) or None,
        accelerator=env.get(ENV_ACCELERATOR) or None,
        launched_by_fabric_lite=env.get(ENV_LAUNCHED) == "1",
        explain=None if env.get(ENV_EXPLAIN, "").strip().lower() in {"", "0", "false", "no"} else env[ENV_EXPLAIN],
        parallelism=_parallelism(env),
    )


def _parallelism(env: Mapping[str, str]) -> Optional[Tuple[int, int, int, int]]:
    if env.get(ENV_USE_PARALLELISM, "").strip().lower() not in {"1", "true", "yes"}:
        return None
    return tuple(_int(env, f"{PARALLELISM_PREFIX}{name}_SIZE", 1) or 1  # type: ignore[return-value]
                 for name in ("DP_REPLICATE", "DP_SHARD", "TP", "CP"))


@dataclass(frozen=True)
class LaunchEnvironment:
    """Everything the launch environment says about this process, read at once: its place in the job, the
    settings a launcher passed down, and the settings of each device runtime it names. A plain value: the doors
    resolve their settings from it (`fabric_lite.settings`), and tests build one instead of setting variables."""

    process: ProcessInfo = ProcessInfo()
    launch: LaunchSettings = LaunchSettings()
    #: By runtime name (the registry's `register_runtime`): the settings its reader found, for each runtime the
    #: environment says something about (none: no entry).
    runtimes: Mapping[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:  # (the mapping is not hashable; the runtimes' settings are seldom set)
        return hash((self.process, self.launch, tuple(sorted(self.runtimes))))


def read_launch_environment(env: Optional[Mapping[str, str]] = None) -> LaunchEnvironment:
    """The one read of the launch environment (`os.environ` unless `env` is given): the doors make it once per
    construction and hand on what it says; code that runs with no door (the command line, a Ray driver, a
    PartialState before any Accelerator, a launcher) calls it where it needs a launch fact."""
    from fabric_lite.strategies.registry import read_runtime_settings

    env = os.environ if env is None else env
    runtimes: Dict[str, Any] = read_runtime_settings(env)
    return LaunchEnvironment(process=detect_process(env), launch=read_launch_settings(env), runtimes=runtimes)
