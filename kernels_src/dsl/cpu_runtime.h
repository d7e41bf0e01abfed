// The CPU oracle's runtime for rendered SIMT kernels (cpu_target.py): every thread of a threadgroup is a fiber
// (ucontext), all running the same rendered body. A barrier or a simdgroup collective suspends the fiber; once
// every fiber of the group waits at the same kind of point the scheduler releases them all (a barrier also opens
// a new "epoch"). Threadgroup memory is shadowed per byte (writer, reader, epoch), so a missing barrier shows up
// as a race, a read of bytes never written as an error; global accesses are checked against the arguments'
// allocations. half / bfloat hold 16 bits and round every result, as the GPUs' 16-bit arithmetic does.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dsl {
namespace {

inline uint16_t f2h(float ff) {  // round to nearest even (F. Giesen's float_to_half_fast3_rtne)
  const uint32_t infty = 255u << 23, f16max = (127u + 16) << 23, magic = ((127u - 15) + (23 - 10) + 1) << 23;
  uint32_t f;
  std::memcpy(&f, &ff, 4);
  uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t o;
  if (f >= f16max) {
    o = f > infty ? 0x7e00 : 0x7c00;
  } else if (f < (113u << 23)) {
    float fl, dm;
    std::memcpy(&fl, &f, 4);
    std::memcpy(&dm, &magic, 4);
    fl += dm;
    uint32_t r;
    std::memcpy(&r, &fl, 4);
    o = (uint16_t)(r - magic);
  } else {
    uint32_t odd = (f >> 13) & 1;
    f += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
    o = (uint16_t)(f >> 13);
  }
  return (uint16_t)(o | (sign >> 16));
}

inline float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, out;
  if (e == 0) {
    float f = (float)m * (1.0f / 16777216.0f);
    std::memcpy(&out, &f, 4);
    out |= sign;
  } else {
    out = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

inline uint16_t f2bf(float ff) {
  uint32_t u;
  std::memcpy(&u, &ff, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

template <bool BF>
struct f16 {
  uint16_t bits;
  f16() = default;
  f16(float f) : bits(BF ? f2bf(f) : f2h(f)) {}
  template <class T, class = std::enable_if_t<std::is_arithmetic_v<T>>>
  f16(T v) : f16((float)v) {}
  operator float() const {
    if (!BF) return h2f(bits);
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
using half = f16<false>;
using bfloat = f16<true>;

enum State { READY, BARRIER, COLLECT, DONE, ABORT };
constexpr size_t STACK = 512 * 1024;

struct Fiber {
  ucontext_t ctx;
  int state = READY, site = 0, ncoll = 0;
};

struct Group {
  int nthreads = 0, cur = 0, epoch = 0, pid[3] = {0, 0, 0}, npid[3] = {1, 1, 1};
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  ucontext_t sched;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> smem;
  std::vector<int> w_tid, w_ep, r_tid, r_ep;
  std::vector<uint64_t> xch[2];
  std::vector<std::pair<uintptr_t, size_t>> allocs;
  std::string err;
};

Group g;

void suspend(int state, int site) {
  Fiber& f = g.fibers[g.cur];
  f.state = state;
  f.site = site;
  swapcontext(&f.ctx, &g.sched);
}

void fail(const std::string& msg) {
  if (g.err.empty())
    g.err = msg + " (thread " + std::to_string(g.cur) + ", program " + std::to_string(g.pid[0]) + "," +
            std::to_string(g.pid[1]) + "," + std::to_string(g.pid[2]) + ")";
  suspend(ABORT, 0);
}

void entry() {
  (*g.body)();
  suspend(DONE, 0);
}

void check_global(uintptr_t p, size_t n, const char* what) {
  for (auto& a : g.allocs)
    if (p >= a.first && p + n <= a.first + a.second) return;
  fail(std::string("global ") + what + " out of bounds");
}

void check_smem(size_t at, size_t n, bool write) {
  if (at + n > g.smem.size()) fail("threadgroup memory access out of bounds");
  int t = g.cur, ep = g.epoch;
  for (size_t i = at; i < at + n; ++i) {
    if (write) {
      if (g.w_ep[i] == ep && g.w_tid[i] != t) fail("race: two threads write threadgroup memory between barriers");
      if (g.r_ep[i] == ep && g.r_tid[i] != t) fail("race: threadgroup memory written while another thread reads it");
      g.w_ep[i] = ep;
      g.w_tid[i] = t;
    } else {
      if (g.w_ep[i] < 0) fail("race: threadgroup memory read before any thread wrote it (a missing barrier?)");
      if (g.w_ep[i] == ep && g.w_tid[i] != t) fail("race: threadgroup memory read before a barrier after its write");
      if (g.r_ep[i] != ep) {
        g.r_ep[i] = ep;
        g.r_tid[i] = t;
      } else if (g.r_tid[i] != t) {
        g.r_tid[i] = -2;
      }
    }
  }
}

template <class T>
int collect(T x) {  // publish x for the simdgroup; returns the exchange buffer to read
  Fiber& f = g.fibers[g.cur];
  int p = f.ncoll++ & 1;
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof(T));
  g.xch[p][g.cur] = bits;
  suspend(COLLECT, -1);
  return p;
}

template <class T>
T lane(int p, int t) {
  T v;
  std::memcpy(&v, &g.xch[p][t], sizeof(T));
  return v;
}

inline int tid() { return g.cur; }
inline int pid(int a) { return g.pid[a]; }
inline int npid(int a) { return g.npid[a]; }
inline void barrier(int site) { suspend(BARRIER, site); }

template <class T>
T ld(const T* p, int64_t off) {
  check_global((uintptr_t)p + (uintptr_t)(off * (int64_t)sizeof(T)), sizeof(T), "load");
  return p[off];
}
template <class T, class V>
void st(T* p, int64_t off, V v) {
  check_global((uintptr_t)p + (uintptr_t)(off * (int64_t)sizeof(T)), sizeof(T), "store");
  p[off] = v;
}
template <class T>
T sld(size_t base, int64_t i) {
  size_t at = base + (size_t)(i * (int64_t)sizeof(T));
  check_smem(at, sizeof(T), false);
  T v;
  std::memcpy(&v, &g.smem[at], sizeof(T));
  return v;
}
template <class T>
void sst(size_t base, int64_t i, T v) {
  size_t at = base + (size_t)(i * (int64_t)sizeof(T));
  check_smem(at, sizeof(T), true);
  std::memcpy(&g.smem[at], &v, sizeof(T));
}
template <class T>
T shfl_xor(T x, int m) {
  int p = collect(x);
  return lane<T>(p, g.cur ^ m);
}
template <class T, class F>
T simd_fold(T x, F f) {
  int p = collect(x), w = g.cur & ~31;
  T acc = lane<T>(p, w);
  for (int l = 1; l < 32; ++l) acc = f(acc, lane<T>(p, w + l));
  return acc;
}
template <class T>
T simd_sum(T x) { return simd_fold(x, [](T a, T b) { return T(a + b); }); }
template <class T>
T simd_max(T x) { return simd_fold(x, [](T a, T b) { return (a != a || a > b) ? a : b; }); }
template <class T>
T simd_min(T x) { return simd_fold(x, [](T a, T b) { return (a != a || a < b) ? a : b; }); }

// Runs every program of the grid; returns nullptr or the first error.
inline const char* run_grid(const int grid[3], int nthreads, size_t smem_bytes,
                            const std::vector<std::pair<uintptr_t, size_t>>& allocs,
                            const std::function<void()>& body) {
  g.err.clear();
  g.nthreads = nthreads;
  g.fibers.assign(nthreads, Fiber());
  g.stacks.resize((size_t)nthreads * STACK);
  g.body = &body;
  g.allocs = allocs;
  g.xch[0].assign(nthreads, 0);
  g.xch[1].assign(nthreads, 0);
  for (int a = 0; a < 3; ++a) g.npid[a] = grid[a];
  for (int z = 0; z < grid[2]; ++z)
    for (int y = 0; y < grid[1]; ++y)
      for (int x = 0; x < grid[0]; ++x) {
        g.pid[0] = x, g.pid[1] = y, g.pid[2] = z;
        g.epoch = 0;
        g.smem.assign(smem_bytes, 0xff);
        g.w_ep.assign(smem_bytes, -1);
        g.r_ep.assign(smem_bytes, -1);
        g.w_tid.assign(smem_bytes, -1);
        g.r_tid.assign(smem_bytes, -1);
        for (int t = 0; t < nthreads; ++t) {
          Fiber& f = g.fibers[t];
          f.state = READY, f.ncoll = 0;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = &g.stacks[(size_t)t * STACK];
          f.ctx.uc_stack.ss_size = STACK;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, entry, 0);
        }
        for (;;) {
          for (int t = 0; t < nthreads; ++t) {
            if (g.fibers[t].state != READY) continue;
            g.cur = t;
            swapcontext(&g.sched, &g.fibers[t].ctx);
            if (!g.err.empty()) return g.err.c_str();
          }
          int count[5] = {0, 0, 0, 0, 0};
          for (auto& f : g.fibers) count[f.state]++;
          if (count[DONE] == nthreads) break;
          if (count[DONE] || (count[BARRIER] && count[COLLECT])) {
            g.err = "threads of one program reach different barriers or collectives (divergent control flow)";
            return g.err.c_str();
          }
          for (auto& f : g.fibers)
            if (f.site != g.fibers[0].site) {
              g.err = "threads of one program wait at different barriers";
              return g.err.c_str();
            }
          if (count[BARRIER]) g.epoch++;
          for (auto& f : g.fibers) f.state = READY;
        }
      }
  return nullptr;
}

}  // namespace
}  // namespace dsl

namespace {
template <class To, class From>
inline To dsl_bitcast(From x) {
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}
}  // namespace
