"""The raw door's experiment trackers: `Accelerator(log_with=...)`, `init_trackers`, `log`, `get_tracker`.

The trackers themselves are in tracking.py; this is the Accelerator's side (mixed into `Accelerator`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from fabric_lite.accelerator.enums import LoggerType
from fabric_lite.accelerator.tracking import KNOWN_TRACKERS, GeneralTracker, make_trackers
from fabric_lite.arguments import ArgumentCheck

__all__ = ["TrackerControl", "check_log_with"]


class TrackerControl:
    """Start, feed and find the trackers `log_with` names; they run on the main process only."""

    log_with: Any
    trackers: List[GeneralTracker]
    if TYPE_CHECKING:  # (read-only: the Accelerator's RunSettings and ProcessFacts answer them)
        @property
        def logging_dir(self) -> Optional[str]: ...
        @property
        def is_main_process(self) -> bool: ...

    def init_trackers(self, project_name: str, config: Optional[Dict[str, Any]] = None,
                      init_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Start the trackers named by `log_with` (main process only) and record `config`."""
        if not self.is_main_process:
            return
        self.trackers = make_trackers(self.log_with, project_name, self.logging_dir, init_kwargs or {})
        for tracker in self.trackers:
            tracker.start()  # (a tracker written to start late, as Accelerate's custom trackers may be)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.is_main_process:
            raise ValueError(f"No tracker named {name!r}; started: {[t.name for t in self.trackers]}.")
        return GeneralTracker()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, log_kwargs: Optional[Dict[str, Any]] = None) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))


def check_log_with(check: ArgumentCheck, value: Any) -> Any:
    """None, a tracker name (KNOWN_TRACKERS, or 'all'; a `LoggerType` member is one), a GeneralTracker, or a
    list of those. Names come back as plain strings."""
    if value is None:
        return None
    if isinstance(value, LoggerType):
        value = value.value
    elif isinstance(value, (list, tuple)):
        value = [item.value if isinstance(item, LoggerType) else item for item in value]
    allowed = f"{', '.join(map(repr, [*KNOWN_TRACKERS, 'all']))}, or a GeneralTracker"
    single = isinstance(value, (str, GeneralTracker))
    items = [value] if single else check.instances("log_with", value, (str, GeneralTracker),
                                                   what=f"trackers ({allowed})")
    for item in items:
        if isinstance(item, str) and item != "all" and item.lower() not in KNOWN_TRACKERS:
            check.fail("log_with", value, f"unknown tracker {item!r}; allowed: {allowed}, or a list of them.")
    return value if single else items
