// CRC-32 (reflected polynomial 0xEDB88320, zlib-compatible).
// Portable path: slicing-by-8 tables. x86-64 paths: carry-less multiplication
// folding, 4x128 bits per step with PCLMULQDQ, or 16x128 with VPCLMULQDQ
// (AVX-512 registers, or AVX2 registers where the CPU has no AVX-512), then a Barrett reduction; chosen at run time by what the CPU has. crc32_combine works in GF(2) by computing
// x^(8*len2) mod P.
#include "fastpersist/crc32.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FP_HAVE_CLMUL 1
// VPCLMULQDQ intrinsics and target attributes: GCC 8+, clang 6+.
#if (defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 8)
#define FP_HAVE_VPCLMUL 1
#endif
#endif

namespace fastpersist {

namespace {

constexpr uint32_t kPoly = 0xEDB88320u;

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Tables& tables() {
  static const Tables tb;
  return tb;
}

// Raw CRC register update (no pre/post inversion).
uint32_t crc_slice8(uint32_t c, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#ifdef FP_HAVE_CLMUL
// Folding constants for the reflected CRC-32 polynomial: x^(k) mod P for the
// fold distances (512+64, 512, 128+64, 128 bits), the 64->32 fold, and the
// Barrett pair (P', u').
__attribute__((target("pclmul,sse4.1"))) inline __m128i fold128(__m128i acc, __m128i next,
                                                               __m128i k3k4) {
  __m128i hi = _mm_clmulepi64_si128(acc, k3k4, 0x11);
  __m128i lo = _mm_clmulepi64_si128(acc, k3k4, 0x00);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("pclmul,sse4.1"))) uint32_t finish128(__m128i x1, const unsigned char* p, size_t n);

__attribute__((target("pclmul,sse4.1"))) uint32_t crc_clmul(uint32_t c, const unsigned char* p,
                                                             size_t n) {
  // n >= 64 and n % 16 == 0 here.
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);

  __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
  __m128i x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48));
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(c)));
  p += 64;
  n -= 64;
  while (n >= 64) {
    __m128i y1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
    __m128i y2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
    __m128i y3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
    __m128i y4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k1k2, 0x00), y1);
    x2 = _mm_xor_si128(_mm_clmulepi64_si128(x2, k1k2, 0x00), y2);
    x3 = _mm_xor_si128(_mm_clmulepi64_si128(x3, k1k2, 0x00), y3);
    x4 = _mm_xor_si128(_mm_clmulepi64_si128(x4, k1k2, 0x00), y4);
    x1 = _mm_xor_si128(x1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    x2 = _mm_xor_si128(x2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    x3 = _mm_xor_si128(x3, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
    x4 = _mm_xor_si128(x4, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48)));
    p += 64;
    n -= 64;
  }
  x1 = fold128(x1, x2, k3k4);
  x1 = fold128(x1, x3, k3k4);
  x1 = fold128(x1, x4, k3k4);
  return finish128(x1, p, n);
}

// Folds the remaining 16-byte blocks into x1 and reduces it to the CRC register.
__attribute__((target("pclmul,sse4.1"))) uint32_t finish128(__m128i x1, const unsigned char* p, size_t n) {
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  while (n >= 16) {
    x1 = fold128(x1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), k3k4);
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits.
  __m128i t = _mm_clmulepi64_si128(k3k4, x1, 0x01);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
  // 64 -> 32 bits.
  __m128i x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, mask32);
  x1 = _mm_clmulepi64_si128(x1, k5, 0x00);
  x1 = _mm_xor_si128(x1, x2b);
  // Barrett reduction.
  x2b = x1;
  x1 = _mm_and_si128(x1, mask32);
  x1 = _mm_clmulepi64_si128(x1, poly, 0x10);
  x1 = _mm_and_si128(x1, mask32);
  x1 = _mm_clmulepi64_si128(x1, poly, 0x00);
  x1 = _mm_xor_si128(x1, x2b);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool have_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}

#ifdef FP_HAVE_VPCLMUL
// GCC 12 warns "'__Y' is used uninitialized" inside its own avx512fintrin.h, in
// the _mm512_undefined_*() placeholders of intrinsics inlined below (GCC bug
// 105593, fixed in GCC 13): not our code, and it would fail -Werror builds.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define FP_VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,avx2,vpclmulqdq,pclmul,sse4.1")))

// One fold of four 128-bit lanes at once: acc * (x^(D+32), x^(D-32)) xor next.
FP_VPCLMUL_TARGET inline __m512i fold512(__m512i acc, __m512i next, __m512i k) {
  __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
  __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

// The same folding with 512-bit registers (VPCLMULQDQ): four accumulators of
// four lanes, 256 bytes per step (fold distance 2048 bits), then 4 -> 1
// registers (512 bits each), 4 lanes -> 1 (384, 256, 128 bits) and the
// 128-bit tail. Constants: bit-reflected x^(D+32) and x^(D-32) mod P, << 1.
FP_VPCLMUL_TARGET uint32_t crc_vpclmul(uint32_t c, const unsigned char* p, size_t n) {
  // n >= 256 and n % 16 == 0 here.
  const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430LL, 0x11542778aLL));
  const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL));
  __m512i x0 = _mm512_loadu_si512(p);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  p += 256;
  n -= 256;
  while (n >= 256) {
    x0 = fold512(x0, _mm512_loadu_si512(p), k2048);
    x1 = fold512(x1, _mm512_loadu_si512(p + 64), k2048);
    x2 = fold512(x2, _mm512_loadu_si512(p + 128), k2048);
    x3 = fold512(x3, _mm512_loadu_si512(p + 192), k2048);
    p += 256;
    n -= 256;
  }
  x0 = fold512(x0, x1, k512);
  x0 = fold512(x0, x2, k512);
  x0 = fold512(x0, x3, k512);
  // Four 128-bit lanes -> one: lane i moves forward by (3 - i) * 128 bits.
  const __m512i klanes = _mm512_set_epi64(0, 0, 0x0ccaa009eLL, 0x1751997d0LL, 0x15a546366LL, 0x0f1da05aaLL,
                                          0x174359406LL, 0x03db1ecdcLL);
  __m512i hi = _mm512_clmulepi64_epi128(x0, klanes, 0x11);
  __m512i lo = _mm512_clmulepi64_epi128(x0, klanes, 0x00);
  __m512i folded = _mm512_xor_si512(lo, hi);
  // lane 3 is not multiplied (its constants are 0): add it back unchanged
  folded = _mm512_mask_mov_epi64(folded, 0xC0, x0);
  __m256i h = _mm256_xor_si256(_mm512_castsi512_si256(folded), _mm512_extracti64x4_epi64(folded, 1));
  __m128i r = _mm_xor_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  return finish128(r, p, n);
}

bool have_vpclmul() {
  static const bool yes = have_clmul() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
  return yes;
}

#define FP_VPCLMUL256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))

FP_VPCLMUL256_TARGET inline __m256i fold256(__m256i acc, __m256i next, __m256i k) {
  __m256i hi = _mm256_clmulepi64_epi128(acc, k, 0x11);
  __m256i lo = _mm256_clmulepi64_epi128(acc, k, 0x00);
  return _mm256_xor_si256(_mm256_xor_si256(lo, hi), next);
}

// The 512-bit folding above with 256-bit registers, for CPUs that have VPCLMULQDQ
// but not AVX-512 (AMD Zen 3, Intel Alder Lake and later cores): eight accumulators
// of two lanes, 256 bytes per step (the same fold distance, 2048 bits), then the
// same 512-bit and lane reductions, one register pair at a time.
FP_VPCLMUL256_TARGET inline __m256i load(const unsigned char* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}

FP_VPCLMUL256_TARGET uint32_t crc_vpclmul256(uint32_t c, const unsigned char* p, size_t n) {
  // n >= 256 and n % 16 == 0 here.
  const __m256i k2048 = _mm256_broadcastsi128_si256(_mm_set_epi64x(0x1322d1430LL, 0x11542778aLL));
  const __m256i k512 = _mm256_broadcastsi128_si256(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL));
  __m256i y[8];
  for (int i = 0; i < 8; ++i) y[i] = load(p + 32 * i);
  y[0] = _mm256_xor_si256(y[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(c))));
  p += 256;
  n -= 256;
  while (n >= 256) {
    for (int i = 0; i < 8; ++i) y[i] = fold256(y[i], load(p + 32 * i), k2048);
    p += 256;
    n -= 256;
  }
  // 512-bit groups (y0,y1) (y2,y3) (y4,y5) (y6,y7) -> (y0,y1), moving 512 bits at a time.
  for (int g = 1; g < 4; ++g) {
    y[0] = fold256(y[0], y[2 * g], k512);
    y[1] = fold256(y[1], y[2 * g + 1], k512);
  }
  // Four 128-bit lanes -> one: lane i moves forward by (3 - i) * 128 bits; lane 3 stays.
  const __m256i k01 = _mm256_set_epi64x(0x15a546366LL, 0x0f1da05aaLL, 0x174359406LL, 0x03db1ecdcLL);
  const __m256i k23 = _mm256_set_epi64x(0, 0, 0x0ccaa009eLL, 0x1751997d0LL);
  __m256i f0 = _mm256_xor_si256(_mm256_clmulepi64_epi128(y[0], k01, 0x11), _mm256_clmulepi64_epi128(y[0], k01, 0x00));
  __m256i f1 = _mm256_xor_si256(_mm256_clmulepi64_epi128(y[1], k23, 0x11), _mm256_clmulepi64_epi128(y[1], k23, 0x00));
  f1 = _mm256_blend_epi32(f1, y[1], 0xF0);
  __m256i h = _mm256_xor_si256(f0, f1);
  __m128i r = _mm_xor_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  return finish128(r, p, n);
}

bool have_vpclmul256() {
  static const bool yes = have_clmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
  return yes;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // FP_HAVE_VPCLMUL
#endif  // FP_HAVE_CLMUL

uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, prod = 0;
  for (;;) {
    if (a & m) {
      prod ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return prod;
}

// x^(2^k) mod P, k = 0..31.
struct PowTable {
  std::array<uint32_t, 32> t{};
  PowTable() {
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 32; ++k) t[k] = p = multmodp(p, p);
  }
};

uint32_t x2nmodp(uint64_t n, unsigned k) {
  static const PowTable pt;
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(pt.t[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t crc32(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#ifdef FP_HAVE_CLMUL
#ifdef FP_HAVE_VPCLMUL
  if (n >= 512 && have_vpclmul()) {
    size_t body = n & ~static_cast<size_t>(15);
    c = crc_vpclmul(c, p, body);
    p += body;
    n -= body;
  } else if (n >= 512 && have_vpclmul256()) {
    size_t body = n & ~static_cast<size_t>(15);
    c = crc_vpclmul256(c, p, body);
    p += body;
    n -= body;
  }
#endif
  if (n >= 128 && have_clmul()) {
    size_t body = n & ~static_cast<size_t>(15);
    c = crc_clmul(c, p, body);
    p += body;
    n -= body;
  }
#endif
  c = crc_slice8(c, p, n);
  return ~c;
}

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

}  // namespace fastpersist
