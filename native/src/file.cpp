#include "fastpersist/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>

#include "fastpersist/error.hpp"
#include "fastpersist/sys.hpp"

namespace fastpersist {

namespace {

constexpr size_t kMinAlign = 4096;

size_t read_sysfs_size(const std::string& p) {
  std::ifstream in(p);
  size_t v = 0;
  if (in >> v) return v;
  return 0;
}

std::string fd_path(int fd) {
  char buf[4096];
  std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return "fd " + std::to_string(fd);
  buf[n] = '\0';
  return std::string(buf);
}

}  // namespace

size_t alignment_of_fd(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return kMinAlign;
  dev_t dev = S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev;
  unsigned maj = major(dev), min = minor(dev);
  if (maj == 0) return kMinAlign;  // tmpfs, overlay, network filesystems
  std::string base = "/sys/dev/block/" + std::to_string(maj) + ":" + std::to_string(min);
  size_t lbs = read_sysfs_size(base + "/queue/logical_block_size");
  if (lbs == 0) lbs = read_sysfs_size(base + "/../queue/logical_block_size");  // a partition
  return std::max(kMinAlign, lbs);
}

size_t alignment_of(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(errno, "open", path, 0, 0);
  size_t a = alignment_of_fd(fd);
  ::close(fd);
  return a;
}

bool direct_io_supported(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw IoError(errno, "stat", path, 0, 0);
  if (S_ISDIR(st.st_mode)) {
    // O_TMPFILE needs write access; fall back to a named probe file.
    int fd = ::open(path.c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
      return true;
    }
    if (errno == EINVAL) return false;
    std::string probe = path + "/.fastpersist-odirect-probe-" + std::to_string(::getpid());
    fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(probe.c_str());
      return true;
    }
    return false;
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  return false;
}

File File::open(const std::string& path, Mode mode, bool truncate, bool want_direct) {
  File f;
  f.path_ = path;
  int flags = O_CLOEXEC | (mode == Mode::Write ? O_WRONLY | O_CREAT : O_RDONLY);
  if (mode == Mode::Write && truncate) flags |= O_TRUNC;
  int fd = sys::open(path.c_str(), flags, 0666);  // as open(path, "wb"): 0666 less the umask
  if (fd < 0) throw IoError(-fd, "open", path, 0, 0);
  f.fd_ = fd;
  f.own_fd_ = true;
  f.align_ = alignment_of_fd(fd);
  if (want_direct) {
    int dflags = O_CLOEXEC | O_DIRECT | (mode == Mode::Write ? O_WRONLY : O_RDONLY);
    int dfd = ::open(path.c_str(), dflags);
    if (dfd >= 0) {
      f.dfd_ = dfd;
      f.own_dfd_ = true;
    }
  }
  return f;
}

File File::from_fd(int fd, Mode mode, bool want_direct) {
  File f;
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) throw IoError(errno, "fcntl(F_GETFL)", "fd " + std::to_string(fd), 0, 0);
  f.path_ = fd_path(fd);
  f.align_ = alignment_of_fd(fd);
  std::string proc = "/proc/self/fd/" + std::to_string(fd);
  int acc = (mode == Mode::Write) ? O_WRONLY : O_RDONLY;
  if ((fl & O_ACCMODE) == O_RDWR) acc = O_RDWR;
  if (fl & O_DIRECT) {
    // The caller's descriptor is the direct one; open a buffered twin for
    // unaligned heads and tails.
    f.dfd_ = fd;
    int b = ::open(proc.c_str(), acc | O_CLOEXEC);
    if (b < 0) throw IoError(errno, "open", f.path_, 0, 0);
    f.fd_ = b;
    f.own_fd_ = true;
  } else {
    f.fd_ = fd;
    if (want_direct) {
      int d = ::open(proc.c_str(), acc | O_CLOEXEC | O_DIRECT);
      if (d >= 0) {
        f.dfd_ = d;
        f.own_dfd_ = true;
      }
    }
  }
  return f;
}

File::File(File&& o) noexcept { *this = std::move(o); }

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    close_all();
    fd_ = o.fd_;
    dfd_ = o.dfd_;
    own_fd_ = o.own_fd_;
    own_dfd_ = o.own_dfd_;
    align_ = o.align_;
    path_ = std::move(o.path_);
    o.fd_ = o.dfd_ = -1;
    o.own_fd_ = o.own_dfd_ = false;
  }
  return *this;
}

File::~File() { close_all(); }

void File::close_all() noexcept {
  if (own_dfd_ && dfd_ >= 0) ::close(dfd_);
  if (own_fd_ && fd_ >= 0) ::close(fd_);
  fd_ = dfd_ = -1;
  own_fd_ = own_dfd_ = false;
}

void File::sync() const {
  int r = sys::fsync(fd_);
  if (r < 0) throw IoError(-r, "fsync", path_, 0, 0);
}

}  // namespace fastpersist
