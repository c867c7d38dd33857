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
use crate::proto::{Copies, Run, Runs};
use crate::sync::Locked;

mod compile;
mod device;
mod error;
mod exec;
mod table;

pub use compile::*;
pub use device::*;
pub use error::CudaError;
pub use exec::*;
pub use table::*;

/// The kernel's CUDA C source.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/gather_scatter.cu");
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
/// The sizes (in copies) of the packed-copies kernels that take the
/// application addresses as a launch parameter
/// (`bounce_copy_packed_inline<N>`, the region side computed), smallest
/// first: a single list of packed copies of at most the largest (a
/// chunk's gather, a DATA's scatter) is launched with no table filled or
/// uploaded ([`CopyOptions::inline_packed`]). Not larger: 16 KiB of
/// parameter made a lone 16,384-block request (chunks of 2048) ~0.1 ms
/// slower on an H100, where 1024 blocks gained (docs/benchmarks.md).
pub const INLINE_PACKED: [usize; 3] = [256, 512, 1024];
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
    /// A single list of packed copies (a chunk's gather, a DATA's scatter)
    /// of at most the largest of [`INLINE_PACKED`] copies (1024) passes its
    /// application addresses as the launch's parameter, the region side
    /// computed on the device: no table filled or uploaded
    /// (`copy_inline_packed`, on by default).
    pub inline_packed: bool,
}

impl CopyOptions {
    /// The options the configuration asks for (`use_cub_copy` selects the
    /// batched-memcpy path).
    pub fn for_config(cfg: &crate::config::Config) -> Self {
        CopyOptions {
            batch_memcpy: cfg.use_cub_copy,
            pair_tables: cfg.copy_pair_tables,
            inline_packed: cfg.copy_inline_packed,
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
            inline_packed: true,
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

/// The NVTX range of a copy's launch.
fn launch_range(direction: Direction) -> crate::nvtx::Range {
    crate::nvtx::range(match direction {
        Direction::Gather => c"bounce.gather.launch",
        Direction::Scatter => c"bounce.scatter.launch",
    })
}

impl CudaCopy {
    /// A copy started at `t0` (or its failure), its launch time counted,
    /// as the IO thread polls it ([`CopyEngine::try_launch`]).
    fn timed(
        &self,
        direction: Direction,
        t0: Instant,
        started: Result<PendingCopy, CopyError>,
    ) -> Result<Box<dyn LaunchedCopy>, CopyError> {
        let launched = Instant::now();
        self.phases.add(direction, Some(launched - t0), None);
        started.map(|pending| {
            Box::new(TimedCopy {
                pending,
                launched,
                phases: self.phases.clone(),
            }) as Box<dyn LaunchedCopy>
        })
    }

    pub fn new(pool: Arc<ExecPool>) -> Self {
        CudaCopy {
            pool,
            opts: CopyOptions::default(),
            phases: Default::default(),
        }
    }

    pub fn with_options(pool: Arc<ExecPool>, opts: CopyOptions) -> Result<Self, CudaError> {
        if !valid_tile_bytes(opts.tile_bytes) {
            return Err(CudaError::Invalid(format!(
                "tile size {} is not a power of two from 16 to {MAX_TILE_BYTES}",
                opts.tile_bytes
            )));
        }
        if opts.max_blocks == Some(0) {
            return Err(CudaError::Invalid("max_blocks must be at least 1".into()));
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
        self.try_start_list(direction, region, RunsArg::Slice(runs))
    }

    /// [`try_start`](Self::try_start) of a slice or a shared list.
    pub fn try_start_list(
        &self,
        direction: Direction,
        region: RegionSpan,
        runs: RunsArg<'_>,
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
            .map_err(|reason| CopyError::refused(direction, reason))?;
        self.launch_on(g, direction, region, RunsArg::Slice(runs))
    }

    fn launch_on(
        &self,
        mut g: ExecGuard,
        direction: Direction,
        region: RegionSpan,
        runs: RunsArg<'_>,
    ) -> Result<PendingCopy, CopyError> {
        let _range = launch_range(direction);
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
        runs: &Runs,
    ) -> Option<Result<Box<dyn LaunchedCopy>, CopyError>> {
        let t0 = Instant::now();
        let started = self
            .try_start_list(direction, region, RunsArg::List(runs))
            .transpose()?;
        Some(self.timed(direction, t0, started))
    }

    fn try_launch_together(
        &self,
        direction: Direction,
        copies: &[(RegionSpan, &Runs)],
    ) -> Option<Result<Box<dyn LaunchedCopy>, CopyError>> {
        // Packed copies only (real clients' chunks: blocks of one size),
        // and not where tables are read over the bus or copied by the
        // driver's batched memcpy.
        if copies.len() < 2 || self.opts.batch_memcpy || self.pool.zero_copy {
            return None;
        }
        let Some(lists) = copies
            .iter()
            .map(|(region, runs)| runs.copies().map(|c| (*region, c)))
            .collect::<Option<Vec<_>>>()
        else {
            tracing::debug!(
                ?direction,
                n = copies.len(),
                "not launched together: not all packed copies"
            );
            return None;
        };
        let t0 = Instant::now();
        let Some(mut g) = self.pool.try_acquire() else {
            tracing::debug!(
                ?direction,
                n = copies.len(),
                "not launched together: no context free"
            );
            return None;
        };
        let _range = launch_range(direction);
        let started = match g.launch_copies_together(direction, &lists, &self.opts) {
            Ok(exec::Together::Launched) => Ok(PendingCopy {
                direction,
                state: PendingState::Running(g),
            }),
            // Not together: the guard goes back idle, nothing launched.
            Ok(exec::Together::NotLaunched(e)) => {
                tracing::debug!(?direction, n = copies.len(), "not launched together: {e}");
                return None;
            }
            Err(e) => Err(e),
        };
        Some(self.timed(direction, t0, started))
    }

    fn phase_counters(&self) -> Vec<(&'static str, u64)> {
        let get = |a: &[AtomicU64; 2], i: usize| a[i].load(Ordering::Relaxed);
        let p = &self.phases;
        let step = |i: usize| self.pool.launch_steps_ns[i].load(Ordering::Relaxed);
        let kernel = |i: usize| self.pool.kernel_ns[i].load(Ordering::Relaxed);
        let upload = |i: usize| self.pool.upload_ns[i].load(Ordering::Relaxed);
        let launches = |i: usize| self.pool.launches[i].load(Ordering::Relaxed);
        let inline = |i: usize| self.pool.inline_launches[i].load(Ordering::Relaxed);
        vec![
            ("gpu_gather_launch_ns", get(&p.launch_ns, 0)),
            ("gpu_gather_wait_ns", get(&p.wait_ns, 0)),
            ("gpu_scatter_launch_ns", get(&p.launch_ns, 1)),
            ("gpu_scatter_wait_ns", get(&p.wait_ns, 1)),
            ("gpu_launch_prepare_ns", step(0)),
            ("gpu_launch_fill_ns", step(1)),
            ("gpu_launch_upload_ns", step(2)),
            ("gpu_launch_call_ns", step(3)),
            ("gpu_gather_launches", launches(0)),
            ("gpu_scatter_launches", launches(1)),
            ("gpu_gather_inline_launches", inline(0)),
            ("gpu_scatter_inline_launches", inline(1)),
            ("gpu_gather_kernel_ns", kernel(0)),
            ("gpu_scatter_kernel_ns", kernel(1)),
            ("gpu_gather_upload_ns", upload(0)),
            ("gpu_scatter_upload_ns", upload(1)),
        ]
    }
}

/// The runs a launch copies: a slice, or a shared list that may be packed
/// copies ([`Runs::copies`]), whose table is then filled from the copies
/// without their runs being built.
#[derive(Clone, Copy, Debug)]
pub enum RunsArg<'a> {
    Slice(&'a [Run]),
    List(&'a Runs),
}

impl<'a> RunsArg<'a> {
    /// The packed copies, when the list is made of them.
    pub fn copies(self) -> Option<&'a Copies> {
        match self {
            RunsArg::Slice(_) => None,
            RunsArg::List(l) => l.copies(),
        }
    }

    /// The runs (built from packed copies on first use).
    pub fn runs(self) -> &'a [Run] {
        match self {
            RunsArg::Slice(r) => r,
            RunsArg::List(l) => l,
        }
    }

    fn is_empty(self) -> bool {
        match self {
            RunsArg::Slice(r) => r.is_empty(),
            RunsArg::List(l) => l.copies().is_none() && l.is_empty(),
        }
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
                        CudaError::call(
                            format!("the {direction:?} kernel failed (cuStreamSynchronize)"),
                            e,
                        )
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
mod tests;
