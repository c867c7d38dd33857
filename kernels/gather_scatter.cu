// nixl-bounce: the batched gather/scatter copy kernel.
//
// Compiled at run time with NVRTC (src/copy/cuda/compile.rs) for the running GPU's
// architecture. NVRTC has no CUDA toolkit headers: only built-ins (uint4,
// threadIdx, __ballot_sync, __clz, ...) are used, and the integer types are
// spelled out below.
//
// One launch copies one chunk's whole run list. The host (`fill_table` in
// src/copy/cuda/table.rs) writes one table, in three parts:
//
//   runs[r]        4 x 64-bit words (`DevRun`): src, dst (first copy's
//                  source / destination), len (bytes per copy, > 0),
//                  count (low 32 bits, >= 1) | stride_index (high 32 bits)
//   tile_start[r]  u32, r = 0..=nruns: index of run r's first tile (prefix
//                  sum; tile_start[0] = 0, tile_start[nruns] = total_tiles;
//                  strictly increasing since every run has a tile)
//   strides[k]     2 x 64-bit words (src_stride, dst_stride) of the k-th
//                  run with count > 1 (its stride_index); single copies
//                  (the common case) need none, which keeps the table at
//                  36 bytes per run.
//
// A tile is (copy i of run r, byte window j of that copy): at most
// tile_bytes = 1 << tile_shift bytes. Tiles are numbered run after run, copy
// after copy: tile t of run r is copy (t - tile_start[r]) / tiles_per_copy,
// window (t - tile_start[r]) % tiles_per_copy, with tiles_per_copy =
// ceil(len / tile_bytes). A run with count = 1000 is one table entry: the
// copies are expanded here, never on the host.
//
// The unit of work is one WARP, not one block: warp w copies tiles
// [w * tiles_per_warp, (w + 1) * tiles_per_warp). No block-wide barrier
// anywhere, so the 8 warps of a block (and the blocks of the grid) run
// fully independently; tiles_per_warp is 1 unless the chunk has more tiles
// than the launch has warps (see `LaunchShape`). A warp finds the run of
// its first tile with a 32-ary search over tile_start (each lane probes one
// entry, a ballot picks the interval: ceil(log32(nruns)) rounds, 3 for
// 16384 runs, of one coalesced-ish load each, served by L2), then walks its
// tiles in order and loads the next run entry when it crosses a run
// boundary (the next tile is always in the next run).
//
// A tile is copied by the 32 lanes with the widest word the relative
// alignment of source and destination allows (16-byte uint4 when both are
// equally aligned mod 16, else 8, 4, 1), BOUNCE_UNROLL words per lane in
// flight: 32 x 16 B x 8 = 4 KiB per warp per round. Tiles start at
// multiples of tile_bytes (a multiple of 16) within a copy, so every tile
// keeps its copy's alignment.
//
// Direction (gather or scatter) is decided on the host by which side goes
// into src and which into dst.
//
// The pair table (`bounce_copy_pairs`, the peer-mapped path's table when
// every copy has one length, as real clients' KV blocks do): pairs[2i] and
// pairs[2i + 1] are copy i's source and destination, `len` bytes each. No
// run search and no per-run entry: 16 bytes per copy, written by the host
// in one pass over NIXL's descriptors. Tile t is copy t / per_copy, window
// t % per_copy (per_copy = ceil(len / tile_bytes)).
//
// Table location: `bounce_copy` reads a device copy uploaded (one
// cuMemcpyHtoDAsync on the same stream) before the launch: plain loads,
// L2-resident. `bounce_copy_zero_copy` reads mapped pinned host memory with
// volatile loads (so a reused pinned buffer is never served from a stale
// cache line); every table load is then a PCIe round trip, which makes it
// the slow option (see `ExecPool::new`). `bounce_copy_pairs_inline<N>`
// takes a pair table of at most N copies as its own parameter, and
// `bounce_copy_packed_inline<N>` the application addresses of at most N
// packed copies (the end of this file).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define BOUNCE_THREADS 256
#define BOUNCE_WARPS (BOUNCE_THREADS / 32)
// At least 3 resident blocks (24 warps) per SM: caps registers at 80 per
// thread; ptxas (sm_90, CUDA 13.0) then uses 80 with a 12-byte spill around
// the out-of-line slow path. Unbounded it takes 112 (2 blocks per SM); at 4
// blocks (64 registers) the uint4 path spills. 24 warps x 4 KiB in flight
// is ~96 KiB per SM, plenty for HBM.
#define BOUNCE_MIN_BLOCKS 3
#define BOUNCE_UNROLL 8
#define FULL_MASK 0xffffffffu

template <bool ZC>
__device__ __forceinline__ u32 ld_u32(const u32* p)
{
    if (ZC) return *(const volatile u32*)p;
    return *p;
}

template <bool ZC>
__device__ __forceinline__ u64 ld_u64(const u64* p)
{
    if (ZC) return *(const volatile u64*)p;
    return *p;
}

// Copies nwords words of type W with the 32 lanes of a warp; d and s are
// both aligned to sizeof(W). Lane l moves words l, l + 32, ...; each round
// issues U loads before the stores so they are in flight together. Full
// rounds need no bounds test (constant offsets from one pointer, few
// registers); the last partial round tests each word.
template <typename W, u32 U>
__device__ __forceinline__ void warp_words(u8* __restrict__ d, const u8* __restrict__ s,
                                           u32 nwords, u32 lane)
{
    W* __restrict__ dw = reinterpret_cast<W*>(d);
    const W* __restrict__ sw = reinterpret_cast<const W*>(s);
    u32 k = lane;
    for (; k + 32 * (U - 1) < nwords; k += 32 * U) {
        W v[U];
#pragma unroll
        for (u32 u = 0; u < U; ++u) v[u] = sw[k + u * 32];
#pragma unroll
        for (u32 u = 0; u < U; ++u) dw[k + u * 32] = v[u];
    }
    if (k < nwords) {
        W v[U];
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            if (k + u * 32 < nwords) v[u] = sw[k + u * 32];
        }
#pragma unroll
        for (u32 u = 0; u < U; ++u) {
            if (k + u * 32 < nwords) dw[k + u * 32] = v[u];
        }
    }
}

// Copies n bytes with words of type W: a byte head up to the first aligned
// source address (< sizeof(W) <= 16 bytes, one lane each), the aligned
// words, a byte tail (< sizeof(W)). Head, body and tail are disjoint.
template <typename W>
__device__ __forceinline__ void warp_copy_with(u8* d, const u8* s, u32 n, u32 lane)
{
    const u32 a = sizeof(W);
    u32 head = (a - ((u32)(u64)s & (a - 1))) & (a - 1);
    if (head > n) head = n;
    const u32 nwords = (n - head) / a;
    const u32 body = nwords * a;
    const u32 tail = n - head - body;
    if (lane < head) d[lane] = s[lane];
    warp_words<W, sizeof(W) == 16 ? BOUNCE_UNROLL : 4>(d + head, s + head, nwords, lane);
    if (lane < tail) d[head + body + lane] = s[head + body + lane];
}

// The rare paths (source and destination not equally aligned mod 16) are
// out of line, so their registers do not weigh on the uint4 path.
__device__ __noinline__ void warp_copy_slow(u8* d, const u8* s, u32 n, u32 lane, u32 mis)
{
    if ((mis & 7) == 0) {
        warp_copy_with<u64>(d, s, n, lane);
    } else if ((mis & 3) == 0) {
        warp_copy_with<u32>(d, s, n, lane);
    } else {
        warp_words<u8, 4>(d, s, n, lane);
    }
}

__device__ __forceinline__ void warp_copy(u64 dst, u64 src, u32 n, u32 lane)
{
    u8* d = reinterpret_cast<u8*>(dst);
    const u8* s = reinterpret_cast<const u8*>(src);
    const u32 mis = (u32)(dst ^ src) & 15;  // uniform across the warp
    if (mis == 0) {
        warp_copy_with<uint4>(d, s, n, lane);
    } else {
        warp_copy_slow(d, s, n, lane, mis);
    }
}

// The run holding tile t: the largest r < nruns with tile_start[r] <= t.
// Invariant: tile_start[lo] <= t and the answer is in [lo, hi). Every
// branch depends on ballots only, so it is uniform across the warp.
template <bool ZC>
__device__ __forceinline__ u32 find_run(const u32* tile_start, u32 nruns, u32 t, u32 lane)
{
    u32 lo = 0, hi = nruns;
    while (hi - lo > 32) {
        const u32 step = (hi - lo + 31) >> 5;
        const u32 idx = lo + lane * step;
        const bool le = idx < hi && ld_u32<ZC>(tile_start + idx) <= t;
        const u32 m = __ballot_sync(FULL_MASK, le);  // bit 0 always set
        const u32 k = 31 - __clz(m);                 // last probe <= t
        lo += k * step;
        if (hi - lo > step) hi = lo + step;  // probe k + 1 (if any) was > t
    }
    const u32 idx = lo + lane;
    const bool le = idx < hi && ld_u32<ZC>(tile_start + idx) <= t;
    const u32 m = __ballot_sync(FULL_MASK, le);
    return lo + 31 - __clz(m);
}

struct RunEntry {
    u64 src, dst, len, src_stride, dst_stride;
    u32 start, end, count;
};

template <bool ZC>
__device__ __forceinline__ void load_run(RunEntry& e, const u64* runs, const u32* tile_start,
                                         const u64* strides, u32 r)
{
    // Every lane loads the same words: one transaction per load, broadcast.
    const u64* p = runs + (u64)r * 4;
    e.src = ld_u64<ZC>(p);
    e.dst = ld_u64<ZC>(p + 1);
    e.len = ld_u64<ZC>(p + 2);
    const u64 w = ld_u64<ZC>(p + 3);
    e.start = ld_u32<ZC>(tile_start + r);
    e.end = ld_u32<ZC>(tile_start + r + 1);
    e.count = (u32)w;
    e.src_stride = 0;
    e.dst_stride = 0;
    if (e.count > 1) {
        const u64* q = strides + (w >> 32) * 2;
        e.src_stride = ld_u64<ZC>(q);
        e.dst_stride = ld_u64<ZC>(q + 1);
    }
}

template <bool ZC>
__device__ __forceinline__ void copy_tiles(const u64* runs, const u32* tile_start,
                                           const u64* strides, u32 total_tiles,
                                           u32 tiles_per_warp, u32 tile_shift, u32 nruns)
{
    const u32 lane = threadIdx.x & 31;
    const u64 warp = (u64)blockIdx.x * BOUNCE_WARPS + (threadIdx.x >> 5);
    const u64 first = warp * tiles_per_warp;
    if (first >= total_tiles) return;  // the whole warp: no work left
    u32 t = (u32)first;
    const u64 last = first + tiles_per_warp;
    const u32 t_end = last < total_tiles ? (u32)last : total_tiles;
    const u64 tile_bytes = (u64)1 << tile_shift;

    u32 r = find_run<ZC>(tile_start, nruns, t, lane);
    for (;;) {
        // The run entry is (re)loaded per tile rather than kept across the
        // copy (only r, t, t_end and end stay live), to save registers;
        // repeated loads of one entry are L1 hits (uploaded table).
        RunEntry e;
        load_run<ZC>(e, runs, tile_start, strides, r);
        const u32 end = e.end;
        // ceil(len / tile_bytes) <= total_tiles < 2^32 (checked on the host).
        const u32 per_copy = (u32)((e.len + tile_bytes - 1) >> tile_shift);
        const u32 local = t - e.start;
        u32 i = local, j = 0;
        if (per_copy != 1) {
            i = local / per_copy;
            j = local - i * per_copy;
        }
        const u64 off = (u64)j << tile_shift;
        const u64 left = e.len - off;
        const u32 n = (u32)(left < tile_bytes ? left : tile_bytes);
        warp_copy(e.dst + (u64)i * e.dst_stride + off, e.src + (u64)i * e.src_stride + off, n,
                  lane);
        if (++t >= t_end) break;
        if (t >= end) ++r;  // runs are never empty: tile t is run r + 1's first
    }
}

extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)
bounce_copy(const u64* runs, const u32* tile_start, const u64* strides, u32 total_tiles,
            u32 tiles_per_warp, u32 tile_shift, u32 nruns)
{
    copy_tiles<false>(runs, tile_start, strides, total_tiles, tiles_per_warp, tile_shift, nruns);
}

extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)
bounce_copy_zero_copy(const u64* runs, const u32* tile_start, const u64* strides,
                      u32 total_tiles, u32 tiles_per_warp, u32 tile_shift, u32 nruns)
{
    copy_tiles<true>(runs, tile_start, strides, total_tiles, tiles_per_warp, tile_shift, nruns);
}

// Copies tiles [w * tiles_per_warp, (w + 1) * tiles_per_warp) of copies
// that all have one length, warp w (see the top of this file): tile t is
// copy t / per_copy, window t % per_copy. `ends(i, src, dst)` gives copy
// i's source and destination (`PairEnds`, `PackedEnds`).
template <typename Ends>
__device__ __forceinline__ void copy_each(const Ends& ends, u64 len, u32 per_copy,
                                          u32 total_tiles, u32 tiles_per_warp, u32 tile_shift)
{
    const u32 lane = threadIdx.x & 31;
    const u64 warp = (u64)blockIdx.x * BOUNCE_WARPS + (threadIdx.x >> 5);
    const u64 first = warp * tiles_per_warp;
    if (first >= total_tiles) return;  // the whole warp: no work left
    const u64 last = first + tiles_per_warp;
    const u32 t_end = last < total_tiles ? (u32)last : total_tiles;
    const u64 tile_bytes = (u64)1 << tile_shift;
    for (u32 t = (u32)first; t < t_end; ++t) {
        u32 i = t, j = 0;
        if (per_copy != 1) {
            i = t / per_copy;
            j = t - i * per_copy;
        }
        u64 src, dst;
        ends(i, src, dst);
        const u64 off = (u64)j << tile_shift;
        const u64 left = len - off;
        const u32 n = (u32)(left < tile_bytes ? left : tile_bytes);
        warp_copy(dst + off, src + off, n, lane);
    }
}

// A pair table: pairs[2i] and pairs[2i + 1] are copy i's source and
// destination.
struct PairEnds {
    const u64* pairs;
    __device__ __forceinline__ void operator()(u32 i, u64& src, u64& dst) const
    {
        // Every lane loads the same two words: one broadcast transaction each.
        src = pairs[2 * (u64)i];
        dst = pairs[2 * (u64)i + 1];
    }
};

// Packed copies (a chunk of one length's blocks, as the arena packs them):
// copy i is `len` bytes between addrs[i] (the application's side) and
// region + i * len (the arena's, back to back), application -> region for
// a gather, region -> application for a scatter. Half a pair table's
// bytes: the region side is computed, not read.
struct PackedEnds {
    const u64* addrs;
    u64 region, len;
    u32 gather;
    __device__ __forceinline__ void operator()(u32 i, u64& src, u64& dst) const
    {
        // Every lane loads the same word: one broadcast transaction.
        const u64 app = addrs[i];
        const u64 reg = region + (u64)i * len;
        src = gather ? app : reg;
        dst = gather ? reg : app;
    }
};

// The pair table in device memory (uploaded before the launch).
extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)
bounce_copy_pairs(const u64* pairs, u64 len, u32 per_copy, u32 total_tiles, u32 tiles_per_warp,
                  u32 tile_shift)
{
    copy_each(PairEnds{pairs}, len, per_copy, total_tiles, tiles_per_warp, tile_shift);
}

// The pair table as the launch's own parameter (`bounce_copy_pairs_inline<N>`,
// N copies at most): nothing to allocate or upload before the launch, so a
// small transfer's preparation makes no driver call. The driver copies the
// parameter into the launch; `__grid_constant__` lets every warp read it in
// place (constant bank, one broadcast per load). Kernel parameters may be
// up to 32,764 bytes from CUDA 12.1 on (Volta and later); older NVRTCs and
// older GPUs compile these kernels out, and the host then uploads every
// table (as it does when the driver is older than 12.1).
#if defined(__CUDACC_VER_MAJOR__) &&                                                              \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1)) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700)
template <u32 N>
struct InlinePairs {
    u64 pairs[2 * N];
};

#define BOUNCE_INLINE_PAIRS_KERNEL(N)                                                           \
    extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)            \
        bounce_copy_pairs_inline##N(const __grid_constant__ InlinePairs<N> table, u64 len,      \
                                    u32 per_copy, u32 total_tiles, u32 tiles_per_warp,          \
                                    u32 tile_shift)                                             \
    {                                                                                           \
        copy_each(PairEnds{table.pairs}, len, per_copy, total_tiles, tiles_per_warp, tile_shift); \
    }

// The sizes are `INLINE_PAIRS` in src/copy/cuda/mod.rs: 4, 8, 16 and 31.9 KiB
// of table (2040 pairs: the table and the other parameters, 32,664 bytes,
// stay under the limit). A launch's cost grows with its parameter's size (1.5 us
// more than an uploaded table's at 4 KiB, 7 us at 32 KiB on the H200), so
// each table takes the smallest that holds it.
BOUNCE_INLINE_PAIRS_KERNEL(256)
BOUNCE_INLINE_PAIRS_KERNEL(512)
BOUNCE_INLINE_PAIRS_KERNEL(1024)
BOUNCE_INLINE_PAIRS_KERNEL(2040)

// Packed copies with their application addresses as the launch's own
// parameter (`bounce_copy_packed_inline<N>`, N copies at most; the region
// side computed, `PackedEnds`): a chunk's gather or a DATA's scatter of
// up to 1024 blocks with no table filled, allocated or uploaded, where an
// uploaded table costs a driver call of its own (~9 us under MPS on an
// H100). The sizes are `INLINE_PACKED` in src/copy/cuda/mod.rs: 2, 4 and
// 8 KiB of addresses. Not larger: on an H100 a lone 16,384-block request
// (chunks of 2048) took 0.94-0.98 ms with 16 KiB parameters against
// 0.83-0.87 uploaded (docs/benchmarks.md), while 1024 blocks gained.
template <u32 N>
struct InlineAddrs {
    u64 addrs[N];
};

#define BOUNCE_INLINE_PACKED_KERNEL(N)                                                          \
    extern "C" __global__ void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)            \
        bounce_copy_packed_inline##N(const __grid_constant__ InlineAddrs<N> table, u64 len,     \
                                     u32 per_copy, u32 total_tiles, u32 tiles_per_warp,         \
                                     u32 tile_shift, u64 region, u32 gather)                    \
    {                                                                                           \
        copy_each(PackedEnds{table.addrs, region, len, gather}, len, per_copy, total_tiles,     \
                  tiles_per_warp, tile_shift);                                                  \
    }

BOUNCE_INLINE_PACKED_KERNEL(256)
BOUNCE_INLINE_PACKED_KERNEL(512)
BOUNCE_INLINE_PACKED_KERNEL(1024)
#endif
