//! The peer-mapped path in the engine: which VRAM regions are exported for
//! mapping, which remote regions can be mapped, and the routing rule that
//! sends a transfer through one kernel instead of the bounce arena.
//!
//! A transfer takes this path when both engines run on one host (same boot
//! id), every descriptor is VRAM on both sides, the local descriptors lie on
//! one GPU, every remote descriptor lies in an allocation the peer exported
//! and this process could map, and the routing gates of the bounce path
//! (descriptor count, average size) pass. Anything else takes the bounce
//! path or UCX, exactly as before. See docs/design.md §3.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use nixl_sys::Agent;

use super::bounce::{peer_map_gate, Fallback};
use super::conn_info::IpcExport;
use super::{Descs, MemKind, Op, Range, RawDesc, Shape};
use crate::config::Config;
use crate::copy::cuda::CudaError;
use crate::copy::ipc::{self, Identity, IpcCopier, IpcCopy, IpcLaunch, IpcMapping};
use crate::proto::plan::RunBuilder;
use crate::sync::Locked;

/// Streams per device for peer-mapped copies.
const STREAMS_PER_DEVICE: usize = 4;

/// GPU ordinals a process's peer-mapped copies can use (a copier each);
/// a transfer on a GPU numbered beyond them takes another path
/// (`peer_map_unavailable`).
const MAX_GPUS: usize = 64;

/// The fewest descriptors whose table is filled in parts on several threads
/// (`peer_map_prepare_threads`) while the workers sleep: a walk long enough
/// for workers woken at its start to join it (the walk's and the wake-up's
/// costs: docs/benchmarks.md, "Figures behind the code").
const PARALLEL_FILL_MIN_DESCRIPTORS: usize = 16_384;

/// The same while they are awake ([`FillPool::warm`]).
pub const WARM_PARALLEL_FILL_MIN_DESCRIPTORS: usize = 8192;

/// Descriptors in one part of a table filled on several threads: microseconds
/// of walk, against one uncontended lock and one atomic to take it.
const FILL_PART_DESCRIPTORS: usize = 1024;

/// Threads that fill a large table beside the preparing thread
/// ([`walk_pairs_in_parts`]), and the descriptors of one part.
pub struct FillPool {
    pub pool: rayon::ThreadPool,
    pub part_len: usize,
    /// Held by the one table the pool fills at a time (a scope waits for
    /// every job it spawned to start, so a second table would wait behind
    /// the first one's parts); the others are walked by their own thread.
    pub busy: Mutex<()>,
    /// The process that started the workers: a child forked after that has
    /// none (a fork copies only the forking thread), and a scope there
    /// would wait for ever, so a child walks alone.
    pub pid: u32,
    /// [`FillPool::warm`]'s jobs not started yet, and those polling.
    pub warming: Arc<Warming>,
}

/// The jobs of [`FillPool::warm`]: queued on a worker and not started, and
/// started and still polling; and how many times the workers were woken.
#[derive(Debug, Default)]
pub struct Warming {
    pub pending: AtomicUsize,
    pub polling: AtomicUsize,
    pub wakes: AtomicU64,
}

/// Counts a started [`FillPool::warm`] job as polling until it returns
/// (or unwinds).
struct Polling<'a>(&'a Warming);

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.0.polling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a transfer does not take the peer-mapped path (before any mapping is
/// looked at).
pub fn gate(cfg: &Config, g: &Shape) -> Result<(), &'static str> {
    if !cfg.enabled || !cfg.enable_peer_map {
        return Err("peer mapping disabled");
    }
    if g.local_transfer {
        return Err("a transfer within one agent");
    }
    if g.local != MemKind::Vram || g.remote != MemKind::Vram {
        return Err("not VRAM on both sides");
    }
    peer_map_gate(cfg)
        .admit(g.descriptors, g.bytes)
        .map_err(|f| match f {
            Fallback::TooFewDescriptors => "too few descriptors",
            _ => "descriptors too large",
        })
}

/// A peer's exported allocation, shared by every loaded region in it; holds
/// this process's mappings of it (one per local GPU that copies to or from
/// it). Dropped, with its mappings, when the last such region is unloaded.
#[derive(Debug)]
pub struct RemoteAlloc {
    pub export: IpcExport,
    same_process: bool,
    mappings: Mutex<HashMap<usize, Result<Arc<IpcMapping>, CudaError>>>,
}

impl RemoteAlloc {
    /// The mapping for copies on `copier`'s device, opened at first use (a
    /// failure is remembered and not retried for this allocation).
    fn mapping(&self, copier: &Arc<IpcCopier>) -> Result<Arc<IpcMapping>, CudaError> {
        let dev = copier.device().ordinal();
        let mut map = self.mappings.locked();
        map.entry(dev)
            .or_insert_with(|| {
                let e = &self.export;
                IpcMapping::open(
                    copier,
                    &e.device_uuid,
                    e.alloc_base,
                    e.alloc_len,
                    &e.ipc_handle,
                    self.same_process,
                )
                .map(Arc::new)
            })
            .clone()
    }
}

/// A remote region as this process addresses it from one local device:
/// the mapping of the allocation holding it, and the shift from the peer's
/// addresses to this process's. Kept in the region's `Md` by the first
/// preparation that maps it, so that later ones read it there instead of
/// taking the allocation's lock and map (each region's look-up touched
/// several cold cache lines; a 512-descriptor request over 64 regions has
/// 64 of them). It holds the mapping open as long as the region is loaded,
/// which the allocation's own map did too.
#[derive(Clone, Debug)]
pub struct MappedRegion {
    device: usize,
    shift: u64,
    mapping: Arc<IpcMapping>,
}

/// A transfer on the peer-mapped path, made when the request is prepared.
pub struct IpcXfer {
    pub table: ipc::IpcTable,
    /// The mappings the table's addresses point into: open while the request
    /// lives (and, once it is gone, until its last copy ended: see
    /// `IpcMapping`'s drop).
    pub mappings: Vec<Arc<IpcMapping>>,
    pub launch: Option<Arc<IpcLaunch>>,
    /// How long the posted copy may run before its request fails (the
    /// transfer's deadline, else the configured deadline or timeout).
    pub limit: Duration,
    pub reported: bool,
    pub peer_inner: Arc<str>,
    /// How the table's parts were shared out, when it was filled in parts.
    pub help: Option<FillHelp>,
}

impl IpcXfer {
    /// A prepared, not yet posted transfer of `table` through `mappings`.
    fn new(table: ipc::IpcTable, mappings: Vec<Arc<IpcMapping>>, peer_inner: Arc<str>) -> Self {
        IpcXfer {
            table,
            mappings,
            launch: None,
            limit: Duration::MAX,
            reported: false,
            peer_inner,
            help: None,
        }
    }
}

/// The windows of the regions the last one-pass preparation met, per side
/// in the order it met them (`IpcMaps::prepare_pairs`), for copies on GPU
/// `device`. Real clients prepare the same regions in the same order for
/// every request (vLLM: its whole cache, region-major), and a region's
/// look-up from its handle touches several cache lines that are cold
/// between requests (the shim's table, the `Md`, its kept mapping); here
/// the next request finds them in two short arrays read in order.
///
/// Keyed by NIXL's handle (which the shim resolves to an `Md`): a handle lives
/// as long as its region is registered or loaded, and every release
/// empties the cache first (`forget_windows`), so a handle found here is
/// the live region its window was made from.
#[derive(Default)]
struct WindowCache {
    device: usize,
    local: Vec<(usize, Window)>,
    remote: Vec<(usize, (Window, Arc<IpcMapping>))>,
}

/// How many regions per side [`WindowCache`] keeps at most.
const CACHED_WINDOWS: usize = 4096;

/// One preparation's walk through what the last one kept of the regions
/// it met (a [`WindowCache`] side, or the arena check's
/// [`super::KeptRegions`]): the `i`-th region it looks up is found when it
/// is the `i`-th of the last preparation; any other is looked up and
/// replaces what followed.
pub(crate) struct Cursor<'c, T> {
    kept: &'c mut Vec<(usize, T)>,
    next: usize,
}

impl<'c, T> Cursor<'c, T> {
    pub(crate) fn new(kept: &'c mut Vec<(usize, T)>) -> Self {
        Cursor { kept, next: 0 }
    }

    pub(crate) fn hit(&mut self, handle: *const std::ffi::c_void) -> Option<&T> {
        let (h, value) = self.kept.get(self.next)?;
        if *h != handle as usize {
            return None;
        }
        self.next += 1;
        Some(value)
    }

    pub(crate) fn keep(&mut self, handle: *const std::ffi::c_void, value: T) {
        self.kept.truncate(self.next);
        if self.next < CACHED_WINDOWS {
            self.kept.push((handle as usize, value));
            self.next += 1;
        }
    }
}

/// What the last preparation kept of the regions it met, for this one:
/// `None` while another preparation holds it; emptied when one panicked
/// holding it.
pub(crate) fn take_kept<T: Default>(kept: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match kept.try_lock() {
        Ok(k) => Some(k),
        Err(std::sync::TryLockError::WouldBlock) => None,
        Err(std::sync::TryLockError::Poisoned(p)) => {
            let mut k = p.into_inner();
            *k = T::default();
            kept.clear_poison();
            Some(k)
        }
    }
}

/// Adds `m` to the mappings a table's addresses point into, once.
fn keep_mapping(mappings: &mut Vec<Arc<IpcMapping>>, m: &Arc<IpcMapping>) {
    if !mappings.iter().any(|x| Arc::ptr_eq(x, m)) {
        mappings.push(m.clone());
    }
}

/// A GPU's copier, or why it has none.
type CopierOrWhyNot = Result<Arc<IpcCopier>, String>;

/// The engine's peer-mapping state.
pub struct IpcMaps {
    identity: Option<Identity>,
    /// Per GPU ordinal, made at first use (a failure is kept, not retried):
    /// found by indexing, without a lock, by every preparation.
    copiers: Box<[OnceLock<CopierOrWhyNot>]>,
    allocs: Mutex<HashMap<IpcExport, Weak<RemoteAlloc>>>,
    notifier: Mutex<Option<Notifier>>,
    /// The run list a preparation builds, kept between preparations (its
    /// megabytes would otherwise be page-faulted in anew every time); one
    /// that finds it in use builds its own.
    runs: Mutex<RunBuilder>,
    windows: Mutex<WindowCache>,
    /// `peer_map_inline_table_max_descriptors`, given to every copier.
    inline_limit: usize,
    /// `peer_map_prepare_threads` resolved (1: the preparing thread only).
    fill_threads: usize,
    /// The threads that fill a large table's parts beside the preparing
    /// thread, started with the first such table.
    fill_pool: OnceLock<Option<FillPool>>,
}

impl std::fmt::Debug for IpcMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMaps")
            .field("identity", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl IpcMaps {
    pub fn new(cfg: &Config) -> Self {
        let identity = if cfg.enabled && cfg.enable_peer_map {
            ipc::identity()
        } else {
            None
        };
        IpcMaps {
            identity,
            copiers: (0..MAX_GPUS).map(|_| OnceLock::new()).collect(),
            allocs: Mutex::new(HashMap::new()),
            notifier: Mutex::new(None),
            runs: Mutex::new(RunBuilder::default()),
            windows: Mutex::new(WindowCache::default()),
            // Small tables ride in the launch only where the preparation
            // runs inside the first post (`prepare_at_post`), whose timed
            // span then saves the upload's driver calls. A client that has
            // BOUNCE prepare in prepXfer prepares ahead of its posts, and
            // there an uploaded table halves each post (design.md §3).
            inline_limit: if cfg.prepare_at_post {
                cfg.peer_map_inline_table_max_descriptors as usize
            } else {
                0
            },
            // Half the cores by default, at most 8 (the preparing thread
            // among them): the arena's fused pass of 32,768 descriptors,
            // 8 parts of whole chunks, went from 392 to 313 us on the H200
            // host from 4 to 8 (docs/benchmarks.md).
            fill_threads: super::threads(cfg.peer_map_prepare_threads, |cores| {
                (cores / 2).clamp(1, 8)
            }),
            fill_pool: OnceLock::new(),
        }
    }

    /// The pool that does a preparation's work on `n` descriptors in parts
    /// beside the preparing thread (a peer-mapped table's fill, an arena
    /// plan's packing), if `n` is at least `min`: enough to gain from it.
    pub fn fill_pool(&self, n: usize, min: usize) -> Option<&FillPool> {
        if self.fill_threads < 2 || n < min {
            return None;
        }
        self.fill_pool
            .get_or_init(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.fill_threads - 1)
                    .thread_name(|i| format!("bounce-fill-{i}"))
                    .build()
                    .map_err(|e| {
                        tracing::warn!("peer-mapped table fill threads: {e}; one thread fills")
                    })
                    .ok()
                    .map(|pool| FillPool::new(pool, FILL_PART_DESCRIPTORS))
            })
            .as_ref()
    }

    /// What to publish for a VRAM region registered on `device` at `addr`
    /// (`len` bytes), if it can be mapped by peers. Errors are the reason
    /// it cannot (logged by the caller, not fatal).
    pub fn export(&self, device: u64, addr: u64, len: u64) -> Result<IpcExport, String> {
        let id = self
            .identity
            .ok_or("peer mapping is off, or this host cannot be identified")?;
        let (alloc_base, alloc_len, ipc_handle, device_uuid) =
            ipc::export_allocation(device as usize, addr)?;
        let export = IpcExport {
            host: id.host,
            process: id.process,
            device_uuid,
            alloc_base,
            alloc_len,
            ipc_handle,
        };
        if !export.covers(addr, len) {
            return Err(format!(
                "the region ({len} bytes at {addr:#x}) does not lie inside one allocation"
            ));
        }
        Ok(export)
    }

    /// The shared handle of a peer's exported allocation holding the region
    /// `[addr, addr + len)`, when it can be used from here: the peer is on
    /// this host and the region lies inside the allocation. `None` means
    /// the region is served by the bounce path or UCX.
    pub fn remote(&self, export: &IpcExport, addr: u64, len: u64) -> Option<Arc<RemoteAlloc>> {
        let id = self.identity?;
        if export.host != id.host {
            return None;
        }
        if !export.covers(addr, len) {
            tracing::warn!(
                addr,
                len,
                "a peer's region lies outside the allocation it exported; not mapped"
            );
            return None;
        }
        let mut allocs = self.allocs.locked();
        allocs.retain(|_, w| w.strong_count() > 0);
        if let Some(a) = allocs.get(export).and_then(Weak::upgrade) {
            return Some(a);
        }
        let a = Arc::new(RemoteAlloc {
            export: *export,
            same_process: export.process == id.process,
            mappings: Mutex::new(HashMap::new()),
        });
        allocs.insert(*export, Arc::downgrade(&a));
        Some(a)
    }

    fn copier(&self, device: usize) -> Result<&Arc<IpcCopier>, String> {
        let slot = self.copiers.get(device).ok_or_else(|| {
            format!("GPU {device}: peer-mapped copies support GPU ordinals below {MAX_GPUS}")
        })?;
        slot.get_or_init(|| {
            let c = IpcCopier::for_device(device, STREAMS_PER_DEVICE)?;
            c.set_inline_limit(self.inline_limit);
            Ok(c)
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// Empties the windows kept from the last preparation: called before
    /// any region is released, so that none is found after it.
    pub fn forget_windows(&self) {
        *self.windows.locked() = WindowCache::default();
    }

    /// The windows kept for copies on GPU `ordinal` (emptied when they were
    /// another GPU's, or when a preparation panicked holding them), unless
    /// another preparation holds them: that one keeps them, and this one
    /// looks every region up.
    fn kept_windows(&self, ordinal: usize) -> Option<std::sync::MutexGuard<'_, WindowCache>> {
        let mut w = take_kept(&self.windows)?;
        if w.device != ordinal {
            *w = WindowCache {
                device: ordinal,
                ..WindowCache::default()
            };
        }
        Some(w)
    }

    /// Prepares a peer-mapped transfer whose descriptors are all one length
    /// as a pair table, in one pass over NIXL's descriptors
    /// ([`walk_pairs`]; from 16,384 descriptors, 8192 while the pool's
    /// workers are awake, in parts on several threads,
    /// [`walk_pairs_in_parts`]). `None`: this way declines it (descriptors of
    /// several lengths, memory not mapped or not mappable, anything a check
    /// would refuse, or a CUDA failure); the checked path then decides, and
    /// words any error. Counts and logs nothing.
    pub fn prepare_pairs(
        &self,
        op: Op,
        local: &Descs<'_>,
        remote: &Descs<'_>,
        peer_inner: Arc<str>,
    ) -> Option<IpcXfer> {
        let started = std::time::Instant::now();
        let first = *local.raw().first()?;
        let device = first.dev;
        let copier = self.copier(usize::try_from(device).ok()?).ok()?;
        let mut mappings: Vec<Arc<IpcMapping>> = Vec::new();
        let mut help = None;
        let ordinal = copier.device().ordinal();
        // The walk, and with it the windows kept from the last preparation
        // (held only while it runs).
        let walk = |out: &mut [u64]| {
            // A large table in parts on several threads; otherwise, and for
            // anything the parts decline, alone.
            if let Some(walked) = self.walk_mapped_in_parts(op, local, remote, out, device, ordinal)
            {
                for m in &walked.used {
                    keep_mapping(&mut mappings, m);
                }
                help = Some(walked.help);
                return Ok(true);
            }
            let mut kept_windows = self.kept_windows(ordinal);
            let (mut lcache, mut rcache) = match kept_windows.as_deref_mut() {
                Some(w) => (
                    Some(Cursor::new(&mut w.local)),
                    Some(Cursor::new(&mut w.remote)),
                ),
                None => (None, None),
            };
            let local_window = |p| {
                let found = lcache.as_mut().and_then(|c| c.hit(p).copied());
                let w = match found {
                    Some(w) => w,
                    None => {
                        let w = Window::of(local.md(p)?.range, 0);
                        if let Some(c) = lcache.as_mut() {
                            c.keep(p, w);
                        }
                        w
                    }
                };
                (w.dev == device).then_some(w)
            };
            // Borrows what the region keeps: no reference count is taken
            // per region (each would be an atomic read-modify-write on the
            // mapping's shared count), only per mapping the table uses and
            // for a window the cache keeps.
            let remote_window = |p| {
                if let Some((w, m)) = rcache.as_mut().and_then(|c| c.hit(p)) {
                    keep_mapping(&mut mappings, m);
                    return Some(*w);
                }
                let md = remote.md(p)?;
                let kept = md.mapped()?;
                let mut window = |r: &MappedRegion| {
                    keep_mapping(&mut mappings, &r.mapping);
                    let w = Window::of(md.range, r.shift);
                    if let Some(c) = rcache.as_mut() {
                        c.keep(p, (w, r.mapping.clone()));
                    }
                    Some(w)
                };
                match kept.get() {
                    Some(r) if r.device == ordinal => window(r),
                    _ => {
                        let alloc = md.peer_alloc()?;
                        let m = alloc.mapping(copier).ok()?;
                        // The region must lie in the mapped allocation: then
                        // so does every descriptor inside the region.
                        let offset = (md.range.addr as u64).checked_sub(alloc.export.alloc_base)?;
                        m.address(offset, md.range.len as u64)?;
                        let r = MappedRegion {
                            device: ordinal,
                            shift: m.base().wrapping_sub(alloc.export.alloc_base),
                            mapping: m,
                        };
                        // The Md keeps the first one set (another device's,
                        // or a concurrent preparation's); this one is used
                        // here, and kept in the window cache.
                        match kept.set(r) {
                            Ok(()) => window(kept.get()?),
                            Err(r) => window(&r),
                        }
                    }
                }
            };
            Ok(walk_pairs(
                op,
                local.raw(),
                remote.raw(),
                out,
                local_window,
                remote_window,
            ))
        };
        let table = copier.prepare_pairs(local.len(), first.len as u64, started, walk);
        match table {
            Ok(Some(table)) => Some(IpcXfer {
                help,
                ..IpcXfer::new(table, mappings, peer_inner)
            }),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!("one-pass peer-mapped table: {e}; trying the checked path");
                None
            }
        }
    }

    /// A large transfer's pair table filled in parts on several threads
    /// ([`walk_pairs_in_parts`]), local regions on `device`, remote ones
    /// already mapped for `ordinal` (the parts only read them: an unmapped
    /// one declines, and the single walk maps it). `None`: too small, no
    /// pool free, or declined. The mappings the table's addresses point
    /// into, and how the parts were shared out.
    fn walk_mapped_in_parts(
        &self,
        op: Op,
        local: &Descs<'_>,
        remote: &Descs<'_>,
        out: &mut [u64],
        device: u64,
        ordinal: usize,
    ) -> Option<PartsWalked<Arc<IpcMapping>>> {
        // Workers already awake ([`FillPool::warm`]) pay from fewer.
        let pool = self.fill_pool(local.len(), WARM_PARALLEL_FILL_MIN_DESCRIPTORS)?;
        if !pool.awake() && local.len() < PARALLEL_FILL_MIN_DESCRIPTORS {
            return None;
        }
        let local_window = |p| {
            let w = Window::of(local.md(p)?.range, 0);
            (w.dev == device).then_some(w)
        };
        let remote_window = |p, used: &mut Vec<Arc<IpcMapping>>| {
            let md = remote.md(p)?;
            let r = md.mapped()?.get().filter(|r| r.device == ordinal)?;
            keep_mapping(used, &r.mapping);
            Some(Window::of(md.range, r.shift))
        };
        walk_pairs_in_parts(
            pool,
            op,
            local.raw(),
            remote.raw(),
            out,
            local_window,
            remote_window,
        )
    }

    /// Plans a peer-mapped transfer of `n` descriptors: `pairs` yields, per
    /// descriptor, (local address, remote address, length, the remote
    /// region's allocation), the local ones on `device`, or `Err` naming why
    /// that descriptor cannot take this path. Err: why the transfer cannot.
    pub fn prepare<'a>(
        &self,
        op: Op,
        device: usize,
        n: usize,
        pairs: impl Iterator<Item = Result<(u64, u64, u64, &'a Arc<RemoteAlloc>), &'static str>>,
        peer_inner: Arc<str>,
    ) -> Result<IpcXfer, String> {
        let started = std::time::Instant::now();
        let copier = self.copier(device)?;
        let mut mappings: Vec<Arc<IpcMapping>> = Vec::new();
        let mut last: Option<(*const RemoteAlloc, Arc<IpcMapping>)> = None;
        // Each pair as this process's (source, destination) of one copy.
        let copies = pairs.map(|pair| -> Result<IpcCopy, String> {
            let (local, remote, len, alloc) = pair?;
            // Consecutive descriptors usually share an allocation: no
            // look-up and no reference count per descriptor then.
            if !matches!(&last, Some((p, _)) if std::ptr::eq(*p, Arc::as_ptr(alloc))) {
                let m = alloc.mapping(copier)?;
                keep_mapping(&mut mappings, &m);
                last = Some((Arc::as_ptr(alloc), m));
            }
            let mapping = &last.as_ref().expect("set above").1;
            let mapped = remote
                .checked_sub(alloc.export.alloc_base)
                .and_then(|offset| mapping.address(offset, len))
                .ok_or_else(|| {
                    format!("remote descriptor ({len} bytes at {remote:#x}) lies outside the peer's allocation")
                })?;
            Ok(match op {
                Op::Write => IpcCopy {
                    src: local,
                    dst: mapped,
                    len,
                },
                Op::Read => IpcCopy {
                    src: mapped,
                    dst: local,
                    len,
                },
            })
        });
        let mut kept = self.runs.try_locked();
        let mut own = RunBuilder::default();
        let runs: &mut RunBuilder = match kept.as_deref_mut() {
            Some(v) => v,
            None => &mut own,
        };
        runs.clear();
        runs.runs_mut().reserve(n);
        for c in copies {
            ipc::push_copy(runs, c?);
        }
        let table = copier.prepare(runs.runs(), started)?;
        Ok(IpcXfer::new(table, mappings, peer_inner))
    }

    /// The way to send notifications of peer-mapped transfers (the
    /// engine's notifier thread, started at the first use).
    pub fn notifier(&self, inner: &Agent) -> Result<Notify, String> {
        let mut slot = self.notifier.locked();
        if slot.is_none() {
            *slot = Some(Notifier::start(inner.clone())?);
        }
        let n = slot.as_ref().expect("started above");
        Ok(Notify(n.tx.clone()))
    }
}

/// Queues notifications for the notifier thread.
pub struct Notify(mpsc::Sender<Pending>);

impl Notify {
    /// Sends `message` to `peer_inner` once `launch` ended, unless the
    /// request was released or failed first. A thread of the engine does
    /// it, so the notification leaves even if the application never polls
    /// the request.
    pub fn after(
        self,
        launch: Arc<IpcLaunch>,
        limit: Duration,
        peer_inner: Arc<str>,
        message: Vec<u8>,
    ) {
        // The thread ends only with the engine, after every sender is gone.
        let _ = self.0.send(Pending {
            launch,
            limit,
            peer_inner,
            message,
        });
    }
}

impl Drop for IpcMaps {
    fn drop(&mut self) {
        if let Some(n) = self.notifier.get_mut().ok().and_then(Option::take) {
            n.stop();
        }
    }
}

struct Pending {
    launch: Arc<IpcLaunch>,
    /// After this long the copy counts as failed (see `IpcLaunch::expire`),
    /// so a copy that never ends cannot hold the thread (or the engine's
    /// teardown, which waits for it) longer.
    limit: Duration,
    peer_inner: Arc<str>,
    message: Vec<u8>,
}

/// The thread that sends notifications of peer-mapped transfers after their
/// copies ended, in posting order.
struct Notifier {
    tx: mpsc::Sender<Pending>,
    thread: JoinHandle<()>,
    /// Set when the engine goes: copies still running get at most
    /// [`STOP_GRACE`] more before their notifications are given up.
    stopping: Arc<AtomicBool>,
}

/// How long a stopping notifier still waits for a copy to end.
const STOP_GRACE: Duration = Duration::from_secs(1);

impl Notifier {
    fn start(inner: Agent) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel::<Pending>();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("bounce-peer-notify".into())
            .spawn(move || {
                // When the engine began stopping: from then on, at most
                // STOP_GRACE in all for the copies still queued.
                let mut stop_seen: Option<std::time::Instant> = None;
                for p in rx {
                    let ended = loop {
                        if p.launch.cancelled.load(Ordering::SeqCst) {
                            break Err("released".to_string());
                        }
                        p.launch.expire(p.limit);
                        if let Some(r) = p.launch.poll() {
                            break r.map_err(String::from);
                        }
                        if stop.load(Ordering::SeqCst) {
                            let since = *stop_seen.get_or_insert_with(std::time::Instant::now);
                            if since.elapsed() > STOP_GRACE {
                                break Err("the engine stopped before the copy ended".into());
                            }
                        }
                        std::thread::sleep(Duration::from_micros(20));
                    };
                    if let Err(e) = ended {
                        if !p.launch.cancelled.load(Ordering::SeqCst) {
                            tracing::warn!("no notification for a peer-mapped copy: {e}");
                        }
                        continue;
                    }
                    if p.launch.cancelled.load(Ordering::SeqCst) {
                        continue;
                    }
                    if let Err(e) = inner.send_notification(&p.peer_inner, &p.message, None) {
                        tracing::warn!(peer = %p.peer_inner, "sending a peer-mapped transfer's notification: {e}");
                    }
                }
            })
            .map_err(|e| format!("starting the peer-map notifier: {e}"))?;
        Ok(Notifier {
            tx,
            thread,
            stopping,
        })
    }

    /// Sends what is queued (each after its copy, waiting at most
    /// [`STOP_GRACE`] more per copy) and ends the thread.
    fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        drop(self.tx);
        let _ = self.thread.join();
    }
}

/// A region as [`walk_pairs`] checks descriptors against it: its bounds
/// and device, and what to add (wrapping) to an address in it to get the
/// address the copy uses (0 for local memory; into the mapping for a
/// peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    addr: usize,
    len: usize,
    dev: u64,
    shift: u64,
}

impl Window {
    pub fn of(r: Range, shift: u64) -> Self {
        Window {
            addr: r.addr,
            len: r.len,
            dev: r.dev,
            shift,
        }
    }
}

/// [`walk_pairs`] in parts of `fill.part_len` descriptors, taken in turn by
/// the calling thread and `fill`'s threads, with the same result: the table
/// written, or a decline (`None`; also when another table holds the pool,
/// or in a child forked after the workers started). The calling thread
/// starts at once and the workers join as they wake (tens of us on a busy
/// host), so a table is never much slower than one thread's walk, however
/// late they come.
/// Every part looks its own regions up, so the look-ups are only reads:
/// `remote_window` records in its part's list what the table will use (the
/// parts' lists are returned, one after the other, in [`PartsWalked`]).
pub fn walk_pairs_in_parts<T: Send>(
    fill: &FillPool,
    op: Op,
    local: &[RawDesc],
    remote: &[RawDesc],
    out: &mut [u64],
    local_window: impl Fn(*const std::ffi::c_void) -> Option<Window> + Sync,
    remote_window: impl Fn(*const std::ffi::c_void, &mut Vec<T>) -> Option<Window> + Sync,
) -> Option<PartsWalked<T>> {
    let (n, len) = (local.len(), local.first()?.len);
    let part_len = fill.part_len;
    if remote.len() != n || out.len() != 2 * n || part_len == 0 {
        return None;
    }
    let parts: Vec<_> = local
        .chunks(part_len)
        .zip(remote.chunks(part_len))
        .zip(out.chunks_mut(2 * part_len))
        .map(|((l, r), o)| (l, r, o))
        .collect();
    let walk = |(l, r, out): (&[RawDesc], &[RawDesc], &mut [u64])| {
        // Each part checks that its descriptors are as long as its own
        // first, and that one as long as the whole transfer's first.
        if l.first()?.len != len {
            return None;
        }
        let mut used = Vec::new();
        let remote_window = |p| remote_window(p, &mut used);
        walk_pairs(op, l, r, out, &local_window, remote_window).then_some(used)
    };
    let (used, help) = fill.share(parts, walk)?;
    Some(PartsWalked {
        used: used.into_iter().flatten().collect(),
        help,
    })
}

impl FillPool {
    /// `pool`'s workers, sharing work in parts of `part_len` descriptors.
    pub fn new(pool: rayon::ThreadPool, part_len: usize) -> Self {
        FillPool {
            pool,
            part_len,
            busy: Mutex::new(()),
            pid: std::process::id(),
            warming: Arc::default(),
        }
    }

    /// Wakes the workers ahead of a preparation that will share its work
    /// with them (a request admitted in `prepXfer` and prepared at its first
    /// post): each polls the pool for up to `spin`, so that the parts the
    /// post hands out are taken at once, not after a wake-up (which takes
    /// longer than a client's time from `prepXfer` to the post). A worker
    /// that ran a job, or whose time is up, goes back to
    /// sleep; it lets others have its core every 64 polls. Nothing is woken
    /// while any job of the last call is still queued or polling (a second
    /// job on a worker would be run by the first one's poll and end it), nor
    /// in a forked child.
    pub fn warm(&self, spin: std::time::Duration) {
        let w = &self.warming;
        if self.pid != std::process::id()
            || w.pending.load(Ordering::Acquire) + w.polling.load(Ordering::Acquire) > 0
        {
            return;
        }
        let n = self.pool.current_num_threads();
        // Only one caller broadcasts (another that raced here backs off).
        if w.pending
            .compare_exchange(0, n, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        w.wakes.fetch_add(1, Ordering::Relaxed);
        let until = std::time::Instant::now() + spin;
        let warming = w.clone();
        // One job on each worker (a broadcast).
        self.pool.spawn_broadcast(move |_| {
            // Polling before no longer pending: the two never read 0
            // together while a job is in flight.
            warming.polling.fetch_add(1, Ordering::AcqRel);
            warming.pending.fetch_sub(1, Ordering::AcqRel);
            let _polling = Polling(&warming);
            let mut polls = 0u32;
            while std::time::Instant::now() < until {
                match rayon::yield_now() {
                    Some(rayon::Yield::Executed) => break,
                    _ if polls % 64 == 63 => std::thread::yield_now(),
                    _ => std::hint::spin_loop(),
                }
                polls = polls.wrapping_add(1);
            }
        });
    }

    /// Whether workers woken by [`FillPool::warm`] still poll for work.
    pub fn awake(&self) -> bool {
        self.warming.polling.load(Ordering::Acquire) > 0
    }

    /// `0..n` cut into parts of about the pool's part length, each a
    /// whole number of `unit`s (the last may be shorter).
    pub fn parts(&self, n: usize, unit: usize) -> Vec<std::ops::Range<usize>> {
        let unit = unit.max(1);
        let step = unit * self.part_len.div_ceil(unit).max(1);
        (0..n).step_by(step).map(|a| a..n.min(a + step)).collect()
    }

    /// Runs `work` on every part, the calling thread and the workers taking
    /// parts in turn; what each part gave, in the parts' order, and how the
    /// workers helped. `None`: a part declined (the rest are skipped),
    /// another caller holds the pool, or this is a child forked after the
    /// workers started. The calling thread starts at once and the workers
    /// join as they wake (tens of us on a busy host), so the whole is never
    /// much slower than one thread's, however late they come.
    pub fn share<P: Send, T: Send>(
        &self,
        parts: Vec<P>,
        work: impl Fn(P) -> Option<T> + Sync,
    ) -> Option<(Vec<T>, FillHelp)> {
        let started = std::time::Instant::now();
        if self.pid != std::process::id() {
            return None;
        }
        let _busy = self.busy.try_locked()?;
        /// One part: what to do (taken by the thread that does it), then
        /// what it gave (`None` inside: declined).
        type Part<P, T> = (Option<P>, Option<Option<T>>);
        let parts: Vec<Mutex<Part<P, T>>> = parts
            .into_iter()
            .map(|p| Mutex::new((Some(p), None)))
            .collect();
        let (next, declined) = (AtomicUsize::new(0), AtomicBool::new(false));
        // What the workers did: parts done, and when the first one began.
        let (helped, first_help) = (AtomicUsize::new(0), AtomicU64::new(u64::MAX));
        let take_parts = |worker: bool| {
            while !declined.load(Ordering::Relaxed) {
                let Some(part) = parts.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                if worker {
                    helped.fetch_add(1, Ordering::Relaxed);
                    first_help.fetch_min(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                let mut part = part.locked();
                let found = part.0.take().and_then(&work);
                if found.is_none() {
                    declined.store(true, Ordering::Relaxed);
                }
                part.1 = Some(found);
            }
        };
        self.pool.in_place_scope(|s| {
            for _ in 0..self
                .pool
                .current_num_threads()
                .min(parts.len().saturating_sub(1))
            {
                s.spawn(|_| take_parts(true));
            }
            take_parts(false);
        });
        let count = parts.len();
        let done = parts
            .into_iter()
            .map(|p| {
                p.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .1
                    .flatten()
            })
            .collect::<Option<Vec<T>>>()?;
        let helped = helped.into_inner();
        Some((
            done,
            FillHelp {
                parts: count as u64,
                helped: helped as u64,
                first_help_ns: if helped > 0 {
                    first_help.into_inner()
                } else {
                    0
                },
            },
        ))
    }
}

/// A table [`walk_pairs_in_parts`] wrote: what its parts' look-ups
/// recorded, and how much the workers helped.
pub struct PartsWalked<T> {
    pub used: Vec<T>,
    pub help: FillHelp,
}

/// How a table filled in parts was shared out: the parts, those the
/// workers walked, and how long after the walk's start the first worker
/// began one (0 when none did). Counted per preparation (with the tables
/// that any worker helped, so that the last has a mean), it shows whether
/// waking the workers, not the walk, bounds the fill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FillHelp {
    pub parts: u64,
    pub helped: u64,
    pub first_help_ns: u64,
}

/// The pair table of a transfer whose descriptors are all one length, in
/// one pass over NIXL's two descriptor arrays: writes copy i's (source,
/// destination) into `out[2i]`, `out[2i + 1]` (`out` holds 2n words), local
/// to remote for a WRITE, remote to local for a READ. Each distinct
/// metadata handle (consecutive descriptors mostly share one) is looked up
/// once, as the window its descriptors must lie in (`None` declines).
///
/// Declines (false) at the first descriptor that is not plainly of this
/// shape: another length on either side, a handle without a window, a
/// descriptor outside its window or on another device. The caller then
/// takes the checked path, which words any error. True: every pair is
/// written, and every copy lies inside its windows.
pub fn walk_pairs(
    op: Op,
    local: &[RawDesc],
    remote: &[RawDesc],
    out: &mut [u64],
    mut local_window: impl FnMut(*const std::ffi::c_void) -> Option<Window>,
    mut remote_window: impl FnMut(*const std::ffi::c_void) -> Option<Window>,
) -> bool {
    let Some(len) = local.first().map(|d| d.len) else {
        return false;
    };
    if len == 0 || remote.len() != local.len() || out.len() != 2 * local.len() {
        return false;
    }
    // A window with room for one descriptor, as (window, last start).
    let fit = |w: Window| Some((w, w.len.checked_sub(len)?));
    let (mut lp, mut rp) = (std::ptr::null(), std::ptr::null());
    let none = (
        Window::of(
            Range {
                addr: 0,
                len: 0,
                dev: 0,
            },
            0,
        ),
        0,
    );
    let (mut lw, mut rw) = (none, none);
    // Inside a window: the right length and device, and a start no later
    // than the window's last (wrapping: an address below the window is far
    // above it).
    let inside = |d: &RawDesc, (w, last): (Window, usize)| {
        d.len == len && d.dev == w.dev && d.addr.wrapping_sub(w.addr) <= last
    };
    for ((l, r), pair) in local.iter().zip(remote).zip(out.chunks_exact_mut(2)) {
        // (Before the first look-up `lp` is null, and a null handle has no
        // window: every pass looks up at least once per side.)
        if l.md != lp || lp.is_null() {
            let Some(w) = local_window(l.md).and_then(fit) else {
                return false;
            };
            (lp, lw) = (l.md, w);
        }
        if r.md != rp || rp.is_null() {
            let Some(w) = remote_window(r.md).and_then(fit) else {
                return false;
            };
            (rp, rw) = (r.md, w);
        }
        if !(inside(l, lw) && inside(r, rw)) {
            return false;
        }
        let (la, ra) = (l.addr as u64, (r.addr as u64).wrapping_add(rw.0.shift));
        let (src, dst) = match op {
            Op::Write => (la, ra),
            Op::Read => (ra, la),
        };
        pair[0] = src;
        pair[1] = dst;
    }
    true
}

#[cfg(test)]
mod tests;
