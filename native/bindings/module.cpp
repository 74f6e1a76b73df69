// fastpersist._native: the only file that knows about Python. Converts
// arguments, releases the GIL around all I/O, and turns native errors into
// Python exceptions (OSError subclass from errno, EOFError, ValueError).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "fastpersist/crc32.hpp"
#include "fastpersist/cuda_rt.hpp"
#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/file.hpp"
#include "fastpersist/fork.hpp"
#include "fastpersist/handle.hpp"
#include "fastpersist/sys.hpp"

namespace nb = nanobind;
using namespace fastpersist;

namespace {

uint64_t as_u64(PyObject* o, const char* what) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgError(std::string(what) + " must be a non-negative int");
  }
  return v;
}

long long as_i64(PyObject* o, const char* what) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgError(std::string(what) + " must be an int");
  }
  return v;
}

struct FastSeq {
  PyObject* seq;
  explicit FastSeq(nb::handle h, const char* what) {
    seq = PySequence_Fast(h.ptr(), what);
    if (!seq) {
      PyErr_Clear();
      throw ArgError(std::string(what));
    }
  }
  ~FastSeq() { Py_XDECREF(seq); }
  Py_ssize_t size() const { return PySequence_Fast_GET_SIZE(seq); }
  PyObject* operator[](Py_ssize_t i) const { return PySequence_Fast_GET_ITEM(seq, i); }
};

// ``(ptr, length)`` host ranges from a Python sequence of 2-tuples (crc32_many, crc32_ranges).
std::vector<std::pair<uint64_t, uint64_t>> ptr_ranges(nb::handle ranges) {
  FastSeq s(ranges, "ranges must be a sequence of (ptr, length) tuples");
  std::vector<std::pair<uint64_t, uint64_t>> v(static_cast<size_t>(s.size()));
  for (Py_ssize_t i = 0; i < s.size(); ++i) {
    FastSeq t(s[i], "each range must be a (ptr, length) tuple");
    if (t.size() != 2) throw ArgError("each range must be a (ptr, length) tuple");
    v[static_cast<size_t>(i)] = {as_u64(t[0], "ptr"), as_u64(t[1], "length")};
  }
  return v;
}

std::vector<Extent> to_extents(nb::handle h) {
  FastSeq s(h, "extents must be a sequence of (file_offset, ptr, length, crc_slot) tuples");
  std::vector<Extent> out(static_cast<size_t>(s.size()));
  for (Py_ssize_t i = 0; i < s.size(); ++i) {
    FastSeq t(s[i], "each extent must be a (file_offset, ptr, length, crc_slot) tuple");
    if (t.size() != 4) throw ArgError("each extent must have 4 items (file_offset, ptr, length, crc_slot)");
    Extent& e = out[static_cast<size_t>(i)];
    e.off = as_u64(t[0], "extent file_offset");
    e.ptr = as_u64(t[1], "extent ptr");
    e.len = as_u64(t[2], "extent length");
    e.slot = static_cast<int32_t>(as_i64(t[3], "extent crc_slot"));
  }
  return out;
}

std::vector<Patch> to_patches(nb::handle h) {
  FastSeq s(h, "patches must be a sequence of (file_offset, crc_slot[, kind]) tuples");
  std::vector<Patch> out(static_cast<size_t>(s.size()));
  for (Py_ssize_t i = 0; i < s.size(); ++i) {
    FastSeq t(s[i], "each patch must be a (file_offset, crc_slot[, kind]) tuple");
    if (t.size() != 2 && t.size() != 3) throw ArgError("each patch must have 2 or 3 items");
    Patch& p = out[static_cast<size_t>(i)];
    p.off = as_u64(t[0], "patch file_offset");
    p.slot = static_cast<int32_t>(as_i64(t[1], "patch crc_slot"));
    p.kind = t.size() == 3 ? static_cast<int32_t>(as_i64(t[2], "patch kind")) : 0;
  }
  return out;
}

Target to_target(nb::handle h) {
  Target t;
  if (PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr())) {
    t.fd = static_cast<int>(as_i64(h.ptr(), "fd"));
    if (t.fd < 0) throw ArgError("file descriptor must be >= 0");
    return t;
  }
  PyObject* p = PyOS_FSPath(h.ptr());
  if (!p) {
    PyErr_Clear();
    throw ArgError("target must be a path (str or os.PathLike) or an open file descriptor (int)");
  }
  nb::object path = nb::steal(p);
  if (PyBytes_Check(p)) {
    t.path = std::string(PyBytes_AS_STRING(p), static_cast<size_t>(PyBytes_GET_SIZE(p)));
  } else {
    t.path = nb::cast<std::string>(path);
  }
  return t;
}

OpSpec make_spec(bool write, nb::handle target, nb::handle extents, nb::handle patches, int nslots,
                 bool truncate, bool fsync) {
  OpSpec op;
  op.write = write;
  op.target = to_target(target);
  op.extents = to_extents(extents);
  if (write && patches.ptr() != Py_None) op.patches = to_patches(patches);
  op.nslots = nslots;
  op.truncate = truncate;
  op.fsync = fsync;
  return op;
}

double as_timeout(nb::handle t) {
  if (t.is_none()) return -1.0;
  double v = PyFloat_AsDouble(t.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgError("timeout must be None or a number of seconds");
  }
  if (v < 0) throw ArgError("timeout must be >= 0 (or None: no limit)");
  return v;
}

int pinned_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  PinnedBuffer* b = nb::inst_ptr<PinnedBuffer>(self);
  return PyBuffer_FillInfo(view, self, b->data(), static_cast<Py_ssize_t>(b->size()), 0, flags);
}

PyType_Slot pinned_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(pinned_getbuffer)},
                              {0, nullptr}};

// ---- the GIL at interpreter exit ---------------------------------------------------
//
// CPython 3.11-3.13 end a thread that takes the GIL back once finalization has begun:
// PyEval_RestoreThread calls pthread_exit, whose forced unwind runs through every C++
// frame between it and the thread's start. nanobind's gil_scoped_release takes the
// GIL back in its destructor (noexcept) and nanobind's call dispatch catches (...):
// either turns that unwind into std::terminate ("terminate called without an active
// exception", SIGABRT; issue 33). So every GIL release here is a GilRelease, whose
// way back goes through one process-wide gate:
//
// * The gate closes in an atexit hook (close_exit_gate, registered when this module
//   is loaded, so it runs after the hooks registered later, fastpersist.asyncsave's
//   included), before CPython marks the interpreter as finalizing. Closing waits,
//   GIL released, until every thread that passed the gate before holds the GIL: none
//   is still waiting for it when finalization begins.
// * A thread that reaches the gate once it is closed (or once the interpreter is
//   finalizing, had the hook not run) does not take the GIL: it sleeps until the
//   process ends, as CPython 3.14 does with such threads. Only daemon threads can
//   get there (the others were joined before atexit); the thread that closed the
//   gate (the one finalizing) passes.
// * The gate is per process (rebuilt in a forked child, fork.hpp) and never freed:
//   a sleeping thread may outlive static destructors.
struct ExitGate {
  explicit ExitGate(uint64_t g) : gen(g) {}
  const uint64_t gen;  // fork_generation() of the process it belongs to
  std::mutex mu;
  std::condition_variable cv;
  bool closed = false;
  unsigned long passer = 0;  // PyThread_get_thread_ident() of the thread that closed it
  size_t transit = 0;        // threads past the gate, not yet holding the GIL
};

std::atomic<ExitGate*> g_gate{nullptr};
unsigned long g_main_thread = 0;  // threading.main_thread() when the module was loaded

ExitGate& exit_gate() {
  const uint64_t gen = fork_generation();
  ExitGate* g = g_gate.load(std::memory_order_acquire);
  while (g == nullptr || g->gen != gen) {
    auto* fresh = new ExitGate(gen);
    if (g_gate.compare_exchange_strong(g, fresh, std::memory_order_acq_rel)) return *fresh;  // a parent's: leaked
    delete fresh;  // another thread was first; g is now its gate
  }
  return *g;
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

[[noreturn]] void sleep_until_process_exit() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
}

// Take the GIL back for `ts`, unless the interpreter's exit has begun (see above).
void take_gil_back(PyThreadState* ts) noexcept {
  ExitGate& g = exit_gate();
  const unsigned long me = PyThread_get_thread_ident();
  {
    std::unique_lock<std::mutex> lk(g.mu);
    const bool passes = g.closed ? me == g.passer : (me == g_main_thread || !interpreter_finalizing());
    if (!passes) {
      lk.unlock();
      sleep_until_process_exit();
    }
    ++g.transit;
  }
  PyEval_RestoreThread(ts);
  {
    std::lock_guard<std::mutex> lk(g.mu);
    --g.transit;
  }
  g.cv.notify_all();
}

// nb::gil_scoped_release with the exit gate on the way back. Also a call_guard.
class GilRelease {
 public:
  GilRelease() : ts_(PyEval_SaveThread()) {}
  ~GilRelease() { take_gil_back(ts_); }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* ts_;
};

// atexit: see above. Called with the GIL held, on the thread that will finalize.
void close_exit_gate() {
  ExitGate& g = exit_gate();
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.closed) return;
    g.closed = true;
    g.passer = PyThread_get_thread_ident();
  }
  PyThreadState* ts = PyEval_SaveThread();
  {
    std::unique_lock<std::mutex> lk(g.mu);
    g.cv.wait(lk, [&] { return g.transit == 0; });
  }
  PyEval_RestoreThread(ts);
}

// The exit status of a process whose async save failed and nobody collected the
// error (fastpersist.asyncsave._at_exit). Python cannot change a finishing
// interpreter's exit status from atexit, so a Py_AtExit function, run at the very
// end of Py_FinalizeEx (after every Python exit handler ran and sys.stdout/stderr
// were flushed), ends the process with it: C stdio is flushed, C atexit handlers
// and static destructors are skipped, as with os._exit.
std::atomic<int> g_exit_status{0};
bool g_exit_hook = false;

void exit_with_status() {
  const int status = g_exit_status.load();
  if (status != 0) {
    std::fflush(nullptr);
    ::_exit(status);
  }
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "fastpersist native core (engines, executor, pinned memory). See _native.pyi.";
  m.attr("__version__") = "0.1.0";
  m.attr("ENGINES") = nb::make_tuple("aio", "psync", "cufile");
  // Tensors returned by fastpersist.load are views of a PinnedBuffer; a script that
  // still holds them when Python exits keeps the buffer alive through interpreter
  // teardown, which nanobind would report as "leaked instances" on stderr of every
  // such program. That is expected lifetime, not a leak. Debug builds can define
  // FASTPERSIST_LEAK_WARNINGS to get nanobind's report back.
#ifndef FASTPERSIST_LEAK_WARNINGS
  nb::set_leak_warnings(false);
#endif

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const IoError& e) {
      std::string msg = e.detail();
      PyObject* exc = PyObject_CallFunction(PyExc_OSError, "iss", e.err(), msg.c_str(), e.path().c_str());
      if (!exc) return;
      PyObject* v = PyLong_FromUnsignedLongLong(e.offset());
      PyObject_SetAttrString(exc, "offset", v);
      Py_XDECREF(v);
      v = PyLong_FromUnsignedLongLong(e.length());
      PyObject_SetAttrString(exc, "length", v);
      Py_XDECREF(v);
      v = PyUnicode_FromString(e.op().c_str());
      PyObject_SetAttrString(exc, "operation", v);
      Py_XDECREF(v);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
      Py_DECREF(exc);
    } catch (const EofError& e) {
      PyErr_SetString(PyExc_EOFError, e.what());
    } catch (const WaitTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  // A bad FASTPERSIST_FAULT is an error at import, not silently ignored.
  if (const char* spec = std::getenv("FASTPERSIST_FAULT"); spec && *spec) {
    try {
      sys::set_fault_from_spec(spec);
    } catch (const std::exception& e) {
      throw ArgError(std::string("bad FASTPERSIST_FAULT='") + spec + "' (expected op:nth:action[:count], " +
                     "e.g. write:3:EIO): " + e.what());
    }
  }

  m.def("available_engines", [] {
    std::vector<std::string> out;
    if (aio_available()) out.push_back("aio");
    out.push_back("psync");
    if (cufile_available()) out.push_back("cufile");
    return out;
  });
  m.def("cufile_status", [] { return cufile_status(); });
  m.def("set_staging_huge_pages", &set_staging_huge_pages, nb::arg("huge"));
  m.def("staging_huge_pages", &staging_huge_pages);
  m.def("alignment_of", [](nb::handle path) { return alignment_of(to_target(path).path); }, nb::arg("path"));
  m.def("direct_io_supported", [](nb::handle path) { return direct_io_supported(to_target(path).path); },
        nb::arg("path"));
  m.def(
      "crc32",
      [](uint64_t ptr, uint64_t len, uint32_t crc) {
        GilRelease r;
        return crc32(crc, reinterpret_cast<const void*>(ptr), len);
      },
      nb::arg("ptr"), nb::arg("length"), nb::arg("crc") = 0);
  // One call for many ranges, on the calling thread, the GIL released once: a
  // background thread checksumming a window's tensors would otherwise take the GIL
  // back after every tensor, each time forcing the training thread to hand it over.
  m.def(
      "crc32_many",
      [](nb::handle ranges) {
        std::vector<std::pair<uint64_t, uint64_t>> v = ptr_ranges(ranges);
        std::vector<uint32_t> out(v.size());
        {
          GilRelease r;
          for (size_t i = 0; i < v.size(); ++i) {
            out[i] = crc32(0, reinterpret_cast<const void*>(v[i].first), v[i].second);
          }
        }
        return out;
      },
      nb::arg("ranges"));
  m.def("crc32_combine", [](uint32_t a, uint32_t b, uint64_t len2) { return crc32_combine(a, b, len2); },
        nb::arg("crc1"), nb::arg("crc2"), nb::arg("len2"));

  // Interpreter exit (see "the GIL at interpreter exit" above).
  g_main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  m.def("close_exit_gate", &close_exit_gate);
  nb::module_::import_("atexit").attr("register")(m.attr("close_exit_gate"));
  g_exit_hook = Py_AtExit(&exit_with_status) == 0;
  m.def(
      "set_exit_status",
      [](int status) {
        if (!g_exit_hook) return false;
        g_exit_status.store(status);
        return true;
      },
      nb::arg("status"));

  m.def("set_fault", &sys::set_fault, nb::arg("op"), nb::arg("nth"), nb::arg("action"), nb::arg("count") = 1);
  m.def("clear_faults", &sys::clear_faults);
  m.def("fault_hits", &sys::fault_hits);
  m.def("fault_errno", &sys::fault_errno, nb::arg("op"));

  nb::class_<Handle>(m, "Handle")
      .def(nb::init<std::string, size_t, unsigned, unsigned, bool, unsigned, bool, std::string>(),
           nb::arg("engine") = "auto", nb::arg("chunk_size") = size_t(8) << 20, nb::arg("queue_depth") = 8,
           nb::arg("threads") = 2, nb::arg("direct") = true, nb::arg("max_async") = 2, nb::arg("stage_reads") = false,
           nb::arg("read_mode") = "direct")
      .def_prop_ro("engine", &Handle::engine)
      .def_prop_ro("chunk_size", &Handle::chunk_size)
      .def_prop_ro("queue_depth", &Handle::queue_depth)
      .def_prop_ro("threads", &Handle::threads)
      .def_prop_ro("direct", &Handle::direct)
      .def_prop_ro("stage_reads", &Handle::stage_reads)
      .def_prop_ro("read_mode", &Handle::read_mode)
      .def_prop_ro("last_engine", &Handle::last_engine)
      .def(
          "write",
          [](Handle& h, nb::handle target, nb::handle extents, nb::handle patches, int nslots, bool truncate,
             bool fsync) {
            OpSpec op = make_spec(true, target, extents, patches, nslots, truncate, fsync);
            GilRelease r;
            return h.run(op);
          },
          nb::arg("target"), nb::arg("extents"), nb::arg("patches") = nb::tuple(), nb::arg("nslots") = 0,
          nb::arg("truncate") = true, nb::arg("fsync") = false)
      .def(
          "read",
          [](Handle& h, nb::handle target, nb::handle extents, int nslots) {
            OpSpec op = make_spec(false, target, extents, nb::none(), nslots, false, false);
            GilRelease r;
            return h.run(op);
          },
          nb::arg("target"), nb::arg("extents"), nb::arg("nslots") = 0)
      .def(
          "submit_write",
          [](Handle& h, nb::handle target, nb::handle extents, nb::handle patches, int nslots, bool truncate,
             bool fsync) { return h.submit(make_spec(true, target, extents, patches, nslots, truncate, fsync)); },
          nb::arg("target"), nb::arg("extents"), nb::arg("patches") = nb::tuple(), nb::arg("nslots") = 0,
          nb::arg("truncate") = true, nb::arg("fsync") = false)
      .def(
          "submit_read",
          [](Handle& h, nb::handle target, nb::handle extents, int nslots) {
            return h.submit(make_spec(false, target, extents, nb::none(), nslots, false, false));
          },
          nb::arg("target"), nb::arg("extents"), nb::arg("nslots") = 0)
      .def(
          "write_async",
          [](Handle& h, nb::handle target, nb::handle extents, nb::handle patches, int nslots, bool truncate,
             bool fsync) {
            return h.submit_future(make_spec(true, target, extents, patches, nslots, truncate, fsync));
          },
          nb::arg("target"), nb::arg("extents"), nb::arg("patches") = nb::tuple(), nb::arg("nslots") = 0,
          nb::arg("truncate") = true, nb::arg("fsync") = false)
      .def(
          "read_async",
          [](Handle& h, nb::handle target, nb::handle extents, int nslots) {
            return h.submit_future(make_spec(false, target, extents, nb::none(), nslots, false, false));
          },
          nb::arg("target"), nb::arg("extents"), nb::arg("nslots") = 0)
      .def(
          "wait",
          [](Handle& h) {
            GilRelease r;
            return h.wait();
          })
      .def(
          "wait_op",
          [](Handle& h, uint64_t id, nb::handle timeout) {
            double t = as_timeout(timeout);
            GilRelease r;
            return h.wait_op(id, t);
          },
          nb::arg("op_id"), nb::arg("timeout") = nb::none())
      .def("done", &Handle::done, nb::arg("op_id"))
      .def(
          "copy_ranges",
          [](Handle& h, nb::handle ranges, bool crc) {
            FastSeq s(ranges, "ranges must be a sequence of (dst_ptr, src_ptr, length) tuples");
            std::vector<std::array<uint64_t, 3>> v(static_cast<size_t>(s.size()));
            for (Py_ssize_t i = 0; i < s.size(); ++i) {
              FastSeq t(s[i], "each range must be a (dst_ptr, src_ptr, length) tuple");
              if (t.size() != 3) throw ArgError("each range must be a (dst_ptr, src_ptr, length) tuple");
              v[static_cast<size_t>(i)] = {as_u64(t[0], "dst_ptr"), as_u64(t[1], "src_ptr"), as_u64(t[2], "length")};
            }
            GilRelease r;
            return h.copy_ranges(v, crc);
          },
          nb::arg("ranges"), nb::arg("crc") = false)
      .def("pending", &Handle::pending)
      .def("trim_buffers", &Handle::trim_buffers, nb::arg("keep") = 0)
      .def(
          "crc32_ranges",
          [](Handle& h, nb::handle ranges) {
            std::vector<std::pair<uint64_t, uint64_t>> v = ptr_ranges(ranges);
            GilRelease r;
            return h.crc32_ranges(v);
          },
          nb::arg("ranges"));

  nb::class_<Future>(m, "Future")
      .def_prop_ro("id", &Future::id)
      .def("done", &Future::done)
      .def(
          "wait",
          [](Future& f, nb::handle timeout) {
            double t = as_timeout(timeout);
            GilRelease r;
            return f.wait(t);
          },
          nb::arg("timeout") = nb::none())
      .def(
          "result",
          [](Future& f, nb::handle timeout) {
            double t = as_timeout(timeout);
            GilRelease r;
            return f.result(t);
          },
          nb::arg("timeout") = nb::none());

  nb::class_<PinnedBuffer>(m, "PinnedBuffer", nb::type_slots(pinned_slots))
      // The GIL is released while the memory is mapped and mlock'ed (faulted in: tens
      // of ms per 64 MiB of fresh memory): a lazy save's feeder thread allocates
      // staging windows while the training thread runs Python.
      .def(nb::init<size_t, size_t, bool>(), nb::arg("nbytes"), nb::arg("alignment") = 4096,
           nb::arg("lock") = true, nb::call_guard<GilRelease>())
      .def_prop_ro("ptr", [](const PinnedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_prop_ro("nbytes", &PinnedBuffer::size)
      .def_prop_ro("locked", &PinnedBuffer::locked)
      .def_prop_ro("cuda_registered", &PinnedBuffer::cuda_registered)
      .def("cuda_register", &PinnedBuffer::cuda_register);
}
