#include "fastpersist/error.hpp"

#include <cerrno>
#include <cstring>

namespace fastpersist {

namespace {

bool is_write_op(const std::string& op) { return op == "pwrite" || op == "cuFileWrite"; }

// What the user can do about some errors, appended to both the message and
// detail(). Only what the error itself tells: the op, the file, the offset and
// the length of the failed request (for a write: the bytes that request still
// had to write; the whole operation may need more).
std::string hint(int err, const std::string& op, const std::string& path, uint64_t offset,
                 uint64_t length) {
  if (err == ENOSPC) {
    std::string h = "; free space on the filesystem holding '" + path + "'";
    if (is_write_op(op) && length > 0) {
      h += " (this write needed " + std::to_string(length) + " more bytes at offset " +
           std::to_string(offset) + ")";
    } else if (op == "fallocate" && length > 0) {
      h += " (reserving " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
           " failed)";
    }
    return h;
  }
  if (err == EAGAIN && (op == "pwrite" || op == "pread")) {
    // The engines give up on EAGAIN only after their bounded retry (sys::EagainBackoff).
    return "; still failing after retrying with backoff for about 1 s";
  }
  return "";
}

std::string describe(int err, const std::string& op, const std::string& path, uint64_t offset,
                     uint64_t length) {
  return op + " '" + path + "' at offset " + std::to_string(offset) + ", length " +
         std::to_string(length) + ": " + std::strerror(err) + hint(err, op, path, offset, length);
}

}  // namespace

IoError::IoError(int err, std::string op, std::string path, uint64_t offset, uint64_t length)
    : std::runtime_error(describe(err, op, path, offset, length)),
      err_(err),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset),
      length_(length) {}

std::string IoError::detail() const {
  return std::string(std::strerror(err_)) + " (" + op_ + " at offset " + std::to_string(offset_) +
         ", length " + std::to_string(length_) + ")" + hint(err_, op_, path_, offset_, length_);
}

EofError::EofError(const std::string& path, uint64_t offset, uint64_t wanted_end)
    : std::runtime_error("unexpected end of file in '" + path + "' at offset " +
                         std::to_string(offset) + " (needed bytes up to " +
                         std::to_string(wanted_end) + "); the file is truncated or not what " +
                         "the caller expects") {}

}  // namespace fastpersist
