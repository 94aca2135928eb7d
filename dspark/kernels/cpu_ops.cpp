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
//   row_argmax(x)                  each row's maximum and its first index (torch.max(x, -1)'s answer).
//   markov_walk(...)               DSpark's greedy vanilla Markov walk over a drafted block (bias, add, argmax
//                                  per position), the Python loop's arithmetic.
//   short_attention(...)           paged attention for short queries: each query reads its request's keys
//                                  straight from the pool through the slot table, up to a per-query key
//                                  limit (causal or block-bidirectional); scores, one vectorised exp pass,
//                                  then the weighted values in registers; GQA. Query heads reading the same
//                                  keys run in tiles that share each key and value load (set_attention_tile).
//   set_attention_tile(n)          query heads per tile (1: untiled; a query's result is the same).
//   decoder_layers_(...)           every Llama/Qwen3 decoder layer of a decode/verify step in one call and
//                                  one OpenMP region (the ops above + RoPE, K/V store, SiLU), bit-identical
//                                  to the per-layer modules.
//   block_mm, q8_0_mm              products on a GGUF's Q5_0 / Q4_K / Q6_K blocks (cpu_ops_blocks.inc) and a
//                                  Q8_0 LM head, rows interleaved by 8, the input quantized (cpu_ops_head.inc).
//   block_layers_(...)             the decoder stack for matrices held as GGUF block parts, Llama and Gemma 3
//                                  (cpu_ops_block_layers.inc).
//   draft_inputs_(...)             the rows, RoPE and attention indices of DSpark's draft blocks (cpu_ops_draft.inc).
//   draft_block_(...)              DSpark's greedy proposal in one call: decoder_layers_, final norm, LM head,
//                                  markov_walk, confidence head (cpu_ops_draft.inc).
//   gated_delta_windows_(...)      the Gated DeltaNet layers' conv and delta rule for decode and verification
//                                  windows, every position's state written into the state rings
//                                  (cpu_ops_recurrent.inc).
//   draft_context_(...)            DSpark's context extension in one call: context features, each layer's K/V
//                                  (product, k norm, RoPE) stored in the pool (cpu_ops_draft.inc).
//
// Threads come from torch's OpenMP runtime (at::parallel_for, or one `omp parallel` region for the
// decoder stack), so no second pool spins against it. The Python side (dspark/kernels/__init__.py)
// builds this file (with its parts, cpu_ops_*.inc) once per machine and keeps a torch twin of every op
// for the tests.
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
#include <memory>
#include <type_traits>
#include <vector>

// The parts (textual includes: one translation unit, one anonymous namespace; the build hashes them all).
#include "cpu_ops_simd.inc"
#include "cpu_ops_quant.inc"
#include "cpu_ops_ops.inc"
#include "cpu_ops_attention.inc"
#include "cpu_ops_blocks.inc"
#include "cpu_ops_kquants.inc"
#include "cpu_ops_kpacked.inc"
#include "cpu_ops_head.inc"
#include "cpu_ops_recurrent.inc"

// act[r0:r1] = activation(gate[r0:r1]) * up[r0:r1] (SiLU, or tanh-GELU): torch's own ops, serial inside the
// stacks' parallel region, so the per-layer modules' numerics; on a row slice the same vector loop per row as over
// the whole matrix (views only for a part: a whole step takes the tensors themselves).
inline void activation_rows(const torch::Tensor& act, const torch::Tensor& gate, const torch::Tensor& up, int64_t r0,
                            int64_t r1, bool gelu_tanh) {
  if (r0 >= r1) return;
  const bool all = r1 - r0 == act.size(0);
  const auto rows = [&](const torch::Tensor& t) { return all ? t : t.narrow(0, r0, r1 - r0); };
  torch::Tensor a = rows(act);
  if (gelu_tanh) at::gelu_out(a, rows(gate), "tanh");
  else at::silu_out(a, rows(gate));
  a.mul_(rows(up));
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
  const std::vector<int64_t> bounds = attention_bounds(klp, S, Q, H, Hkv, max_kv, threads);  // every layer's split

  // One parallel region for the whole stack: the matrix products and attention are split across the
  // threads, and so is the row-wise glue (norms, RoPE, K/V stores, residual adds, the activation): each
  // thread takes its own rows [r0, r1), every row computed as alone (the same numbers whatever the split;
  // distinct rows store to distinct K/V slots). The phases are separated by a spinning barrier.
  SpinBarrier barrier;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the workers take the caller's
#pragma omp parallel num_threads(threads)
  {
    const c10::InferenceMode mode(inference);  // (the activation below is a torch op on the caller's tensors)
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto [r0, r1] = share(T, tid, nt, 1);  // this thread's rows of the row-wise glue
    auto sync = [&] { barrier.wait(nt); };
    auto mm = [&](const float* in, int64_t K, const torch::Tensor& wt, int64_t N, float* out) {
      const auto [n0, n1] = share(N, tid, nt, 16);
      if (wt.scalar_type() == at::kByte) {  // Q4_1: prepare the input rows (split by rows), then multiply
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
      for (int64_t t = r0; t < r1; ++t) norm_rows(xp + t * D, w[0].data_ptr<float>(), hp + t * D, D, feps);
      sync();
      mm(hp, D, w[1], qkv_dim, qkvp);
      for (int64_t t = r0; t < r1; ++t) {
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
      sync();
      {
        const auto [b0, b1] = item_range(bounds, tid, nt);
        attention_items(qp, kcp[l], vcp[l], ap, H, Hkv, hd, tip, klp, slp, Q, max_kv, sc, b0, b1);
      }
      sync();
      mm(ap, H * hd, w[4], D, opp);
      // MLP block
      for (int64_t t = r0; t < r1; ++t) {
        float* xr = xp + t * D;
        for (int64_t i = 0; i < D; ++i) xr[i] += opp[t * D + i];
        norm_rows(xr, w[5].data_ptr<float>(), hp + t * D, D, feps);
      }
      sync();
      mm(hp, D, w[6], 2 * inter, gup);
      activation_rows(act, gate, up, r0, r1, false);  // this thread's rows
      sync();
      mm(actp, inter, w[7], D, opp);
      // the next layer's first phase reads only this thread's rows: no barrier needed here
      for (int64_t i = r0 * D; i < r1 * D; ++i) xp[i] += opp[i];
      for (size_t i = 0; i < tap_layers.size(); ++i)
        if (tap_layers[i] == l)
          for (int64_t t = r0; t < r1; ++t) std::copy(xp + t * D, xp + (t + 1) * D, tapp + t * tap_stride + tap_cols[i]);
    }
  }
}

#include "cpu_ops_block_layers.inc"
#include "cpu_ops_draft.inc"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as torch's own ops do: the server's API thread keeps
  // streaming and detokenizing while the engine thread computes
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("small_mm", &small_mm, "x[M,K] @ w[N,K]^T for M <= 128 (fp32 x; fp32, bf16, Q4_1- or Q8_0-packed w; CPU)", release());
  m.def("rms_norm", &rms_norm, "x / rms(x) * w (fp32, CPU)", release());
  m.def("row_argmax", &row_argmax, "each row's max and its first index, as torch.max(x, -1) (fp32, CPU)", release());
  m.def("markov_walk", &markov_walk, "the greedy vanilla Markov walk over a drafted block (fp32 bias, CPU)", release());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; rms_norm(residual) (fp32, CPU)", release());
  m.def("short_attention", &short_attention, "paged attention for short queries (fp32, CPU)", release());
  m.def("set_attention_tile", [](int tile) {
    TORCH_CHECK(tile >= 1 && tile <= kAttnTileMax, "set_attention_tile: 1..", kAttnTileMax, ", got ", tile);
    const int before = attention_tile();
    attention_tile() = tile;
    return before;
  }, "query heads per attention tile (1: each query head alone; the same results); returns the previous value");
  m.def("decoder_layers_", &decoder_layers_, "all decoder layers of a few-row step (fp32; matrices fp32, bf16 or Q4_1)", release());
  m.def("draft_inputs_", &draft_inputs_, "the fused stack's inputs for DSpark's draft blocks, from the block tables (CPU)", release());
  m.def("draft_block_", &draft_block_, "DSpark's greedy proposal: block forward, final norm, LM head, Markov walk, confidence (CPU)", release());
  m.def("draft_context_", &draft_context_, "DSpark's context extension: features, then each layer's K/V stored (CPU)", release());
  m.def("block_mm", &block_mm, "x[M,K] fp32 @ GGUF blocks w[N, row bytes]^T (Q5_0, Q4_K, Q6_K; CPU)", release());
  m.def("q8_0_mm", &q8_0_mm, "x[M,K] fp32 (quantized to Q8_0) @ interleaved Q8_0 w[N, K/32*34]^T (CPU)", release());
  m.def("gated_delta_windows_", &gated_delta_windows_, "Gated DeltaNet windows: conv, q/k norm, delta rule, every state kept in the rings (CPU)", release());
  m.def("block_layers_", &block_layers_, "all decoder layers of a few-row step, matrices as GGUF block parts (Llama, Gemma 3)", release());
  m.attr("has_bf16") = kHasBf16;
  m.attr("has_bf16w") = kHasBf16W;  // small_mm multiplies bf16 weights by the unrounded fp32 input (AVX2)
  m.attr("has_q4_1") = kHasQ4;
  m.attr("q4_1_vnni") = kQ4Vnni;  // Q4_1 products in pairs of tiles by AVX512-VNNI (q4_tile_pair)
  m.attr("q4_1_group_rows") = kQ4GroupRows;  // the packing kernels.pack_q4_1 must give these kernels
  m.attr("has_q8_0") = kHasQ8;
  m.attr("q8_0_interleaved") = true;  // q8_0_mm reads rows interleaved by blocks.pack_q8_0x8 (ab_quant_ops.py)
  m.attr("has_quant") = kHasQuant;  // block_mm, q8_0_mm and block_layers_'s block parts (AVX2, FMA, F16C)
  m.attr("k_quant_group_rows") = kKPackRows;  // rows a packed Q4_K / Q6_K group (ggml.pack_k16); 0: none
  m.attr("vnni") = kVnni;  // their integer sums by AVX512-VNNI (else AVX2; DSPARK_QUANT_AVX2 forces AVX2)
}

