// Native flatten / unflatten / copy_in / copy_out for parts.csrc, registered as torch.ops.parts.*.
// Every copying op is reduced to a list of byte segments (src, dst, nbytes) that
// at::parallel_for splits by bytes, so many tiny tensors and a few huge ones both balance.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

struct Segment {
  const char* src;
  char* dst;
  int64_t nbytes;
};

constexpr int64_t kGrainBytes = 1 << 20;  // 1 MiB per task: below this threads cost more than they save

// Copy all segments; work is split by byte ranges over the concatenation of the segments.
void run_segments(const std::vector<Segment>& segs) {
  std::vector<int64_t> starts(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) starts[i + 1] = starts[i] + segs[i].nbytes;
  const int64_t total = starts.back();
  if (total == 0) return;
  at::parallel_for(0, total, kGrainBytes, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(starts.begin(), starts.end(), begin) - 1;
    for (size_t i = it - starts.begin(); i < segs.size() && starts[i] < end; ++i) {
      const int64_t lo = std::max(begin, starts[i]) - starts[i];
      const int64_t hi = std::min(end, starts[i + 1]) - starts[i];
      if (hi > lo) std::memcpy(segs[i].dst + lo, segs[i].src + lo, hi - lo);
    }
  });
}

const char* bytes_of(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }
char* mutable_bytes_of(const at::Tensor& t) { return static_cast<char*>(t.mutable_data_ptr()); }

at::Tensor flatten_cpu(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "parts::flatten: tensors is empty");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(),
                "parts::flatten: tensors[", i, "] has dtype ", tensors[i].scalar_type(),
                ", expected ", tensors[0].scalar_type());
    total += tensors[i].numel();
  }
  at::Tensor out = at::empty({total}, tensors[0].options());
  std::vector<at::Tensor> keep;  // contiguous copies of strided inputs stay alive until copied
  std::vector<Segment> segs;
  const int64_t itemsize = out.element_size();
  char* dst = mutable_bytes_of(out);
  for (const auto& t : tensors) {
    keep.push_back(t.contiguous());
    segs.push_back({bytes_of(keep.back()), dst, t.numel() * itemsize});
    dst += t.numel() * itemsize;
  }
  run_segments(segs);
  return out;
}

void copy_in_cpu(at::TensorList srcs, const at::Tensor& dst, at::IntArrayRef offsets) {
  TORCH_CHECK(srcs.size() == offsets.size(), "parts::copy_in: len(srcs) != len(offsets)");
  TORCH_CHECK(dst.is_contiguous(), "parts::copy_in: dst must be contiguous");
  const int64_t itemsize = dst.element_size();
  std::vector<at::Tensor> keep;
  std::vector<Segment> segs;
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK(srcs[i].scalar_type() == dst.scalar_type(), "parts::copy_in: srcs[", i, "] dtype mismatch");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + srcs[i].numel() <= dst.numel(),
                "parts::copy_in: srcs[", i, "] does not fit in dst at offset ", offsets[i]);
    keep.push_back(srcs[i].contiguous());
    segs.push_back({bytes_of(keep.back()), mutable_bytes_of(dst) + offsets[i] * itemsize,
                    srcs[i].numel() * itemsize});
  }
  run_segments(segs);
}

void copy_out_cpu(const at::Tensor& src, at::TensorList dsts, int64_t world_size,
                  at::IntArrayRef offsets, at::IntArrayRef shard_numels) {
  TORCH_CHECK(world_size >= 1 && src.numel() % world_size == 0,
              "parts::copy_out: src numel not divisible by world_size");
  TORCH_CHECK(src.is_contiguous(), "parts::copy_out: src must be contiguous");
  TORCH_CHECK(dsts.size() == offsets.size() && dsts.size() == shard_numels.size(),
              "parts::copy_out: len(dsts), len(offsets), len(shard_numels) must match");
  const int64_t chunk = src.numel() / world_size, itemsize = src.element_size();
  std::vector<Segment> segs;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const int64_t off = offsets[i], n = shard_numels[i], m = dsts[i].numel();
    TORCH_CHECK(dsts[i].scalar_type() == src.scalar_type(), "parts::copy_out: dsts[", i, "] dtype mismatch");
    TORCH_CHECK(dsts[i].is_contiguous(), "parts::copy_out: dsts[", i, "] must be contiguous");
    TORCH_CHECK(off >= 0 && n >= 0 && off + n <= chunk, "parts::copy_out: shard ", i, " outside the chunk");
    TORCH_CHECK(m <= world_size * n, "parts::copy_out: dsts[", i, "] larger than its shards");
    for (int64_t r = 0; r * n < m; ++r) {
      segs.push_back({bytes_of(src) + (r * chunk + off) * itemsize,
                      mutable_bytes_of(dsts[i]) + r * n * itemsize, std::min(n, m - r * n) * itemsize});
    }
  }
  run_segments(segs);
}

// Views into flat; composite, so autograd, meta and fake tensors work through narrow/view.
std::vector<at::Tensor> unflatten_composite(const at::Tensor& flat, at::IntArrayRef numels,
                                            at::IntArrayRef sizes_flat) {
  std::vector<at::Tensor> out;
  out.reserve(numels.size());
  int64_t offset = 0;
  size_t dim_pos = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    // numels[i] < 0 would be invalid; sizes_flat holds (ndim, d0, d1, ...) per tensor.
    const int64_t ndim = sizes_flat[dim_pos];
    at::IntArrayRef shape(sizes_flat.data() + dim_pos + 1, ndim);
    dim_pos += 1 + ndim;
    out.push_back(flat.narrow(0, offset, numels[i]).view(shape));
    offset += numels[i];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(parts, m) {
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("copy_in(Tensor[] srcs, Tensor(a!) dst, int[] offsets) -> ()");
  m.def("copy_out(Tensor src, Tensor(a!)[] dsts, int world_size, int[] offsets, int[] shard_numels) -> ()");
  m.def("unflatten(Tensor(a) flat, int[] numels, int[] sizes) -> Tensor(a)[]");
}

TORCH_LIBRARY_IMPL(parts, CPU, m) {
  m.impl("flatten", &flatten_cpu);
  m.impl("copy_in", &copy_in_cpu);
  m.impl("copy_out", &copy_out_cpu);
}

TORCH_LIBRARY_IMPL(parts, CompositeImplicitAutograd, m) {
  m.impl("unflatten", &unflatten_composite);
}
