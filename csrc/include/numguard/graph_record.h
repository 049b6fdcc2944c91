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

// A call's place: its first record's position and its log row's call number.
struct GraphCall {
  int64_t start;
  int64_t call;
};

// Takes the next n positions and the next call number from the cursor. On the device they are
// taken with atomic adds, so calls running at once on different streams never share a position
// or a log row (NOTE: [concurrent recording] in numguard/stats_reduce.h).
NUMGUARD_HD GraphCall claim_graph_call(int64_t* cursor, int64_t n) {
#ifdef __CUDA_ARCH__
  auto* words = reinterpret_cast<unsigned long long*>(cursor);
  const auto start = static_cast<int64_t>(atomicAdd(words + kCursorPosition, static_cast<unsigned long long>(n)));
  const auto call = static_cast<int64_t>(atomicAdd(words + kCursorCalls, 1ull));
  return GraphCall{start, call};
#else
  const GraphCall claimed{cursor[kCursorPosition], cursor[kCursorCalls]};
  cursor[kCursorPosition] += n;
  cursor[kCursorCalls] += 1;
  return claimed;
#endif
}

// Logs `call` of `slot` in its log row, with the batch the cursor holds.
NUMGUARD_HD void log_graph_call(const GraphCall& call, const int64_t* cursor, int64_t* log, int64_t log_rows,
                                int64_t slot) {
  int64_t* entry = log + ring_row(call.call, log_rows) * kGraphLogWidth;
  entry[kLogSlot] = slot;
  entry[kLogStart] = call.start;
  entry[kLogBatch] = cursor[kCursorBatch];
}

}  // namespace numguard
