// GEMMs on x86 CPUs for weights prepacked once (bf16 and fp32), attention over the paged cache,
// RMSNorm and rotary: on AVX512-BF16, or on AVX2 + FMA (x86-64-v3) through the same source.
//
// A packed weight of N outputs and K inputs is [ceil(N/64), K/s, 64, s]: panels of 64 outputs, and
// within a panel, for each step of s inputs, the step's values for the 64 outputs (four 64-byte
// blocks of 16 outputs). A bf16 step is an input pair (s = 2): `vdpbf16ps` adds x[k]·w[k] +
// x[k+1]·w[k+1] to 16 fp32 accumulators at once (on AVX2: the k products, then the k+1 products,
// two fused multiply-adds); an fp32 step is one input (s = 1, `vfmadd`). Either way no horizontal
// sums, and a register tile as wide as a panel reads it as one sequential stream. Each output element is
// accumulated over its steps in order, whatever the tile, the thread split or the number of rows in
// the call: a row's result never depends on the rest of the batch.
//
// The kernels are written once against a 16-lane fp32 vector (`vf`, below): one __m512 where the
// compiler targets AVX512-BF16, two __m256 where it targets AVX2 + FMA (moeshard.kernels.built picks
// the flags from the CPU). The two builds need not agree bit for bit (vdpbf16ps need not round as two
// fused multiply-adds do; vcvtneps2bf16 flushes denormals); each is deterministic and row-independent.
//
// Shape letters: M rows of activations, N outputs, K inputs (P = K/s steps), L local experts,
// D hidden, I intermediate (padded to a multiple of 32 in packed form).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;     // outputs per vector ("block")
constexpr int64_t kMaxBlocks = 4;  // blocks per panel, and at most per register tile
constexpr int64_t kMaxRows = 6;    // rows per register tile, at most

// ---- The vector layer: 16 fp32 lanes, and masks that keep a prefix of them -------------------

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)

using vf = __m512;
using Mask = __mmask16;
constexpr Mask kAll = 0xFFFF;
inline Mask lanes_below(int64_t n) { return n >= kLanes ? kAll : n <= 0 ? Mask(0) : Mask((1u << n) - 1u); }

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float a) { return _mm512_set1_ps(a); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a·b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c − a·b
inline vf fmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }    // a·b − c
inline vf round_even(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
inline vf scalef(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p · 2ⁿ, n integral
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline vf keep(Mask m, vf a) { return _mm512_maskz_mov_ps(m, a); }  // masked-off lanes zero

inline vf load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline vf load(const at::BFloat16* p, Mask m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store(float* p, vf v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(at::BFloat16* p, vf v, Mask m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
inline vf round_bf16(vf v) {  // v rounded to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// What the weights' element type T decides: inputs per step, and how one step is accumulated.
template <typename T>
struct Step;

template <>
struct Step<at::BFloat16> {
  static constexpr int64_t kInputs = 2;
  using Vec = __m512bh;
  static Vec weights(const at::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Vec inputs(const at::BFloat16* row, int64_t p) {
    int32_t pair;
    std::memcpy(&pair, row + 2 * p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static vf add(vf acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};

template <>
struct Step<float> {
  static constexpr int64_t kInputs = 1;
  using Vec = vf;
  static Vec weights(const float* w) { return _mm512_loadu_ps(w); }
  static Vec inputs(const float* row, int64_t p) { return set1(row[p]); }
  static vf add(vf acc, Vec x, Vec w) { return fmadd(x, w, acc); }
};

// Quantized weights' bytes as 16 32-bit integers (see Dequant below), and bf16 steps made from fp32.
using vi = __m512i;
inline vi load_sx(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi load_zx(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <int N>
inline vi shl(vi a) { return _mm512_slli_epi32(a, N); }
inline vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }
inline vf and_or(vi a, int32_t mask, int32_t bits) {  // the bits (a & mask) | bits, read as fp32: one vpternlogd
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(a, _mm512_set1_epi32(mask), _mm512_set1_epi32(bits), 0xEA));
}
inline vf pairs(__m256 eight) {  // (e0, e0, e1, e1, …, e7, e7)
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(eight));
}
inline __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 eight(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// A bf16 step of one block (16 outputs × an input pair) from fp32: `lo` holds outputs 0–7's pairs,
// `hi` outputs 8–15's, in the step's order; rounded to nearest even as vcvtneps2bf16 rounds.
inline Step<at::BFloat16>::Vec bf16_step(vf lo, vf hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

// int8 activations (A8Panels below): a 32-bit lane holds one output's 4 u8 weights, `vpdpbusd` adds
// their products with 4 s8 inputs to its int32 sum. int4: 8 inputs a lane, low nibbles the first 4.
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iset1(int32_t a) { return _mm512_set1_epi32(a); }
inline vi isub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi imul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
inline vf unfused(vf a) {  // a product the compiler may not fuse into the add that takes it
  asm("" : "+v"(a));
  return a;
}
inline int32_t four(const int8_t* a) {
  int32_t bytes;
  std::memcpy(&bytes, a, sizeof bytes);
  return bytes;
}
struct A8Int8 {
  using W = vi;
  static W weights(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static vi add(vi sum, const W& w, const int8_t* a) { return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(four(a))); }
  static vi sums(vi sum) { return sum; }
};
struct A8Int4 {
  struct W {
    vi low, high;
  };
  static W weights(const uint8_t* p) {
    const vi bytes = _mm512_loadu_si512(p), nibble = _mm512_set1_epi8(0x0F);
    return {_mm512_and_si512(bytes, nibble), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)};
  }
  static vi add(vi sum, const W& w, const int8_t* a) {
    sum = _mm512_dpbusd_epi32(sum, w.low, _mm512_set1_epi32(four(a)));
    return _mm512_dpbusd_epi32(sum, w.high, _mm512_set1_epi32(four(a + 4)));
  }
  static vi sums(vi sum) { return sum; }
};
constexpr int64_t kA8Rows = 4;  // rows per int8-activation tile: 16 int32 sums, 8 weight vectors

// Register tiles (32 vector registers): up to 6 rows × a whole panel, 24 accumulators.
struct Shape {
  int64_t rows, blocks;
};
// The tile for the next rows (`left` of them), at least `min_blocks` wide.
template <typename T>
inline Shape tile_shape(int64_t left, int64_t /*min_blocks*/) { return {std::min(kMaxRows, left), kMaxBlocks}; }

#elif defined(__AVX2__) && defined(__FMA__)

// Two __m256: lanes 0–7, 8–15. Every operation is the AVX2 one on each half; the horizontal sum
// and the bf16 conversions are spelled out, each in one fixed order.
struct vf {
  __m256 lo, hi;
};
using Mask = int;  // lanes [0, n) of 16
constexpr Mask kAll = 16;
inline Mask lanes_below(int64_t n) { return Mask(std::clamp<int64_t>(n, 0, kLanes)); }

#define MOESHARD_HALVES(name, op) \
  inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
MOESHARD_HALVES(add, _mm256_add_ps)
MOESHARD_HALVES(sub, _mm256_sub_ps)
MOESHARD_HALVES(mul, _mm256_mul_ps)
MOESHARD_HALVES(div, _mm256_div_ps)
MOESHARD_HALVES(max, _mm256_max_ps)
MOESHARD_HALVES(min, _mm256_min_ps)
#undef MOESHARD_HALVES
inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fmsub(vf a, vf b, vf c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }
inline vf round_even(vf a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2(__m256i n) {  // 2ⁿ for integral n in [−126, 127]: the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline __m256 scalef(__m256 p, __m256 n) {
  // p · 2ⁿ as vscalefps gives it, for integral n in [−252, 254] (exp_ps's): 2ⁿ in two exact
  // factors, so only the last product rounds.
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
inline vf scalef(vf p, vf n) { return {scalef(p.lo, n.lo), scalef(p.hi, n.hi)}; }
inline float reduce_add(vf a) {  // ((lo + hi) as 8, then 4, 2, 1): one fixed order
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline __m256i prefix8(int n) {  // lanes [0, n) of 8 all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf keep(Mask m, vf a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(prefix8(m))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(prefix8(m - 8)))};
}

inline vf load(const float* p, Mask m) {
  if (m == kAll) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, prefix8(m)), _mm256_maskload_ps(p + 8, prefix8(m - 8))};  // no access past lane m
}
inline void store(float* p, vf v, Mask m) {
  if (m == kAll) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(p, prefix8(m), v.lo);
  _mm256_maskstore_ps(p + 8, prefix8(m - 8), v.hi);
}
inline __m256 widen(__m128i bf16x8) {  // bf16 → fp32: the bits, 16 places up
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16x8), 16));
}
inline vf load(const at::BFloat16* p, Mask m) {
  uint16_t part[kLanes] = {};
  if (m != kAll) {  // no 16-bit masked loads on AVX2: the lanes present, through a zeroed copy
    std::memcpy(part, p, sizeof(uint16_t) * m);
    p = reinterpret_cast<const at::BFloat16*>(part);
  }
  return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// fp32 → bf16 rounded to nearest even in integer ops, NaN → 0x7FC0: c10::BFloat16's rounding, so a
// stored value equals torch's `.to(torch.bfloat16)`. In each 32-bit lane's low 16 bits.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store(at::BFloat16* p, vf v, Mask m) {
  // Pack lanes 0–7 and 8–15 to 16 bits (per 128-bit half, hence the permute back to lane order).
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v.lo), bf16_bits(v.hi)), 0xD8);
  if (m == kAll) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  uint16_t part[kLanes];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), packed);
  std::memcpy(p, part, sizeof(uint16_t) * m);
}
inline vf round_bf16(vf v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v.hi), 16))};
}

template <typename T>
struct Step;

// A bf16 step: 16 outputs' input pairs are 16 32-bit words, input k in the low half. The k products
// are added first, then the k+1 products (two fused multiply-adds: vdpbf16ps's work, in an order of
// our own).
template <>
struct Step<at::BFloat16> {
  static constexpr int64_t kInputs = 2;
  struct Vec {
    vf first, second;
  };
  static __m256 low_halves(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
  static __m256 high_halves(__m256i words) {
    return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  }
  static Vec weights(const at::BFloat16* w) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
    return {{low_halves(lo), low_halves(hi)}, {high_halves(lo), high_halves(hi)}};
  }
  static Vec inputs(const at::BFloat16* row, int64_t p) {
    uint32_t pair, first, second;
    std::memcpy(&pair, row + 2 * p, sizeof pair);
    first = pair << 16;
    second = pair & 0xFFFF0000u;
    float a, b;
    std::memcpy(&a, &first, sizeof a);
    std::memcpy(&b, &second, sizeof b);
    return {set1(a), set1(b)};
  }
  static vf add(vf acc, const Vec& x, const Vec& w) { return fmadd(x.second, w.second, fmadd(x.first, w.first, acc)); }
};

template <>
struct Step<float> {
  static constexpr int64_t kInputs = 1;
  using Vec = vf;
  static Vec weights(const float* w) { return {_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)}; }
  static Vec inputs(const float* row, int64_t p) { return set1(row[p]); }
  static vf add(vf acc, Vec x, Vec w) { return fmadd(x, w, acc); }
};

struct vi {
  __m256i lo, hi;
};
inline __m128i eight_bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline vi load_sx(const uint8_t* p) { return {_mm256_cvtepi8_epi32(eight_bytes(p)), _mm256_cvtepi8_epi32(eight_bytes(p + 8))}; }
inline vi load_zx(const uint8_t* p) { return {_mm256_cvtepu8_epi32(eight_bytes(p)), _mm256_cvtepu8_epi32(eight_bytes(p + 8))}; }
template <int N>
inline vi shl(vi a) { return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)}; }
inline vf to_float(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline vf and_or(vi a, int32_t mask, int32_t bits) {
  const __m256i m = _mm256_set1_epi32(mask), b = _mm256_set1_epi32(bits);
  return {_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(a.lo, m), b)),
          _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(a.hi, m), b))};
}
inline vf pairs(__m256 eight) {
  return {_mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
          _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
}
inline __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 eight(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes(p))); }
// The inputs k (even lanes) or k + 1 (odd lanes) of 8 outputs' pairs held in two __m256, in output order.
template <int Odd>
inline __m256 of_pairs(__m256 a, __m256 b) {
  const __m256 picked = _mm256_shuffle_ps(a, b, Odd ? 0xDD : 0x88);  // per 128 bits: a's two, then b's two
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(picked), 0xD8));
}
// A bf16 step of one block from fp32 (lo: outputs 0–7's pairs, hi: 8–15's), rounded as `store` rounds.
inline Step<at::BFloat16>::Vec bf16_step(vf lo, vf hi) {
  const vf l = round_bf16(lo), h = round_bf16(hi);
  return {{of_pairs<0>(l.lo, l.hi), of_pairs<0>(h.lo, h.hi)}, {of_pairs<1>(l.lo, l.hi), of_pairs<1>(h.lo, h.hi)}};
}

// int8 activations without VNNI, the same int32 sums (integer sums are exact in any order): int8
// weights widened to 16 bits (u8 · s8 pairs overflow vpmaddubsw's 16-bit sums), `vpmaddwd`, then
// adjacent sums (`vphaddd`, lanes in the order 0 1 4 5 | 2 3 6 7 until `sums` puts them back);
// int4 through `vpmaddubsw` (15 · 127 · 4 fits 16 bits), then `vpmaddwd` by ones.
inline vi izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi iset1(int32_t a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
inline vi isub(vi a, vi b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline vi imul(vi a, vi b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline vf unfused(vf a) {
  asm("" : "+x"(a.lo), "+x"(a.hi));
  return a;
}
inline int32_t four(const int8_t* a) {
  int32_t bytes;
  std::memcpy(&bytes, a, sizeof bytes);
  return bytes;
}
inline __m256i sixteen_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
struct A8Int8 {
  using W = const uint8_t*;
  static W weights(const uint8_t* p) { return p; }
  static __m256i eight(const uint8_t* p, __m256i a) {  // 8 outputs' sums (32 bytes), lanes 0 1 4 5 | 2 3 6 7
    return _mm256_hadd_epi32(_mm256_madd_epi16(sixteen_bytes(p), a), _mm256_madd_epi16(sixteen_bytes(p + 16), a));
  }
  static vi add(vi sum, W w, const int8_t* a) {
    const __m256i a16 = _mm256_cvtepi8_epi16(_mm_set1_epi32(four(a)));
    return {_mm256_add_epi32(sum.lo, eight(w, a16)), _mm256_add_epi32(sum.hi, eight(w + 32, a16))};
  }
  static vi sums(vi sum) { return {_mm256_permute4x64_epi64(sum.lo, 0xD8), _mm256_permute4x64_epi64(sum.hi, 0xD8)}; }
};
struct A8Int4 {
  using W = const uint8_t*;
  static W weights(const uint8_t* p) { return p; }
  static __m256i eight(const uint8_t* p, __m256i low4, __m256i high4) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nibble = _mm256_set1_epi8(0x0F);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(bytes, nibble), low4),
                                           _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), high4));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  static vi add(vi sum, W w, const int8_t* a) {
    const __m256i low4 = _mm256_set1_epi32(four(a)), high4 = _mm256_set1_epi32(four(a + 4));
    return {_mm256_add_epi32(sum.lo, eight(w, low4, high4)), _mm256_add_epi32(sum.hi, eight(w + 32, low4, high4))};
  }
  static vi sums(vi sum) { return sum; }
};
constexpr int64_t kA8Rows = 2;

// Register tiles (16 vector registers): 1 row × a whole panel (the decode shape: the most
// independent sums per weight byte read), 2 rows × 2 blocks, or one block for more rows: 4 in bf16
// (a step's weights take 4 registers), 6 in fp32 (2), 12 accumulators.
struct Shape {
  int64_t rows, blocks;
};
template <typename T>
inline Shape tile_shape(int64_t left, int64_t min_blocks) {
  const int64_t blocks = std::max(min_blocks, left >= 3 ? int64_t(1) : left == 2 ? int64_t(2) : kMaxBlocks);
  const int64_t one_block = std::is_same_v<T, float> ? 6 : 4;
  return {std::min(left, blocks == 1 ? one_block : blocks == 2 ? int64_t(2) : int64_t(1)), blocks};
}

#else
#error "moeshard's CPU kernels need AVX512-BF16 or AVX2 + FMA (see moeshard.kernels.built)"
#endif

// ---- The kernels ---------------------------------------------------------------------------

// Elements of one step of a panel.
template <typename T>
constexpr int64_t kPanelStep = kMaxBlocks * kLanes * Step<T>::kInputs;

// acc[i][j] = sum over steps of x[i] · w block j, for MB rows and NB blocks.
// The accumulators are locals, copied out once at the end: kept in registers whether or not the
// compiler inlines the call.
template <typename T, int MB, int NB>
void tile(const T* x, int64_t ldx, const T* w, int64_t P, vf (&out)[kMaxRows][kMaxBlocks]) {
  using S = Step<T>;
  vf acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = zero();
  for (int64_t p = 0; p < P; ++p) {
    typename S::Vec wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = S::weights(w + p * kPanelStep<T> + j * kLanes * S::kInputs);
    for (int i = 0; i < MB; ++i) {
      const typename S::Vec xv = S::inputs(x + i * ldx, p);
      for (int j = 0; j < NB; ++j) acc[i][j] = S::add(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = acc[i][j];
}

template <typename T>
using Tile = void (*)(const T*, int64_t, const T*, int64_t, vf (&)[kMaxRows][kMaxBlocks]);

// The register tile for mb rows (1…6) and nb blocks (1…4), chosen at run time.
template <typename T>
Tile<T> tile_of(int64_t mb, int64_t nb) {
#define MOESHARD_TILES(M) {&tile<T, M, 1>, &tile<T, M, 2>, &tile<T, M, 3>, &tile<T, M, 4>}
  static constexpr Tile<T> tiles[kMaxRows][kMaxBlocks] = {
      MOESHARD_TILES(1), MOESHARD_TILES(2), MOESHARD_TILES(3), MOESHARD_TILES(4), MOESHARD_TILES(5), MOESHARD_TILES(6)};
#undef MOESHARD_TILES
  return tiles[mb - 1][nb - 1];
}

// Packed bf16 or fp32 panels, read as they are.
template <typename T>
struct PlainPanels {
  const T* w;  // panel 0
  int64_t P;
  const T* panel_w = nullptr;

  void begin(int64_t panel, bool /*one_row_tile*/) { panel_w = w + panel * P * kPanelStep<T>; }
  Shape shape(int64_t left, int64_t min_blocks) const { return tile_shape<T>(left, min_blocks); }
  void tile(int64_t mb, int64_t nb, int64_t j0, const T* x, int64_t ldx, vf (&acc)[kMaxRows][kMaxBlocks]) const {
    tile_of<T>(mb, nb)(x, ldx, panel_w + j0 * kLanes * Step<T>::kInputs, P, acc);
  }
};

// ---- Quantized weights (moeshard.kernels.PackedQuantized), dequantized in registers ----------
//
// Each weight becomes bf16(fp32(value − zero) · scale), moeshard.kernels.quant.dequantize's
// definition: the difference exact, one fp32 multiply, one rounding to nearest even; then the bf16
// step adds it as it adds a stored bf16 weight. So a product equals, bit for bit, the bf16 kernel's
// on the dequantized weights, on either build. The exact difference needs no conversion where a
// magic number does it: the fp32 bits 0x4B000000 | n read 2²³ + n (n < 2²³), and minus 2²³ + zero
// (exact, one subtraction) leave n − zero.
//
// A block's bytes of one step hold its 16 outputs × 2 inputs in the bf16 step's order; the kernel
// turns them into two fp32 vectors, `lo` (outputs 0–7's pairs) and `hi` (outputs 8–15's), which
// scale vectors of pair-repeated scales multiply: the per-group constants (QConsts) are made
// once per group and block, not per step.

enum class QKind { kFp8, kInt8, kUint8, kInt4 };  // kUint8: int8 with zero points; kInt4: zero points or 8

struct QConsts {
  vf scale_lo, scale_hi, zero_lo, zero_hi;  // zero_*: what the kind subtracts (magic number included)
};

constexpr int32_t kMagic23 = 0x4B000000;  // 2²³: n in the low mantissa bits reads 2²³ + n
constexpr int32_t kMagic19 = 0x49000000;  // 2¹⁹: 16·n in the low mantissa bits reads 2¹⁹ + n

template <QKind Q>
struct Dequant;

template <>
struct Dequant<QKind::kFp8> {
  static constexpr int64_t kBlockBytes = 32;
  // e4m3's sign, exponent and mantissa moved to fp32's fields: the value · 2⁻¹²⁰, exactly (subnormals
  // too), which the scale · 2¹²⁰ (exact: pack_quantized keeps scales below 2⁸) multiplies once.
  static vf raw(const uint8_t* p) { return and_or(shl<20>(load_sx(p)), int32_t(0x87F00000u), 0); }
  static QConsts consts(const float* s, const uint8_t*) {
    const vf up = set1(0x1p120f);
    return {mul(pairs(eight(s)), up), mul(pairs(eight(s + 8)), up), zero(), zero()};
  }
  static void halves(const uint8_t* p, const QConsts& c, vf& lo, vf& hi) {
    lo = mul(raw(p), c.scale_lo);
    hi = mul(raw(p + 16), c.scale_hi);
  }
};

template <>
struct Dequant<QKind::kInt8> {
  static constexpr int64_t kBlockBytes = 32;
  static QConsts consts(const float* s, const uint8_t*) { return {pairs(eight(s)), pairs(eight(s + 8)), zero(), zero()}; }
  static void halves(const uint8_t* p, const QConsts& c, vf& lo, vf& hi) {
    lo = mul(to_float(load_sx(p)), c.scale_lo);
    hi = mul(to_float(load_sx(p + 16)), c.scale_hi);
  }
};

template <>
struct Dequant<QKind::kUint8> {
  static constexpr int64_t kBlockBytes = 32;
  static QConsts consts(const float* s, const uint8_t* z) {
    const vf bias = set1(0x1p23f);
    return {pairs(eight(s)), pairs(eight(s + 8)), add(pairs(eight(z)), bias), add(pairs(eight(z + 8)), bias)};
  }
  static void halves(const uint8_t* p, const QConsts& c, vf& lo, vf& hi) {
    lo = mul(sub(and_or(load_zx(p), 0xFF, kMagic23), c.zero_lo), c.scale_lo);
    hi = mul(sub(and_or(load_zx(p + 16), 0xFF, kMagic23), c.zero_hi), c.scale_hi);
  }
};

template <>
struct Dequant<QKind::kInt4> {
  static constexpr int64_t kBlockBytes = 16;  // byte t: weight t (low nibble), weight t + 16 (high)
  static QConsts consts(const float* s, const uint8_t* z) {
    const vf lo = z ? pairs(eight(z)) : set1(8.f), hi = z ? pairs(eight(z + 8)) : set1(8.f);
    return {pairs(eight(s)), pairs(eight(s + 8)), add(lo, set1(0x1p23f)), add(hi, set1(0x1p19f))};
  }
  static void halves(const uint8_t* p, const QConsts& c, vf& lo, vf& hi) {
    const vi bytes = load_zx(p);
    lo = mul(sub(and_or(bytes, 0x0F, kMagic23), c.zero_lo), c.scale_lo);
    hi = mul(sub(and_or(bytes, 0xF0, kMagic19), c.zero_hi), c.scale_hi);
  }
};

template <QKind Q>
struct QuantPanels;

// acc[i][j] as `tile` computes it on the dequantized weights: the same steps in the same order.
template <QKind Q, int MB, int NB>
void quant_tile(const at::BFloat16* x, int64_t ldx, const QuantPanels<Q>& w, int64_t j0,
                vf (&out)[kMaxRows][kMaxBlocks]) {
  using S = Step<at::BFloat16>;
  using D = Dequant<Q>;
  vf acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = zero();
  const uint8_t* values = w.panel_values + j0 * D::kBlockBytes;
  for (int64_t g = 0, p0 = 0; p0 < w.P; ++g, p0 += w.group_steps) {
    QConsts c[NB];
    for (int j = 0; j < NB; ++j) c[j] = w.consts(g, j0 + j);
    for (int64_t p = p0, p1 = std::min(w.P, p0 + w.group_steps); p < p1; ++p) {
      S::Vec wv[NB];
      for (int j = 0; j < NB; ++j) {
        vf lo, hi;
        D::halves(values + p * QuantPanels<Q>::kStepBytes + j * D::kBlockBytes, c[j], lo, hi);
        wv[j] = bf16_step(lo, hi);
      }
      for (int i = 0; i < MB; ++i) {
        const S::Vec xv = S::inputs(x + i * ldx, p);
        for (int j = 0; j < NB; ++j) acc[i][j] = S::add(acc[i][j], xv, wv[j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = acc[i][j];
}

// Quantized panels: rows that one register tile holds are computed on the weights dequantized in
// registers (each weight once); more rows on the panel dequantized once into a bf16 scratch panel,
// then read by the bf16 tiles (the same bits either way).
template <QKind Q>
struct QuantPanels {
  static constexpr int64_t kStepBytes = kMaxBlocks * Dequant<Q>::kBlockBytes;
  const uint8_t* values;  // panel 0's
  const float* scale;
  const uint8_t* zero;  // or nullptr
  int64_t P, groups, group_steps;
  const uint8_t* panel_values = nullptr;
  const float* panel_scale = nullptr;
  const uint8_t* panel_zero = nullptr;
  const at::BFloat16* dequantized = nullptr;

  Shape shape(int64_t left, int64_t min_blocks) const { return tile_shape<at::BFloat16>(left, min_blocks); }

  QConsts consts(int64_t g, int64_t block) const {
    const int64_t at = g * kMaxBlocks * kLanes + block * kLanes;
    return Dequant<Q>::consts(panel_scale + at, panel_zero ? panel_zero + at : nullptr);
  }

  void begin(int64_t panel, bool one_row_tile) {
    panel_values = values + panel * P * kStepBytes;
    panel_scale = scale + panel * groups * kMaxBlocks * kLanes;
    panel_zero = zero ? zero + panel * groups * kMaxBlocks * kLanes : nullptr;
    dequantized = one_row_tile ? nullptr : dequantize_panel();
  }

  const at::BFloat16* dequantize_panel() const {
    thread_local std::vector<at::BFloat16> scratch;
    scratch.resize(P * kPanelStep<at::BFloat16>);
    at::BFloat16* out = scratch.data();
    for (int64_t g = 0, p0 = 0; p0 < P; ++g, p0 += group_steps)
      for (int64_t j = 0; j < kMaxBlocks; ++j) {
        const QConsts c = consts(g, j);
        for (int64_t p = p0, p1 = std::min(P, p0 + group_steps); p < p1; ++p) {
          vf lo, hi;
          Dequant<Q>::halves(panel_values + p * kStepBytes + j * Dequant<Q>::kBlockBytes, c, lo, hi);
          at::BFloat16* step = out + p * kPanelStep<at::BFloat16> + j * 2 * kLanes;
          store(step, lo, kAll);
          store(step + kLanes, hi, kAll);
        }
      }
    return out;
  }

  void tile(int64_t mb, int64_t nb, int64_t j0, const at::BFloat16* x, int64_t ldx,
            vf (&acc)[kMaxRows][kMaxBlocks]) const {
    if (dequantized) return tile_of<at::BFloat16>(mb, nb)(x, ldx, dequantized + j0 * kLanes * 2, P, acc);
    using QTile = void (*)(const at::BFloat16*, int64_t, const QuantPanels&, int64_t, vf(&)[kMaxRows][kMaxBlocks]);
#define MOESHARD_QTILES(M) {&quant_tile<Q, M, 1>, &quant_tile<Q, M, 2>, &quant_tile<Q, M, 3>, &quant_tile<Q, M, 4>}
    static constexpr QTile tiles[kMaxRows][kMaxBlocks] = {MOESHARD_QTILES(1), MOESHARD_QTILES(2), MOESHARD_QTILES(3),
                                                          MOESHARD_QTILES(4), MOESHARD_QTILES(5), MOESHARD_QTILES(6)};
#undef MOESHARD_QTILES
    tiles[mb - 1][nb - 1](x, ldx, *this, j0, acc);
  }
};


// ---- Quantized weights times int8 activations (`vpdpbusd`), LLM(quantize_activations=True) ----
//
// Each row of activations is quantized per group of G inputs (the weights' groups), on its own:
// scale = max |x| / 127 (fp32), q = round_even(x / scale) in −127…127, and Σ q kept (an all-zero
// group: scale 0, q 0). A weight is stored as an unsigned level u (int8 + 128, int4 + 8, or as
// given with zero points z), so per row, output and group the exact int32 sum is
//   S = Σ u·q − z·Σq = Σ (value − z)·q   (z = 128, 8 or the zero point),
// and the fp32 accumulator, group by group in order, adds float(S) · (weight scale · row scale):
// two fp32 multiplies and an add, each rounded (never fused). A row's result depends on that row
// alone, and the AVX2 build gets the same int32 sums, so the same bits.
//
// Panels ("a8" layout, moeshard.kernels.PackedQuantized): per step of 4 inputs (int8) or 8 (int4)
// and block of 16 outputs, 64 bytes: output n's 32-bit lane holds its 4 levels of the step (int4:
// inputs 0–3 in the low nibbles, 4–7 in the high ones), in input order.

constexpr int64_t kA8BlockBytes = 64;
constexpr int64_t kA8StepBytes = kMaxBlocks * kA8BlockBytes;

// Rows of quantized activations (HeldRows' view), from row 0 of a tile on.
struct QRows {
  const int8_t* q;
  const float* scale;
  const int32_t* total;  // Σ q per group
  int64_t K, groups;
  QRows operator+(int64_t rows) const { return {q + rows * K, scale + rows * groups, total + rows * groups, K, groups}; }
};

struct HeldRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> total;
  int64_t K, groups;
  QRows rows() const { return {q.data(), scale.data(), total.data(), K, groups}; }
};

HeldRows quantize_rows(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  const int64_t X = (K + G - 1) / G;
  HeldRows held{std::vector<int8_t>(M * K), std::vector<float>(M * X), std::vector<int32_t>(M * X), K, X};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < X; ++g) {
      const at::BFloat16* in = x + m * ldx + g * G;
      int8_t* q = held.q.data() + m * K + g * G;
      const int64_t n = std::min(G, K - g * G);
      float largest = 0.f;
      for (int64_t k = 0; k < n; ++k) largest = std::max(largest, std::fabs(float(in[k])));
      const float scale = largest / 127.f;
      int32_t total = 0;
      for (int64_t k = 0; k < n; ++k) {
        q[k] = largest > 0.f ? int8_t(std::clamp(std::nearbyint(float(in[k]) / scale), -127.f, 127.f)) : int8_t(0);
        total += q[k];
      }
      held.scale[m * X + g] = scale;
      held.total[m * X + g] = total;
    }
  return held;
}

// What a kind's step does: the dot product (A8Int8, A8Int4), inputs per step, the level of zero
// where the weights have no zero points.
template <QKind Q>
struct A8 {
  using Step = A8Int8;
  static constexpr int64_t kInputs = 4;
  static constexpr int32_t kZero = Q == QKind::kInt8 ? 128 : 0;
};
template <>
struct A8<QKind::kInt4> {
  using Step = A8Int4;
  static constexpr int64_t kInputs = 8;
  static constexpr int32_t kZero = 8;
};

template <QKind Q>
struct A8Panels;

template <QKind Q, int MB, int NB>
void a8_tile(const QRows& x, const A8Panels<Q>& w, int64_t j0, vf (&out)[kMaxRows][kMaxBlocks]) {
  using S = typename A8<Q>::Step;
  vf acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = zero();
  const uint8_t* values = w.panel_values + j0 * kA8BlockBytes;
  for (int64_t g = 0, p0 = 0; p0 < w.P; ++g, p0 += w.group_steps) {
    vi sum[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) sum[i][j] = izero();
    for (int64_t p = p0, p1 = std::min(w.P, p0 + w.group_steps); p < p1; ++p) {
      typename S::W wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = S::weights(values + p * kA8StepBytes + j * kA8BlockBytes);
      for (int i = 0; i < MB; ++i) {
        const int8_t* a = x.q + i * x.K + p * A8<Q>::kInputs;
        for (int j = 0; j < NB; ++j) sum[i][j] = S::add(sum[i][j], wv[j], a);
      }
    }
    const int64_t at = g * kMaxBlocks * kLanes + j0 * kLanes;
    for (int j = 0; j < NB; ++j) {
      const vf weight_scale = load(w.panel_scale + at + j * kLanes, kAll);
      const uint8_t* zero_points = w.panel_zero ? w.panel_zero + at + j * kLanes : nullptr;
      for (int i = 0; i < MB; ++i) {
        const int32_t total = x.total[i * x.groups + g];
        const vi exact = isub(S::sums(sum[i][j]), zero_points ? imul(load_zx(zero_points), iset1(total))
                                                              : iset1(A8<Q>::kZero * total));
        const vf scale = mul(weight_scale, set1(x.scale[i * x.groups + g]));
        acc[i][j] = add(acc[i][j], unfused(mul(to_float(exact), scale)));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i][j] = acc[i][j];
}

template <QKind Q>
struct A8Panels {
  static constexpr int64_t kStepBytes = kA8StepBytes;
  const uint8_t* values;  // panel 0's
  const float* scale;
  const uint8_t* zero;  // or nullptr
  int64_t P, groups, group_steps;  // P: steps of A8<Q>::kInputs inputs
  const uint8_t* panel_values = nullptr;
  const float* panel_scale = nullptr;
  const uint8_t* panel_zero = nullptr;

  void begin(int64_t panel, bool /*one_row_tile*/) {
    panel_values = values + panel * P * kStepBytes;
    panel_scale = scale + panel * groups * kMaxBlocks * kLanes;
    panel_zero = zero ? zero + panel * groups * kMaxBlocks * kLanes : nullptr;
  }
  Shape shape(int64_t left, int64_t /*min_blocks*/) const { return {std::min(kA8Rows, left), kMaxBlocks}; }

  void tile(int64_t mb, int64_t nb, int64_t j0, const QRows& x, int64_t /*ldx*/, vf (&acc)[kMaxRows][kMaxBlocks]) const {
    using ATile = void (*)(const QRows&, const A8Panels&, int64_t, vf(&)[kMaxRows][kMaxBlocks]);
#define MOESHARD_ATILES(M) {&a8_tile<Q, M, 1>, &a8_tile<Q, M, 2>, &a8_tile<Q, M, 3>, &a8_tile<Q, M, 4>}
#if defined(__AVX512F__)
    static constexpr ATile tiles[kA8Rows][kMaxBlocks] = {MOESHARD_ATILES(1), MOESHARD_ATILES(2), MOESHARD_ATILES(3),
                                                         MOESHARD_ATILES(4)};
#else
    static constexpr ATile tiles[kA8Rows][kMaxBlocks] = {MOESHARD_ATILES(1), MOESHARD_ATILES(2)};
#endif
#undef MOESHARD_ATILES
    tiles[mb - 1][nb - 1](x, *this, j0, acc);
  }
};

// Rows [0, M) times blocks [b0, b1) (b0 a panel's first) of packed weights `w` (PlainPanels,
// QuantPanels or A8Panels, whose rows x are bf16/fp32 pointers or QRows) with N outputs; out is
// [M, N] with stride ldo.
template <typename X, typename Out, typename W>
void gemm_blocks(X x, int64_t ldx, int64_t M, W w, int64_t N, Out* out, int64_t ldo, int64_t b0, int64_t b1) {
  vf acc[kMaxRows][kMaxBlocks];
  for (int64_t b = b0; b < b1; b += kMaxBlocks) {
    const int64_t panel_blocks = std::min(kMaxBlocks, b1 - b);
    w.begin(b / kMaxBlocks, w.shape(M, 1).rows >= M);
    for (int64_t m = 0, mb; m < M; m += mb) {
      const Shape shape = w.shape(M - m, 1);
      mb = shape.rows;
      for (int64_t j0 = 0; j0 < panel_blocks; j0 += shape.blocks) {
        const int64_t nb = std::min(shape.blocks, panel_blocks - j0);
        w.tile(mb, nb, j0, x + m * ldx, ldx, acc);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t n = (b + j0 + j) * kLanes;
            store(out + (m + i) * ldo + n, acc[i][j], lanes_below(N - n));
          }
      }
    }
  }
}

// exp for the SwiGLU epilogue: Cody–Waite range reduction and a degree-6 polynomial (~1 ulp in fp32).
inline vf exp_ps(vf x) {
  x = max(min(x, set1(88.3762626647949f)), set1(-87.3365478515625f));
  const vf n = round_even(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500E-4f);
  p = fmadd(p, r, set1(1.3981999507E-3f));
  p = fmadd(p, r, set1(8.3334519073E-3f));
  p = fmadd(p, r, set1(4.1665795894E-2f));
  p = fmadd(p, r, set1(1.6666665459E-1f));
  p = fmadd(p, r, set1(5.0000001201E-1f));
  p = fmadd(mul(p, r), r, add(r, set1(1.f)));
  return scalef(p, n);
}

// h = silu(gate) * up as the unfused computation in T gives it: in bf16 each of gate, silu(gate)
// and up is rounded to bf16 (as torch's bf16 ops would store them), in fp32 nothing is.
template <typename T>
inline vf swiglu_ps(vf gate, vf up) {
  constexpr bool kRound = std::is_same_v<T, at::BFloat16>;
  if constexpr (kRound) gate = round_bf16(gate);
  const vf silu = div(gate, add(set1(1.f), exp_ps(sub(zero(), gate))));
  if constexpr (kRound) return mul(round_bf16(silu), round_bf16(up));
  return mul(silu, up);
}

// Rows [0, M) of one expert's gate/up (blocks interleaved: gate block c, then up block c) → h [M, Ip],
// for intermediate blocks [c0, c1), c0 even (a panel holds two intermediate blocks).
template <typename T, typename X, typename W>
void gate_up_blocks(X x, int64_t ldx, int64_t M, W w13, T* h, int64_t Ip, int64_t c0, int64_t c1) {
  vf acc[kMaxRows][kMaxBlocks];
  for (int64_t c = c0; c < c1; c += 2) {
    const int64_t pairs = std::min<int64_t>(2, c1 - c);
    w13.begin(c / 2, w13.shape(M, 2).rows >= M);
    for (int64_t m = 0, mb; m < M; m += mb) {
      const Shape shape = w13.shape(M - m, 2);  // a tile holds both halves of its outputs
      mb = shape.rows;
      for (int64_t q0 = 0; q0 < pairs; q0 += shape.blocks / 2) {
        const int64_t nq = std::min(shape.blocks / 2, pairs - q0);
        w13.tile(mb, 2 * nq, 2 * q0, x + m * ldx, ldx, acc);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < nq; ++j)
            store(h + (m + i) * Ip + (c + q0 + j) * kLanes, swiglu_ps<T>(acc[i][2 * j], acc[i][2 * j + 1]), kAll);
      }
    }
  }
}

bool is_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat; }

void check_weight(const at::Tensor& w, int dim, const char* name) {
  TORCH_CHECK((w.scalar_type() == at::kBFloat16 || is_float(w)) && w.device().is_cpu(), name,
              " must be a bfloat16 or float32 CPU tensor");
  TORCH_CHECK(w.dim() == dim && w.is_contiguous() && w.size(dim - 2) == kMaxBlocks * kLanes &&
                  w.size(dim - 1) == (is_float(w) ? 1 : 2),
              name, " must be packed by moeshard.kernels.pack");
}

void check_rows(const at::Tensor& x, const at::Tensor& w, int64_t P) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x must have the packed weight's dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (is_float(x) || x.stride(0) % 2 == 0),
              "x must be [M, K] rows (an even row stride in bf16)");
  TORCH_CHECK(x.size(1) == P * w.size(-1), "x has ", x.size(1), " inputs; the packed weight has ", P * w.size(-1));
}

// The experts' work is split in chunks of this many blocks (one panel), per expert.
constexpr int64_t kGrainBlocks = kMaxBlocks;

// Rows x (ldx apart, M of them) times the weight w: out [M, N].
template <typename Out, typename X, typename W>
void linear_impl(X x, int64_t ldx, int64_t M, const W& w, int64_t panels, int64_t N, at::Tensor& out) {
  const int64_t blocks = panels * kMaxBlocks;
  Out* o = out.data_ptr<Out>();
  // Split by whole panels (a tile never straddles two), whatever ranges the threads get.
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    gemm_blocks(x, ldx, M, w, N, o, N, p0 * kMaxBlocks, std::min(p1 * kMaxBlocks, blocks));
  });
}

template <typename T, typename Out, typename W>
void linear_impl(const at::Tensor& x_MK, const W& w, int64_t panels, int64_t N, at::Tensor& out) {
  linear_impl<Out>(x_MK.data_ptr<T>(), x_MK.stride(0), x_MK.size(0), w, panels, N, out);
}

// x [M, K] · packed weight → [M, N]: fp32 weights give fp32; bf16 weights give bf16, or the fp32
// accumulator with fp32_out.
at::Tensor linear(const at::Tensor& x_MK, const at::Tensor& w_BPs, int64_t N, bool fp32_out) {
  check_weight(w_BPs, 4, "weight");
  TORCH_CHECK(w_BPs.size(0) * kMaxBlocks * kLanes >= N, "the packed weight has fewer than ", N, " outputs");
  check_rows(x_MK, w_BPs, w_BPs.size(1));
  const bool fp32 = is_float(w_BPs) || fp32_out;
  auto out = at::empty({x_MK.size(0), N}, x_MK.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  if (x_MK.size(0) == 0 || N == 0) return out;
  const int64_t panels = w_BPs.size(0), P = w_BPs.size(1);
  if (is_float(w_BPs))
    linear_impl<float, float>(x_MK, PlainPanels<float>{w_BPs.data_ptr<float>(), P}, panels, N, out);
  else if (fp32_out)
    linear_impl<at::BFloat16, float>(x_MK, PlainPanels<at::BFloat16>{w_BPs.data_ptr<at::BFloat16>(), P}, panels, N, out);
  else
    linear_impl<at::BFloat16, at::BFloat16>(x_MK, PlainPanels<at::BFloat16>{w_BPs.data_ptr<at::BFloat16>(), P}, panels,
                                            N, out);
  return out;
}

// The rows a product reads as they are: (pointer, row stride).
struct AsStored {
  template <typename T>
  std::pair<const T*, int64_t> operator()(const T* x, int64_t ldx, int64_t /*M*/, int64_t /*K*/) const {
    return {x, ldx};
  }
};

// The rows quantized (quantize_rows), held until this object goes: (QRows, 1).
struct Int8Rows {
  int64_t group;
  std::vector<HeldRows> held;
  std::pair<QRows, int64_t> operator()(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K) {
    held.reserve(2);  // gate-up's and down's inputs: views of the first stay valid
    held.push_back(quantize_rows(x, ldx, M, K, group));
    return {held.back().rows(), 1};
  }
};

// Rows sorted by expert; experts(l) gives expert l's gate/up and down panels (PlainPanels,
// QuantPanels or A8Panels); inputs(x, ldx, M, K) the rows each product reads (AsStored, Int8Rows).
template <typename T, typename Experts, typename Inputs = AsStored>
void grouped_swiglu_impl(const at::Tensor& x_MD, int64_t L, int64_t down_panels, Experts experts,
                         const std::vector<int64_t>& starts, at::Tensor& h, at::Tensor& y, Inputs inputs = {}) {
  const int64_t Ip = h.size(1), D = x_MD.size(1);
  const auto rows = inputs(x_MD.data_ptr<T>(), x_MD.stride(0), starts[L], D);
  const auto x = rows.first;
  const int64_t ldx = rows.second;
  T* hp = h.data_ptr<T>();
  // Tasks are (expert, chunk of blocks) pairs, so experts with one row each still spread over threads.
  auto for_each_chunk = [&](int64_t blocks, auto&& body) {
    const int64_t chunks = (blocks + kGrainBlocks - 1) / kGrainBlocks;
    at::parallel_for(0, L * chunks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t l = t / chunks, c = t % chunks;
        if (starts[l + 1] > starts[l]) body(l, c * kGrainBlocks, std::min(blocks, (c + 1) * kGrainBlocks));
      }
    });
  };
  for_each_chunk(Ip / kLanes, [&](int64_t l, int64_t c0, int64_t c1) {
    gate_up_blocks(x + starts[l] * ldx, ldx, starts[l + 1] - starts[l], experts(l).first, hp + starts[l] * Ip, Ip, c0, c1);
  });
  const auto hidden = inputs(static_cast<const T*>(hp), Ip, starts[L], Ip);
  const auto hs = hidden.first;
  const int64_t ldh = hidden.second;
  for_each_chunk(down_panels * kMaxBlocks, [&](int64_t l, int64_t b0, int64_t b1) {
    gemm_blocks(hs + starts[l] * ldh, ldh, starts[l + 1] - starts[l], experts(l).second, D, y.data_ptr<T>() + starts[l] * D,
                D, b0, b1);
  });
}

// Group ends → row starts per local expert (checked), and the outputs, zero past the last end.
std::vector<int64_t> group_starts(const at::Tensor& group_ends_L, int64_t L, int64_t M) {
  auto ends = group_ends_L.to(at::kLong).contiguous();
  TORCH_CHECK(ends.numel() == L, "grouped_swiglu: one group end per local expert");
  std::vector<int64_t> starts(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) {
    starts[l + 1] = ends.data_ptr<int64_t>()[l];
    TORCH_CHECK(starts[l] <= starts[l + 1], "grouped_swiglu: group ends must not decrease");
  }
  TORCH_CHECK(starts[L] <= M, "grouped_swiglu: group ends past the rows");
  return starts;
}

at::Tensor zero_past(const at::Tensor& x_MD, int64_t computed) {
  auto y = at::empty({x_MD.size(0), x_MD.size(1)}, x_MD.options());
  if (computed < x_MD.size(0)) y.narrow(0, computed, x_MD.size(0) - computed).zero_();
  return y;
}

// Rows sorted by local expert: rows [ends[l-1], ends[l]) use expert l. Returns
// down(silu(gate(x)) * up(x)) for those rows; rows past the last end are zero.
// w13 is [L, Ip/32, D/s, 64, s] (gate and up blocks of 16 interleaved), w2 is [L, ceil(D/64), Ip/s, 64, s].
at::Tensor grouped_swiglu(const at::Tensor& x_MD, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& group_ends_L) {
  check_weight(w13, 5, "w13");
  check_weight(w2, 5, "w2");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "grouped_swiglu: w13 and w2 differ in dtype");
  const int64_t L = w13.size(0), Ip = w13.size(1) * 2 * kLanes, D = x_MD.size(1);
  check_rows(x_MD, w13, w13.size(2));
  TORCH_CHECK(w2.size(0) == L && w2.size(2) * w2.size(4) == Ip && w2.size(1) * kMaxBlocks * kLanes >= D,
              "grouped_swiglu: w2 does not match w13");
  const std::vector<int64_t> starts = group_starts(group_ends_L, L, x_MD.size(0));
  auto h = at::empty({starts[L], Ip}, x_MD.options());
  auto y = zero_past(x_MD, starts[L]);
  auto run = [&](auto zero_element) {
    using T = decltype(zero_element);
    const T *w13p = w13.data_ptr<T>(), *w2p = w2.data_ptr<T>();
    const int64_t P13 = w13.size(2), P2 = w2.size(2);
    const int64_t expert13 = w13.size(1) * P13 * kPanelStep<T>, expert2 = w2.size(1) * P2 * kPanelStep<T>;
    grouped_swiglu_impl<T>(x_MD, L, w2.size(1), [&](int64_t l) {
      return std::make_pair(PlainPanels<T>{w13p + l * expert13, P13}, PlainPanels<T>{w2p + l * expert2, P2});
    }, starts, h, y);
  };
  if (is_float(w13))
    run(float{});
  else
    run(at::BFloat16{});
  return y;
}

// ---- The quantized ops --------------------------------------------------------------------

// Checks a quantized weight's panels ([lead], then [B, P, 64, 2] values, or [B, P, 64] for int4;
// with int8 activations [B, P, 64, 4], steps of 4 inputs (int8) or 8 (int4); scale and zero
// [B, ceil(K/G), 64]) and returns its inputs K.
int64_t check_quantized(const at::Tensor& values, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                        const std::string& kind, int64_t group, bool int8_activations, int64_t lead, const char* name) {
  TORCH_CHECK(kind == "fp8" || kind == "int8" || kind == "int4", name, ": the quantization must be fp8, int8 or int4, got ",
              kind);
  TORCH_CHECK(!int8_activations || kind != "fp8", name, ": int8 activations take int8 or int4 weights, not fp8");
  const bool int4 = kind == "int4";
  const int64_t step = int8_activations ? (int4 ? 8 : 4) : 2;
  TORCH_CHECK(group >= step && group % step == 0, name, ": a quantization group must be a positive multiple of ", step,
              " inputs (the kernels' step), got ", group);
  TORCH_CHECK(values.scalar_type() == at::kByte && values.device().is_cpu() && values.is_contiguous() &&
                  values.dim() == lead + (int4 && !int8_activations ? 3 : 4) &&
                  values.size(lead + 2) == kMaxBlocks * kLanes &&
                  ((int4 && !int8_activations) || values.size(lead + 3) == (int8_activations ? 4 : 2)),
              name, "'s values must be uint8 panels made by moeshard.kernels.pack_quantized");
  const int64_t B = values.size(lead), P = values.size(lead + 1), groups = (step * P + group - 1) / group;
  auto panels_of_groups = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.is_contiguous() && t.dim() == lead + 3 && t.size(lead) == B &&
           t.size(lead + 1) == groups && t.size(lead + 2) == kMaxBlocks * kLanes &&
           (lead == 0 || t.size(0) == values.size(0));
  };
  TORCH_CHECK(is_float(scale) && panels_of_groups(scale), name, "'s scales must be float32 panels of ", groups,
              " groups of ", group, " inputs, as its values");
  TORCH_CHECK(!zero.has_value() || kind != "fp8", name, ": fp8 weights have no zero points");
  TORCH_CHECK(!zero.has_value() || (zero->scalar_type() == at::kByte && panels_of_groups(*zero)), name,
              "'s zero points must be uint8 panels shaped as its scales");
  return step * P;
}

void check_quantized_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quantized weights take bfloat16 activations, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 2 == 0, "x must be [M, K] rows (an even row stride)");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs; the packed weight has ", K);
}

// The panels of a quantized weight ([lead] dims first), of kind Q.
template <QKind Q>
QuantPanels<Q> quant_panels(const at::Tensor& values, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                            int64_t group, int64_t lead) {
  return {values.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.has_value() ? zero->data_ptr<uint8_t>() : nullptr,
          values.size(lead + 1), scale.size(lead + 1), group / 2};
}

// The panels of a quantized weight in the int8-activation layout ([lead] dims first), of kind Q.
template <QKind Q>
A8Panels<Q> a8_panels(const at::Tensor& values, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                      int64_t group, int64_t lead) {
  return {values.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.has_value() ? zero->data_ptr<uint8_t>() : nullptr,
          values.size(lead + 1), scale.size(lead + 1), group / A8<Q>::kInputs};
}

// body(std::integral_constant<QKind, Q>) for the weights' kind Q.
template <typename Body>
void with_kind(const std::string& kind, bool zero_points, Body&& body) {
  if (kind == "fp8")
    body(std::integral_constant<QKind, QKind::kFp8>{});
  else if (kind == "int8" && !zero_points)
    body(std::integral_constant<QKind, QKind::kInt8>{});
  else if (kind == "int8")
    body(std::integral_constant<QKind, QKind::kUint8>{});
  else
    body(std::integral_constant<QKind, QKind::kInt4>{});
}

// Expert l's panels of a [L, ...] quantized weight (QuantPanels or A8Panels).
template <typename W>
W expert_panels(W w, int64_t panels, int64_t l) {
  w.values += l * panels * w.P * W::kStepBytes;
  w.scale += l * panels * w.groups * kMaxBlocks * kLanes;
  if (w.zero) w.zero += l * panels * w.groups * kMaxBlocks * kLanes;
  return w;
}

// x [M, K] (bf16) · a quantized packed weight → [M, N], bf16 or fp32 (fp32_out): the bf16 linear's
// bits on the dequantized weights; with int8_activations (int8/int4 weights in the a8 layout), the
// integer products of the rows quantized to int8 (A8Panels).
at::Tensor linear_quantized(const at::Tensor& x_MK, const at::Tensor& values, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& zero, const std::string& kind, int64_t group, int64_t N,
                            bool fp32_out, bool int8_activations) {
  const int64_t K = check_quantized(values, scale, zero, kind, group, int8_activations, 0, "weight");
  TORCH_CHECK(values.size(0) * kMaxBlocks * kLanes >= N, "the packed weight has fewer than ", N, " outputs");
  check_quantized_rows(x_MK, K);
  auto out = at::empty({x_MK.size(0), N}, x_MK.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (x_MK.size(0) == 0 || N == 0) return out;
  auto run = [&](const auto& w, auto x, int64_t ldx) {
    if (fp32_out)
      linear_impl<float>(x, ldx, x_MK.size(0), w, values.size(0), N, out);
    else
      linear_impl<at::BFloat16>(x, ldx, x_MK.size(0), w, values.size(0), N, out);
  };
  with_kind(kind, zero.has_value(), [&](auto q) {
    constexpr QKind Q = decltype(q)::value;
    if constexpr (Q != QKind::kFp8) {
      if (int8_activations) {
        const HeldRows rows = quantize_rows(x_MK.data_ptr<at::BFloat16>(), x_MK.stride(0), x_MK.size(0), K, group);
        return run(a8_panels<Q>(values, scale, zero, group, 0), rows.rows(), 1);
      }
    }
    run(quant_panels<Q>(values, scale, zero, group, 0), x_MK.data_ptr<at::BFloat16>(), x_MK.stride(0));
  });
  return out;
}

// grouped_swiglu over quantized gate/up (w13, pack_gate_up_quantized) and down (w2,
// pack_down_quantized) weights of one format: the bf16 grouped_swiglu's bits on the dequantized weights.
at::Tensor grouped_swiglu_quantized(const at::Tensor& x_MD, const at::Tensor& values13, const at::Tensor& scale13,
                                    const c10::optional<at::Tensor>& zero13, const at::Tensor& values2,
                                    const at::Tensor& scale2, const c10::optional<at::Tensor>& zero2,
                                    const std::string& kind, int64_t group, const at::Tensor& group_ends_L,
                                    bool int8_activations) {
  const int64_t K13 = check_quantized(values13, scale13, zero13, kind, group, int8_activations, 1, "w13");
  const int64_t K2 = check_quantized(values2, scale2, zero2, kind, group, int8_activations, 1, "w2");
  TORCH_CHECK(zero13.has_value() == zero2.has_value(), "grouped_swiglu: w13 and w2 must both have zero points or neither");
  check_quantized_rows(x_MD, K13);
  const int64_t L = values13.size(0), Ip = values13.size(1) * 2 * kLanes, D = x_MD.size(1);
  TORCH_CHECK(values2.size(0) == L && K2 == Ip && values2.size(1) * kMaxBlocks * kLanes >= D,
              "grouped_swiglu: w2 does not match w13");
  const std::vector<int64_t> starts = group_starts(group_ends_L, L, x_MD.size(0));
  auto h = at::empty({starts[L], Ip}, x_MD.options());
  auto y = zero_past(x_MD, starts[L]);
  auto run = [&](const auto& w13, const auto& w2, auto inputs) {
    grouped_swiglu_impl<at::BFloat16>(x_MD, L, values2.size(1), [&](int64_t l) {
      return std::make_pair(expert_panels(w13, values13.size(1), l), expert_panels(w2, values2.size(1), l));
    }, starts, h, y, inputs);
  };
  with_kind(kind, zero13.has_value(), [&](auto q) {
    constexpr QKind Q = decltype(q)::value;
    if constexpr (Q != QKind::kFp8) {
      if (int8_activations)
        return run(a8_panels<Q>(values13, scale13, zero13, group, 1), a8_panels<Q>(values2, scale2, zero2, group, 1),
                   Int8Rows{group, {}});
    }
    run(quant_panels<Q>(values13, scale13, zero13, group, 1), quant_panels<Q>(values2, scale2, zero2, group, 1), AsStored{});
  });
  return y;
}

// Loads 16 elements as fp32; all 16 where the row has them (no mask needed).
template <bool Full, typename T>
inline vf load_row(const T* p, int64_t left) {
  return load(p, Full ? kAll : lanes_below(left));
}

constexpr int64_t kAhead = 8;  // keys whose rows are prefetched ahead of use

template <typename C>
inline void prefetch_row(const C* row, int64_t elements, int hint) {
  for (int64_t byte = 0; byte < elements * int64_t(sizeof(C)); byte += 64) {
    if (hint == _MM_HINT_T0)
      _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T0);
    else
      _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T1);
  }
}

// One query row of HB heads that share a KV head, over key positions [lo, pos] of one sequence.
// The K and V rows (C: the cache's type) are converted to fp32 once for the HB heads. DV, EV: head dims in vectors of
// 16, compile-time where small (then the loads need no mask and the accumulators stay in
// registers), 0 for any size.
template <typename Q, typename C, int HB, int DV, int EV>
inline void attend_row(const Q* const* q_heads, Q* const* out_heads, const C* k, int64_t k_stride, const C* v,
                       int64_t v_stride, const int64_t* slot, int64_t lo, int64_t pos, int64_t d,
                       int64_t e, float scale, std::vector<float>& scores) {
  constexpr bool kFullD = DV > 0, kFullE = EV > 0;
  const int64_t dv = DV ? DV : (d + kLanes - 1) / kLanes, ev = EV ? EV : (e + kLanes - 1) / kLanes;
  const int64_t n = pos + 1 - lo;
  scores.resize(HB * n);
  vf top[HB];
  for (int b = 0; b < HB; ++b) top[b] = set1(-INFINITY);
  // Scores: the queries converted to fp32 once, each K row once for the HB heads.
  vf q_r[HB][DV ? DV : 1];
  std::unique_ptr<vf[]> q_m(DV ? nullptr : new vf[HB * dv]);
  auto qv = [&](int b, int64_t c) -> vf& { return DV ? q_r[b][c] : q_m[b * dv + c]; };
  for (int b = 0; b < HB; ++b)
    for (int64_t c = 0; c < dv; ++c) qv(b, c) = load_row<kFullD>(q_heads[b] + c * kLanes, d - c * kLanes);
  for (int64_t kp = lo; kp < std::min(lo + kAhead, pos + 1); ++kp) prefetch_row(k + slot[kp] * k_stride, d, _MM_HINT_T0);
  // Rows sit in blocks anywhere in the pool: their loads are prefetched a few keys ahead (and the V
  // rows during the score pass), or every row's first load waits on memory.
  for (int64_t kp = lo; kp <= pos; ++kp) {
    if (kp + kAhead <= pos) prefetch_row(k + slot[kp + kAhead] * k_stride, d, _MM_HINT_T0);
    prefetch_row(v + slot[kp] * v_stride, e, _MM_HINT_T1);
    const C* kr = k + slot[kp] * k_stride;
    vf dot[HB];
    for (int b = 0; b < HB; ++b) dot[b] = zero();
    for (int64_t c = 0; c < dv; ++c) {
      const vf kc = load_row<kFullD>(kr + c * kLanes, d - c * kLanes);
      for (int b = 0; b < HB; ++b) dot[b] = fmadd(qv(b, c), kc, dot[b]);
    }
    for (int b = 0; b < HB; ++b) {
      const float sc = reduce_add(dot[b]) * scale;
      scores[b * n + kp - lo] = sc;
      top[b] = max(top[b], set1(sc));
    }
  }
  float inv[HB];
  for (int b = 0; b < HB; ++b) {
    float* sb = scores.data() + b * n;
    vf sum = zero();
    for (int64_t j = 0; j < n; j += kLanes) {
      const Mask mask = lanes_below(n - j);
      const vf ex = exp_ps(sub(load(sb + j, mask), top[b]));
      store(sb + j, ex, mask);
      sum = add(sum, keep(mask, ex));
    }
    inv[b] = 1.f / reduce_add(sum);
  }
  // Values: each V row converted once, added into every head's accumulators.
  vf acc_r[HB][EV ? EV : 1];
  std::unique_ptr<vf[]> acc_m(EV ? nullptr : new vf[HB * ev]);
  auto acc = [&](int b, int64_t c) -> vf& { return EV ? acc_r[b][c] : acc_m[b * ev + c]; };
  for (int b = 0; b < HB; ++b)
    for (int64_t c = 0; c < ev; ++c) acc(b, c) = zero();
  for (int64_t kp = lo; kp <= pos; ++kp) {
    if (kp + kAhead <= pos) prefetch_row(v + slot[kp + kAhead] * v_stride, e, _MM_HINT_T0);
    const C* vr = v + slot[kp] * v_stride;
    vf p[HB];
    for (int b = 0; b < HB; ++b) p[b] = set1(scores[b * n + kp - lo]);
    for (int64_t c = 0; c < ev; ++c) {
      const vf vc = load_row<kFullE>(vr + c * kLanes, e - c * kLanes);
      for (int b = 0; b < HB; ++b) acc(b, c) = fmadd(p[b], vc, acc(b, c));
    }
  }
  for (int b = 0; b < HB; ++b)
    for (int64_t c = 0; c < ev; ++c) {
      const vf o = mul(acc(b, c), set1(inv[b]));
      store(out_heads[b] + c * kLanes, o, lanes_below(e - c * kLanes));
    }
}

// Causal attention of each sequence's new tokens over its cached context, read in place from the
// paged cache. Sequence i's queries are rows [starts[i], starts[i+1]) at positions
// lens[i] - (starts[i+1] - starts[i]) onwards; its key position k lives in slot slots[i, k].
// Each (sequence, KV head) is one task. Scores, softmax and the weighted sum of values are fp32,
// in key order, the same for any batch.
template <typename Q, typename C, int DV, int EV>
void paged_attention_impl(const at::Tensor& q_THd, const at::Tensor& k_SGd, const at::Tensor& v_SGe,
                          const int64_t* starts, const int64_t* lens, const int64_t* slots, int64_t X, int64_t N,
                          double scale, int64_t window, at::Tensor& out_THe) {
  const int64_t H = q_THd.size(1), d = q_THd.size(2), G = k_SGd.size(1), e = v_SGe.size(2), h = H / G;
  const Q* q = q_THd.data_ptr<Q>();
  Q* out = out_THe.data_ptr<Q>();
  const C* k_cache = k_SGd.data_ptr<C>();
  const C* v_cache = v_SGe.data_ptr<C>();
  at::parallel_for(0, N * G, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / G, g = t % G, rows = starts[i + 1] - starts[i], first = lens[i] - rows;
      const C* k = k_cache + g * k_SGd.stride(1);
      const C* v = v_cache + g * v_SGe.stride(1);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = first + r, lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const int64_t row = starts[i] + r;
        for (int64_t hh = 0; hh < h; hh += 2) {
          const Q* q_heads[2];
          Q* out_heads[2];
          for (int b = 0; b < 2 && hh + b < h; ++b) {
            q_heads[b] = q + row * q_THd.stride(0) + (g * h + hh + b) * q_THd.stride(1);
            out_heads[b] = out + row * out_THe.stride(0) + (g * h + hh + b) * out_THe.stride(1);
          }
          if (hh + 1 < h)
            attend_row<Q, C, 2, DV, EV>(q_heads, out_heads, k, k_SGd.stride(0), v, v_SGe.stride(0), slots + i * X, lo,
                                     pos, d, e, float(scale), scores);
          else
            attend_row<Q, C, 1, DV, EV>(q_heads, out_heads, k, k_SGd.stride(0), v, v_SGe.stride(0), slots + i * X, lo,
                                     pos, d, e, float(scale), scores);
        }
      }
    }
  });
}

template <typename Q, typename C>
void paged_attention_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* starts,
                              const int64_t* lens, const int64_t* slots, int64_t X, int64_t N, double scale,
                              int64_t window, at::Tensor& out) {
  const int64_t d = q.size(2), e = v.size(2);
  if (d == 64 && e == 64)
    paged_attention_impl<Q, C, 4, 4>(q, k, v, starts, lens, slots, X, N, scale, window, out);
  else if (d == 128 && e == 128)
    paged_attention_impl<Q, C, 8, 8>(q, k, v, starts, lens, slots, X, N, scale, window, out);
  else
    paged_attention_impl<Q, C, 0, 0>(q, k, v, starts, lens, slots, X, N, scale, window, out);
}

at::Tensor paged_attention(const at::Tensor& q_THd, const at::Tensor& k_SGd, const at::Tensor& v_SGe,
                           const at::Tensor& query_starts, const at::Tensor& seq_lens, const at::Tensor& slots_NX,
                           double scale, int64_t window) {
  TORCH_CHECK((k_SGd.scalar_type() == at::kBFloat16 || is_float(k_SGd)) && k_SGd.device().is_cpu() &&
                  v_SGe.scalar_type() == k_SGd.scalar_type() && v_SGe.device().is_cpu(),
              "paged_attention: the key and value caches must be both bfloat16 or both float32 CPU tensors");
  TORCH_CHECK(is_float(q_THd) || q_THd.scalar_type() == k_SGd.scalar_type(),
              "paged_attention: q must be float32 or the cache's dtype");
  TORCH_CHECK(q_THd.dim() == 3 && k_SGd.dim() == 3 && v_SGe.dim() == 3 && q_THd.stride(2) == 1 &&
                  k_SGd.stride(2) == 1 && v_SGe.stride(2) == 1 && q_THd.size(2) == k_SGd.size(2) &&
                  q_THd.size(1) % k_SGd.size(1) == 0 && k_SGd.size(1) == v_SGe.size(1),
              "paged_attention: shapes do not match");
  auto starts = query_starts.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  auto slots = slots_NX.to(at::kLong).contiguous();
  const int64_t N = lens.numel(), X = slots.size(1);
  TORCH_CHECK(starts.numel() == N + 1 && slots.size(0) == N, "paged_attention: one length and slot row per sequence");
  for (int64_t i = 0; i < N; ++i) {
    const int64_t rows = starts.data_ptr<int64_t>()[i + 1] - starts.data_ptr<int64_t>()[i];
    TORCH_CHECK(rows >= 0 && rows <= lens.data_ptr<int64_t>()[i] && lens.data_ptr<int64_t>()[i] <= X,
                "paged_attention: a sequence's queries or length do not fit its slots");
  }
  auto out = at::zeros({q_THd.size(0), q_THd.size(1), v_SGe.size(2)}, q_THd.options());
  if (N == 0) return out;
  TORCH_CHECK(starts.data_ptr<int64_t>()[N] <= q_THd.size(0), "paged_attention: more queries than rows");
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
  if (is_float(k_SGd))
    paged_attention_dispatch<float, float>(q_THd, k_SGd, v_SGe, st, ln, sl, X, N, scale, window, out);
  else if (is_float(q_THd))
    paged_attention_dispatch<float, at::BFloat16>(q_THd, k_SGd, v_SGe, st, ln, sl, X, N, scale, window, out);
  else
    paged_attention_dispatch<at::BFloat16, at::BFloat16>(q_THd, k_SGd, v_SGe, st, ln, sl, X, N, scale, window, out);
  return out;
}

// The elementwise kernels below replace chains of small torch ops (RMSNorm is eight, rotary twelve,
// each a dispatch and a new tensor): at decode sizes the chains, not the arithmetic, were the cost.

template <typename T>
inline vf load_as_stored(const float* p, Mask mask) {  // a table value as a T op would see it
  const vf v = load(p, mask);
  return std::is_same_v<T, at::BFloat16> ? round_bf16(v) : v;
}

// y = weight · T(x / rms(x)) per row, the rms in fp32: torch's `w * (x32 * rsqrt(mean(x32²) + eps)).to(T)`.
template <typename T>
void rms_norm_impl(const at::Tensor& x_MD, const at::Tensor& w_D, double eps, at::Tensor& y_MD) {
  const int64_t M = x_MD.size(0), D = x_MD.size(1), ldx = x_MD.stride(0);
  const T* x = x_MD.data_ptr<T>();
  const T* w = w_D.data_ptr<T>();
  T* y = y_MD.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * ldx;
      vf sum = zero();
      for (int64_t c = 0; c < D; c += kLanes) {
        const vf v = load(xr + c, lanes_below(D - c));
        sum = fmadd(v, v, sum);
      }
      const vf inv = set1(1.f / std::sqrt(reduce_add(sum) / float(D) + float(eps)));
      for (int64_t c = 0; c < D; c += kLanes) {
        const Mask mask = lanes_below(D - c);
        vf normed = mul(load(xr + c, mask), inv);
        if constexpr (std::is_same_v<T, at::BFloat16>) normed = round_bf16(normed);
        store(y + m * D + c, mul(load(w + c, mask), normed), mask);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_MD, const at::Tensor& w_D, double eps) {
  TORCH_CHECK(x_MD.dim() == 2 && x_MD.stride(1) == 1 && w_D.dim() == 1 && w_D.is_contiguous() &&
                  w_D.size(0) == x_MD.size(1) && x_MD.scalar_type() == w_D.scalar_type(),
              "rms_norm: x must be [M, D] rows and the weight [D], of one dtype");
  auto y = at::empty({x_MD.size(0), x_MD.size(1)}, x_MD.options());
  if (is_float(x_MD))
    rms_norm_impl<float>(x_MD, w_D, eps, y);
  else
    rms_norm_impl<at::BFloat16>(x_MD, w_D, eps, y);
  return y;
}

// Rotary embedding of x [T, H, r] at positions_T, with fp32 cos/sin tables [X, r] rounded to T as
// torch's `.to(x.dtype)` would; the products are summed in fp32 and rounded once. Halves: pairs
// (i, i + r/2); interleaved: pairs (2i, 2i + 1), evens written first, then odds.
template <typename T>
void rotary_impl(const at::Tensor& x_THr, const at::Tensor& cos_Xr, const at::Tensor& sin_Xr, const int64_t* pos,
                 bool interleaved, at::Tensor& y_THr) {
  const int64_t T_ = x_THr.size(0), H = x_THr.size(1), r = x_THr.size(2), half = r / 2;
  const T* x = x_THr.data_ptr<T>();
  T* y = y_THr.data_ptr<T>();
  const float *cos = cos_Xr.data_ptr<float>(), *sin = sin_Xr.data_ptr<float>();
  at::parallel_for(0, T_ * H, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = t / H, head = t % H;
      const T* xr = x + row * x_THr.stride(0) + head * x_THr.stride(1);
      T* yr = y + t * r;
      const float *c = cos + pos[row] * r, *s = sin + pos[row] * r;
      if (interleaved) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = float(xr[2 * i]), x2 = float(xr[2 * i + 1]);
          const float ci = float(T(c[i])), si = float(T(s[i]));
          yr[i] = T(x1 * ci - x2 * si);
          yr[half + i] = T(x2 * ci + x1 * si);
        }
        continue;
      }
      for (int64_t i = 0; i < half; i += kLanes) {
        const Mask mask = lanes_below(half - i);
        const vf x1 = load(xr + i, mask), x2 = load(xr + half + i, mask);
        const vf c1 = load_as_stored<T>(c + i, mask), s1 = load_as_stored<T>(s + i, mask);
        const vf c2 = load_as_stored<T>(c + half + i, mask), s2 = load_as_stored<T>(s + half + i, mask);
        store(yr + i, fmsub(x1, c1, mul(x2, s1)), mask);
        store(yr + half + i, fmadd(x2, c2, mul(x1, s2)), mask);
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x_THr, const at::Tensor& cos_Xr, const at::Tensor& sin_Xr,
                  const at::Tensor& positions_T, bool interleaved) {
  TORCH_CHECK(x_THr.dim() == 3 && x_THr.stride(2) == 1 && x_THr.size(2) % 2 == 0, "rotary: x must be [T, H, r], r even");
  TORCH_CHECK(is_float(cos_Xr) && is_float(sin_Xr) && cos_Xr.is_contiguous() && sin_Xr.is_contiguous() &&
                  cos_Xr.sizes() == sin_Xr.sizes() && cos_Xr.size(1) == x_THr.size(2),
              "rotary: the tables must be float32 [X, r]");
  auto pos = positions_T.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == x_THr.size(0), "rotary: one position per row");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < cos_Xr.size(0), "rotary: position ", p[i], " is outside the table");
  auto y = at::empty({x_THr.size(0), x_THr.size(1), x_THr.size(2)}, x_THr.options());
  if (is_float(x_THr))
    rotary_impl<float>(x_THr, cos_Xr, sin_Xr, p, interleaved, y);
  else
    rotary_impl<at::BFloat16>(x_THr, cos_Xr, sin_Xr, p, interleaved, y);
  return y;
}

}  // namespace

TORCH_LIBRARY(moeshard_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, int N, bool fp32_out) -> Tensor");
  m.def("grouped_swiglu(Tensor x, Tensor w13, Tensor w2, Tensor group_ends) -> Tensor");
  m.def("linear_quantized(Tensor x, Tensor values, Tensor scale, Tensor? zero, str kind, int group, int N, "
        "bool fp32_out, bool int8_activations) -> Tensor");
  m.def("grouped_swiglu_quantized(Tensor x, Tensor values13, Tensor scale13, Tensor? zero13, Tensor values2, "
        "Tensor scale2, Tensor? zero2, str kind, int group, Tensor group_ends, bool int8_activations) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_starts, Tensor seq_lens, "
        "Tensor slots, float scale, int window) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(moeshard_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("grouped_swiglu", &grouped_swiglu);
  m.impl("linear_quantized", &linear_quantized);
  m.impl("grouped_swiglu_quantized", &grouped_swiglu_quantized);
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}
