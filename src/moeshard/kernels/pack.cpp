// Writing a block of a weight's rows into its packed panels (moeshard/kernels/packed.py): the load
// path's one transposition. torch's strided copy moves a bf16 pair at a time through its generic
// iterator (~0.5-1.5 GB/s on one core); this moves them in cache-sized tiles, and where a step is 4
// bytes (bf16 pairs, fp32) transposes squares of rows × steps in vector registers: each source
// line read once, whole, and each destination vector written once, whole, in address order, with
// non-temporal stores — a load writes fresh memory, which an ordinary store first reads in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowTile = 16;   // rows per tile: 16 source rows stream at once
constexpr int64_t kStepTile = 256; // input steps per tile: one tile's destination stays in L1

// Rows [r0, r1) and steps [k0, k1) of one panel, step by step: out[k, r, :] = rows[r, k*s : (k+1)*s]
// (`o1`, `o2`: the destination's strides along steps and rows; `row`: the source's, in bytes).
void pack_tiles(char* dst, const char* src, int64_t bytes, int64_t o1, int64_t o2, int64_t row,
                int64_t r0, int64_t r1, int64_t k0, int64_t k1) {
  for (int64_t first = r0; first < r1; first += kRowTile) {
    const int64_t last = std::min(r1, first + kRowTile);
    for (int64_t ka = k0; ka < k1; ka += kStepTile) {
      const int64_t kb = std::min(k1, ka + kStepTile);
      for (int64_t r = first; r < last; ++r) {
        const char* from = src + r * row + ka * bytes;
        char* to = dst + r * o2 + ka * o1;
        if (bytes == 4) {
          for (int64_t k = ka; k < kb; ++k, from += 4, to += o1) {
            uint32_t v;
            std::memcpy(&v, from, 4);
            std::memcpy(to, &v, 4);
          }
        } else {
          for (int64_t k = ka; k < kb; ++k, from += bytes, to += o1) std::memcpy(to, from, bytes);
        }
      }
    }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // 4-byte steps per vector: one cache line
using Vec = __m512i;
inline Vec load(const char* p) { return _mm512_loadu_si512(p); }
inline void store(char* to, const Vec& v, bool stream) {
  stream ? _mm512_stream_si512(reinterpret_cast<Vec*>(to), v) : _mm512_storeu_si512(to, v);
}
// v[i] = row i's 16 dwords → v[j] = dword j of the 16 rows.
inline void transpose(Vec* v) {
  Vec t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int q = 0; q < 16; q += 4) {  // u[q + m], 128-bit lane L: rows q…q+3 at dword 4L + m
    u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // dword 4L + m: lane L of u[m], u[4 + m], u[8 + m], u[12 + m]
    const Vec lo_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), lo_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const Vec hi_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE), hi_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    v[m] = _mm512_shuffle_i32x4(lo_a, lo_b, 0x88);
    v[4 + m] = _mm512_shuffle_i32x4(lo_a, lo_b, 0xDD);
    v[8 + m] = _mm512_shuffle_i32x4(hi_a, hi_b, 0x88);
    v[12 + m] = _mm512_shuffle_i32x4(hi_a, hi_b, 0xDD);
  }
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;  // half a cache line: two stores in a row fill it
using Vec = __m256i;
inline Vec load(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const Vec*>(p)); }
inline void store(char* to, const Vec& v, bool stream) {
  stream ? _mm256_stream_si256(reinterpret_cast<Vec*>(to), v) : _mm256_storeu_si256(reinterpret_cast<Vec*>(to), v);
}
inline void transpose(Vec* v) {
  Vec t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int q = 0; q < 8; q += 4) {
    u[q] = _mm256_unpacklo_epi64(t[q], t[q + 2]);
    u[q + 1] = _mm256_unpackhi_epi64(t[q], t[q + 2]);
    u[q + 2] = _mm256_unpacklo_epi64(t[q + 1], t[q + 3]);
    u[q + 3] = _mm256_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    v[m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x20);
    v[4 + m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x31);
  }
}
#endif

#if defined(__AVX2__)
// Rows [0, groups·kLanes) and steps [0, squares·kLanes) of one panel of 4-byte steps, a square of
// kLanes rows × kLanes steps at a time; the panel's rows of one step are contiguous (o2 = 4), so
// for each kLanes steps the destination fills whole vectors in address order.
void pack_squares(char* dst, const char* src, int64_t o1, int64_t row, int64_t groups, int64_t squares, bool stream) {
  Vec v[kLanes];
  for (int64_t sq = 0; sq < squares; ++sq) {
    for (int64_t g = 0; g < groups; ++g) {
      const char* from = src + g * kLanes * row + sq * kLanes * 4;
      for (int64_t i = 0; i < kLanes; ++i) v[i] = load(from + i * row);
      transpose(v);
      char* to = dst + sq * kLanes * o1 + g * kLanes * 4;
      for (int64_t j = 0; j < kLanes; ++j) store(to + j * o1, v[j], stream);
    }
  }
}
#endif

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
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      char* panel = dst + b * o0;
      const char* from = src + b * r0;
      int64_t vector_rows = 0, vector_steps = 0;  // the part the squares write
#if defined(__AVX2__)
      if (bytes == 4 && o2 == 4) {
        vector_rows = n / kLanes * kLanes;
        vector_steps = steps / kLanes * kLanes;
        // streamed where every vector lies within one aligned line (or half of one)
        const bool stream = reinterpret_cast<uintptr_t>(panel) % (kLanes * 4) == 0 && o1 % (kLanes * 4) == 0;
        pack_squares(panel, from, o1, r1, vector_rows / kLanes, vector_steps / kLanes, stream);
        _mm_sfence();  // the non-temporal stores are visible before this returns
      }
#endif
      pack_tiles(panel, from, bytes, o1, o2, r1, vector_rows, n, 0, steps);
      pack_tiles(panel, from, bytes, o1, o2, r1, 0, vector_rows, vector_steps, steps);
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
