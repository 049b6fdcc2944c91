"""The in-order logger's fixed-size records: a long message is cut at a UTF-8 character boundary
and marked, for characters of every width at every cut offset; end to end on two gloo ranks."""
import json
import logging
import os
import sys

import pytest

from numguard.distributed import logging as nglog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHARS = ["a", "\u00e9", "\u20ac", "\U0001F600"]          # 1, 2, 3 and 4 bytes in UTF-8
MARK = " ... [truncated, "


def _check_cut(message, payload, limit):
    """payload is a valid UTF-8 prefix of message plus the mark, the longest that fits."""
    assert len(payload) <= limit
    text = payload.decode("utf-8")                      # strict: a split character would raise
    kept, mark = text.split(MARK)
    assert message.startswith(kept)
    assert mark == f"{len(message.encode())} bytes]"
    following = message[len(kept)]
    assert len(payload) + len(following.encode()) > limit   # the next character did not fit


@pytest.mark.parametrize("char", CHARS)
def test_cut_at_every_offset_keeps_whole_characters(char):
    width = len(char.encode())
    limit = nglog.MESSAGE_BYTES
    for pad in range(2 * width + 8):                    # moves the cut through every byte of a char
        message = "x" * pad + char * (limit // width + 2)
        _check_cut(message, nglog.fit_message(message), limit)


@pytest.mark.parametrize("limit", [1, 5, 40, 41, 64, 100])
def test_small_limits_still_fit(limit):
    for char in CHARS:
        message = "\u00e9" + char * 50
        payload = nglog.fit_message(message, limit)
        assert len(payload) <= limit
        payload.decode("utf-8")


def test_short_messages_are_untouched():
    for char in CHARS:
        message = char * (nglog.MESSAGE_BYTES // len(char.encode()))
        assert nglog.fit_message(message) == message.encode()
    assert nglog.fit_message("lone \ud800 surrogate") == b"lone ? surrogate"


class _OneRank:
    """A gather of one rank: what rank 0 emits is exactly what it packed."""

    rank, world = 0, 1

    def __init__(self):
        import threading

        self.buf = bytearray(nglog._WORDS * 8)
        self.lock = threading.RLock()  # what channel.exclusive() takes
        self.holder = None

    def gather_buffers(self, words):
        return (self.buf,)


def test_in_order_log_emits_the_cut_message_on_rank_0(monkeypatch):
    state = _OneRank()
    channel = nglog._channel
    monkeypatch.setattr(channel, "is_initialized", lambda: True)
    monkeypatch.setattr(channel, "world_size", lambda: 2)
    monkeypatch.setattr(channel, "rank", lambda: 0)
    monkeypatch.setattr(channel, "group_state", lambda group=None: state)
    monkeypatch.setattr(nglog._collectives, "timed_all_gather",
                        lambda st, words, what, site, timeout=None: bytes(st.buf))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = nglog.get_logger("numguard.test.cut", "INFO")
    log.logger.addHandler(Keep())
    log.logger.propagate = False
    for char in CHARS:
        for pad in range(2 * len(char.encode()) + 2):
            records.clear()
            message = "x" * pad + char * nglog.MESSAGE_BYTES
            log.info(message, in_order=True)
            assert len(records) == 1 and "\ufffd" not in records[0]
            _check_cut("[RANK 0] " + message, records[0].encode(), nglog.MESSAGE_BYTES)


_WORKER = r"""
import json, logging, os, sys
import torch.distributed as dist
from numguard.distributed import get_logger
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
log = get_logger("numguard.test.cut2", "INFO")
log.logger.addHandler(Keep())
log.logger.propagate = False
rank = dist.get_rank()
log.info("x" * (rank + 1) + "\u20ac" * 5000, in_order=True)
dist.destroy_process_group()
print(json.dumps(records))
"""


def test_two_ranks_cut_multibyte_messages_cleanly():
    from dist_workers import job_environs, run_rank_processes

    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
    base["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [base.get("PYTHONPATH")] if p])
    results = run_rank_processes([sys.executable, "-c", _WORKER], job_environs(2, base=base), REPO, timeout=180)
    outs = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[1] == []                                  # only rank 0 emits
    assert len(outs[0]) == 2
    for rank, text in enumerate(outs[0]):
        _check_cut(f"[RANK {rank}] " + "x" * (rank + 1) + "\u20ac" * 5000, text.encode(), nglog.MESSAGE_BYTES)
