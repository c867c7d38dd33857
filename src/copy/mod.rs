//! Copy engines: gather scattered application memory into an arena region,
//! and scatter a region back out. One trait, so the DRAM (memcpy) engine and
//! the CUDA engine slot into the same runtime.

pub mod cma;
pub mod cuda;
pub mod host;
pub mod ipc;

use std::sync::Arc;

use crate::config::Config;
use crate::dataplane::Arena;

use crate::proto::{Run, Runs};

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Application memory (`Run::addr`) -> region.
    Gather,
    /// Region -> application memory (`Run::addr`).
    Scatter,
}

/// A copy that could not be carried out. Nothing was copied when the runs
/// were rejected up front; `quiesced` says whether the engine can prove that
/// nothing still touches the memory (always true for the host engine).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{direction:?} failed: {reason}")]
pub struct CopyError {
    pub direction: Direction,
    pub reason: String,
    pub quiesced: bool,
}

impl CopyError {
    /// A copy refused before anything was launched: nothing was copied and
    /// nothing touches the memory.
    pub fn refused(direction: Direction, reason: impl Into<String>) -> Self {
        CopyError {
            direction,
            reason: reason.into(),
            quiesced: true,
        }
    }
}

/// A region of the local arena, as an address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSpan {
    pub addr: usize,
    pub len: usize,
}

/// A copy launched without waiting for it (see [`CopyEngine::try_launch`]).
pub trait LaunchedCopy: Send {
    /// `None` while the copy runs; then its result. Does not block (a
    /// failure may synchronise the copy's stream to tell whether it is
    /// quiet). Dropping a copy that still runs waits for it first, so an
    /// abandoned copy never touches memory afterwards.
    fn poll(&mut self) -> Option<Result<(), CopyError>>;
}

/// Moves bytes between application memory and arena regions.
///
/// `copy` blocks until the bytes are in place (the runtime calls it from a
/// copy worker, never from the IO thread); `try_launch` queues a copy
/// without blocking where the engine can (the CUDA engine), and the IO
/// thread then polls it. Implementations check that every
/// run lies inside `region` before touching memory; the application side of
/// each run was validated by the caller (the sender's descriptors by NIXL,
/// the receiver's destinations against registered memory).
pub trait CopyEngine: Send + Sync + std::fmt::Debug {
    fn copy(&self, direction: Direction, region: RegionSpan, runs: &[Run])
        -> Result<(), CopyError>;

    /// Launches a copy without waiting for it. `None`: this engine copies
    /// synchronously (the host engine), or nothing is free to launch on
    /// right now; then the caller hands the copy to a worker's `copy`.
    /// `Some(Err(_))`: refused up front or failed to launch, as `copy`.
    fn try_launch(
        &self,
        _direction: Direction,
        _region: RegionSpan,
        _runs: &Runs,
    ) -> Option<Result<Box<dyn LaunchedCopy>, CopyError>> {
        None
    }

    /// Launches copies of one direction together, without waiting: one
    /// table, one launch and one completion for all of them (a burst of
    /// chunks the IO thread launches in one pass). `None`: not together
    /// (this engine cannot, the lists are not packed copies of one length,
    /// one of them is refused, or nothing is free to launch on); nothing
    /// was launched, and the caller launches them one by one, which words
    /// any refusal. `Some(Err(_))`: the launch failed after it began, for
    /// every one of them.
    fn try_launch_together(
        &self,
        _direction: Direction,
        _copies: &[(RegionSpan, &Runs)],
    ) -> Option<Result<Box<dyn LaunchedCopy>, CopyError>> {
        None
    }

    /// Engine-specific time counters for the stats export (name, value),
    /// e.g. the CUDA engine's host launch time against its device wait.
    fn phase_counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// Checks that every run of `runs` lies inside a region of `region_len`
/// bytes and that no application range wraps around the address space.
pub fn check_runs(direction: Direction, region_len: usize, runs: &[Run]) -> Result<u64, CopyError> {
    let mut total = 0u64;
    for (i, run) in runs.iter().enumerate() {
        let bad = |why: String| CopyError::refused(direction, format!("run {i}: {why}"));
        let end = run
            .region_end()
            .ok_or_else(|| bad("empty or overflowing run".into()))?;
        if end > region_len as u64 {
            return Err(bad(format!(
                "ends at region offset {end}, past the region's {region_len} bytes"
            )));
        }
        run.addr_end()
            .ok_or_else(|| bad("application range wraps around".into()))?;
        total = run
            .total_bytes()
            .and_then(|b| total.checked_add(b))
            .ok_or_else(|| bad("size overflows".into()))?;
    }
    Ok(total)
}

/// An arena and the copy engine that fills and drains it.
pub type ArenaAndCopier = (Arc<dyn Arena>, Arc<dyn CopyEngine>);

/// The arena and copy engine for GPU `device`: device memory and the CUDA
/// gather/scatter kernels.
///
/// Fails (and the engine keeps that GPU's memory on UCX) when no CUDA driver
/// is present, the kernel does not compile, or the arena cannot be
/// allocated.
pub fn device_arena(device: u64, len: usize, config: &Config) -> Result<ArenaAndCopier, String> {
    cuda_arena(device, config, |dev| {
        Ok(Arc::new(crate::dataplane::vram::DeviceArena::new(
            dev, len,
        )?))
    })
}

/// The arena and copy engine of GPU `device`'s host-staged instance: host
/// memory pinned and mapped for the device, filled and drained by the same
/// CUDA kernels across PCIe (mixed memory; docs/design.md §3).
pub fn staged_arena(device: u64, len: usize, config: &Config) -> Result<ArenaAndCopier, String> {
    cuda_arena(device, config, |dev| {
        Ok(Arc::new(crate::dataplane::vram::PinnedArena::new(
            dev, len,
        )?))
    })
}

/// GPU `device`'s CUDA copy engine with the arena `make` allocates for it.
fn cuda_arena(
    device: u64,
    config: &Config,
    make: impl FnOnce(&cuda::CudaDevice) -> Result<Arc<dyn Arena>, String>,
) -> Result<ArenaAndCopier, String> {
    let cuda = cuda::CudaRuntime::probe()?;
    let ordinal =
        usize::try_from(device).map_err(|_| format!("device id {device} is not a GPU ordinal"))?;
    let dev = cuda.device(ordinal)?;
    let arena = make(&dev)?;
    let streams = (config.copy_stream_count as usize).max(1);
    let pool = cuda::ExecPool::new(dev, streams, config.use_zero_copy_arguments)?;
    let copier = cuda::CudaCopy::with_options(pool, cuda::CopyOptions::for_config(config))?;
    Ok((arena, Arc::new(copier)))
}
