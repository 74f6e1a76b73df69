#include "fastpersist/cuda_rt.hpp"

#include <dlfcn.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "fastpersist/error.hpp"

namespace fastpersist {

namespace {

void* find_loaded(const char* const* names) {
  for (const char* const* n = names; *n; ++n) {
    if (void* h = ::dlopen(*n, RTLD_NOW | RTLD_NOLOAD)) return h;
  }
  return nullptr;
}

using HostRegisterFn = int (*)(void*, size_t, unsigned);
using HostUnregisterFn = int (*)(void*);

struct CudaRt {
  HostRegisterFn reg = nullptr;
  HostUnregisterFn unreg = nullptr;
  CudaRt() {
    static const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                  "libcudart.so", nullptr};
    void* h = find_loaded(names);
    if (!h) return;
    reg = reinterpret_cast<HostRegisterFn>(::dlsym(h, "cudaHostRegister"));
    unreg = reinterpret_cast<HostUnregisterFn>(::dlsym(h, "cudaHostUnregister"));
  }
};

CudaRt& rt() {
  static CudaRt r;
  return r;
}

// ---- cuFile (types as in cufile.h) ----
struct CUfileError_t {
  int err;
  int cu_err;
};
struct CUfileDescr_t {
  int type;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};
using CUfileHandle_t = void*;

struct CuFile {
  std::string status = "not probed";
  CUfileError_t (*driver_open)() = nullptr;
  CUfileError_t (*handle_register)(CUfileHandle_t*, CUfileDescr_t*) = nullptr;
  void (*handle_deregister)(CUfileHandle_t) = nullptr;
  ssize_t (*read)(CUfileHandle_t, void*, size_t, off_t, off_t) = nullptr;
  ssize_t (*write)(CUfileHandle_t, const void*, size_t, off_t, off_t) = nullptr;
  bool ok = false;

  CuFile() {
    // cuFileDriverOpen spins forever on machines without an NVIDIA GPU, so
    // look for the driver's device nodes first.
    if (::access("/dev/nvidiactl", F_OK) != 0 || ::access("/dev/nvidia0", F_OK) != 0) {
      status = "no NVIDIA GPU device (/dev/nvidia0) on this machine";
      return;
    }
    const char* env = std::getenv("FASTPERSIST_CUFILE_LIB");
    void* h = nullptr;
    if (env && *env) h = ::dlopen(env, RTLD_NOW | RTLD_LOCAL);
    if (!h) h = ::dlopen("libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = ::dlopen("libcufile.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      status = std::string("libcufile not loadable: ") + (e ? e : "unknown error");
      return;
    }
    driver_open = reinterpret_cast<decltype(driver_open)>(::dlsym(h, "cuFileDriverOpen"));
    handle_register = reinterpret_cast<decltype(handle_register)>(::dlsym(h, "cuFileHandleRegister"));
    handle_deregister = reinterpret_cast<decltype(handle_deregister)>(::dlsym(h, "cuFileHandleDeregister"));
    read = reinterpret_cast<decltype(read)>(::dlsym(h, "cuFileRead"));
    write = reinterpret_cast<decltype(write)>(::dlsym(h, "cuFileWrite"));
    if (!driver_open || !handle_register || !handle_deregister || !read || !write) {
      status = "libcufile lacks the cuFile symbols";
      return;
    }
    CUfileError_t e = driver_open();
    if (e.err != 0) {
      status = "cuFileDriverOpen failed (cuFile error " + std::to_string(e.err) + ", CUDA error " +
               std::to_string(e.cu_err) + "); no GPU or driver?";
      return;
    }
    ok = true;
    status = "available";
  }
};

CuFile& cufile() {
  static CuFile c;  // thread-safe lazy init
  return c;
}

}  // namespace

bool cuda_host_register(void* p, size_t n) {
  auto& r = rt();
  if (!r.reg || !p || n == 0) return false;
  return r.reg(p, n, 0) == 0;
}

void cuda_host_unregister(void* p) {
  auto& r = rt();
  if (r.unreg && p) r.unreg(p);
}

std::string cufile_status() { return cufile().status; }
bool cufile_available() { return cufile().ok; }

CufileFile::CufileFile(int fd, std::string path) : path_(std::move(path)) {
  auto& c = cufile();
  if (!c.ok) throw IoError(ENOTSUP, "cuFile (" + c.status + ")", path_, 0, 0);
  CUfileDescr_t d{};
  d.type = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD
  d.handle.fd = fd;
  CUfileHandle_t fh = nullptr;
  CUfileError_t e = c.handle_register(&fh, &d);
  // A refused registration means cuFile cannot serve this file (no nvidia-fs and no
  // compatibility mode, a filesystem it does not support): ENOTSUP, so that callers
  // that may choose another way (engine "auto") fall back instead of failing.
  if (e.err != 0)
    throw IoError(ENOTSUP,
                  "cuFileHandleRegister refused the file (cuFile error " + std::to_string(e.err) +
                      ", CUDA error " + std::to_string(e.cu_err) + "; see CUfileOpError in cufile.h)",
                  path_, 0, 0);
  fh_ = fh;
}

CufileFile::~CufileFile() {
  if (fh_) cufile().handle_deregister(fh_);
}

void CufileFile::transfer(bool write, void* dev, size_t len, uint64_t off, size_t chunk) {
  auto& c = cufile();
  size_t done = 0;
  while (done < len) {
    size_t n = std::min(chunk, len - done);
    ssize_t r = write ? c.write(fh_, dev, n, static_cast<off_t>(off + done), static_cast<off_t>(done))
                      : c.read(fh_, dev, n, static_cast<off_t>(off + done), static_cast<off_t>(done));
    if (r == -1 && errno == EINTR) continue;
    if (r < 0) throw IoError(r == -1 ? errno : EIO, write ? "cuFileWrite" : "cuFileRead", path_, off + done, n);
    if (r == 0) {
      if (write) throw IoError(EIO, "cuFileWrite", path_, off + done, n);
      throw EofError(path_, off + done, off + len);
    }
    done += static_cast<size_t>(r);
  }
}

void cufile_transfer(int fd, const std::string& path, bool write, void* dev, size_t len,
                     uint64_t off, size_t chunk) {
  CufileFile f(fd, path);
  f.transfer(write, dev, len, off, chunk);
}

}  // namespace fastpersist
