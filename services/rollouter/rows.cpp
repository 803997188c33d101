// Chorus's product of a few token rows by a weight, for the continuous engine on CPU (services/rollouter/native.py
// compiles this file on the machine that runs it, with -march=native, and the kernel plan measures it beside
// F.linear, W @ X^T and oneDNN: it is used for a weight shape and row count only where it was measured fastest).
//
//   y[R, N] = x[R, K] . w[N, K]^T      (x, y row-major float32; w packed once by pack())
//
// A decode step multiplies every weight by a few rows, so it streams each weight from memory once and does
// little arithmetic per byte: the speed is the memory stream. pack() lays w out as blocks of NB outputs,
// [ceil(N / NB)][K][NB], so a block is one contiguous stream; for each k the micro-kernel loads NB weights
// (NBV vectors), broadcasts x[r, k] of each row of its group and accumulates NB outputs of every row in
// registers: no horizontal sums, the x rows stay in L1, and a software prefetch PREFETCH bytes ahead keeps the
// stream's requests in flight while the core multiplies.
#include <cstddef>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
constexpr int V = 16;      // floats per vector register
constexpr int RBMAX = 8;   // rows per micro-kernel: 8 x 2 accumulators + 2 weights + 1 broadcast of 32 registers
#else
constexpr int V = 8;       // AVX2 and others (NEON: the compiler splits the vector in two)
constexpr int RBMAX = 6;   // 6 x 2 accumulators + 2 + 1 of 16 registers
#endif
constexpr int NBV = 2;     // vectors of outputs per block
constexpr int NB = NBV * V;
constexpr long PREFETCH = 2048;  // bytes ahead in the block's stream

typedef float vf __attribute__((vector_size(V * 4)));
typedef float vfu __attribute__((vector_size(V * 4), aligned(4)));  // unaligned loads and stores

extern "C" int chorus_rows_block() { return NB; }

extern "C" int chorus_rows_max_group() { return RBMAX; }

extern "C" long chorus_rows_packed_size(long n, long k) { return (n + NB - 1) / NB * k * NB; }

extern "C" void chorus_rows_pack(const float* w, long n, long k, float* p) {
  const long blocks = (n + NB - 1) / NB;
  for (long b = 0; b < blocks; b++)
    for (long kk = 0; kk < k; kk++)
      for (int j = 0; j < NB; j++) {
        const long o = b * NB + j;
        p[(b * k + kk) * NB + j] = o < n ? w[o * k + kk] : 0.0f;
      }
}

template <int RB>
static inline void micro(const float* x, long k, const float* pb, float* y, long ldy, int valid) {
  vf acc[RB][NBV];
  for (int r = 0; r < RB; r++)
    for (int v = 0; v < NBV; v++) acc[r][v] = vf{};
  for (long kk = 0; kk < k; kk++) {
    const float* wk = pb + kk * NB;
    __builtin_prefetch(reinterpret_cast<const char*>(wk) + PREFETCH);
    __builtin_prefetch(reinterpret_cast<const char*>(wk) + PREFETCH + 64);
    vf w[NBV];
    for (int v = 0; v < NBV; v++) w[v] = *reinterpret_cast<const vfu*>(wk + v * V);
    for (int r = 0; r < RB; r++) {
      const float xs = x[r * k + kk];
      for (int v = 0; v < NBV; v++) acc[r][v] += w[v] * xs;
    }
  }
  for (int r = 0; r < RB; r++) {
    if (valid == NB) {
      for (int v = 0; v < NBV; v++) *reinterpret_cast<vfu*>(y + r * ldy + v * V) = acc[r][v];
    } else {  // the last block of an N that is not a multiple of NB
      float tmp[NB];
      for (int v = 0; v < NBV; v++) *reinterpret_cast<vfu*>(tmp + v * V) = acc[r][v];
      std::memcpy(y + r * ldy, tmp, sizeof(float) * valid);
    }
  }
}

static void group(int rb, const float* x, long k, const float* pb, float* y, long ldy, int valid) {
  switch (rb) {
    case 1: micro<1>(x, k, pb, y, ldy, valid); break;
    case 2: micro<2>(x, k, pb, y, ldy, valid); break;
    case 3: micro<3>(x, k, pb, y, ldy, valid); break;
    case 4: micro<4>(x, k, pb, y, ldy, valid); break;
    case 5: micro<5>(x, k, pb, y, ldy, valid); break;
    case 6: micro<6>(x, k, pb, y, ldy, valid); break;
#if defined(__AVX512F__)
    case 7: micro<7>(x, k, pb, y, ldy, valid); break;
    case 8: micro<8>(x, k, pb, y, ldy, valid); break;
#endif
    default: break;
  }
}

// Rows come in groups of RBMAX for each block; a block's weights (k * NB floats) are read from memory by the
// first group and from cache by the others. ``threads`` > 1 splits the blocks among OpenMP threads (the
// runtime torch has loaded: one pool).
extern "C" void chorus_rows_product(const float* x, long rows, long k, const float* p, long n, float* y,
                                    int threads) {
  const long blocks = (n + NB - 1) / NB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (long b = 0; b < blocks; b++) {
    const float* pb = p + b * k * NB;
    const int valid = static_cast<int>(n - b * NB < NB ? n - b * NB : NB);
    for (long r0 = 0; r0 < rows; r0 += RBMAX) {
      const int rb = static_cast<int>(rows - r0 < RBMAX ? rows - r0 : RBMAX);
      group(rb, x + r0 * k, k, pb, y + r0 * n + b * NB, n, valid);
    }
  }
}
