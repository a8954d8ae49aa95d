// Global-memory traffic counters of the SIMT runtime (see traffic.h). Costs one flag
// test per access while not counting; nothing at all outside the emulated build.
#include "emulation/traffic.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define DFLASH2_TRAFFIC_ASAN 1
#else
#define DFLASH2_TRAFFIC_ASAN 0
#endif

namespace dflash2 {
namespace emulation {
namespace traffic {
namespace {

constexpr int kWarp = 32;
constexpr uintptr_t kSector = 32;

bool counting = false;

struct Access {
  uintptr_t pc;
  uintptr_t address;
  uint32_t size;
  bool store;
};

struct Range {
  uintptr_t begin;
  uintptr_t end;
};

// Request totals of one kind (loads or stores), of a launch or of one instruction.
// A request is regular when its lanes' addresses step by one constant in lane order
// (a coalesced access, a broadcast, a strided one): its bytes could have come packed
// into ceil(bytes / 32) sectors, its ideal. An irregular one (a gather through indices)
// needs the sectors it touches.
struct Totals {
  uint64_t requests = 0;
  uint64_t irregular_requests = 0;
  uint64_t sectors = 0;         // 32-byte sectors the requests touch
  uint64_t packed_sectors = 0;  // sum over requests of ceil(unique bytes / 32)
  uint64_t ideal_sectors = 0;   // packed for regular requests, touched for irregular ones
  uint64_t bytes = 0;           // sum over requests of their unique bytes
  uint64_t lane_bytes = 0;      // sum over lanes' accesses (a broadcast counts per lane)

  void add(uint64_t sectors_touched, uint64_t unique_bytes, uint64_t lanes_bytes, bool regular) {
    const uint64_t packed = (unique_bytes + kSector - 1) / kSector;
    ++requests;
    irregular_requests += regular ? 0 : 1;
    sectors += sectors_touched;
    packed_sectors += packed;
    ideal_sectors += regular ? packed : sectors_touched;
    bytes += unique_bytes;
    lane_bytes += lanes_bytes;
  }
};

struct Site {
  bool store = false;
  Totals totals;
};

// Byte masks of the 32-byte sectors a set of accesses touched.
using SectorMasks = std::unordered_map<uintptr_t, uint32_t>;

void mark(SectorMasks& masks, Range range) {
  for (uintptr_t sector = range.begin / kSector; sector * kSector < range.end; ++sector) {
    const uintptr_t low = std::max(range.begin, sector * kSector) - sector * kSector;
    const uintptr_t high = std::min(range.end, (sector + 1) * kSector) - sector * kSector;
    const uint32_t bits = high - low == 32 ? ~0u : ((1u << (high - low)) - 1u) << low;
    masks[sector] |= bits;
  }
}

uint64_t masked_bytes(const SectorMasks& masks) {
  uint64_t total = 0;
  for (const auto& [sector, bits] : masks) total += static_cast<uint64_t>(__builtin_popcount(bits));
  return total;
}

struct LaunchRecord {
  std::string kernel;
  dim3 grid;
  dim3 block;
  bool ok = true;
  Totals loads;
  Totals stores;
  SectorMasks read;
  SectorMasks written;
  uint64_t blocks = 0;
  uint64_t block_unique_bytes_sum = 0;  // each block's own unique bytes, summed over blocks
  uint64_t block_unique_bytes_max = 0;
  std::map<uintptr_t, Site> sites;  // by the instruction's offset in this library
};

std::vector<LaunchRecord> records;
LaunchRecord* current = nullptr;
std::vector<std::vector<Access>> thread_accesses;  // the running block's, per thread
Range os_stack{0, 0};                              // the launching thread's stack
Range runtime_state{0, 0};                         // the runtime's per-thread records

// This library's mapped segments (code, constants, statics: __shared__ memory is a
// function-local static here) and its load address.
struct Image {
  std::vector<Range> segments;
  uintptr_t base = 0;
};

Image find_image() {
  Image image;
  static const int anchor = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        Image& found = *static_cast<Image*>(data);
        const uintptr_t target = reinterpret_cast<uintptr_t>(&anchor);
        std::vector<Range> segments;
        bool mine = false;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& header = info->dlpi_phdr[i];
          if (header.p_type != PT_LOAD) continue;
          const Range range{info->dlpi_addr + header.p_vaddr, info->dlpi_addr + header.p_vaddr + header.p_memsz};
          segments.push_back(range);
          mine = mine || (target >= range.begin && target < range.end);
        }
        if (!mine) return 0;
        found.segments = std::move(segments);
        found.base = info->dlpi_addr;
        return 1;
      },
      &image);
  return image;
}

const Image& image() {
  static const Image found = find_image();
  return found;
}

bool in_static_storage(uintptr_t address) {
  for (const Range& segment : image().segments) {
    if (address >= segment.begin && address < segment.end) return true;
  }
  return false;
}

bool on_fake_stack(uintptr_t address) {
#if DFLASH2_TRAFFIC_ASAN
  void* fake_stack = __asan_get_current_fake_stack();
  return fake_stack != nullptr &&
         __asan_addr_is_in_fake_stack(fake_stack, reinterpret_cast<void*>(address), nullptr, nullptr) != nullptr;
#else
  (void)address;
  return false;
#endif
}

void note(uintptr_t address, size_t size, bool store, uintptr_t pc) {
  int linear = 0;
  uintptr_t stack_low = 0;
  uintptr_t stack_high = 0;
  if (current == nullptr || !running_thread(&linear, &stack_low, &stack_high)) return;
  // A thread's registers and local arrays live on its fiber's stack; the launch's
  // arguments on the launching thread's.
  if (address >= stack_low && address < stack_high) return;
  if (address >= os_stack.begin && address < os_stack.end) return;
  if (address >= runtime_state.begin && address < runtime_state.end) return;
  if (in_static_storage(address) || on_fake_stack(address)) return;
  if (static_cast<size_t>(linear) >= thread_accesses.size()) return;
  thread_accesses[linear].push_back(Access{pc, address, static_cast<uint32_t>(size), store});
}

Range thread_stack() {
  pthread_attr_t attributes;
  if (pthread_getattr_np(pthread_self(), &attributes) != 0) return Range{0, 0};
  void* low = nullptr;
  size_t size = 0;
  pthread_attr_getstack(&attributes, &low, &size);
  pthread_attr_destroy(&attributes);
  return Range{reinterpret_cast<uintptr_t>(low), reinterpret_cast<uintptr_t>(low) + size};
}

// One warp's accesses, grouped into requests: lane l's n-th access from instruction pc
// joins every other lane's n-th access from pc.
void close_warp(int first_thread, int threads, SectorMasks& block_masks) {
  LaunchRecord& record = *current;
  struct Request {
    bool store = false;
    std::vector<Range> ranges;
    uint64_t lane_bytes = 0;
  };
  std::map<std::pair<uintptr_t, uint64_t>, Request> requests;
  for (int thread = first_thread; thread < std::min(threads, first_thread + kWarp); ++thread) {
    std::unordered_map<uintptr_t, uint64_t> executions;
    for (const Access& access : thread_accesses[thread]) {
      Request& request = requests[{access.pc, executions[access.pc]++}];
      request.store = access.store;
      request.ranges.push_back(Range{access.address, access.address + access.size});
      request.lane_bytes += access.size;
    }
  }
  std::vector<uintptr_t> sectors;
  for (auto& [key, request] : requests) {
    // Lanes were added in lane order, one access each.
    bool regular = true;
    for (size_t lane = 2; lane < request.ranges.size() && regular; ++lane) {
      regular = request.ranges[lane].begin - request.ranges[lane - 1].begin ==
                    request.ranges[1].begin - request.ranges[0].begin &&
                request.ranges[lane].end - request.ranges[lane].begin == request.ranges[0].end - request.ranges[0].begin;
    }
    std::sort(request.ranges.begin(), request.ranges.end(),
              [](const Range& a, const Range& b) { return a.begin < b.begin; });
    uint64_t unique = 0;
    uintptr_t covered = 0;
    sectors.clear();
    for (const Range& range : request.ranges) {
      const uintptr_t begin = std::max(range.begin, covered);
      if (range.end > begin) unique += range.end - begin;
      covered = std::max(covered, range.end);
      for (uintptr_t sector = range.begin / kSector; sector * kSector < range.end; ++sector) sectors.push_back(sector);
      mark(request.store ? record.written : record.read, range);
      mark(block_masks, range);
    }
    std::sort(sectors.begin(), sectors.end());
    const uint64_t touched = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
    (request.store ? record.stores : record.loads).add(touched, unique, request.lane_bytes, regular);
    Site& site = record.sites[key.first - image().base];
    site.store = request.store;
    site.totals.add(touched, unique, request.lane_bytes, regular);
  }
}

void append_totals(std::ostringstream& out, const char* name, const Totals& totals) {
  out << "\"" << name << "\":{\"requests\":" << totals.requests
      << ",\"irregular_requests\":" << totals.irregular_requests << ",\"sectors\":" << totals.sectors
      << ",\"packed_sectors\":" << totals.packed_sectors << ",\"ideal_sectors\":" << totals.ideal_sectors
      << ",\"bytes\":" << totals.bytes
      << ",\"lane_bytes\":" << totals.lane_bytes << "}";
}

void append_json_string(std::ostringstream& out, const std::string& text) {
  out << '"';
  for (const char c : text) {
    if (c == '"' || c == '\\') out << '\\';
    out << c;
  }
  out << '"';
}

}  // namespace

void start() {
  records.clear();
  image();
  counting = true;
}

std::string stop() {
  counting = false;
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < records.size(); ++i) {
    const LaunchRecord& record = records[i];
    out << (i ? ",\n" : "") << "{\"kernel\":";
    append_json_string(out, record.kernel);
    out << ",\"grid\":[" << record.grid.x << "," << record.grid.y << "," << record.grid.z << "]"
        << ",\"block\":[" << record.block.x << "," << record.block.y << "," << record.block.z << "]"
        << ",\"ok\":" << (record.ok ? "true" : "false") << ",\"blocks\":" << record.blocks << ",";
    append_totals(out, "loads", record.loads);
    out << ",";
    append_totals(out, "stores", record.stores);
    out << ",\"read_unique_bytes\":" << masked_bytes(record.read) << ",\"read_unique_sectors\":" << record.read.size()
        << ",\"write_unique_bytes\":" << masked_bytes(record.written)
        << ",\"write_unique_sectors\":" << record.written.size()
        << ",\"block_unique_bytes_sum\":" << record.block_unique_bytes_sum
        << ",\"block_unique_bytes_max\":" << record.block_unique_bytes_max << ",\"sites\":[";
    bool first = true;
    for (const auto& [offset, site] : record.sites) {
      out << (first ? "" : ",") << "{\"offset\":" << offset << ",\"store\":" << (site.store ? "true" : "false")
          << ",";
      append_totals(out, "totals", site.totals);
      out << "}";
      first = false;
    }
    out << "]}";
  }
  out << "]";
  records.clear();
  return out.str();
}

void launch_begin(const char* kernel, dim3 grid, dim3 block, uintptr_t state_begin, uintptr_t state_end) {
  if (!counting) return;
  runtime_state = Range{state_begin, state_end};
  records.emplace_back();
  current = &records.back();
  current->kernel = kernel;
  current->grid = grid;
  current->block = block;
  thread_accesses.assign(static_cast<size_t>(block.x) * block.y * block.z, {});
  os_stack = thread_stack();
}

void block_end(int threads) {
  if (current == nullptr) return;
  SectorMasks block_masks;
  for (int first = 0; first < threads; first += kWarp) close_warp(first, threads, block_masks);
  for (std::vector<Access>& accesses : thread_accesses) accesses.clear();
  const uint64_t unique = masked_bytes(block_masks);
  ++current->blocks;
  current->block_unique_bytes_sum += unique;
  current->block_unique_bytes_max = std::max(current->block_unique_bytes_max, unique);
}

void launch_end(bool ok) {
  if (current == nullptr) return;
  current->ok = ok;
  current = nullptr;
  thread_accesses.clear();
}

}  // namespace traffic
}  // namespace emulation
}  // namespace dflash2

// The hooks the kernel files call for every load and store (their sanitizer checks
// compiled as calls). Under AddressSanitizer each hook hands the access on to the
// sanitizer's own check; without it (scripts/asan.py --no-asan compiles the kernels
// with -fsanitize=kernel-address, whose calls need no runtime) the hooks only count.
// Hidden: they bind the kernel files of this library and nothing outside it.
namespace {

using Check = void (*)(uintptr_t);
using CheckN = void (*)(uintptr_t, uintptr_t);

inline void count(uintptr_t address, size_t size, bool store, const void* pc) {
  if (__builtin_expect(dflash2::emulation::traffic::counting, 0)) {
    dflash2::emulation::traffic::note(address, size, store, reinterpret_cast<uintptr_t>(pc));
  }
}

#if DFLASH2_TRAFFIC_ASAN
template <typename F>
F sanitizer_check(const char* name) {
  void* symbol = dlsym(RTLD_DEFAULT, name);
  if (symbol == nullptr) {
    std::fprintf(stderr, "dflash2 emulator: the sanitizer's %s is missing (is libasan preloaded?)\n", name);
    std::abort();
  }
  return reinterpret_cast<F>(symbol);
}
#endif

}  // namespace

#define DFLASH2_TRAFFIC_HOOK(kind, bytes, is_store)                                                            \
  extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_##kind##bytes##_noabort(uintptr_t a) { \
    count(a, bytes, is_store, __builtin_return_address(0));                                                    \
  }                                                                                                            \
  DFLASH2_TRAFFIC_SANITIZED_HOOK(kind, bytes, is_store)

#if DFLASH2_TRAFFIC_ASAN
#define DFLASH2_TRAFFIC_SANITIZED_HOOK(kind, bytes, is_store)                                                   \
  extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_##kind##bytes(uintptr_t a) {          \
    static const Check check = sanitizer_check<Check>("__asan_" #kind #bytes);                                 \
    count(a, bytes, is_store, __builtin_return_address(0));                                                    \
    check(a);                                                                                                  \
  }
#else
#define DFLASH2_TRAFFIC_SANITIZED_HOOK(kind, bytes, is_store)
#endif

DFLASH2_TRAFFIC_HOOK(load, 1, false)
DFLASH2_TRAFFIC_HOOK(load, 2, false)
DFLASH2_TRAFFIC_HOOK(load, 4, false)
DFLASH2_TRAFFIC_HOOK(load, 8, false)
DFLASH2_TRAFFIC_HOOK(load, 16, false)
DFLASH2_TRAFFIC_HOOK(store, 1, true)
DFLASH2_TRAFFIC_HOOK(store, 2, true)
DFLASH2_TRAFFIC_HOOK(store, 4, true)
DFLASH2_TRAFFIC_HOOK(store, 8, true)
DFLASH2_TRAFFIC_HOOK(store, 16, true)

extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_loadN_noabort(uintptr_t a, uintptr_t size) {
  count(a, size, false, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_storeN_noabort(uintptr_t a, uintptr_t size) {
  count(a, size, true, __builtin_return_address(0));
}
#if DFLASH2_TRAFFIC_ASAN
extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_loadN(uintptr_t a, uintptr_t size) {
  static const CheckN check = sanitizer_check<CheckN>("__asan_loadN");
  count(a, size, false, __builtin_return_address(0));
  check(a, size);
}
extern "C" __attribute__((visibility("hidden"), noinline)) void __asan_storeN(uintptr_t a, uintptr_t size) {
  static const CheckN check = sanitizer_check<CheckN>("__asan_storeN");
  count(a, size, true, __builtin_return_address(0));
  check(a, size);
}
#else
// -fsanitize=kernel-address also calls this before a noreturn call; nothing to do
// without the sanitizer's runtime.
extern "C" __attribute__((visibility("hidden"))) void __asan_handle_no_return() {}
#endif
