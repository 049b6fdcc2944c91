"""numguard.distributed: keep multi-rank jobs from hanging or gathering garbage.

    import numguard.distributed as ngd
    ngd.check_shapes(batch, op="my_gather")     # one tiny all_gather; raises on every rank
    guard = ngd.guard_collectives()             # check before every torch.distributed collective
    guard.remove()                              # undo
    log = ngd.get_logger(__name__)              # [RANK i] prefix, main_process_only, in_order
    ngd.set_trigger(); ngd.check_trigger()      # any rank sets, every rank sees

``NUMGUARD_DIST_CHECK=1`` installs :func:`guard_collectives` when this package is imported
(``guard_collectives()`` called explicitly always installs; ``import numguard`` imports this
package when the variable is set, and with ``NUMGUARD=1`` numguard's start-up hook does). ``NUMGUARD_DIST_TIMEOUT`` (seconds, default 60) bounds every
numguard check; a rank that does not arrive in time is named in a
:class:`DistributedTimeoutError` on the ranks that did, and numguard stops checking that group.

Each numguard check is one small fixed-size tensor operation on numguard's own gloo process group
over the same ranks (created by the first numguard collective of a group, which every rank of
the group reaches; see NOTE: [own process group] in channel.py), so a check never pairs with
a user collective another rank is in. Every numguard check must be called by every rank of the
group in the same order, like any collective. The inspector's trip exchange
(:func:`exchange_trip`) is the exception: the ranks first meet in the store, and a rank that does
not come within a few seconds leaves the others with their own results and a one-time
:class:`DistributedWarning`, never a crash or a hang. numguard releases its state of a group when
the group is destroyed (``destroy_process_group``) and at interpreter exit.
"""
from __future__ import annotations

from . import channel, collectives, trip_exchange
from ._env import dist_check_enabled
from .amax import last_amax_mismatches
from .channel import rank, world_size
from .errors import (CrossRankWarning, DistributedOperationException, DistributedTimeoutError,
                     DistributedWarning, ReplicaDivergenceError)
from .guard import CollectiveGuard, guard_collectives, unguard_collectives
from .logging import get_logger
from .numerics import last_numbers, last_outliers
from .replicas import ReplicaSentinel, watch_replicas
from .shapes import check_shapes
from .triggers import check_trigger, set_trigger
from .trip_exchange import exchange_trip, gather_trip_details, last_exchange

__all__ = [
    "CollectiveGuard",
    "CrossRankWarning",
    "ReplicaDivergenceError",
    "ReplicaSentinel",
    "DistributedOperationException",
    "DistributedTimeoutError",
    "DistributedWarning",
    "check_shapes",
    "channel",
    "check_trigger",
    "collectives",
    "exchange_trip",
    "gather_trip_details",
    "get_logger",
    "guard_collectives",
    "last_amax_mismatches",
    "last_exchange",
    "last_numbers",
    "last_outliers",
    "rank",
    "set_trigger",
    "trip_exchange",
    "unguard_collectives",
    "watch_replicas",
    "world_size",
]

if dist_check_enabled():
    guard_collectives()
