#include "cpu_result_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define DFLASH2_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DFLASH2_ASAN 1
#endif
#endif

#if defined(__unix__)
#include <pthread.h>
#endif

#if defined(DFLASH2_ASAN)
#include <sanitizer/asan_interface.h>
#elif defined(__linux__)
#define DFLASH2_MMAP_BLOCKS 1
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace dflash2::cpu_result_cache {
namespace {

constexpr size_t kWholeHugePagesFrom = size_t(8) << 20;
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kDefaultLimitMiB = 1024;
constexpr const char* kLimitVariable = "DFLASH2_CPU_CACHE_MB";

struct Block {
  void* data;
  size_t length;  // what was mapped (or allocated), and the key a request must match
};

// Never destroyed: a tensor can outlive static destruction (a Python global freed at
// exit) and still hand its block back.
struct Cache {
  std::mutex mutex;
  std::vector<Block*> kept;  // least recently freed first
  size_t kept_bytes = 0;
};

Cache* the_cache = nullptr;

// A fork while another thread held the lock would leave the child's copy locked.
void unlock_in_child() { new (&the_cache->mutex) std::mutex; }

Cache& cache() {
  static Cache* instance = [] {
    the_cache = new Cache;
#if defined(__unix__)
    pthread_atfork(nullptr, nullptr, unlock_in_child);
#endif
    return the_cache;
  }();
  return *instance;
}

// The limit in bytes, or -1 when the variable is not a non-negative integer.
int64_t parse_limit_bytes() {
  const char* text = std::getenv(kLimitVariable);
  if (text == nullptr || *text == '\0') return int64_t(kDefaultLimitMiB) << 20;
  char* end = nullptr;
  errno = 0;
  const unsigned long long mib = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || *text == '-' || mib > (uint64_t(1) << 40)) return -1;
  return int64_t(mib) << 20;
}

// Whole huge pages from 8 MiB (at most a quarter more than asked for; requests of
// nearby sizes then share blocks), whole pages below (a block's 2 MB-aligned interior
// is still huge pages; its tail is small pages).
size_t block_length(size_t bytes) {
#if defined(DFLASH2_MMAP_BLOCKS)
  static const size_t page = [] {
    const long size = sysconf(_SC_PAGESIZE);
    return size > 0 ? size_t(size) : size_t(4096);
  }();
  const size_t unit = bytes >= kWholeHugePagesFrom ? kHugePage : page;
  return (bytes + unit - 1) / unit * unit;
#else
  return bytes;
#endif
}

// 2 MB-aligned, so that every 2 MB of it can be one huge page. nullptr when the system
// refuses.
void* map_block(size_t length) {
#if defined(DFLASH2_MMAP_BLOCKS)
  void* raw = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePage - 1) & ~uintptr_t(kHugePage - 1);
  if (aligned > begin) munmap(raw, aligned - begin);
  const uintptr_t tail = aligned + length;
  const uintptr_t end = begin + length + kHugePage;
  if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
#if defined(MADV_HUGEPAGE)
  (void)madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);
#endif
  return reinterpret_cast<void*>(aligned);
#else
  try {
    return c10::alloc_cpu(length);
  } catch (const c10::Error&) {
    return nullptr;
  }
#endif
}

void unmap_block(Block* block) {
#if defined(DFLASH2_MMAP_BLOCKS)
  munmap(block->data, block->length);
#else
#if defined(DFLASH2_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(block->data, block->length);
#endif
  c10::free_cpu(block->data);
#endif
  delete block;
}

Block* take_kept(size_t length) {
  Cache& state = cache();
  std::lock_guard<std::mutex> lock(state.mutex);
  for (auto it = state.kept.rbegin(); it != state.kept.rend(); ++it) {
    if ((*it)->length != length) continue;
    Block* block = *it;
    state.kept.erase(std::next(it).base());
    state.kept_bytes -= length;
#if defined(DFLASH2_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(block->data, block->length);
#endif
    return block;
  }
  return nullptr;
}

// The tensor's deleter: runs wherever its storage dies, so it neither throws nor unmaps
// under the lock.
void give_back(void* context) noexcept {
  Block* block = static_cast<Block*>(context);
  const int64_t limit = parse_limit_bytes();
  std::vector<Block*> evicted;
  if (limit <= 0 || block->length > size_t(limit)) {
    evicted.push_back(block);
  } else {
#if defined(DFLASH2_ASAN)
    ASAN_POISON_MEMORY_REGION(block->data, block->length);
#endif
    Cache& state = cache();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.kept.push_back(block);
    state.kept_bytes += block->length;
    size_t first_kept = 0;
    while (state.kept_bytes > size_t(limit)) {
      state.kept_bytes -= state.kept[first_kept]->length;
      evicted.push_back(state.kept[first_kept++]);
    }
    state.kept.erase(state.kept.begin(), state.kept.begin() + first_kept);
  }
  for (Block* old : evicted) unmap_block(old);
}

}  // namespace

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_CHECK(options.device().is_cpu(), "dflash2: the CPU result cache holds CPU tensors only");
  const uint64_t itemsize = options.dtype().itemsize();
  uint64_t elements = 0;
  const bool valid = std::none_of(sizes.begin(), sizes.end(), [](int64_t size) { return size < 0; }) &&
                     !c10::safe_multiplies_u64(sizes, &elements) && elements <= SIZE_MAX / itemsize;
  if (!valid || elements * itemsize < kMinBytes) return at::empty(sizes, options);
  TORCH_CHECK(parse_limit_bytes() >= 0, kLimitVariable, " must be a non-negative whole number of MiB, got '",
              std::getenv(kLimitVariable), "'");
  const size_t bytes = elements * itemsize;
  const size_t length = block_length(bytes);
  Block* block = take_kept(length);
  if (block == nullptr) {
    void* data = map_block(length);
    if (data == nullptr) {
      // Kept blocks of other sizes must never be why a request fails.
      release_all();
      data = map_block(length);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr, "dflash2: could not allocate ", bytes,
                     " bytes for a CPU result");
    block = new Block{data, length};
  }
  return at::for_blob(block->data, sizes)
      .context(block, &give_back)
      .options(options)
      .allocator(c10::GetCPUAllocator())
      .resizeable_storage()
      .make_tensor();
}

at::Tensor scratch(int64_t bytes) { return empty({bytes}, at::TensorOptions().dtype(at::kByte)); }

size_t retained_bytes() {
  Cache& state = cache();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.kept_bytes;
}

void release_all() {
  std::vector<Block*> evicted;
  {
    Cache& state = cache();
    std::lock_guard<std::mutex> lock(state.mutex);
    evicted.swap(state.kept);
    state.kept_bytes = 0;
  }
  for (Block* block : evicted) unmap_block(block);
}

}  // namespace dflash2::cpu_result_cache
