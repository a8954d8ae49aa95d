// Fiber stacks and context switches (see fiber.h). On x86-64 a hand-written switch
// saves the six callee-saved registers and the stack pointer: a few nanoseconds, where
// glibc's swapcontext makes a system call (the signal mask) on every switch, and a
// select_path launch switches hundreds of thousands of times. Elsewhere, ucontext.
#include "emulation/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define DFLASH2_ASAN 1
#else
#define DFLASH2_ASAN 0
#endif

#if defined(__x86_64__)
extern "C" void dflash2_emulation_switch(void** save_stack_pointer, void* load_stack_pointer);
// System V: rbx, rbp and r12-r15 are callee-saved; everything else the caller of this
// function already treats as clobbered.
asm(R"(
    .text
    .globl dflash2_emulation_switch
    .hidden dflash2_emulation_switch
    .type dflash2_emulation_switch, @function
dflash2_emulation_switch:
    .cfi_startproc
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .cfi_endproc
    .size dflash2_emulation_switch, .-dflash2_emulation_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

namespace dflash2 {
namespace emulation {

FiberStack::FiberStack(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  usable_bytes_ = (bytes + page - 1) / page * page;
  mapping_bytes_ = usable_bytes_ + page;
  void* mapping = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
  if (mapping == MAP_FAILED) throw std::bad_alloc();
  mapping_ = static_cast<char*>(mapping);
  mprotect(mapping_, page, PROT_NONE);  // the guard page: stacks grow down into it
  usable_ = mapping_ + page;
}

FiberStack::~FiberStack() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

void prepare_context(FiberContext& context, FiberStack& stack, void (*entry)()) {
#if DFLASH2_ASAN
  // A fiber abandoned mid-call (a failed launch) leaves its frames' redzones poisoned.
  ASAN_UNPOISON_MEMORY_REGION(stack.bottom(), stack.size());
#endif
  context.stack_bottom = stack.bottom();
  context.stack_size = stack.size();
  context.fake_stack = nullptr;
#if defined(__x86_64__)
  // From the 16-byte aligned top down: a null return address for entry (it never
  // returns; entry starts with rsp = 8 mod 16 as after a call), entry's address for the
  // switch's `ret`, and six zeroed callee-saved registers for its pops.
  auto top = reinterpret_cast<uintptr_t>(stack.bottom() + stack.size()) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<void**>(top);
  slots[-1] = nullptr;
  slots[-2] = reinterpret_cast<void*>(entry);
  for (int r = 3; r <= 8; ++r) slots[-r] = nullptr;
  context.stack_pointer = &slots[-8];
#else
  if (context.ucontext == nullptr) context.ucontext = new ucontext_t();
  auto* uc = static_cast<ucontext_t*>(context.ucontext);
  if (getcontext(uc) != 0) throw std::runtime_error("getcontext failed");
  uc->uc_stack.ss_sp = stack.bottom();
  uc->uc_stack.ss_size = stack.size();
  uc->uc_link = nullptr;
  makecontext(uc, entry, 0);
#endif
}

void switch_context(FiberContext& from, FiberContext& to, bool finishing) {
#if DFLASH2_ASAN
  __sanitizer_start_switch_fiber(finishing ? nullptr : &from.fake_stack, to.stack_bottom, to.stack_size);
#else
  (void)finishing;
#endif
#if defined(__x86_64__)
  dflash2_emulation_switch(&from.stack_pointer, to.stack_pointer);
#else
  if (from.ucontext == nullptr) from.ucontext = new ucontext_t();
  swapcontext(static_cast<ucontext_t*>(from.ucontext), static_cast<ucontext_t*>(to.ucontext));
#endif
#if DFLASH2_ASAN
  const void* previous_bottom = nullptr;
  size_t previous_size = 0;
  __sanitizer_finish_switch_fiber(from.fake_stack, &previous_bottom, &previous_size);
#endif
}

void start_fiber(FiberContext& self, FiberContext& scheduler) {
  (void)self;
#if DFLASH2_ASAN
  // The switch came from the scheduler: this is where its stack becomes known.
  __sanitizer_finish_switch_fiber(nullptr, &scheduler.stack_bottom, &scheduler.stack_size);
#else
  (void)scheduler;
#endif
}

}  // namespace emulation
}  // namespace dflash2
