"""watch()'s options as one checked record. What each option accepts, its default and its
NUMGUARD_* variable live in numguard.env (the one copy); this module only holds the result."""
from __future__ import annotations

import dataclasses

from .. import env

STDOUT = env.STDOUT  # the default report_to: whatever sys.stdout is at report time


@dataclasses.dataclass
class WatchOptions:
    """Validated watch() options (see Inspector for what each does)."""
    max_frames_to_save: int
    trace_batch_nums: env.BatchSet
    abort_after_batch_num: int | None
    backward: bool
    check: str
    check_every: int
    on_trip: str
    dump_dir: object
    headroom: float
    report_to: object
    extras: bool
    scaler_skips: str
    ops: bool
    replay: bool
    replicas: int = 0   # numguard.distributed.replicas: check every N steps (0: off)

    @classmethod
    def from_arguments(cls, **arguments) -> "WatchOptions":
        """Options from watch()'s arguments (those left out take env.WATCH_DEFAULTS); raises
        numguard.env.OptionError (a TypeError and a ValueError) naming the first bad one."""
        unknown = sorted(set(arguments) - set(env.WATCH_DEFAULTS))
        if unknown:
            raise TypeError(f"numguard.watch: unknown option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(env.WATCH_DEFAULTS)}")
        return cls(**env.validate_watch_options(dict(env.WATCH_DEFAULTS, **arguments)))
