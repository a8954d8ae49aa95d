// The SIMT runtime's scheduler (see simt.h for the execution model).
//
// A launch runs its blocks one after another. Each block's threads are fibers; the
// scheduler (on the OS thread's own stack) repeatedly draws a runnable fiber from the
// seeded generator and switches to it. A fiber runs until it parks at a barrier or a
// warp collective, yields at an atomic or fence, or exits, and switches back. Every
// park is checked at once against what the other threads are doing, so a collective
// that can never complete is reported where it happens, with both source lines.
#include "emulation/simt.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "emulation/fiber.h"
#include "emulation/traffic.h"

namespace dflash2 {
namespace emulation {

const ThreadContext* current_thread = nullptr;

namespace {

constexpr int kWarp = 32;
constexpr size_t kFiberStackBytes = size_t{256} << 10;  // room for AddressSanitizer's redzones
constexpr int kMaxBlockThreads = 1024;

// splitmix64: small, seedable, and good enough to shuffle schedules.
struct Generator {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t bound) { return static_cast<size_t>(next() % bound); }
};

enum class State { kRunnable, kBarrier, kCollective, kYielded, kExited };

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSyncwarp: return "__syncwarp";
    case WarpOp::kShfl: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
  }
  return "?";
}

struct Fiber {
  FiberContext context;
  ThreadContext builtins;
  int linear = 0;  // thread index within the block, x fastest
  State state = State::kRunnable;
  const char* file = nullptr;  // where it parked (or exited)
  int line = 0;
  // The collective it waits at.
  WarpOp op = WarpOp::kSyncwarp;
  unsigned mask = 0;
  int width = kWarp;
  int argument = 0;
  uint64_t value = 0;
  uint64_t result = 0;
};

const char* base_name(const char* file) {
  if (file == nullptr) return "?";
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

// Two parks at one source line. The call sites' __builtin_FILE() strings are usually one
// literal, so the pointers decide before any string compare.
bool same_place(const Fiber& a, const Fiber& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(base_name(a.file), base_name(b.file)) == 0);
}

std::string where(const Fiber& fiber) {
  std::ostringstream text;
  text << base_name(fiber.file) << ":" << fiber.line;
  return text.str();
}

// Everything about the launch in progress. Launches are serialised (one set of
// function-local statics stands for every block's shared memory).
struct Launch {
  const char* kernel = nullptr;
  KernelBody body = nullptr;
  void* closure = nullptr;
  int threads = 0;
  uint3 block_index{};
  std::vector<Fiber> fibers;
  // Per warp, bit l for lane l: parked at a collective, exited, parked at __syncthreads.
  struct WarpLanes {
    unsigned at_collective = 0;
    unsigned exited = 0;
    unsigned at_barrier = 0;
  };
  std::vector<WarpLanes> warps;
  std::vector<int> runnable;
  int exited = 0;
  int at_barrier = 0;
  std::string error;
  Fiber* running = nullptr;
  FiberContext scheduler;
};

std::mutex launch_mutex;
Launch* active = nullptr;
Generator generator{0x5eed};
thread_local std::string last_error;
std::vector<std::unique_ptr<FiberStack>> stack_pool;

// A kernel that spins (waiting on another block's write, which never comes while
// blocks run one at a time) never reaches the scheduler again; the watchdog turns
// that hang into an abort with the kernel's name.
std::atomic<int64_t> launch_started_ms{0};
std::atomic<const char*> watched_kernel{nullptr};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t watchdog_limit_ms() {
  const char* text = std::getenv("DFLASH2_EMULATION_TIMEOUT_S");
  const double seconds = text ? std::atof(text) : 300.0;
  return seconds > 0 ? static_cast<int64_t>(seconds * 1000) : 0;
}

void watchdog_loop() {
  const int64_t limit = watchdog_limit_ms();
  if (limit <= 0) return;
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const int64_t started = launch_started_ms.load();
    if (started != 0 && now_ms() - started > limit) {
      std::fprintf(stderr,
                   "dflash2 emulator: kernel %s has run for over %.0f s without finishing: a thread spins on a value "
                   "no other thread will write (blocks run one at a time), or the launch is far too large. "
                   "Aborting (DFLASH2_EMULATION_TIMEOUT_S sets the limit).\n",
                   watched_kernel.load() ? watched_kernel.load() : "?", limit / 1000.0);
      std::abort();
    }
  }
}

void start_watchdog() {
  static std::once_flag once;
  std::call_once(once, [] { std::thread(watchdog_loop).detach(); });
}

std::string thread_label(const Launch& launch, const Fiber& fiber) {
  std::ostringstream text;
  text << "thread (" << fiber.builtins.thread_index.x << "," << fiber.builtins.thread_index.y << ","
       << fiber.builtins.thread_index.z << ")";
  if (launch.threads > kWarp) text << " (warp " << fiber.linear / kWarp << ", lane " << fiber.linear % kWarp << ")";
  return text.str();
}

void fail(Launch& launch, const std::string& message) {
  if (!launch.error.empty()) return;
  std::ostringstream text;
  text << "dflash2 emulator: kernel " << launch.kernel << ", block (" << launch.block_index.x << ","
       << launch.block_index.y << "," << launch.block_index.z << "): " << message;
  launch.error = text.str();
}

// Where a parked fiber waits, for messages.
std::string describe(const Launch& launch, const Fiber& fiber) {
  std::ostringstream text;
  text << thread_label(launch, fiber);
  switch (fiber.state) {
    case State::kBarrier: text << " waits at __syncthreads (" << where(fiber) << ")"; break;
    case State::kCollective:
      text << " waits at " << op_name(fiber.op) << "(mask 0x" << std::hex << fiber.mask << std::dec << ") ("
           << where(fiber) << ")";
      break;
    case State::kExited: text << " has exited"; break;
    default: text << " is running"; break;
  }
  return text.str();
}

[[noreturn]] void fiber_main();

void switch_to_scheduler(Fiber& self, bool finishing = false) {
  switch_context(self.context, active->scheduler, finishing);
}

void fiber_main() {
  Launch& launch = *active;
  Fiber& self = *launch.running;
  start_fiber(self.context, launch.scheduler);
  launch.body(launch.closure);
  self.state = State::kExited;
  switch_to_scheduler(self, /*finishing=*/true);
  std::abort();  // never resumed
}

// A barrier completes when every thread of the block waits at it, all at one line.
void try_release_barrier(Launch& launch) {
  if (launch.at_barrier == 0 || launch.at_barrier + launch.exited < launch.threads) return;
  const Fiber* first = nullptr;
  for (const Fiber& fiber : launch.fibers) {
    if (fiber.state != State::kBarrier) continue;
    if (first == nullptr) {
      first = &fiber;
    } else if (!same_place(fiber, *first)) {
      fail(launch, "divergent __syncthreads: " + describe(launch, *first) + " while " + describe(launch, fiber));
      return;
    }
  }
  if (launch.exited > 0) {
    for (const Fiber& fiber : launch.fibers) {
      if (fiber.state == State::kExited) {
        fail(launch, describe(launch, *first) + ", which " + thread_label(launch, fiber) +
                         ", having exited, will never reach");
        return;
      }
    }
  }
  for (Fiber& fiber : launch.fibers) {
    fiber.state = State::kRunnable;
    launch.runnable.push_back(fiber.linear);
  }
  launch.at_barrier = 0;
  for (Launch::WarpLanes& warp : launch.warps) warp.at_barrier = 0;
}

// The lane a shuffle reads, or -1 for the caller's own value (source outside its segment).
int shuffle_source(const Fiber& fiber) {
  const int lane = fiber.linear % kWarp;
  const int width = fiber.width;
  const int segment = lane / width * width;
  switch (fiber.op) {
    case WarpOp::kShfl: return segment + (fiber.argument & (width - 1));
    case WarpOp::kShflUp: return lane - segment >= fiber.argument ? lane - fiber.argument : -1;
    case WarpOp::kShflDown: return lane - segment + fiber.argument < width ? lane + fiber.argument : -1;
    case WarpOp::kShflXor: {
      const int source = lane ^ fiber.argument;
      return source >= segment && source < segment + width ? source : -1;
    }
    default: return -1;
  }
}

// Called when `fiber` parks at a collective: checks it against its warp and completes
// the collective once every lane it names has arrived. Every park is checked against
// one lane already waiting at a collective that names it: by induction all of them
// agree, so a check costs O(1) and only a completing collective visits its lanes.
void try_complete_collective(Launch& launch, Fiber& fiber) {
  const int lane = fiber.linear % kWarp;
  const int warp_base = fiber.linear - lane;
  const int warp_lanes = std::min(kWarp, launch.threads - warp_base);
  const unsigned existing = warp_lanes == kWarp ? ~0u : (1u << warp_lanes) - 1u;
  const unsigned self_bit = 1u << lane;
  Launch::WarpLanes& warp = launch.warps[warp_base / kWarp];
  if ((fiber.mask & self_bit) == 0) {
    fail(launch, describe(launch, fiber) + ", whose mask leaves out its own lane");
    return;
  }
  if (fiber.width < 1 || fiber.width > kWarp || (fiber.width & (fiber.width - 1)) != 0) {
    fail(launch, describe(launch, fiber) + " with width " + std::to_string(fiber.width) +
                     ", not a power of two in [1, 32]");
    return;
  }
  if ((fiber.mask & ~existing) != 0) {
    fail(launch, describe(launch, fiber) + " names lane " + std::to_string(__builtin_ctz(fiber.mask & ~existing)) +
                     ", which this block does not have");
    return;
  }
  const unsigned gone = fiber.mask & (warp.exited | warp.at_barrier);
  if (gone != 0) {
    const int other_lane = __builtin_ctz(gone);
    fail(launch, describe(launch, fiber) + " for lane " + std::to_string(other_lane) + ", but " +
                     describe(launch, launch.fibers[warp_base + other_lane]));
    return;
  }
  // One waiting lane this collective names, and every waiting lane outside it that
  // names this one: each must be at the very same collective.
  unsigned to_compare = warp.at_collective & fiber.mask;
  to_compare = to_compare & (0u - to_compare);  // the lowest
  for (unsigned others = warp.at_collective & ~fiber.mask; others != 0; others &= others - 1) {
    const Fiber& other = launch.fibers[warp_base + __builtin_ctz(others)];
    if (other.mask & self_bit) to_compare |= 1u << __builtin_ctz(others);
  }
  for (; to_compare != 0; to_compare &= to_compare - 1) {
    const Fiber& other = launch.fibers[warp_base + __builtin_ctz(to_compare)];
    if (other.op != fiber.op || other.mask != fiber.mask || other.width != fiber.width || !same_place(other, fiber)) {
      fail(launch, "divergent warp collective: " + describe(launch, fiber) + " while " + describe(launch, other));
      return;
    }
  }
  warp.at_collective |= self_bit;
  if ((warp.at_collective & fiber.mask) != fiber.mask) return;  // lanes still on their way

  uint64_t votes = 0;
  bool all_true = true;
  for (unsigned m = fiber.mask; m != 0; m &= m - 1) {
    const Fiber& member = launch.fibers[warp_base + __builtin_ctz(m)];
    if (member.value != 0) votes |= 1ull << __builtin_ctz(m);
    all_true = all_true && member.value != 0;
  }
  for (unsigned m = fiber.mask; m != 0; m &= m - 1) {
    Fiber& member = launch.fibers[warp_base + __builtin_ctz(m)];
    switch (member.op) {
      case WarpOp::kSyncwarp: member.result = 0; break;
      case WarpOp::kBallot: member.result = votes; break;
      case WarpOp::kAny: member.result = votes != 0; break;
      case WarpOp::kAll: member.result = all_true; break;
      default: {
        const int source = shuffle_source(member);
        if (source < 0 || source == member.linear % kWarp) {
          member.result = member.value;
        } else if (((fiber.mask >> source) & 1u) == 0) {
          fail(launch, describe(launch, member) + " reads lane " + std::to_string(source) +
                           ", which is not in the mask (its value is undefined)");
          return;
        } else {
          member.result = launch.fibers[warp_base + source].value;
        }
      }
    }
  }
  warp.at_collective &= ~fiber.mask;
  for (unsigned m = fiber.mask; m != 0; m &= m - 1) {
    launch.fibers[warp_base + __builtin_ctz(m)].state = State::kRunnable;
    launch.runnable.push_back(warp_base + __builtin_ctz(m));
  }
}

// A lane that exits or waits at __syncthreads can never join a collective that names
// it: an error if one of its warp's lanes waits at such a collective.
void check_no_collective_waits_for(Launch& launch, const Fiber& fiber) {
  const int lane = fiber.linear % kWarp;
  const int warp_base = fiber.linear - lane;
  for (unsigned waiting = launch.warps[warp_base / kWarp].at_collective; waiting != 0; waiting &= waiting - 1) {
    const Fiber& other = launch.fibers[warp_base + __builtin_ctz(waiting)];
    if ((other.mask >> lane) & 1u) {
      fail(launch, describe(launch, other) + " for lane " + std::to_string(lane) + ", but " +
                       describe(launch, fiber));
      return;
    }
  }
}

// Nothing can run and threads remain: say where each group waits.
void report_deadlock(Launch& launch) {
  std::ostringstream text;
  text << "deadlock: no thread can proceed.";
  int shown = 0;
  for (const Fiber& fiber : launch.fibers) {
    if (fiber.state == State::kExited) continue;
    if (shown++ == 8) {
      text << " ...";
      break;
    }
    text << " " << describe(launch, fiber) << ";";
  }
  fail(launch, text.str());
}

void run_block(Launch& launch) {
  launch.runnable.clear();
  launch.exited = 0;
  launch.at_barrier = 0;
  launch.warps.assign((launch.threads + kWarp - 1) / kWarp, Launch::WarpLanes{});
  for (int t = 0; t < launch.threads; ++t) {
    Fiber& fiber = launch.fibers[t];
    fiber.state = State::kRunnable;
    fiber.file = nullptr;
    fiber.line = 0;
    fiber.builtins.block_index = launch.block_index;
    prepare_context(fiber.context, *stack_pool[t], &fiber_main);
    launch.runnable.push_back(t);
  }
  while (launch.error.empty()) {
    if (launch.runnable.empty()) {
      if (launch.exited < launch.threads) report_deadlock(launch);
      return;
    }
    const size_t pick = generator.below(launch.runnable.size());
    const int chosen = launch.runnable[pick];
    launch.runnable[pick] = launch.runnable.back();
    launch.runnable.pop_back();
    Fiber& fiber = launch.fibers[chosen];
    launch.running = &fiber;
    current_thread = &fiber.builtins;
    switch_context(launch.scheduler, fiber.context);
    launch.running = nullptr;
    switch (fiber.state) {
      case State::kYielded:
        fiber.state = State::kRunnable;
        launch.runnable.push_back(chosen);
        break;
      case State::kExited:
        ++launch.exited;
        launch.warps[chosen / kWarp].exited |= 1u << (chosen % kWarp);
        check_no_collective_waits_for(launch, fiber);
        try_release_barrier(launch);
        break;
      case State::kBarrier:
        ++launch.at_barrier;
        launch.warps[chosen / kWarp].at_barrier |= 1u << (chosen % kWarp);
        check_no_collective_waits_for(launch, fiber);
        try_release_barrier(launch);
        break;
      case State::kCollective: try_complete_collective(launch, fiber); break;
      case State::kRunnable: break;
    }
  }
}

void ensure_stacks(int threads) {
  while (static_cast<int>(stack_pool.size()) < threads) {
    stack_pool.push_back(std::make_unique<FiberStack>(kFiberStackBytes));
  }
}

Fiber& running_fiber(const char* what) {
  if (active == nullptr || active->running == nullptr) {
    std::fprintf(stderr, "dflash2 emulator: %s called outside an emulated kernel\n", what);
    std::abort();
  }
  return *active->running;
}

}  // namespace

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int argument, int width, const char* file,
                         int line) {
  Fiber& self = running_fiber(op_name(op));
  self.state = State::kCollective;
  self.op = op;
  self.mask = mask;
  self.value = value;
  self.argument = argument;
  self.width = width;
  self.file = file;
  self.line = line;
  switch_to_scheduler(self);
  return self.result;
}

void block_barrier(const char* file, int line) {
  Fiber& self = running_fiber("__syncthreads");
  self.state = State::kBarrier;
  self.file = file;
  self.line = line;
  switch_to_scheduler(self);
}

void device_fault(const char* what, const char* file, int line) {
  Fiber& self = running_fiber("a device fault");
  std::ostringstream text;
  text << thread_label(*active, self) << ": " << what << " (" << file << ":" << line << ")";
  fail(*active, text.str());
}

void yield_point(const char* file, int line) {
  Fiber& self = running_fiber("an atomic or fence");
  self.state = State::kYielded;
  self.file = file;
  self.line = line;
  switch_to_scheduler(self);
}

bool running_thread(int* linear, uintptr_t* stack_low, uintptr_t* stack_high) {
  if (active == nullptr || active->running == nullptr) return false;
  const int thread = active->running->linear;
  const FiberStack& stack = *stack_pool[thread];
  *linear = thread;
  *stack_low = reinterpret_cast<uintptr_t>(stack.bottom());
  *stack_high = *stack_low + stack.size();
  return true;
}

void set_schedule_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(launch_mutex);
  generator.state = seed;
}

const char* last_launch_error() { return last_error.c_str(); }

namespace {
std::atomic<int> emulated_capability{90};  // major * 10 + minor
}  // namespace

void set_device_capability(int major, int minor) { emulated_capability.store(major * 10 + minor); }

void device_capability(int* major, int* minor) {
  const int capability = emulated_capability.load();
  *major = capability / 10;
  *minor = capability % 10;
}

const char* kernel_name_from_signature(const char* signature, char* buffer, size_t buffer_size) {
  const char* start = std::strstr(signature, "Kernel = ");
  start = start ? start + 9 : signature;
  if (*start == '&') ++start;
  std::string name(start, std::strcspn(start, ";]"));
  for (const char* noise : {"dflash2::{anonymous}::", "dflash2::"}) {
    for (size_t at = name.find(noise); at != std::string::npos; at = name.find(noise)) {
      name.erase(at, std::strlen(noise));
    }
  }
  std::snprintf(buffer, buffer_size, "%s", name.c_str());
  return buffer;
}

cudaError_t run_grid(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared_bytes, KernelBody body,
                     void* closure) {
  std::lock_guard<std::mutex> lock(launch_mutex);
  last_error.clear();
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::ostringstream problem;
  if (threads == 0 || threads > kMaxBlockThreads) {
    problem << "block of " << threads << " threads (CUDA allows 1 to " << kMaxBlockThreads << ")";
  } else if (blocks == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    problem << "grid (" << grid.x << "," << grid.y << "," << grid.z << ") out of CUDA's limits";
  } else if (dynamic_shared_bytes != 0) {
    problem << "dynamic shared memory (" << dynamic_shared_bytes << " bytes) is not emulated";
  }
  if (!problem.str().empty()) {
    last_error = std::string("dflash2 emulator: kernel ") + kernel + ": invalid launch: " + problem.str();
    return cudaErrorInvalidConfiguration;
  }

  start_watchdog();
  ensure_stacks(static_cast<int>(threads));
  Launch launch;
  launch.kernel = kernel;
  launch.body = body;
  launch.closure = closure;
  launch.threads = static_cast<int>(threads);
  launch.fibers.resize(threads);
  for (int t = 0; t < launch.threads; ++t) {
    Fiber& fiber = launch.fibers[t];
    fiber.linear = t;
    fiber.builtins.thread_index =
        uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    fiber.builtins.block_dim = block;
    fiber.builtins.grid_dim = grid;
  }
  traffic::launch_begin(kernel, grid, block, reinterpret_cast<uintptr_t>(launch.fibers.data()),
                        reinterpret_cast<uintptr_t>(launch.fibers.data() + launch.fibers.size()));
  // The blocks' order: a seeded permutation (Fisher-Yates).
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), uint64_t{0});
  for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[generator.below(i)]);

  active = &launch;
  watched_kernel.store(kernel);
  launch_started_ms.store(now_ms());
  for (const uint64_t linear_block : order) {
    launch.block_index = uint3{static_cast<unsigned>(linear_block % grid.x),
                               static_cast<unsigned>((linear_block / grid.x) % grid.y),
                               static_cast<unsigned>(linear_block / (uint64_t{grid.x} * grid.y))};
    run_block(launch);
    traffic::block_end(launch.threads);
    if (!launch.error.empty()) break;
  }
  traffic::launch_end(launch.error.empty());
  launch_started_ms.store(0);
  active = nullptr;
  current_thread = nullptr;
  if (!launch.error.empty()) {
    last_error = launch.error;
    return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace emulation
}  // namespace dflash2

// The CUDA runtime calls the kernel files make, for the emulator: no device exists.
extern "C" {
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attribute, int device) {
  (void)device;
  if (attribute == cudaDevAttrMultiProcessorCount) {
    *value = 132;  // an H100 / H200: the launchers size their grids for it
    return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}
}
