"""watch()'s options as one checked record. Each option is declared once, in
numguard.env.WATCH_OPTIONS (name, default, check, meaning, variable); this module only derives the
record's type from that table."""
from __future__ import annotations

import dataclasses

from .. import env

STDOUT = env.STDOUT  # the default report_to: whatever sys.stdout is at report time


def _from_arguments(cls, **arguments):
    """Options from watch()'s arguments (those left out take env.WATCH_DEFAULTS); raises
    numguard.env.OptionError (a TypeError and a ValueError) naming the first bad one."""
    unknown = sorted(set(arguments) - set(env.WATCH_DEFAULTS))
    if unknown:
        raise TypeError(f"numguard.watch: unknown option(s) {', '.join(unknown)}; the options are "
                        f"{', '.join(env.WATCH_DEFAULTS)}")
    return cls(**env.validate_watch_options(dict(env.WATCH_DEFAULTS, **arguments)))


#: Validated watch() options, one field per row of numguard.env.WATCH_OPTIONS.
WatchOptions = dataclasses.make_dataclass(
    "WatchOptions", [(o.name, object) for o in env.WATCH_OPTIONS],
    namespace={"from_arguments": classmethod(_from_arguments),
               "__doc__": "Validated watch() options (numguard.env.WATCH_OPTIONS says what each does).",
               "__module__": __name__})
