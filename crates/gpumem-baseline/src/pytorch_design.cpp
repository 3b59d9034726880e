// PyTorch's CUDA caching allocator design, written for gpumem's benchmarks from the
// allocator's specification (../shared/reference): the same decisions as gpumem's core on a
// simulated device, with PyTorch's data structures and locking, so that the two can be timed
// side by side on the same allocations.
//
// What it keeps of the design, because it costs time on every call:
// - per pool a std::set<Block*> ordered by (stream, size, address) (PyTorch 2.11 and before)
//   or (stream, size, segment counter, address) (2.13 and later) through a function-pointer
//   comparator; blocks allocated on the heap, linked to their neighbours in the segment, each
//   carrying its segment's counter;
// - an open-addressing hash map from address to block behind 67 sharded mutexes (the
//   allocator's front end), and an open-addressing set of the active blocks (its flat hash
//   tables);
// - a recursive mutex taken by every malloc and free;
// - nine stat arrays (current, peak, allocated, freed for all, small and large), updated on
//   every malloc, free and segment allocation.
//
// Left out, because the benchmark's recordings never reach it: stream-ordered reuse (events),
// expandable segments, garbage collection, and the release-and-retry path on out-of-memory
// (malloc returns 0 instead). The device hands out 2 MiB-aligned addresses from the same base
// as gpumem's simulated GPU, first fit, so both allocators place segments alike.

#include <array>
#include <cstdint>
#include <mutex>
#include <set>
#include <vector>

namespace {

constexpr uint64_t kMinBlockSize = 512;
constexpr uint64_t kSmallSize = 1ull << 20;
constexpr uint64_t kSmallBuffer = 2ull << 20;
constexpr uint64_t kLargeBuffer = 20ull << 20;
constexpr uint64_t kMinLargeAlloc = 10ull << 20;
constexpr uint64_t kRoundLarge = 2ull << 20;
constexpr uint64_t kAlignment = 2ull << 20;
constexpr uint64_t kBaseAddress = 0x7f0000000000ull;
constexpr uint64_t kMaxSplitSize = UINT64_MAX;
constexpr size_t kShards = 67;

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};

void update_stat(Stat &stat, int64_t amount) {
  stat.current += amount;
  if (stat.current > stat.peak) stat.peak = stat.current;
  if (amount > 0) stat.allocated += amount;
  if (amount < 0) stat.freed += -amount;
}

// Indexed by 0 (all), 1 (small pool), 2 (large pool).
using StatArray = std::array<Stat, 3>;

struct DeviceStats {
  StatArray allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
      active_bytes, inactive_split_bytes, requested_bytes;
  int64_t num_device_alloc = 0;
  int64_t num_device_free = 0;
  // No retry chain and no memory fraction here: a request the device cannot hold is an OOM,
  // and none is ever refused at a fraction (throw_on_cudamalloc_oom).
  int64_t num_ooms = 0;
  int64_t num_oom_rejections = 0;
  int64_t oversize_allocations = 0;
};

struct Block;
using Comparison = bool (*)(const Block *, const Block *);

struct BlockPool {
  explicit BlockPool(Comparison compare, bool small) : blocks(compare), is_small(small) {}
  std::set<Block *, Comparison> blocks;
  bool is_small;
};

struct Block {
  Block(uint64_t stream, uint64_t size, BlockPool *pool, uint64_t ptr)
      : stream(stream), size(size), pool(pool), ptr(ptr) {}
  // A search key.
  Block(uint64_t stream, uint64_t size) : stream(stream), size(size), pool(nullptr), ptr(0) {}
  bool is_split() const { return prev != nullptr || next != nullptr; }

  uint64_t stream;
  uint64_t size;
  uint64_t requested_size = 0;
  BlockPool *pool;
  uint64_t ptr;
  // The segment's counter (taken when the segment was obtained, inherited by its pieces).
  int32_t counter = 0;
  bool allocated = false;
  Block *prev = nullptr;
  Block *next = nullptr;
  int event_count = 0;
};

bool by_stream_size_address(const Block *a, const Block *b) {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->ptr < b->ptr;
}

// PyTorch 2.13+: the older segment first among equal sizes. A search key's counter is -1.
bool by_stream_size_counter_address(const Block *a, const Block *b) {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  if (a->counter != b->counter) return a->counter < b->counter;
  return a->ptr < b->ptr;
}

uint64_t fibonacci(uint64_t key) { return key * 11400714819323198485ull; }

// Open addressing with linear probing and backward-shift deletion, at most half full: the
// shape of the flat hash tables the allocator keeps. Key 0 marks an empty slot (no block
// lives at address 0).
template <typename Value> class FlatMap {
 public:
  FlatMap() { resize(64); }

  void insert(uint64_t key, Value value) {
    if ((count_ + 1) * 2 > keys_.size()) resize(keys_.size() * 2);
    size_t i = slot(key);
    while (keys_[i] != 0 && keys_[i] != key) i = (i + 1) & mask_;
    if (keys_[i] == 0) ++count_;
    keys_[i] = key;
    values_[i] = value;
  }

  // Removes `key`; its value, or a default one when absent (0 is never a key).
  Value take(uint64_t key) {
    if (key == 0) return Value();
    size_t i = slot(key);
    while (keys_[i] != key) {
      if (keys_[i] == 0) return Value();
      i = (i + 1) & mask_;
    }
    Value value = values_[i];
    // Backward shift: later entries of the run move up so that no probe stops early.
    size_t hole = i;
    size_t j = (i + 1) & mask_;
    while (keys_[j] != 0) {
      size_t home = slot(keys_[j]);
      bool movable = ((j - home) & mask_) >= ((j - hole) & mask_);
      if (movable) {
        keys_[hole] = keys_[j];
        values_[hole] = values_[j];
        hole = j;
      }
      j = (j + 1) & mask_;
    }
    keys_[hole] = 0;
    values_[hole] = Value();
    --count_;
    return value;
  }

 private:
  size_t slot(uint64_t key) const { return fibonacci(key) >> shift_; }

  void resize(size_t capacity) {
    std::vector<uint64_t> keys(capacity, 0);
    std::vector<Value> values(capacity);
    keys.swap(keys_);
    values.swap(values_);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    count_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != 0) insert(keys[i], values[i]);
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<Value> values_;
  size_t mask_ = 0;
  unsigned shift_ = 0;
  size_t count_ = 0;
};

class DeviceCachingAllocator {
 public:
  DeviceCachingAllocator(uint64_t capacity, bool counter_order)
      : capacity_(capacity),
        small_blocks_(counter_order ? by_stream_size_counter_address : by_stream_size_address,
                      true),
        large_blocks_(counter_order ? by_stream_size_counter_address : by_stream_size_address,
                      false) {}

  ~DeviceCachingAllocator() {
    for (BlockPool *pool : {&small_blocks_, &large_blocks_}) {
      for (Block *b : pool->blocks) delete b;
    }
  }

  Block *malloc(uint64_t orig_size, uint64_t stream) {
    std::unique_lock<std::recursive_mutex> lock(mutex_);
    // More than the device can never be served (and would overflow the rounding).
    if (orig_size == 0) return nullptr;
    if (orig_size > capacity_) {
      ++stats_.num_ooms;
      return nullptr;
    }
    const uint64_t size = round_size(orig_size);
    BlockPool &pool = size <= kSmallSize ? small_blocks_ : large_blocks_;
    Block key(stream, size);
    key.counter = -1;
    Block *block = get_free_block(pool, key);
    if (block == nullptr) {
      block = alloc_block(pool, stream, allocation_size(size));
      if (block == nullptr) {
        ++stats_.num_ooms;
        return nullptr;
      }
    }
    return alloc_found_block(block, size, orig_size);
  }

  void free(Block *block) {
    std::unique_lock<std::recursive_mutex> lock(mutex_);
    block->allocated = false;
    const int pool = block->pool->is_small ? 1 : 2;
    for (int s : {0, pool}) {
      update_stat(stats_.allocation[s], -1);
      update_stat(stats_.allocated_bytes[s], -static_cast<int64_t>(block->size));
    }
    if (block->size >= kMaxSplitSize) --stats_.oversize_allocations;
    free_block(block);
  }

  const DeviceStats &stats() const { return stats_; }

 private:
  static uint64_t round_size(uint64_t size) {
    if (size < kMinBlockSize) return kMinBlockSize;
    return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
  }

  static uint64_t allocation_size(uint64_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
  }

  Block *get_free_block(BlockPool &pool, Block &key) {
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != key.stream) return nullptr;
    if (key.size < kMaxSplitSize && (*it)->size >= kMaxSplitSize) return nullptr;
    if (key.size >= kMaxSplitSize && (*it)->size >= key.size + kLargeBuffer) return nullptr;
    Block *block = *it;
    pool.blocks.erase(it);
    return block;
  }

  Block *alloc_block(BlockPool &pool, uint64_t stream, uint64_t size) {
    // The simulated driver: 2 MiB-aligned addresses in order (segments are never released
    // here), within the device's capacity.
    const uint64_t reserved = static_cast<uint64_t>(stats_.reserved_bytes[0].current);
    if (size > capacity_ - reserved) return nullptr;
    const uint64_t ptr = next_address_;
    next_address_ += (size + kAlignment - 1) / kAlignment * kAlignment;
    const int p = pool.is_small ? 1 : 2;
    for (int s : {0, p}) {
      update_stat(stats_.segment[s], 1);
      update_stat(stats_.reserved_bytes[s], static_cast<int64_t>(size));
    }
    ++stats_.num_device_alloc;
    Block *segment = new Block(stream, size, &pool, ptr);
    segment->counter = next_counter_++;
    return segment;
  }

  static bool should_split(const Block *block, uint64_t size) {
    const uint64_t remaining = block->size - size;
    if (block->pool->is_small) return remaining >= kMinBlockSize;
    return size < kMaxSplitSize && remaining > kSmallSize;
  }

  Block *alloc_found_block(Block *block, uint64_t size, uint64_t orig_size) {
    BlockPool *pool = block->pool;
    const bool already_split = block->is_split();
    int64_t split_blocks = 0;
    int64_t split_bytes = 0;
    if (should_split(block, size)) {
      Block *remaining = block;
      block = new Block(remaining->stream, size, pool, remaining->ptr);
      block->counter = remaining->counter;
      block->prev = remaining->prev;
      if (block->prev != nullptr) block->prev->next = block;
      block->next = remaining;
      remaining->prev = block;
      remaining->ptr += size;
      remaining->size -= size;
      pool->blocks.insert(remaining);
      if (already_split) {
        split_bytes -= static_cast<int64_t>(block->size);
      } else {
        split_bytes += static_cast<int64_t>(remaining->size);
        split_blocks += 1;
      }
    } else if (already_split) {
      split_bytes -= static_cast<int64_t>(block->size);
      split_blocks -= 1;
    }
    block->allocated = true;
    block->requested_size = orig_size;
    active_blocks_.insert(reinterpret_cast<uintptr_t>(block), block);
    const int p = pool->is_small ? 1 : 2;
    for (int s : {0, p}) {
      update_stat(stats_.inactive_split[s], split_blocks);
      update_stat(stats_.inactive_split_bytes[s], split_bytes);
      update_stat(stats_.allocation[s], 1);
      update_stat(stats_.allocated_bytes[s], static_cast<int64_t>(block->size));
      update_stat(stats_.active[s], 1);
      update_stat(stats_.active_bytes[s], static_cast<int64_t>(block->size));
      update_stat(stats_.requested_bytes[s], static_cast<int64_t>(orig_size));
    }
    if (block->size >= kMaxSplitSize) ++stats_.oversize_allocations;
    return block;
  }

  void free_block(Block *block) {
    const uint64_t original_size = block->size;
    const uint64_t requested = block->requested_size;
    BlockPool *pool = block->pool;
    int64_t split_blocks = 0;
    int64_t split_bytes = 0;
    for (Block *candidate : {block->prev, block->next}) {
      const uint64_t subsumed = try_merge_blocks(block, candidate, pool);
      if (subsumed > 0) {
        split_blocks -= 1;
        split_bytes -= static_cast<int64_t>(subsumed);
      }
    }
    active_blocks_.take(reinterpret_cast<uintptr_t>(block));
    pool->blocks.insert(block);
    if (block->is_split()) {
      split_blocks += 1;
      split_bytes += static_cast<int64_t>(block->size);
    }
    const int p = pool->is_small ? 1 : 2;
    for (int s : {0, p}) {
      update_stat(stats_.inactive_split[s], split_blocks);
      update_stat(stats_.inactive_split_bytes[s], split_bytes);
      update_stat(stats_.active[s], -1);
      update_stat(stats_.active_bytes[s], -static_cast<int64_t>(original_size));
      update_stat(stats_.requested_bytes[s], -static_cast<int64_t>(requested));
    }
  }

  static uint64_t try_merge_blocks(Block *dst, Block *src, BlockPool *pool) {
    if (src == nullptr || src->allocated || src->event_count > 0) return 0;
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev != nullptr) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next != nullptr) dst->next->prev = dst;
    }
    const uint64_t subsumed = src->size;
    dst->size += subsumed;
    pool->blocks.erase(src);
    delete src;
    return subsumed;
  }

  std::recursive_mutex mutex_;
  uint64_t capacity_;
  uint64_t next_address_ = kBaseAddress;
  int32_t next_counter_ = 0;
  BlockPool small_blocks_;
  BlockPool large_blocks_;
  FlatMap<Block *> active_blocks_;
  DeviceStats stats_;
};

// The front end: the device allocator, and the map from address to block in shards, each
// behind its own mutex.
struct NativeAllocator {
  NativeAllocator(uint64_t capacity, bool counter_order) : device(capacity, counter_order) {}

  size_t shard(uint64_t ptr) const { return (ptr >> 9) % kShards; }

  uint64_t malloc(uint64_t size, uint64_t stream) {
    Block *block = device.malloc(size, stream);
    if (block == nullptr) return 0;
    const size_t s = shard(block->ptr);
    std::lock_guard<std::mutex> lock(mutexes[s]);
    blocks[s].insert(block->ptr, block);
    return block->ptr;
  }

  bool free(uint64_t ptr) {
    Block *block;
    {
      const size_t s = shard(ptr);
      std::lock_guard<std::mutex> lock(mutexes[s]);
      block = blocks[s].take(ptr);
    }
    if (block == nullptr) return false;
    device.free(block);
    return true;
  }

  DeviceCachingAllocator device;
  std::array<std::mutex, kShards> mutexes;
  std::array<FlatMap<Block *>, kShards> blocks;
};

void put(const StatArray &array, int64_t *&out) {
  for (const Stat &stat : array) {
    *out++ = stat.current;
    *out++ = stat.peak;
    *out++ = stat.allocated;
    *out++ = stat.freed;
  }
}

}  // namespace

extern "C" {

void *gpumem_baseline_new(uint64_t capacity, int counter_order) {
  return new NativeAllocator(capacity, counter_order != 0);
}

void gpumem_baseline_delete(void *allocator) { delete static_cast<NativeAllocator *>(allocator); }

uint64_t gpumem_baseline_malloc(void *allocator, uint64_t size, uint64_t stream) {
  return static_cast<NativeAllocator *>(allocator)->malloc(size, stream);
}

int gpumem_baseline_free(void *allocator, uint64_t ptr) {
  return static_cast<NativeAllocator *>(allocator)->free(ptr) ? 0 : -1;
}

// 9 stat arrays × (all, small, large) × (current, peak, allocated, freed), in the order
// allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
// inactive_split_bytes, requested_bytes; then num_device_alloc, num_device_free, num_ooms,
// num_oom_rejections.
void gpumem_baseline_stats(void *allocator, int64_t *out) {
  const DeviceStats &s = static_cast<NativeAllocator *>(allocator)->device.stats();
  for (const StatArray *array :
       {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
        &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    put(*array, out);
  }
  *out++ = s.num_device_alloc;
  *out++ = s.num_device_free;
  *out++ = s.num_ooms;
  *out++ = s.num_oom_rejections;
}

}  // extern "C"
