//! The CUDA copy engine: gather/scatter of a chunk's whole run list with one
//! kernel launch (`kernels/gather_scatter.cu`, compiled at first use with
//! NVRTC for the running GPU and cached per process and device).
//!
//! Pieces, bottom up:
//! - [`CudaRuntime::probe`]: finds the driver without panicking (cudarc's
//!   dynamic loading panics when `libcuda.so` is absent) and counts devices;
//!   [`CudaRuntime::device`] opens a device once per process ([`CudaDevice`]).
//! - [`CudaDevice::copy_kernel`]: the NVRTC-compiled kernel ([`CopyKernel`]),
//!   compiled once; a compile error carries NVRTC's log.
//! - [`ExecPool`]: `copy_stream_count` execution contexts {stream, event,
//!   pinned run table, optional device copy of the table}; borrowed through
//!   [`ExecGuard`] (returned on drop). A context in the pool never has work
//!   in flight.
//! - [`CudaCopy`]: [`CopyEngine`] (blocking, for scatter workers) plus the
//!   non-blocking [`CudaCopy::try_start`] / [`PendingCopy::poll`] pair for the
//!   IO thread (eager gathers; completion by event query).
//!
//! The run table ([`DevRun`], 32 bytes per run) and the per-block start runs
//! are built by [`fill_table`], a pure function that is unit-tested (with a
//! host model of the kernel) on machines without a GPU.
//!
//! Errors: every CUDA call is checked; a [`CopyError`] names the call and the
//! driver's error name. After a failed launch or a failed completion,
//! `quiesced` says whether the context's stream could be synchronised: when
//! it is false the memory the copy touched may still be in use, the context
//! is discarded (its pinned memory leaked on purpose, never freed under a
//! running kernel) and the caller must poison the arena.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc;

use super::{check_runs, CopyEngine, CopyError, Direction, LaunchedCopy, RegionSpan};
use crate::proto::Run;
use crate::sync::Locked;

/// The kernel's CUDA C source.
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/gather_scatter.cu");
/// The kernel's (unmangled) name: reads an uploaded (device) table.
pub const KERNEL_NAME: &str = "bounce_copy";
/// The same kernel reading its table from mapped pinned host memory.
pub const ZERO_COPY_KERNEL_NAME: &str = "bounce_copy_zero_copy";
/// The kernel over a pair table (every copy one length; [`pairs_shape`]).
pub const PAIRS_KERNEL_NAME: &str = "bounce_copy_pairs";
/// The sizes (in copies) of the pair kernels that take their table as a
/// launch parameter (`bounce_copy_pairs_inline<N>`), smallest first: a
/// table of at most the largest needs no device memory and no upload.
pub const INLINE_PAIRS: [usize; 4] = [256, 512, 1024, 2040];
/// Threads per block (matches `BOUNCE_THREADS` / `__launch_bounds__` in the source).
pub const BLOCK_THREADS: u32 = 256;
/// Warps per block: the kernel's unit of work is one warp.
pub const WARPS_PER_BLOCK: u32 = BLOCK_THREADS / 32;
/// Default bytes per tile (one warp's unit of work): a power of two, at
/// least 16. 8 KiB is two rounds of 32 lanes x 16 B x 8 words in flight;
/// copies of up to 8 KiB (most KV blocks) are one tile each.
pub const DEFAULT_TILE_BYTES: u64 = 8 * 1024;
/// Largest tile size (a tile's byte count is 32-bit on the device).
pub const MAX_TILE_BYTES: u64 = 1 << 30;
/// Default launch size in "waves" of resident blocks: the grid covers every
/// tile (one tile per warp) up to this many waves, after which warps take
/// several consecutive tiles each (tune with [`CopyOptions::max_blocks`];
/// `gpu-probe --max-blocks N` measures it).
pub const GRID_WAVES: u32 = 4;
/// Runs the pinned table is sized for before it first grows.
const INITIAL_TABLE_RUNS: usize = 1024;

// ---------------------------------------------------------------------------
// Host-side planning (pure; runs everywhere)
// ---------------------------------------------------------------------------

/// One run as the kernel reads it: 4 little-endian 64-bit words (the layout
/// documented at the top of `kernels/gather_scatter.cu`). The strides of a
/// run with `count > 1` live in the table's stride list at `stride_index`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevRun {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub count: u32,
    /// Index into the stride list (only meaningful when `count > 1`).
    pub stride_index: u32,
}

const _: () = assert!(std::mem::size_of::<DevRun>() == 32);

/// (src_stride, dst_stride) of one run with `count > 1`.
pub type DevStrides = [u64; 2];

/// Where the three parts of a table of `nruns` runs lie in one buffer:
/// `nruns` [`DevRun`]s, then `nruns + 1` `u32` tile starts, then (16-byte
/// aligned) up to `nruns` [`DevStrides`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableLayout {
    pub nruns: usize,
    pub tile_start_offset: usize,
    pub strides_offset: usize,
    /// Bytes the buffer needs (every run strided, the worst case).
    pub capacity: usize,
}

impl TableLayout {
    pub fn new(nruns: usize) -> Option<TableLayout> {
        let tile_start_offset = nruns.checked_mul(std::mem::size_of::<DevRun>())?;
        let strides_offset = tile_start_offset
            .checked_add(nruns.checked_add(1)?.checked_mul(4)?)?
            .checked_next_multiple_of(16)?;
        let capacity =
            strides_offset.checked_add(nruns.checked_mul(std::mem::size_of::<DevStrides>())?)?;
        Some(TableLayout {
            nruns,
            tile_start_offset,
            strides_offset,
            capacity,
        })
    }
}

/// The three parts of a run table of `nruns` runs laid out by `layout` in
/// the buffer at `base`: the runs, the tile starts, the stride slots.
///
/// # Safety
/// `base` must point to at least `layout.capacity` writable bytes, aligned
/// to 8, that nothing else reads or writes while the slices live, and
/// `layout` must be `TableLayout::new(nruns)`.
pub(crate) unsafe fn table_parts<'a>(
    base: *mut u8,
    layout: &TableLayout,
) -> (&'a mut [DevRun], &'a mut [u32], &'a mut [DevStrides]) {
    let nruns = layout.nruns;
    // SAFETY (of each part): nruns DevRuns at 0, nruns + 1 u32s at
    // tile_start_offset, nruns DevStrides at strides_offset (16-aligned):
    // disjoint, inside `layout.capacity`, aligned for their types given an
    // 8-aligned base (the caller's promise).
    (
        std::slice::from_raw_parts_mut(base as *mut DevRun, nruns),
        std::slice::from_raw_parts_mut(base.add(layout.tile_start_offset) as *mut u32, nruns + 1),
        std::slice::from_raw_parts_mut(base.add(layout.strides_offset) as *mut DevStrides, nruns),
    )
}

/// Launches `func` (one of the copy kernels) over the table at device
/// address `table` laid out by `layout`, with the grid `shape` asks for.
///
/// # Safety
/// `func` must be a copy kernel of the current context's module, `table` a
/// filled table (`fill_table`) that stays allocated and unchanged until the
/// kernel ended, and every address in it valid for the kernel to read
/// (sources) or write (destinations) until then.
pub(crate) unsafe fn launch_copy(
    func: &CudaFunction,
    table: u64,
    layout: &TableLayout,
    shape: &LaunchShape,
    stream: sys::CUstream,
) -> Result<(), result::DriverError> {
    let mut a_runs: u64 = table;
    let mut a_tile_start: u64 = table + layout.tile_start_offset as u64;
    let mut a_strides: u64 = table + layout.strides_offset as u64;
    let mut a_total: u32 = shape.total_tiles;
    let mut a_tpw: u32 = shape.tiles_per_warp;
    let mut a_shift: u32 = shape.tile_shift();
    let mut a_nruns: u32 = shape.nruns;
    let mut params: [*mut c_void; 7] = [
        &mut a_runs as *mut u64 as *mut c_void,
        &mut a_tile_start as *mut u64 as *mut c_void,
        &mut a_strides as *mut u64 as *mut c_void,
        &mut a_total as *mut u32 as *mut c_void,
        &mut a_tpw as *mut u32 as *mut c_void,
        &mut a_shift as *mut u32 as *mut c_void,
        &mut a_nruns as *mut u32 as *mut c_void,
    ];
    // The kernels' parameters are (u64, u64, u64, u32, u32, u32, u32),
    // matching `params`; the rest is the caller's promise.
    launch_grid(func, shape, stream, &mut params)
}

/// Launches `func` on `shape`'s grid of [`BLOCK_THREADS`]-thread blocks
/// with `params` (which cuLaunchKernel copies before returning).
///
/// # Safety
/// `params` point to values of `func`'s parameter types, in order; the
/// rest is the promise of [`launch_copy`] or [`launch_pairs`].
unsafe fn launch_grid(
    func: &CudaFunction,
    shape: &LaunchShape,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), result::DriverError> {
    result::launch_kernel(
        func.cu_function(),
        (shape.grid, 1, 1),
        (BLOCK_THREADS, 1, 1),
        0,
        stream,
        params,
    )
}

/// The launch a filled table describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub nruns: u32,
    /// Runs with `count > 1` (entries of the stride list).
    pub nstrided: u32,
    pub total_tiles: u32,
    /// Consecutive tiles per warp (1 unless the tiles outnumber `max_warps`).
    pub tiles_per_warp: u32,
    /// Blocks to launch (of [`WARPS_PER_BLOCK`] warps).
    pub grid: u32,
    pub tile_bytes: u64,
    pub total_bytes: u64,
}

impl LaunchShape {
    /// The launch of `total_tiles` tiles on at most `max_warps` warps (> 0):
    /// one tile per warp, or as many consecutive tiles per warp as it takes
    /// to stay within `max_warps`.
    fn spread(
        nruns: u32,
        nstrided: u32,
        total_tiles: u32,
        max_warps: u32,
        tile_bytes: u64,
        total_bytes: u64,
    ) -> Self {
        let tiles_per_warp = total_tiles.div_ceil(max_warps);
        let warps = total_tiles.div_ceil(tiles_per_warp);
        LaunchShape {
            nruns,
            nstrided,
            total_tiles,
            tiles_per_warp,
            grid: warps.div_ceil(WARPS_PER_BLOCK),
            tile_bytes,
            total_bytes,
        }
    }

    /// `log2(tile_bytes)`.
    pub fn tile_shift(&self) -> u32 {
        self.tile_bytes.trailing_zeros()
    }
    /// Bytes of the table actually used (what is uploaded): everything up
    /// to the end of the stride list.
    pub fn table_bytes(&self) -> usize {
        let l = TableLayout::new(self.nruns as usize).expect("a filled table's layout fits");
        l.strides_offset + self.nstrided as usize * std::mem::size_of::<DevStrides>()
    }
}

/// Table capacity (bytes) needed for `nruns` runs.
pub fn table_capacity(nruns: usize) -> Option<usize> {
    TableLayout::new(nruns).map(|l| l.capacity)
}

/// Whether `tile_bytes` is usable: a power of two in 16..=[`MAX_TILE_BYTES`]
/// (a multiple of 16 keeps every tile's alignment; a power of two lets the
/// kernel shift instead of divide).
pub fn valid_tile_bytes(tile_bytes: u64) -> bool {
    tile_bytes.is_power_of_two() && (16..=MAX_TILE_BYTES).contains(&tile_bytes)
}

/// Validates `runs` against `region`, writes the kernel's run table into
/// `out_runs` (at least `runs.len()` entries), the tile starts into
/// `out_tile_start` (at least `runs.len() + 1`) and the strides of the runs
/// with `count > 1` into `out_strides` (at least `runs.len()` slots), and
/// returns the launch shape: at most `max_warps` warps,
/// each taking `tiles_per_warp` consecutive tiles. Nothing is written past
/// what the shape uses. `tile_bytes` must pass [`valid_tile_bytes`].
///
/// One linear pass over the runs (validation folded in: the same checks as
/// [`check_runs`], which only runs again to word an error), no allocation,
/// no division (tile sizes are powers of two).
#[allow(clippy::too_many_arguments)]
pub fn fill_table(
    direction: Direction,
    region: RegionSpan,
    runs: &[Run],
    tile_bytes: u64,
    max_warps: u32,
    out_runs: &mut [DevRun],
    out_tile_start: &mut [u32],
    out_strides: &mut [DevStrides],
) -> Result<LaunchShape, CopyError> {
    let fail = |reason: String| CopyError {
        direction,
        reason,
        quiesced: true,
    };
    if !valid_tile_bytes(tile_bytes) {
        return Err(fail(format!(
            "tile size {tile_bytes} is not a power of two from 16 to {MAX_TILE_BYTES}"
        )));
    }
    if max_warps == 0 {
        return Err(fail("a launch of at most 0 warps".into()));
    }
    if runs.is_empty() {
        return Err(fail("no runs to copy".into()));
    }
    // Below 2^31 so the kernel's 32-ary search never overflows an index.
    let nruns = u32::try_from(runs.len())
        .ok()
        .filter(|&n| n < 1 << 31)
        .ok_or_else(|| {
            fail(format!(
                "{} runs in one launch (at most 2^31 - 1)",
                runs.len()
            ))
        })?;
    let nr = runs.len();
    if out_runs.len() < nr || out_tile_start.len() <= nr || out_strides.len() < nr {
        return Err(fail(format!(
            "run table too small: {} run, {} tile-start and {} stride slots for {nr} runs",
            out_runs.len(),
            out_tile_start.len(),
            out_strides.len(),
        )));
    }
    let shift = tile_bytes.trailing_zeros();
    let region_base = region.addr as u64;
    let region_len = region.len as u64;
    // One pass that checks and fills at once: the checks of `check_runs`
    // are folded into one flag with wrapping arithmetic (no early exit, no
    // error built per run); when the flag is set, `check_runs` runs again
    // to name the first bad run. Tables of bad runs are never launched.
    let out_runs = &mut out_runs[..nr];
    let out_tile_start = &mut out_tile_start[..=nr];
    // The direction is a constant of the loop (one instance each), and a
    // single copy (`count == 1`, every run of scattered blocks) takes the
    // short form of the same checks: together they halved the pass on the
    // 2-core VM (not on the H200 host, docs/benchmarks.md).
    let fill = match direction {
        Direction::Gather => fill_runs::<true>,
        Direction::Scatter => fill_runs::<false>,
    };
    let Filled {
        bad,
        total_bytes,
        total_tiles,
        nstrided,
    } = fill(
        region_base,
        region_len,
        shift,
        runs,
        out_runs,
        out_tile_start,
        out_strides,
    );
    if bad {
        check_runs(direction, region.len, runs)?;
        return Err(fail(
            "the runs' total size or region addresses overflow".into(),
        ));
    }
    // Tile indices are 32-bit on the device.
    if total_tiles > u64::from(u32::MAX) {
        return Err(fail(format!(
            "{total_tiles} tiles of {tile_bytes} bytes in one launch (at most {})",
            u32::MAX
        )));
    }
    out_tile_start[nr] = total_tiles as u32;
    Ok(LaunchShape::spread(
        nruns,
        nstrided as u32,
        total_tiles as u32,
        max_warps,
        tile_bytes,
        total_bytes,
    ))
}

/// What [`fill_runs`] found: whether any run failed a check (the error is
/// worded by `check_runs`), the bytes and tiles of all runs, and how many
/// stride slots it used.
struct Filled {
    bad: bool,
    total_bytes: u64,
    total_tiles: u64,
    nstrided: usize,
}

/// [`fill_table`]'s pass over the runs, for one direction (`GATHER`: the
/// application side is the source). `out_runs` and `out_tile_start` hold
/// exactly `runs.len()` and `runs.len() + 1` slots, `out_strides` at least
/// `runs.len()`. Checks are folded into one flag with wrapping arithmetic;
/// a single copy (`count == 1`) needs no stride arithmetic, so it takes the
/// short form of the same checks.
#[inline(always)]
fn fill_runs<const GATHER: bool>(
    region_base: u64,
    region_len: u64,
    shift: u32,
    runs: &[Run],
    out_runs: &mut [DevRun],
    out_tile_start: &mut [u32],
    out_strides: &mut [DevStrides],
) -> Filled {
    let tile_mask = (1u64 << shift) - 1;
    let mut bad = false;
    let mut total_bytes: u64 = 0;
    let mut total_tiles: u64 = 0;
    let mut nstrided: usize = 0;
    for ((run, out), start) in runs
        .iter()
        .zip(out_runs.iter_mut())
        .zip(out_tile_start.iter_mut())
    {
        let len = run.len;
        let (region_addr, o_base) = region_base.overflowing_add(run.region_offset);
        let mut stride_index = 0u32;
        let tiles = if run.count == 1 {
            let (r_end, o1) = run.region_offset.overflowing_add(len);
            let (_, o2) = run.addr.overflowing_add(len);
            let (sum, o3) = total_bytes.overflowing_add(len);
            total_bytes = sum;
            bad |= (len == 0) | (r_end > region_len) | o1 | o2 | o3 | o_base;
            // Valid runs have len <= region.len, so this does not overflow.
            len.wrapping_add(tile_mask) >> shift
        } else {
            let count = u64::from(run.count);
            let more = count.wrapping_sub(1);
            let (r_last, o1) = more.overflowing_mul(run.region_stride);
            let (r_end, o2) = run.region_offset.overflowing_add(r_last);
            let (r_end, o3) = r_end.overflowing_add(len);
            let (a_last, o4) = more.overflowing_mul(run.addr_stride);
            let (a_end, o5) = run.addr.overflowing_add(a_last);
            let (_, o6) = a_end.overflowing_add(len);
            let (bytes, o7) = len.overflowing_mul(count);
            let (sum, o8) = total_bytes.overflowing_add(bytes);
            total_bytes = sum;
            bad |= (len == 0)
                | (count == 0)
                | (r_end > region_len)
                | o1
                | o2
                | o3
                | o4
                | o5
                | o6
                | o7
                | o8
                | o_base;
            if count > 1 {
                // nstrided < runs.len() <= out_strides.len().
                out_strides[nstrided] = if GATHER {
                    [run.addr_stride, run.region_stride]
                } else {
                    [run.region_stride, run.addr_stride]
                };
                stride_index = nstrided as u32;
                nstrided += 1;
            }
            (len.wrapping_add(tile_mask) >> shift).saturating_mul(count)
        };
        let (src, dst) = if GATHER {
            (run.addr, region_addr)
        } else {
            (region_addr, run.addr)
        };
        *start = total_tiles as u32;
        *out = DevRun {
            src,
            dst,
            len,
            count: run.count,
            stride_index,
        };
        total_tiles = total_tiles.saturating_add(tiles);
    }
    Filled {
        bad,
        total_bytes,
        total_tiles,
        nstrided,
    }
}

/// The pair table of `runs` when every copy of every run has one length,
/// as [`fill_table`] would check them: copy j's (source, destination) into
/// words 2j and 2j + 1 of `out`, a strided run's copies one by one.
/// Returns the length and the number of copies; `Ok(None)` when the runs
/// are of another shape or have more copies than `out` holds (`out` then
/// holds nothing usable: build a run table instead). Errors are worded by
/// [`check_runs`], as the run table's.
///
/// One pass, checks folded into a flag as in [`fill_runs`]. Real clients'
/// chunks are of this shape (vLLM: every block the same size; the plan
/// merges two blocks whose addresses both step forward into a strided run
/// of two), and the pair table is 16 bytes a copy against the run table's
/// 36 a run (52 a strided one).
pub fn fill_pairs(
    direction: Direction,
    region: RegionSpan,
    runs: &[Run],
    out: &mut [u64],
) -> Result<Option<(u64, usize)>, CopyError> {
    let Some(first) = runs.first() else {
        return Ok(None);
    };
    let len = first.len;
    let region_base = region.addr as u64;
    let region_len = region.len as u64;
    let gather = direction == Direction::Gather;
    let mut bad = len == 0;
    let mut at = 0usize;
    for run in runs {
        // Of another shape (merged neighbours, mixed sizes) or too many
        // copies: stop at once, so a run table costs little more than its
        // own pass.
        let count = run.count as usize;
        if run.len != len || out.len() - at < 2 * count {
            return Ok(None);
        }
        let (region_addr, o_base) = region_base.overflowing_add(run.region_offset);
        let (src, dst, src_step, dst_step) = if gather {
            (run.addr, region_addr, run.addr_stride, run.region_stride)
        } else {
            (region_addr, run.addr, run.region_stride, run.addr_stride)
        };
        if count == 1 {
            let (r_end, o1) = run.region_offset.overflowing_add(len);
            let (_, o2) = run.addr.overflowing_add(len);
            bad |= (r_end > region_len) | o1 | o2 | o_base;
            out[at] = src;
            out[at + 1] = dst;
            at += 2;
            continue;
        }
        let more = (count as u64).wrapping_sub(1);
        let (r_last, o1) = more.overflowing_mul(run.region_stride);
        let (r_end, o2) = run.region_offset.overflowing_add(r_last);
        let (r_end, o3) = r_end.overflowing_add(len);
        let (a_last, o4) = more.overflowing_mul(run.addr_stride);
        let (a_end, o5) = run.addr.overflowing_add(a_last);
        let (_, o6) = a_end.overflowing_add(len);
        bad |= (count == 0) | (r_end > region_len) | o1 | o2 | o3 | o4 | o5 | o6 | o_base;
        // Wrapping: a run that overflows is refused below, never launched.
        let (mut s, mut d) = (src, dst);
        for pair in out[at..at + 2 * count].chunks_exact_mut(2) {
            pair[0] = s;
            pair[1] = d;
            s = s.wrapping_add(src_step);
            d = d.wrapping_add(dst_step);
        }
        at += 2 * count;
    }
    let copies = at / 2;
    if bad || len.checked_mul(copies as u64).is_none() {
        check_runs(direction, region.len, runs)?;
        return Err(CopyError {
            direction,
            reason: "the runs' total size or region addresses overflow".into(),
            quiesced: true,
        });
    }
    Ok(Some((len, copies)))
}

/// The launch of a pair table (`bounce_copy_pairs` in
/// `kernels/gather_scatter.cu`): `n` copies of `len` bytes each, table
/// entry i the (source, destination) of copy i, 16 bytes per copy. The
/// caller writes the pairs; this checks that such a launch exists (tiles
/// counted in 32 bits, `n` below 2^31) and sizes it as [`fill_table`] would
/// the same copies unmerged (tested against it). `nruns` is `n`.
pub fn pairs_shape(
    n: usize,
    len: u64,
    tile_bytes: u64,
    max_warps: u32,
) -> Result<LaunchShape, String> {
    if n == 0 || len == 0 {
        return Err("a copy of no bytes".into());
    }
    if !valid_tile_bytes(tile_bytes) || max_warps == 0 {
        return Err(format!(
            "tile size {tile_bytes} or launch of {max_warps} warps unusable"
        ));
    }
    let per_copy = len.div_ceil(tile_bytes);
    let total_tiles = u32::try_from(per_copy.saturating_mul(n as u64))
        .map_err(|_| format!("{n} copies of {len} bytes: too many tiles for one launch"))?;
    let nruns = u32::try_from(n)
        .ok()
        .filter(|&r| r < 1 << 31)
        .ok_or_else(|| format!("{n} copies in one launch (at most 2^31 - 1)"))?;
    let total_bytes = len
        .checked_mul(n as u64)
        .ok_or_else(|| format!("{n} copies of {len} bytes overflow"))?;
    Ok(LaunchShape::spread(
        nruns,
        0,
        total_tiles,
        max_warps,
        tile_bytes,
        total_bytes,
    ))
}

/// Bytes of a pair table of `n` copies.
pub const fn pairs_table_bytes(n: usize) -> usize {
    n * 16
}

/// Launches `func` (the pair kernel) over the pair table at device address
/// `table` of copies `len` bytes long, with the grid `shape`
/// ([`pairs_shape`]) asks for.
///
/// # Safety
/// `func` must be the pair kernel of the current context's module, `table`
/// `shape.nruns` (source, destination) pairs that stay allocated and
/// unchanged until the kernel ended, and every range they name valid for
/// the kernel to read (sources) or write (destinations) until then.
pub(crate) unsafe fn launch_pairs(
    func: &CudaFunction,
    table: u64,
    len: u64,
    shape: &LaunchShape,
    stream: sys::CUstream,
) -> Result<(), result::DriverError> {
    let mut a_pairs: u64 = table;
    // The kernel's first parameter is the table's address (u64).
    pair_launch(
        func,
        &mut a_pairs as *mut u64 as *mut c_void,
        len,
        shape,
        stream,
    )
}

/// Launches a pair kernel whose first parameter is at `table` (the table's
/// address, or the table itself), then (len u64, per_copy u32, total_tiles
/// u32, tiles_per_warp u32, tile_shift u32).
///
/// # Safety
/// As for [`launch_pairs`]; `table` points at the first parameter's value,
/// as large as `func` declares it.
unsafe fn pair_launch(
    func: &CudaFunction,
    table: *mut c_void,
    len: u64,
    shape: &LaunchShape,
    stream: sys::CUstream,
) -> Result<(), result::DriverError> {
    let mut a_len: u64 = len;
    // ceil(len / tile_bytes) * nruns == total_tiles < 2^32 (pairs_shape).
    let mut a_per_copy: u32 = len.div_ceil(shape.tile_bytes) as u32;
    let mut a_total: u32 = shape.total_tiles;
    let mut a_tpw: u32 = shape.tiles_per_warp;
    let mut a_shift: u32 = shape.tile_shift();
    let mut params: [*mut c_void; 6] = [
        table,
        &mut a_len as *mut u64 as *mut c_void,
        &mut a_per_copy as *mut u32 as *mut c_void,
        &mut a_total as *mut u32 as *mut c_void,
        &mut a_tpw as *mut u32 as *mut c_void,
        &mut a_shift as *mut u32 as *mut c_void,
    ];
    // The kernels' parameters are (table, u64, u32, u32, u32, u32), matching
    // `params`; the rest is the caller's promise.
    launch_grid(func, shape, stream, &mut params)
}

/// The name of the pair kernel whose table parameter holds `n` copies.
pub fn inline_pairs_kernel_name(n: usize) -> String {
    format!("bounce_copy_pairs_inline{n}")
}

/// Launches `func` (the pair kernel for `table.len() / 2` copies, from
/// [`CopyKernel::inline_pairs_function`]) with `table` as its parameter:
/// the driver copies the table into the launch, so nothing needs to stay
/// allocated for it. Copies are `len` bytes long, the grid is `shape`'s
/// ([`pairs_shape`]).
///
/// # Safety
/// `func` must be the inline pair kernel of the current context's module
/// whose table holds exactly `table.len() / 2` pairs, `shape.nruns` of them
/// filled, and every range they name valid for the kernel to read (sources)
/// or write (destinations) until it ended.
pub(crate) unsafe fn launch_pairs_inline(
    func: &CudaFunction,
    table: &[u64],
    len: u64,
    shape: &LaunchShape,
    stream: sys::CUstream,
) -> Result<(), result::DriverError> {
    // The first parameter is InlinePairs<N> itself, read from `table` (2N
    // words, the caller's promise); the driver only reads the parameters.
    pair_launch(func, table.as_ptr() as *mut c_void, len, shape, stream)
}

/// What NVRTC should produce for a device of compute capability `cc`
/// (`major * 10 + minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvrtcTarget {
    /// Machine code for `sm_XY` (the normal case: no JIT at load time).
    Cubin(u32),
    /// PTX for `compute_XY`, JIT-compiled by the driver (NVRTC older than the GPU).
    Ptx(u32),
}

impl NvrtcTarget {
    /// The `--gpu-architecture` option for this target.
    pub fn arch_option(&self) -> String {
        match self {
            NvrtcTarget::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
            NvrtcTarget::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
        }
    }
}

/// `major * 10 + minor`, as NVRTC numbers architectures (9.0 -> 90, 10.0 -> 100).
pub fn arch_number(major: i32, minor: i32) -> Option<u32> {
    if major <= 0 || !(0..10).contains(&minor) {
        return None;
    }
    u32::try_from(major)
        .ok()?
        .checked_mul(10)?
        .checked_add(minor as u32)
}

/// Picks the NVRTC target: machine code for the device's own architecture
/// when NVRTC supports it (or when the supported list is unknown), otherwise
/// PTX for the newest older architecture NVRTC knows.
pub fn choose_target(major: i32, minor: i32, supported: &[i32]) -> Result<NvrtcTarget, String> {
    let want = arch_number(major, minor)
        .ok_or_else(|| format!("unusable compute capability {major}.{minor}"))?;
    if supported.is_empty() || supported.contains(&(want as i32)) {
        return Ok(NvrtcTarget::Cubin(want));
    }
    supported
        .iter()
        .copied()
        .filter(|&s| s > 0 && (s as u32) < want)
        .max()
        .map(|s| NvrtcTarget::Ptx(s as u32))
        .ok_or_else(|| {
            format!(
                "NVRTC supports none of the architectures up to sm_{want} (it knows {supported:?})"
            )
        })
}

/// The NVRTC options for `target`.
pub fn nvrtc_options(target: NvrtcTarget) -> Vec<String> {
    vec![
        target.arch_option(),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "--generate-line-info".into(),
    ]
}

// ---------------------------------------------------------------------------
// Runtime and devices
// ---------------------------------------------------------------------------

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    crate::boundary::catch(f)
        .unwrap_or_else(|panic| Err(format!("{what}: the CUDA library panicked: {panic}")))
}

/// The process's CUDA driver: present, initialised, with at least one device.
/// Cheap to clone; one per process (devices are opened and kernels compiled
/// once, whoever asks).
#[derive(Clone)]
pub struct CudaRuntime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    device_count: usize,
    driver_version: i32,
    devices: Mutex<HashMap<usize, Arc<CudaDevice>>>,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime")
            .field("device_count", &self.inner.device_count)
            .field("driver_version", &self.inner.driver_version)
            .finish()
    }
}

impl CudaRuntime {
    /// Finds and initialises the CUDA driver. Never panics: without
    /// `libcuda.so`, without a device, or when `cuInit` fails, the error says
    /// which. The result is cached for the process.
    pub fn probe() -> Result<CudaRuntime, String> {
        static RUNTIME: OnceLock<Result<CudaRuntime, String>> = OnceLock::new();
        RUNTIME.get_or_init(probe_uncached).clone()
    }

    pub fn device_count(&self) -> usize {
        self.inner.device_count
    }

    /// The driver's CUDA version (e.g. 13000 for 13.0).
    pub fn driver_version(&self) -> i32 {
        self.inner.driver_version
    }

    /// Device `ordinal` (its primary context, retained once per process).
    pub fn device(&self, ordinal: usize) -> Result<Arc<CudaDevice>, String> {
        if ordinal >= self.inner.device_count {
            return Err(format!(
                "CUDA device {ordinal} does not exist ({} present)",
                self.inner.device_count
            ));
        }
        let mut devices = self.inner.devices.locked();
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(guarded("opening a CUDA device", || {
            CudaDevice::open(ordinal)
        })?);
        devices.insert(ordinal, d.clone());
        Ok(d)
    }
}

fn probe_uncached() -> Result<CudaRuntime, String> {
    // SAFETY: only tries to dlopen the candidate library names; no symbol
    // is called.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver: libcuda.so could not be loaded".into());
    }
    guarded("probing the CUDA driver", || {
        result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let count = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
        if count <= 0 {
            return Err("the CUDA driver reports no device".into());
        }
        let mut version: i32 = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| format!("cuDriverGetVersion: {e}"))?;
        Ok(CudaRuntime {
            inner: Arc::new(RuntimeInner {
                device_count: count as usize,
                driver_version: version,
                devices: Mutex::new(HashMap::new()),
            }),
        })
    })
}

/// One GPU: its primary context and, once compiled, its copy kernel.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    name: String,
    cc: (i32, i32),
    sm_count: u32,
    kernel: OnceLock<Result<Arc<CopyKernel>, String>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("cc", &self.cc)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl CudaDevice {
    fn open(ordinal: usize) -> Result<CudaDevice, String> {
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| format!("retaining the primary context of CUDA device {ordinal}: {e}"))?;
        let name = ctx
            .name()
            .map_err(|e| format!("cuDeviceGetName({ordinal}): {e}"))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| format!("compute capability of device {ordinal}: {e}"))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| format!("multiprocessor count of device {ordinal}: {e}"))?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            name,
            cc,
            sm_count: sm_count.max(1) as u32,
            kernel: OnceLock::new(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// The primary context (cudarc), e.g. to create more streams.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("making CUDA device {} current: {e}", self.ordinal))
    }

    /// The copy kernel, compiled with NVRTC at the first call (once per
    /// process and device; a failure is cached too and returned again).
    pub fn copy_kernel(&self) -> Result<Arc<CopyKernel>, String> {
        self.kernel
            .get_or_init(|| {
                guarded("compiling the copy kernel", || CopyKernel::build(self)).map(Arc::new)
            })
            .clone()
    }
}

/// The loaded copy kernel of one device.
pub struct CopyKernel {
    /// `bounce_copy`: reads an uploaded table.
    func: CudaFunction,
    /// `bounce_copy_zero_copy`: reads the table from mapped pinned memory.
    func_zero_copy: CudaFunction,
    /// `bounce_copy_pairs`: reads an uploaded pair table.
    func_pairs: CudaFunction,
    /// `bounce_copy_pairs_inline<N>` for each N of [`INLINE_PAIRS`] (none
    /// when NVRTC compiled them out, older than CUDA 12.1 or for a GPU
    /// before Volta, or when the driver is older than 12.1).
    func_pairs_inline: Vec<(usize, CudaFunction)>,
    _module: Arc<CudaModule>,
    /// What NVRTC compiled for (e.g. `sm_90`).
    pub target: NvrtcTarget,
    /// NVRTC compile time (plus module load).
    pub compile_time: Duration,
    /// Resident blocks per SM at `BLOCK_THREADS` threads (occupancy query).
    pub blocks_per_sm: u32,
    /// Most blocks one launch uses (`sm_count * blocks_per_sm * GRID_WAVES`);
    /// a chunk with more tiles than these blocks have warps gives each warp
    /// several consecutive tiles.
    pub max_grid: u32,
}

impl std::fmt::Debug for CopyKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyKernel")
            .field("target", &self.target)
            .field("compile_time", &self.compile_time)
            .field("blocks_per_sm", &self.blocks_per_sm)
            .field("max_grid", &self.max_grid)
            .finish()
    }
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed once.
        let _ = unsafe { nvrtc::result::destroy_program(self.0) };
    }
}

fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `src` and returns the cubin (or the PTX text, NUL-free).
fn nvrtc_compile(src: &str, target: NvrtcTarget) -> Result<Vec<u8>, String> {
    let csrc = CString::new(src).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let name = CString::new("gather_scatter.cu").expect("no NUL in a literal");
    let prog = Program(
        nvrtc::result::create_program(&csrc, Some(&name))
            .map_err(|e| format!("nvrtcCreateProgram: {e}"))?,
    );
    let options = nvrtc_options(target);
    // SAFETY: prog is a live program; options are plain strings.
    if let Err(e) = unsafe { nvrtc::result::compile_program(prog.0, &options) } {
        // SAFETY: prog is still live.
        let log = unsafe { nvrtc::result::get_program_log(prog.0) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_else(|le| format!("(no log: {le})"));
        return Err(format!(
            "NVRTC failed to compile the copy kernel with {options:?}: {e}\n{log}"
        ));
    }
    match target {
        NvrtcTarget::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: prog was compiled for a real architecture, so it has a
            // cubin; the size is written through a valid pointer.
            unsafe { nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: cubin has exactly the size NVRTC reported.
            unsafe { nvrtc::sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
            Ok(cubin)
        }
        NvrtcTarget::Ptx(_) => {
            // SAFETY: prog is compiled and live.
            let ptx = unsafe { nvrtc::result::get_ptx(prog.0) }
                .map_err(|e| format!("nvrtcGetPTX: {e}"))?;
            Ok(c_chars_to_string(&ptx).into_bytes())
        }
    }
}

/// Compiles the copy kernel for `target` without any device (NVRTC only):
/// the image (cubin, or PTX text) and the compile time. Err when NVRTC is
/// absent or rejects the source (with its log).
pub fn compile_copy_kernel(target: NvrtcTarget) -> Result<(Vec<u8>, Duration), String> {
    // SAFETY: only tries to dlopen the candidate library names.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err("NVRTC is not available: libnvrtc.so could not be loaded".into());
    }
    guarded("compiling the copy kernel", || {
        let t = Instant::now();
        let image = nvrtc_compile(KERNEL_SOURCE, target)?;
        Ok((image, t.elapsed()))
    })
}

fn nvrtc_supported_archs() -> Vec<i32> {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: writes one int.
    if unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .is_err()
        || n <= 0
    {
        return Vec::new();
    }
    let mut v = vec![0i32; n as usize];
    // SAFETY: v has room for the n entries NVRTC reported.
    if unsafe { nvrtc::sys::nvrtcGetSupportedArchs(v.as_mut_ptr()) }
        .result()
        .is_err()
    {
        return Vec::new();
    }
    v
}

impl CopyKernel {
    /// The kernel that reads an uploaded table (the peer-mapped copy's).
    pub(crate) fn function(&self) -> &CudaFunction {
        &self.func
    }

    /// The kernel over an uploaded pair table ([`launch_pairs`]).
    pub(crate) fn pairs_function(&self) -> &CudaFunction {
        &self.func_pairs
    }

    /// The smallest pair kernel taking its table as a parameter that holds
    /// `n` copies, with its capacity ([`launch_pairs_inline`]).
    pub(crate) fn inline_pairs_function(&self, n: usize) -> Option<(usize, &CudaFunction)> {
        self.func_pairs_inline
            .iter()
            .find(|(cap, _)| n <= *cap)
            .map(|(cap, f)| (*cap, f))
    }

    fn build(dev: &CudaDevice) -> Result<CopyKernel, String> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { nvrtc::sys::is_culib_present() } {
            return Err("NVRTC is not available: libnvrtc.so could not be loaded".into());
        }
        let started = Instant::now();
        let target = choose_target(dev.cc.0, dev.cc.1, &nvrtc_supported_archs())?;
        let image = nvrtc_compile(KERNEL_SOURCE, target)?;
        dev.bind()?;
        let ptx = match target {
            NvrtcTarget::Cubin(_) => nvrtc::Ptx::from_binary(image),
            NvrtcTarget::Ptx(_) => nvrtc::Ptx::from_src(String::from_utf8_lossy(&image)),
        };
        let module = dev.ctx.load_module(ptx).map_err(|e| {
            format!(
                "loading the copy kernel ({target:?}) on device {}: {e}",
                dev.ordinal
            )
        })?;
        let func = module
            .load_function(KERNEL_NAME)
            .map_err(|e| format!("cuModuleGetFunction({KERNEL_NAME}): {e}"))?;
        let func_zero_copy = module
            .load_function(ZERO_COPY_KERNEL_NAME)
            .map_err(|e| format!("cuModuleGetFunction({ZERO_COPY_KERNEL_NAME}): {e}"))?;
        let func_pairs = module
            .load_function(PAIRS_KERNEL_NAME)
            .map_err(|e| format!("cuModuleGetFunction({PAIRS_KERNEL_NAME}): {e}"))?;
        // Absent from the module when NVRTC compiled them out (see the
        // source); unused when the driver predates large kernel parameters.
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: one out pointer.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) }
            .result()
            .is_ok()
            && driver >= 12010;
        let func_pairs_inline: Vec<(usize, CudaFunction)> = INLINE_PAIRS
            .iter()
            .filter(|_| driver_ok)
            .filter_map(|&n| {
                let f = module.load_function(&inline_pairs_kernel_name(n)).ok()?;
                Some((n, f))
            })
            .collect();
        if func_pairs_inline.is_empty() {
            tracing::info!(
                driver,
                "no inline pair kernels (NVRTC or driver older than CUDA 12.1, or a GPU before Volta): every peer-mapped table is uploaded"
            );
        }
        let compile_time = started.elapsed();
        // SAFETY: func is a live kernel of a loaded module.
        let occ = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                func.cu_function(),
                BLOCK_THREADS as i32,
                0,
            )
        }
        .map_err(|e| format!("cuOccupancyMaxActiveBlocksPerMultiprocessor: {e}"))?;
        let blocks_per_sm = occ.clamp(1, 32) as u32;
        Ok(CopyKernel {
            func,
            func_zero_copy,
            func_pairs,
            func_pairs_inline,
            _module: module,
            target,
            compile_time,
            blocks_per_sm,
            max_grid: dev
                .sm_count
                .saturating_mul(blocks_per_sm)
                .saturating_mul(GRID_WAVES)
                .max(1),
        })
    }
}

// ---------------------------------------------------------------------------
// Execution contexts
// ---------------------------------------------------------------------------

/// Page-locked, device-mapped host memory holding a run table.
struct PinnedTable {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    dev: u64,
    cap: usize,
}

impl PinnedTable {
    fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<Self, String> {
        let cap = cap.max(4096);
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        // SAFETY: plain allocation of cap bytes; the result is checked.
        let host = unsafe {
            result::malloc_host(
                cap,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| format!("cuMemHostAlloc({cap} bytes) for a run table: {e}"))?
            as *mut u8;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was just allocated with DEVICEMAP; dev is a valid out pointer.
        let mapped =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: host came from cuMemHostAlloc and nothing uses it yet.
            let _ = unsafe { result::free_host(host as *mut c_void) };
            return Err(format!("cuMemHostGetDevicePointer for a run table: {e}"));
        }
        Ok(PinnedTable {
            ctx: ctx.clone(),
            host,
            dev,
            cap,
        })
    }

    /// Makes room for `need` bytes (the old contents are not kept). Only
    /// called on an idle context, so no kernel reads the old buffer.
    fn ensure(&mut self, need: usize) -> Result<(), String> {
        if need <= self.cap {
            return Ok(());
        }
        let cap = need.checked_next_power_of_two().unwrap_or(need);
        *self = PinnedTable::new(&self.ctx, cap)?;
        Ok(())
    }
}

impl Drop for PinnedTable {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: host came from cuMemHostAlloc; the owning context is idle
        // (contexts with work in flight are leaked, never dropped).
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}

/// Device memory holding an uploaded copy of the run table.
struct DeviceScratch {
    ctx: Arc<CudaContext>,
    ptr: u64,
    cap: usize,
}

impl DeviceScratch {
    fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<Self, String> {
        let cap = cap.max(4096);
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        // SAFETY: plain device allocation, checked.
        let ptr = unsafe { result::malloc_sync(cap) }
            .map_err(|e| format!("cuMemAlloc({cap} bytes) for an uploaded run table: {e}"))?;
        Ok(DeviceScratch {
            ctx: ctx.clone(),
            ptr,
            cap,
        })
    }
    fn ensure(&mut self, need: usize) -> Result<(), String> {
        if need <= self.cap {
            return Ok(());
        }
        let cap = need.checked_next_power_of_two().unwrap_or(need);
        *self = DeviceScratch::new(&self.ctx, cap)?;
        Ok(())
    }
}

impl Drop for DeviceScratch {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from cuMemAlloc and the owning context is idle.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// One execution context: a stream, its completion event, the pinned run
/// table and (when arguments are uploaded) the table's device copy.
struct ExecCtx {
    stream: Arc<CudaStream>,
    done: CudaEvent,
    /// Recorded right before a timed kernel (see [`KERNEL_TIMING_ENV`]);
    /// `done` then times too.
    began: Option<CudaEvent>,
    /// Recorded before a timed kernel's table upload: `queued` to `began`
    /// is the upload plus any wait for the GPU.
    queued: Option<CudaEvent>,
    /// The kernel in flight on this context is timed (`began` recorded).
    timed: Option<Direction>,
    table: PinnedTable,
    scratch: Option<DeviceScratch>,
    /// A pair table passed as a launch's parameter ([`Form::Inline`]).
    inline_words: Vec<u64>,
}

/// With this variable set (to anything but empty), the run-table kernels
/// are timed with CUDA events and their device time is counted
/// (`gpu_{gather,scatter}_kernel_ns`, and from the table's upload to the
/// kernel's start `gpu_{gather,scatter}_upload_ns`): "device wait" counts
/// until the reactor looks, and only the device's own times tell a slow
/// copy from a late look. Off (the default), events are created without
/// timing, which is cheaper to record.
pub const KERNEL_TIMING_ENV: &str = "NIXL_BOUNCE_TIME_KERNELS";

fn kernel_timing() -> bool {
    std::env::var_os(KERNEL_TIMING_ENV).is_some_and(|x| !x.is_empty())
}

// SAFETY: the raw pointers in PinnedTable/DeviceScratch are owned
// allocations; an ExecCtx is used by one thread at a time (it is moved out
// of the pool to be used), and the CUDA handles are thread-safe.
unsafe impl Send for ExecCtx {}

impl ExecCtx {
    fn new(dev: &CudaDevice, table_cap: usize, zero_copy: bool) -> Result<Self, String> {
        dev.bind()?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| format!("cuStreamCreate: {e}"))?;
        let (done, began, queued) = if kernel_timing() {
            let timed = || {
                dev.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| format!("cuEventCreate: {e}"))
            };
            (timed()?, Some(timed()?), Some(timed()?))
        } else {
            let done = dev
                .ctx
                .new_event(None)
                .map_err(|e| format!("cuEventCreate: {e}"))?;
            (done, None, None)
        };
        let table = PinnedTable::new(&dev.ctx, table_cap)?;
        let scratch = if zero_copy {
            None
        } else {
            Some(DeviceScratch::new(&dev.ctx, table_cap)?)
        };
        Ok(ExecCtx {
            stream,
            done,
            began,
            queued,
            timed: None,
            table,
            scratch,
            inline_words: Vec::new(),
        })
    }
}

/// `copy_stream_count` execution contexts of one device, borrowed per
/// kernel. Thread-safe.
pub struct ExecPool {
    device: Arc<CudaDevice>,
    kernel: Arc<CopyKernel>,
    zero_copy: bool,
    state: Mutex<PoolState>,
    returned: Condvar,
    /// Host time of a launch's steps, summed: [context bind and table
    /// sizing, table fill, upload call, launch and event record].
    launch_steps_ns: [AtomicU64; 4],
    /// Device time of timed kernels, summed: [gather, scatter].
    kernel_ns: [AtomicU64; 2],
    /// Device time from a timed kernel's upload to its start, summed:
    /// [gather, scatter].
    upload_ns: [AtomicU64; 2],
}

struct PoolState {
    idle: Vec<ExecCtx>,
    /// Contexts not discarded (idle + borrowed).
    live: usize,
}

impl std::fmt::Debug for ExecPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (idle, live) = {
            let s = self.state.locked();
            (s.idle.len(), s.live)
        };
        f.debug_struct("ExecPool")
            .field("device", &self.device.ordinal)
            .field("zero_copy", &self.zero_copy)
            .field("idle", &idle)
            .field("live", &live)
            .finish()
    }
}

impl ExecPool {
    /// Compiles the kernel (if not yet) and creates `count` contexts.
    ///
    /// `zero_copy = false` (the default, `use_zero_copy_arguments = false`):
    /// the run table (36 bytes per run plus 16 per strided run) is uploaded
    /// with one `cuMemcpyHtoDAsync` on the copy's stream right before the
    /// launch (~0.6 MiB for 16384 runs: ~15 us at PCIe Gen5 speed, ordered
    /// by the stream, no host wait) and the kernel reads it from device
    /// memory / L2. `zero_copy = true`: the kernel reads the table straight
    /// from mapped pinned host memory. That saves the upload but makes every
    /// table load a PCIe round trip (~1-2 us), several per warp (the run
    /// search, the run entry), and thousands of warps reading the same host
    /// line (one merged run) queue behind each other: it is the slower
    /// option, kept for comparison (`gpu-probe` measures both).
    pub fn new(
        device: Arc<CudaDevice>,
        count: usize,
        zero_copy: bool,
    ) -> Result<Arc<Self>, String> {
        if count == 0 {
            return Err("an execution pool needs at least one context".into());
        }
        let kernel = device.copy_kernel()?;
        let cap = table_capacity(INITIAL_TABLE_RUNS).unwrap_or(1 << 20);
        let idle = guarded("creating execution contexts", || {
            (0..count)
                .map(|_| ExecCtx::new(&device, cap, zero_copy))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(Arc::new(ExecPool {
            device,
            kernel,
            zero_copy,
            state: Mutex::new(PoolState { idle, live: count }),
            returned: Condvar::new(),
            launch_steps_ns: Default::default(),
            kernel_ns: Default::default(),
            upload_ns: Default::default(),
        }))
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    pub fn kernel(&self) -> &Arc<CopyKernel> {
        &self.kernel
    }
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }
    /// Contexts still usable (idle or borrowed).
    pub fn live(&self) -> usize {
        self.state.locked().live
    }
    /// Contexts idle right now.
    pub fn idle(&self) -> usize {
        self.state.locked().idle.len()
    }

    /// A context if one is idle now (never blocks).
    pub fn try_acquire(self: &Arc<Self>) -> Option<ExecGuard> {
        let ctx = self.state.locked().idle.pop()?;
        Some(ExecGuard {
            pool: self.clone(),
            ctx: Some(ctx),
        })
    }

    /// A context, waiting up to `timeout` for one to be returned. Err when
    /// the wait timed out or every context was discarded after errors.
    pub fn acquire(self: &Arc<Self>, timeout: Duration) -> Result<ExecGuard, String> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.locked();
        loop {
            if let Some(ctx) = st.idle.pop() {
                return Ok(ExecGuard {
                    pool: self.clone(),
                    ctx: Some(ctx),
                });
            }
            if st.live == 0 {
                return Err("every execution context was discarded after CUDA errors".into());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "no execution context was free within {timeout:?} ({} in use)",
                    st.live
                ));
            }
            st = crate::sync::wait_timeout(&self.returned, st, deadline - now).0;
        }
    }
}

/// A borrowed execution context; returned to its pool on drop.
pub struct ExecGuard {
    pool: Arc<ExecPool>,
    ctx: Option<ExecCtx>,
}

impl std::fmt::Debug for ExecGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecGuard")
            .field("device", &self.pool.device.ordinal)
            .finish()
    }
}

/// The table form of one launch (see [`ExecGuard::launch`]).
enum Form {
    /// A run table ([`fill_table`]), uploaded (or mapped).
    Runs(LaunchShape),
    /// A pair table of copies `len` bytes long ([`fill_pairs`]), uploaded.
    Pairs { len: u64, shape: LaunchShape },
    /// A pair table passed as the launch's parameter: the
    /// `bounce_copy_pairs_inline<cap>` kernel over the context's
    /// `inline_words`.
    Inline {
        len: u64,
        shape: LaunchShape,
        cap: usize,
    },
}

/// A pair table filled by [`ExecGuard::fill_pair_form`].
struct PairForm {
    len: u64,
    copies: usize,
    /// The parameter kernel's capacity when the table is the parameter.
    inline: Option<usize>,
}

impl Form {
    fn shape(&self) -> &LaunchShape {
        match self {
            Form::Runs(shape) | Form::Pairs { shape, .. } | Form::Inline { shape, .. } => shape,
        }
    }
}

impl ExecGuard {
    /// Adds a timed kernel's device time (its events are both complete) to
    /// the pool's count; nothing for an untimed one.
    fn count_kernel_time(&mut self) {
        let Some(ctx) = self.ctx.as_mut() else {
            return;
        };
        let (Some(direction), Some(began)) = (ctx.timed.take(), &ctx.began) else {
            return;
        };
        let count = |sum: &AtomicU64, ms: f32| {
            sum.fetch_add((f64::from(ms) * 1e6) as u64, Ordering::Relaxed);
        };
        if let Ok(ms) = began.elapsed_ms(&ctx.done) {
            count(&self.pool.kernel_ns[direction as usize], ms);
        }
        if let Some(Ok(ms)) = ctx.queued.as_ref().map(|q| q.elapsed_ms(began)) {
            count(&self.pool.upload_ns[direction as usize], ms);
        }
    }

    fn ctx(&self) -> &ExecCtx {
        self.ctx
            .as_ref()
            .expect("an ExecGuard holds its context until dropped")
    }

    /// The context's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.ctx().stream
    }

    /// Drops the context without returning it: its stream may still run
    /// work that reads its buffers, so they are leaked on purpose.
    pub fn discard(mut self) {
        if let Some(ctx) = self.ctx.take() {
            std::mem::forget(ctx);
            {
                let mut st = self.pool.state.locked();
                st.live = st.live.saturating_sub(1);
                tracing::warn!(
                    device = self.pool.device.ordinal,
                    live = st.live,
                    "a CUDA execution context was discarded after an error it could not be synchronised from"
                );
            }
            self.pool.returned.notify_all();
        }
    }

    /// Fills the pair table of `runs` if every copy has one length
    /// ([`fill_pairs`]): into the context's parameter words when a pair
    /// kernel takes that many copies as its parameter, else into the pinned
    /// table (at most two copies a run, which its capacity holds; not in
    /// zero-copy mode, whose tables are read over the bus). Returns the
    /// copies' length and count, and the parameter kernel's capacity
    /// (`None`: the pinned table); `None` when `runs` are of another shape.
    fn fill_pair_form(
        ctx: &mut ExecCtx,
        kernel: &CopyKernel,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
        layout: &TableLayout,
        zero_copy: bool,
    ) -> Result<Option<PairForm>, CopyError> {
        let n = runs.len();
        let largest = INLINE_PAIRS[INLINE_PAIRS.len() - 1];
        if n <= largest && kernel.inline_pairs_function(1).is_some() {
            if ctx.inline_words.len() < 2 * largest {
                ctx.inline_words.resize(2 * largest, 0);
            }
            if let Some((len, copies)) = fill_pairs(direction, region, runs, &mut ctx.inline_words)?
            {
                // A parameter kernel that size: else the pinned table below
                // (filled again: only what is filled is ever launched).
                if let Some((cap, _)) = kernel.inline_pairs_function(copies) {
                    return Ok(Some(PairForm {
                        len,
                        copies,
                        inline: Some(cap),
                    }));
                }
            }
        }
        let pairs = (2 * n).min(layout.capacity / 16);
        if zero_copy || pairs == 0 {
            return Ok(None);
        }
        // SAFETY: the pinned table holds `layout.capacity` bytes (at least
        // the 16 * `pairs` bytes taken here), page-aligned, so 8-aligned for
        // u64; the context is borrowed exclusively and idle, so nothing
        // reads the table while it is rewritten.
        let out = unsafe { std::slice::from_raw_parts_mut(ctx.table.host as *mut u64, 2 * pairs) };
        Ok(
            fill_pairs(direction, region, runs, out)?.map(|(len, copies)| PairForm {
                len,
                copies,
                inline: None,
            }),
        )
    }

    /// Fills the copy's table (a run table, or a pair table with
    /// `pair_tables`) and launches the copy; records the context's event
    /// after it. Err: nothing launched (`quiesced`) or a launch error.
    fn launch(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
        opts: &CopyOptions,
    ) -> Result<(), CopyError> {
        if opts.batch_memcpy {
            return self.launch_batch(direction, region, runs);
        }
        let kernel = self.pool.kernel.clone();
        let zero_copy = self.pool.zero_copy;
        let dev = self.pool.device.clone();
        let err = |reason: String, quiesced: bool| CopyError {
            direction,
            reason,
            quiesced,
        };
        // A grid's x dimension is at most 2^31 - 1 blocks.
        let max_grid = opts
            .max_blocks
            .unwrap_or(kernel.max_grid)
            .clamp(1, i32::MAX as u32);
        let max_warps = max_grid.saturating_mul(WARPS_PER_BLOCK);
        let t0 = Instant::now();
        let layout = TableLayout::new(runs.len()).ok_or_else(|| {
            err(
                format!("{} runs overflow the run table size", runs.len()),
                true,
            )
        })?;
        dev.bind().map_err(|e| err(e, true))?;
        let ctx = self
            .ctx
            .as_mut()
            .expect("an ExecGuard holds its context until dropped");
        ctx.table
            .ensure(layout.capacity)
            .map_err(|e| err(e, true))?;
        let nruns = runs.len();
        let t1 = Instant::now();
        // Every copy of one length (real clients' blocks): the pair
        // kernel's table, the launch's own parameter when it fits one.
        let pairs = match opts.pair_tables {
            true => {
                Self::fill_pair_form(ctx, &kernel, direction, region, runs, &layout, zero_copy)?
            }
            false => None,
        };
        let form = match pairs {
            Some(PairForm {
                len,
                copies,
                inline,
            }) => {
                let shape = pairs_shape(copies, len, opts.tile_bytes, max_warps)
                    .map_err(|e| err(e, true))?;
                match inline {
                    Some(cap) => Form::Inline { len, shape, cap },
                    None => Form::Pairs { len, shape },
                }
            }
            None => {
                // SAFETY: the pinned table holds at least `layout.capacity`
                // bytes (ensured above), page-aligned (cuMemHostAlloc); the
                // context is borrowed exclusively and idle, so no kernel
                // reads the table while it is rewritten.
                let (out_runs, out_tile_start, out_strides) =
                    unsafe { table_parts(ctx.table.host, &layout) };
                Form::Runs(fill_table(
                    direction,
                    region,
                    runs,
                    opts.tile_bytes,
                    max_warps,
                    out_runs,
                    out_tile_start,
                    out_strides,
                )?)
            }
        };
        let t2 = Instant::now();
        if let Some(queued) = &ctx.queued {
            // Timed: from here to `began` is the upload (and any wait).
            let _ = queued.record(&ctx.stream);
        }
        let stream = ctx.stream.cu_stream();
        let used = match &form {
            Form::Runs(shape) => {
                // The alignment gap between the tile starts and the strides
                // is uploaded too: give it defined contents.
                let gap_from = layout.tile_start_offset + (nruns + 1) * 4;
                // SAFETY: inside the pinned table (`layout.capacity` bytes),
                // which nothing reads while the context is idle.
                unsafe {
                    std::ptr::write_bytes(
                        ctx.table.host.add(gap_from),
                        0,
                        layout.strides_offset - gap_from,
                    )
                };
                shape.table_bytes()
            }
            Form::Pairs { shape, .. } => pairs_table_bytes(shape.nruns as usize),
            Form::Inline { .. } => 0,
        };
        let table_dev = if zero_copy || used == 0 {
            ctx.table.dev
        } else {
            let scratch = ctx
                .scratch
                .as_mut()
                .expect("an uploading pool has a scratch buffer per context");
            scratch.ensure(used).map_err(|e| err(e, true))?;
            // SAFETY: table.host holds `used` initialised bytes (filled
            // above: the runs, the tile starts, the alignment gap and the
            // used strides, or the pairs); scratch holds at least `used`
            // bytes; the pinned source stays untouched until the context
            // is idle again.
            let src = unsafe { std::slice::from_raw_parts(ctx.table.host as *const u8, used) };
            // SAFETY: as above; the copy is ordered before the launch on the same stream.
            if let Err(e) = unsafe { result::memcpy_htod_async(scratch.ptr, src, stream) } {
                return Err(self.after_failure(
                    direction,
                    format!("uploading the run table (cuMemcpyHtoDAsync): {e}"),
                ));
            }
            scratch.ptr
        };
        let t3 = Instant::now();
        // The table writes above must be visible before the launch doorbell.
        fence(Ordering::SeqCst);
        if let Some(began) = &ctx.began {
            // After the upload: the kernel's own time, up to `done`.
            ctx.timed = began.record(&ctx.stream).ok().map(|()| direction);
        }
        // SAFETY: a copy kernel of this device's module over the table just
        // filled (uploaded, mapped, or the parameter itself), which stays
        // allocated and unchanged until the context is idle again. Every
        // address in it was checked: the region side against `region`
        // (fill_table, fill_pairs), the application side by the caller (see
        // CopyEngine).
        let launched = unsafe {
            match &form {
                Form::Runs(shape) => {
                    let func = if zero_copy {
                        &kernel.func_zero_copy
                    } else {
                        &kernel.func
                    };
                    launch_copy(func, table_dev, &layout, shape, stream)
                }
                Form::Pairs { len, shape } => {
                    launch_pairs(kernel.pairs_function(), table_dev, *len, shape, stream)
                }
                Form::Inline { len, shape, cap } => match kernel
                    .inline_pairs_function(shape.nruns as usize)
                {
                    Some((c, func)) if c == *cap => {
                        launch_pairs_inline(func, &ctx.inline_words[..2 * c], *len, shape, stream)
                    }
                    _ => Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_FOUND)),
                },
            }
        };
        if let Err(e) = launched {
            let shape = form.shape();
            return Err(self.after_failure(
                direction,
                format!(
                    "launching the {direction:?} kernel ({} table entries, {} blocks): {e}",
                    shape.nruns, shape.grid
                ),
            ));
        }
        let ctx = self.ctx();
        if let Err(e) = ctx.done.record(&ctx.stream) {
            return Err(self.after_failure(
                direction,
                format!("cuEventRecord after the {direction:?} kernel: {e}"),
            ));
        }
        let steps = [t1 - t0, t2 - t1, t3 - t2, t3.elapsed()];
        for (sum, d) in self.pool.launch_steps_ns.iter().zip(steps) {
            sum.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The batched-memcpy alternative to the kernel (see
    /// [`CopyOptions::batch_memcpy`]).
    fn launch_batch(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<(), CopyError> {
        let err = |reason: String| CopyError {
            direction,
            reason,
            quiesced: true,
        };
        check_runs(direction, region.len, runs)?;
        let mut srcs: Vec<sys::CUdeviceptr> = Vec::new();
        let mut dsts: Vec<sys::CUdeviceptr> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        for run in runs {
            for (off, addr, len) in run.copies() {
                let reg = (region.addr as u64).wrapping_add(off);
                let (s, d) = match direction {
                    Direction::Gather => (addr, reg),
                    Direction::Scatter => (reg, addr),
                };
                srcs.push(s);
                dsts.push(d);
                sizes.push(len as usize);
            }
        }
        let dev = self.pool.device.clone();
        dev.bind().map_err(err)?;
        let loc = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev.ordinal as i32,
        };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc,
            dstLocHint: loc,
            flags: 0,
        }];
        let mut attr_idx = [0usize];
        let stream = self.ctx().stream.cu_stream();
        let count = sizes.len();
        let called = crate::boundary::catch(|| {
            // SAFETY: the three arrays hold `count` entries and live across
            // the call (the driver reads them before returning); one
            // attribute applies from copy 0 on. Every address was checked
            // as for the kernel (region side by check_runs, application
            // side by the caller).
            unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    count,
                    attrs.as_mut_ptr(),
                    attr_idx.as_mut_ptr(),
                    1,
                    stream,
                )
            }
            .result()
        });
        match called {
            Err(panic) => {
                return Err(err(format!(
                    "cuMemcpyBatchAsync is not available in this driver: {panic}"
                )))
            }
            Ok(Err(e)) => {
                return Err(self.after_failure(
                    direction,
                    format!("cuMemcpyBatchAsync ({count} copies): {e}"),
                ))
            }
            Ok(Ok(())) => {}
        }
        let ctx = self.ctx();
        if let Err(e) = ctx.done.record(&ctx.stream) {
            return Err(self.after_failure(
                direction,
                format!("cuEventRecord after cuMemcpyBatchAsync: {e}"),
            ));
        }
        Ok(())
    }

    /// After a failed launch or completion: synchronise the stream to learn
    /// whether the context is quiet. Builds the error; a context that cannot
    /// be synchronised is discarded when the guard is dropped by the caller
    /// (see `finish_failed`).
    fn after_failure(&mut self, direction: Direction, reason: String) -> CopyError {
        let quiesced = self.ctx().stream.synchronize();
        match quiesced {
            Ok(()) => CopyError {
                direction,
                reason,
                quiesced: true,
            },
            Err(e) => {
                if let Some(ctx) = self.ctx.take() {
                    // Leak: the stream may still be running work that reads
                    // the table (see `discard`).
                    std::mem::forget(ctx);
                    let mut st = self.pool.state.locked();
                    st.live = st.live.saturating_sub(1);
                    drop(st);
                    self.pool.returned.notify_all();
                }
                CopyError {
                    direction,
                    reason: format!(
                        "{reason}; synchronising the stream afterwards failed too: {e}"
                    ),
                    quiesced: false,
                }
            }
        }
    }
}

impl Drop for ExecGuard {
    fn drop(&mut self) {
        if let Some(mut ctx) = self.ctx.take() {
            // A timed kernel not counted (it failed) leaves no mark behind.
            ctx.timed = None;
            self.pool.state.locked().idle.push(ctx);
            self.pool.returned.notify_one();
        }
    }
}

// ---------------------------------------------------------------------------
// The copy engine
// ---------------------------------------------------------------------------

/// Tuning of [`CudaCopy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOptions {
    /// Bytes per tile (one warp's unit of work); a power of two from 16 to
    /// [`MAX_TILE_BYTES`].
    pub tile_bytes: u64,
    /// Cap on blocks (of [`WARPS_PER_BLOCK`] warps) per launch (default: the
    /// kernel's occupancy-derived `max_grid`). Tests use small values to
    /// exercise warps that walk several tiles and runs.
    pub max_blocks: Option<u32>,
    /// How long the blocking paths ([`CopyEngine::copy`], [`CudaCopy::start`])
    /// wait for a free context.
    pub acquire_timeout: Duration,
    /// Experimental (`use_cub_copy`): copy with the driver's batched memcpy
    /// (`cuMemcpyBatchAsync`, CUDA 12.8+; the `_v2` entry point of CUDA 13)
    /// instead of the kernel. The copies are expanded on the host (one
    /// entry per copy). CUB's `DeviceMemcpy::Batched` itself needs the
    /// toolkit's CCCL headers, which NVRTC does not have, so the driver API
    /// stands in for "a library batched memcpy".
    pub batch_memcpy: bool,
    /// Copies all of one length use the pair kernel's table
    /// ([`fill_pairs`]), passed as the launch's parameter up to the largest
    /// of [`INLINE_PAIRS`] copies (`copy_pair_tables`; off by default: no
    /// gain measured on the H200).
    pub pair_tables: bool,
}

impl CopyOptions {
    /// The options the configuration asks for (`use_cub_copy` selects the
    /// batched-memcpy path).
    pub fn for_config(cfg: &crate::config::Config) -> Self {
        CopyOptions {
            batch_memcpy: cfg.use_cub_copy,
            pair_tables: cfg.copy_pair_tables,
            ..Default::default()
        }
    }
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            tile_bytes: DEFAULT_TILE_BYTES,
            max_blocks: None,
            acquire_timeout: Duration::from_secs(10),
            batch_memcpy: false,
            pair_tables: false,
        }
    }
}

/// Gather/scatter with the batched copy kernel.
pub struct CudaCopy {
    pool: Arc<ExecPool>,
    opts: CopyOptions,
    phases: Arc<CopyPhases>,
}

/// Host time to launch (waiting for a free execution context, then binding,
/// table fill, upload, launch) and time waiting for the device, per
/// direction: `[gather, scatter]`.
#[derive(Debug, Default)]
struct CopyPhases {
    launch_ns: [AtomicU64; 2],
    wait_ns: [AtomicU64; 2],
}

impl CopyPhases {
    fn add(&self, direction: Direction, launch: Option<Duration>, wait: Option<Duration>) {
        let i = direction as usize;
        if let Some(d) = launch {
            self.launch_ns[i].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
        if let Some(d) = wait {
            self.wait_ns[i].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// A copy launched by [`CopyEngine::try_launch`]: its device wait is
/// counted when a poll first sees it finished.
struct TimedCopy {
    pending: PendingCopy,
    launched: Instant,
    phases: Arc<CopyPhases>,
}

impl LaunchedCopy for TimedCopy {
    fn poll(&mut self) -> Option<Result<(), CopyError>> {
        let r = self.pending.poll()?;
        self.phases
            .add(self.pending.direction, None, Some(self.launched.elapsed()));
        Some(r)
    }
}

impl std::fmt::Debug for CudaCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopy")
            .field("pool", &self.pool)
            .field("opts", &self.opts)
            .finish()
    }
}

impl CudaCopy {
    pub fn new(pool: Arc<ExecPool>) -> Self {
        CudaCopy {
            pool,
            opts: CopyOptions::default(),
            phases: Default::default(),
        }
    }

    pub fn with_options(pool: Arc<ExecPool>, opts: CopyOptions) -> Result<Self, String> {
        if !valid_tile_bytes(opts.tile_bytes) {
            return Err(format!(
                "tile size {} is not a power of two from 16 to {MAX_TILE_BYTES}",
                opts.tile_bytes
            ));
        }
        if opts.max_blocks == Some(0) {
            return Err("max_blocks must be at least 1".into());
        }
        Ok(CudaCopy {
            opts,
            ..CudaCopy::new(pool)
        })
    }

    pub fn pool(&self) -> &Arc<ExecPool> {
        &self.pool
    }
    pub fn options(&self) -> &CopyOptions {
        &self.opts
    }

    /// Starts a copy if a context is idle: `Ok(None)` when every context is
    /// busy (try again later). Never blocks. Err: the runs were refused
    /// (nothing launched, `quiesced = true`) or CUDA failed.
    pub fn try_start(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<Option<PendingCopy>, CopyError> {
        if runs.is_empty() {
            return Ok(Some(PendingCopy::finished(direction)));
        }
        match self.pool.try_acquire() {
            None => Ok(None),
            Some(g) => self.launch_on(g, direction, region, runs).map(Some),
        }
    }

    /// Starts a copy, waiting up to `acquire_timeout` for a context.
    pub fn start(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<PendingCopy, CopyError> {
        if runs.is_empty() {
            return Ok(PendingCopy::finished(direction));
        }
        let g = self
            .pool
            .acquire(self.opts.acquire_timeout)
            .map_err(|reason| CopyError {
                direction,
                reason,
                quiesced: true,
            })?;
        self.launch_on(g, direction, region, runs)
    }

    fn launch_on(
        &self,
        mut g: ExecGuard,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<PendingCopy, CopyError> {
        let _range = crate::nvtx::range(match direction {
            Direction::Gather => c"bounce.gather.launch",
            Direction::Scatter => c"bounce.scatter.launch",
        });
        g.launch(direction, region, runs, &self.opts)?;
        Ok(PendingCopy {
            direction,
            state: PendingState::Running(g),
        })
    }
}

impl CopyEngine for CudaCopy {
    fn copy(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<(), CopyError> {
        let t0 = Instant::now();
        let pending = self.start(direction, region, runs)?;
        let t1 = Instant::now();
        let done = pending.wait();
        self.phases
            .add(direction, Some(t1 - t0), Some(t1.elapsed()));
        done
    }

    fn try_launch(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Option<Result<Box<dyn LaunchedCopy>, CopyError>> {
        let t0 = Instant::now();
        let started = self.try_start(direction, region, runs).transpose()?;
        let launched = Instant::now();
        self.phases.add(direction, Some(launched - t0), None);
        Some(started.map(|pending| {
            Box::new(TimedCopy {
                pending,
                launched,
                phases: self.phases.clone(),
            }) as Box<dyn LaunchedCopy>
        }))
    }

    fn phase_counters(&self) -> Vec<(&'static str, u64)> {
        let get = |a: &[AtomicU64; 2], i: usize| a[i].load(Ordering::Relaxed);
        let p = &self.phases;
        let step = |i: usize| self.pool.launch_steps_ns[i].load(Ordering::Relaxed);
        let kernel = |i: usize| self.pool.kernel_ns[i].load(Ordering::Relaxed);
        let upload = |i: usize| self.pool.upload_ns[i].load(Ordering::Relaxed);
        vec![
            ("gpu_gather_launch_ns", get(&p.launch_ns, 0)),
            ("gpu_gather_wait_ns", get(&p.wait_ns, 0)),
            ("gpu_scatter_launch_ns", get(&p.launch_ns, 1)),
            ("gpu_scatter_wait_ns", get(&p.wait_ns, 1)),
            ("gpu_launch_prepare_ns", step(0)),
            ("gpu_launch_fill_ns", step(1)),
            ("gpu_launch_upload_ns", step(2)),
            ("gpu_launch_call_ns", step(3)),
            ("gpu_gather_kernel_ns", kernel(0)),
            ("gpu_scatter_kernel_ns", kernel(1)),
            ("gpu_gather_upload_ns", upload(0)),
            ("gpu_scatter_upload_ns", upload(1)),
        ]
    }
}

/// A launched copy. Poll it (non-blocking) or wait for it. Dropping it
/// before completion synchronises its stream first, so an abandoned copy
/// never touches memory after the drop.
pub struct PendingCopy {
    direction: Direction,
    state: PendingState,
}

enum PendingState {
    Running(ExecGuard),
    Finished(Result<(), CopyError>),
}

impl std::fmt::Debug for PendingCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            PendingState::Running(_) => "running",
            PendingState::Finished(Ok(())) => "done",
            PendingState::Finished(Err(_)) => "failed",
        };
        f.debug_struct("PendingCopy")
            .field("direction", &self.direction)
            .field("state", &state)
            .finish()
    }
}

impl PendingCopy {
    fn finished(direction: Direction) -> Self {
        PendingCopy {
            direction,
            state: PendingState::Finished(Ok(())),
        }
    }

    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// `None` while the copy runs; then its result (every later call returns
    /// the same). Never blocks, except that a failure synchronises the
    /// stream to tell whether it is quiet.
    pub fn poll(&mut self) -> Option<Result<(), CopyError>> {
        if let PendingState::Running(g) = &mut self.state {
            let direction = self.direction;
            let bound = g.pool.device.bind();
            let outcome = match bound {
                Err(e) => Some(Err(g.after_failure(direction, e))),
                Ok(()) => match g.ctx().done.try_is_complete() {
                    Ok(false) => None,
                    Ok(true) => {
                        g.count_kernel_time();
                        Some(Ok(()))
                    }
                    Err(e) => Some(Err(g.after_failure(
                        direction,
                        format!("the {direction:?} kernel failed (cuEventQuery): {e}"),
                    ))),
                },
            };
            match outcome {
                None => return None,
                Some(r) => self.state = PendingState::Finished(r), // drops the guard: context back
            }
        }
        match &self.state {
            PendingState::Finished(r) => Some(r.clone()),
            PendingState::Running(_) => None,
        }
    }

    /// Blocks until the copy is done (stream synchronise).
    pub fn wait(mut self) -> Result<(), CopyError> {
        let direction = self.direction;
        match std::mem::replace(&mut self.state, PendingState::Finished(Ok(()))) {
            PendingState::Finished(r) => r,
            PendingState::Running(mut g) => {
                let synced = g.pool.device.bind().and_then(|()| {
                    g.ctx().stream.synchronize().map_err(|e| {
                        format!("the {direction:?} kernel failed (cuStreamSynchronize): {e}")
                    })
                });
                match synced {
                    Ok(()) => {
                        g.count_kernel_time();
                        Ok(())
                    }
                    Err(reason) => Err(g.after_failure(direction, reason)),
                }
            }
        }
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if let PendingState::Running(g) = &mut self.state {
            let _ = g.pool.device.bind();
            if let Err(e) = g.ctx().stream.synchronize() {
                let e = g.after_failure(
                    self.direction,
                    format!("synchronising an abandoned copy: {e}"),
                );
                tracing::warn!("{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {

    /// A pair table's launch is the launch `fill_table` sizes for the same
    /// copies left unmerged; impossible launches are refused.
    #[test]
    fn pairs_shape_matches_fill_table() {
        for (n, len, tile, warps) in [
            (1, 1, 16, 1),
            (7, 4096, 4096, 3),
            (300, 8192, 8192, 96),
            (1000, 32768, 8192, 3168),
            (64, 100_000, 4096, 10),
        ] {
            let runs: Vec<Run> = (0..n as u64)
                .map(|i| Run::single(i * 2 * len, (2 * i + 1) * len, len))
                .collect();
            let (mut ra, mut ta, mut sa) = (
                vec![DevRun::default(); n],
                vec![0u32; n + 1],
                vec![[0u64; 2]; n],
            );
            let whole = RegionSpan {
                addr: 0,
                len: usize::MAX,
            };
            let want = fill_table(
                Direction::Gather,
                whole,
                &runs,
                tile,
                warps,
                &mut ra,
                &mut ta,
                &mut sa,
            )
            .unwrap();
            assert_eq!(
                pairs_shape(n, len, tile, warps).unwrap(),
                want,
                "{n} x {len}"
            );
        }
        assert!(pairs_shape(0, 64, 16, 1).is_err());
        assert!(pairs_shape(2, 0, 16, 1).is_err());
        assert!(pairs_shape(2, 64, 24, 1).is_err());
        assert!(pairs_shape(1 << 20, 1 << 20, 16, 1).is_err(), "2^36 tiles");
    }
    use super::*;
    use crate::copy::host::HostCopy;

    /// A table's three parts, as the tests hold them.
    struct Table {
        runs: Vec<DevRun>,
        tile_start: Vec<u32>,
        strides: Vec<DevStrides>,
    }

    impl Table {
        fn new(nruns: usize) -> Self {
            Table {
                runs: vec![DevRun::default(); nruns],
                tile_start: vec![u32::MAX; nruns + 1],
                strides: vec![[u64::MAX; 2]; nruns],
            }
        }
        fn fill(
            &mut self,
            direction: Direction,
            region: RegionSpan,
            runs: &[Run],
            tile_bytes: u64,
            max_warps: u32,
        ) -> Result<LaunchShape, CopyError> {
            fill_table(
                direction,
                region,
                runs,
                tile_bytes,
                max_warps,
                &mut self.runs,
                &mut self.tile_start,
                &mut self.strides,
            )
        }
    }

    /// The kernel's `find_run`: the same 32-ary search, the 32 lanes and
    /// the ballot simulated.
    fn model_find_run(tile_start: &[u32], nruns: u32, t: u32) -> u32 {
        let ballot = |lo: u32, hi: u32, step: u32| -> u32 {
            (0..32u32)
                .map(|lane| {
                    let idx = lo + lane * step;
                    u32::from(idx < hi && tile_start[idx as usize] <= t) << lane
                })
                .fold(0, |m, b| m | b)
        };
        let (mut lo, mut hi) = (0u32, nruns);
        while hi - lo > 32 {
            let step = (hi - lo + 31) >> 5;
            let m = ballot(lo, hi, step);
            assert!(m & 1 == 1, "the search lost its invariant");
            lo += (31 - m.leading_zeros()) * step;
            if hi - lo > step {
                hi = lo + step;
            }
        }
        let m = ballot(lo, hi, 1);
        assert!(m & 1 == 1, "the search lost its invariant");
        lo + 31 - m.leading_zeros()
    }

    /// The kernel's `warp_copy`: which lane copies which bytes, with the
    /// same head / words / tail split; asserts every byte of the tile is
    /// copied exactly once.
    fn model_warp_copy(dst: u64, src: u64, n: u32) {
        let mis = dst ^ src;
        let a: u32 = if mis & 15 == 0 {
            16
        } else if mis & 7 == 0 {
            8
        } else if mis & 3 == 0 {
            4
        } else {
            1
        };
        let (head, nwords) = if a == 1 {
            (0, n)
        } else {
            let head = ((a - (src as u32 & (a - 1))) & (a - 1)).min(n);
            (head, (n - head) / a)
        };
        let body = nwords * a;
        let tail = n - head - body;
        let mut seen = vec![0u8; n as usize];
        let mut copy = |off: u32, len: u32| {
            for k in off..off + len {
                seen[k as usize] += 1;
            }
            // SAFETY: test buffers; the runs were built inside them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src + u64::from(off)) as usize as *const u8,
                    (dst + u64::from(off)) as usize as *mut u8,
                    len as usize,
                )
            };
        };
        for lane in 0..32u32 {
            if a != 1 && lane < head {
                copy(lane, 1);
            }
            let mut base = lane;
            while base < nwords {
                for u in 0..8u32 {
                    let k = base + u * 32;
                    if k < nwords {
                        copy(head + k * a, a);
                    }
                }
                base += 32 * 8;
            }
            if a != 1 && lane < tail {
                copy(head + body + lane, 1);
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "a tile byte not copied exactly once"
        );
    }

    /// The kernel, on the host: every warp of the grid, same table, same
    /// 32-bit arithmetic, same search and walk.
    fn run_model(table: &Table, shape: &LaunchShape) {
        let warps = u64::from(shape.grid) * u64::from(WARPS_PER_BLOCK);
        let tpw = u64::from(shape.tiles_per_warp);
        let total = u64::from(shape.total_tiles);
        assert!(
            (warps - u64::from(WARPS_PER_BLOCK)) * tpw < total,
            "a whole block idle"
        );
        assert_eq!(table.tile_start[0], 0);
        assert_eq!(table.tile_start[shape.nruns as usize], shape.total_tiles);
        let shift = shape.tile_shift();
        let tile_bytes = 1u64 << shift;
        assert_eq!(tile_bytes, shape.tile_bytes);
        let load = |r: u32| {
            let e = table.runs[r as usize];
            let [ss, ds] = if e.count > 1 {
                table.strides[e.stride_index as usize]
            } else {
                [0, 0]
            };
            let (start, end) = (
                table.tile_start[r as usize],
                table.tile_start[r as usize + 1],
            );
            assert!(start < end, "run {r} has no tile");
            (e, ss, ds, start, end)
        };
        for w in 0..warps {
            let first = w * tpw;
            if first >= total {
                continue;
            }
            let mut t = first as u32;
            let t_end = (first + tpw).min(total) as u32;
            let mut r = model_find_run(&table.tile_start, shape.nruns, t);
            let (mut e, mut ss, mut ds, mut start, mut end) = load(r);
            loop {
                assert!(t >= start && t < end, "tile {t} is not in run {r}");
                let per_copy = ((e.len + tile_bytes - 1) >> shift) as u32;
                let local = t - start;
                let (mut i, mut j) = (local, 0);
                if per_copy != 1 {
                    i = local / per_copy;
                    j = local - i * per_copy;
                }
                assert!(i < e.count);
                let off = u64::from(j) << shift;
                let n = (e.len - off).min(tile_bytes) as u32;
                model_warp_copy(
                    e.dst + u64::from(i) * ds + off,
                    e.src + u64::from(i) * ss + off,
                    n,
                );
                t += 1;
                if t >= t_end {
                    break;
                }
                if t >= end {
                    r += 1;
                    (e, ss, ds, start, end) = load(r);
                }
            }
        }
    }

    #[test]
    fn the_run_search_finds_every_tile() {
        for nruns in [1u32, 2, 31, 32, 33, 63, 64, 65, 1000, 1024, 1025, 40000] {
            let mut starts: Vec<u32> = Vec::with_capacity(nruns as usize + 1);
            let mut t = 0u32;
            for r in 0..nruns {
                starts.push(t);
                t += 1 + (r * 7919 % 5) * (r % 3);
            }
            starts.push(t);
            let mut r = 0u32;
            for tile in 0..t {
                while starts[r as usize + 1] <= tile {
                    r += 1;
                }
                assert_eq!(
                    model_find_run(&starts, nruns, tile),
                    r,
                    "nruns {nruns} tile {tile}"
                );
            }
        }
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Random non-overlapping runs: (region_offset, app_offset, len, count, rstride, astride).
    fn random_runs(
        rng: &mut Rng,
        region_len: u64,
        app_len: u64,
        max_len: u64,
    ) -> Vec<(u64, u64, u64, u32, u64, u64)> {
        let mut out = Vec::new();
        let (mut ro, mut ao) = (rng.below(40), rng.below(40));
        loop {
            let len = 1 + rng.below(max_len);
            let count = if rng.below(3) == 0 {
                1 + rng.below(12) as u32
            } else {
                1
            };
            let rs = len + rng.below(24);
            let as_ = len + rng.below(100);
            let rspan = (count as u64 - 1) * rs + len;
            let aspan = (count as u64 - 1) * as_ + len;
            if ro + rspan > region_len || ao + aspan > app_len {
                break;
            }
            out.push((ro, ao, len, count, rs, as_));
            ro += rspan + rng.below(33);
            ao += aspan + rng.below(33);
        }
        out
    }

    #[test]
    fn table_model_matches_host_copy_for_random_runs() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for case in 0..80 {
            let region_len = 64 * 1024;
            let app_len = 96 * 1024;
            let max_len = [8, 100, 5000, 40000][case % 4];
            let tile = [16, 64, 4096, DEFAULT_TILE_BYTES][(case / 4) % 4];
            let max_warps = [1, 3, 7, 1000, 1 << 20][(case / 16) % 5];
            let layout = random_runs(&mut rng, region_len, app_len, max_len);
            if layout.is_empty() {
                continue;
            }
            let src: Vec<u8> = (0..app_len).map(|_| rng.next() as u8).collect();
            let mut region_ref = vec![0xABu8; region_len as usize];
            let mut region_model = vec![0xABu8; region_len as usize];
            let mk = |region: &mut Vec<u8>, app_base: usize| -> (RegionSpan, Vec<Run>) {
                let span = RegionSpan {
                    addr: region.as_mut_ptr() as usize,
                    len: region.len(),
                };
                let runs = layout
                    .iter()
                    .map(|&(ro, ao, len, count, rs, as_)| Run {
                        region_offset: ro,
                        addr: app_base as u64 + ao,
                        len,
                        count,
                        region_stride: rs,
                        addr_stride: as_,
                    })
                    .collect();
                (span, runs)
            };
            // Gather: host reference vs model.
            let (span_ref, runs_ref) = mk(&mut region_ref, src.as_ptr() as usize);
            HostCopy {
                threads: 1,
                parallel_threshold: u64::MAX,
            }
            .copy(Direction::Gather, span_ref, &runs_ref)
            .unwrap();
            let (span_m, runs_m) = mk(&mut region_model, src.as_ptr() as usize);
            let mut table = Table::new(runs_m.len());
            let shape = table
                .fill(Direction::Gather, span_m, &runs_m, tile, max_warps)
                .unwrap();
            assert!(shape.grid >= 1);
            assert!(
                u64::from(shape.grid) * u64::from(WARPS_PER_BLOCK)
                    < u64::from(max_warps) + u64::from(WARPS_PER_BLOCK)
            );
            assert_eq!(
                shape.nstrided as usize,
                runs_m.iter().filter(|r| r.count > 1).count()
            );
            assert_eq!(
                shape.total_bytes,
                runs_m.iter().map(|r| r.len * r.count as u64).sum::<u64>()
            );
            run_model(&table, &shape);
            assert!(region_model == region_ref, "case {case}: gather differs");
            // Scatter back into poisoned application buffers.
            let mut dst_ref = vec![0xABu8; app_len as usize];
            let mut dst_model = vec![0xABu8; app_len as usize];
            let (_, s_ref) = mk(&mut region_ref, dst_ref.as_mut_ptr() as usize);
            HostCopy {
                threads: 1,
                parallel_threshold: u64::MAX,
            }
            .copy(Direction::Scatter, span_ref, &s_ref)
            .unwrap();
            let (_, s_m) = mk(&mut region_model, dst_model.as_mut_ptr() as usize);
            let shape = table
                .fill(Direction::Scatter, span_m, &s_m, tile, max_warps)
                .unwrap();
            run_model(&table, &shape);
            assert!(dst_model == dst_ref, "case {case}: scatter differs");
        }
    }

    #[test]
    fn a_run_of_many_copies_is_one_table_entry() {
        let region = RegionSpan {
            addr: 1 << 20,
            len: 4096 * 1000,
        };
        let runs = [Run {
            region_offset: 0,
            addr: 1 << 40,
            len: 4096,
            count: 1000,
            region_stride: 4096,
            addr_stride: 8192,
        }];
        let mut table = Table::new(1);
        let s = table
            .fill(
                Direction::Gather,
                region,
                &runs,
                DEFAULT_TILE_BYTES,
                132 * 64,
            )
            .unwrap();
        // One tile (one warp) per copy: 1000 warps in 125 blocks.
        assert_eq!(
            (s.nruns, s.nstrided, s.total_tiles, s.tiles_per_warp, s.grid),
            (1, 1, 1000, 1, 125)
        );
        assert_eq!(table.runs[0].src, 1 << 40);
        assert_eq!(table.runs[0].dst, 1 << 20);
        assert_eq!((table.runs[0].count, table.runs[0].stride_index), (1000, 0));
        assert_eq!(table.strides[0], [8192, 4096]);
        assert_eq!(&table.tile_start[..2], &[0, 1000]);
        // 32 bytes of run, 8 of tile starts, 8 of alignment gap, 16 of strides.
        assert_eq!(s.table_bytes(), 32 + 8 + 8 + 16);
        let s = table
            .fill(
                Direction::Scatter,
                region,
                &runs,
                DEFAULT_TILE_BYTES,
                132 * 64,
            )
            .unwrap();
        assert_eq!(s.total_bytes, 4096 * 1000);
        assert_eq!((table.runs[0].src, table.runs[0].dst), (1 << 20, 1 << 40));
        assert_eq!(table.strides[0], [4096, 8192]);
        // A large single copy is split into tiles; no stride list.
        let big = [Run::single(0, 1 << 40, 4096 * 1000)];
        let s = table
            .fill(Direction::Gather, region, &big, 16 * 1024, 100)
            .unwrap();
        assert_eq!(s.total_tiles as u64, (4096u64 * 1000).div_ceil(16 * 1024));
        // 250 tiles over at most 100 warps: 3 tiles each, so 84 warps in 11 blocks.
        assert_eq!(
            (s.total_tiles, s.tiles_per_warp, s.grid, s.nstrided),
            (250, 3, 11, 0)
        );
        assert_eq!(s.table_bytes(), 32 + 8 + 8);
        // 16384 single 4 KiB runs (the probe's case): 36 bytes a run.
        let n = 16384u64;
        let region = RegionSpan {
            addr: 1 << 30,
            len: (n * 4096) as usize,
        };
        let single: Vec<Run> = (0..n)
            .map(|i| Run::single(i * 4096, (1 << 40) + 2 * i * 4096, 4096))
            .collect();
        let mut table = Table::new(single.len());
        let s = table
            .fill(
                Direction::Gather,
                region,
                &single,
                DEFAULT_TILE_BYTES,
                132 * 64 * 4,
            )
            .unwrap();
        assert_eq!(
            (s.total_tiles, s.tiles_per_warp, s.grid, s.nstrided),
            (16384, 1, 2048, 0)
        );
        assert_eq!(s.table_bytes(), 16384 * 36 + 4 + 12);
        assert!(table
            .tile_start
            .iter()
            .enumerate()
            .all(|(i, &t)| t == i as u32));
    }

    proptest::proptest! {
        /// The one pass (with its short form for single copies) refuses
        /// exactly what `check_runs` refuses, near every overflow edge, and
        /// otherwise writes the table entry by entry as the definition
        /// says.
        #[test]
        fn the_fill_refuses_what_the_check_refuses_and_tables_the_rest(
            // Mostly valid runs, each field now and then at an edge, so
            // that a list is often refused for one run's one field.
            runs in proptest::collection::vec(
                (
                    proptest::prop_oneof![8 => 0..1u64 << 15, 1 => (u64::MAX - 1024)..=u64::MAX],
                    proptest::prop_oneof![8 => 0..1u64 << 40, 1 => (u64::MAX - 1024)..=u64::MAX],
                    proptest::prop_oneof![1 => proptest::strategy::Just(0u64), 8 => 1..5000u64, 1 => (u64::MAX - 1024)..=u64::MAX],
                    proptest::prop_oneof![6 => proptest::strategy::Just(1u32), 1 => 0..5u32],
                    proptest::prop_oneof![8 => 0..4096u64, 1 => (u64::MAX / 2)..=u64::MAX],
                    proptest::prop_oneof![8 => 0..4096u64, 1 => (u64::MAX / 2)..=u64::MAX],
                ),
                1..4,
            ),
            gather in proptest::bool::ANY,
            region_addr in proptest::prop_oneof![8 => proptest::strategy::Just(1u64 << 20), 1 => (u64::MAX - (1 << 16))..=u64::MAX],
        ) {
            use proptest::prelude::*;
            let direction = if gather { Direction::Gather } else { Direction::Scatter };
            let region = RegionSpan { addr: region_addr as usize, len: 1 << 16 };
            let runs: Vec<Run> = runs
                .into_iter()
                .map(|(region_offset, addr, len, count, region_stride, addr_stride)| Run {
                    region_offset,
                    addr,
                    len,
                    count,
                    region_stride,
                    addr_stride,
                })
                .collect();
            let mut table = Table::new(runs.len());
            let filled = table.fill(direction, region, &runs, 64, 1000);
            let base_wraps = runs.iter().any(|r| region_addr.checked_add(r.region_offset).is_none());
            let checked = check_runs(direction, region.len, &runs);
            prop_assert_eq!(filled.is_ok(), checked.is_ok() && !base_wraps, "{:?} / {:?}", filled, checked);
            if let Ok(shape) = filled {
                prop_assert_eq!(shape.total_bytes, checked.unwrap());
                let mut tiles = 0u32;
                let mut strided = 0u32;
                for (i, r) in runs.iter().enumerate() {
                    let at = region_addr + r.region_offset;
                    let (src, dst) = if gather { (r.addr, at) } else { (at, r.addr) };
                    let stride_index = if r.count > 1 { strided += 1; strided - 1 } else { 0 };
                    prop_assert_eq!(table.runs[i], DevRun { src, dst, len: r.len, count: r.count, stride_index });
                    prop_assert_eq!(table.tile_start[i], tiles);
                    if r.count > 1 {
                        let want = if gather {
                            [r.addr_stride, r.region_stride]
                        } else {
                            [r.region_stride, r.addr_stride]
                        };
                        prop_assert_eq!(table.strides[stride_index as usize], want);
                    }
                    tiles += (r.len.div_ceil(64) * u64::from(r.count)) as u32;
                }
                prop_assert_eq!(table.tile_start[runs.len()], tiles);
                prop_assert_eq!(shape.nstrided, strided);
            }
        }

        /// The pair table is taken exactly when every copy has one length
        /// and they fit; it then refuses what the run table refuses and
        /// holds the run table's (source, destination) of every copy.
        #[test]
        fn the_pair_fill_agrees_with_the_run_table(
            runs in proptest::collection::vec(
                (
                    proptest::prop_oneof![8 => 0..1u64 << 15, 1 => (u64::MAX - 1024)..=u64::MAX],
                    proptest::prop_oneof![8 => 0..1u64 << 40, 1 => (u64::MAX - 1024)..=u64::MAX],
                    // Mostly one length (the first run's), now and then another.
                    proptest::prop_oneof![12 => proptest::strategy::Just(None), 1 => proptest::strategy::Strategy::prop_map(0..5000u64, Some), 1 => proptest::strategy::Strategy::prop_map((u64::MAX - 1024)..=u64::MAX, Some)],
                    proptest::prop_oneof![8 => proptest::strategy::Just(1u32), 4 => proptest::strategy::Just(2u32), 1 => 0..5u32],
                    proptest::prop_oneof![8 => 0..8192u64, 1 => (u64::MAX / 2)..=u64::MAX],
                    proptest::prop_oneof![8 => 0..8192u64, 1 => (u64::MAX / 2)..=u64::MAX],
                ),
                1..5,
            ),
            first_len in proptest::prop_oneof![1 => proptest::strategy::Just(0u64), 8 => 1..5000u64, 1 => (u64::MAX - 1024)..=u64::MAX],
            gather in proptest::bool::ANY,
            region_addr in proptest::prop_oneof![8 => proptest::strategy::Just(1u64 << 20), 1 => (u64::MAX - (1 << 16))..=u64::MAX],
        ) {
            use proptest::prelude::*;
            let direction = if gather { Direction::Gather } else { Direction::Scatter };
            let region = RegionSpan { addr: region_addr as usize, len: 1 << 16 };
            let runs: Vec<Run> = runs
                .into_iter()
                .map(|(region_offset, addr, len, count, region_stride, addr_stride)| Run {
                    region_offset,
                    addr,
                    len: len.unwrap_or(first_len),
                    count,
                    region_stride,
                    addr_stride,
                })
                .collect();
            let uniform = runs.iter().all(|r| r.len == runs[0].len);
            let copies: u64 = runs.iter().map(|r| u64::from(r.count)).sum();
            let room = 8usize;
            let mut words = vec![u64::MAX; 2 * room];
            let pairs = fill_pairs(direction, region, &runs, &mut words);
            let mut table = Table::new(runs.len());
            let filled = table.fill(direction, region, &runs, 64, 1000);
            match pairs {
                Ok(None) => prop_assert!(!uniform || copies > room as u64),
                Err(_) => prop_assert!(uniform && filled.is_err(), "{:?}", filled),
                Ok(Some((len, n))) => {
                    prop_assert!(uniform);
                    prop_assert_eq!((len, n as u64), (runs[0].len, copies));
                    prop_assert!(filled.is_ok(), "{:?}", filled);
                    let mut j = 0;
                    for run in &table.runs {
                        let [ss, ds] = if run.count > 1 { table.strides[run.stride_index as usize] } else { [0, 0] };
                        for k in 0..u64::from(run.count) {
                            // Wrapping, as the device would (a table that
                            // wraps is refused, never launched).
                            let at = |base: u64, step: u64| base.wrapping_add(k.wrapping_mul(step));
                            prop_assert_eq!([words[2 * j], words[2 * j + 1]], [at(run.src, ss), at(run.dst, ds)]);
                            j += 1;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_input_is_refused_before_anything_is_launched() {
        let region = RegionSpan {
            addr: 4096,
            len: 4096,
        };
        let mut table = Table::new(4);
        let ok = Run::single(0, 1 << 30, 100);
        let past = Run::single(4000, 1 << 30, 200);
        let e = table
            .fill(Direction::Gather, region, &[ok, past], 4096, 8)
            .unwrap_err();
        assert!(e.reason.contains("run 1") && e.quiesced, "{e}");
        for bad_tile in [0, 8, 24, 100, 4096 + 16, MAX_TILE_BYTES * 2] {
            let e = table
                .fill(Direction::Gather, region, &[ok], bad_tile, 8)
                .unwrap_err();
            assert!(e.reason.contains("power of two"), "{e}");
        }
        let e = table
            .fill(Direction::Gather, region, &[], 4096, 8)
            .unwrap_err();
        assert!(e.reason.contains("no runs"), "{e}");
        let e = table
            .fill(Direction::Gather, region, &[ok; 5], 4096, 8)
            .unwrap_err();
        assert!(e.reason.contains("too small"), "{e}");
        let e = table
            .fill(Direction::Gather, region, &[ok], 4096, 0)
            .unwrap_err();
        assert!(e.reason.contains("0 warps"), "{e}");
        let empty = Run { count: 0, ..ok };
        assert!(table
            .fill(Direction::Scatter, region, &[empty], 4096, 8)
            .is_err());
        let wrap = Run::single(0, u64::MAX - 10, 100);
        assert!(table
            .fill(Direction::Scatter, region, &[wrap], 4096, 8)
            .is_err());
        // More than 2^32 - 1 tiles of 16 bytes: refused, not truncated.
        let huge = RegionSpan {
            addr: 1 << 40,
            len: 1 << 37,
        };
        let e = table
            .fill(
                Direction::Gather,
                huge,
                &[Run::single(0, 1 << 20, 1 << 37)],
                16,
                8,
            )
            .unwrap_err();
        assert!(e.reason.contains("tiles"), "{e}");
    }

    #[test]
    fn architecture_strings() {
        assert_eq!(arch_number(9, 0), Some(90));
        assert_eq!(arch_number(10, 0), Some(100));
        assert_eq!(arch_number(12, 1), Some(121));
        assert_eq!(arch_number(0, 0), None);
        assert_eq!(choose_target(9, 0, &[]).unwrap(), NvrtcTarget::Cubin(90));
        assert_eq!(
            choose_target(9, 0, &[75, 80, 86, 89, 90, 100]).unwrap(),
            NvrtcTarget::Cubin(90)
        );
        assert_eq!(
            choose_target(12, 0, &[75, 80, 90, 100]).unwrap(),
            NvrtcTarget::Ptx(100)
        );
        assert!(choose_target(7, 0, &[75, 80]).is_err());
        assert_eq!(
            NvrtcTarget::Cubin(90).arch_option(),
            "--gpu-architecture=sm_90"
        );
        assert_eq!(
            NvrtcTarget::Ptx(100).arch_option(),
            "--gpu-architecture=compute_100"
        );
        let o = nvrtc_options(NvrtcTarget::Cubin(90));
        assert!(o.contains(&"--std=c++17".to_string()));
    }

    #[test]
    fn the_kernel_source_matches_the_host_constants() {
        assert!(KERNEL_SOURCE.contains(&format!("#define BOUNCE_THREADS {BLOCK_THREADS}")));
        for name in [KERNEL_NAME, ZERO_COPY_KERNEL_NAME] {
            assert!(KERNEL_SOURCE.contains(&format!(
                "void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)\n{name}("
            )));
        }
        for n in INLINE_PAIRS {
            assert!(KERNEL_SOURCE.contains(&format!("BOUNCE_INLINE_PAIRS_KERNEL({n})\n")));
            // The table and the other five parameters fit in CUDA's 32,764
            // bytes of kernel parameters.
            assert!(n * 16 + 8 + 4 * 4 <= 32_764, "{n}");
        }
        assert!(INLINE_PAIRS.windows(2).all(|w| w[0] < w[1]));
        assert!(
            !KERNEL_SOURCE.contains("#include"),
            "NVRTC has no toolkit headers"
        );
    }

    #[test]
    fn the_kernel_compiles_with_nvrtc_when_present() {
        for target in [NvrtcTarget::Cubin(90), NvrtcTarget::Ptx(80)] {
            match compile_copy_kernel(target) {
                Ok((image, t)) => {
                    assert!(!image.is_empty());
                    // NVRTC of CUDA 12.1 or later keeps the inline kernels
                    // (for Volta and later: both targets here are).
                    let (mut major, mut minor) = (0, 0);
                    // SAFETY: two out pointers.
                    let _ = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
                    let has = |name: &str| image.windows(name.len()).any(|w| w == name.as_bytes());
                    for n in INLINE_PAIRS {
                        assert_eq!(
                            has(&inline_pairs_kernel_name(n)),
                            (major, minor) >= (12, 1),
                            "{n}: NVRTC {major}.{minor}"
                        );
                    }
                    println!("{target:?}: {} bytes in {t:?}", image.len());
                }
                Err(e) if e.contains("could not be loaded") => {
                    println!("SKIP: {e}");
                    return;
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn handles_cross_threads_as_the_runtime_needs() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<PendingCopy>();
        send::<ExecGuard>();
        send_sync::<CudaCopy>();
        send_sync::<ExecPool>();
        send_sync::<CudaRuntime>();
        send_sync::<crate::dataplane::vram::DeviceArena>();
    }

    #[test]
    fn probe_never_panics() {
        match CudaRuntime::probe() {
            Ok(rt) => assert!(rt.device_count() > 0),
            Err(e) => assert!(!e.is_empty()),
        }
    }
}
