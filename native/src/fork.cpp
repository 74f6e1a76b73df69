// Fork generation counter; see fork.hpp for the design.
#include "fastpersist/fork.hpp"

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <initializer_list>

#include "fastpersist/crc32.hpp"

namespace fastpersist {

namespace {

std::atomic<uint64_t> g_generation{0};

void after_fork_in_child() { g_generation.fetch_add(1, std::memory_order_relaxed); }

struct Init {
  Init() {
    ::pthread_atfork(nullptr, nullptr, &after_fork_in_child);
    // Build the CRC tables (function-local statics) now, at load time, so that a
    // fork can never catch another thread inside their one-time initialisation
    // (the child would wait on its guard forever).
    // Three lengths: the vector (>= 512 bytes), carry-less (>= 128) and table paths.
    static const char warm[1024] = {};
    for (size_t n : {sizeof(warm), size_t(200), size_t(5)}) (void)crc32(0, warm, n);
    (void)crc32_combine(1, 2, 4096);
  }
};
Init g_init;

}  // namespace

uint64_t fork_generation() { return g_generation.load(std::memory_order_relaxed); }

}  // namespace fastpersist
