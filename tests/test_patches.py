"""numguard.patches: every process-wide change numguard makes goes through one place, is listed
by numguard.patched() while in place, and is undone by what installed it."""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

import numguard
from numguard import patches


def _targets():
    return [p["target"] for p in numguard.patched()]


def test_replace_is_idempotent_restores_and_leaves_a_wrapper_on_top_alone():
    owner = types.SimpleNamespace(f=lambda: "original")
    original = owner.f
    first = patches.replace(owner, "f", lambda: "ours", target="test.f", why="a test")
    assert patches.replace(owner, "f", lambda: "again", target="test.f", why="a test") is first
    assert owner.f() == "ours" and owner.f.__numguard_original__ is original
    assert {"target": "test.f", "why": "a test"} in numguard.patched()
    patches.restore("test.f")
    patches.restore("test.f")  # idempotent
    assert owner.f is original and "test.f" not in _targets()
    # someone wrapped ours: restoring leaves their wrapper in place
    patches.replace(owner, "f", lambda: "ours", target="test.f", why="a test")
    theirs = owner.f = lambda: "theirs"
    assert "test.f" not in _targets()  # ours is not in place any more
    patches.restore("test.f")
    assert owner.f is theirs
    # ours put back by someone else's restore: installing again puts ours in place again
    patches.replace(owner, "f", lambda: "ours", target="test.f", why="a test")
    owner.f = original
    patches.replace(owner, "f", lambda: "ours again", target="test.f", why="a test")
    assert owner.f() == "ours again"
    patches.restore("test.f")
    assert owner.f is original


def test_watch_with_backward_lists_its_patches_and_close_removes_them():
    before = _targets()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    original_backward, original_step = torch.autograd.backward, torch.amp.GradScaler.step
    insp = numguard.watch(model, backward=True, ops=True, report_to=None)
    try:
        expected = ["torch.autograd.backward", "torch.optim optimizer step pre-hook", "torch.amp.GradScaler.step"]
        assert set(expected) <= set(_targets())  # (some may be in place already, for a watcher left open)
        assert torch.autograd.backward is not original_backward
        model(torch.ones(1, 2)).sum().backward()
    finally:
        insp.close()
    assert _targets() == before
    assert torch.autograd.backward is original_backward and torch.amp.GradScaler.step is original_step


def test_rerun_lists_its_registration_hooks_and_close_removes_them():
    # rerun=True lists the model's buffers again when any module or buffer is registered: two
    # process-wide hooks, listed while the inspector is open, and a registration after close()
    # reaches neither
    before = _targets()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    insp = numguard.watch(model, rerun=True, report_to=None)
    rerun = next(f for f in insp.features if type(f).__name__ == "RootRerun")
    added = [t for t in _targets() if t not in before and "rerun=True" in t]
    assert len(added) == 2, added
    model(torch.ones(1, 2))
    assert rerun.buffers is not None
    model.register_buffer("extra", torch.zeros(1))
    assert rerun.buffers is None   # listed again at the next call
    model(torch.ones(1, 2))
    insp.close()
    assert _targets() == before
    model.register_buffer("later", torch.zeros(1))
    assert rerun.buffers is not None   # the hook is gone


def test_the_collective_guard_lists_each_function_it_wraps(monkeypatch):
    from numguard.distributed import guard_collectives
    before = _targets()
    original = dist.all_reduce
    guard = guard_collectives()
    try:
        wrapped = {f"torch.distributed.{name}" for name in guard.names}
        assert "torch.distributed.all_reduce" in wrapped and wrapped <= set(_targets())
    finally:
        guard.remove()
    assert dist.all_reduce is original and not wrapped & set(_targets())


def test_a_watcher_left_open_elsewhere_keeps_only_what_it_uses():
    """A framework run that raised before its end hook leaves its inspector open: closing another
    one with ops=True still puts torch.autograd.backward back (the open one does not record
    operations); GradScaler.step stays patched while the open one watches gradients."""
    original_backward = torch.autograd.backward
    left_open = numguard.watch(torch.nn.Sequential(torch.nn.Linear(2, 2)), backward=True, report_to=None)
    try:
        other = numguard.watch(torch.nn.Sequential(torch.nn.Linear(2, 2)), backward=True, ops=True, report_to=None)
        assert torch.autograd.backward is not original_backward
        other.close()
        assert torch.autograd.backward is original_backward
        assert "torch.amp.GradScaler.step" in _targets()
    finally:
        left_open.close()
    assert torch.autograd.backward is original_backward


def test_the_batch_finder_lists_its_registration_hook_while_a_try_runs(tmp_path):
    """The finder's process-wide module-registration hook (guarding a DDP model made inside a try)
    is numguard's like the others: listed by numguard.patched() during the try, gone after."""
    from numguard.memory.ranks import _Exchange
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        exchange = _Exchange()
        before = _targets()
        exchange.begin_try()
        try:
            added = [t for t in _targets() if t not in before]
            assert len(added) == 1 and "batch finder" in added[0], added
        finally:
            exchange.end_try()
        assert _targets() == before
    finally:
        dist.destroy_process_group()
