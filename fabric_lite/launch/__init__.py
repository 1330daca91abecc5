"""Starting processes: over torch.distributed.run and from a notebook (`launcher`), the workers' environment
(`worker_env`), a device runtime's own replica launcher (`launcher.replica_runtime`), the launch config file
(`config_file`; its settings in `config_values`, Accelerate's format in `accelerate_config`), the checks before a
start (`launch_checks`), and preemption signals (`preemption`). `fabric-lite launch` is `cli/launch_command.py`."""
