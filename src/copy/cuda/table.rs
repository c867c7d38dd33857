//! The run table, host side (no CUDA call; runs and is tested everywhere): the
//! kernel's [`DevRun`] layout, the launch shape, and [`fill_table`] /
//! [`fill_pairs`], which build a chunk's table from its runs.

use super::*;

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
    pub(super) fn spread(
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
    let fail = |reason: String| CopyError::refused(direction, reason);
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
pub(super) struct Filled {
    pub(super) bad: bool,
    pub(super) total_bytes: u64,
    pub(super) total_tiles: u64,
    pub(super) nstrided: usize,
}

/// [`fill_table`]'s pass over the runs, for one direction (`GATHER`: the
/// application side is the source). `out_runs` and `out_tile_start` hold
/// exactly `runs.len()` and `runs.len() + 1` slots, `out_strides` at least
/// `runs.len()`. Checks are folded into one flag with wrapping arithmetic;
/// a single copy (`count == 1`) needs no stride arithmetic, so it takes the
/// short form of the same checks.
#[inline(always)]
pub(super) fn fill_runs<const GATHER: bool>(
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
        return Err(CopyError::refused(
            direction,
            "the runs' total size or region addresses overflow",
        ));
    }
    Ok(Some((len, copies)))
}

/// The pair table of packed copies ([`Copies`]: copy j between region
/// offset `first + j * len` and `addrs[j]`), as [`fill_pairs`] would fill
/// it from the runs the copies are: one pass over the addresses, no run
/// read. `Ok(None)` when `out` holds fewer than the copies; `Err` (worded
/// from the runs) when a copy leaves the region or an address range wraps.
pub fn fill_pairs_from_copies(
    direction: Direction,
    region: RegionSpan,
    copies: &Copies,
    out: &mut [u64],
) -> Result<Option<(u64, usize)>, CopyError> {
    let (len, addrs) = (copies.copy_len(), copies.addrs());
    let n = addrs.len();
    if out.len() < 2 * n {
        return Ok(None);
    }
    // No region address below overflows.
    let mut at = packed_region_start(direction, region, copies)?;
    let gather = direction == Direction::Gather;
    for (pair, &a) in out[..2 * n].chunks_exact_mut(2).zip(addrs) {
        (pair[0], pair[1]) = if gather { (a, at) } else { (at, a) };
        at += len;
    }
    Ok(Some((len, n)))
}

/// The device address of `copies`' first region-side copy in `region`,
/// once every copy is checked to lie inside it (and every application
/// range to fit the address space): the region side of copy i is this
/// plus i times the copies' length, with no overflow. Err: a copy leaves
/// the region (named as [`check_runs`] names it) or an address overflows.
pub fn packed_region_start(
    direction: Direction,
    region: RegionSpan,
    copies: &Copies,
) -> Result<u64, CopyError> {
    let region_base = region.addr as u64;
    let fits = copies.region_end() <= region.len as u64
        && region_base.checked_add(copies.region_end()).is_some()
        && copies.addresses_fit();
    if !fits {
        let runs = Runs::from_copies(copies.clone());
        check_runs(direction, region.len, &runs)?;
        return Err(CopyError::refused(
            direction,
            "the copies' region addresses overflow",
        ));
    }
    Ok(region_base + copies.first())
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
) -> Result<LaunchShape, CudaError> {
    if n == 0 || len == 0 {
        return Err(CudaError::Invalid("a copy of no bytes".into()));
    }
    if !valid_tile_bytes(tile_bytes) || max_warps == 0 {
        return Err(CudaError::Invalid(format!(
            "tile size {tile_bytes} or launch of {max_warps} warps unusable"
        )));
    }
    let per_copy = len.div_ceil(tile_bytes);
    let total_tiles = u32::try_from(per_copy.saturating_mul(n as u64)).map_err(|_| {
        CudaError::Invalid(format!(
            "{n} copies of {len} bytes: too many tiles for one launch"
        ))
    })?;
    let nruns = u32::try_from(n)
        .ok()
        .filter(|&r| r < 1 << 31)
        .ok_or_else(|| {
            CudaError::Invalid(format!("{n} copies in one launch (at most 2^31 - 1)"))
        })?;
    let total_bytes = len
        .checked_mul(n as u64)
        .ok_or_else(|| CudaError::Invalid(format!("{n} copies of {len} bytes overflow")))?;
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

/// The name of the pair kernel whose table parameter holds `n` copies.
pub fn inline_pairs_kernel_name(n: usize) -> String {
    format!("bounce_copy_pairs_inline{n}")
}

/// The name of the packed-copies kernel whose parameter holds the
/// application addresses of `n` copies.
pub fn inline_packed_kernel_name(n: usize) -> String {
    format!("bounce_copy_packed_inline{n}")
}
