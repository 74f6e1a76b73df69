// Native-only test driver: exercises the threaded parts of the core (executor
// write/read with CRC slots and patches on the worker pool, both CPU engines,
// O_DIRECT and buffered, injected errors racing with fills, transient and
// persistent EAGAIN, asynchronous ops, several handles at once) without Python,
// so it can run under ThreadSanitizer with every line instrumented. Built only
// with -DFASTPERSIST_NATIVE_DRIVER=ON; run by `.ci/sanitize thread`.
// Exit status 0 and "driver: ok" on success; a message and 1 on a wrong result.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fastpersist/crc32.hpp"
#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/handle.hpp"
#include "fastpersist/sys.hpp"

using namespace fastpersist;

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "driver: FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                             \
      std::fprintf(stderr, "\n");                                    \
      ++g_failures;                                                  \
    }                                                                \
  } while (0)

std::vector<char> random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng() & 0xFF);
  return v;
}

uint64_t addr(const char* p) { return reinterpret_cast<uint64_t>(p); }

// The whole buffer as four extents with CRC slots 0, 1, -1, 2, written at `base`,
// plus a u32 patch of slot 2's CRC over the first 4 bytes of extent 2 (slot -1).
OpSpec write_spec(const std::string& path, const std::vector<char>& data, uint64_t base) {
  OpSpec op;
  op.write = true;
  op.target.path = path;
  const size_t n = data.size(), q = n / 4;
  const size_t cut[5] = {0, q, 2 * q + 5, 3 * q + 1, n};
  const int32_t slot[4] = {0, 1, -1, 2};
  for (int i = 0; i < 4; ++i) {
    Extent e;
    e.off = base + cut[i];
    e.ptr = addr(data.data() + cut[i]);
    e.len = cut[i + 1] - cut[i];
    e.slot = slot[i];
    op.extents.push_back(e);
  }
  op.nslots = 3;
  Patch p;
  p.off = base + cut[2];
  p.slot = 2;
  p.kind = 0;
  op.patches.push_back(p);
  return op;
}

OpSpec read_spec(const std::string& path, std::vector<char>& dst, uint64_t base) {
  OpSpec op;
  op.write = false;
  op.target.path = path;
  const size_t n = dst.size(), h = n / 3;
  const size_t cut[4] = {0, h, 2 * h + 3, n};
  for (int i = 0; i < 3; ++i) {
    Extent e;
    e.off = base + cut[i];
    e.ptr = addr(dst.data() + cut[i]);
    e.len = cut[i + 1] - cut[i];
    e.slot = i;
    op.extents.push_back(e);
  }
  op.nslots = 3;
  return op;
}

// Write with slots and a patch, read back; check the patch, the bytes, the CRCs.
void roundtrip(Handle& h, const std::string& path, size_t n, unsigned seed, const char* what) {
  const uint64_t base = 4096 + 17;
  std::vector<char> data = random_bytes(n, seed);
  OpSpec w = write_spec(path, data, base);
  std::vector<uint32_t> wc = h.run(w);
  CHECK(wc.size() == 3, "%s", what);
  std::vector<char> expect = data;
  const size_t p = w.patches[0].off - base;
  for (int i = 0; i < 4; ++i) expect[p + i] = static_cast<char>((wc[2] >> (8 * i)) & 0xFF);
  CHECK(wc[0] == crc32(0, data.data(), w.extents[0].len), "%s: slot 0 crc", what);
  std::vector<char> back(n);
  std::vector<uint32_t> rc = h.run(read_spec(path, back, base));
  CHECK(back == expect, "%s: bytes differ after the round trip", what);
  const size_t h3 = n / 3;
  CHECK(rc[0] == crc32(0, expect.data(), h3), "%s: read crc", what);
}

template <class F>
bool raises_io(F&& f, int* err_out) {
  try {
    f();
  } catch (const IoError& e) {
    *err_out = e.err();
    return true;
  }
  return false;
}

void run_engine(const std::string& dir, const std::string& engine, bool direct) {
  const std::string tag = engine + (direct ? "/direct" : "/buffered");
  const std::string path = dir + "/" + engine + (direct ? "-d" : "-b") + ".bin";
  Handle h(engine, 64u << 10, 8, 4, direct, 4);
  const size_t n = (4u << 20) + 7;
  roundtrip(h, path, n, 1, tag.c_str());

  // Errors while the pool is still filling later chunks (the on_done/fill race).
  for (long nth : {1L, 2L, 3L, 7L, 20L}) {
    std::vector<char> data = random_bytes(n, 2);
    int err = 0;
    sys::set_fault("write", nth, "EIO", 1);
    bool raised = raises_io([&] { h.run(write_spec(path, data, 0)); }, &err);
    sys::clear_faults();
    CHECK(raised && err == EIO, "%s: write EIO at call %ld", tag.c_str(), nth);
    std::vector<char> dst(n);
    sys::set_fault("read", nth, "EIO", 1);
    raised = raises_io([&] { h.run(read_spec(path, dst, 0)); }, &err);
    sys::clear_faults();
    CHECK(raised && err == EIO, "%s: read EIO at call %ld", tag.c_str(), nth);
  }
  roundtrip(h, path, n, 3, tag.c_str());

  // Transient EAGAIN: retried, exact bytes.
  sys::set_fault("write", 2, "EAGAIN", 6);
  roundtrip(h, path, n, 4, (tag + " transient EAGAIN").c_str());
  CHECK(sys::fault_hits() == 6, "%s: EAGAIN hits %ld", tag.c_str(), sys::fault_hits());
  sys::clear_faults();

  // Persistent EAGAIN: an IoError(EAGAIN) after the bounded backoff, not a hang.
  {
    std::vector<char> data = random_bytes(n, 5);
    auto t0 = std::chrono::steady_clock::now();
    int err = 0;
    sys::set_fault("write", 1, "EAGAIN", 1000000000L);
    bool raised = raises_io([&] { h.run(write_spec(path, data, 0)); }, &err);
    sys::clear_faults();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(raised && err == EAGAIN, "%s: persistent EAGAIN", tag.c_str());
    CHECK(s < 10.0, "%s: persistent EAGAIN took %.1f s", tag.c_str(), s);
  }

  // Asynchronous ops (the handle's own worker threads), one of them failing.
  std::vector<std::vector<char>> pieces;
  for (unsigned i = 0; i < 8; ++i) pieces.push_back(random_bytes(300000 + i, 10 + i));
  std::vector<uint64_t> ids;
  for (unsigned i = 0; i < pieces.size(); ++i) {
    ids.push_back(h.submit(write_spec(dir + "/async" + std::to_string(i) + ".bin", pieces[i], 0)));
  }
  std::vector<Future> futures;
  for (unsigned i = 0; i < 4; ++i) {
    futures.push_back(h.submit_future(write_spec(dir + "/fut" + std::to_string(i) + ".bin", pieces[i], 0)));
  }
  auto done = h.wait();
  CHECK(done.size() == ids.size(), "%s: async ops collected %zu", tag.c_str(), done.size());
  for (auto& f : futures) CHECK(f.result(-1).size() == 3, "%s: future", tag.c_str());
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/fastpersist-driver-XXXXXX";
  const char* base = std::getenv("FASTPERSIST_DRIVER_DIR");
  std::string dir;
  if (base && *base) {
    dir = base;
  } else {
    char* d = ::mkdtemp(tmpl);
    if (!d) {
      std::perror("mkdtemp");
      return 1;
    }
    dir = d;
  }
  std::vector<std::string> engines = {"psync"};
  if (aio_available()) engines.push_back("aio");
  try {
    for (const auto& e : engines) {
      for (bool direct : {true, false}) run_engine(dir, e, direct);
    }
    // Several handles at once, from several threads (no fault active here: faults are global).
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < 3; ++t) {
      ts.emplace_back([&, t] {
        Handle h(engines[t % engines.size()], 64u << 10, 8, 3, t % 2 == 0, 2);
        for (unsigned k = 0; k < 3; ++k) {
          roundtrip(h, dir + "/thr" + std::to_string(t) + ".bin", (1u << 20) + 4096 * k + t, 100 + t, "threads");
        }
      });
    }
    for (auto& t : ts) t.join();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "driver: unexpected exception: %s\n", e.what());
    return 1;
  }
  if (!base || !*base) {
    std::string cmd = "rm -rf '" + dir + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "driver: could not remove %s\n", dir.c_str());
  }
  if (g_failures) {
    std::fprintf(stderr, "driver: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("driver: ok (%zu engine(s), direct and buffered)\n", engines.size());
  return 0;
}
