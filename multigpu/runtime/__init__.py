"""Processes of a run: this process's place in it (``runtime``), the one supervisor that starts and
watches the ranks (``supervisor``), rank processes (``processes``) and their entry point (``rank_entry``)."""

from multigpu.runtime.runtime import Runtime, current, fail, rank, rerun_command, start, world_size

__all__ = ["Runtime", "current", "fail", "rank", "rerun_command", "start", "world_size"]
