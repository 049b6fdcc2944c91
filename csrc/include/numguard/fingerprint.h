// numguard's replica fingerprint, written once for the host (CPU kernel) and the device (CUDA
// kernel): the digest's definition and its constants, which the extension also reports
// (numguard._C.fingerprint_layout) so that the Python side checks the constants in use.
#pragma once

#include <cstdint>

#include "numguard/stats_reduce.h"  // NUMGUARD_HD

namespace numguard {

// =============================================================================================
// Fingerprints (numguard::multi_tensor_fingerprint; numguard.schema.FINGERPRINT_*)
//
// NOTE: [fingerprint]
// The fingerprint of a tensor is an exact 64-bit digest of its bits, used to tell whether the
// replicas of a parameter on different ranks are bitwise identical. Each element contributes
// mix64(bits ^ (index * kFingerprintIndexStep)), where `bits` is the element's storage bits
// zero-extended to 64 (a bool as 0 or 1), and `index` its flat row-major (logical) index; the
// contributions are combined by wrapping (mod 2^64) addition. Addition is associative and
// commutative, so the digest is the same for any thread count, chunking or launch shape, and
// a non-contiguous or expanded tensor has the digest of its contiguous copy. Changing any one
// element always changes the digest (mix64 is a bijection, so its contribution changes by a
// non-zero amount); several changes cancel only by chance (2^-64). -0.0 and 0.0, and NaNs with
// different payloads, differ: this is bit identity, not numeric equality. An empty tensor's
// digest is 0.
constexpr uint64_t kFingerprintIndexStep = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd
constexpr int kFingerprintVersion = 1;  // numguard.schema.FINGERPRINT_VERSION
// splitmix64's finalizer multipliers (numguard.schema.FINGERPRINT_MIX_MULTIPLIERS).
constexpr uint64_t kFingerprintMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kFingerprintMix2 = 0x94D049BB133111EBull;

// splitmix64's finalizer (Stafford's "mix13"): a bijection of 64-bit words with full avalanche.
NUMGUARD_HD uint64_t fingerprint_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kFingerprintMix1;
  z = (z ^ (z >> 27)) * kFingerprintMix2;
  return z ^ (z >> 31);
}

// The contribution of the element with storage bits `bits` at flat index `index`.
NUMGUARD_HD uint64_t fingerprint_element(uint64_t bits, uint64_t index) {
  return fingerprint_mix64(bits ^ (index * kFingerprintIndexStep));
}

// The partial digest of `n` elements of `elem_size` bytes at `data`, whose first element has
// flat index `first_index`. `is_bool`: storage bytes read as 0 / 1.
NUMGUARD_HD uint64_t fingerprint_span(const void* data, int elem_size, bool is_bool, int64_t n,
                                      uint64_t first_index) {
  uint64_t sum = 0;
  switch (elem_size) {
    case 1: {
      const uint8_t* p = static_cast<const uint8_t*>(data);
      if (is_bool) {
        for (int64_t i = 0; i < n; ++i) sum += fingerprint_element(p[i] != 0 ? 1 : 0, first_index + i);
      } else {
        for (int64_t i = 0; i < n; ++i) sum += fingerprint_element(p[i], first_index + i);
      }
      break;
    }
    case 2: {
      const uint16_t* p = static_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) sum += fingerprint_element(p[i], first_index + i);
      break;
    }
    case 4: {
      const uint32_t* p = static_cast<const uint32_t*>(data);
      for (int64_t i = 0; i < n; ++i) sum += fingerprint_element(p[i], first_index + i);
      break;
    }
    default: {
      const uint64_t* p = static_cast<const uint64_t*>(data);
      for (int64_t i = 0; i < n; ++i) sum += fingerprint_element(p[i], first_index + i);
      break;
    }
  }
  return sum;
}

}  // namespace numguard
