"""The batch finder's loop: :func:`find_executable_batch_size` tries sizes (numguard.memory.search),
agrees with the other ranks after every try (numguard.memory.ranks) and frees a failed try's
memory (numguard.memory.oom)."""
from __future__ import annotations

import functools
import inspect
import warnings

import torch

from ..env import OptionError
from . import oom as _oom
from . import ranks as _ranks
from .oom import (_WHERE, BatchSizeNotFoundError, BatchSizeTimeoutError, _drop_frames, _gib, _reset_peak,
                  is_out_of_memory, release_memory)
from .ranks import (_ENDS, _ERROR, _FAILURES, _MARGIN, _OK, _OOM, _OOM_FINAL, _PEER, _START, _Exchange, _failures,
                    _peer_error)
from .search import _Search, _agree_next, _validate, _whole, few_sizes_warning


class _Finder:
    def __init__(self, function, starting, reduce_fn, minimum, reduction, search, margin,
                 global_batch):
        self.function = function
        self.reduce_fn = reduce_fn
        self.minimum, self.reduction, self.search = minimum, reduction, search
        self.margin, self.global_batch = margin, global_batch
        self.batch_size = starting           # where the next call starts (Accelerate's state)
        self.succeeded = False
        self.tried = []
        self.logger = None
        self.leading = 2 if global_batch is not None else 1
        self.options = {}   # the decorated function's attributes (retry_after_success)

    @property
    def retry_after_success(self):
        return bool(self.options.get("retry_after_success", False))

    @staticmethod
    def _tell_peers(ex, exc, oom):
        """A failure that ends the search on this rank: report it so the other ranks raise too
        instead of waiting. Returns a PeerFailedError to raise instead of ``exc`` when ``exc`` is
        a collective that broke because another rank ran out of memory (the watchdog aborted it,
        NOTE: [stuck ranks], or the group's own timeout expired); None to re-raise ``exc``."""
        text = f"{type(exc).__name__}: {exc}"
        code = _OOM_FINAL if oom else _ERROR
        ex.post_failure(code, text)
        gone = ex.gone()
        try:
            # A peer that gave up waits no more: an exchange would only time out.
            failures = ex.known_failures() if gone else _failures(ex.settle(code, 0, 0, text))
        except BatchSizeTimeoutError:
            failures = ex.known_failures()
        peer_oom = any(c in (_OOM, _OOM_FINAL) for r, (c, _) in failures.items() if r != ex.rank)
        broken = ex.aborted or gone or isinstance(exc, getattr(torch.distributed, "DistError", ()))
        if peer_oom and broken:
            failures[ex.rank] = (code, text)
            return _peer_error(failures)
        return None

    def _log(self, level, msg):
        if self.logger is None:
            from ..distributed import get_logger
            self.logger = get_logger("numguard.memory")
        try:
            getattr(self.logger, level)(msg, main_process_only=True)
        except Exception:  # noqa: BLE001 - logging must never end the search
            pass

    def _check_call(self, args):
        params = list(inspect.signature(self.function).parameters.keys())
        if len(params) < len(args) + self.leading:
            name = getattr(self.function, "__name__", repr(self.function))
            arg_str = ", ".join(f"{a}={v}" for a, v in zip(params[self.leading:], args[self.leading:]))
            raise TypeError(f"Batch size was passed into `{name}` as the first argument when "
                            f"called. Remove this as the decorator already does so: "
                            f"`{name}({arg_str})`")

    def reset(self, starting_batch_size=None):
        """Forget the size found; the next call searches again (from starting_batch_size)."""
        if starting_batch_size is not None:
            self.batch_size = _whole("starting_batch_size", starting_batch_size, 0)
        self.succeeded = False

    def __call__(self, *args, **kwargs):
        self._check_call(args)
        dist = torch.distributed
        ex = _Exchange() if dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1 else None
        world = ex.world if ex is not None else 1
        per_rank = None
        if self.global_batch is not None:
            if self.global_batch % world:
                raise OptionError("global_batch_size", self.global_batch,
                                  f"pass a multiple of the world size ({world})", where=_WHERE)
            per_rank = self.global_batch // world
            few = few_sizes_warning(self.global_batch, world, per_rank)
            if few is not None:
                warnings.warn(few, UserWarning, stacklevel=2)
        search = _Search(self, per_rank)
        self.tried = search.tried   # this call's [(size, outcome)], for the caller to inspect
        size = search.snap(self.batch_size)
        if ex is not None:  # every rank starts from the smallest starting size
            size = min(r[1] for r in ex.round(_START, size))
        if size < self.minimum:
            start = f"starting_batch_size={self.batch_size}" + (
                f" (largest divisor of {per_rank} per rank: {size})" if per_rank is not None else "")
            raise BatchSizeNotFoundError([], self.minimum, f"{start} leaves nothing to try")
        best_result, last_error = None, None
        release_memory()
        while True:
            _reset_peak()
            code, text = _OK, ""
            call = (size, per_rank // size) if per_rank is not None else (size,)
            if ex is not None:
                ex.begin_try()
            _ranks._ACTIVE = ex
            try:
                result = self.function(*call, *args, **kwargs)
            except Exception as exc:
                _ranks._ACTIVE = None
                peer = ex.peer_failure if ex is not None else None
                oom = is_out_of_memory(exc)
                if peer is None and (not oom or (self.succeeded and not self.retry_after_success)):
                    instead = self._tell_peers(ex, exc, oom) if ex is not None else None
                    if instead is not None:
                        raise instead from exc
                    raise
                code = _PEER if peer is not None else _OOM
                text = str(peer) if peer is not None else f"{type(exc).__name__}: {exc}"
                if ex is not None:
                    ex.peer_failure = None
                    if code == _OOM:
                        ex.post_failure(code, text)
                _drop_frames(exc)
                last_error = exc
                del exc
            finally:
                _ranks._ACTIVE = None
                if ex is not None:
                    ex.end_try()
            mem = _oom.device_memory()
            if code == _OK and self.margin is not None and mem is not None \
                    and mem[1] > (1.0 - self.margin) * mem[2]:
                code, text = _MARGIN, (f"peak {_gib(mem[1])} leaves less than margin="
                                       f"{self.margin:g} of {_gib(mem[2])} free")
            if code != _OK:
                result = None
                release_memory()
            fail_prop = search.fail_proposal(size, call_user_fn=code in (_OOM, _MARGIN))
            if code == _MARGIN and fail_prop <= 0:  # nothing smaller to go to: keep this size
                code, fail_prop = _OK, 0
                self._log("warning", f"batch size {size} leaves less memory free than margin="
                                     f"{self.margin:g} but no smaller size is allowed; using it")
            ok_prop = search.ok_proposal(size) if code == _OK else 0
            rows = ex.settle(code, fail_prop, ok_prop, text) if ex is not None \
                else [(code, fail_prop, ok_prop, text)]
            if any(row[0] in _ENDS for row in rows):
                raise _peer_error(_failures(rows)) from last_error
            failed_ranks = [r for r, row in enumerate(rows) if row[0] in (_OOM, _MARGIN)]
            failed = any(row[0] in _FAILURES for row in rows)
            outcome = "ok" if not failed else (
                ("out of memory" if any(rows[r][0] == _OOM for r in failed_ranks) else "over margin")
                + (f" on rank {', '.join(map(str, failed_ranks))}" if ex is not None else ""))
            search.tried.append((size, outcome))
            if failed:
                search.lowest_fail = size if search.lowest_fail is None else min(search.lowest_fail, size)
                last_text = next((rows[r][3] for r in failed_ranks), text)
                if not last_text and last_error is not None:
                    last_text = str(last_error)
            else:
                search.best = size
                best_result = result
            nxt = _agree_next(rows, failed)
            if failed:  # one line per try: info (0.9 steps make many); the summary warns
                self._log("info", self._retry_line(size, failed_ranks, ex, mem, nxt, last_text))
            result = None
            if nxt == -1:
                raise BatchSizeNotFoundError(search.tried, self.minimum, last_text) from last_error
            if nxt == 0:
                break
            size = nxt
        self.batch_size, self.succeeded = search.best, True
        tried = ", ".join(f"{s} ({o})" for s, o in search.tried)
        accum = f" x {per_rank // search.best} accumulation steps x {world} ranks = " \
                f"{self.global_batch}" if per_rank is not None else ""
        # Shown by default when the size differs from the one asked for.
        level = "warning" if len(search.tried) > 1 else "info"
        self._log(level, f"batch size {search.best}{accum} fits; tried {tried}")
        return best_result

    @staticmethod
    def _retry_line(size, ranks, ex, mem, nxt, text):
        where = f" on rank {', '.join(map(str, ranks))}" if ex is not None and ranks else ""
        memory = f" (CUDA: {_gib(mem[0])} in use, peak {_gib(mem[1])})" if mem is not None else ""
        then = f"retrying with {nxt}" if nxt > 0 else "no smaller size left" if nxt == -1 \
            else "keeping the largest size that ran"
        return f"batch size {size} failed{where}{memory}: {text.splitlines()[0] if text else ''}; {then}"


def _check_retryable(function):
    """A generator or coroutine function returns at once, before any of its body runs: its
    out-of-memory errors come later, outside the decorator, and would never be retried."""
    kind = ("an async generator function" if inspect.isasyncgenfunction(function) else
            "a coroutine function (async def)" if inspect.iscoroutinefunction(function) else
            "a generator function" if inspect.isgeneratorfunction(function) else None)
    if kind is None:
        return
    name = getattr(function, "__qualname__", None) or repr(function)
    raise TypeError(
        f"{_WHERE} cannot retry `{name}`: it is {kind}, so calling it only creates a "
        f"{'coroutine' if 'coroutine' in kind else 'generator'} and its out-of-memory errors "
        f"happen later, while it is iterated or awaited, outside the decorator. Decorate a plain "
        f"function that runs the whole training (collect what the generator yields into a list "
        f"and return it; run async code with asyncio.run inside a plain function).")


def find_executable_batch_size(function=None, starting_batch_size=128, reduce_batch_size_fn=None,
                               *, minimum_batch_size=1, reduction=0.9, search="down", margin=None,
                               global_batch_size=None):
    """Call ``function(batch_size, *args, **kwargs)`` with smaller batch sizes until it runs
    without running out of memory (Accelerate-compatible decorator, see the module docstring).

    Args:
        function: the function to wrap; None to use as ``@find_executable_batch_size(...)``.
        starting_batch_size: the first size tried (and the largest, even with ``search="binary"``).
        reduce_batch_size_fn: a function of no argument returning the next size after a failure
            (called on the ranks that failed; every rank uses the smallest proposed).
        minimum_batch_size: going below it raises :class:`BatchSizeNotFoundError`.
        reduction: the factor a size is multiplied by after a failure (``int(size *
            reduction)``): 0.9 by default, as Accelerate 1.x; 0.5 halves (Accelerate's guide).
        search: ``"down"`` stops at the first size that runs; ``"binary"`` then searches between
            it and the smallest failed size for the largest that runs.
        margin: keep this fraction of device memory free (CUDA; peak over total), by retrying one
            step smaller when a run's peak leaves less.
        global_batch_size: keep ``batch_size * gradient_accumulation_steps * world_size`` equal to
            it; the function is then called as ``function(batch_size, accumulation_steps, ...)``.
    """
    options = _validate(starting_batch_size, reduce_batch_size_fn, minimum_batch_size, reduction,
                        search, margin, global_batch_size)
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn,
                                 minimum_batch_size=minimum_batch_size, reduction=reduction,
                                 search=search, margin=margin, global_batch_size=global_batch_size)
    _check_retryable(function)
    finder = _Finder(function, options[0], reduce_batch_size_fn, *options[1:])

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        return finder(*args, **kwargs)

    decorator.finder = finder
    decorator.reset = finder.reset
    decorator.retry_after_success = False
    finder.options = decorator.__dict__   # read on each call: the user may set it any time
    return decorator
