"""A worker thread that cannot be started (issue 24, case 5).

``terminate called without an active exception`` is what libstdc++ prints when a
joinable ``std::thread`` is destroyed. Our thread owners (the handle's task pool, its
async workers, the psync engine) started their threads in a loop in the constructor:
when the system refused one (``pthread_create`` EAGAIN: a machine under load, the
thread or process limit reached) the ``std::system_error`` unwound the constructor
and destroyed the threads already started, still joinable: the process aborted. Now
those threads are stopped and joined and the error reaches Python.

``pthread_create`` is made to fail by an ``LD_PRELOAD`` shim, armed after the imports,
in a child process (before the fix the child aborted with that message).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef int (*create_fn)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);

/* FP_PTHREAD_BUDGET="N TAG" (set at run time; a new TAG re-arms it): the next N
   pthread_create calls succeed, the ones after fail with EAGAIN, until it is removed. */
int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  static create_fn real;
  static char armed[64];
  static int left = 0;
  if (!real) real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
  const char* s = getenv("FP_PTHREAD_BUDGET");
  if (s) {
    if (strncmp(s, armed, sizeof armed - 1) != 0) {
      strncpy(armed, s, sizeof armed - 1);
      left = atoi(s);
    }
    if (left-- <= 0) return EAGAIN;
  }
  return real(t, a, f, arg);
}
"""

CHILD = textwrap.dedent("""
    import os, sys
    import torch
    import fastpersist
    from fastpersist import _native
    outcomes = []
    for budget in range(0, 16):
        os.environ["FP_PTHREAD_BUDGET"] = f"{budget} {budget}"
        try:
            h = _native.Handle(engine="psync", threads=4, max_async=3)
        except Exception as e:
            outcomes.append(type(e).__name__)
        else:
            outcomes.append("ok")
        finally:
            del os.environ["FP_PTHREAD_BUDGET"]
    # the handles that did start work, and saving still works once threads can be made
    path = sys.argv[1]
    fastpersist.save({"w": torch.arange(10.0)}, path)
    assert torch.equal(fastpersist.load(path)["w"], torch.arange(10.0))
    print("OUTCOMES", " ".join(outcomes))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD shim: Linux")
def test_thread_that_cannot_start_raises_instead_of_aborting(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the pthread_create shim")
    src = tmp_path / "shim.c"
    src.write_text(SHIM)
    lib = tmp_path / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], check=True)
    env = dict(os.environ, LD_PRELOAD=str(lib), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "c.pt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    outcomes = out.stdout.split("OUTCOMES", 1)[1].split()
    # 4 pool threads + 3 async workers: every budget below 7 fails part-way through, and raises
    assert outcomes[:7] == ["RuntimeError"] * 7, outcomes
    assert set(outcomes[7:]) == {"ok"}, outcomes
