"""The Inspector's feature lifecycle (numguard.inspector.features): every feature is called at the
same points, in order, and a feature's failure at close never fails the job."""
from __future__ import annotations

import warnings

import pytest
import torch

import numguard
from numguard.errors import InspectorWarning, NonFiniteWarning
from numguard.inspector import is_watched
from numguard.inspector.features import Feature


class Log(Feature):
    def __init__(self):
        self.calls = []

    def begin_batch(self, batch):
        self.calls.append(("begin", batch))

    def end_batch(self, batch):
        self.calls.append(("end", batch))

    def check_read(self, status):
        self.calls.append(("read", bool(status.tripped)))

    def frames_confirmed(self, ring, start, boundary):
        self.calls.append(("confirmed", boundary - start > 0))

    def annotate_report(self, report, offender, frames):
        report["logged"] = True
        self.calls.append(("annotate", report["module"]))

    def close(self):
        self.calls.append(("close",))


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_a_feature_sees_each_point_of_the_lifecycle_in_order():
    model = _model()
    log = Log()
    insp = numguard.watch(model, report_to=None, on_trip="warn")
    insp.features.append(log)
    model(torch.ones(2, 4))
    bad = torch.ones(2, 4)
    bad[0, 0] = float("nan")
    with pytest.warns(NonFiniteWarning):
        model(bad)
    insp.close()
    assert log.calls == [("begin", 0), ("end", 0), ("read", False), ("confirmed", True),
                         ("begin", 1), ("end", 1), ("read", True), ("annotate", "0"), ("close",)]
    assert insp.last_report["logged"] is True


def test_the_built_in_features_are_listed_in_their_order():
    model = _model()
    with numguard.watch(model, report_to=None, backward=True, ops=True, replay=True) as insp:
        kinds = [type(f).__name__ for f in insp.features]
    assert kinds == ["GraphRecorder", "OperationRecorder", "BackwardWatcher", "HistoryFeature", "InputKeeper"]


def test_a_feature_failing_to_close_warns_and_the_rest_still_close():
    class Broken(Feature):
        def close(self):
            raise RuntimeError("cannot let go")

    model = _model()
    log = Log()
    insp = numguard.watch(model, report_to=None)
    insp.features[:0] = [Broken()]
    insp.features.append(log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp.close()
    assert any(issubclass(w.category, InspectorWarning) and "Broken" in str(w.message) and "cannot let go"
               in str(w.message) for w in caught)
    assert log.calls[-1] == ("close",)
    assert not is_watched(model)
