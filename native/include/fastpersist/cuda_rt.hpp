// Run-time access to CUDA pieces without linking them: the CUDA runtime that
// torch has already loaded (for cudaHostRegister) and cuFile (GPUDirect
// Storage), both through dlopen. Absent libraries simply make these
// unavailable; nothing here is needed on CPU-only machines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpersist {

// cudaHostRegister / cudaHostUnregister through an already-loaded libcudart.
bool cuda_host_register(void* p, size_t n);
void cuda_host_unregister(void* p);

// cuFile: "available" or why not. Tries FASTPERSIST_CUFILE_LIB, then libcufile.so.0.
std::string cufile_status();
bool cufile_available();

// One cuFile registration of an open file (cuFileHandleRegister), deregistered
// on destruction: register a file once, then transfer every extent through it.
// Throws IoError (ENOTSUP when cuFile is unavailable, EIO when registration fails).
class CufileFile {
 public:
  CufileFile(int fd, std::string path);
  ~CufileFile();
  CufileFile(const CufileFile&) = delete;
  CufileFile& operator=(const CufileFile&) = delete;
  // Transfer `len` bytes between device memory `dev` and the file at `off`, in
  // pieces of at most `chunk` bytes; retries EINTR, continues short transfers.
  void transfer(bool write, void* dev, size_t len, uint64_t off, size_t chunk);

 private:
  void* fh_ = nullptr;
  std::string path_;
};

// Transfer `len` bytes between device memory `dev` and file `fd` (opened with
// O_DIRECT) at `off`, registering the file handle for this call only. Throws IoError.
void cufile_transfer(int fd, const std::string& path, bool write, void* dev, size_t len,
                     uint64_t off, size_t chunk);

}  // namespace fastpersist
