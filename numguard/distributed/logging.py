"""Rank-aware logging: ``get_logger(name).info(msg, main_process_only=True, in_order=False)``.

- Every message is prefixed ``[RANK i]``.
- ``main_process_only=True`` (default): only rank 0 emits its message; the other ranks drop it.
  ``main_process_only=False``: every rank emits its own message, in whatever order they come.
- ``in_order=True``: a collective (every rank of the group must make the same call). Each rank puts
  its formatted message (or nothing, when its own level filters it out) in a fixed-size record
  (``MESSAGE_BYTES`` bytes; a longer message is cut at a character boundary and marked, see
  :func:`fit_message`) and the records are all-gathered ONCE; rank 0 then emits every rank's
  message in rank order through its handlers.
  The collective is entered regardless of the level, so ranks with different levels never
  deadlock, and there are no barriers. ``main_process_only`` is ignored with ``in_order=True``.
- The level comes from ``log_level`` or ``NUMGUARD_LOG_LEVEL`` (names like ``INFO`` or numbers);
  an invalid value raises a ValueError naming it. Without either, the logger's own level applies.
"""
from __future__ import annotations

import logging as _logging
import struct

from . import channel as _channel
from . import collectives as _collectives
from ._env import env_log_level, parse_log_level

MESSAGE_BYTES = 4096
_WORDS = 2 + MESSAGE_BYTES // 8
_MAGIC = 0x4E47_4C47  # "NGLG"


def fit_message(text: str, limit: int = MESSAGE_BYTES) -> bytes:
    """``text`` as UTF-8 in at most ``limit`` bytes. A longer text is cut at a character boundary
    (a cut inside a multi-byte character would reach rank 0 as U+FFFD) and ends with a mark
    saying how long it was: `` ... [truncated, N bytes]``."""
    payload = text.encode("utf-8", "replace")
    if len(payload) <= limit:
        return payload
    mark = f" ... [truncated, {len(payload)} bytes]".encode()[:limit]  # ASCII: any cut is valid
    keep = limit - len(mark)
    # UTF-8 continuation bytes are 0b10xxxxxx: step back to the first byte of the cut character.
    while keep > 0 and payload[keep] & 0xC0 == 0x80:
        keep -= 1
    return payload[:keep] + mark


class RankLoggerAdapter(_logging.LoggerAdapter):
    """A ``logging.LoggerAdapter`` whose calls take ``main_process_only`` and ``in_order``."""

    def process(self, msg, kwargs):
        return f"[RANK {_channel.rank()}] {msg}", kwargs

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False,
            **kwargs):
        if in_order and _channel.is_initialized() and _channel.world_size() > 1:
            self._log_in_order(level, msg, args, kwargs)
            return
        if main_process_only and _channel.rank() != 0:
            return
        if self.isEnabledFor(level):
            msg, kwargs = self.process(msg, kwargs)
            kwargs.setdefault("stacklevel", 3)
            self.logger.log(level, msg, *args, **kwargs)

    def _log_in_order(self, level, msg, args, kwargs) -> None:
        st = _channel.group_state(None)
        enabled = self.isEnabledFor(level)
        payload = b""
        if enabled:
            text, _ = self.process(msg, {})
            if args:
                text = text % args
            payload = fit_message(text)
        # The shared buffer is filled and gathered under the group's lock: two threads logging
        # at once must not mix their records.
        with _channel.exclusive(st, "an in-order log"):
            hin_b = st.gather_buffers(_WORDS)[0]
            struct.pack_into("<qq", hin_b, 0, _MAGIC, (len(payload) << 1) | int(enabled))
            hin_b[16: 16 + len(payload)] = payload
            out = bytes(_collectives.timed_all_gather(st, _WORDS, "numguard in-order log (all_gather)",
                                             _channel.call_site()))
        if st.rank != 0:
            return
        exc_info = kwargs.get("exc_info")
        for r in range(st.world):
            base = r * _WORDS * 8
            magic, info = struct.unpack_from("<qq", out, base)
            if magic != _MAGIC or not info & 1:
                continue
            n = info >> 1
            text = bytes(out[base + 16: base + 16 + n]).decode("utf-8", "replace")
            record = self.logger.makeRecord(
                self.logger.name, level, "(rank %d)" % r, 0, text, None,
                exc_info if r == 0 else None, extra=kwargs.get("extra"))
            self.logger.handle(record)

    # logging.LoggerAdapter's helpers call self.log(level, msg, *args, **kwargs): route them here.
    def debug(self, msg, *args, **kwargs):
        self.log(_logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(_logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(_logging.WARNING, msg, *args, **kwargs)

    def error(self, msg, *args, **kwargs):
        self.log(_logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg, *args, **kwargs):
        self.log(_logging.CRITICAL, msg, *args, **kwargs)

    def exception(self, msg, *args, exc_info=True, **kwargs):
        self.log(_logging.ERROR, msg, *args, exc_info=exc_info, **kwargs)


def get_logger(name: str, log_level=None) -> RankLoggerAdapter:
    """A rank-aware logger for ``name`` (see the module docstring).

    Args:
        name: the ``logging`` logger name.
        log_level: level name or number; default ``NUMGUARD_LOG_LEVEL`` when set.
    """
    level = parse_log_level(log_level) if log_level is not None else env_log_level()
    logger = _logging.getLogger(name)
    if level is not None:
        logger.setLevel(level)
    return RankLoggerAdapter(logger, {})
