"""The `fabric-lite` command: launch, config, env, test, explain, consolidate."""

from fabric_lite.cli.main import main

__all__ = ["main"]
