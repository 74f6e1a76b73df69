// Error types of the native core. Every failure in the I/O path becomes one of
// these; the binding layer turns them into Python exceptions (OSError subclass
// chosen from errno, EOFError, ValueError). No assert/abort/exit in the I/O path.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastpersist {

// A failed system call: errno, what was done, on which file, where.
class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string op, std::string path, uint64_t offset, uint64_t length);
  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  uint64_t offset() const noexcept { return offset_; }
  uint64_t length() const noexcept { return length_; }
  // "Input/output error (pwrite at offset 4096, length 8192)"
  std::string detail() const;

 private:
  int err_;
  std::string op_;
  std::string path_;
  uint64_t offset_;
  uint64_t length_;
};

// The file ended before the requested bytes.
class EofError : public std::runtime_error {
 public:
  EofError(const std::string& path, uint64_t offset, uint64_t wanted_end);
};

// Bad arguments from the caller (mapped to ValueError).
class ArgError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace fastpersist
