// Attention of rows at sorted absolute positions over one sequence's K/V, float32, on a CPU.
//
// Row i (position q_pos[i]) sees keys 0..q_pos[i] (and only those > q_pos[i] - window when
// window > 0). The query heads of one KV head are computed together, so every K/V tile is read
// once for its whole group; scores exist for one tile of keys at a time (online softmax, as in
// flash attention), so no [rows, keys] matrix is ever built. V may be wider than Q and K (the
// fused span statistics append indicator columns to V).
//
// Written with GCC/Clang vector extensions, not one instruction set's intrinsics: one source
// for AVX-512, AVX2 and others, compiled for the machine it runs on (-march=native) by
// cachecraft/model/row_kernel.py.

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One vector: 16 floats where AVX-512 has 32 registers of them, else 8 (AVX2's 16 registers,
// or two of NEON's 32). R x 4 accumulators plus 4 operands fit the registers either way.
#if defined(__AVX512F__)
#define CC_LANES 16
#else
#define CC_LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * CC_LANES)));
typedef float vfu __attribute__((vector_size(4 * CC_LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * CC_LANES)));

constexpr int L = CC_LANES;    // floats per vector
constexpr int R = L == 16 ? 6 : 3;  // rows per register block (R x 4 vectors of accumulators)
constexpr int ROWS = 24;       // query rows per work item, before multiplying by the group
constexpr int KEYS = 128;      // keys per tile (a multiple of 4 L)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vf splat(float s) { return vf{} + s; }

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Lanes swapped in pairs of blocks of 8, 4, 2 and 1: halving steps of a horizontal reduction.
#if CC_LANES == 16
#define CC_SWAP8(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define CC_SWAP4(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define CC_SWAP2(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define CC_SWAP1(x) __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#else
#define CC_SWAP4(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3)
#define CC_SWAP2(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5)
#define CC_SWAP1(x) __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6)
#endif

inline float hmax(vf x) {
#if CC_LANES == 16
  x = vmax(x, CC_SWAP8(x));
#endif
  x = vmax(x, CC_SWAP4(x));
  x = vmax(x, CC_SWAP2(x));
  x = vmax(x, CC_SWAP1(x));
  return x[0];
}
inline float hsum(vf x) {
#if CC_LANES == 16
  x += CC_SWAP8(x);
#endif
  x += CC_SWAP4(x);
  x += CC_SWAP2(x);
  x += CC_SWAP1(x);
  return x[0];
}

// exp(x) for x <= 0 (scores minus their row maximum), relative error ~2e-7; exp(-inf) = 0.
// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n from bits.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  vf xc = x < lo ? lo : x;
  vf fx = xc * 1.44269504088896341f - 0.5f;  // round to nearest for fx <= 0 by truncation
  vi n = __builtin_convertvector(fx, vi);
  vf nf = __builtin_convertvector(n, vf);
  vf r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vf y = p * scale;
  return x < lo ? vf{} : y;
}

struct Args {
  const float* q;  // [H, n, dq] with strides q_h, q_n
  const float* kt;  // [Hkv, dq, kt_n] contiguous: K transposed, zero past the keys
  const float* v;  // [Hkv, ctx, dv] with strides v_h, v_n
  float* out;  // [n, H, dv] with strides o_n, o_h
  const int64_t* pos;
  int64_t q_h, q_n, v_h, v_n, o_n, o_h, kt_n;
  int64_t n, ctx, dq, dv, group, window;
  float scale;
};

// s[r, 0..KEYS) = q_r . k_j for R rows from qs over one tile of keys (K transposed, padded),
// four vectors of keys at a time.
inline void score_block(const float* qs, const float* kt, int64_t kt_n, int64_t dq, float* s) {
  for (int c0 = 0; c0 < KEYS / L; c0 += 4) {
    vf acc[R][4] = {};
    for (int64_t d = 0; d < dq; ++d) {
      vf kv[4];
      for (int c = 0; c < 4; ++c) kv[c] = load(kt + d * kt_n + (c0 + c) * L);
      for (int r = 0; r < R; ++r) {
        const vf qb = splat(qs[r * dq + d]);
        for (int c = 0; c < 4; ++c) acc[r][c] += qb * kv[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) store(s + r * KEYS + (c0 + c) * L, acc[r][c]);
  }
}

// o[r, c0 * L..(c0 + NC) * L) += sum_j p[r, j] v_j for R rows, nk keys.
template <int NC>
inline void value_block(const float* p, const float* v, int64_t v_n, int64_t nk, float* o,
                        int64_t dv) {
  vf acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = load(o + r * dv + c * L);
  for (int64_t j = 0; j < nk; ++j) {
    vf vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load(v + j * v_n + c * L);
    for (int r = 0; r < R; ++r) {
      const vf pb = splat(p[r * KEYS + j]);
      for (int c = 0; c < NC; ++c) acc[r][c] += pb * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) store(o + r * dv + c * L, acc[r][c]);
}

inline void value_rows(const float* p, const float* v, int64_t v_n, int64_t nk, float* o,
                       int64_t dv) {
  int64_t c0 = 0;
  for (; c0 + 4 <= dv / L; c0 += 4) value_block<4>(p, v + c0 * L, v_n, nk, o + c0 * L, dv);
  switch (dv / L - c0) {
    case 1: value_block<1>(p, v + c0 * L, v_n, nk, o + c0 * L, dv); break;
    case 2: value_block<2>(p, v + c0 * L, v_n, nk, o + c0 * L, dv); break;
    case 3: value_block<3>(p, v + c0 * L, v_n, nk, o + c0 * L, dv); break;
    default: break;
  }
}

// One work item: rows [a, b) of every query head of KV head g.
void attend_item(const Args& A, int64_t g, int64_t a, int64_t b) {
  const int64_t rows = b - a, dv = A.dv, nv = dv / L;
  const int64_t m = (rows * A.group + R - 1) / R * R;  // whole blocks of R (extra rows: zeros)
  const int64_t dq = A.dq;
  std::vector<float> qs(m * dq, 0.f), s(m * KEYS), o(m * dv, 0.f), mx(m, NEG_INF);
  std::vector<float> den(m, 0.f);
  std::vector<int64_t> hi(m, A.ctx), lo(m, 0);  // per row: keys lo..hi-1 are visible
  for (int64_t h = 0; h < A.group; ++h) {
    const float* qh = A.q + (g * A.group + h) * A.q_h;
    for (int64_t i = 0; i < rows; ++i) {
      const float* src = qh + (a + i) * A.q_n;
      float* dst = &qs[(h * rows + i) * dq];
      for (int64_t d = 0; d < dq; ++d) dst[d] = src[d] * A.scale;
      const int64_t p = A.pos[a + i];
      hi[h * rows + i] = p + 1;
      lo[h * rows + i] = A.window > 0 ? std::max<int64_t>(0, p - A.window + 1) : 0;
    }
  }
  const int64_t end = A.pos[b - 1] + 1;  // no row sees past this
  const int64_t min_hi = A.pos[a] + 1;
  const int64_t start = A.window > 0 ? std::max<int64_t>(0, A.pos[a] - A.window + 1) : 0;
  const int64_t max_lo = A.window > 0 ? std::max<int64_t>(0, A.pos[b - 1] - A.window + 1) : 0;
  const float* kt = A.kt + g * dq * A.kt_n;
  const float* vg = A.v + g * A.v_h;
  for (int64_t j0 = (start / KEYS) * KEYS; j0 < end; j0 += KEYS) {
    const int64_t nk = std::min<int64_t>(KEYS, end - j0);
    for (int64_t r0 = 0; r0 < m; r0 += R)
      score_block(&qs[r0 * dq], kt + j0, A.kt_n, dq, &s[r0 * KEYS]);
    // Masking only where some row's visible range starts or ends inside the tile.
    const bool masked = j0 + KEYS > min_hi || (A.window > 0 && j0 < max_lo);
    for (int64_t r = 0; r < m; ++r) {
      float* sr = &s[r * KEYS];
      if (masked) {
        const int64_t lo_r = std::clamp<int64_t>(lo[r] - j0, 0, KEYS);
        const int64_t hi_r = std::clamp<int64_t>(hi[r] - j0, lo_r, KEYS);
        for (int64_t j = 0; j < lo_r; ++j) sr[j] = NEG_INF;
        for (int64_t j = hi_r; j < KEYS; ++j) sr[j] = NEG_INF;
      }
      vf vm = splat(NEG_INF);
      for (int c = 0; c < KEYS / L; ++c) {
        const vf x = load(sr + c * L);
        vm = vmax(x, vm);
      }
      const float m_new = std::max(mx[r], hmax(vm));
      if (m_new == NEG_INF) {  // nothing visible to this row yet
        for (int c = 0; c < KEYS / L; ++c) store(sr + c * L, vf{});
        continue;
      }
      vf sum = {};
      const vf mv = splat(m_new);
      for (int c = 0; c < KEYS / L; ++c) {
        const vf p = vexp(load(sr + c * L) - mv);
        store(sr + c * L, p);
        sum += p;
      }
      const float alpha = mx[r] == NEG_INF ? 0.f : std::exp(mx[r] - m_new);
      den[r] = den[r] * alpha + hsum(sum);
      mx[r] = m_new;
      if (alpha != 1.f) {
        float* orow = &o[r * dv];
        const vf av = splat(alpha);
        for (int64_t c = 0; c < nv; ++c) store(orow + c * L, load(orow + c * L) * av);
      }
    }
    const float* vt = vg + j0 * A.v_n;
    for (int64_t r0 = 0; r0 < m; r0 += R)
      value_rows(&s[r0 * KEYS], vt, A.v_n, nk, &o[r0 * dv], dv);
  }
  for (int64_t h = 0; h < A.group; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = h * rows + i;
      const vf inv = splat(1.f / den[r]);
      float* dst = A.out + (a + i) * A.o_n + (g * A.group + h) * A.o_h;
      for (int64_t c = 0; c < nv; ++c) store(dst + c * L, load(&o[r * dv + c * L]) * inv);
    }
  }
}

// q [H, n, dq], k [Hkv, ctx, dq] (any strides), v [Hkv, ctx, dv] (dv a multiple of 16),
// q_pos [n] int64 ascending with q_pos[-1] < ctx, out [n, H, dv]; q, v and out contiguous in
// their last dimension. Writes out.
void row_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& q_pos,
    int64_t window,
    double scale,
    at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "3-D operands");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 operands");
  TORCH_CHECK(k.size(2) == q.size(2), "Q and K of one width");
  TORCH_CHECK(v.size(2) % L == 0 && out.size(2) == v.size(2), "V's width a multiple of 16");
  TORCH_CHECK(q.size(0) % k.size(0) == 0 && v.size(0) == k.size(0), "grouped heads");
  TORCH_CHECK(q.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1, "contiguous rows");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.is_contiguous(), "int64 positions");
  const int64_t n = q.size(1);
  TORCH_CHECK(q_pos.size(0) == n && out.size(0) == n && out.size(1) == q.size(0), "shapes");
  if (n == 0) return;
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  TORCH_CHECK(pos[0] >= 0 && pos[n - 1] < k.size(1) && v.size(1) >= k.size(1),
              "positions within the keys");
  for (int64_t i = 1; i < n; ++i) TORCH_CHECK(pos[i - 1] < pos[i], "ascending positions");
  const int64_t end = pos[n - 1] + 1;
  // K transposed, zero to a whole number of tiles: [Hkv, dq, kt_n].
  const int64_t kt_n = (end + KEYS - 1) / KEYS * KEYS;
  at::Tensor kt = at::zeros({k.size(0), k.size(2), kt_n}, k.options());
  kt.narrow(2, 0, end).copy_(k.narrow(1, 0, end).transpose(1, 2));
  Args A{q.data_ptr<float>(), kt.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
         pos, q.stride(0), q.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
         kt_n, n, end, q.size(2), v.size(2), q.size(0) / k.size(0), window,
         static_cast<float>(scale)};
  // Work items (KV head, row block), dealt to threads by cost (rows x keys, largest first) so
  // that each thread's list costs about the same.
  struct Item { int64_t g, a, b; double cost; };
  std::vector<Item> items;
  for (int64_t g = 0; g < k.size(0); ++g)
    for (int64_t a = 0; a < n; a += ROWS) {
      const int64_t b = std::min(n, a + ROWS);
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos[a] - window + 1) : 0;
      items.push_back({g, a, b, double(b - a) * double(pos[b - 1] + 1 - first + KEYS)});
    }
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<std::vector<Item>> lists(threads);
  std::vector<double> load_of(threads, 0.0);
  for (const Item& it : items) {
    const int64_t t = std::min_element(load_of.begin(), load_of.end()) - load_of.begin();
    lists[t].push_back(it);
    load_of[t] += it.cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (const Item& it : lists[t]) attend_item(A, it.g, it.a, it.b);
  });
}

}  // namespace

TORCH_LIBRARY(cachecraft, m) {
  m.def(
      "row_attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, int window, float scale, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(cachecraft, CPU, m) {
  m.impl("row_attention", row_attention);
}
