// nixl-bounce: the batched gather/scatter copy kernel.
//
// Compiled at run time with NVRTC (src/copy/cuda.rs) for the running GPU's
// architecture. NVRTC has no CUDA toolkit headers: only built-ins (uint4,
// threadIdx, __syncthreads, ...) are used, and the integer types are
// spelled out below.
//
// One launch copies one chunk's whole run list. The host writes a table
// (layout shared with `DevRun` in src/copy/cuda.rs, 8 x 64-bit words per run):
//
//   src, dst          address of the first copy's source / destination
//   len               bytes per copy (> 0)
//   src_stride,
//   dst_stride        address step between consecutive copies
//   first_tile        index of this run's first tile (prefix sum)
//   tiles_per_copy    ceil(len / tile_bytes)
//   count             copies in this run (>= 1)
//
// A tile is (copy i of run r, byte window j of that copy): at most
// `tile_bytes` bytes. Tiles are numbered run after run, copy after copy,
// so tile t of run r is copy (t - first_tile) / tiles_per_copy, window
// (t - first_tile) % tiles_per_copy. A run with count = 1000 is one table
// entry: the copies are expanded here, never on the host.
//
// Block b copies tiles [b * tiles_per_block, (b + 1) * tiles_per_block);
// `block_run[b]` is the run holding its first tile (computed by the host,
// so no block searches the table). A block walks its tiles in order and
// loads the next run entry when it crosses a run boundary (runs are never
// empty, so the next tile is always in the next run).
//
// Direction (gather or scatter) is decided on the host by which side goes
// into src and which into dst.
//
// Table and block_run are either mapped pinned host memory (zero-copy:
// read over PCIe, a handful of loads per block) or a device copy uploaded
// before the launch; the kernel does not care which. They are read with
// volatile loads so a reused pinned buffer is never served from a stale
// cache line.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define BOUNCE_THREADS 256
#define BOUNCE_UNROLL 4

// Copies n bytes as words of type W; d and s are both aligned to sizeof(W).
// The whole block takes part; words are interleaved across threads so each
// warp access is coalesced.
template <typename W>
__device__ __forceinline__ void copy_words(u8* __restrict__ d, const u8* __restrict__ s,
                                           u64 nwords, u32 tid, u32 nt)
{
    W* __restrict__ dw = reinterpret_cast<W*>(d);
    const W* __restrict__ sw = reinterpret_cast<const W*>(s);
    const u64 step = (u64)nt * BOUNCE_UNROLL;
    for (u64 base = tid; base < nwords; base += step) {
        W v[BOUNCE_UNROLL];
#pragma unroll
        for (u32 u = 0; u < BOUNCE_UNROLL; ++u) {
            const u64 k = base + (u64)u * nt;
            if (k < nwords) v[u] = sw[k];
        }
#pragma unroll
        for (u32 u = 0; u < BOUNCE_UNROLL; ++u) {
            const u64 k = base + (u64)u * nt;
            if (k < nwords) dw[k] = v[u];
        }
    }
}

__device__ __forceinline__ void copy_bytes(u8* __restrict__ d, const u8* __restrict__ s, u64 n,
                                           u32 tid, u32 nt)
{
    for (u64 k = tid; k < n; k += nt) d[k] = s[k];
}

// Copies n bytes with the widest word size the relative alignment of s and
// d allows: a byte head up to the first aligned address, aligned words, a
// byte tail. Head, body and tail are disjoint, so no barrier between them.
template <typename W>
__device__ __forceinline__ void copy_with(u8* d, const u8* s, u64 n, u32 tid, u32 nt)
{
    const u64 a = sizeof(W);
    u64 head = (a - ((u64)s & (a - 1))) & (a - 1);
    if (head > n) head = n;
    const u64 nwords = (n - head) / a;
    const u64 body = nwords * a;
    copy_bytes(d, s, head, tid, nt);
    copy_words<W>(d + head, s + head, nwords, tid, nt);
    copy_bytes(d + head + body, s + head + body, n - head - body, tid, nt);
}

__device__ __forceinline__ void block_copy(u64 dst, u64 src, u64 n, u32 tid, u32 nt)
{
    u8* d = reinterpret_cast<u8*>(dst);
    const u8* s = reinterpret_cast<const u8*>(src);
    const u64 mis = dst ^ src;
    if ((mis & 15) == 0) {
        copy_with<uint4>(d, s, n, tid, nt);
    } else if ((mis & 7) == 0) {
        copy_with<u64>(d, s, n, tid, nt);
    } else if ((mis & 3) == 0) {
        copy_with<u32>(d, s, n, tid, nt);
    } else {
        copy_bytes(d, s, n, tid, nt);
    }
}

extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS)
bounce_copy(const u64* runs, const u32* block_run, u64 total_tiles, u64 tiles_per_block,
            u64 tile_bytes, u32 nruns)
{
    __shared__ u64 run[8];
    __shared__ u32 first_run;

    const u32 tid = threadIdx.x;
    const u32 nt = blockDim.x;
    const u64 t0 = (u64)blockIdx.x * tiles_per_block;
    if (t0 >= total_tiles) return;  // uniform across the block
    u64 t_end = t0 + tiles_per_block;
    if (t_end > total_tiles) t_end = total_tiles;

    if (tid == 0) first_run = ((const volatile u32*)block_run)[blockIdx.x];
    __syncthreads();
    u32 r = first_run;
    if (r >= nruns) return;  // cannot happen with a host-built table; uniform
    if (tid < 8) run[tid] = ((const volatile u64*)(runs + (u64)r * 8))[tid];
    __syncthreads();

    for (u64 t = t0; t < t_end; ++t) {
        // run[] is shared, so this test is uniform and the barriers are safe.
        if (t >= run[5] + run[6] * run[7]) {
            __syncthreads();  // every thread is done with the current entry
            ++r;
            if (r >= nruns) return;  // uniform; cannot happen (see above)
            if (tid < 8) run[tid] = ((const volatile u64*)(runs + (u64)r * 8))[tid];
            __syncthreads();
        }
        const u64 local = t - run[5];
        const u64 i = local / run[6];
        const u64 j = local - i * run[6];
        const u64 off = j * tile_bytes;
        u64 n = run[2] - off;
        if (n > tile_bytes) n = tile_bytes;
        block_copy(run[1] + i * run[4] + off, run[0] + i * run[3] + off, n, tid, nt);
    }
}
