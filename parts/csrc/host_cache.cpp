// A CPU allocator that keeps freed large blocks for the next request of the same size.
//
// Each freed block of at least min_bytes would otherwise go back to the system (the store fixes
// glibc's mmap threshold) and its next use would fault in fresh zeroed pages: a training step
// allocates the same sizes (weight grads, activations, shards read from disk) again and again.
// Kept blocks are bounded twice: by the capacity, and by the high-water mark of the large bytes
// in use at once over this period and the last (a period is a training step: new_period), so
// that in use + kept stays within what the process recently held at its peak.
// Blocks below min_bytes, and every block allocated before install, belong to the allocator that
// was installed before (their deleters are their own).
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <pthread.h>

#include <algorithm>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Block = std::pair<void*, size_t>;  // address, bytes

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < min_bytes_) return base_->allocate(nbytes);
    void* ptr = take(nbytes);
    if (ptr == nullptr) ptr = c10::alloc_cpu(nbytes);
    std::lock_guard<std::mutex> guard(mutex_);
    sizes_[ptr] = nbytes;
    return {ptr, ptr, &HostCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Set the capacity (a lower one drops kept blocks); the first call makes this torch's CPU allocator.
  bool install(int64_t capacity, int64_t min_bytes) {
    std::vector<Block> dropped;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (base_ == nullptr) {
        base_ = c10::GetCPUAllocator();
        min_bytes_ = static_cast<size_t>(std::max<int64_t>(min_bytes, 1));
        pthread_atfork(&HostCache::before_fork, &HostCache::after_fork, &HostCache::after_fork);
      }
      capacity_ = static_cast<size_t>(std::max<int64_t>(capacity, 0));
      evict_to(capacity_, dropped);
    }
    for (const Block& block : dropped) c10::free_cpu(block.first);
    if (c10::GetCPUAllocator() != this) c10::SetCPUAllocator(this, /*priority=*/1);
    return c10::GetCPUAllocator() == this;
  }

  // Start a period: a peak older than the last period no longer lets the cache keep blocks.
  void new_period() {
    std::vector<Block> dropped;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      last_peak_ = high_water_;
      high_water_ = used_bytes_;
      evict_to(peak() - used_bytes_, dropped);
    }
    for (const Block& block : dropped) c10::free_cpu(block.first);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {static_cast<int64_t>(hits_), static_cast<int64_t>(misses_), static_cast<int64_t>(kept_bytes_),
            static_cast<int64_t>(used_bytes_), static_cast<int64_t>(peak()),
            static_cast<int64_t>(capacity_), c10::GetCPUAllocator() == this ? 1 : 0};
  }

  static HostCache& instance() {
    static HostCache* cache = new HostCache();  // never destroyed: blocks may be freed at exit
    return *cache;
  }

 private:
  // A kept block of exactly nbytes (the most recently freed), or nullptr after making room.
  void* take(size_t nbytes) {
    std::vector<Block> dropped;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      used_bytes_ += nbytes;
      auto found = by_size_.find(nbytes);
      if (found != by_size_.end() && !found->second.empty()) {
        ptr = found->second.back()->first;
        order_.erase(found->second.back());
        found->second.pop_back();
        kept_bytes_ -= nbytes;
        ++hits_;
      } else {
        ++misses_;
        high_water_ = std::max(high_water_, used_bytes_);
        evict_to(peak() - used_bytes_, dropped);
      }
    }
    for (const Block& block : dropped) c10::free_cpu(block.first);
    return ptr;
  }

  static void release(void* ptr) {
    HostCache& cache = instance();
    std::vector<Block> dropped;
    if (!cache.keep_or_drop(ptr, dropped)) {
      cache.base_->raw_deleter()(ptr);  // a small block raw_allocate'd by the base allocator
      return;
    }
    for (const Block& block : dropped) c10::free_cpu(block.first);
  }

  // False if ptr is not ours; else keep it (making room) or add it to dropped.
  bool keep_or_drop(void* ptr, std::vector<Block>& dropped) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = sizes_.find(ptr);
    if (found == sizes_.end()) return false;
    const size_t nbytes = found->second;
    sizes_.erase(found);
    used_bytes_ -= nbytes;
    const size_t room = std::min(capacity_, peak() - used_bytes_);
    if (nbytes > room) {
      dropped.emplace_back(ptr, nbytes);
      return true;
    }
    evict_to(room - nbytes, dropped);
    order_.emplace_back(ptr, nbytes);
    by_size_[nbytes].push_back(std::prev(order_.end()));
    kept_bytes_ += nbytes;
    return true;
  }

  // Drop the oldest kept blocks until at most limit bytes are kept (mutex_ held).
  void evict_to(size_t limit, std::vector<Block>& dropped) {
    while (kept_bytes_ > limit) {
      const Block oldest = order_.front();
      auto& same = by_size_[oldest.second];
      same.erase(same.begin());  // a size's oldest block is the first of its list
      order_.pop_front();
      kept_bytes_ -= oldest.second;
      dropped.push_back(oldest);
    }
  }

  size_t peak() const { return std::max(last_peak_, high_water_); }  // mutex_ held

  static void before_fork() { instance().mutex_.lock(); }
  static void after_fork() { instance().mutex_.unlock(); }

  std::mutex mutex_;
  c10::Allocator* base_ = nullptr;
  size_t min_bytes_ = 1 << 20;
  size_t capacity_ = 0;
  size_t kept_bytes_ = 0, used_bytes_ = 0, high_water_ = 0, last_peak_ = 0;
  size_t hits_ = 0, misses_ = 0;
  std::list<Block> order_;  // kept blocks, oldest first
  std::unordered_map<size_t, std::vector<std::list<Block>::iterator>> by_size_;
  std::unordered_map<void*, size_t> sizes_;  // blocks in use that this cache handed out
};

bool host_cache_install(int64_t capacity, int64_t min_bytes) {
  return HostCache::instance().install(capacity, min_bytes);
}

void host_cache_new_period() { HostCache::instance().new_period(); }

std::vector<int64_t> host_cache_stats() { return HostCache::instance().stats(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(parts, m) {
  m.def("host_cache_install(int capacity, int min_bytes) -> bool", &host_cache_install);
  m.def("host_cache_new_period() -> ()", &host_cache_new_period);
  m.def("host_cache_stats() -> int[]", &host_cache_stats);
}
