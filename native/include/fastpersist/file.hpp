// An open file as the engines see it: a buffered descriptor (always) and an
// O_DIRECT descriptor (when the filesystem accepts it), plus the alignment
// O_DIRECT needs on this file's device. RAII: owned descriptors close on
// destruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpersist {

class File {
 public:
  enum class Mode { Read, Write };

  // Open `path`. Write: O_CREAT (+O_TRUNC when `truncate`). `want_direct`:
  // also open an O_DIRECT descriptor; silently absent where refused (tmpfs).
  static File open(const std::string& path, Mode mode, bool truncate, bool want_direct);
  // Use a caller's descriptor (never closed here). An O_DIRECT twin is opened
  // through /proc/self/fd when `want_direct`.
  static File from_fd(int fd, Mode mode, bool want_direct);

  File(File&& o) noexcept;
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const noexcept { return fd_; }    // buffered
  int dfd() const noexcept { return dfd_; }  // O_DIRECT or -1
  bool direct() const noexcept { return dfd_ >= 0; }
  size_t align() const noexcept { return align_; }
  const std::string& path() const noexcept { return path_; }

  // fsync through the fault-injectable syscall layer; throws IoError.
  void sync() const;

 private:
  File() = default;
  void close_all() noexcept;

  int fd_ = -1;
  int dfd_ = -1;
  bool own_fd_ = false;
  bool own_dfd_ = false;
  size_t align_ = 4096;
  std::string path_;
};

// O_DIRECT alignment for files at `path` (file or directory): the logical
// block size of the backing device, never below 4096.
size_t alignment_of_fd(int fd);
size_t alignment_of(const std::string& path);
// Whether O_DIRECT opens succeed on the filesystem of `path` (file or directory).
bool direct_io_supported(const std::string& path);

}  // namespace fastpersist
