//! Execution contexts: a stream, an event and a pinned run table each,
//! pooled per device ([`ExecPool`], borrowed as [`ExecGuard`]), and the
//! kernel launches they make.

use super::*;

/// Page-locked, device-mapped host memory holding a run table.
pub(super) struct PinnedTable {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) host: *mut u8,
    pub(super) dev: u64,
    pub(super) cap: usize,
}

impl PinnedTable {
    pub(super) fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<Self, CudaError> {
        let cap = cap.max(4096);
        ctx.bind_to_thread()
            .map_err(|e| CudaError::call("binding the CUDA context", e))?;
        // SAFETY: plain allocation of cap bytes; the result is checked.
        let host = unsafe {
            result::malloc_host(
                cap,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| CudaError::call(format!("cuMemHostAlloc({cap} bytes) for a run table"), e))?
            as *mut u8;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was just allocated with DEVICEMAP; dev is a valid out pointer.
        let mapped =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: host came from cuMemHostAlloc and nothing uses it yet.
            let _ = unsafe { result::free_host(host as *mut c_void) };
            return Err(CudaError::call(
                "cuMemHostGetDevicePointer for a run table",
                e,
            ));
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
    pub(super) fn ensure(&mut self, need: usize) -> Result<(), CudaError> {
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
pub(super) struct DeviceScratch {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: u64,
    pub(super) cap: usize,
}

impl DeviceScratch {
    pub(super) fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<Self, CudaError> {
        let cap = cap.max(4096);
        ctx.bind_to_thread()
            .map_err(|e| CudaError::call("binding the CUDA context", e))?;
        // SAFETY: plain device allocation, checked.
        let ptr = unsafe { result::malloc_sync(cap) }.map_err(|e| {
            CudaError::call(
                format!("cuMemAlloc({cap} bytes) for an uploaded run table"),
                e,
            )
        })?;
        Ok(DeviceScratch {
            ctx: ctx.clone(),
            ptr,
            cap,
        })
    }
    pub(super) fn ensure(&mut self, need: usize) -> Result<(), CudaError> {
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
pub(super) struct ExecCtx {
    pub(super) stream: Arc<CudaStream>,
    pub(super) done: CudaEvent,
    /// Recorded right before a timed kernel (see [`KERNEL_TIMING_ENV`]);
    /// `done` then times too.
    pub(super) began: Option<CudaEvent>,
    /// Recorded before a timed kernel's table upload: `queued` to `began`
    /// is the upload plus any wait for the GPU.
    pub(super) queued: Option<CudaEvent>,
    /// The kernel in flight on this context is timed (`began` recorded).
    pub(super) timed: Option<Direction>,
    pub(super) table: PinnedTable,
    pub(super) scratch: Option<DeviceScratch>,
    /// A pair table passed as a launch's parameter ([`Form::Inline`]).
    pub(super) inline_words: Vec<u64>,
}

/// With this variable set (to anything but empty), the run-table kernels
/// are timed with CUDA events and their device time is counted
/// (`gpu_{gather,scatter}_kernel_ns`, and from the table's upload to the
/// kernel's start `gpu_{gather,scatter}_upload_ns`): "device wait" counts
/// until the reactor looks, and only the device's own times tell a slow
/// copy from a late look. Off (the default), events are created without
/// timing, which is cheaper to record.
pub const KERNEL_TIMING_ENV: &str = "NIXL_BOUNCE_TIME_KERNELS";

pub(super) fn kernel_timing() -> bool {
    std::env::var_os(KERNEL_TIMING_ENV).is_some_and(|x| !x.is_empty())
}

// SAFETY: the raw pointers in PinnedTable/DeviceScratch are owned
// allocations; an ExecCtx is used by one thread at a time (it is moved out
// of the pool to be used), and the CUDA handles are thread-safe.
unsafe impl Send for ExecCtx {}

impl ExecCtx {
    pub(super) fn new(
        dev: &CudaDevice,
        table_cap: usize,
        zero_copy: bool,
    ) -> Result<Self, CudaError> {
        dev.bind()?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| CudaError::call("cuStreamCreate", e))?;
        let (done, began, queued) = if kernel_timing() {
            let timed = || {
                dev.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| CudaError::call("cuEventCreate", e))
            };
            (timed()?, Some(timed()?), Some(timed()?))
        } else {
            let done = dev
                .ctx
                .new_event(None)
                .map_err(|e| CudaError::call("cuEventCreate", e))?;
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
    pub(super) device: Arc<CudaDevice>,
    pub(super) kernel: Arc<CopyKernel>,
    pub(super) zero_copy: bool,
    pub(super) state: Mutex<PoolState>,
    pub(super) returned: Condvar,
    /// Host time of a launch's steps, summed: [context bind and table
    /// sizing, table fill, upload call, launch and event record].
    pub(super) launch_steps_ns: [AtomicU64; 4],
    /// Kernel launches made: [gather, scatter] (a group launched together
    /// counts once).
    pub(super) launches: [AtomicU64; 2],
    /// Of those, the launches whose table was their parameter (nothing
    /// uploaded): [gather, scatter].
    pub(super) inline_launches: [AtomicU64; 2],
    /// Device time of timed kernels, summed: [gather, scatter].
    pub(super) kernel_ns: [AtomicU64; 2],
    /// Device time from a timed kernel's upload to its start, summed:
    /// [gather, scatter].
    pub(super) upload_ns: [AtomicU64; 2],
}

pub(super) struct PoolState {
    pub(super) idle: Vec<ExecCtx>,
    /// Contexts not discarded (idle + borrowed).
    pub(super) live: usize,
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
    /// launch (ordered by the stream, no host wait) and the kernel reads it
    /// from device
    /// memory / L2. `zero_copy = true`: the kernel reads the table straight
    /// from mapped pinned host memory. That saves the upload but makes every
    /// table load a PCIe round trip, several per warp (the run
    /// search, the run entry), and thousands of warps reading the same host
    /// line (one merged run) queue behind each other: it is the slower
    /// option, kept for comparison (`gpu-probe` measures both).
    pub fn new(
        device: Arc<CudaDevice>,
        count: usize,
        zero_copy: bool,
    ) -> Result<Arc<Self>, CudaError> {
        if count == 0 {
            return Err(CudaError::Invalid(
                "an execution pool needs at least one context".into(),
            ));
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
            launches: Default::default(),
            inline_launches: Default::default(),
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
    pub fn acquire(self: &Arc<Self>, timeout: Duration) -> Result<ExecGuard, CudaError> {
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
                return Err(CudaError::call(
                    "acquiring an execution context",
                    "every execution context was discarded after CUDA errors",
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CudaError::Timeout(format!(
                    "no execution context was free within {timeout:?} ({} in use)",
                    st.live
                )));
            }
            st = crate::sync::wait_timeout(&self.returned, st, deadline - now).0;
        }
    }
}

/// A borrowed execution context; returned to its pool on drop.
pub struct ExecGuard {
    pub(super) pool: Arc<ExecPool>,
    pub(super) ctx: Option<ExecCtx>,
}

impl std::fmt::Debug for ExecGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecGuard")
            .field("device", &self.pool.device.ordinal)
            .finish()
    }
}

/// The table form of one launch (see [`ExecGuard::launch`]).
pub(super) enum Form {
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
    /// Packed copies' application addresses passed as the launch's
    /// parameter, the region side from `region` on: the
    /// `bounce_copy_packed_inline<cap>` kernel over the context's
    /// `inline_words`.
    InlinePacked {
        len: u64,
        shape: LaunchShape,
        cap: usize,
        region: u64,
        direction: Direction,
    },
}

/// What [`ExecGuard::launch_copies_together`] did.
pub(super) enum Together {
    /// One launch copies every list.
    Launched,
    /// Nothing launched, for this reason: the lists' copies are not all of
    /// one length, a list leaves its region (worded from its runs), or the
    /// launch could not be prepared (binding the device, room for the
    /// table, the launch's shape).
    NotLaunched(CopyError),
}

/// A pair table filled by [`ExecGuard::fill_pair_form`].
pub(super) struct PairForm {
    pub(super) len: u64,
    pub(super) copies: usize,
    /// The parameter kernel's capacity when the table is the parameter.
    pub(super) inline: Option<usize>,
}

impl Form {
    pub(super) fn shape(&self) -> &LaunchShape {
        match self {
            Form::Runs(shape)
            | Form::Pairs { shape, .. }
            | Form::Inline { shape, .. }
            | Form::InlinePacked { shape, .. } => shape,
        }
    }
}

impl ExecGuard {
    /// Adds a timed kernel's device time (its events are both complete) to
    /// the pool's count; nothing for an untimed one.
    pub(super) fn count_kernel_time(&mut self) {
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

    pub(super) fn ctx(&self) -> &ExecCtx {
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
    pub(super) fn fill_pair_form(
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

    /// The warps a launch may use: `opts.max_blocks` or the kernel's
    /// largest grid (a grid's x dimension is at most 2^31 - 1 blocks).
    fn max_warps(kernel: &CopyKernel, opts: &CopyOptions) -> u32 {
        let max_grid = opts
            .max_blocks
            .unwrap_or(kernel.max_grid)
            .clamp(1, i32::MAX as u32);
        max_grid.saturating_mul(WARPS_PER_BLOCK)
    }

    /// Fills the copy's table (a run table, or a pair table with
    /// `pair_tables`) and launches the copy; records the context's event
    /// after it. Err: nothing launched (`quiesced`) or a launch error.
    pub(super) fn launch(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        list: RunsArg<'_>,
        opts: &CopyOptions,
    ) -> Result<(), CopyError> {
        if opts.batch_memcpy {
            return self.launch_batch(direction, region, list.runs());
        }
        // Packed copies (a DATA's, as wire version 3 sends them): their
        // pair table straight from the addresses, no run read or built.
        // Not on a zero-copy pool, whose kernels read their table from
        // mapped host memory: there a pinned pair table is never used
        // (`fill_pair_form`), and the runs are built instead.
        if let Some(c) = list.copies().filter(|_| !self.pool.zero_copy) {
            return self.launch_copies(direction, region, c, opts);
        }
        let runs = list.runs();
        let kernel = self.pool.kernel.clone();
        let zero_copy = self.pool.zero_copy;
        let dev = self.pool.device.clone();
        let err = |reason: String, quiesced: bool| CopyError {
            direction,
            reason,
            quiesced,
        };
        let max_warps = Self::max_warps(&kernel, opts);
        let t0 = Instant::now();
        let layout = TableLayout::new(runs.len()).ok_or_else(|| {
            err(
                format!("{} runs overflow the run table size", runs.len()),
                true,
            )
        })?;
        dev.bind().map_err(|e| err(e.to_string(), true))?;
        let ctx = self
            .ctx
            .as_mut()
            .expect("an ExecGuard holds its context until dropped");
        ctx.table
            .ensure(layout.capacity)
            .map_err(|e| err(e.to_string(), true))?;
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
                    .map_err(|e| err(e.to_string(), true))?;
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
        self.submit(direction, form, &layout, [t0, t1, Instant::now()])
    }

    /// Fills the pair table of packed copies ([`fill_pairs_from_copies`])
    /// in the context's pinned table and launches it as [`launch`] does.
    ///
    /// [`launch`]: ExecGuard::launch
    fn launch_copies(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        copies: &Copies,
        opts: &CopyOptions,
    ) -> Result<(), CopyError> {
        match self.launch_copies_together(direction, &[(region, copies)], opts)? {
            Together::Launched => Ok(()),
            Together::NotLaunched(e) => Err(e),
        }
    }

    /// The pair tables of several lists of packed copies of one length,
    /// each in its region, one after another in the context's pinned table,
    /// launched as one copy ([`CopyEngine::try_launch_together`]): one
    /// upload, one launch, one event for all of them. Nothing is launched
    /// when a list is refused or the lengths differ.
    pub(super) fn launch_copies_together(
        &mut self,
        direction: Direction,
        lists: &[(RegionSpan, &Copies)],
        opts: &CopyOptions,
    ) -> Result<Together, CopyError> {
        let err = |reason: String| CopyError::refused(direction, reason);
        // Until the launch begins, a failure launches nothing (one list
        // alone may still fit what is there).
        let declined = |e: String| Ok(Together::NotLaunched(err(e)));
        let Some(((_, first), rest)) = lists.split_first() else {
            return Err(err("no copies to launch".into()));
        };
        let len = first.copy_len();
        if rest.iter().any(|(_, c)| c.copy_len() != len) {
            return declined("lengths differ".into());
        }
        let max_warps = Self::max_warps(&self.pool.kernel, opts);
        let t0 = Instant::now();
        let n: usize = lists.iter().map(|(_, c)| c.addrs().len()).sum();
        let bytes = pairs_table_bytes(n);
        if let Err(e) = self.pool.device.bind() {
            return declined(e.to_string());
        }
        if let ([(region, copies)], true) = (lists, opts.inline_packed) {
            if let Some(launched) =
                self.launch_packed_inline(direction, *region, copies, max_warps, opts, t0)
            {
                return launched;
            }
        }
        let zero_copy = self.pool.zero_copy;
        let ctx = self
            .ctx
            .as_mut()
            .expect("an ExecGuard holds its context until dropped");
        if let Err(e) = ctx.table.ensure(bytes) {
            return declined(e.to_string());
        }
        if let (false, Some(scratch)) = (zero_copy, ctx.scratch.as_mut()) {
            if let Err(e) = scratch.ensure(bytes) {
                return declined(e.to_string());
            }
        }
        let t1 = Instant::now();
        // SAFETY: the pinned table holds at least `bytes` = 16 n bytes
        // (ensured above), page-aligned (cuMemHostAlloc), so 8-aligned for
        // u64; the context is borrowed exclusively and idle, so no kernel
        // reads the table while it is rewritten.
        let out = unsafe { std::slice::from_raw_parts_mut(ctx.table.host as *mut u64, 2 * n) };
        let mut at = 0;
        for (region, copies) in lists {
            let filled = match fill_pairs_from_copies(direction, *region, copies, &mut out[at..]) {
                Ok(f) => f,
                Err(e) => return Ok(Together::NotLaunched(e)),
            };
            let Some((_, k)) = filled else {
                return declined(format!(
                    "a table of {n} copies does not fit its {bytes} bytes"
                ));
            };
            at += 2 * k;
        }
        let shape = match pairs_shape(n, len, opts.tile_bytes, max_warps) {
            Ok(shape) => shape,
            Err(e) => return declined(e.to_string()),
        };
        let layout = TableLayout::new(0).expect("an empty layout");
        // Begun: a failure from here fails every list.
        self.submit(
            direction,
            Form::Pairs { len, shape },
            &layout,
            [t0, t1, Instant::now()],
        )?;
        Ok(Together::Launched)
    }

    /// One list of packed copies launched with its application addresses
    /// as the kernel's parameter ([`launch_packed_inline`]), when a
    /// packed-copies kernel holds that many; `None`: no such kernel (the
    /// caller uploads a pair table instead). The region side is checked
    /// first ([`packed_region_start`]): a copy outside `region` launches
    /// nothing.
    fn launch_packed_inline(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        copies: &Copies,
        max_warps: u32,
        opts: &CopyOptions,
        t0: Instant,
    ) -> Option<Result<Together, CopyError>> {
        let addrs = copies.addrs();
        let (cap, _) = self.pool.kernel.inline_packed_function(addrs.len())?;
        let len = copies.copy_len();
        let checked = packed_region_start(direction, region, copies).and_then(|start| {
            pairs_shape(addrs.len(), len, opts.tile_bytes, max_warps)
                .map(|shape| (start, shape))
                .map_err(|e| CopyError::refused(direction, e.to_string()))
        });
        let (start, shape) = match checked {
            Ok(checked) => checked,
            Err(e) => return Some(Ok(Together::NotLaunched(e))),
        };
        let t1 = Instant::now();
        let ctx = self
            .ctx
            .as_mut()
            .expect("an ExecGuard holds its context until dropped");
        if ctx.inline_words.len() < cap {
            ctx.inline_words.resize(cap, 0);
        }
        ctx.inline_words[..addrs.len()].copy_from_slice(addrs);
        let form = Form::InlinePacked {
            len,
            shape,
            cap,
            region: start,
            direction,
        };
        let layout = TableLayout::new(0).expect("an empty layout");
        Some(
            self.submit(direction, form, &layout, [t0, t1, Instant::now()])
                .map(|()| Together::Launched),
        )
    }

    /// Uploads the table filled in the context's pinned memory (unless
    /// mapped or the parameter), launches its kernel and records the
    /// context's event after it; `marks` are when the launch began, its
    /// table was sized and filled.
    fn submit(
        &mut self,
        direction: Direction,
        form: Form,
        layout: &TableLayout,
        [t0, t1, t2]: [Instant; 3],
    ) -> Result<(), CopyError> {
        let kernel = self.pool.kernel.clone();
        let zero_copy = self.pool.zero_copy;
        let err = |reason: String, quiesced: bool| CopyError {
            direction,
            reason,
            quiesced,
        };
        let nruns = layout.nruns;
        let ctx = self
            .ctx
            .as_mut()
            .expect("an ExecGuard holds its context until dropped");
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
            Form::Inline { .. } | Form::InlinePacked { .. } => 0,
        };
        let table_dev = if zero_copy || used == 0 {
            ctx.table.dev
        } else {
            let scratch = ctx
                .scratch
                .as_mut()
                .expect("an uploading pool has a scratch buffer per context");
            scratch.ensure(used).map_err(|e| err(e.to_string(), true))?;
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
        // (fill_table, fill_pairs, packed_region_start), the application
        // side by the caller (see CopyEngine).
        let launched = unsafe {
            match &form {
                Form::Runs(shape) => {
                    let func = if zero_copy {
                        &kernel.func_zero_copy
                    } else {
                        &kernel.func
                    };
                    launch_copy(func, table_dev, layout, shape, stream)
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
                Form::InlinePacked {
                    len,
                    shape,
                    cap,
                    region,
                    direction,
                } => match kernel.inline_packed_function(shape.nruns as usize) {
                    Some((c, func)) if c == *cap => launch_packed_inline(
                        func,
                        &ctx.inline_words[..c],
                        *region,
                        *direction,
                        *len,
                        shape,
                        stream,
                    ),
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
        self.pool.launches[direction as usize].fetch_add(1, Ordering::Relaxed);
        if matches!(form, Form::Inline { .. } | Form::InlinePacked { .. }) {
            self.pool.inline_launches[direction as usize].fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The batched-memcpy alternative to the kernel (see
    /// [`CopyOptions::batch_memcpy`]).
    pub(super) fn launch_batch(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
    ) -> Result<(), CopyError> {
        let err = |reason: String| CopyError::refused(direction, reason);
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
        dev.bind().map_err(|e| err(e.to_string()))?;
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
    pub(super) fn after_failure(
        &mut self,
        direction: Direction,
        reason: impl Into<String>,
    ) -> CopyError {
        let reason = reason.into();
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
        &[],
    )
}

/// Launches a pair kernel whose first parameter is at `table` (the table's
/// address, or the table itself), then (len u64, per_copy u32, total_tiles
/// u32, tiles_per_warp u32, tile_shift u32): the tile walk every pair and
/// packed-copies kernel shares (`copy_each` in
/// `kernels/gather_scatter.cu`), then `extra` (at most two: the
/// packed-copies kernels' region and direction).
///
/// # Safety
/// As for [`launch_pairs`]; `table` points at the first parameter's value,
/// as large as `func` declares it, and `extra` at values of the types
/// `func` declares after the tile walk's.
pub(super) unsafe fn pair_launch(
    func: &CudaFunction,
    table: *mut c_void,
    len: u64,
    shape: &LaunchShape,
    stream: sys::CUstream,
    extra: &[*mut c_void],
) -> Result<(), result::DriverError> {
    let mut a_len: u64 = len;
    // ceil(len / tile_bytes) * nruns == total_tiles < 2^32 (pairs_shape).
    let mut a_per_copy: u32 = len.div_ceil(shape.tile_bytes) as u32;
    let mut a_total: u32 = shape.total_tiles;
    let mut a_tpw: u32 = shape.tiles_per_warp;
    let mut a_shift: u32 = shape.tile_shift();
    let mut params: [*mut c_void; 8] = [
        table,
        &mut a_len as *mut u64 as *mut c_void,
        &mut a_per_copy as *mut u32 as *mut c_void,
        &mut a_total as *mut u32 as *mut c_void,
        &mut a_tpw as *mut u32 as *mut c_void,
        &mut a_shift as *mut u32 as *mut c_void,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    ];
    assert!(
        extra.len() <= 2,
        "pair_launch takes at most two extra parameters"
    );
    let n = 6 + extra.len();
    params[6..n].copy_from_slice(extra);
    // The kernels' parameters are (table, u64, u32, u32, u32, u32, extra),
    // matching `params[..n]`; the rest is the caller's promise.
    launch_grid(func, shape, stream, &mut params[..n])
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
    pair_launch(func, table.as_ptr() as *mut c_void, len, shape, stream, &[])
}

/// Launches `func` (the packed-copies kernel for `addrs.len()` copies,
/// from [`CopyKernel::inline_packed_function`]) with `addrs` as its
/// parameter: copy i is `len` bytes between `addrs[i]` and `region + i *
/// len`, application -> region for a gather, the reverse for a scatter.
/// The driver copies the parameters into the launch, so nothing needs to
/// stay allocated for them. The grid is `shape`'s ([`pairs_shape`]).
///
/// # Safety
/// `func` must be the inline packed-copies kernel of the current context's
/// module whose parameter holds exactly `addrs.len()` addresses,
/// `shape.nruns` of them filled; every range they and the region side name
/// valid for the kernel to read (sources) or write (destinations) until it
/// ended.
pub(crate) unsafe fn launch_packed_inline(
    func: &CudaFunction,
    addrs: &[u64],
    region: u64,
    direction: Direction,
    len: u64,
    shape: &LaunchShape,
    stream: sys::CUstream,
) -> Result<(), result::DriverError> {
    debug_assert!(INLINE_PACKED.contains(&addrs.len()) && shape.nruns as usize <= addrs.len());
    let mut a_region: u64 = region;
    let mut a_gather: u32 = u32::from(direction == Direction::Gather);
    // The first parameter is InlineAddrs<N> itself, read from `addrs` (N
    // words, the caller's promise); the driver only reads the parameters.
    pair_launch(
        func,
        addrs.as_ptr() as *mut c_void,
        len,
        shape,
        stream,
        &[
            &mut a_region as *mut u64 as *mut c_void,
            &mut a_gather as *mut u32 as *mut c_void,
        ],
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
pub(super) unsafe fn launch_grid(
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
