// FEPLB row-movement kernels (CuPy RawModule; compiled by NVRTC on the GPU host, by nvcc in tests).
//
// The Copy Engine moves contiguous byte ranges only, so every gather or scatter of rows happens
// here, on the SMs, right before or after a CE copy (a copy within one GPU would use SMs anyway). The kernels are dtype-agnostic
// where they only move bytes (rows of `row_bytes` bytes) and typed where they do arithmetic.
//
// No #include: NVRTC on the GPU host has no host headers, and bf16/f16 conversions are written
// with PTX `cvt` so cuda_bf16.h / cuda_fp16.h are not needed either. 64-bit integers are
// `long long`. Every kernel has a numpy/torch reference of its contract in
// deepspeed_feplb/gpu/reference.py; tests compare the two.
//
// Kernels (all extern "C"):
//   feplb_gather_rows(src, dst, index, n_rows, row_bytes)
//       dst[i] = src[index[i]]; index[i] < 0 writes a zero row.      (permute, pack send buffers)
//   feplb_scatter_rows(src, dst, index, n_rows, row_bytes)
//       dst[index[i]] = src[i]; index[i] < 0 skips row i.             (unpack results back)
//   feplb_expert_counts(expert_of_route, n_routes, n_experts, counts)
//       counts[e] = #{r : expert_of_route[r] == e}; one block per expert, no atomics.
//   feplb_expert_positions(expert_of_route, n_routes, n_experts, offsets, position)
//       position[r] = offsets[e] + (#{r' < r : expert_of_route[r'] == e}) for e = expert_of_route[r],
//       -1 for routes whose expert is outside [0, n_experts): a *stable* counting sort, so rows
//       grouped by expert keep their receive order (source rank, then token), deterministically.
//   feplb_weighted_combine_{f32,bf16,f16}(rows, slot, weight, out, n_tokens, k, hidden)
//       out[t, :] = sum_{j < k, slot[t, j] >= 0} weight[t, j] * rows[slot[t, j], :], products and sums
//       rounded separately in fp32 (no FMA, like torch), in the order j = 0 .. k-1, one final rounding.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned short u16;

// ------------------------------------------------------------------------------------------ bytes
// One block per row; threads stride over 16-byte words when the row and both base pointers allow
// it, else over bytes. A row of bf16 [7168] is 14336 bytes = 896 words: one pass of 256 threads x 4.
__device__ __forceinline__ bool aligned16(const void* p, i64 row_bytes) {
    return ((reinterpret_cast<u64>(p) | static_cast<u64>(row_bytes)) & 15ull) == 0ull;
}

__device__ __forceinline__ void copy_row(const char* __restrict__ s, char* __restrict__ d, i64 row_bytes,
                                         bool vec) {
    if (vec) {
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        for (i64 w = threadIdx.x; w < row_bytes / 16; w += blockDim.x) d4[w] = s4[w];
    } else {
        for (i64 b = threadIdx.x; b < row_bytes; b += blockDim.x) d[b] = s[b];
    }
}

__device__ __forceinline__ void zero_row(char* __restrict__ d, i64 row_bytes, bool vec) {
    if (vec) {
        uint4* d4 = reinterpret_cast<uint4*>(d);
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        for (i64 w = threadIdx.x; w < row_bytes / 16; w += blockDim.x) d4[w] = z;
    } else {
        for (i64 b = threadIdx.x; b < row_bytes; b += blockDim.x) d[b] = 0;
    }
}

extern "C" __global__ void feplb_gather_rows(const char* __restrict__ src, char* __restrict__ dst,
                                             const i64* __restrict__ index, i64 n_rows, i64 row_bytes) {
    const bool vec = aligned16(src, row_bytes) && aligned16(dst, row_bytes);
    for (i64 i = blockIdx.x; i < n_rows; i += gridDim.x) {
        const i64 j = index[i];
        char* d = dst + i * row_bytes;
        if (j < 0) zero_row(d, row_bytes, vec);
        else copy_row(src + j * row_bytes, d, row_bytes, vec);
    }
}

extern "C" __global__ void feplb_scatter_rows(const char* __restrict__ src, char* __restrict__ dst,
                                              const i64* __restrict__ index, i64 n_rows, i64 row_bytes) {
    const bool vec = aligned16(src, row_bytes) && aligned16(dst, row_bytes);
    for (i64 i = blockIdx.x; i < n_rows; i += gridDim.x) {
        const i64 j = index[i];
        if (j >= 0) copy_row(src + i * row_bytes, dst + j * row_bytes, row_bytes, vec);
    }
}

// --------------------------------------------------------------------------- stable counting sort
// Block-wide exclusive prefix of a 0/1 flag, in thread order. Needs blockDim.x a multiple of 32 and
// at most 1024; `warp_totals` is shared memory of 32 ints. Returns the prefix; *total gets the sum.
__device__ __forceinline__ int block_exclusive_flag_scan(int flag, int* warp_totals, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < n_warps; ++w) {
        const int c = warp_totals[w];
        if (w < warp) before += c;
        sum += c;
    }
    __syncthreads();  // warp_totals is reused by the next call
    *total = sum;
    return before + in_warp;
}

extern "C" __global__ void feplb_expert_counts(const i64* __restrict__ expert_of_route, i64 n_routes,
                                               i64 n_experts, i64* __restrict__ counts) {
    __shared__ int warp_totals[32];
    for (i64 e = blockIdx.x; e < n_experts; e += gridDim.x) {
        i64 count = 0;
        for (i64 base = 0; base < n_routes; base += blockDim.x) {
            const i64 r = base + threadIdx.x;
            const int flag = (r < n_routes && expert_of_route[r] == e) ? 1 : 0;
            int total;
            block_exclusive_flag_scan(flag, warp_totals, &total);
            count += total;
        }
        if (threadIdx.x == 0) counts[e] = count;
    }
}

extern "C" __global__ void feplb_expert_positions(const i64* __restrict__ expert_of_route, i64 n_routes,
                                                  i64 n_experts, const i64* __restrict__ offsets,
                                                  i64* __restrict__ position) {
    __shared__ int warp_totals[32];
    // routes outside [0, n_experts) get -1; blockIdx 0 writes them (each route exactly once)
    if (blockIdx.x == 0) {
        for (i64 r = threadIdx.x; r < n_routes; r += blockDim.x) {
            const i64 e = expert_of_route[r];
            if (e < 0 || e >= n_experts) position[r] = -1;
        }
    }
    for (i64 e = blockIdx.x; e < n_experts; e += gridDim.x) {
        i64 next = offsets[e];
        for (i64 base = 0; base < n_routes; base += blockDim.x) {
            const i64 r = base + threadIdx.x;
            const int flag = (r < n_routes && expert_of_route[r] == e) ? 1 : 0;
            int total;
            const int rank = block_exclusive_flag_scan(flag, warp_totals, &total);
            if (flag) position[r] = next + rank;
            next += total;
        }
    }
}

// ------------------------------------------------------------------------------ weighted combine
__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const u16* p, int is_bf16) {
    const u16 h = *p;
    if (is_bf16) return __uint_as_float(static_cast<unsigned>(h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 store_h(float f, int is_bf16) {
    u16 h;
    if (is_bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// One block per token, threads over hidden. `slot` and `weight` are [n_tokens, k] row-major;
// weights are fp32 whatever the row dtype (DeepSpeed's gates are fp32).
extern "C" __global__ void feplb_weighted_combine_f32(const float* __restrict__ rows, const i64* __restrict__ slot,
                                                      const float* __restrict__ weight, float* __restrict__ out,
                                                      i64 n_tokens, i64 k, i64 hidden) {
    for (i64 t = blockIdx.x; t < n_tokens; t += gridDim.x) {
        for (i64 h = threadIdx.x; h < hidden; h += blockDim.x) {
            float acc = 0.f;
            for (i64 j = 0; j < k; ++j) {
                const i64 s = slot[t * k + j];
                if (s >= 0) acc = __fadd_rn(acc, __fmul_rn(load_f(rows + s * hidden + h), weight[t * k + j]));
            }
            out[t * hidden + h] = acc;
        }
    }
}

__device__ __forceinline__ void combine_half(const u16* __restrict__ rows, const i64* __restrict__ slot,
                                             const float* __restrict__ weight, u16* __restrict__ out,
                                             i64 n_tokens, i64 k, i64 hidden, int is_bf16) {
    for (i64 t = blockIdx.x; t < n_tokens; t += gridDim.x) {
        for (i64 h = threadIdx.x; h < hidden; h += blockDim.x) {
            float acc = 0.f;
            for (i64 j = 0; j < k; ++j) {
                const i64 s = slot[t * k + j];
                if (s >= 0) acc = __fadd_rn(acc, __fmul_rn(load_f(rows + s * hidden + h, is_bf16), weight[t * k + j]));
            }
            out[t * hidden + h] = store_h(acc, is_bf16);
        }
    }
}

extern "C" __global__ void feplb_weighted_combine_bf16(const u16* __restrict__ rows, const i64* __restrict__ slot,
                                                       const float* __restrict__ weight, u16* __restrict__ out,
                                                       i64 n_tokens, i64 k, i64 hidden) {
    combine_half(rows, slot, weight, out, n_tokens, k, hidden, 1);
}

extern "C" __global__ void feplb_weighted_combine_f16(const u16* __restrict__ rows, const i64* __restrict__ slot,
                                                      const float* __restrict__ weight, u16* __restrict__ out,
                                                      i64 n_tokens, i64 k, i64 hidden) {
    combine_half(rows, slot, weight, out, n_tokens, k, hidden, 0);
}
