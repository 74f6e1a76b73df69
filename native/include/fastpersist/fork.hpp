// Fork safety of the native core.
//
// After fork() only the forking thread exists in the child. Every worker thread
// of the parent is gone, any mutex one of them held at that moment stays locked
// forever, a condition variable they waited on still counts them as waiters
// (glibc's pthread_cond_destroy then blocks for good), and joining their
// std::thread objects hangs or crashes. DataLoader workers and many launchers
// fork after the parent has saved or loaded, so the core must cope.
//
// The design (one rule for every object that owns threads or locks):
//
// * fork_generation() counts the forks this process descends from: a
//   pthread_atfork child handler increments it (a lock-free atomic, so the
//   handler is safe at any moment of the fork).
// * Long-lived objects keep everything that is per-process (worker threads,
//   thread pool, mutexes, condition variables, queues, staging buffer cache) in
//   one heap block stamped with the generation that built it (Handle::State).
//   The first use in a child sees a stale stamp and builds a fresh block; the
//   parent's block is deliberately leaked, never locked, notified, joined or
//   destroyed: its mutexes may be held by threads that do not exist here and
//   its condition variables may count such threads as waiters. The leak is the
//   parent's memory at fork time (copy-on-write, shared with the parent until
//   written), once per handle per fork. Destroying an object in a child whose
//   internals belong to the parent likewise leaks them instead of joining.
//   Because the child never touches a lock of the parent's block, a fork while
//   a parent thread is in the middle of an I/O (holding any of those locks) is
//   as safe as a fork at rest.
// * Per-operation objects (an op's engine with its Linux AIO context or psync
//   threads, its task group and locks) live on the stack of the thread running
//   the op. That thread does not exist in the child, so the child never sees
//   them; a child's own ops build their own (io_setup contexts are never shared
//   with a parent: the kernel does not copy the AIO ring into a child).
// * Process-wide state with a lock (the fault-injection state in sys.cpp) takes
//   its lock in a pthread_atfork prepare handler, releases it in the parent and
//   re-initialises it in the child, so the child's copy is consistent and
//   unlocked. Lazily initialised tables (CRC-32) are built when the library is
//   loaded, so no fork can catch their one-time initialisation half done.
// * CUDA cannot be used in a forked child of a process that initialised it
//   (CUDA's own rule): a PinnedBuffer registered with CUDA by the parent is not
//   unregistered when a child frees it (the registration is the parent's).
//
// Async ops the parent submitted and had not collected at fork time ran (or
// run) in the parent only; a child's reads of them would land in the parent's
// pages, not its own. The child's Handle counts them in pending() and its first
// wait() raises RuntimeError saying so (after collecting the child's own ops),
// then forgets them.
#pragma once

#include <cstdint>

namespace fastpersist {

// 0 in the process that loaded the library; +1 in a child after each fork().
uint64_t fork_generation();

}  // namespace fastpersist
