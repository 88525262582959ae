// Writing a block of a weight's rows into its packed panels (moeshard/kernels/packed.py): the load
// path's one transposition. torch's strided copy moves a bf16 pair at a time through its generic
// iterator (~0.5-1.5 GB/s on one core); this moves them in cache-sized tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRowTile = 16;   // rows per tile: 16 source rows stream at once
constexpr int64_t kStepTile = 256; // input steps per tile: one tile's destination stays in L1

// out[b, k, r, :] = rows[b, r, k*s : (k+1)*s], where out is [B, K/s, n, s] and rows [B, n, K]
// (any strides, but unit stride along s and along K).
void pack_rows(at::Tensor out, const at::Tensor& rows) {
  TORCH_CHECK(out.dim() == 4 && rows.dim() == 3, "pack_rows takes out [B, K/s, n, s] and rows [B, n, K]");
  TORCH_CHECK(out.scalar_type() == rows.scalar_type(), "pack_rows copies without converting");
  const int64_t B = out.size(0), steps = out.size(1), n = out.size(2), s = out.size(3);
  TORCH_CHECK(rows.size(0) == B && rows.size(1) == n && rows.size(2) == steps * s, "pack_rows: shapes differ");
  TORCH_CHECK(out.stride(3) == 1 && rows.stride(2) == 1, "pack_rows needs unit stride along the inputs");
  const int64_t es = out.element_size(), bytes = s * es;
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  const int64_t o0 = out.stride(0) * es, o1 = out.stride(1) * es, o2 = out.stride(2) * es;
  const int64_t r0 = rows.stride(0) * es, r1 = rows.stride(1) * es;
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, B * tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / tiles, first = (t % tiles) * kRowTile, last = std::min(n, first + kRowTile);
      for (int64_t k0 = 0; k0 < steps; k0 += kStepTile) {
        const int64_t k1 = std::min(steps, k0 + kStepTile);
        for (int64_t r = first; r < last; ++r) {
          const char* from = src + b * r0 + r * r1 + k0 * bytes;
          char* to = dst + b * o0 + r * o2 + k0 * o1;
          if (bytes == 4) {
            for (int64_t k = k0; k < k1; ++k, from += 4, to += o1) {
              uint32_t v;
              std::memcpy(&v, from, 4);
              std::memcpy(to, &v, 4);
            }
          } else {
            for (int64_t k = k0; k < k1; ++k, from += bytes, to += o1) std::memcpy(to, from, bytes);
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moeshard_cpu, m) {
  m.def("pack_rows(Tensor(a!) out, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(moeshard_cpu, CPU, m) {
  m.impl("pack_rows", &pack_rows);
}
