"""numguard's Inspector: module hooks that record stats into a device-side ring without host
syncs, and report the frames that led to the first NaN/Inf in the format of Transformers'
``DebugUnderflowOverflow``.

Modules, in the order a watched tensor meets them:

- ``options``: watch()'s checked options (the rules and defaults live in numguard.env);
- ``frames``: owners, the Frame record, and how a call's arguments become report lines;
- ``core``: the Inspector (builds the parts below and is their public face) and watch();
- ``hooks``: the module hooks, the batch state they hold, and the batch bracket (Inspector.batch);
- ``cycle``: the batch life cycle (begin, end, checks) over the ring, reader, weights and reporter;
- ``features``: the lifecycle every optional part implements (gradients, graph, ops, replay,
  history and spikes, rerun, quant, running statistics: a module each, added in core._add_features);
- ``ring``: the device ring, recording, reuse of tensors already recorded, growth;
- ``operations``: ops=True, a dispatch mode recording every aten operation of the forward;
- ``weights``: the per-batch weight table and the per-module weight flags;
- ``checks``: reading the trip flag (sync / async) and sharing it across ranks;
- ``trips``: reports, on_trip actions, headroom warnings, traces;
- ``dropin``: Transformers' DebugUnderflowOverflow and detect_overflow.
"""
from .core import Inspector, is_watched, watch
from .dropin import DebugUnderflowOverflow, detect_overflow

__all__ = ["Inspector", "watch", "is_watched", "DebugUnderflowOverflow", "detect_overflow"]
