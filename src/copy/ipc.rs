//! The peer-mapped copy: one kernel moves every descriptor of a transfer
//! straight between this process's device memory and a peer's, when the
//! peer runs on the same host and its allocation can be mapped into this
//! process with CUDA IPC. No arena, no control messages, and no kernel in
//! the peer's process (on one shared GPU that kernel would cost a GPU
//! context switch; see docs/design.md §3 "The peer-mapped path").
//!
//! The pieces, each owning one CUDA resource:
//! - [`export_allocation`]: what a registering process publishes for a VRAM
//!   region (the allocation's base, length, IPC handle and GPU).
//! - [`IpcMapping`]: a peer's allocation opened in this process (closed on
//!   drop, after every peer-mapped copy of the device has ended).
//! - [`IpcCopier`]: one device's streams and its copy kernel.
//! - [`IpcTable`]: a transfer's copy table (runs or pairs), built once when
//!   the request is prepared, uploaded or kept to be passed as the launch's
//!   parameter, so a post is one kernel launch.
//! - [`IpcLaunch`]: one posted copy, polled through its event.
//!
//! The kernel is the gather/scatter kernel of `kernels/gather_scatter.cu`:
//! a peer-mapped copy is a gather whose "region" is the whole address space
//! (every destination is an absolute address, already translated into the
//! mapping and checked against the peer's registration by the engine).

use std::ffi::c_void;
use std::io::Read;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaStream};

use super::cuda::{
    fill_table, launch_copy, launch_pairs, launch_pairs_inline, pairs_shape, pairs_table_bytes,
    table_parts, CopyKernel, CudaDevice, CudaError, CudaRuntime, LaunchShape, TableLayout,
    DEFAULT_TILE_BYTES, WARPS_PER_BLOCK,
};
use super::{Direction, RegionSpan};
use crate::proto::plan::RunBuilder;
use crate::proto::Run;
use crate::sync::Locked;

/// How long closing a mapping waits for this device's copies to end.
pub const QUIESCE_BOUND: Duration = Duration::from_secs(5);

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// Who this process is, as peers compare it: the host (the kernel's boot id,
/// shared by every process and container of one machine) and a random
/// token of this process (a PID can repeat across PID namespaces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub host: [u8; 16],
    pub process: [u8; 16],
}

/// This process's identity; `None` when the host cannot be identified (no
/// readable boot id), in which case nothing is exported or mapped. A child
/// forked from this process gets a token of its own at its first call: it
/// must not pass for its parent (whose memory is not its own).
pub fn identity() -> Option<Identity> {
    static ID: Mutex<Option<(u32, Option<Identity>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut known = ID.locked();
    if let Some((p, id)) = *known {
        if p == pid {
            return id;
        }
    }
    let id = (|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let mut host = parse_uuid(&text)?;
        let mut process = [0u8; 16];
        let mut urandom = std::fs::File::open("/dev/urandom").ok()?;
        urandom.read_exact(&mut process).ok()?;
        if crate::failpoint::Failpoints::from_env().is_set("another_host") {
            urandom.read_exact(&mut host).ok()?;
        }
        Some(Identity { host, process })
    })();
    *known = Some((pid, id));
    id
}

/// Parses a textual UUID (`8-4-4-4-12` hex digits, surrounding whitespace
/// allowed) into its 16 bytes.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 || text.trim().len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// Restores, when it ends, the CUDA context the thread had when it began:
/// the engine runs on the application's threads, whose current device it
/// must not change. Only made once the driver is loaded (after
/// [`CudaRuntime::probe`] succeeded).
struct ContextScope {
    previous: sys::CUcontext,
}

impl ContextScope {
    /// Remembers the thread's current context.
    fn save() -> Result<ContextScope, CudaError> {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: one out pointer.
        unsafe { sys::cuCtxGetCurrent(&mut previous) }
            .result()
            .map_err(|e| CudaError::call("cuCtxGetCurrent", e))?;
        Ok(ContextScope { previous })
    }

    /// Remembers the thread's current context and makes `device`'s current.
    fn enter(device: &CudaDevice) -> Result<ContextScope, CudaError> {
        let scope = Self::save()?;
        let ours = device.context().cu_ctx();
        if scope.previous != ours {
            // SAFETY: `ours` is the device's primary context, retained by
            // CudaDevice for the life of the process.
            unsafe { sys::cuCtxSetCurrent(ours) }
                .result()
                .map_err(|e| {
                    CudaError::call(
                        format!("making CUDA device {} current", device.ordinal()),
                        e,
                    )
                })?;
        }
        Ok(scope)
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: one out pointer; then `previous`, which was current on
        // this thread when the scope began (null, or a context the
        // application keeps alive).
        unsafe {
            if sys::cuCtxGetCurrent(&mut now).result().is_ok() && now != self.previous {
                let _ = sys::cuCtxSetCurrent(self.previous);
            }
        }
    }
}

/// The UUID of device `ordinal`.
fn device_uuid(ordinal: usize) -> Result<[u8; 16], CudaError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one CUdevice through a valid pointer.
    unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) }
        .result()
        .map_err(|e| CudaError::call(format!("cuDeviceGet({ordinal})"), e))?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: writes one CUuuid through a valid pointer.
    unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) }
        .result()
        .map_err(|e| CudaError::call(format!("cuDeviceGetUuid({ordinal})"), e))?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The ordinal of the local device with this UUID, if this process sees it.
pub fn device_with_uuid(cuda: &CudaRuntime, uuid: &[u8; 16]) -> Option<usize> {
    (0..cuda.device_count()).find(|&d| device_uuid(d).is_ok_and(|u| &u == uuid))
}

/// What a registering process publishes for device memory at `addr` on
/// device `ordinal`: the enclosing allocation (base, length), its IPC handle
/// and the GPU's UUID. Err when the memory cannot be shared this way (e.g.
/// it was not allocated with `cuMemAlloc`/`cudaMalloc`), or there is no
/// CUDA driver.
pub fn export_allocation(
    ordinal: usize,
    addr: u64,
) -> Result<(u64, u64, [u8; IPC_HANDLE_LEN], [u8; 16]), CudaError> {
    let cuda = CudaRuntime::probe()?;
    // Opening the device may make its context current: restore the
    // application's afterwards.
    let _saved = ContextScope::save()?;
    let device = cuda.device(ordinal)?;
    let _ctx = ContextScope::enter(&device)?;
    let (base, len) = allocation_of(addr)?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_LEN],
    };
    // SAFETY: one out pointer; `base` is the start of a live allocation (just
    // looked up).
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
        .result()
        .map_err(|e| CudaError::call(format!("cuIpcGetMemHandle({base:#x})"), e))?;
    Ok((
        base,
        len,
        handle.reserved.map(|b| b as u8),
        device_uuid(ordinal)?,
    ))
}

// ---------------------------------------------------------------------------
// The copier of one device
// ---------------------------------------------------------------------------

/// Streams of one device for peer-mapped copies, round-robin, and the
/// memory of tables (pinned host memory they are built in, device memory
/// they are uploaded to on their copies' stream), kept for the next ones
/// ([`TableCache`]).
pub struct IpcCopier {
    device: Arc<CudaDevice>,
    kernel: Arc<CopyKernel>,
    /// Dropped by hand, inside a [`ContextScope`]: cudarc's drop of a
    /// stream makes its context current and leaves it so.
    streams: ManuallyDrop<Vec<Arc<CudaStream>>>,
    /// Held while a copy is launched on stream i and noted by its mappings,
    /// so a mapping's "last copy on stream i" is really the last one.
    launching: Vec<Mutex<()>>,
    tables: Mutex<TableCache>,
    next: AtomicUsize,
    /// Completion events of launches, reused.
    events: Arc<EventPool>,
    /// Pair tables of at most this many copies are the launch's parameter
    /// (when the kernel has a variant that holds them); larger ones are
    /// uploaded.
    inline_limit: AtomicUsize,
    /// Inline tables' words, back from dropped tables (the driver copies a
    /// launch's parameter when the launch is queued, so they are free):
    /// a preparation reuses them instead of allocating and zeroing anew.
    inline_words: Mutex<Vec<Box<[u64]>>>,
}

/// How many inline tables' words [`IpcCopier`] keeps for reuse.
const KEPT_INLINE_WORDS: usize = 8;

// SAFETY: the cached tables are driver handles and memory usable from any
// thread (only under their mutex); everything else is Send + Sync already.
unsafe impl Send for IpcCopier {}
// SAFETY: as above.
unsafe impl Sync for IpcCopier {}

impl Drop for IpcCopier {
    fn drop(&mut self) {
        let Ok(_ctx) = ContextScope::enter(&self.device) else {
            return; // leaked: nothing can be released without the context
        };
        // Tables hold an Arc of this copier: every one came back to the
        // cache before this runs.
        self.tables
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .release_all();
        // SAFETY: dropped once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.streams) };
    }
}

impl std::fmt::Debug for IpcCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcCopier")
            .field("device", &self.device.ordinal())
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl IpcCopier {
    /// The copier of device `ordinal`: compiles the copy kernel (if not
    /// yet) and creates `streams` streams.
    pub fn for_device(ordinal: usize, streams: usize) -> Result<Arc<Self>, CudaError> {
        let cuda = CudaRuntime::probe()?;
        let _saved = ContextScope::save()?;
        let device = cuda.device(ordinal)?;
        let kernel = device.copy_kernel()?;
        let _ctx = ContextScope::enter(&device)?;
        let ctx = device.context();
        let make = || {
            ctx.new_stream()
                .map_err(|e| CudaError::call("cuStreamCreate", e))
        };
        let streams = (0..streams.max(1))
            .map(|_| make())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(IpcCopier {
            events: EventPool::new(device.clone()),
            device,
            kernel,
            launching: streams.iter().map(|_| Mutex::new(())).collect(),
            streams: ManuallyDrop::new(streams),
            tables: Mutex::new(TableCache::default()),
            next: AtomicUsize::new(0),
            inline_limit: AtomicUsize::new(usize::MAX),
            inline_words: Mutex::new(Vec::new()),
        }))
    }

    /// Pair tables of at most `n` copies are passed to the kernel as its
    /// parameter from now on (`peer_map_inline_table_max_descriptors`; the
    /// kernel's largest variant bounds it); 0: every table is uploaded.
    pub fn set_inline_limit(&self, n: usize) {
        self.inline_limit.store(n, Ordering::Relaxed);
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Builds and uploads the run table of `runs` (made by [`push_copy`]:
    /// a gather into address 0, so `addr` is each source and
    /// `region_offset` each destination). `started` is when the caller
    /// began building the runs (for the table-fill time).
    pub fn prepare(
        self: &Arc<Self>,
        runs: &[Run],
        started: Instant,
    ) -> Result<IpcTable, CudaError> {
        if runs.is_empty() {
            return Err(CudaError::Invalid("a peer-mapped copy of no bytes".into()));
        }
        let max_warps = self.max_warps();
        let layout = TableLayout::new(runs.len()).ok_or_else(|| {
            CudaError::Invalid(format!("{} runs overflow the run table", runs.len()))
        })?;
        let built = self.build(layout.capacity, started, |host| {
            // SAFETY: `host` holds `layout.capacity` bytes, 8-aligned, used by
            // nothing else while the fill runs (`build`'s promise).
            let (out_runs, out_tile_start, out_strides) =
                unsafe { table_parts(host.as_mut_ptr() as *mut u8, &layout) };
            let shape = fill_table(
                Direction::Gather,
                WHOLE_ADDRESS_SPACE,
                runs,
                DEFAULT_TILE_BYTES,
                max_warps,
                out_runs,
                out_tile_start,
                out_strides,
            )
            .map_err(|e| CudaError::Invalid(e.reason))?;
            Ok(Some((TableForm::Runs(layout), shape, shape.table_bytes())))
        })?;
        Ok(built.expect("a run table is never declined"))
    }

    /// Builds and uploads the pair table of `n` copies of `len` bytes each
    /// (see `pairs_shape`): `fill` writes copy i's (source, destination)
    /// into words 2i and 2i + 1 of the slice it is given (2n words), or
    /// returns `Ok(false)` to decline the table (nothing is uploaded: the
    /// caller takes another way) or an error. The transfers of real clients
    /// are of this shape (vLLM: every block the same size). Every address
    /// is the caller's to check.
    pub fn prepare_pairs(
        self: &Arc<Self>,
        n: usize,
        len: u64,
        started: Instant,
        fill: impl FnOnce(&mut [u64]) -> Result<bool, CudaError>,
    ) -> Result<Option<IpcTable>, CudaError> {
        let shape = pairs_shape(n, len, DEFAULT_TILE_BYTES, self.max_warps())?;
        let inline = (n <= self.inline_limit.load(Ordering::Relaxed))
            .then(|| self.kernel.inline_pairs_function(n))
            .flatten();
        if let Some((capacity, _)) = inline {
            // Small enough to be the launch's parameter: built in memory of
            // its own, no driver call.
            let mut words = self.take_inline_words(2 * capacity);
            match fill(&mut words[..2 * n]) {
                Ok(true) => {}
                other => {
                    self.keep_inline_words(words);
                    return other.map(|_| None);
                }
            }
            let fill = started.elapsed().as_nanos() as u64;
            return Ok(Some(IpcTable {
                copier: self.clone(),
                device_table: None,
                form: TableForm::InlinePairs { len, words },
                shape,
                stream: self.next_stream(),
                last_launch: None,
                times: TableTimes {
                    fill,
                    ..TableTimes::default()
                },
            }));
        }
        let bytes = pairs_table_bytes(n);
        self.build(bytes, started, |host| {
            Ok(fill(&mut host[..2 * n])?.then_some((TableForm::Pairs { len }, shape, bytes)))
        })
    }

    /// The stream the next table's copies run on (round robin).
    fn next_stream(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len()
    }

    /// The most warps one launch of the copy kernel runs.
    fn max_warps(&self) -> u32 {
        self.kernel.max_grid.saturating_mul(WARPS_PER_BLOCK)
    }

    /// Builds a table of at most `capacity` bytes with `fill` (given the
    /// buffer as 8-byte words; it returns the table's form, launch and the
    /// bytes it used, or `None` to decline) in the pinned host memory of a
    /// kept table, and uploads it to that table's device memory on the
    /// stream its copies will run on: the stream orders the copies after
    /// the upload, and nothing is waited for. A preparation makes two
    /// driver calls, the context check and the copy, and queries no event
    /// when the memory it reuses was last read by a copy already seen to
    /// end ([`TableCache`]).
    fn build(
        self: &Arc<Self>,
        capacity: usize,
        started: Instant,
        fill: impl FnOnce(&mut [u64]) -> Result<Option<(TableForm, LaunchShape, usize)>, CudaError>,
    ) -> Result<Option<IpcTable>, CudaError> {
        let _range = crate::nvtx::range(c"bounce peer-mapped prepare");
        let t0 = started;
        let _ctx = ContextScope::enter(&self.device)?;
        let t_ctx = Instant::now();
        let table = self.tables.locked().take(capacity)?;
        let t_setup = Instant::now();
        // Pinned memory of the table's own, else (none to be had) a
        // pageable buffer of this call's, which the driver stages before
        // the upload call returns.
        let words = capacity.div_ceil(8);
        let pinned = !table.host.is_null();
        let mut pageable = Vec::new();
        let host: &mut [u64] = if pinned {
            // SAFETY: the table's pinned memory holds `table.bytes >=
            // capacity` bytes, 8-aligned, and nothing reads it: the cache
            // hands a table out only once its last upload and copies ended.
            unsafe { std::slice::from_raw_parts_mut(table.host, words) }
        } else {
            pageable = vec![0u64; words];
            &mut pageable
        };
        let (form, shape, used) = match fill(host) {
            Ok(Some(f)) => f,
            other => {
                // Declined or failed: nothing was queued, the memory is free.
                self.keep_table(table);
                return other.map(|_| None);
            }
        };
        let t1 = Instant::now();
        // SAFETY: `host` holds at least `used` initialised bytes (`fill`'s
        // promise; it is `capacity` bytes, zeroed when allocated).
        let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, used) };
        // Every launch of this table goes to one stream, and so does its
        // upload and its return to the cache: each is ordered after the one
        // before.
        let on = self.next_stream();
        let stream = &self.streams[on];
        // SAFETY: the table's device memory holds `used` bytes, and the
        // upload is queued on the stream the table's launches go to, so
        // every launch reads the finished table. Pinned `bytes` stay
        // unchanged until the upload completed: they go back to the cache
        // only behind everything queued on this stream (`IpcTable`'s drop).
        // A pageable buffer is staged by the driver before the call
        // returns (CUDA's rule for pageable sources), so it may be dropped
        // then. (A synchronous cuMemcpyHtoD from pageable memory may also
        // return before its DMA ends, and the copy streams are not ordered
        // after it: the table's own stream is what orders the launch.)
        let copied = unsafe { result::memcpy_htod_async(table.ptr, bytes, stream.cu_stream()) }
            .map_err(|e| CudaError::call("uploading a peer-copy table (cuMemcpyHtoDAsync)", e));
        let t2 = Instant::now();
        if let Err(e) = copied {
            // The upload may have been queued: the memory goes back behind
            // the stream, never waited for here.
            self.keep_table_behind(table, on);
            return Err(e);
        }
        drop(pageable);
        Ok(Some(IpcTable {
            copier: self.clone(),
            device_table: Some(table),
            form,
            shape,
            stream: on,
            last_launch: None,
            times: TableTimes::from_marks(t0, t_ctx, t_setup, t1, t2, Instant::now()),
        }))
    }
}

/// The "region" of a peer-mapped copy: every address is absolute.
const WHOLE_ADDRESS_SPACE: RegionSpan = RegionSpan {
    addr: 0,
    len: usize::MAX,
};

/// One copy of a peer-mapped transfer: absolute addresses in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcCopy {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// Appends copy `c` to `runs` as the kernel's runs: a gather into address
/// 0, so `addr` is the source and `region_offset` the destination, merged
/// with the planner's rule ([`RunBuilder`]: contiguous on both sides, or a
/// uniform stride on both). Empty copies are skipped.
pub fn push_copy(runs: &mut RunBuilder, c: IpcCopy) {
    if c.len > 0 {
        runs.add(c.dst, c.src, c.len);
    }
}

/// `copies` as runs (see [`push_copy`]).
#[cfg(test)]
fn merge(copies: &[IpcCopy]) -> Vec<Run> {
    let mut runs = RunBuilder::new(Vec::with_capacity(copies.len()));
    for &c in copies {
        push_copy(&mut runs, c);
    }
    runs.take()
}

// ---------------------------------------------------------------------------
// A prepared table and its launches
// ---------------------------------------------------------------------------

/// Host time a table took, in nanoseconds: `fill` from the start of the
/// preparation to the table written (of it, `setup`: the device's context
/// and the table's memory, of that `alloc`: taking the memory from the
/// cache), `upload` from then to the upload queued (of it `copy`, the copy
/// call; `order` is what follows it, nothing since the upload runs on the
/// copies' own stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableTimes {
    pub fill: u64,
    pub setup: u64,
    pub upload: u64,
    pub alloc: u64,
    pub copy: u64,
    pub order: u64,
}

impl TableTimes {
    fn from_marks(
        start: Instant,
        context: Instant,
        setup: Instant,
        filled: Instant,
        copied: Instant,
        end: Instant,
    ) -> Self {
        let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as u64;
        TableTimes {
            fill: ns(start, filled),
            setup: ns(start, setup),
            upload: ns(filled, end),
            alloc: ns(context, setup),
            copy: ns(filled, copied),
            order: ns(copied, end),
        }
    }
}

/// What a table holds: runs (`fill_table`), or (source, destination)
/// pairs of copies of one length (`pairs_shape`), uploaded or passed to
/// the kernel as its parameter.
#[derive(Debug)]
enum TableForm {
    Runs(TableLayout),
    Pairs {
        len: u64,
    },
    /// The whole parameter of the inline pair kernel for `words.len() / 2`
    /// copies (`INLINE_PAIRS`), the first `shape.nruns` pairs filled.
    InlinePairs {
        len: u64,
        words: Box<[u64]>,
    },
}

/// A transfer's table, uploaded or (a small pair table) kept to be the
/// launch's parameter. Its upload and copies all run on one stream of the
/// copier; on drop an uploaded table's memory (pinned and device) goes
/// back to the copier's [`TableCache`], reused only after its upload and
/// every copy launched from it ended.
pub struct IpcTable {
    copier: Arc<IpcCopier>,
    /// Taken back by the cache on drop.
    device_table: Option<CachedTable>,
    form: TableForm,
    shape: LaunchShape,
    stream: usize,
    /// The last launch of the table: when it was seen to end, the table's
    /// memory is free as soon as the table is dropped.
    last_launch: Option<Arc<IpcLaunch>>,
    /// Where the preparation's host time went.
    pub times: TableTimes,
}

impl std::fmt::Debug for IpcTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcTable")
            .field("runs", &self.shape.nruns)
            .field("bytes", &self.shape.total_bytes)
            .finish()
    }
}

impl IpcTable {
    /// Bytes one launch moves.
    pub fn bytes(&self) -> u64 {
        self.shape.total_bytes
    }

    /// The table is the launch's parameter (nothing was uploaded).
    pub fn inline(&self) -> bool {
        matches!(self.form, TableForm::InlinePairs { .. })
    }

    /// Uploads a table that was the launch's parameter, so that its later
    /// launches pass a pointer instead of up to 32 KiB (design.md §3, "Small
    /// tables ride in the launch"). `Ok(true)`: uploaded; `Ok(false)`: it
    /// was not inline. On an error (no device memory for the table, a
    /// failed upload) it stays inline and usable. Call it only between
    /// launches: the engine reposts a transfer only once its copy ended.
    pub fn upload(&mut self) -> Result<bool, CudaError> {
        let TableForm::InlinePairs { len, words } = &self.form else {
            return Ok(false);
        };
        let (len, shape) = (*len, self.shape);
        let n = shape.nruns as usize;
        let bytes = pairs_table_bytes(n);
        let uploaded = self.copier.build(bytes, Instant::now(), |host| {
            // Only the table's own pairs: the words past them are a kept
            // buffer's leftovers (`take_inline_words`).
            host[..2 * n].copy_from_slice(&words[..2 * n]);
            Ok(Some((TableForm::Pairs { len }, shape, bytes)))
        })?;
        let Some(mut uploaded) = uploaded else {
            return Ok(false);
        };
        // The preparation's breakdown stays the preparation's.
        uploaded.times = self.times;
        // The inline table goes (its words back to the copier): nothing
        // reads it, since it was only ever a launch's parameter.
        drop(std::mem::replace(self, uploaded));
        Ok(true)
    }

    /// Launches the copy on the table's stream, records an event after it
    /// and notes it in every mapping its addresses point into (`mappings`),
    /// all under the stream's launch lock, so that each mapping's last copy
    /// on that stream is the one queued last. (The engine refuses to repost
    /// a request whose copy still runs; were it not to, the copies would
    /// only queue on the stream.) On an error nothing runs any more.
    pub fn launch(&mut self, mappings: &[Arc<IpcMapping>]) -> Result<Arc<IpcLaunch>, CudaError> {
        let _range = crate::nvtx::range(c"bounce peer-mapped launch");
        let c = &self.copier;
        let i = self.stream;
        let stream = &c.streams[i];
        let _ctx = ContextScope::enter(&c.device)?;
        let event = c.events.take()?;
        let ptr = self.device_table.as_ref().map_or(0, |t| t.ptr);
        // Until this launch is tracked, no earlier one vouches for the
        // table: on any failure below its drop waits behind the stream.
        self.last_launch = None;
        let _launching = c.launching[i].locked();
        // SAFETY: this device's copy kernel (of the table's form) over the
        // table uploaded in `build` (on this stream, before), reused
        // only after this launch ended (the event its drop records), or over
        // the table passed as the parameter (copied by the launch). Every
        // address in it was checked by the engine: sources and destinations
        // lie in memory registered here or in the peer's registered memory,
        // translated into mappings that stay open until the copies through
        // them ended (noted below).
        let launched = unsafe {
            match &self.form {
                TableForm::Runs(layout) => launch_copy(
                    c.kernel.function(),
                    ptr,
                    layout,
                    &self.shape,
                    stream.cu_stream(),
                ),
                TableForm::Pairs { len } => launch_pairs(
                    c.kernel.pairs_function(),
                    ptr,
                    *len,
                    &self.shape,
                    stream.cu_stream(),
                ),
                TableForm::InlinePairs { len, words } => {
                    // The variant whose parameter is exactly `words` (it
                    // was sized from this look-up when prepared).
                    match c.kernel.inline_pairs_function(words.len() / 2) {
                        Some((cap, func)) if 2 * cap == words.len() => {
                            launch_pairs_inline(func, words, *len, &self.shape, stream.cu_stream())
                        }
                        _ => Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_FOUND)),
                    }
                }
            }
        };
        if let Err(e) = launched {
            c.events.put(event);
            return Err(CudaError::call(
                format!(
                    "launching the peer-mapped copy ({} runs, {} blocks)",
                    self.shape.nruns, self.shape.grid
                ),
                e,
            ));
        }
        // SAFETY: an event of this context (the pool's) and a live stream of it.
        if let Err(e) = unsafe { sys::cuEventRecord(event, stream.cu_stream()) }.result() {
            // The copy runs untracked: wait for it before reporting; when
            // even that fails, its mappings are never closed (fail closed).
            let waited = stream.synchronize();
            if waited.is_err() {
                for m in mappings {
                    std::mem::forget(m.clone());
                }
            }
            c.events.put(event);
            return Err(CudaError::call(
                "cuEventRecord after the peer-mapped copy",
                format!("{e} (waiting for the copy: {waited:?})"),
            ));
        }
        let launch = Arc::new(IpcLaunch {
            event,
            events: c.events.clone(),
            device: c.device.clone(),
            stream: i,
            posted: Instant::now(),
            cancelled: AtomicBool::new(false),
            failure: Mutex::new(None),
            ended: AtomicBool::new(false),
        });
        for m in mappings {
            m.note(&launch);
        }
        self.last_launch = Some(launch.clone());
        Ok(launch)
    }
}

impl Drop for IpcTable {
    fn drop(&mut self) {
        let c = &self.copier;
        if let TableForm::InlinePairs { words, .. } = &mut self.form {
            c.keep_inline_words(std::mem::take(words));
        }
        let Some(mut t) = self.device_table.take() else {
            return;
        };
        // Launched last by a copy seen to end: its upload and every copy
        // that read it ended (one stream, in order), and it is free now.
        if self
            .last_launch
            .as_ref()
            .is_some_and(|l| l.ended.load(Ordering::Acquire))
        {
            t.queued = false;
            c.keep_table(t);
            return;
        }
        let Ok(_ctx) = ContextScope::enter(&c.device) else {
            tracing::warn!("cannot bind the CUDA context to return a peer-copy table; leaked");
            return;
        };
        c.keep_table_behind(t, self.stream);
    }
}

impl IpcCopier {
    /// Words for an inline table: kept ones of that length (holding an
    /// earlier table's pairs, which the kernel does not read beyond the
    /// table's own), else new ones.
    fn take_inline_words(&self, len: usize) -> Box<[u64]> {
        let mut kept = self.inline_words.locked();
        match kept.iter().position(|w| w.len() == len) {
            Some(i) => kept.remove(i),
            None => vec![0u64; len].into_boxed_slice(),
        }
    }

    fn keep_inline_words(&self, words: Box<[u64]>) {
        let mut kept = self.inline_words.locked();
        // Full: the oldest goes, so that the sizes in use stay.
        if kept.len() == KEPT_INLINE_WORDS {
            kept.remove(0);
        }
        kept.push(words);
    }

    /// Puts a table's memory back in the cache (`t.queued` says whether
    /// its event must be queried before reuse).
    fn keep_table(&self, t: CachedTable) {
        self.tables.locked().free.push(t);
    }

    /// Puts a table's memory back in the cache behind everything queued on
    /// stream `on` so far (its upload, every launch that reads it): its
    /// event, recorded there, says when it is free. Memory whose last use
    /// cannot be waited for is never reused (fail closed). Needs the
    /// device's context current.
    fn keep_table_behind(&self, mut t: CachedTable, on: usize) {
        // SAFETY: the table's own event and a live stream of this context.
        match unsafe { sys::cuEventRecord(t.event, self.streams[on].cu_stream()) }.result() {
            Ok(()) => {
                t.queued = true;
                self.keep_table(t);
            }
            Err(e) => tracing::warn!("returning a peer-copy table: {e}; leaked"),
        }
    }
}

/// The memory of peer-copy tables, kept for reuse instead of being freed:
/// a table's memory comes back when the table is dropped, free at once when
/// its last launch was seen to end, else with an event recorded on the
/// table's stream behind its upload and every launch that reads it, and is
/// handed out again only once that event completed (a query: nothing
/// waits, and no stream waits for another). Allocating afresh, or from a
/// stream-ordered pool, cost tens of microseconds per preparation, and
/// every driver call a preparation makes costs microseconds inside an
/// inference process (docs/benchmarks.md, "Figures behind the code"). It
/// holds at most as many tables as
/// were ever live or still being read at once; all are freed with the
/// copier.
#[derive(Default)]
struct TableCache {
    free: Vec<CachedTable>,
}

/// The memory of one table: pinned host memory it is built in (null when
/// none was to be had), device memory as large it is uploaded to, and the
/// event of its last use.
struct CachedTable {
    ptr: sys::CUdeviceptr,
    host: *mut u64,
    bytes: usize,
    event: sys::CUevent,
    /// The event was recorded (after the last use) and may not have
    /// completed; false: nothing reads the memory.
    queued: bool,
}

impl TableCache {
    /// Memory for a table of `bytes`: the smallest kept table that is large
    /// enough and no longer read, else a new allocation (a power of two, at
    /// least 64 KiB). Needs the device's context current.
    fn take(&mut self, bytes: usize) -> Result<CachedTable, CudaError> {
        // Smallest first; a table known free needs no query, the others one
        // each, stopping at the first whose last use ended.
        let mut fitting: Vec<usize> = (0..self.free.len())
            .filter(|&i| self.free[i].bytes >= bytes)
            .collect();
        fitting.sort_by_key(|&i| (self.free[i].queued, self.free[i].bytes));
        for i in fitting {
            if self.free[i].queued {
                // SAFETY: the table's own event.
                match unsafe { sys::cuEventQuery(self.free[i].event) } {
                    sys::CUresult::CUDA_SUCCESS => {}
                    sys::CUresult::CUDA_ERROR_NOT_READY => continue,
                    e => {
                        return Err(CudaError::call(
                            "cuEventQuery on a peer-copy table",
                            format!("{e:?}"),
                        ))
                    }
                }
            }
            let mut t = self.free.swap_remove(i);
            t.queued = false;
            if t.host.is_null() {
                // Pinned memory was not to be had when it was allocated.
                t.host = pinned_zeroed(t.bytes);
            }
            return Ok(t);
        }
        let want = bytes.next_power_of_two().max(64 << 10);
        let event = new_event("a peer-copy table")?;
        // SAFETY: a plain device allocation; released on failure below.
        let ptr = match unsafe { result::malloc_sync(want) } {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: created above, never recorded.
                let _ = unsafe { sys::cuEventDestroy_v2(event) };
                return Err(CudaError::call(
                    format!("cuMemAlloc({want} bytes) for a peer-copy table"),
                    e,
                ));
            }
        };
        Ok(CachedTable {
            ptr,
            host: pinned_zeroed(want),
            bytes: want,
            event,
            queued: false,
        })
    }

    /// Frees every kept table once its last use ended (a table whose end
    /// cannot be waited for is leaked). Needs the device's context current.
    fn release_all(&mut self) {
        for t in self.free.drain(..) {
            // SAFETY: the table's own event, recorded after its last use (or
            // never recorded, when `queued` is false).
            let ended = !t.queued || unsafe { sys::cuEventSynchronize(t.event) }.result().is_ok();
            if ended {
                // SAFETY: nothing reads the memory any more; `host` came
                // from cuMemHostAlloc (or is null).
                unsafe {
                    let _ = result::free_sync(t.ptr);
                    if !t.host.is_null() {
                        let _ = result::free_host(t.host as *mut c_void);
                    }
                }
            }
            // SAFETY: nothing records or waits on the event any more.
            let _ = unsafe { sys::cuEventDestroy_v2(t.event) };
        }
    }
}

/// `bytes` of zeroed pinned host memory, or null when none is to be had.
/// Needs a context current.
fn pinned_zeroed(bytes: usize) -> *mut u64 {
    // SAFETY: a plain pinned allocation; the pointer is checked below.
    match unsafe { result::malloc_host(bytes, 0) } {
        Ok(p) if !p.is_null() => {
            // SAFETY: `bytes` writable bytes just allocated.
            unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
            p as *mut u64
        }
        _ => std::ptr::null_mut(),
    }
}

/// One launched peer-mapped copy. Shared by the request (which polls it)
/// and the notifier (which sends the transfer's notification once it ended).
#[derive(Debug)]
pub struct IpcLaunch {
    /// Recorded after the kernel; back to `events` on drop.
    event: sys::CUevent,
    events: Arc<EventPool>,
    device: Arc<CudaDevice>,
    /// The copier stream it runs on.
    stream: usize,
    posted: Instant,
    /// The request was released before its copy ended: send no notification.
    pub cancelled: AtomicBool,
    failure: Mutex<Option<CudaError>>,
    /// The kernel was seen to end (no query needed any more).
    ended: AtomicBool,
}

// SAFETY: the event is a driver handle usable from any thread; nothing
// else in a launch is thread-bound.
unsafe impl Send for IpcLaunch {}
// SAFETY: as above; the event is only queried (and recorded before the
// launch is shared).
unsafe impl Sync for IpcLaunch {}

impl Drop for IpcLaunch {
    fn drop(&mut self) {
        // Recorded again by a later launch: nothing tracks this one's
        // kernel any more (mappings keep their launches until they ended).
        self.events.put(self.event);
    }
}

/// A plain event without timing, for `what`. Needs a context current.
fn new_event(what: &str) -> Result<sys::CUevent, CudaError> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: one out pointer; a plain event without timing.
    unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    }
    .result()
    .map_err(|e| CudaError::call(format!("cuEventCreate for {what}"), e))?;
    Ok(event)
}

/// Completion events of a copier's launches, kept for the next ones (an
/// event created and destroyed per post were two more driver calls).
#[derive(Debug)]
pub(crate) struct EventPool {
    device: Arc<CudaDevice>,
    free: Mutex<Vec<sys::CUevent>>,
}

// SAFETY: raw event handles, usable from any thread; the free ones are
// touched only under the mutex, a taken one only by its launch.
unsafe impl Send for EventPool {}
// SAFETY: as above.
unsafe impl Sync for EventPool {}

impl EventPool {
    fn new(device: Arc<CudaDevice>) -> Arc<Self> {
        Arc::new(EventPool {
            device,
            free: Mutex::new(Vec::new()),
        })
    }

    /// A free event, or a new one. Needs the device's context current.
    fn take(&self) -> Result<sys::CUevent, CudaError> {
        if let Some(e) = self.free.locked().pop() {
            return Ok(e);
        }
        new_event("a peer-mapped copy")
    }

    fn put(&self, event: sys::CUevent) {
        self.free.locked().push(event);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let Ok(_ctx) = ContextScope::enter(&self.device) else {
            return; // leaked: they cannot be destroyed without the context
        };
        for e in self
            .free
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            // SAFETY: our event; every launch that used it is gone.
            let _ = unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

impl IpcLaunch {
    /// Fails the copy if it still runs `limit` after its launch: it cannot
    /// be stopped, but its request ends (and sends no notification).
    pub fn expire(&self, limit: Duration) {
        if self.posted.elapsed() > limit && self.poll().is_none() {
            self.cancelled.store(true, Ordering::SeqCst);
            self.failure.locked().get_or_insert_with(|| {
                CudaError::Timeout(format!(
                    "the peer-mapped copy still runs {limit:?} after its launch"
                ))
            });
        }
    }

    /// `None` while the request is open, then its result (never blocks).
    /// A request failed by [`expire`](Self::expire) has a result while its
    /// copy may still run: see [`running`](Self::running).
    pub fn poll(&self) -> Option<Result<(), CudaError>> {
        let mut failure = self.failure.locked();
        if let Some(f) = failure.as_ref() {
            return Some(Err(f.clone()));
        }
        match self.query() {
            Ok(false) => None,
            Ok(true) => Some(Ok(())),
            Err(e) => {
                let f = CudaError::call("the peer-mapped copy failed", e);
                *failure = Some(f.clone());
                Some(Err(f))
            }
        }
    }

    /// Whether the kernel may still be running (whatever the request's
    /// outcome): an error from the event counts as ended.
    pub fn running(&self) -> bool {
        matches!(self.query(), Ok(false))
    }

    fn query(&self) -> Result<bool, CudaError> {
        if self.ended.load(Ordering::Acquire) {
            return Ok(true);
        }
        let _ctx = ContextScope::enter(&self.device)?;
        // SAFETY: this launch's event (recorded after its kernel).
        let ended = match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => true,
            sys::CUresult::CUDA_ERROR_NOT_READY => false,
            e => return Err(CudaError::call("cuEventQuery", format!("{e:?}"))),
        };
        if ended {
            self.ended.store(true, Ordering::Release);
        }
        Ok(ended)
    }

    /// The copier stream the copy runs on.
    pub fn stream(&self) -> usize {
        self.stream
    }
}

// ---------------------------------------------------------------------------
// Mappings of a peer's allocations
// ---------------------------------------------------------------------------

/// The allocation holding `addr` in the current context: (base, length).
fn allocation_of(addr: u64) -> Result<(u64, u64), CudaError> {
    let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: two out pointers; the driver only reads `addr` as a number.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr) }
        .result()
        .map_err(|e| CudaError::call(format!("cuMemGetAddressRange({addr:#x})"), e))?;
    Ok((base, len as u64))
}

/// Whether GPU `local` can address GPU `owner`'s memory (NVLink or PCIe
/// peer access); an error saying which pair cannot.
fn check_peer_access(local: usize, owner: usize) -> Result<(), CudaError> {
    let (mut a, mut b): (sys::CUdevice, sys::CUdevice) = (0, 0);
    let mut can: std::ffi::c_int = 0;
    // SAFETY: out pointers for plain integers.
    let probed = unsafe {
        sys::cuDeviceGet(&mut a, local as i32)
            .result()
            .and_then(|_| sys::cuDeviceGet(&mut b, owner as i32).result())
            .and_then(|_| sys::cuDeviceCanAccessPeer(&mut can, a, b).result())
    };
    probed.map_err(|e| CudaError::call(format!("cuDeviceCanAccessPeer({local}, {owner})"), e))?;
    if can == 0 {
        return Err(CudaError::Unavailable(format!(
            "GPU {local} cannot access GPU {owner}'s memory"
        )));
    }
    Ok(())
}

/// Gives the current context (GPU `local`'s primary context) access to
/// `owner`'s primary context, where this process's memory on that GPU
/// lives. Already enabled (by an earlier mapping, or by the application) is
/// success.
fn enable_peer_access(owner: &CudaDevice, local: usize) -> Result<(), CudaError> {
    // SAFETY: the owner's primary context is retained by CudaDevice for the
    // life of the process; the call only changes the current context's
    // peer table.
    match unsafe { sys::cuCtxEnablePeerAccess(owner.context().cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => Err(CudaError::call(
            format!(
                "cuCtxEnablePeerAccess(GPU {local} -> GPU {})",
                owner.ordinal()
            ),
            format!("{e:?}"),
        )),
    }
}

/// A peer's allocation as this process addresses it.
pub struct IpcMapping {
    copier: Arc<IpcCopier>,
    /// This process's address of the allocation's base.
    base: u64,
    len: u64,
    /// Opened with cuIpcOpenMemHandle (closed on drop); false for memory of
    /// this very process, used at its own address.
    opened: bool,
    /// The last copy launched through this mapping on each copier stream
    /// (copies on one stream end in order): what closing it waits for.
    last: Mutex<Vec<Option<Arc<IpcLaunch>>>>,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("opened", &self.opened)
            .finish()
    }
}

impl IpcMapping {
    /// Maps a peer's allocation for copies launched by `copier`.
    ///
    /// `same_process`: the exporter is this process (two agents in one
    /// process); its memory is used at its own address. When it lives on
    /// another GPU, the copier's context is given peer access to that GPU's
    /// primary context (a lasting setting of the context, as torch's peer
    /// copies make it). Otherwise the IPC handle is opened in the copier's
    /// device context, with peer access enabled lazily when the allocation
    /// lives on another GPU. Either is refused when the two GPUs cannot
    /// reach each other.
    pub fn open(
        copier: &Arc<IpcCopier>,
        device_uuid: &[u8; 16],
        alloc_base: u64,
        alloc_len: u64,
        ipc_handle: &[u8; IPC_HANDLE_LEN],
        same_process: bool,
    ) -> Result<IpcMapping, CudaError> {
        let local = copier.device.ordinal();
        let cuda = CudaRuntime::probe()?;
        let owner = device_with_uuid(&cuda, device_uuid).ok_or_else(|| {
            CudaError::Unavailable("the peer's GPU is not visible to this process".into())
        })?;
        let mapping = |base: u64, opened: bool| IpcMapping {
            copier: copier.clone(),
            base,
            len: alloc_len,
            opened,
            last: Mutex::new(vec![None; copier.streams.len()]),
        };
        // Opened before entering the copier's context: opening a device
        // makes its context current.
        let owner_here = match same_process && owner != local {
            true => Some(cuda.device(owner)?),
            false => None,
        };
        let _ctx = ContextScope::enter(&copier.device)?;
        if owner != local {
            check_peer_access(local, owner)?;
        }
        if same_process {
            if let Some(owner_dev) = &owner_here {
                enable_peer_access(owner_dev, local)?;
            }
            // The claim is checked, not trusted: an allocation of this
            // process must start there and be that long.
            let (base, len) = allocation_of(alloc_base)?;
            if base != alloc_base || len < alloc_len {
                return Err(CudaError::Invalid(format!(
                    "no allocation of {alloc_len} bytes at {alloc_base:#x} in this process"
                )));
            }
            return Ok(mapping(alloc_base, false));
        }
        let handle = sys::CUipcMemHandle {
            reserved: ipc_handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: one out pointer; the handle is plain bytes the driver
        // validates (a forged or stale handle is an error, not UB).
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| CudaError::call("cuIpcOpenMemHandle", e))?;
        let opened = mapping(ptr, true);
        // The length is the peer's word; what the driver mapped decides.
        match allocation_of(ptr) {
            Ok((base, len)) if base == ptr && len >= alloc_len => Ok(opened),
            Ok((_, len)) => Err(CudaError::Invalid(format!(
                "the peer exported {alloc_len} bytes, but its handle maps {len}"
            ))),
            Err(e) => Err(e),
        }
    }

    /// Remembers `launch` as the last copy through this mapping on its
    /// stream (call after each launch that uses it).
    pub fn note(&self, launch: &Arc<IpcLaunch>) {
        let mut last = self.last.locked();
        if let Some(slot) = last.get_mut(launch.stream()) {
            *slot = Some(launch.clone());
        }
    }

    /// This process's address of bytes `[offset, offset + len)` of the
    /// allocation, if they lie inside it.
    /// This process's address of the allocation's base.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn address(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.base + offset)
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if !self.opened {
            return;
        }
        // No copy may still use the mapping when it is closed: wait (a
        // bounded time) for the last copy through it on each stream; when
        // that cannot be shown, the mapping is leaked (fail closed).
        let t0 = Instant::now();
        let last = std::mem::take(self.last.get_mut().unwrap_or_else(|p| p.into_inner()));
        for launch in last.iter().flatten() {
            while launch.running() {
                if t0.elapsed() > QUIESCE_BOUND {
                    tracing::error!(
                        "peer mapping left open, leaked: a copy through it still runs after {QUIESCE_BOUND:?}"
                    );
                    return;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if let Ok(_ctx) = ContextScope::enter(&self.copier.device) {
            // SAFETY: `base` came from cuIpcOpenMemHandle and no copy uses it.
            if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result() {
                tracing::warn!("cuIpcCloseMemHandle: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::cuda::{DevRun, DevStrides};

    /// The table `prepare` builds of `runs`, on the host.
    fn filled(runs: &[Run]) -> (LaunchShape, Vec<DevRun>, Vec<DevStrides>) {
        let n = runs.len();
        let mut out_runs = vec![DevRun::default(); n];
        let mut starts = vec![0u32; n + 1];
        let mut strides = vec![[0u64; 2]; n];
        let shape = fill_table(
            Direction::Gather,
            WHOLE_ADDRESS_SPACE,
            runs,
            DEFAULT_TILE_BYTES,
            1 << 20,
            &mut out_runs,
            &mut starts,
            &mut strides,
        )
        .unwrap();
        (shape, out_runs, strides)
    }

    #[test]
    fn uuids_parse_strictly() {
        let u = parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
        assert_eq!(u[0], 0x0f);
        assert_eq!(u[15], 0xf0);
        assert!(parse_uuid("0f1e2d3c4b5a69788796a5b4c3d2e1f0").is_none());
        assert!(parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fz").is_none());
        assert!(parse_uuid("").is_none());
    }

    #[test]
    fn identity_is_stable_and_names_this_host() {
        // Linux always has a boot id; the token is random but fixed per process.
        let a = identity().expect("boot id readable");
        assert_eq!(identity(), Some(a));
        assert_ne!(a.process, [0; 16]);
    }

    #[test]
    fn merge_joins_only_copies_that_continue_on_both_sides() {
        let c = |src, dst, len| IpcCopy { src, dst, len };
        let runs = merge(&[
            c(0, 1000, 10),
            c(10, 1010, 5),  // continues both: merged
            c(15, 2000, 5),  // source continues, destination jumps
            c(20, 2005, 5),  // continues the last
            c(100, 2010, 0), // empty: skipped
            c(50, 2010, 5),  // destination continues, source jumps
        ]);
        let got: Vec<(u64, u64, u64)> = runs
            .iter()
            .map(|r| (r.addr, r.region_offset, r.len))
            .collect();
        assert_eq!(got, vec![(0, 1000, 15), (15, 2000, 10), (50, 2010, 5)]);
        assert!(runs.iter().all(|r| r.count == 1));
    }

    #[test]
    fn uniformly_strided_copies_become_one_strided_run() {
        // Blocks every 8 KiB on the source, every 12 KiB on the destination.
        let copies: Vec<IpcCopy> = (0..64)
            .map(|i| IpcCopy {
                src: 0x1000_0000 + i * 8192,
                dst: 0x9000_0000 + i * 12288,
                len: 4096,
            })
            .collect();
        let runs = merge(&copies);
        assert_eq!(runs.len(), 1);
        let r = runs[0];
        assert_eq!(
            (r.addr, r.region_offset, r.len, r.count),
            (0x1000_0000, 0x9000_0000, 4096, 64)
        );
        assert_eq!((r.addr_stride, r.region_stride), (8192, 12288));
        let (shape, out_runs, strides) = filled(&runs);
        assert_eq!(shape.total_bytes, 64 * 4096);
        assert_eq!((shape.nstrided, shape.total_tiles), (1, 64));
        assert_eq!(
            (out_runs[0].src, out_runs[0].dst),
            (0x1000_0000, 0x9000_0000)
        );
        assert_eq!(strides[0], [8192, 12288]);
    }

    #[test]
    fn a_merged_table_fills_with_absolute_destinations() {
        let copies: Vec<IpcCopy> = (0..64)
            .map(|i| IpcCopy {
                src: 0x1000_0000 + i * 8192,
                dst: 0x9000_0000 + (63 - i) * 4096,
                len: 4096,
            })
            .collect();
        let runs = merge(&copies);
        let (shape, out_runs, _) = filled(&runs);
        assert_eq!(shape.total_bytes, 64 * 4096);
        for (r, c) in out_runs.iter().zip(&copies) {
            assert_eq!((r.src, r.dst, r.len), (c.src, c.dst, c.len));
        }
    }
}
