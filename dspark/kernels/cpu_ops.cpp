// CPU kernels for the few-row steps (batch-1 decode, short verification and draft blocks), where
// torch's general kernels pay more in dispatch and poor GEMV bandwidth than the arithmetic costs.
// Activations are fp32; the products take fp32 weights or, with AVX512-BF16, bf16 weights (the input
// rows rounded to bf16 first, VDPBF16PS: exact products, fp32 sums — twice the FMA's arithmetic per
// instruction and half the weight bytes) — on AVX2 bf16 weights widened to fp32 against the fp32 input
// (BF16W: the bf16 model's exact fp32 product, half the weight bytes) — or, with AVX2 + FMA + F16C, a
// GGUF's own Q4_1 blocks (input quantized to Q8_1 blocks: integer dot products, as llama.cpp) and Q8_0
// blocks (fp32 input), repacked by
// dspark.kernels ("Q4_1 products", "Q8_0 products" below):
//
//   small_mm(x, w)                 x[M, K] @ w[N, K]^T (chunks of 128 rows): passes of up to 12 rows (R rows x M
//                                  accumulators in vector registers) over L2-sized tiles of weight rows;
//                                  parallel over output rows.
//   rms_norm(x, w, eps)            y = x / rms(x) * w, one pass per row.
//   add_rms_norm_(x, r, w, eps)    r += x in place, returns rms_norm(r) (the residual add fused in).
//   short_attention(...)           paged attention for short queries: each query reads its request's keys
//                                  straight from the pool through the slot table, up to a per-query key
//                                  limit (causal or block-bidirectional); scores, one vectorised exp pass,
//                                  then the weighted values in registers; GQA.
//   decoder_layers_(...)           every Llama/Qwen3 decoder layer of a decode/verify step in one call and
//                                  one OpenMP region (the ops above + RoPE, K/V store, SiLU), bit-identical
//                                  to the per-layer modules.
//
// Threads come from torch's OpenMP runtime (at::parallel_for, or one `omp parallel` region for the
// decoder stack), so no second pool spins against it. The Python side (dspark/kernels/__init__.py)
// builds this file once per machine and keeps a torch twin of every op for the tests.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <omp.h>
#include <utility>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#else
struct vec { float v[4]; };
constexpr int kLanes = 4;
inline vec vzero() { return vec{{0.f, 0.f, 0.f, 0.f}}; }
inline vec vload(const float* p) { return vec{{p[0], p[1], p[2], p[3]}}; }
inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < 4; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float vsum(vec v) { return v.v[0] + v.v[1] + v.v[2] + v.v[3]; }
inline vec vset1(float a) { return vec{{a, a, a, a}}; }
inline vec vmul(vec a, vec b) { return vec{{a.v[0] * b.v[0], a.v[1] * b.v[1], a.v[2] * b.v[2], a.v[3] * b.v[3]}}; }
inline void vstore(float* p, vec v) { for (int i = 0; i < 4; ++i) p[i] = v.v[i]; }
#endif

#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // the sum of an AVX2 vector's 8 lanes (Q4_1 / Q8_0 products)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int64_t kPrefetch = 1024;  // floats ahead of the current load, per weight row
constexpr int kRegs = kLanes == 16 ? 32 : 16;  // vector registers (AVX-512: 32, AVX2: 16)

// Rows per block: the most of 8, 4, 3, 2, 1 whose R x M accumulators + R weight vectors + 1 input vector
// fit in the registers (more rows in flight = more memory streams per thread).
template <int M>
constexpr int rows_per_block() {
  for (int r : {8, 4, 3, 2})
    if (r * M + r + 1 <= kRegs) return r;
  return 1;
}

// How a product's elements are loaded and multiplied: fp32 (one FMA per element pair), and with
// AVX512-BF16 bf16 (VDPBF16PS: 32 element pairs per instruction into 16 fp32 sums, each product exact in
// fp32 — twice the FMA's arithmetic and half its weight bytes). `step`: elements per vector.
// `elem` is the weights' element and `xelem` the input's (the same but for BF16W).
struct F32 {
  using elem = float;
  using xelem = float;
  using evec = vec;
  using xvec = vec;
  static constexpr int step = kLanes;
  static evec load(const float* p) { return vload(p); }
  static xvec xload(const float* p) { return vload(p); }
  static vec fma(vec acc, evec w, xvec x) { return vfma(w, x, acc); }
  static float value(float v) { return v; }
  static float xvalue(float v) { return v; }
};

using bf16 = at::BFloat16;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHasBf16 = true;
struct BF16 {
  using elem = bf16;
  using xelem = bf16;
  using evec = __m512bh;
  using xvec = __m512bh;
  static constexpr int step = 32;
  static evec load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static xvec xload(const bf16* p) { return load(p); }
  static vec fma(vec acc, evec w, xvec x) { return _mm512_dpbf16_ps(acc, w, x); }
  static float value(bf16 v) { return static_cast<float>(v); }  // exact widening
  static float xvalue(bf16 v) { return static_cast<float>(v); }
};

// fp32 -> bf16, round to nearest even (VCVTNEPS2BF16, also for the tail, so every element of a row is
// rounded the same way wherever the row sits).
inline void to_bf16(const float* x, bf16* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(y + i, mask, v);
  }
}
#else
constexpr bool kHasBf16 = false;
struct BF16 {  // compiles the bf16 paths; never called: every bf16 entry point checks kHasBf16 first
  using elem = bf16;
  using xelem = bf16;
  using evec = vec;
  using xvec = vec;
  static constexpr int step = kLanes;
  static evec load(const bf16*) { return vzero(); }
  static xvec xload(const bf16*) { return vzero(); }
  static vec fma(vec acc, evec, xvec) { return acc; }
  static float value(bf16 v) { return static_cast<float>(v); }
  static float xvalue(bf16 v) { return static_cast<float>(v); }
};
inline void to_bf16(const float*, bf16*, int64_t) {}
#endif

// bf16 weights, fp32 input, without bf16 dot products (AVX2 + FMA, no AVX-512): each weight widened
// exactly (a 16-bit shift) and multiplied by the input as in F32 — the fp32 product of the bf16 weights,
// in half F32's weight bytes (the few-row products are bound by those bytes). DSpark drafters ship bf16.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kHasBf16W = true;
struct BF16W {
  using elem = bf16;
  using xelem = float;
  using evec = vec;
  using xvec = vec;
  static constexpr int step = kLanes;
  static evec load(const bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static xvec xload(const float* p) { return vload(p); }
  static vec fma(vec acc, evec w, xvec x) { return vfma(w, x, acc); }
  static float value(bf16 v) { return static_cast<float>(v); }
  static float xvalue(float v) { return v; }
};
#else
constexpr bool kHasBf16W = false;
struct BF16W : F32 {  // never called: small_mm checks kHasBf16W first
  using elem = bf16;
  static evec load(const bf16*) { return vzero(); }
  static float value(bf16 v) { return static_cast<float>(v); }
};
#endif

// Output rows [n, n + R) for all M input rows, x [M, K] and w [N, K] row-major in the elements of T.
template <typename T, int M, int R>
inline void block(const typename T::xelem* x, const typename T::elem* w, float* out, int64_t K, int64_t N,
                  int64_t n) {
  constexpr int64_t prefetch = kPrefetch * 4 / sizeof(typename T::elem);  // the same bytes ahead in any type
  vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + T::step <= K; k += T::step) {
    typename T::evec wv[R];
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(w + (n + r) * K + k + prefetch, 0, 1);  // to L2: measured best of 0-3
      wv[r] = T::load(w + (n + r) * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const typename T::xvec xv = T::xload(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = T::fma(acc[r][m], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += T::value(w[(n + r) * K + kk]) * T::xvalue(x[m * K + kk]);
      out[m * N + n + r] = s;
    }
  }
}

template <typename T, int M>
void rows(const typename T::xelem* x, const typename T::elem* w, float* out, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  constexpr int R = rows_per_block<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<T, M, R>(x, w, out, K, N, n);
  for (; n < n1; ++n) block<T, M, 1>(x, w, out, K, N, n);
}

template <typename T>
using RowsFn = void (*)(const typename T::xelem*, const typename T::elem*, float*, int64_t, int64_t, int64_t,
                        int64_t);
// One pass serves up to kPassRows input rows (beyond that the accumulators no longer fit and the pass
// gets slower than two); up to kMaxRows rows run as balanced passes. Against BLAS on all of SmolLM2's
// weights (ms, one process): 8 rows 22 vs 42, 16 31 vs 52, 32 57 vs 74, 48 92 vs 98, 64 124 vs 127,
// 96 182 vs 169, 128 232 vs 216. The limit is 128 rather than where BLAS overtakes (~70) so that the
// one-call decoder stack (decoder_layers_, same products) serves verification steps up to 128 rows: above
// its limit a step falls to the per-layer path, which cost a 56-row step 212 ms against 162 fused.
constexpr int kPassRows = 12;
constexpr int kMaxRows = 128;
template <typename T>
constexpr RowsFn<T> kRows[kPassRows] = {rows<T, 1>, rows<T, 2>, rows<T, 3>, rows<T, 4>,  rows<T, 5>,  rows<T, 6>,
                                        rows<T, 7>, rows<T, 8>, rows<T, 9>, rows<T, 10>, rows<T, 11>, rows<T, 12>};

// Output columns [n0, n1) of out[M, N] = x[M, K] @ w[N, K]^T, M in 1..kMaxRows, in balanced passes of
// <= 12 rows over tiles of weight rows that stay in L2 (~256 KB): the first pass streams a tile from
// memory, the others re-read it from cache. Every output element is the same K-ordered sum whatever M,
// the pass split or the tile, so a row's result never depends on the other rows of the batch.
// The walk of mm_cols and the quantized products: balanced passes of <= `pass_rows` input rows over tiles
// of weight rows [t0, t1) of ~256 KB (`row_bytes` each); pass(m0, rows, t0, t1) for each.
template <typename Pass>
inline void passes_over_tiles(int64_t M, int64_t pass_rows, int64_t row_bytes, int64_t n0, int64_t n1, Pass&& pass) {
  const int64_t passes = (M + pass_rows - 1) / pass_rows, per_pass = (M + passes - 1) / passes;
  const int64_t tile = passes == 1 ? n1 - n0 : std::max<int64_t>(16, (1 << 18) / row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += per_pass) pass(m0, std::min(per_pass, M - m0), t0, t1);
  }
}

template <typename T>
void mm_cols(const typename T::xelem* xp, int64_t M, int64_t K, const typename T::elem* wp, int64_t N, float* op,
             int64_t n0, int64_t n1) {
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(typename T::elem));
  passes_over_tiles(M, kPassRows, row_bytes, n0, n1, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    kRows<T>[rows - 1](xp + m0 * K, wp, op + m0 * N, K, N, t0, t1);
  });
}

// out[M, N] = x[M, K] @ w[N, K]^T for M in 1..kMaxRows, raw row-major pointers; parallel over N.
template <typename T>
void mm_into(const typename T::xelem* xp, int64_t M, int64_t K, const typename T::elem* wp, int64_t N, float* op) {
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(typename T::elem));
  const int64_t grain = std::max<int64_t>(64, (1 << 18) / row_bytes);  // >= ~256 KB of weights per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { mm_cols<T>(xp, M, K, wp, N, op, n0, n1); });
}

// A parallel_for grain that gives each thread one even share of n items (at least `at_least`: 16 weight rows,
// or 1 tile of 8 for Q4_1): for the quantized
// products, whose short rows would make a byte-sized grain leave a thread idle on 576-row matrices.
inline int64_t even_grain(int64_t n, int64_t at_least = 16) {
  const int64_t threads = std::max(1, at::get_num_threads());
  return std::max<int64_t>(at_least, (n + threads - 1) / threads);
}

// [begin, end) of thread `tid`'s share of n items, boundaries on multiples of `align`.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  return {std::min(n, units * tid / nt * align), std::min(n, units * (tid + 1) / nt * align)};
}

// A spinning barrier for the threads of one parallel region (libgomp's own barrier may sleep between
// the ~240 phases of a decode step; waking a thread costs more than the phase).
class SpinBarrier {
 public:
  void wait(int num_threads) {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == num_threads - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (gen_.load(std::memory_order_acquire) == gen) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    }
  }

 private:
  std::atomic<int> count_{0}, gen_{0};
};


// ---------------------------------------------------------------------------------------- Q4_1 products
// Weights kept in llama.cpp's Q4_1 blocks (32 weights: w_i = d * q_i + m, q_i in 0..15, d and m fp16) against
// the input quantized as llama.cpp's Q8_1 blocks (32 inputs: x_i ~ e * p_i, p_i = round(x_i / e) to nearest
// even in -127..127, e = max |x_i| / 127, fp32): the product of llama.cpp's Q4_1 x Q8_1 dot,
//   sum_b (d_b e_b) * (sum_i q_i p_i) + m_b * (e_b sum_i p_i)
// over the blocks b of a row, the integer sums exact (VPMADDUBSW, int16 sums of at most 16 products
// |15 * 127| each, then VPMADDWD), the fp32 sums over the blocks in order whatever the batch.
// Packed (dspark.kernels.pack_q4_1) in tiles of 8 weight rows, so that a vector's lanes are 8 output rows
// and no horizontal sum is needed: a tile's block b is 160 bytes: 4 units of 32 bytes (unit u: bytes
// 4 u .. 4 u + 3 of each of the 8 rows' 16 GGUF nibble bytes, row after row; byte j holds q_j low and q_{j+16}
// high), then the 8 rows' d, then their m (fp16). AVX2 builds (q4_1_group_rows 8): tile t (rows 8 t .. 8 t + 7)
// is 8 row-lengths of bytes, its blocks in order. AVX512-VNNI builds (q4_1_group_rows 16): groups of 16 rows,
// the two tiles of a group interleaved: per block b 320 bytes, each unit of the first tile then the same unit of
// the second (one 64-byte vector), then the 16 rows' d, then their m; so a pair of tiles multiplied together
// streams its bytes in order (two tiles read side by side from two places made steps of 2-8 rows 1.3-1.6x slower
// than single tiles: the prefetchers follow one stream) and loads each unit pair whole. An odd last tile
// (N = 16 g + 8) keeps the plain layout.
// K * 10 / 16 bytes a row as in the GGUF; N a multiple of 8. An input row is quantized once per product
// (q4_prepare): its p in order and per block [e, e sum p]. AVX2 + FMA + F16C; with AVX512-VNNI a group's two
// tiles are multiplied at once (q4_tile_pair: the same sums bit for bit). The Python side checks
// has_q4_1 and keeps the torch twin (kernels.q8_1_dequantized: the input as its Q8_1 values).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DSPARK_Q4_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(DSPARK_Q4_NO_VNNI)
#define DSPARK_Q4_VNNI 1  // pairs of tiles in 512-bit vectors, the integer sums by VPDPBUSD (q4_tile_pair)
constexpr bool kQ4Vnni = true;
#else
constexpr bool kQ4Vnni = false;
#endif
constexpr bool kHasQ4 = true;
#else
constexpr bool kQ4Vnni = false;
constexpr bool kHasQ4 = false;
#endif
constexpr int64_t kQ4GroupRows = kQ4Vnni ? 16 : 8;  // rows a packing group holds (see above)
constexpr int64_t kQ4BlockBytes = 20, kQ4TileRows = 8;
constexpr int64_t kQ4GroupBlockBytes = 2 * kQ4TileRows * kQ4BlockBytes;  // a block of a 16-row group
inline int64_t q4_row_bytes(int64_t K) { return K / 32 * kQ4BlockBytes; }
// K from a packed row's byte count (0 when no multiple of 32 gives it)
inline int64_t q4_cols(int64_t row_bytes) { return row_bytes % kQ4BlockBytes == 0 ? row_bytes / kQ4BlockBytes * 32 : 0; }

#if defined(DSPARK_Q4_AVX2)
// x [M, K] rows [m0, m1) -> xq [M, K] int8 p and meta [M, K / 16]: per block e, e sum p.
inline void q4_prepare(const float* x, int64_t m0, int64_t m1, int64_t K, int8_t* xq, float* meta) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* v = x + m * K + 32 * b;
      __m256 xs[4];
      __m256 amax = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        xs[c] = _mm256_loadu_ps(v + 8 * c);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, xs[c]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float e = _mm_cvtss_f32(h) / 127.0f, inv = e != 0.0f ? 1.0f / e : 0.0f;
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i p[4];
      for (int c = 0; c < 4; ++c)
        p[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(xs[c], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
      __m128i psum4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      psum4 = _mm_hadd_epi32(psum4, psum4);
      psum4 = _mm_hadd_epi32(psum4, psum4);
      const __m256i q = _mm256_permutevar8x32_epi32(  // p_0 .. p_31 in order
          _mm256_packs_epi16(_mm256_packs_epi32(p[0], p[1]), _mm256_packs_epi32(p[2], p[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + 32 * b), q);
      meta[m * (K / 16) + 2 * b] = e;
      meta[m * (K / 16) + 2 * b + 1] = e * static_cast<float>(_mm_cvtsi128_si32(psum4));
    }
}

// Tile of 8 output rows [n, n + 8) for M prepared input rows.
template <int M>
inline void q4_tile(const int8_t* xq, const float* meta, const uint8_t* tile, float* out, int64_t K, int64_t N,
                    int64_t n) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = tile + b * kQ4TileRows * kQ4BlockBytes;
    __builtin_prefetch(p + 4 * kQ4TileRows * kQ4BlockBytes, 0, 1);
    __builtin_prefetch(p + 4 * kQ4TileRows * kQ4BlockBytes + 64, 0, 1);
    __builtin_prefetch(p + 4 * kQ4TileRows * kQ4BlockBytes + 128, 0, 1);
    __m256i lo[4], hi[4];  // unit u: q_{4u .. 4u+3} and q_{16+4u .. 16+4u+3} of the 8 rows
    for (int u = 0; u < 4; ++u) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * u));
      lo[u] = _mm256_and_si256(w, low4);
      hi[u] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    }
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 128)));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 144)));
    for (int m = 0; m < M; ++m) {
      const int8_t* xb = xq + m * K + 32 * b;
      const auto bcast = [&](int j) {  // p_j .. p_{j+3} in every 32-bit lane
        int32_t v;
        std::memcpy(&v, xb + j, 4);
        return _mm256_set1_epi32(v);
      };
      __m256i s = _mm256_maddubs_epi16(lo[0], bcast(0));
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast(16)));
      for (int u = 1; u < 4; ++u) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[u], bcast(4 * u)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[u], bcast(16 + 4 * u)));
      }
      const float* em = meta + m * (K / 16) + 2 * b;
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));  // the 8 rows' sum_i q_i p_i
      acc[m] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d8, _mm256_set1_ps(em[0])), acc[m]);
      acc[m] = _mm256_fmadd_ps(m8, _mm256_set1_ps(em[1]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * N + n, acc[m]);
}
#else
inline void q4_prepare(const float*, int64_t, int64_t, int64_t, int8_t*, float*) {}
template <int M>
inline void q4_tile(const int8_t*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t) {}
#endif

#if defined(DSPARK_Q4_VNNI)
// A group's two tiles, 16 output rows [n, n + 16), in the halves of 512-bit vectors: each broadcast input
// and per-block scale serves 16 rows. Lane for lane the same operations as q4_tile (the same results, bit for
// bit); out's rows n .. n + 15 are contiguous, so one store per input row.
template <int M>
inline void q4_tile_pair(const int8_t* xq, const float* meta, const uint8_t* group, float* out, int64_t K, int64_t N,
                         int64_t n) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = group + b * kQ4GroupBlockBytes;
    for (int64_t ahead = 0; ahead < kQ4GroupBlockBytes; ahead += 64)
      __builtin_prefetch(p + 4 * kQ4GroupBlockBytes + ahead, 0, 1);
    __m512i lo[4], hi[4];  // unit u of both tiles: the first's 32 bytes, then the second's
    for (int u = 0; u < 4; ++u) {
      const __m512i w = _mm512_loadu_si512(p + 64 * u);
      lo[u] = _mm512_and_si512(w, low4);
      hi[u] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
    }
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    for (int m = 0; m < M; ++m) {
      const int8_t* xb = xq + m * K + 32 * b;
      const auto bcast = [&](int j) {
        int32_t v;
        std::memcpy(&v, xb + j, 4);
        return _mm512_set1_epi32(v);
      };
      // VPDPBUSD: 4 products a lane straight into int32 (exact), in 4 independent chains of 2 (one chain of 8
      // waits on its latency), then summed: integers, so the very sums of q4_tile's VPMADDUBSW + VPMADDWD
      __m512i s[4];
      for (int c = 0; c < 4; ++c) {
        const int u = c >> 1;
        s[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c & 1 ? hi[u] : lo[u], bcast((c & 1) * 16 + 4 * u));
      }
      for (int c = 0; c < 4; ++c) {
        const int u = 2 + (c >> 1);
        s[c] = _mm512_dpbusd_epi32(s[c], c & 1 ? hi[u] : lo[u], bcast((c & 1) * 16 + 4 * u));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
      const float* em = meta + m * (K / 16) + 2 * b;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d16, _mm512_set1_ps(em[0])), acc[m]);
      acc[m] = _mm512_fmadd_ps(m16, _mm512_set1_ps(em[1]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * N + n, acc[m]);
}
#else
template <int M>
inline void q4_tile_pair(const int8_t*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t) {}
#endif

using Q4TileFn = void (*)(const int8_t*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t);
// Input rows a pass serves: 8 (8 unpacked weight vectors + the scales + an accumulator per input row spill a
// few registers, but one pass of 5-8 rows beats two: SmolLM2's layer products at 5 / 6 rows 1.09 / 1.20x
// faster than passes of <= 4, equal at 4, 8 and 16 rows; benchmarks/bench_q4_kernel.py --base 932a229).
constexpr int64_t kQ4PassRows = 8;
constexpr Q4TileFn kQ4Tiles[kQ4PassRows] = {q4_tile<1>, q4_tile<2>, q4_tile<3>, q4_tile<4>,
                                            q4_tile<5>, q4_tile<6>, q4_tile<7>, q4_tile<8>};
constexpr Q4TileFn kQ4Pairs[kQ4PassRows] = {q4_tile_pair<1>, q4_tile_pair<2>, q4_tile_pair<3>, q4_tile_pair<4>,
                                            q4_tile_pair<5>, q4_tile_pair<6>, q4_tile_pair<7>, q4_tile_pair<8>};

// Output columns [n0, n1) of out[M, N] (n0 a multiple of kQ4GroupRows, n1 too or N) for prepared inputs:
// group by group (VNNI builds: both tiles at once, whatever the rows; one input row is as fast as the AVX2
// single tiles' in-order stream, 1.00x a batch-1 step side by side) or tile by tile (AVX2, and an odd last
// tile), every pass of <= kQ4PassRows input rows over it while it is in L1 (a tile is 8 rows: K * 5 / 4 bytes).
void q4_mm_cols(const int8_t* xq, const float* meta, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* op,
                int64_t n0, int64_t n1) {
  const int64_t rb = q4_row_bytes(K), passes = (M + kQ4PassRows - 1) / kQ4PassRows, per_pass = (M + passes - 1) / passes;
  for (int64_t n = n0; n < n1;) {
    const bool group = kQ4GroupRows == 2 * kQ4TileRows && n + 2 * kQ4TileRows <= N;
    const Q4TileFn* fns = group ? kQ4Pairs : kQ4Tiles;
    for (int64_t m0 = 0; m0 < M; m0 += per_pass)
      fns[std::min(per_pass, M - m0) - 1](xq + m0 * K, meta + m0 * (K / 16), w + n * rb, op + m0 * N, K, N, n);
    n += group ? 2 * kQ4TileRows : kQ4TileRows;
  }
}

// ---------------------------------------------------------------------------------------- Q8_0 products
// Weights kept in llama.cpp's Q8_0 blocks (32 weights: w_i = d * q_i, q_i int8, d fp16), repacked per row
// (dspark.kernels.pack_q8_0) as the K int8 q, then the K / 32 scales d as fp32: K * 9 / 8 bytes a row.
// Each weight d * q is exact in fp32 (19 bits), the input stays fp32: the fp32 model's product, only
// the summation order differs (per block sum_i q_i x_i, then times d). For the LM head of a Q8_0 GGUF
// (SmolLM2's tied embedding): 1.1 bytes a weight instead of 4.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasQ8 = true;

// Output rows [n, n + R) for the M input rows x [M, K]; a row's sums run in one fixed order whatever R, M.
template <int M, int R>
inline void q8_block(const float* x, const int8_t* w, int64_t rb, float* out, int64_t K, int64_t N, int64_t n) {
  const int64_t B = K / 32;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256 t[R][M];
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(w + (n + r) * rb + 32 * b + 512, 0, 1);
      for (int m = 0; m < M; ++m) t[r][m] = _mm256_setzero_ps();
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m256 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + 32 * b + 8 * c);
      for (int r = 0; r < R; ++r) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + (n + r) * rb + 32 * b + 8 * c))));
        for (int m = 0; m < M; ++m) t[r][m] = _mm256_fmadd_ps(q, xv[m], t[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(w + (n + r) * rb + K) + b);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(t[r][m], d, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * N + n + r] = hsum8(acc[r][m]);
}
#else
constexpr bool kHasQ8 = false;
template <int M, int R>
inline void q8_block(const float*, const int8_t*, int64_t, float*, int64_t, int64_t, int64_t) {}
#endif

template <int M>
constexpr int q8_rows_per_block() {  // 2 R x M sums + M inputs + 1 weight vector fit 16 registers
  for (int r : {6, 4, 3, 2})
    if (2 * r * M + M + 1 <= 16) return r;
  return 1;
}

template <int M>
void q8_rows(const float* x, const int8_t* w, int64_t rb, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = q8_rows_per_block<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) q8_block<M, R>(x, w, rb, out, K, N, n);
  for (; n < n1; ++n) q8_block<M, 1>(x, w, rb, out, K, N, n);
}

constexpr int64_t kQ8PassRows = 4;
using Q8RowsFn = void (*)(const float*, const int8_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);
constexpr Q8RowsFn kQ8Rows[kQ8PassRows] = {q8_rows<1>, q8_rows<2>, q8_rows<3>, q8_rows<4>};

// out[M, N] for x [M, K] fp32 and Q8_0-packed w [N, K * 9 / 8]: even shares of N over the threads, passes
// of <= 4 input rows over L2-sized tiles of weight rows.
void q8_mm_into(const float* xp, int64_t M, int64_t K, const int8_t* wp, int64_t N, float* op) {
  const int64_t rb = K + K / 8;
  at::parallel_for(0, N, even_grain(N), [&](int64_t n0, int64_t n1) {
    passes_over_tiles(M, kQ8PassRows, rb, n0, n1, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
      kQ8Rows[rows - 1](xp + m0 * K, wp, rb, op + m0 * N, K, N, t0, t1);
    });
  });
}

}  // namespace

namespace {
// out[M, N] for x [M, K] fp32 and Q4_1-packed w [N, q4_row_bytes(K)]; parallel over N.
void q4_mm_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* op, const at::TensorOptions& opts) {
  torch::Tensor xq = torch::empty({M * K}, opts.dtype(at::kChar)), meta = torch::empty({M * (K / 16)}, opts);
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* mp = meta.data_ptr<float>();
  q4_prepare(xp, 0, M, K, xqp, mp);
  const int64_t groups = (N + kQ4GroupRows - 1) / kQ4GroupRows;
  at::parallel_for(0, groups, even_grain(groups, 1), [&](int64_t g0, int64_t g1) {
    q4_mm_cols(xqp, mp, M, K, wp, N, op, g0 * kQ4GroupRows, std::min(g1 * kQ4GroupRows, N));
  });
}
}  // namespace

// x [M, K] fp32 contiguous (any M >= 1), w [N, K] fp32 or bf16, or uint8 [N, q4_row_bytes(K)] Q4_1-packed
// (see "Q4_1 products"; K a multiple of 32, N of 8) -> [M, N] fp32. With Q4_1 weights x is quantized to Q8_1 blocks;
// with bf16 ones on AVX512-BF16 x is rounded to bf16 first (round to nearest even); with bf16 weights on AVX2
// (BF16W) x stays fp32. The products accumulate in fp32. More than kMaxRows rows run as consecutive chunks of
// kMaxRows written into the one output (a row's result is the one it gets in a chunk of its own: prompt
// chunks and decode steps agree), so a long prompt chunk costs no concatenation.
torch::Tensor small_mm(const torch::Tensor& x, const torch::Tensor& w) {
  const bool bf = w.scalar_type() == at::kBFloat16, q4 = w.scalar_type() == at::kByte, q8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && (q4 ? w.size(1) == q4_row_bytes(x.size(1)) && x.size(1) % 32 == 0 && w.size(0) % kQ4TileRows == 0
                                               : q8 ? w.size(1) == x.size(1) + x.size(1) / 8 && x.size(1) % 32 == 0
                                                    : x.size(1) == w.size(1)),
              "small_mm: shapes ", x.sizes(), " and ", w.sizes(), q4 ?  " (Q4_1: K a multiple of 32, K * 10 / 16 bytes a row, rows a multiple of 8: kernels.pack_q4_1)"
                                                                 : q8 ? " (Q8_0: K a multiple of 32, K * 9 / 8 bytes a row)" : "");
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || bf || q4 || q8),
              "small_mm: fp32 input and fp32, bf16, Q4_1-packed uint8 or Q8_0-packed int8 weights only");
  TORCH_CHECK(!q8 || kHasQ8, "small_mm: Q8_0 weights need a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(!bf || kHasBf16 || kHasBf16W, "small_mm: bf16 weights need a CPU with AVX512-BF16, or AVX2 + FMA");
  TORCH_CHECK(!q4 || kHasQ4, "small_mm: Q4_1 weights need a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_mm: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1, "small_mm: at least one row, got ", M);
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  torch::Tensor xb;  // the bf16-rounded input (AVX512-BF16), elementwise: rounded once for every chunk
  if (bf && kHasBf16) {
    xb = torch::empty({M, K}, x.options().dtype(at::kBFloat16));
    to_bf16(xc.data_ptr<float>(), xb.data_ptr<bf16>(), M * K);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t mc = std::min<int64_t>(kMaxRows, M - m0);
    const float* xp = xc.data_ptr<float>() + m0 * K;
    float* op = out.data_ptr<float>() + m0 * N;
    if (q8) {
      q8_mm_into(xp, mc, K, wc.data_ptr<int8_t>(), N, op);
    } else if (q4) {
      q4_mm_into(xp, mc, K, wc.data_ptr<uint8_t>(), N, op, x.options());
    } else if (bf && !kHasBf16) {  // AVX2: the fp32 input times the widened bf16 weights
      mm_into<BF16W>(xp, mc, K, wc.data_ptr<bf16>(), N, op);
    } else if (bf) {
      mm_into<BF16>(xb.data_ptr<bf16>() + m0 * K, mc, K, wc.data_ptr<bf16>(), N, op);
    } else {
      mm_into<F32>(xp, mc, K, wc.data_ptr<float>(), N, op);
    }
  }
  return out;
}

namespace {
inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": fp32 CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0), op,
              ": contiguous x[..., d] and w[d], got ", x.sizes(), " and ", w.sizes());
}

void norm_rows(const float* x, const float* w, float* y, int64_t d, float eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * inv * w[i];
}
}  // namespace

// x [..., d] -> x / rms(x) * w
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  torch::Tensor y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) norm_rows(xp + r * d, wp, yp + r * d, d, static_cast<float>(eps));
  return y;
}

// residual += x (in place); returns rms_norm(residual)
torch::Tensor add_rms_norm_(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w,
                            double eps) {
  check_rows(residual, w, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "add_rms_norm_: x ", x.sizes(), " vs residual ", residual.sizes());
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  torch::Tensor y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* rr = rp + r * d;
    for (int64_t i = 0; i < d; ++i) rr[i] += xp[r * d + i];
    norm_rows(rr, wp, yp + r * d, d, static_cast<float>(eps));
  }
  return y;
}

namespace {
void attention_items(const float* qp, const float* kp, const float* vp, float* op, int64_t H, int64_t Hkv,
                     int64_t hd, const int64_t* tip, const int64_t* klp, const int64_t* slp, int64_t Q,
                     int64_t max_kv, float sc, int64_t b0, int64_t b1);

// Paged attention of short queries on raw pointers. q/out [T, H, hd]; kp/vp [num_slots, Hkv, hd];
// tip/klp [S, Q] (flat row, key limit; limit 0 = padding); slp [S, max_kv] pool slot of each key.
void attention_into(const float* qp, const float* kp, const float* vp, float* op, int64_t H, int64_t Hkv,
                    int64_t hd, const int64_t* tip, const int64_t* klp, const int64_t* slp, int64_t S, int64_t Q,
                    int64_t max_kv, float sc) {
  at::parallel_for(0, S * Q * H, 1, [&](int64_t b0, int64_t b1) {
    attention_items(qp, kp, vp, op, H, Hkv, hd, tip, klp, slp, Q, max_kv, sc, b0, b1);
  });
}

// x[j] = exp(x[j] - m) for j < n; returns their sum. With AVX-512 sixteen at a time: exp(y) = 2^k e^r,
// k = round(y / ln 2), r = y - k ln 2 in two parts (Cody-Waite), e^r by Cephes' degree-6 polynomial
// (relative error ~2e-7, as expf), 2^k by VSCALEFPS (underflows to 0 for very negative y).
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 lowest = _mm512_set1_ps(-104.f), one = _mm512_set1_ps(1.f);
  __m512 total = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 y = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm), lowest);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(y, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, ln2_hi, y);
    r = _mm512_fnmadd_ps(k, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
    const __m512 e = _mm512_scalef_ps(p, k);
    _mm512_storeu_ps(x + j, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

#if defined(__AVX512F__)
// The dot products of one query (C vectors of 16) with 16 keys, as one vector (lane t: key t). The 16
// per-key partial vectors are summed in a transpose tree (four levels of lane shuffles and adds) instead
// of one horizontal reduction per key.
template <int C>
inline __m512 dots16(const __m512* q, const float* const* keys) {
  __m512 a[16], b[8], c[4], d[2];
  for (int t = 0; t < 16; ++t) {
    __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(keys[t]));
    for (int i = 1; i < C; ++i) acc = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(keys[t] + 16 * i), acc);
    a[t] = acc;
  }
  // b[i]: 256-bit halves = keys i, i + 8; c[i]: 128-bit quarters = keys i, i + 8, i + 4, i + 12;
  // d[i]: pairs of keys per quarter; e: one sum per lane, in the order `order` undoes
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, e);
}
#endif

// One query head against its request's keys [0, limit): scores, softmax, weighted values. HD: the head
// dim when known at compile time (the output sums then stay in registers), 0 for any.
template <int HD>
void attend(const float* qv, const float* kp, const float* vp, float* o, const int64_t* slots, int64_t limit,
            int64_t Hkv, int64_t kvh, int64_t hd, float sc, float* scores) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {  // sixteen keys at a time
    constexpr int C = HD / 16;
    __m512 q[C];
    for (int i = 0; i < C; ++i) q[i] = _mm512_loadu_ps(qv + 16 * i);
    const __m512 vsc = _mm512_set1_ps(sc);
    __m512 vmax = _mm512_set1_ps(m);
    const float* keys[16];
    for (; j + 16 <= limit; j += 16) {
      for (int t = 0; t < 16; ++t) keys[t] = kp + (slots[j + t] * Hkv + kvh) * HD;
      const __m512 scores16 = _mm512_mul_ps(dots16<C>(q, keys), vsc);
      _mm512_storeu_ps(scores + j, scores16);
      vmax = _mm512_max_ps(vmax, scores16);
    }
    m = _mm512_reduce_max_ps(vmax);
  }
#endif
  for (; j < limit; ++j) {
    scores[j] = dot(qv, kp + (slots[j] * Hkv + kvh) * hd, hd) * sc;
    m = std::max(m, scores[j]);
  }
  const float inv = 1.f / exp_shifted_sum(scores, limit, m);
  if constexpr (HD > 0 && HD % kLanes == 0) {
    constexpr int C = HD / kLanes;
    vec acc[C];
    for (int c = 0; c < C; ++c) acc[c] = vzero();
    for (int64_t j = 0; j < limit; ++j) {
      const float* vv = vp + (slots[j] * Hkv + kvh) * HD;
      const vec p = vset1(scores[j]);
      for (int c = 0; c < C; ++c) acc[c] = vfma(p, vload(vv + c * kLanes), acc[c]);
    }
    const vec vinv = vset1(inv);
    for (int c = 0; c < C; ++c) vstore(o + c * kLanes, vmul(acc[c], vinv));
  } else {
    std::fill(o, o + hd, 0.f);
    for (int64_t j = 0; j < limit; ++j) {
      const float* vv = vp + (slots[j] * Hkv + kvh) * hd;
      for (int64_t i = 0; i < hd; ++i) o[i] += scores[j] * vv[i];
    }
    for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
  }
}

// Items [b0, b1) of attention_into, b = ((s * Hkv + kvh) * Q + j) * group + g: query j of sequence s,
// head kvh * group + g. The items that read one sequence's keys and values of one KV head run in a row,
// so those stay in cache (a verification window at a long context: 8 queries x the group's heads).
void attention_items(const float* qp, const float* kp, const float* vp, float* op, int64_t H, int64_t Hkv,
                     int64_t hd, const int64_t* tip, const int64_t* klp, const int64_t* slp, int64_t Q,
                     int64_t max_kv, float sc, int64_t b0, int64_t b1) {
  const int64_t group = H / Hkv;
  std::vector<float> scores(std::max<int64_t>(max_kv, 1));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t g = b % group, j = b / group % Q, kvh = b / (group * Q) % Hkv, s = b / (group * Q * Hkv);
    const int64_t sj = s * Q + j, h = kvh * group + g;
    const int64_t limit = std::min(klp[sj], max_kv);
    if (limit <= 0) continue;
    const int64_t row = tip[sj];
    const float* qv = qp + (row * H + h) * hd;
    float* o = op + (row * H + h) * hd;
    const int64_t* slots = slp + s * max_kv;
    if (hd == 64)
      attend<64>(qv, kp, vp, o, slots, limit, Hkv, kvh, hd, sc, scores.data());
    else if (hd == 128)
      attend<128>(qv, kp, vp, o, slots, limit, Hkv, kvh, hd, sc, scores.data());
    else
      attend<0>(qv, kp, vp, o, slots, limit, Hkv, kvh, hd, sc, scores.data());
  }
}

void check_index(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), op,
              ": int64 contiguous CPU index tensors");
}
}  // namespace

// out[token_index[s, j], h] = softmax(q . k[slots[s, :limit]] * scale) @ v[...] for every valid query
// (key_limit[s, j] > 0). q/out [T, H, hd]; k_flat/v_flat [num_slots, Hkv, hd]; kv_slots [S, max_kv].
void short_attention(const torch::Tensor& q, const torch::Tensor& k_flat, const torch::Tensor& v_flat,
                     const torch::Tensor& token_index, const torch::Tensor& key_limit,
                     const torch::Tensor& kv_slots, torch::Tensor& out, double scale) {
  for (const torch::Tensor* t : {&q, &k_flat, &v_flat, static_cast<const torch::Tensor*>(&out)})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() && t->dim() == 3,
                "short_attention: contiguous fp32 CPU [rows, heads, head_dim] tensors only");
  for (const torch::Tensor* t : {&token_index, &key_limit, &kv_slots}) {
    check_index(*t, "short_attention");
    TORCH_CHECK(t->dim() == 2, "short_attention: [num_seqs, n] index tensors");
  }
  const int64_t H = q.size(1), hd = q.size(2), Hkv = k_flat.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_flat.size(2) == hd && v_flat.sizes() == k_flat.sizes() && out.sizes() == q.sizes(),
              "short_attention: q ", q.sizes(), " k ", k_flat.sizes(), " v ", v_flat.sizes());
  attention_into(q.data_ptr<float>(), k_flat.data_ptr<float>(), v_flat.data_ptr<float>(), out.data_ptr<float>(), H,
                 Hkv, hd, token_index.data_ptr<int64_t>(), key_limit.data_ptr<int64_t>(),
                 kv_slots.data_ptr<int64_t>(), token_index.size(0), token_index.size(1), kv_slots.size(1),
                 static_cast<float>(scale));
}

// The decoder layers of a Llama/Qwen3 model for a few-row step whose queries all fit one short attention
// group, in one call: per layer RMSNorm -> qkv -> (per-head q/k RMSNorm) -> RoPE -> K/V stored at
// slot_mapping -> paged attention -> o_proj -> residual add + RMSNorm -> gate_up -> SiLU * up -> down ->
// residual add. The same arithmetic as the per-op path (the same GEMM, norm and attention code, torch's
// own SiLU), so both give identical results; what it saves is ~20 Python-level ops per layer.
//
// x [T, D] residual stream, updated in place. weights: 8 per layer (input norm [D], qkv [(H+2Hkv)hd, D],
// q_norm [hd] or empty, k_norm [hd] or empty, o [D, H hd], post norm [D], gate_up [2I, D], down [D, I]).
// k_caches/v_caches: per layer [num_blocks, block_size, Hkv, hd]. cos/sin [T, hd] (sin with the
// rotate-half sign folded in). taps [T, n * D] or empty: after layer tap_layers[i], x is copied to
// columns tap_cols[i] .. + D.
void decoder_layers_(torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                     const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                     const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slot_mapping,
                     const torch::Tensor& token_index, const torch::Tensor& key_limit,
                     const torch::Tensor& kv_slots, int64_t H, int64_t Hkv, double eps, double scale,
                     const std::vector<int64_t>& tap_layers, const std::vector<int64_t>& tap_cols,
                     torch::Tensor& taps) {
  constexpr int kPerLayer = 8;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * L && v_caches.size() == k_caches.size(),
              "decoder_layers_: ", kPerLayer, " weights and one K and V cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "decoder_layers_: x must be a contiguous fp32 CPU [T, D] tensor");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(T >= 1 && T <= kMaxRows, "decoder_layers_: 1..", kMaxRows, " rows, got ", T);
  bool any_bf = false, any_q4 = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    const torch::Tensor& w = weights[i];
    const int slot = static_cast<int>(i % kPerLayer);
    const bool matrix = slot == 1 || slot == 4 || slot == 6 || slot == 7;  // qkv, o, gate_up, down
    const bool bf = matrix && w.defined() && w.scalar_type() == at::kBFloat16;
    const bool q4 = matrix && w.defined() && w.scalar_type() == at::kByte;
    any_bf |= bf;
    any_q4 |= q4;
    TORCH_CHECK(!bf || kHasBf16 || kHasBf16W, "decoder_layers_: bf16 weights need a CPU with AVX512-BF16, or AVX2 + FMA");
    TORCH_CHECK(!q4 || (kHasQ4 && w.dim() == 2 && q4_cols(w.size(1)) > 0 && w.size(0) % kQ4TileRows == 0),
                "decoder_layers_: Q4_1-packed weights need a CPU with AVX2, FMA and F16C, [N, K * 10 / 16], N a multiple of 8");
    TORCH_CHECK(!w.defined() || w.numel() == 0 || ((w.scalar_type() == at::kFloat || bf || q4) && w.is_contiguous() &&
                                                  w.device().is_cpu()),
                "decoder_layers_: weights must be contiguous CPU tensors, fp32 (matrices: fp32, bf16 or Q4_1)");
  }
  // a matrix's input width: its columns, or what its packed Q4_1 row holds
  const auto cols = [](const torch::Tensor& w) { return w.scalar_type() == at::kByte ? q4_cols(w.size(1)) : w.size(1); };
  for (const torch::Tensor* t : {&slot_mapping, &token_index, &key_limit, &kv_slots}) check_index(*t, "decoder_layers_");
  TORCH_CHECK(slot_mapping.numel() == T, "decoder_layers_: one slot per row");
  const int64_t hd = cos.size(-1), qk_heads = H + Hkv, qkv_dim = (H + 2 * Hkv) * hd;
  const int64_t inter = cols(weights[7]), half = hd / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * hd && sin.numel() == T * hd &&
                  H % Hkv == 0 && hd % 2 == 0,
              "decoder_layers_: cos/sin [T, head_dim] contiguous");
  TORCH_CHECK(tap_layers.size() == tap_cols.size(), "decoder_layers_: one column per tap");
  const float feps = static_cast<float>(eps), sc = static_cast<float>(scale);
  auto opts = x.options();
  torch::Tensor h = torch::empty({T, D}, opts), qkv = torch::empty({T, qkv_dim}, opts);
  torch::Tensor q = torch::empty({T, H, hd}, opts), attn = torch::empty({T, H * hd}, opts);
  torch::Tensor o = torch::empty({T, D}, opts), gu = torch::empty({T, 2 * inter}, opts);
  torch::Tensor act = torch::empty({T, inter}, opts);
  // bf16 copies of a product's input rows, for bf16 weights (the widest input: D, H * hd or inter)
  const int64_t widest = std::max({D, H * hd, inter});
  const int64_t threads = std::max(1, at::get_num_threads());
  torch::Tensor xbf = torch::empty({any_bf && kHasBf16 ? T * widest : 0}, opts.dtype(at::kBFloat16));
  // Q4_1: the prepared input rows (int8) and their per-block [e, e sum p]
  torch::Tensor xq4 = torch::empty({any_q4 ? T * widest : 0}, opts.dtype(at::kChar));
  torch::Tensor xsums = torch::empty({any_q4 ? T * widest / 16 : 0}, opts);
  bf16* xbp = xbf.data_ptr<bf16>();
  int8_t* xqp = xq4.data_ptr<int8_t>();
  float* xsp = xsums.data_ptr<float>();
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *ap = attn.data_ptr<float>(), *opp = o.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const torch::Tensor gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
  std::vector<float*> kcp(L), vcp(L);
  for (int64_t l = 0; l < L; ++l) {  // every check before the parallel region (nothing may throw inside)
    const torch::Tensor* w = weights.data() + kPerLayer * l;
    const torch::Tensor &kc = k_caches[l], &vc = v_caches[l];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.size(-2) == Hkv && kc.size(-1) == hd && vc.sizes() == kc.sizes(),
                "decoder_layers_: fp32 contiguous caches [blocks, block_size, ", Hkv, ", ", hd, "]");
    TORCH_CHECK(w[0].numel() == D && w[5].numel() == D && w[1].size(0) == qkv_dim && cols(w[1]) == D &&
                    w[4].size(0) == D && cols(w[4]) == H * hd && w[6].size(0) == 2 * inter &&
                    cols(w[6]) == D && w[7].size(0) == D && cols(w[7]) == inter &&
                    (w[2].numel() == 0 || (w[2].numel() == hd && w[3].numel() == hd)),
                "decoder_layers_: weight shapes of layer ", l);
    kcp[l] = kc.data_ptr<float>();
    vcp[l] = vc.data_ptr<float>();
  }
  TORCH_CHECK(taps.numel() == 0 || (taps.is_contiguous() && taps.size(0) == T && taps.scalar_type() == at::kFloat),
              "decoder_layers_: taps must be a contiguous fp32 [T, n * D] tensor");
  for (size_t i = 0; i < tap_layers.size(); ++i)
    TORCH_CHECK(tap_cols[i] >= 0 && tap_cols[i] + D <= taps.size(-1), "decoder_layers_: tap column out of range");
  const int64_t* tip = token_index.data_ptr<int64_t>();
  const int64_t* klp = key_limit.data_ptr<int64_t>();
  const int64_t* slp = kv_slots.data_ptr<int64_t>();
  const int64_t S = token_index.size(0), Q = token_index.size(1), max_kv = kv_slots.size(1);
  float* tapp = taps.numel() ? taps.data_ptr<float>() : nullptr;
  const int64_t tap_stride = taps.numel() ? taps.size(-1) : 0;

  // One parallel region for the whole stack: the matrix products and attention are split across the
  // threads, the row-wise glue (norms, RoPE, K/V stores, residual adds) runs on thread 0, and the
  // phases are separated by a spinning barrier.
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    auto sync = [&] { barrier.wait(nt); };
    auto mm = [&](const float* in, int64_t K, const torch::Tensor& wt, int64_t N, float* out) {
      const auto [n0, n1] = share(N, tid, nt, 16);
      if (wt.scalar_type() == at::kByte) {  // Q4_1: prepare the input rows (split by rows), then multiply
        const auto [r0, r1] = share(T, tid, nt, 1);
        if (r0 < r1) q4_prepare(in, r0, r1, K, xqp, xsp);
        sync();
        if (n0 < n1) q4_mm_cols(xqp, xsp, T, K, wt.data_ptr<uint8_t>(), N, out, n0, n1);
      } else if (wt.scalar_type() == at::kBFloat16 && !kHasBf16) {  // AVX2: widen the weights, fp32 input
        if (n0 < n1) mm_cols<BF16W>(in, T, K, wt.data_ptr<bf16>(), N, out, n0, n1);
      } else if (wt.scalar_type() == at::kBFloat16) {  // round the input rows to bf16 (split), then multiply
        const auto [i0, i1] = share(T * K, tid, nt, 16);
        if (i0 < i1) to_bf16(in + i0, xbp + i0, i1 - i0);
        sync();
        if (n0 < n1) mm_cols<BF16>(xbp, T, K, wt.data_ptr<bf16>(), N, out, n0, n1);
      } else if (n0 < n1) {
        mm_cols<F32>(in, T, K, wt.data_ptr<float>(), N, out, n0, n1);
      }
      sync();
    };
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* w = weights.data() + kPerLayer * l;
      const bool qk_norm = w[2].numel() == hd;
      // attention block
      if (tid == 0)
        for (int64_t t = 0; t < T; ++t) norm_rows(xp + t * D, w[0].data_ptr<float>(), hp + t * D, D, feps);
      sync();
      mm(hp, D, w[1], qkv_dim, qkvp);
      if (tid == 0) {
        for (int64_t t = 0; t < T; ++t) {
          const float *c = cp + t * hd, *s = sp + t * hd;
          for (int64_t j = 0; j < qk_heads; ++j) {
            float* src = qkvp + t * qkv_dim + j * hd;  // q heads, then k heads
            if (qk_norm) norm_rows(src, w[j < H ? 2 : 3].data_ptr<float>(), src, hd, feps);
            // x * cos + rotate_half(x) * sin, into q (query heads) or the K cache (key heads)
            float* dst = j < H ? qp + (t * H + j) * hd : kcp[l] + (slots[t] * Hkv + (j - H)) * hd;
            for (int64_t i = 0; i < hd; ++i)  // one fused multiply-add, as torch's addcmul rounds it
              dst[i] = std::fma(src[i < half ? i + half : i - half], s[i], src[i] * c[i]);
          }
          std::copy(qkvp + t * qkv_dim + qk_heads * hd, qkvp + (t + 1) * qkv_dim, vcp[l] + slots[t] * Hkv * hd);
        }
      }
      sync();
      {
        const auto [b0, b1] = share(S * Q * H, tid, nt, 1);
        attention_items(qp, kcp[l], vcp[l], ap, H, Hkv, hd, tip, klp, slp, Q, max_kv, sc, b0, b1);
      }
      sync();
      mm(ap, H * hd, w[4], D, opp);
      // MLP block
      if (tid == 0) {
        for (int64_t t = 0; t < T; ++t) {
          float* xr = xp + t * D;
          for (int64_t i = 0; i < D; ++i) xr[i] += opp[t * D + i];
          norm_rows(xr, w[5].data_ptr<float>(), hp + t * D, D, feps);
        }
      }
      sync();
      mm(hp, D, w[6], 2 * inter, gup);
      if (tid == 0) {  // torch's own SiLU (serial inside this region): the per-op path's numerics
        at::silu_out(act, gate);
        act.mul_(up);
      }
      sync();
      mm(actp, inter, w[7], D, opp);
      if (tid == 0) {  // the next layer's first phase is thread 0's too: no barrier needed here
        for (int64_t i = 0; i < T * D; ++i) xp[i] += opp[i];
        for (size_t i = 0; i < tap_layers.size(); ++i)
          if (tap_layers[i] == l)
            for (int64_t t = 0; t < T; ++t) std::copy(xp + t * D, xp + (t + 1) * D, tapp + t * tap_stride + tap_cols[i]);
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as torch's own ops do: the server's API thread keeps
  // streaming and detokenizing while the engine thread computes
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("small_mm", &small_mm, "x[M,K] @ w[N,K]^T for M <= 128 (fp32 x; fp32, bf16, Q4_1- or Q8_0-packed w; CPU)", release());
  m.def("rms_norm", &rms_norm, "x / rms(x) * w (fp32, CPU)", release());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; rms_norm(residual) (fp32, CPU)", release());
  m.def("short_attention", &short_attention, "paged attention for short queries (fp32, CPU)", release());
  m.def("decoder_layers_", &decoder_layers_, "all decoder layers of a few-row step (fp32; matrices fp32, bf16 or Q4_1)", release());
  m.attr("has_bf16") = kHasBf16;
  m.attr("has_bf16w") = kHasBf16W;  // small_mm multiplies bf16 weights by the unrounded fp32 input (AVX2)
  m.attr("has_q4_1") = kHasQ4;
  m.attr("q4_1_vnni") = kQ4Vnni;  // Q4_1 products in pairs of tiles by AVX512-VNNI (q4_tile_pair)
  m.attr("q4_1_group_rows") = kQ4GroupRows;  // the packing kernels.pack_q4_1 must give these kernels
  m.attr("has_q8_0") = kHasQ8;
}
