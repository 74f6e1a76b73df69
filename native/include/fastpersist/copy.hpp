// Bulk copies with their CRC-32, the one memory pass every save and staged load makes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastpersist {

// Copy n bytes from src to dst (not overlapping) and return the CRC-32 of them
// (0 and no CRC work when want_crc is false). In L2-sized steps: the CRC reads
// each step of src first, which brings it into cache, then the copy reads it from
// there and writes dst with non-temporal stores (large copies on x86-64), which
// skip reading dst's cache lines before writing them and leave the caches to the
// caller's working set. The copy is complete and visible to other threads when
// this returns (store fence).
uint32_t copy_crc(char* dst, const char* src, size_t n, bool want_crc);

// The copy alone, with the same store choice.
void copy_stream(char* dst, const char* src, size_t n);

// Whether copies of this size use non-temporal stores in this process: x86-64, at
// least kStreamMin bytes, and not turned off with FASTPERSIST_COPY=plain in the
// environment (read once; a diagnostic switch for A/B measurements).
bool streams(size_t n);

constexpr size_t kStreamMin = 256u << 10;

}  // namespace fastpersist
