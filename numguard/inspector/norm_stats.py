"""The running statistics of the watched normalization layers (BatchNorm, InstanceNorm with
``track_running_stats``), checked after every training forward.

NOTE: [running statistics]
A BatchNorm layer in training mode normalizes with the batch's own statistics and only folds them
into ``running_mean`` / ``running_var``: one huge input (a 1e20 that squares past float32's max)
makes ``running_var`` +Inf while every output of that batch stays finite, and from then on every
evaluation divides by Inf and returns zeros, finite and silent. Module outputs never show it, so
after each training forward the statistics of every layer that updated them are recorded as one
frame of the root (section "buffers", labels ``<layer>.running_mean`` / ``.running_var``; one
multi-tensor launch), read with the batch's flag like every frame: a non-finite one trips at the
batch that wrote it. Only these buffers are watched: other buffers may hold -inf by design
(attention masks), and statistics are non-finite only by a fault. Layers in eval mode, or without
``track_running_stats``, do not update them and are skipped.
"""
from __future__ import annotations

import torch

from .features import Feature

SECTION = "buffers"
_NORMS = torch.nn.modules.batchnorm._NormBase


class NormStatsWatch(Feature):
    """Records the running statistics of the model's normalization layers at each batch's end."""

    def __init__(self, inspector, model):
        self.inspector = inspector
        names = inspector._module_names
        self.layers = [(names.get(m, ""), m) for m in model.modules()
                       if isinstance(m, _NORMS) and m.track_running_stats]
        self.root = (names.get(model, ""), type(model).__name__)

    def end_batch(self, batch):
        labels, values = [], []
        for name, layer in self.layers:
            if not layer.training:
                continue
            for stat in ("running_mean", "running_var"):
                value = layer._buffers.get(stat)
                if value is not None and value.is_floating_point():
                    labels.append(f"{name}.{stat}" if name else stat)
                    values.append(value)
        if not values:
            return
        try:
            self.inspector.record_frame(*self.root, labels, values, section=SECTION)
        except Exception as exc:  # numguard's own failure must not kill the job
            self.layers = []
            self.inspector._warn_once(("norm stats",), f"numguard: the running statistics of normalization "
                                                       f"layers are not watched after an internal error "
                                                       f"({type(exc).__name__}: {exc})")
