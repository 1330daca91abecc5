"""Starting processes: the launcher over torch.distributed.run and notebook_launcher (`launcher`), the
config file written by `fabric-lite config` (`config_file`), and preemption signals (`preemption`)."""
