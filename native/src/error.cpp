#include "fastpersist/error.hpp"

#include <cstring>

namespace fastpersist {

namespace {
std::string describe(int err, const std::string& op, const std::string& path, uint64_t offset,
                     uint64_t length) {
  return op + " '" + path + "' at offset " + std::to_string(offset) + ", length " +
         std::to_string(length) + ": " + std::strerror(err);
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
         ", length " + std::to_string(length_) + ")";
}

EofError::EofError(const std::string& path, uint64_t offset, uint64_t wanted_end)
    : std::runtime_error("unexpected end of file in '" + path + "' at offset " +
                         std::to_string(offset) + " (needed bytes up to " +
                         std::to_string(wanted_end) + "); the file is truncated or not what " +
                         "the caller expects") {}

}  // namespace fastpersist
