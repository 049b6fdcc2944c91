// Recording from inside a compiled graph (record_at_cursor_): the frame's base position comes from
// a device-side cursor, not from the host, and each call leaves (slot, start, batch) in a device
// log, so the host can tell which frames were written when it needs to (after a trip), with no
// read per batch. Shared by the CPU and CUDA kernels; no ATen here.
#pragma once

#include <cstdint>

#include "numguard/stats_reduce.h"

namespace numguard {

// Layout of the cursor (int64[kGraphCursorSize]); numguard.schema.GRAPH_CURSOR_FIELDS.
enum GraphCursorField : int {
  kCursorPosition = 0,  // position of the next record (starts at numguard.schema.GRAPH_POSITION_BASE)
  kCursorCalls = 1,     // calls logged so far; call c is log row c mod log rows
  kCursorBatch = 2,     // the batch being run (set by the host when a batch begins)
};
constexpr int kGraphCursorSize = 3;

// Layout of a log row (int64[L, kGraphLogWidth]); numguard.schema.GRAPH_LOG_FIELDS.
enum GraphLogField : int { kLogSlot = 0, kLogStart = 1, kLogBatch = 2 };
constexpr int kGraphLogWidth = 3;

// Row of `position` in a ring (or log) of `rows` rows.
NUMGUARD_HD int64_t ring_row(int64_t position, int64_t rows) {
  int64_t row = position % rows;
  return row < 0 ? row + rows : row;
}

// Logs the call of `slot` (n records from the cursor's position) and advances the cursor.
NUMGUARD_HD void log_graph_call(int64_t* cursor, int64_t* log, int64_t log_rows, int64_t slot, int64_t n) {
  int64_t* entry = log + ring_row(cursor[kCursorCalls], log_rows) * kGraphLogWidth;
  entry[kLogSlot] = slot;
  entry[kLogStart] = cursor[kCursorPosition];
  entry[kLogBatch] = cursor[kCursorBatch];
  cursor[kCursorPosition] += n;
  cursor[kCursorCalls] += 1;
}

}  // namespace numguard
