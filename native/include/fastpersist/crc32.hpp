// CRC-32 with the zlib/zip polynomial (same values as zlib.crc32).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastpersist {

uint32_t crc32(uint32_t crc, const void* data, size_t n);
// crc(A + B) from crc(A), crc(B) and len(B).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

}  // namespace fastpersist
