// Fibers for the SIMT runtime: stacks and the context switch between the scheduler and
// the CUDA threads it runs, with AddressSanitizer told of every switch (so it tracks
// the right stack and reports overflows of fiber stacks as such).
#pragma once

#include <cstddef>

namespace dflash2 {
namespace emulation {

// One fiber's stack: mmap'ed with a guard page below it, so an overflow faults.
class FiberStack {
 public:
  explicit FiberStack(size_t bytes);
  ~FiberStack();
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;

  char* bottom() const { return usable_; }
  size_t size() const { return usable_bytes_; }

 private:
  char* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  char* usable_ = nullptr;
  size_t usable_bytes_ = 0;
};

// A saved execution context. The scheduler's own context lives on the OS thread's stack.
struct FiberContext {
  void* stack_pointer = nullptr;  // x86-64: where the callee-saved registers were pushed
  void* ucontext = nullptr;       // elsewhere: a ucontext_t
  // AddressSanitizer's view of the stack this context runs on.
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;
};

// Makes `context` start `entry()` on `stack` at its next resume. `entry` must never
// return: it ends by switching away for good (switch_context with finishing = true).
void prepare_context(FiberContext& context, FiberStack& stack, void (*entry)());

// Saves the current context into `from` and resumes `to`. `finishing`: the current
// fiber will never be resumed (its AddressSanitizer fake stack is released).
void switch_context(FiberContext& from, FiberContext& to, bool finishing = false);

// The first thing a fresh fiber's entry does: completes the switch that started it.
void start_fiber(FiberContext& self, FiberContext& scheduler);

}  // namespace emulation
}  // namespace dflash2
