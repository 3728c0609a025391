// Native stack of a "terminate called ..." abort at exit: an LD_PRELOAD library whose
// constructor installs a std::terminate handler that prints the calling thread's name and its
// backtrace (demangled where the symbol is exported) to stderr, then aborts.
//
//   g++ -O0 -g -shared -fPIC -o /tmp/libterm.so tests/tools/terminate_stack.cpp
//   LD_PRELOAD=/tmp/libterm.so PYTHONFAULTHANDLER=1 torchrun --standalone --nproc-per-node 2 job.py
//
// Frames shown as lib.so(+0xOFFSET) resolve with: gdb -batch -ex "info symbol 0xOFFSET" lib.so
#include <cxxabi.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

namespace {

// The demangled name in a backtrace_symbols line "lib(mangled+0x1f) [addr]", or nullptr.
char* demangled(const char* line) {
  const char* open = strchr(line, '(');
  const char* plus = open ? strchr(open, '+') : nullptr;
  if (!open || !plus || plus == open + 1) return nullptr;
  char mangled[1024];
  size_t len = static_cast<size_t>(plus - open - 1);
  if (len >= sizeof mangled) return nullptr;
  memcpy(mangled, open + 1, len);
  mangled[len] = 0;
  int status = 0;
  char* name = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  return status == 0 ? name : nullptr;
}

void on_terminate() {
  char thread[32] = "?";
  pthread_getname_np(pthread_self(), thread, sizeof thread);
  fprintf(stderr, "\n=== std::terminate: pid %d tid %ld thread '%s' (active exception: %s) ===\n",
          getpid(), static_cast<long>(gettid()), thread, std::current_exception() ? "yes" : "none");
  void* frames[128];
  int n = backtrace(frames, 128);
  char** lines = backtrace_symbols(frames, n);
  for (int i = 0; i < n; ++i) {
    const char* line = lines ? lines[i] : "?";
    char* name = demangled(line);
    fprintf(stderr, "#%-2d %s%s%s\n", i, line, name ? "  => " : "", name ? name : "");
    free(name);
  }
  fprintf(stderr, "=== end ===\n");
  fflush(stderr);
  signal(SIGABRT, SIG_DFL);
  abort();
}

__attribute__((constructor)) void install() { std::set_terminate(on_terminate); }

}  // namespace
