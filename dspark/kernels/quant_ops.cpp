// Products on a GGUF's own blocks of the types beyond Q4_1 / Q8_0 (cpu_ops.cpp has those): Q5_0, Q4_K and
// Q6_K, the types of gemma-3-270m's layers. The weights stay in the file's bytes, unchanged ([N, K / S *
// block bytes] uint8, S the block's weights); the input rows are quantized once per product to int8 in blocks
// of S (32 for Q5_0, 256 for the K types): e = max |x| / 127, p = round(x * (1 / e)) to nearest even (fp32),
// the sums of p per 16 kept (Q8_1's rule over Q8_K's block length). Per weight block the integer dot products
// are exact (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD on AVX512-VNNI: the same integers), and each output's
// fp32 sum runs block after block in one order, with separately rounded multiplies and adds
// (-ffp-contract=off):
//   Q5_0 (w = d (q - 16)):                acc = acc + (d e) * float(sum q p - 16 sum p)
//   Q4_K (w = d sc_j q - dmin m_j):       acc = acc + (d e) * float(sum_j sc_j sum q p)
//                                         acc = acc - (dmin e) * float(sum_j m_j sum p)
//   Q6_K (w = d sc_j (q - 32)):           acc = acc + (d e) * float(sum_j sc_j (sum q p - 32 sum p))
// so the AVX2 and AVX-512 builds agree bit for bit, with each other and with the torch twin that repeats
// these steps (dspark.kernels.ggml.product_reference). Parallel over output rows; any number of input rows.
// Q5_0 takes a row's blocks 8 at a time: their integer sums, d e and products as vectors, then added in order;
// Q6_K's 16 sub-block sums times their scales are two vectors and one horizontal sum (the same integers).
//
//   block_mm(x [M, K] fp32, w [N, row bytes] uint8, ggml type id) -> [M, N] fp32
//
// Q8_0 x Q8_0 (llama.cpp's product of a Q8_0 matrix, `q8_0_mm`) on the rows as `kernels.pack_q8_0` packs them
// (the K int8 q, then the K / 32 scales d as fp32): the input quantized in blocks of 32 as above, the exact integer
// sum of each block (signed x signed: AVX2 |q| times p with q's sign, VPMADDUBSW + VPMADDWD; VNNI (q + 128) times p
// by VPDPBUSD, less 128 sum p), then per
// output 8 fp32 lanes, block b on lane b % 8, group after group of 8 blocks (a short last group adds nothing to
// its missing lanes):
//   lane_j = lane_j + (d_b e_b) * float(isum_b)        b = 8 g + j
//   out = ((lane_0 + lane_4) + (lane_2 + lane_6)) + ((lane_1 + lane_5) + (lane_3 + lane_7))
// so 8 blocks' sums and scales are one vector each (the scales lie in order at the row's end).
//
//   q8_0_mm(x [M, K] fp32, w [N, K * 9 / 8] int8 packed) -> [M, N] fp32
//
// Built by dspark.kernels.ggml (torch's extension loader, the flags of cpu_ops.cpp); DSPARK_QUANT_AVX2 builds
// the AVX2 integer sums on an AVX-512 machine (the tests compare the two).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kQ5_0 = 6, kQ4_K = 12, kQ6_K = 14;  // GGML type ids

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasQuant = true;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(DSPARK_QUANT_AVX2)
constexpr bool kVnni = true;
// acc (8 int32 lanes) += the sums of 4 products uint8 x int8 per lane
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
  // u <= 63, |s| <= 127: a pair's sum (<= 16002) fits VPMADDUBSW's int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}
inline int32_t hsum8(__m256i v) { return hsum4(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))); }
// The lane sums of a, b, c, d (8 int32 each) into out[0..3]
inline void hsum8x4(__m256i a, __m256i b, __m256i c, __m256i d, int32_t* out) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));  // per 128-bit half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// The sums of each 128-bit half of a, b, c, d (4 int32 each), in order: a's low, a's high, b's low, ...
inline __m256i hsum4x4x2(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));  // lows | highs
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// The 8 sums of 16 consecutive pairs of psum16 (s[0] + s[1], s[2] + s[3], ...): the sums of p per 32.
inline __m256i pair_sums(const int32_t* s) {
  const __m256i h = _mm256_hadd_epi32(load32(s), load32(s + 8));  // per half: s's pairs 0-1, then 4-5 | 2-3, 6-7
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}
// The 8 sums of the 8 int32 lanes of v[0] .. v[7], in order (exact: integers).
inline __m256i hsum8x8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // a: v0..v3's low-half sums | their high-half sums; b: the same for v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 bits of `bits` as bytes 0 / 16 (bit i -> byte i): the fifth bit of Q5_0's q. Byte i takes byte i / 8
// of `bits` (a shuffle within each 128-bit lane, which both hold all 4 bytes) and tests its bit i % 8.
inline __m256i bits_to_16s(uint32_t bits) {
  const __m256i v = _mm256_set1_epi32(static_cast<int32_t>(bits));
  const __m256i spread = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);  // 0xFF where bit i is set
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q5_0 block (22 bytes: fp16 d, 32 high bits, 16 bytes: q_j low nibble, q_{j+16} high) -> q 0..31 in order.
// With AVX-512BW the fifth bits select the bytes that get 16 (a mask register); else bits_to_16s.
inline __m256i q5_0_values(const uint8_t* blk) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)), low4 = _mm_set1_epi8(0x0F);
  const __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), _mm_and_si128(qs, low4));
#if defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(DSPARK_QUANT_AVX2)
  return _mm256_mask_blend_epi8(static_cast<__mmask32>(qh), lo, _mm256_or_si256(lo, _mm256_set1_epi8(0x10)));
#else
  return _mm256_or_si256(lo, bits_to_16s(qh));
#endif
}
#else
constexpr bool kHasQuant = false, kVnni = false;
#endif

// Input rows quantized in blocks of S: p [M, K] int8, e [M, K / S] fp32, psum16 [M, K / 16] int32 (sums of p).
struct Prepared {
  std::vector<int8_t> p;
  std::vector<float> e;
  std::vector<int32_t> psum16;
};

Prepared prepare(const float* x, int64_t M, int64_t K, int64_t S) {
  // p has 256 bytes past its end: a short last group of 8 Q8_0 blocks reads them (against zero weights)
  Prepared r{std::vector<int8_t>(M * K + 256), std::vector<float>(M * (K / S)), std::vector<int32_t>(M * (K / 16))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / S; ++b) {
      const float* v = x + m * K + b * S;
      float amax = 0.0f;
      for (int64_t i = 0; i < S; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float e = amax / 127.0f, inv = e != 0.0f ? 1.0f / e : 0.0f;
      r.e[m * (K / S) + b] = e;
      for (int64_t i = 0; i < S; ++i) r.p[m * K + b * S + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / 16; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += r.p[m * K + 16 * j + i];
      r.psum16[m * (K / 16) + j] = s;
    }
  return r;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The fp16 scales d of 8 neighbouring Q5_0 blocks (22 bytes apart from `blk`) as fp32.
inline __m256 q5_0_scales8(const uint8_t* blk) {
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) std::memcpy(h + i, blk + 22 * i, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// Output rows [n0, n1) of out [M, N]; w rows of `rb` bytes, one row after the other (the weights stream in
// order). Per row, groups of 8 blocks: their integer sums, d e and the products are vectors, then added to the
// row's sum one by one in block order; then groups of 4 and single blocks, scalar. Every block's steps are the
// same, so the result does not depend on the grouping.
void q5_0_rows(const Prepared& in, int64_t M, int64_t K, const uint8_t* w, int64_t rb, float* out, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const uint8_t* blk = w + n * rb + 22 * b;
      __m256i q[8];
      for (int i = 0; i < 8; ++i) q[i] = q5_0_values(blk + 22 * i);
      const __m256 d = q5_0_scales8(blk);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* p = in.p.data() + m * K + 32 * b;
        __m256i dots[8];
        for (int i = 0; i < 8; ++i) dots[i] = dot_acc(_mm256_setzero_si256(), q[i], load32(p + 32 * i));
        const __m256i psum = pair_sums(in.psum16.data() + m * (K / 16) + 2 * b);  // the 8 blocks' sums of p
        const __m256i isum = _mm256_sub_epi32(hsum8x8(dots), _mm256_slli_epi32(psum, 4));
        const __m256 v = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(in.e.data() + m * nb + b)),
                                       _mm256_cvtepi32_ps(isum));
        alignas(32) float terms[8];
        _mm256_store_ps(terms, v);
        float a = acc[m];
        for (int i = 0; i < 8; ++i) a = a + terms[i];
        acc[m] = a;
      }
    }
    for (; b + 4 <= nb; b += 4) {  // 4 blocks' integer sums reduced together (exact), then added in order
      const uint8_t* blk = w + n * rb + 22 * b;
      const __m256i q[4] = {q5_0_values(blk), q5_0_values(blk + 22), q5_0_values(blk + 44), q5_0_values(blk + 66)};
      const float d[4] = {half(blk), half(blk + 22), half(blk + 44), half(blk + 66)};
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* p = in.p.data() + m * K + 32 * b;
        int32_t dot[4];
        hsum8x4(dot_acc(_mm256_setzero_si256(), q[0], load32(p)), dot_acc(_mm256_setzero_si256(), q[1], load32(p + 32)),
                dot_acc(_mm256_setzero_si256(), q[2], load32(p + 64)), dot_acc(_mm256_setzero_si256(), q[3], load32(p + 96)),
                dot);
        const int32_t* s = in.psum16.data() + m * (K / 16) + 2 * b;
        for (int j = 0; j < 4; ++j) {
          const int32_t isum = dot[j] - 16 * (s[2 * j] + s[2 * j + 1]);
          acc[m] = acc[m] + (d[j] * in.e[m * nb + b + j]) * static_cast<float>(isum);
        }
      }
    }
    for (; b < nb; ++b) {
      const uint8_t* blk = w + n * rb + 22 * b;
      const __m256i q = q5_0_values(blk);
      const float d = half(blk);
      for (int64_t m = 0; m < M; ++m) {
        const int32_t dot = hsum8(dot_acc(_mm256_setzero_si256(), q, load32(in.p.data() + m * K + 32 * b)));
        const int32_t* s = in.psum16.data() + m * (K / 16) + 2 * b;
        const int32_t isum = dot - 16 * (s[0] + s[1]);
        acc[m] = acc[m] + (d * in.e[m * nb + b]) * static_cast<float>(isum);
      }
    }
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
}

// Q4_K's 8 6-bit scales and mins from its 12 bytes (GGUF's packing).
inline void q4_k_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

void q4_k_rows(const Prepared& in, int64_t M, int64_t K, const uint8_t* w, int64_t rb, float* out, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t nb = K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * rb + 144 * b;
      int32_t sc[8], mn[8];
      q4_k_scales(blk + 4, sc, mn);
      const float d = half(blk), dmin = half(blk + 2);
      __m256i q[8];  // sub-block j's 32 q (chunk c: low nibbles sub-block 2c, high 2c + 1)
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(blk + 16 + 32 * c);
        q[2 * c] = _mm256_and_si256(v, low4);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* p = in.p.data() + m * K + 256 * b;
        const int32_t* s = in.psum16.data() + m * (K / 16) + 16 * b;
        int32_t i1 = 0, i2 = 0;
        for (int j = 0; j < 8; ++j) {
          i1 += sc[j] * hsum8(dot_acc(_mm256_setzero_si256(), q[j], load32(p + 32 * j)));
          i2 += mn[j] * (s[2 * j] + s[2 * j + 1]);
        }
        const float e = in.e[m * nb + b];
        acc[m] = acc[m] + (d * e) * static_cast<float>(i1);
        acc[m] = acc[m] - (dmin * e) * static_cast<float>(i2);
      }
    }
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
}

void q6_k_rows(const Prepared& in, int64_t M, int64_t K, const uint8_t* w, int64_t rb, float* out, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t nb = K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * rb + 210 * b;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))),
                    sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8)));
      const float d = half(blk + 208);
      __m256i q[8];  // group g = 4 h + s: weights 128 h + 32 s .. + 31, q in 0..63
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), hi = load32(blk + 128 + 32 * h);
        const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
        for (int s = 0; s < 4; ++s) {
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * s), low2);
          q[4 * h + s] = _mm256_or_si256(lows[s], _mm256_slli_epi16(high, 4));
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* p = in.p.data() + m * K + 256 * b;
        const int32_t* s = in.psum16.data() + m * (K / 16) + 16 * b;
        __m256i half_sums[2];  // the sums of q p over each 16 weights: groups 0-3, then 4-7 (first, second half)
        for (int g = 0; g < 8; g += 4)
          half_sums[g / 4] = hsum4x4x2(dot_acc(_mm256_setzero_si256(), q[g], load32(p + 32 * g)),
                                       dot_acc(_mm256_setzero_si256(), q[g + 1], load32(p + 32 * g + 32)),
                                       dot_acc(_mm256_setzero_si256(), q[g + 2], load32(p + 32 * g + 64)),
                                       dot_acc(_mm256_setzero_si256(), q[g + 3], load32(p + 32 * g + 96)));
        // isum = sum over the 16 sub-blocks of scale (half sum - 32 sum p)
        const __m256i t0 = _mm256_mullo_epi32(_mm256_sub_epi32(half_sums[0], _mm256_slli_epi32(load32(s), 5)), sc0);
        const __m256i t1 = _mm256_mullo_epi32(_mm256_sub_epi32(half_sums[1], _mm256_slli_epi32(load32(s + 8), 5)), sc1);
        const int32_t isum = hsum8(_mm256_add_epi32(t0, t1));
        acc[m] = acc[m] + (d * in.e[m * nb + b]) * static_cast<float>(isum);
      }
    }
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
}

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float lanes_sum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Output rows [n0, n1) for MB prepared input rows (p [MB, K] int8 at `p`, e [MB, K / 32] at `e`); packed
// Q8_0 rows of rb = K * 9 / 8 bytes (ps [MB, K / 32 + 8]: the blocks' sums of p, computed once per product
// outside this hot loop, then 8 zeros); out rows MB of stride N. A short last group holds zero weights past
// the row's blocks and multiplies its missing lanes by d = e = 0 (adds nothing to them, whatever p holds there).
template <int MB>
void q8_0_rows(const int8_t* p, const float* e, const int32_t* ps, int64_t K, const int8_t* w, int64_t rb, float* out,
               int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * rb;
    const float* d = reinterpret_cast<const float*>(row + K);
    __builtin_prefetch(row + 4 * rb, 0, 0);
    __builtin_prefetch(row + 4 * rb + 64, 0, 0);
    __builtin_prefetch(row + 4 * rb + 128, 0, 0);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
      const int cnt = static_cast<int>(std::min<int64_t>(8, nb - g));
      __m256i q[8];
      __m256 dv;
      if (cnt == 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) q[i] = load32(row + 32 * (g + i));
        dv = _mm256_loadu_ps(d + g);
      } else {
        for (int i = 0; i < 8; ++i) q[i] = i < cnt ? load32(row + 32 * (g + i)) : _mm256_setzero_si256();
        dv = _mm256_maskload_ps(d + g, _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lanes));
      }
      __builtin_prefetch(row + 4 * rb + 192 + 256 * (g / 8), 0, 0);
      __builtin_prefetch(row + 4 * rb + 256 + 256 * (g / 8), 0, 0);
      // VPDPBUSD: (q + 128) as uint8 times p, less 128 sum p (ps: the blocks' sums of p); AVX2: |q| times p with
      // q's sign (VPMADDUBSW's int16 pair sums would overflow with q + 128)
      __m256i u[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        u[i] = kVnni ? _mm256_xor_si256(q[i], _mm256_set1_epi8(static_cast<char>(0x80))) : _mm256_abs_epi8(q[i]);
      for (int m = 0; m < MB; ++m) {
        const int8_t* pm = p + m * K + 32 * g;
        __m256i s[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
          s[i] = kVnni ? dot_acc(_mm256_setzero_si256(), u[i], load32(pm + 32 * i))
                       : dot_acc(_mm256_setzero_si256(), u[i], _mm256_sign_epi8(load32(pm + 32 * i), q[i]));
        __m256i isum = hsum8x8(s);
        if (kVnni)
          isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(load32(ps + m * (nb + 8) + g), 7));
        const __m256 ev = cnt == 8 ? _mm256_loadu_ps(e + m * nb + g)
                                   : _mm256_maskload_ps(e + m * nb + g, _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lanes));
        acc[m] = _mm256_add_ps(acc[m], _mm256_mul_ps(_mm256_mul_ps(dv, ev), _mm256_cvtepi32_ps(isum)));
      }
    }
    for (int m = 0; m < MB; ++m) out[m * N + n] = lanes_sum(acc[m]);
  }
}

constexpr int kQ8PassRows = 4;
using Q8RowsFn = void (*)(const int8_t*, const float*, const int32_t*, int64_t, const int8_t*, int64_t, float*,
                          int64_t, int64_t, int64_t);
constexpr Q8RowsFn kQ8Rows[kQ8PassRows] = {q8_0_rows<1>, q8_0_rows<2>, q8_0_rows<3>, q8_0_rows<4>};
#endif

struct TypeInfo {
  int64_t weights, bytes;
};
TypeInfo type_info(int64_t t) {
  if (t == kQ5_0) return {32, 22};
  if (t == kQ4_K) return {256, 144};
  if (t == kQ6_K) return {256, 210};
  return {0, 0};
}

}  // namespace

torch::Tensor block_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(kHasQuant, "block_mm: the block products need a CPU with AVX2, FMA and F16C");
  const TypeInfo info = type_info(type);
  TORCH_CHECK(info.weights > 0, "block_mm: GGML type ", type, " has no product here (Q5_0, Q4_K, Q6_K)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "block_mm: x [M, K] fp32 and w [N, row bytes] uint8 on the CPU, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % info.weights == 0 && w.size(1) == K / info.weights * info.bytes,
              "block_mm: K = ", K, " needs whole blocks of ", info.weights, " (", info.bytes, " bytes each); w has ",
              w.size(1), " bytes a row");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const Prepared in = prepare(xc.data_ptr<float>(), M, K, info.weights);
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  const int64_t grain = std::max<int64_t>(1, (N + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (type == kQ5_0) q5_0_rows(in, M, K, wp, rb, op, N, n0, n1);
    else if (type == kQ4_K) q4_k_rows(in, M, K, wp, rb, op, N, n0, n1);
    else q6_k_rows(in, M, K, wp, rb, op, N, n0, n1);
  });
#endif
  return out;
}

torch::Tensor q8_0_mm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(kHasQuant, "q8_0_mm: the block products need a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "q8_0_mm: x [M, K] fp32 and packed Q8_0 w [N, K * 9 / 8] int8 on the CPU, got ", x.sizes(), " and ",
              w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * 36, "q8_0_mm: K = ", K, " needs whole blocks of 32 and w ",
              K / 32 * 36, " bytes a row; w has ", w.size(1));
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const Prepared in = prepare(xc.data_ptr<float>(), M, K, 32);
  const int8_t* wp = wc.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1), nb = K / 32;
  std::vector<int32_t> ps(M * (nb + 8), 0);  // per input row the blocks' sums of p, 8 zeros past the last
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) ps[m * (nb + 8) + b] = in.psum16[m * (K / 16) + 2 * b] + in.psum16[m * (K / 16) + 2 * b + 1];
  const int64_t passes = (M + kQ8PassRows - 1) / kQ8PassRows, per_pass = (M + passes - 1) / passes;
  // more than one pass: tiles of ~256 KB of weight rows, each read from memory once and from L2 per pass
  const int64_t tile = passes == 1 ? N : std::max<int64_t>(16, (1 << 18) / rb);
  const int64_t grain = std::max<int64_t>(16, (N + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile)
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
        kQ8Rows[rows - 1](in.p.data() + m0 * K, in.e.data() + m0 * nb, ps.data() + m0 * (nb + 8), K, wp, rb,
                          op + m0 * N, N, t0, std::min(n1, t0 + tile));
      }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("block_mm", &block_mm, "x[M,K] fp32 @ GGUF blocks w[N, row bytes]^T (Q5_0, Q4_K, Q6_K; CPU)", release());
  m.def("q8_0_mm", &q8_0_mm, "x[M,K] fp32 (quantized to Q8_0) @ packed Q8_0 w[N, K*9/8]^T (CPU)", release());
  m.attr("has_quant") = kHasQuant;
  m.attr("vnni") = kVnni;
}
