//! The BOUNCE backend engine.
//!
//! One [`Engine`] exists per (NIXL agent, BOUNCE backend). Every transfer
//! that neither of BOUNCE's own paths takes is carried by the UCX delegate:
//! NIXL's own UCX engine, which the C++ shim creates beside this engine and
//! calls directly (docs/design.md §2). This engine decides the route
//! ([`Engine::prep_xfer`] answers `None` for the delegate) and carries the
//! delegate's connection info and region public data inside its own.
//!
//! The engine also owns an inner NIXL agent (named after the outer one plus
//! [`INNER_SUFFIX`]) with a UCX backend of its own, for the bounce arena: its
//! chunk writes, its control notifications, and the completion
//! notifications of BOUNCE's own paths.

pub mod bounce;
pub mod cma;
pub mod conn_info;
pub mod params;
pub mod peer;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nixl_sys::{Agent, AgentConfig, NixlError, Params, ThreadSync};

use crate::config::{Config, ConfigSource};
use crate::control::notif::NotifHub;
use crate::failpoint::Failpoints;
use crate::ffi::sys;
use crate::proto::plan::{self, Descriptor, Plan, PlanError, Survey};
use crate::proto::wire::Handshake;
use crate::proto::PeerId;
use crate::runtime::{DeferredNotif, Ticket};
use crate::stats::EngineStats;
use crate::sync::Locked;
use bounce::{Bounce, Fallback, Location, PeerBounce, RouteInput};
use conn_info::{ConnInfo, PublicBounce, PublicData};

/// Appended to the outer agent's name to name its inner agent. Peers use it to
/// map inner agent names (as seen in notifications) back to outer names.
/// No `/` in it: NIXL's file telemetry writes `<dir>/<agent name>`, and the
/// outer agent's file must not have to be a folder.
pub const INNER_SUFFIX: &str = ".bounce";

/// How long the inner agent's progress thread sleeps between rounds.
pub const INNER_PROGRESS_DELAY_US: u64 = 5_000;

/// A NIXL status, as the C boundary carries it: the header's `BOUNCE_*`
/// codes, which the shim asserts equal to NIXL's own at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    InProgress = sys::BOUNCE_IN_PROG as i32,
    Success = sys::BOUNCE_SUCCESS as i32,
    NotPosted = sys::BOUNCE_ERR_NOT_POSTED,
    InvalidParam = sys::BOUNCE_ERR_INVALID_PARAM,
    Backend = sys::BOUNCE_ERR_BACKEND,
    NotFound = sys::BOUNCE_ERR_NOT_FOUND,
    Mismatch = sys::BOUNCE_ERR_MISMATCH,
    NotAllowed = sys::BOUNCE_ERR_NOT_ALLOWED,
    RepostActive = sys::BOUNCE_ERR_REPOST_ACTIVE,
    Unknown = sys::BOUNCE_ERR_UNKNOWN,
    NotSupported = sys::BOUNCE_ERR_NOT_SUPPORTED,
    RemoteDisconnect = sys::BOUNCE_ERR_REMOTE_DISCONNECT,
    Canceled = sys::BOUNCE_ERR_CANCELED,
}

/// An operation's failure: the NIXL status to return and what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    fn invalid(message: impl Into<String>) -> Self {
        Self::new(Status::InvalidParam, message)
    }
    fn nixl(context: &str, e: NixlError) -> Self {
        let status = match e {
            NixlError::InvalidParam => Status::InvalidParam,
            NixlError::NotFound => Status::NotFound,
            _ => Status::Backend,
        };
        Self::new(
            status,
            format!("{context}: NIXL reported {e} to BOUNCE's inner agent (the bounce arena's)"),
        )
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:?})", self.message, self.status)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Memory kinds as NIXL numbers them (the header's `BOUNCE_MEM_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemKind {
    Dram,
    Vram,
}

impl MemKind {
    pub fn from_nixl(v: i32) -> Result<Self> {
        const DRAM: i32 = sys::BOUNCE_MEM_DRAM as i32;
        const VRAM: i32 = sys::BOUNCE_MEM_VRAM as i32;
        match v {
            DRAM => Ok(Self::Dram),
            VRAM => Ok(Self::Vram),
            other => Err(Error::new(
                Status::NotSupported,
                format!("memory type {other} is not supported by BOUNCE (DRAM and VRAM are)"),
            )),
        }
    }
}

/// A transfer direction as NIXL numbers it (the header's `BOUNCE_OP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    pub fn from_nixl(v: i32) -> Result<Self> {
        const READ: i32 = sys::BOUNCE_OP_READ as i32;
        const WRITE: i32 = sys::BOUNCE_OP_WRITE as i32;
        match v {
            READ => Ok(Self::Read),
            WRITE => Ok(Self::Write),
            other => Err(Error::invalid(format!(
                "unknown transfer operation {other}"
            ))),
        }
    }
}

/// A memory range: address, length, device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub addr: usize,
    pub len: usize,
    pub dev: u64,
}

impl Range {
    fn end(&self) -> Option<usize> {
        self.addr.checked_add(self.len)
    }
    /// Whether `inner` lies entirely inside `self` on the same device.
    pub fn covers(&self, inner: &Range) -> bool {
        match (self.end(), inner.end()) {
            (Some(end), Some(inner_end)) => {
                self.dev == inner.dev && self.addr <= inner.addr && inner_end <= end
            }
            _ => false,
        }
    }
}

/// Backend metadata handed to NIXL (one per registered region, per loaded
/// remote region, and per local target).
#[derive(Debug)]
pub struct Md {
    magic: u64,
    pub range: Range,
    pub kind: MemKind,
    pub owner: MdOwner,
}

/// The fewest descriptors whose arena plan is packed in parts on several
/// threads (`Engine::plan`): 30-40 ns a descriptor cold on one thread (a
/// vLLM-pattern preparation on the H200 host), so 0.25 ms or more, against
/// 45-70 us for a worker to wake.
const PARALLEL_PLAN_MIN_DESCRIPTORS: usize = 8192;

/// How long the preparation pool's workers, woken when a large request is
/// admitted in `prepXfer`, wait for its first post ([`peer::FillPool::warm`]):
/// well over a client's own time from `prepXfer` to the post.
const FILL_POOL_WARM: std::time::Duration = std::time::Duration::from_micros(300);

/// Tags live [`Md`] objects, so that what the shim's table resolves a
/// descriptor's metadata to can be checked before it is used.
const MD_MAGIC: u64 = 0x4e58_424d_445f_4f4b; // "NXBMD_OK"

#[derive(Debug)]
pub enum MdOwner {
    /// Memory this agent registered (with the UCX delegate too: the shim
    /// holds that registration beside this handle).
    Registered {
        public_data: Vec<u8>,
        /// The bounce instance of the region's location, if any.
        bounce: Option<Arc<Bounce>>,
        /// A VRAM region's host-staged instance, for its transfers with
        /// DRAM (docs/design.md §3, "Mixed memory").
        staged: Option<Arc<Bounce>>,
    },
    /// A region of a remote agent, loaded from its metadata.
    Remote {
        agent: String,
        /// The peer's bounce instance for the region's location, when it
        /// advertised a compatible one.
        bounce: Option<Arc<PeerBounce>>,
        /// The peer's host-staged instance of a VRAM region's GPU, when it
        /// advertised a compatible one (for our DRAM's transfers with it).
        staged: Option<Arc<PeerBounce>>,
        /// The peer's allocation holding the region, when it is on this
        /// host and exported it for mapping (the peer-mapped path).
        peer: Option<Arc<peer::RemoteAlloc>>,
        /// The region as this process addresses it, once a preparation
        /// found it (see [`peer::MappedRegion`]).
        mapped: std::sync::OnceLock<peer::MappedRegion>,
        /// The peer process, when it is on this host and proven reachable
        /// by cross-memory attach (the CMA path, DRAM only).
        cma: Option<Arc<cma::CmaPeer>>,
    },
    /// This agent's own registered memory as the target of a local transfer.
    LocalTarget,
}

impl Md {
    pub fn is_valid(&self) -> bool {
        self.magic == MD_MAGIC
    }

    /// The peer's allocation holding this remote region, when the peer is
    /// on this host and exported it for mapping (the peer-mapped path).
    pub fn peer_alloc(&self) -> Option<&Arc<peer::RemoteAlloc>> {
        match &self.owner {
            MdOwner::Remote { peer: Some(a), .. } => Some(a),
            _ => None,
        }
    }

    /// The bounce instance of this agent's registered region.
    fn instance(&self) -> Option<&Arc<Bounce>> {
        match &self.owner {
            MdOwner::Registered {
                bounce: Some(b), ..
            } => Some(b),
            _ => None,
        }
    }

    /// The peer's bounce arena of this remote region.
    fn arena(&self) -> Option<&Arc<PeerBounce>> {
        match &self.owner {
            MdOwner::Remote {
                bounce: Some(p), ..
            } => Some(p),
            _ => None,
        }
    }

    /// The bounce instance that moves this registered region to or from
    /// the other side's memory: its host-staged one when `mixed` (the
    /// other side's memory is of the other kind) and it has one, else its
    /// location's.
    fn instance_for(&self, mixed: bool) -> Option<&Arc<Bounce>> {
        match &self.owner {
            MdOwner::Registered {
                staged: Some(h), ..
            } if mixed => Some(h),
            _ => self.instance(),
        }
    }

    /// [`Md::instance_for`] for a remote region: the peer's arena.
    fn arena_for(&self, mixed: bool) -> Option<&Arc<PeerBounce>> {
        match &self.owner {
            MdOwner::Remote {
                staged: Some(h), ..
            } if mixed => Some(h),
            _ => self.arena(),
        }
    }

    /// Where a remote region kept its mapping ([`peer::MappedRegion`]).
    pub fn mapped(&self) -> Option<&std::sync::OnceLock<peer::MappedRegion>> {
        match &self.owner {
            MdOwner::Remote { mapped, .. } => Some(mapped),
            _ => None,
        }
    }
}

/// Optional arguments of one transfer.
#[derive(Debug, Clone, Default)]
pub struct XferArgs {
    pub notif: Option<Vec<u8>>,
    pub custom_param: Vec<u8>,
}

/// One descriptor as the shim passes it (`bounce_desc_t`, which is NIXL's
/// own descriptor): a range and the backend metadata NIXL resolved it to
/// (the handle of its region, which the shim resolves to an [`Md`]), or
/// null.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawDesc {
    pub addr: usize,
    pub len: usize,
    pub dev: u64,
    pub md: *const std::ffi::c_void,
}

// SAFETY: a descriptor is plain values; `md` is only an address here, read
// through a resolver under `Descs::new`'s contract (which holds on any
// thread: the metadata live for the call, and are only read), so a
// descriptor array may be read by several threads at once (a large table's
// parts, engine::peer).
unsafe impl Send for RawDesc {}
// SAFETY: as above.
unsafe impl Sync for RawDesc {}

// A table's parts read `Md`s from several threads through `&Md` made from
// raw pointers, which the compiler does not check: it must be Sync.
const _: () = {
    const fn sync<T: Sync>() {}
    sync::<Md>()
};

/// The [`Md`] of a descriptor's (non-null) backend metadata, or null
/// (callable from several threads at once: the shim's resolver only reads
/// its metadata table; bounce_ffi.h says so).
pub type MdResolver<'a> = &'a (dyn Fn(*const std::ffi::c_void) -> *const Md + Sync);

/// One side of a transfer as NIXL hands it over: its descriptor array, read
/// in place (no copy per descriptor), its memory kind and the way to its
/// descriptors' metadata. Nothing is checked yet: [`Engine::check`] makes a
/// [`Side`] of it, and the peer-mapped path's one-pass table
/// (`peer::walk_pairs`) checks as it goes.
#[derive(Clone, Copy)]
pub struct Descs<'a> {
    pub kind: MemKind,
    raw: &'a [RawDesc],
    resolve: MdResolver<'a>,
}

impl<'a> Descs<'a> {
    /// # Safety
    /// `resolve` of every non-null `md` in `raw` is null or points to an
    /// [`Md`] that lives for `'a` (its magic is checked before anything
    /// else).
    pub unsafe fn new(kind: MemKind, raw: &'a [RawDesc], resolve: MdResolver<'a>) -> Self {
        Self { kind, raw, resolve }
    }

    pub fn len(&self) -> usize {
        self.raw.len()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn raw(&self) -> &'a [RawDesc] {
        self.raw
    }

    /// The live BOUNCE metadata behind a descriptor's (non-null) handle;
    /// `None` for null or a pointer that is not BOUNCE's.
    pub fn md(&self, p: *const std::ffi::c_void) -> Option<&'a Md> {
        if p.is_null() {
            return None;
        }
        // SAFETY: `new`'s contract: null or an `Md`; the magic is read
        // before the rest.
        let md = unsafe { (self.resolve)(p).as_ref() }?;
        md.is_valid().then_some(md)
    }
}

/// One side's checks, one descriptor at a time: its metadata is a live
/// BOUNCE handle (checked once per run of equal handles: consecutive
/// descriptors mostly share one), it does not wrap around the address
/// space, and it lies inside the memory NIXL resolved it to (NIXL checks
/// this too; a failure means NIXL and this plugin disagree about the
/// layout).
struct SideCheck<'a, 'k> {
    which: &'static str,
    descs: Descs<'a>,
    /// The handle of the run under way (`None` before the first).
    handle: Option<*const std::ffi::c_void>,
    /// Its region (`None`: a null handle).
    region: Option<Region<'a>>,
    /// The regions the last preparation met, in order, when kept.
    kept: Option<peer::Cursor<'k, KeptRegion>>,
}

impl<'a, 'k> SideCheck<'a, 'k> {
    fn new(
        which: &'static str,
        descs: Descs<'a>,
        kept: Option<&'k mut Vec<(usize, KeptRegion)>>,
    ) -> Self {
        SideCheck {
            which,
            descs,
            handle: None,
            region: None,
            kept: kept.map(peer::Cursor::new),
        }
    }

    /// The region behind handle `p` (not null) of descriptor `i`: kept
    /// from the last preparation when it met the same handle at this
    /// point, else resolved (and kept).
    fn region(&mut self, i: usize, p: *const std::ffi::c_void) -> Result<Region<'a>> {
        if let Some(k) = self.kept.as_mut().and_then(|c| c.hit(p)) {
            // SAFETY: the shim forgets the kept regions under its table's
            // writer lock before a handle leaves the table (and so before
            // its `Md` is freed: `Engine::forget_regions`), and a
            // preparation holds the reader lock for the engine's whole
            // call: a kept region is one the table holds, alive for `'a`.
            let md = unsafe { &*(k.md as *const Md) };
            return Ok(Region {
                md,
                range: k.range,
                path: k.path,
            });
        }
        let md = self.descs.md(p).ok_or_else(|| {
            Error::new(
                Status::Mismatch,
                format!("{} descriptor {i} carries metadata that is not one of this BOUNCE engine's registrations or loaded regions", self.which),
            )
        })?;
        let region = Region::of(md, self.which == "local");
        if let Some(c) = self.kept.as_mut() {
            c.keep(
                p,
                KeptRegion {
                    md: md as *const Md as usize,
                    range: region.range,
                    path: region.path,
                },
            );
        }
        Ok(region)
    }

    /// Checks descriptor `i`; at the first of a run of equal handles, the
    /// run's region (inner `None`: a null handle).
    fn step(&mut self, i: usize, d: &RawDesc) -> Result<Option<Option<Region<'a>>>> {
        let which = self.which;
        let range = d.range();
        if range.end().is_none() {
            return Err(Error::invalid(format!(
                "{which} descriptor {i} wraps around the address space"
            )));
        }
        let mut run = None;
        if self.handle != Some(d.md) {
            self.region = match d.md.is_null() {
                true => None,
                false => Some(self.region(i, d.md)?),
            };
            self.handle = Some(d.md);
            run = Some(self.region);
        }
        if let Some(r) = self.region {
            let region = r.range;
            if range.len > 0 && !region.covers(&range) {
                return Err(Error::invalid(format!(
                    "{which} descriptor {i} ({} bytes at {:#x}, device {}) lies outside its registered region ({} bytes at {:#x}, device {})",
                    range.len, range.addr, range.dev, region.len, region.addr, region.dev
                )));
            }
        }
        Ok(run)
    }
}

/// Whether every item seen is the same one.
enum Same<T> {
    Unseen,
    All(T),
    Not,
}

impl<T: Copy> Same<T> {
    fn see(&mut self, item: Option<T>, same: impl Fn(&T, &T) -> bool) {
        *self = match (&*self, item) {
            (Same::Unseen, Some(t)) => Same::All(t),
            (Same::All(a), Some(t)) if same(a, &t) => Same::All(*a),
            _ => Same::Not,
        };
    }

    fn get(&self) -> Option<T> {
        match self {
            Same::All(t) => Some(*t),
            _ => None,
        }
    }

    /// What seeing these items and then `next`'s gives.
    fn then(self, next: Same<T>, same: impl Fn(&T, &T) -> bool) -> Same<T> {
        match (self, next) {
            (Same::Unseen, x) | (x, Same::Unseen) => x,
            (Same::All(a), Same::All(b)) if same(&a, &b) => Same::All(a),
            _ => Same::Not,
        }
    }
}

/// What a check reads of a run's region: its range, and the path it
/// belongs to (its bounce instance, or the peer's arena), as an identity.
#[derive(Clone, Copy)]
struct Region<'a> {
    md: &'a Md,
    range: Range,
    /// The address of the local region's bounce instance or the remote
    /// region's peer arena; 0: none.
    path: usize,
}

impl<'a> Region<'a> {
    /// A region of the local side (its path: its bounce instance) or of the
    /// remote side (the peer's arena).
    fn of(md: &'a Md, local: bool) -> Self {
        let path = match local {
            true => md.instance().map_or(0, |b| Arc::as_ptr(b) as usize),
            false => md.arena().map_or(0, |p| Arc::as_ptr(p) as usize),
        };
        Region {
            md,
            range: md.range,
            path,
        }
    }

    /// Whether two local regions have one bounce instance.
    fn same_instance(a: &Self, b: &Self) -> bool {
        a.path == b.path
    }

    /// Whether two remote regions have one peer arena: the same `Arc` when
    /// they came from one remote agent (`Engine::admit_peer_instance`
    /// shares equal ones), compared in full otherwise.
    fn same_arena(a: &Self, b: &Self) -> bool {
        a.path == b.path || a.md.arena() == b.md.arena()
    }
}

/// A [`Region`] as kept between preparations ([`KeptRegions`]).
#[derive(Clone, Copy)]
pub struct KeptRegion {
    md: usize,
    range: Range,
    path: usize,
}

/// The regions the last arena preparation's check met, each side's in the
/// order met, kept so that the next one, which mostly meets the same
/// regions in the same order (vLLM's lists are region-major), reads its
/// runs' regions from two short arrays instead of resolving each through
/// the shim's table and reading its metadata, cold after a transfer: two
/// to four cache misses per run, 64 runs of 512 descriptors in vLLM's
/// 128-token READ. Forgotten whenever any region is released.
#[derive(Default)]
pub struct KeptRegions {
    local: Vec<(usize, KeptRegion)>,
    remote: Vec<(usize, KeptRegion)>,
}

/// What a pass over pairs of both lists found beside its checks: whether
/// every local region has one bounce instance and every remote one one
/// peer arena, and the plan's survey.
struct Facts<'a> {
    /// The local regions' bounce instance.
    instance: Same<Region<'a>>,
    /// The remote regions' peer arena.
    peer: Same<Region<'a>>,
    survey: std::result::Result<Survey, PlanError>,
}

impl<'a> Facts<'a> {
    /// Checks pairs `range` of `local` and `remote` for a transfer `op`
    /// ([`SideCheck`]; the two lengths of each pair must agree), one run
    /// of equal handles at a time, and surveys them into `survey`. The
    /// first check that fails is named; planning's refusal is kept in
    /// the facts, not an error.
    fn of(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        range: std::ops::Range<usize>,
        survey: Survey,
        kept: Option<&mut KeptRegions>,
    ) -> Result<Self> {
        let (lk, rk) = match kept {
            Some(k) => (Some(&mut k.local), Some(&mut k.remote)),
            None => (None, None),
        };
        let (mut lc, mut rc) = (
            SideCheck::new("local", local, lk),
            SideCheck::new("remote", remote, rk),
        );
        let (mut instance, mut peer) = (Same::Unseen, Same::Unseen);
        let mut survey = Ok(survey);
        let mut add = |l: &RawDesc, r: &RawDesc| {
            if let Ok(s) = &mut survey {
                if let Err(e) = s.add(&pair_descriptor(op, l.range(), r.range())) {
                    survey = Err(e);
                }
            }
        };
        // Every check of pair `i`, naming the first that fails; at the
        // first of a run of handles it resolves the run's regions. The two
        // sides' regions (`None`: a null handle).
        let mut full =
            |i: usize, l: &RawDesc, r: &RawDesc| -> Result<(Option<Range>, Option<Range>)> {
                if let Some(region) = lc.step(i, l)? {
                    instance.see(region.filter(|r| r.path != 0), Region::same_instance);
                }
                if let Some(region) = rc.step(i, r)? {
                    peer.see(region.filter(|r| r.path != 0), Region::same_arena);
                }
                if l.len != r.len {
                    return Err(Error::invalid(format!(
                        "descriptor {i}: local length {} differs from remote length {}",
                        l.len, r.len
                    )));
                }
                Ok((lc.region.map(|r| r.range), rc.region.map(|r| r.range)))
            };
        // One run at a time (the descriptors that share both handles, a
        // region's blocks in vLLM's lists): its first pair checked in full,
        // the rest against the run's two regions inline, and in full only
        // to name what is wrong.
        let end = range.end.min(local.raw.len()).min(remote.raw.len());
        let (lraw, rraw) = (&local.raw[..end], &remote.raw[..end]);
        let mut i = range.start;
        while let (Some(l0), Some(r0)) = (lraw.get(i), rraw.get(i)) {
            let (lw, rw) = full(i, l0, r0)?;
            add(l0, r0);
            i += 1;
            while let (Some(l), Some(r)) = (lraw.get(i), rraw.get(i)) {
                if l.md != l0.md || r.md != r0.md {
                    break;
                }
                if !(l.len == r.len && plainly_inside(l, lw) && plainly_inside(r, rw)) {
                    full(i, l, r)?;
                }
                add(l, r);
                i += 1;
            }
        }
        Ok(Facts {
            instance,
            peer,
            survey,
        })
    }

    /// These facts followed by `next`'s, of the pairs right after.
    fn then(self, next: Facts<'a>) -> Facts<'a> {
        Facts {
            instance: self.instance.then(next.instance, Region::same_instance),
            peer: self.peer.then(next.peer, Region::same_arena),
            survey: match (self.survey, next.survey) {
                (Ok(a), Ok(b)) => Ok(a.then(&b)),
                (Err(e), _) | (Ok(_), Err(e)) => Err(e),
            },
        }
    }
}

/// A plan packed in the check's own pass over NIXL's lists, before its
/// survey is known ([`Checked::in_parts`]): from the first pair, assuming
/// every descriptor is of its length and devices ([`Survey::uniform`]) and
/// that the arena path of the local regions' bounce instance takes it.
/// What the pass finds otherwise is dropped (the run lists go back to
/// their pool) and the plan is made the usual way, after routing.
pub struct Packing {
    /// The local regions' bounce instance the plan is for.
    instance: Arc<Bounce>,
    spec: PackSpec,
}

impl Packing {
    /// The packing of `local` to `remote` for a transfer `op`, when their
    /// first pair names a local bounce instance and a peer arena and the
    /// plan would be cut by whole chunks.
    fn of(op: Op, local: &Descs<'_>, remote: &Descs<'_>) -> Option<Packing> {
        let (l0, r0) = (local.raw.first()?, remote.raw.first()?);
        let mixed = local.kind != remote.kind;
        let instance = local.md(l0.md)?.instance_for(mixed)?.clone();
        remote.md(r0.md)?.arena_for(mixed)?;
        let first = pair_descriptor(op, l0.range(), r0.range());
        let runtime = &instance.runtime;
        let spec = PackSpec::new(
            Survey::uniform(&first, local.len()),
            runtime.plan_options(),
            runtime.run_pool().clone(),
        )?;
        Some(Packing { instance, spec })
    }
}

/// The chunks a check packed, with the packing they assumed and how the
/// pool's workers helped.
struct EarlyPlan {
    packing: Packing,
    chunks: Vec<plan::Chunk>,
    help: peer::FillHelp,
}

/// What packing a plan's chunks before its survey is known assumes: the
/// survey, and the cut it gives.
pub struct PackSpec {
    survey: Survey,
    /// The chunk cap, and the descriptors a chunk holds.
    cap: u64,
    per_chunk: usize,
    merge: bool,
    pool: crate::proto::RunPool,
}

impl PackSpec {
    /// `None` when the plan would not be cut by whole chunks.
    fn new(
        survey: Survey,
        options: plan::PlanOptions,
        pool: crate::proto::RunPool,
    ) -> Option<Self> {
        if options.max_chunk_bytes < plan::REGION_ALIGN {
            return None;
        }
        let cut = plan::cut(&survey, &options);
        Some(PackSpec {
            survey,
            cap: cut.cap,
            per_chunk: cut.per_chunk?,
            merge: options.merge_runs,
            pool,
        })
    }
}

/// Both sides of a transfer for the checked paths, every descriptor
/// checked ([`SideCheck`]; the two lengths of each pair must agree) in one
/// pass over NIXL's two lists, which also gathers what the bounce arena's
/// routing and plan read of every descriptor. A 32,768-descriptor list is
/// read once, where separate checks, comparisons, region scans, sums and
/// the plan's own checks read it seven times (2 MiB each).
pub struct Checked<'a> {
    pub local: Side<'a>,
    pub remote: Side<'a>,
    /// The bounce instance of every local region, when they share one.
    local_instance: Option<&'a Arc<Bounce>>,
    /// The peer's bounce arena of every remote region, when they share one.
    peer: Option<&'a Arc<PeerBounce>>,
    /// The plan's survey of the descriptors, source to destination, or why
    /// they cannot be planned.
    survey: std::result::Result<Survey, PlanError>,
}

impl<'a> Checked<'a> {
    /// Checks `local` and `remote` (of equal lengths) for a transfer `op`.
    pub fn new(op: Op, local: Descs<'a>, remote: Descs<'a>) -> Result<Self> {
        Checked::with_kept(op, local, remote, None)
    }

    /// [`Checked::new`], reading the regions the last preparation met from
    /// `kept` where it meets them again (and keeping the ones it resolves).
    pub fn with_kept(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        kept: Option<&mut KeptRegions>,
    ) -> Result<Self> {
        let facts = Facts::of(op, local, remote, 0..local.len(), Survey::default(), kept)?;
        Ok(Checked::from_facts(local, remote, facts))
    }

    /// [`Checked::new`] in parts on `fill`'s threads beside this one, each
    /// part checked and surveyed apart ([`Survey::part`]) and the facts put
    /// together in order, so the first error is the one a single pass
    /// names; how the pool's workers helped; and, with `packing`, the
    /// chunks each part packed right after checking them (while its
    /// descriptors are in the cache), when every part could. A packing
    /// whose parts of whole chunks would be fewer than the pool's threads
    /// is not done (the check would lose its threads to it). `None`: the
    /// lists are empty or the pool declined (held by another preparation).
    pub fn in_parts(
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        fill: &peer::FillPool,
        packing: Option<&PackSpec>,
    ) -> Option<(Result<Self>, peer::FillHelp, Option<Vec<plan::Chunk>>)> {
        let n = local.len().min(remote.len());
        let first = pair_descriptor(op, local.raw.first()?.range(), remote.raw.first()?.range());
        // Parts of whole chunks when packing, unless they would be fewer
        // than the pool's threads.
        let (mut packing, mut parts) = (packing, fill.parts(n, packing.map_or(1, |p| p.per_chunk)));
        if packing.is_some() && parts.len() <= fill.pool.current_num_threads() {
            (packing, parts) = (None, fill.parts(n, 1));
        }
        let (parts, help) = fill.share(parts, |range| {
            let survey = Survey::part(&first, range.start);
            let facts = Facts::of(op, local, remote, range.clone(), survey, None);
            let chunks = match (&facts, packing) {
                // Every descriptor of the part is the first's length (the
                // part's survey holds it to descriptor 0's).
                (Ok(Facts { survey: Ok(s), .. }), Some(p)) if s.one_len() => {
                    let descriptors = pair_descriptors(op, local, remote, range.clone());
                    plan::pack(descriptors, range.start, &p.survey, p.cap, p.merge, &p.pool).ok()
                }
                _ => None,
            };
            Some((facts, chunks))
        })?;
        let (mut facts, mut chunks): (Option<Facts<'a>>, Option<Vec<_>>) =
            (None, packing.map(|_| Vec::new()));
        for (part, packed) in parts {
            let part = match part {
                Ok(part) => part,
                Err(e) => return Some((Err(e), help, None)),
            };
            facts = Some(match facts {
                Some(f) => f.then(part),
                None => part,
            });
            chunks = chunks.zip(packed).map(|(mut all, part)| {
                all.extend(part);
                all
            });
        }
        Some((Ok(Checked::from_facts(local, remote, facts?)), help, chunks))
    }

    fn from_facts(local: Descs<'a>, remote: Descs<'a>, facts: Facts<'a>) -> Self {
        // Memory of two kinds takes the GPU side's host-staged instance.
        let mixed = local.kind != remote.kind;
        Checked {
            local: Side(local),
            remote: Side(remote),
            local_instance: facts.instance.get().and_then(|r| r.md.instance_for(mixed)),
            peer: facts.peer.get().and_then(|r| r.md.arena_for(mixed)),
            survey: facts.survey,
        }
    }

    /// The transfer's descriptors, source to destination (what was
    /// surveyed).
    fn descriptors(&self, op: Op) -> impl Iterator<Item = Descriptor> + 'a {
        self.descriptors_in(op, 0..self.local.len())
    }

    /// Descriptors `range` of [`Checked::descriptors`].
    fn descriptors_in(
        &self,
        op: Op,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = Descriptor> + 'a {
        pair_descriptors(op, self.local.0, self.remote.0, range)
    }
}

/// Pairs `range` of `local` and `remote` as the plan's source ->
/// destination descriptors ([`pair_descriptor`]).
fn pair_descriptors<'a>(
    op: Op,
    local: Descs<'a>,
    remote: Descs<'a>,
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = Descriptor> + 'a {
    local.raw[range.clone()]
        .iter()
        .zip(&remote.raw[range])
        .map(move |(l, r)| pair_descriptor(op, l.range(), r.range()))
}

/// Whether a descriptor passes [`SideCheck::step`] in a run whose region
/// is `region` (`None`: a null handle), without building its error.
#[inline]
fn plainly_inside(d: &RawDesc, region: Option<Range>) -> bool {
    let range = d.range();
    range.end().is_some() && region.is_none_or(|w| range.len == 0 || w.covers(&range))
}

/// A pair of descriptors as the plan's source -> destination: local to
/// remote for a WRITE, remote to local for a READ.
fn pair_descriptor(op: Op, l: Range, r: Range) -> Descriptor {
    let (src, dst) = match op {
        Op::Write => (l, r),
        Op::Read => (r, l),
    };
    Descriptor {
        src_addr: src.addr as u64,
        src_dev: src.dev as u32,
        dst_addr: dst.addr as u64,
        dst_dev: dst.dev as u32,
        len: l.len as u64,
    }
}

/// One side of a transfer whose every descriptor was checked
/// ([`Engine::check`]).
#[derive(Clone, Copy)]
pub struct Side<'a>(Descs<'a>);

impl std::fmt::Debug for Side<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("kind", &self.0.kind)
            .field("descriptors", &self.len())
            .finish()
    }
}

impl<'a> Side<'a> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Descriptor `i`'s range.
    pub fn range(&self, i: usize) -> Range {
        self.0.raw[i].range()
    }

    /// Each descriptor's range and metadata.
    pub fn iter(&self) -> impl Iterator<Item = (Range, Option<&'a Md>)> + 'a {
        let mut md = self.mds();
        self.0.raw.iter().map(move |d| (d.range(), md(d.md)))
    }

    /// Resolves descriptors' metadata, once per run of equal handles.
    fn mds(&self) -> impl FnMut(*const std::ffi::c_void) -> Option<&'a Md> + 'a {
        let descs = self.0;
        let mut last: (*const std::ffi::c_void, Option<&'a Md>) = (std::ptr::null(), None);
        move |p| {
            if p != last.0 {
                last = (p, descs.md(p));
            }
            last.1
        }
    }

    /// Each descriptor's range.
    pub fn ranges(&self) -> impl Iterator<Item = Range> + 'a {
        self.0.raw.iter().map(RawDesc::range)
    }

    /// The descriptors' metadata, each run of equal handles once (routing
    /// looks at regions, not descriptors).
    pub fn distinct_mds(&self) -> impl Iterator<Item = Option<&'a Md>> + 'a {
        let mut last: Option<*const std::ffi::c_void> = None;
        let mut md = self.mds();
        self.0.raw.iter().filter_map(move |d| {
            if last == Some(d.md) {
                return None;
            }
            last = Some(d.md);
            Some(md(d.md))
        })
    }
}

impl RawDesc {
    fn range(&self) -> Range {
        Range {
            addr: self.addr,
            len: self.len,
            dev: self.dev,
        }
    }
}

/// What routing looks at before any descriptor: the memory kinds, the
/// descriptor count and their total length, and whether the transfer stays
/// within this agent.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub local: MemKind,
    pub remote: MemKind,
    pub descriptors: u64,
    pub bytes: TotalBytes<'a>,
    pub local_transfer: bool,
}

/// The total length of a transfer's descriptors: known, or summed when a
/// gate first asks for it (and kept in the cell for the next). Only gates
/// with a size limit ask, and the peer-mapped path's default gate has
/// none: the real clients' transfers it takes are then read once, by the
/// table's pass, not twice (a sum over 32,768 descriptors reads 1 MiB).
#[derive(Debug, Clone, Copy)]
pub enum TotalBytes<'a> {
    Known(u64),
    Of(&'a [RawDesc], &'a std::cell::OnceCell<u64>),
}

impl TotalBytes<'_> {
    pub fn get(self) -> u64 {
        match self {
            TotalBytes::Known(b) => b,
            TotalBytes::Of(d, sum) => *sum.get_or_init(|| d.iter().map(|d| d.len as u64).sum()),
        }
    }
}

impl From<u64> for TotalBytes<'_> {
    fn from(b: u64) -> Self {
        TotalBytes::Known(b)
    }
}

/// A transfer request owned by NIXL's request handle.
pub struct Request {
    route: Route,
    args: XferArgs,
}

enum Route {
    /// The bounce path.
    Bounce(BounceXfer),
    /// The peer-mapped path: one kernel through a mapping of the peer's
    /// memory.
    PeerMapped(peer::PeerXfer),
    /// The CMA path: DRAM copied straight to or from the peer process.
    Cma(CmaRequest),
}

struct CmaRequest {
    xfer: cma::CmaXfer,
    /// The peer's inner agent (target of the completion notification).
    peer_inner: Arc<str>,
    limit: std::time::Duration,
    reported: bool,
}

struct BounceXfer {
    /// A READ from the peer (else a WRITE to it).
    read: bool,
    /// The local instance that runs it.
    instance: Arc<Bounce>,
    peer: PeerId,
    peer_arena: Arc<PeerBounce>,
    /// The peer's inner agent (target of the completion notification).
    peer_inner: Arc<str>,
    /// Made when the request is prepared; every post submits it.
    plan: Arc<Plan>,
    ticket: Option<Arc<Ticket>>,
    reported: bool,
}

impl Request {
    /// Whether this request took the bounce path.
    pub fn is_bounce(&self) -> bool {
        matches!(self.route, Route::Bounce(_))
    }
    /// Whether this request took the peer-mapped path.
    pub fn is_peer_mapped(&self) -> bool {
        matches!(self.route, Route::PeerMapped(_))
    }
    /// Whether this request took the CMA path.
    pub fn is_cma(&self) -> bool {
        matches!(self.route, Route::Cma(_))
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("bounce", &self.is_bounce())
            .field("peer_mapped", &self.is_peer_mapped())
            .field("cma", &self.is_cma())
            .field("args", &self.args)
            .finish_non_exhaustive()
    }
}

/// What this engine knows about a remote agent.
#[derive(Debug, Clone)]
struct Remote {
    /// Its inner agent's name: shared, since every preparation takes it.
    inner: Arc<str>,
    /// The peer's bounce instances whose arena metadata we loaded.
    bounce_peers: HashSet<PeerId>,
    /// The peer arenas its regions carry, one `Arc` for equal ones: a
    /// preparation compares its regions' arenas by pointer, where comparing
    /// their names read two cold strings per run of descriptors (18 us of a
    /// 512-descriptor check).
    arenas: Vec<Arc<PeerBounce>>,
}

/// Bounce instances by memory location (`None`: set-up failed, not retried).
type Instances = Arc<Mutex<HashMap<Location, Option<Arc<Bounce>>>>>;

/// Per-transfer settings carried in NIXL's backend custom parameter, as
/// `key=value` pairs separated by `;` or `,`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferParams {
    /// Per-request deadline override in milliseconds.
    pub deadline_ms: Option<u64>,
}

impl TransferParams {
    pub fn parse(raw: &[u8]) -> Result<Self> {
        let text = std::str::from_utf8(raw)
            .map_err(|_| Error::invalid("the transfer's custom parameter is not UTF-8 text"))?;
        let mut out = Self::default();
        for item in text
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                Error::invalid(format!(
                    "custom parameter item {item:?} is not key=value (known keys: deadline_ms, worker_id)"
                ))
            })?;
            match k.trim() {
                "deadline_ms" => {
                    let ms = v.trim().parse::<u64>().map_err(|_| {
                        Error::invalid(format!("custom parameter deadline_ms={v:?} is not a whole number of milliseconds"))
                    })?;
                    out.deadline_ms = Some(ms);
                }
                // UCX's: the shared worker a UCX-routed transfer runs on.
                "worker_id" => {}
                other => {
                    return Err(Error::invalid(format!(
                    "unknown custom parameter key {other:?} (known keys: deadline_ms, worker_id)"
                )))
                }
            }
        }
        Ok(out)
    }
}

/// The backend engine. Thread-safe: NIXL may call it from many threads.
pub struct Engine {
    local_name: String,
    inner_name: Arc<str>,
    inner: Agent,
    /// The UCX delegate's parameters: the backend parameters that are UCX's
    /// (the inner agent's UCX backend gets them less
    /// [`params::INNER_OMITTED_KEYS`]).
    ucx_params: Vec<(String, String)>,
    /// The inner agent's metadata from its creation (its connection only):
    /// part of the data path a READ describes.
    inner_md: Vec<u8>,
    /// Outer remote agent name -> what we know of it (shared with
    /// `readers`, which must not invalidate an agent the application loaded).
    remotes: Arc<Mutex<HashMap<String, Remote>>>,
    /// Readers' agents loaded to serve their READs.
    readers: Arc<bounce::ReaderAgents>,
    broken: AtomicBool,
    config: Config,
    failpoints: Failpoints,
    hub: Arc<NotifHub>,
    /// The bounce path: one instance per memory location in use.
    instances: Instances,
    /// The peer-mapped path: exports, mappings, copiers.
    peer: peer::PeerMaps,
    /// The CMA path: its export, proven peers, copy threads.
    cma: Arc<cma::Cma>,
    /// The regions the last arena check met (one check at a time keeps
    /// them; a concurrent one resolves its own).
    kept_regions: Mutex<KeptRegions>,
    /// Counters and identity, published for `nixl_bounce_stats`.
    pub stats: Arc<EngineStats>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("local", &self.local_name)
            .field("inner", &self.inner_name)
            .finish()
    }
}

/// Why a transfer of this shape goes to the UCX delegate before anything
/// per descriptor is looked at; `None`: one of BOUNCE's paths may take it.
/// With `sum_first` false the arena's gate counts descriptors only: its
/// size limit is then applied by [`bounce::route`] with the byte total
/// the check's pass finds (see [`Engine::sums_first`]).
pub fn early_reason(
    cfg: &Config,
    shape: &Shape,
    sum_first: impl FnOnce() -> bool,
) -> Option<Fallback> {
    if !cfg.enabled || shape.local_transfer {
        Some(below_floor_reason(cfg, shape.local_transfer))
    } else if peer::gate(cfg, shape).is_ok() || cma_shape(cfg, shape) {
        None
    } else {
        arena_early_gate(cfg, shape, sum_first).err()
    }
}

/// The arena's gate before the check: in full, or its descriptor count
/// only when it has a size limit and `sum_first` (asked only then) says
/// the limit waits for the check's byte total.
fn arena_early_gate(
    cfg: &Config,
    shape: &Shape,
    sum_first: impl FnOnce() -> bool,
) -> std::result::Result<(), Fallback> {
    let gate = bounce::arena_gate(cfg, shape.local, shape.remote);
    if gate.max_average_bytes == 0 || sum_first() {
        gate.admit(shape.descriptors, shape.bytes)
    } else {
        bounce::ShapeGate {
            max_average_bytes: 0,
            ..gate
        }
        .admit(shape.descriptors, shape.bytes)
    }
}

/// NIXL's two lists pair descriptor by descriptor.
fn same_counts(local: usize, remote: usize) -> Result<()> {
    if local == remote {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{local} local descriptors but {remote} remote descriptors"
        )))
    }
}

/// Whether the CMA path's gate takes a transfer of this shape (DRAM on
/// both sides, enough descriptors); its peer is checked later.
fn cma_shape(cfg: &Config, shape: &Shape) -> bool {
    cfg.enabled
        && cfg.enable_cma
        && !shape.local_transfer
        && shape.local == MemKind::Dram
        && shape.remote == MemKind::Dram
        && bounce::cma_gate(cfg)
            .admit(shape.descriptors, shape.bytes)
            .is_ok()
}

/// The fewest descriptors that any of BOUNCE's own paths takes between
/// memory of kinds `local` and `remote` (`u64::MAX`: none takes any). A
/// transfer with fewer goes to UCX whatever else it is, for the reason
/// [`below_floor_reason`] gives, as [`early_reason`] would decide: the shim
/// reads the floors once, so that the commonest UCX-routed transfers (a few
/// descriptors) are handed to the delegate without entering this engine.
pub fn route_floor(cfg: &Config, local: MemKind, remote: MemKind) -> u64 {
    if !cfg.enabled {
        return u64::MAX;
    }
    let arena = bounce::arena_gate(cfg, local, remote)
        .min_descriptors
        .max(1);
    if cfg.enable_peer_map && local == MemKind::Vram && remote == MemKind::Vram {
        arena.min(bounce::peer_map_gate(cfg).min_descriptors.max(1))
    } else if cfg.enable_cma && local == MemKind::Dram && remote == MemKind::Dram {
        arena.min(bounce::cma_gate(cfg).min_descriptors.max(1))
    } else {
        arena
    }
}

/// Why a transfer with fewer descriptors than its [`route_floor`] goes to
/// UCX: what [`early_reason`] says of it (and, with bounce off or within
/// the agent, of any transfer).
pub fn below_floor_reason(cfg: &Config, local_transfer: bool) -> Fallback {
    if !cfg.enabled {
        Fallback::BounceDisabled
    } else if local_transfer {
        Fallback::LocalTransfer
    } else {
        Fallback::TooFewDescriptors
    }
}

impl Engine {
    /// Creates the engine for agent `local_name` with the backend parameters
    /// given to `createBackend("BOUNCE", params)`.
    pub fn new(local_name: &str, params: BTreeMap<String, String>) -> Result<Self> {
        crate::logging::init();
        if local_name.is_empty() {
            return Err(Error::invalid("the agent name is empty"));
        }
        crate::nixl_runtime::ensure_capi_loaded().map_err(|e| Error::new(Status::Backend, e))?;

        let inner_name = format!("{local_name}{INNER_SUFFIX}");
        // NIXL's default progress thread polls without ever sleeping
        // (pthr_delay_us = 0): two idle inner agents kept both cores of the
        // CI machine busy and halved the speed of every copy (measured in
        // docs/benchmarks.md). Completions are still detected at once: the
        // reactor and NIXL's checkXfer/getNotifs progress the worker when
        // they poll; the thread only has to make background progress.
        let config = AgentConfig {
            thread_sync: ThreadSync::Strict,
            pthr_delay_us: INNER_PROGRESS_DELAY_US,
            ..AgentConfig::default()
        };
        let inner = Agent::new_configured(&inner_name, &config)
            .map_err(|e| Error::nixl("creating the inner agent", e))?;

        let (_mems, ucx_defaults) = inner
            .get_plugin_params("UCX")
            .map_err(|e| Error::nixl("querying the UCX plugin's parameters", e))?;
        let ucx_keys: Vec<String> = ucx_defaults
            .iter()
            .map_err(|e| Error::nixl("reading the UCX plugin's parameters", e))?
            .filter_map(|p| p.ok().map(|(key, _)| key.to_string()))
            .collect();
        let mut split = params::split(&params, &ucx_keys, &Config::known_param_keys())
            .map_err(Error::invalid)?;
        params::add_ucx_from_env(&mut split.ucx, &ucx_keys, &|name: &str| {
            std::env::var(name).ok()
        });
        let (config, warnings) =
            Config::resolve(&|name: &str| std::env::var(name).ok(), &split.bounce)
                .map_err(|e| Error::invalid(format!("BOUNCE configuration: {e}")))?;
        // Explicit backend parameters are strict: a value that cannot be used
        // is an error (environment variables fall back with a warning).
        if let Some(w) = warnings
            .iter()
            .find(|w| matches!(w.source, ConfigSource::Param(_)))
        {
            return Err(Error::invalid(format!("bad BOUNCE backend parameter: {w}")));
        }

        let inner_ucx = params::inner_params(&split.ucx);
        let inner_ucx_params =
            Params::from(inner_ucx.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .map_err(|e| Error::nixl("building the UCX parameters", e))?;
        inner.create_backend("UCX", &inner_ucx_params).map_err(|e| {
            Error::new(
                Status::InvalidParam,
                format!(
                    "the inner UCX backend rejected its parameters {inner_ucx:?} ({e}); check their values"
                ),
            )
        })?;

        let failpoints = Failpoints::from_env();
        // User notifications and (optionally) bounce control messages share
        // the inner agent's notification stream; the hub splits them.
        let hub = Arc::new(NotifHub::new(Arc::new(inner.clone())));
        let instances: Instances = Arc::new(Mutex::new(HashMap::new()));
        let inner_md = inner
            .get_local_md()
            .map_err(|e| Error::nixl("reading the inner agent's metadata", e))?;

        let remotes = Arc::new(Mutex::new(HashMap::new()));
        let cma = Arc::new(cma::Cma::new(&config));
        let readers = Arc::new(bounce::ReaderAgents::new(
            inner.clone(),
            inner_name.clone(),
            remotes.clone(),
            config.use_nixl_notifications,
            cma.clone(),
            &failpoints,
        ));
        let stats = EngineStats::new(local_name, params);
        stats.set_source(instances_stats(instances.clone(), readers.clone()));
        tracing::info!(agent = local_name, inner = %inner_name, bounce = config.enabled, "BOUNCE engine created");
        let peer = peer::PeerMaps::new(&config);
        Ok(Self {
            peer,
            cma,
            kept_regions: Mutex::new(KeptRegions::default()),
            local_name: local_name.to_string(),
            inner_name: inner_name.into(),
            inner,
            ucx_params: split.ucx.clone().into_iter().collect(),
            inner_md,
            remotes,
            readers,
            broken: AtomicBool::new(false),
            stats,
            config,
            failpoints,
            hub,
            instances,
        })
    }

    pub fn local_name(&self) -> &str {
        &self.local_name
    }

    /// Marks the engine unusable (after a panic crossed into the FFI layer).
    pub fn mark_broken(&self) {
        self.broken.store(true, Ordering::SeqCst);
        EngineStats::bump(&self.stats.counters.panics);
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// The bounce instance for `location`, started on first use. A set-up
    /// failure is logged once and that location stays on the standard path.
    fn instance(&self, location: Location) -> Option<Arc<Bounce>> {
        if !self.config.enabled {
            return None;
        }
        let mut map = self.instances.locked();
        if let Some(existing) = map.get(&location) {
            return existing.clone();
        }
        let started = if self.config.use_nixl_notifications && !map.is_empty() {
            // One notification channel per inner agent: its endpoint cannot
            // tell two instances apart.
            Err("control over NIXL notifications serves one memory location per agent".to_string())
        } else {
            let shared = bounce::Shared {
                inner: &self.inner,
                inner_name: &self.inner_name,
                inner_md: &self.inner_md,
                hub: &self.hub,
                agent: &self.local_name,
                config: &self.config,
                failpoints: &self.failpoints,
                readers: &self.readers,
                cma: &self.cma,
            };
            Bounce::start(&shared, location).map(Arc::new)
        };
        let instance = match started {
            Ok(b) => Some(b),
            Err(e) if location.host_staged => {
                tracing::warn!(agent = %self.local_name, %location, "host-staged arena unavailable; this GPU's transfers with DRAM use its own arena: {e}");
                None
            }
            Err(e) => {
                tracing::warn!(agent = %self.local_name, %location, "bounce path unavailable for this memory, it uses UCX: {e}");
                None
            }
        };
        map.insert(location, instance.clone());
        instance
    }

    // ---- memory ----------------------------------------------------------------

    /// Registers memory the UCX delegate registered too; `ucx_public` is the
    /// delegate's public data of it, which travels inside ours.
    pub fn register_mem(&self, range: Range, kind: MemKind, ucx_public: &[u8]) -> Result<Box<Md>> {
        if range.len == 0 || range.end().is_none() {
            return Err(Error::invalid(format!(
                "cannot register {} bytes at {:#x}",
                range.len, range.addr
            )));
        }
        EngineStats::bump(&self.stats.counters.registrations);
        let bounce = self.instance(Location::of(kind, range.dev));
        // A GPU's host-staged instance moves its memory to and from DRAM.
        // Over NIXL notifications an agent has one instance, so there the
        // location's own serves mixed transfers too.
        let staged = match kind {
            MemKind::Vram
                if bounce.is_some()
                    && self.config.mixed_host_staging
                    && !self.config.use_nixl_notifications =>
            {
                self.instance(Location::staged(range.dev))
            }
            _ => None,
        };
        for b in bounce.iter().chain(&staged) {
            b.runtime.targets.add(range.addr, range.len);
        }
        let peer_map = match kind {
            MemKind::Vram if self.config.enabled && self.config.enable_peer_map => {
                match self
                    .peer
                    .export(range.dev, range.addr as u64, range.len as u64)
                {
                    Ok(e) => {
                        self.stats.bump_named("peer_map_exported");
                        Some(e)
                    }
                    Err(e) => {
                        tracing::info!(
                            addr = range.addr,
                            len = range.len,
                            "VRAM region not exported for peer mapping: {e}"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        let public_data = PublicData {
            region_md: ucx_public.to_vec(),
            bounce: bounce.as_deref().map(PublicBounce::of),
            staged: staged.as_deref().map(PublicBounce::of),
            peer_map,
            // A VRAM region's block is for its host-staged arena's chunk
            // writes only (the CMA path itself takes DRAM on both sides).
            cma: match kind {
                MemKind::Dram => self.cma.export(),
                MemKind::Vram => staged.as_ref().and_then(|_| self.cma.export()),
            },
        }
        .encode();
        Ok(Box::new(Md {
            magic: MD_MAGIC,
            range,
            kind,
            owner: MdOwner::Registered {
                public_data,
                bounce,
                staged,
            },
        }))
    }

    /// Forgets what preparations keep of the regions they met: the peer-mapped
    /// path's windows and the arena check's kept regions. Called before any
    /// region leaves the shim's table (while no preparation runs) and again
    /// when it is released.
    pub fn forget_regions(&self) {
        self.peer.forget_windows();
        *self.kept_regions.locked() = KeptRegions::default();
    }

    /// Releases registered memory or loaded metadata.
    // Boxed on purpose: the shim's table held this allocation, and its
    // magic is cleared in place before it is freed, so a stale pointer
    // read later fails `is_valid` rather than passing it.
    #[allow(clippy::boxed_local)]
    pub fn release_md(&self, mut md: Box<Md>) -> Result<()> {
        // No preparation may find this region's window from now on (first:
        // the handle is freed even when it is refused below). The shim has
        // done so already, before the handle left its table.
        self.forget_regions();
        if !md.is_valid() {
            return Err(Error::invalid("metadata handle is not a BOUNCE handle"));
        }
        md.magic = 0;
        if let MdOwner::Registered { bounce, staged, .. } = &md.owner {
            EngineStats::bump(&self.stats.counters.deregistrations);
            if md.kind == MemKind::Dram
                && !self.cma.quiesce(md.range, crate::runtime::QUIESCE_BOUND)
            {
                tracing::error!(
                    addr = md.range.addr,
                    len = md.range.len,
                    "deregistered memory is still used by a CMA copy"
                );
            }
            // No instance takes new work on the region while another
            // drains it: forget it everywhere first, then wait.
            for b in bounce.iter().chain(staged) {
                b.runtime
                    .targets
                    .remove(md.range.addr, md.range.len, std::time::Duration::ZERO);
            }
            for b in bounce.iter().chain(staged) {
                // The user may free the memory once we return: wait until no
                // gather or scatter still touches it.
                if !b.runtime.targets.remove(
                    md.range.addr,
                    md.range.len,
                    crate::runtime::QUIESCE_BOUND,
                ) {
                    tracing::error!(
                        addr = md.range.addr,
                        len = md.range.len,
                        "deregistered memory is still used by a copy that could not be stopped"
                    );
                }
            }
        }
        Ok(())
    }

    pub fn public_data(&self, md: &Md) -> Result<Vec<u8>> {
        match &md.owner {
            MdOwner::Registered { public_data, .. } => Ok(public_data.clone()),
            _ => Err(Error::invalid(
                "public data exists only for memory registered by this agent",
            )),
        }
    }

    /// The backend parameters for the UCX delegate.
    pub fn ucx_params(&self) -> &[(String, String)] {
        &self.ucx_params
    }

    /// The UCX delegate's progress-thread delay in us, if BOUNCE sets one
    /// (else the application's).
    pub fn ucx_progress_delay_us(&self) -> Option<u64> {
        (self.config.ucx_progress_delay_us > 0).then_some(self.config.ucx_progress_delay_us)
    }

    /// Our connection info, carrying the UCX delegate's (`ucx_conn`).
    pub fn conn_info(&self, ucx_conn: &[u8]) -> Vec<u8> {
        ConnInfo {
            inner_md: self.inner_md.clone(),
            ucx_conn: ucx_conn.to_vec(),
        }
        .encode()
    }

    /// Loads a peer's connection info; returns the connection info of its
    /// UCX delegate, for ours.
    pub fn load_remote_conn_info(&self, remote: &str, info: &[u8]) -> Result<Vec<u8>> {
        let info = ConnInfo::decode(info).map_err(|e| {
            Error::new(
                Status::Mismatch,
                format!("connection info of agent {remote:?} is malformed: {e}"),
            )
        })?;
        // Held from the load to the record: a reader's agent is invalidated
        // (`ReaderAgents::unload`) only under this lock and only when no
        // remote names it, so it cannot undo this load in between.
        let mut remotes = self.remotes.locked();
        let inner_remote = self
            .inner
            .load_remote_md(&info.inner_md)
            .map_err(|e| Error::nixl(&format!("loading agent {remote:?}'s connection"), e))?;
        let expected = format!("{remote}{INNER_SUFFIX}");
        if inner_remote != expected {
            tracing::warn!(
                remote,
                inner_remote,
                expected,
                "peer's inner agent is not named after it"
            );
        }
        remotes.insert(
            remote.to_string(),
            Remote {
                inner: inner_remote.into(),
                bounce_peers: HashSet::new(),
                arenas: Vec::new(),
            },
        );
        tracing::debug!(remote, "loaded connection info");
        Ok(info.ucx_conn)
    }

    /// Admits the bounce instance a peer advertised with one of its regions.
    /// An absent, unreadable or incompatible one is not an error: transfers to
    /// that memory use the standard path, decided now rather than after a
    /// timeout.
    fn admit_peer_instance(
        &self,
        remote: &str,
        inner_remote: &str,
        public: &PublicBounce,
        cma: Option<Arc<cma::CmaPeer>>,
    ) -> Option<Arc<PeerBounce>> {
        if !self.config.enabled {
            return None;
        }
        let kind = MemKind::from_nixl(i32::from(public.kind)).ok()?;
        let peer = match Handshake::decode(&public.handshake) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(
                    remote,
                    "peer's bounce handshake is unreadable ({e}); using UCX for that memory"
                );
                return None;
            }
        };
        let admitted = match bounce::admit(&self.config, kind, inner_remote, &peer, cma) {
            Ok(p) => p,
            Err((counter, why)) => {
                self.stats.bump_named(counter);
                tracing::info!(
                    remote,
                    "peer's bounce path is incompatible ({why}); using UCX for that memory"
                );
                return None;
            }
        };
        let mut remotes = self.remotes.locked();
        let entry = remotes.get_mut(remote)?;
        if !entry.bounce_peers.contains(&admitted.id) {
            // The peer's arena registration: lets our inner agent write into it.
            if let Err(e) = self.inner.load_remote_md(&public.arena_md) {
                tracing::warn!(
                    remote,
                    "cannot load the peer's arena metadata ({e}); using UCX for that memory"
                );
                return None;
            }
            entry.bounce_peers.insert(admitted.id.clone());
            tracing::debug!(remote, peer = %admitted.id, "peer instance is bounce-capable");
        }
        if let Some(known) = entry.arenas.iter().find(|a| ***a == admitted) {
            return Some(known.clone());
        }
        let admitted = Arc::new(admitted);
        entry.arenas.push(admitted.clone());
        Some(admitted)
    }

    /// Loads a peer's region; returns its metadata and the public data of the
    /// region for the UCX delegate.
    pub fn load_remote_md(
        &self,
        remote: &str,
        range: Range,
        kind: MemKind,
        public_data: &[u8],
    ) -> Result<(Box<Md>, Vec<u8>)> {
        if range.end().is_none() {
            return Err(Error::invalid(format!(
                "agent {remote:?}'s region of {} bytes at {:#x} wraps around the address space",
                range.len, range.addr
            )));
        }
        let inner_remote = self.inner_remote(remote)?;
        let public = PublicData::decode(public_data).map_err(|e| {
            Error::new(
                Status::Mismatch,
                format!("region metadata of agent {remote:?} is malformed: {e}"),
            )
        })?;
        // The peer's process, proven on this host: the CMA path for its
        // DRAM, and chunk writes into its host arenas.
        let cma_peer = match &public.cma {
            Some(e) if remote != self.local_name => self.cma.peer(e),
            _ => None,
        };
        let md = Box::new(Md {
            magic: MD_MAGIC,
            range,
            kind,
            owner: MdOwner::Remote {
                agent: remote.to_string(),
                bounce: public.bounce.as_ref().and_then(|b| {
                    self.admit_peer_instance(remote, &inner_remote, b, cma_peer.clone())
                }),
                staged: match kind {
                    MemKind::Vram => public.staged.as_ref().and_then(|b| {
                        self.admit_peer_instance(remote, &inner_remote, b, cma_peer.clone())
                    }),
                    MemKind::Dram => None,
                },
                peer: match (kind, &public.peer_map) {
                    (MemKind::Vram, Some(e)) if remote != self.local_name => {
                        self.peer.remote(e, range.addr as u64, range.len as u64)
                    }
                    _ => None,
                },
                mapped: std::sync::OnceLock::new(),
                cma: match kind {
                    MemKind::Dram => cma_peer,
                    MemKind::Vram => None,
                },
            },
        });
        Ok((md, public.region_md))
    }

    pub fn load_local_md(&self, input: &Md) -> Result<Box<Md>> {
        match input.owner {
            MdOwner::Registered { .. } => Ok(Box::new(Md {
                magic: MD_MAGIC,
                range: input.range,
                kind: input.kind,
                owner: MdOwner::LocalTarget,
            })),
            _ => Err(Error::invalid(
                "local metadata can only be loaded for memory registered by this agent",
            )),
        }
    }

    // ---- connections -------------------------------------------------------------

    pub fn connect(&self, remote: &str) -> Result<()> {
        if remote == self.local_name {
            return Ok(());
        }
        let inner_remote = self.inner_remote(remote)?;
        self.inner
            .make_connection(&inner_remote, None)
            .map_err(|e| Error::nixl(&format!("connecting to agent {remote:?}"), e))
    }

    pub fn disconnect(&self, remote: &str) -> Result<()> {
        let known = self.remotes.locked().remove(remote);
        if let Some(Remote {
            inner: inner_remote,
            bounce_peers,
            ..
        }) = known
        {
            let instances: Vec<Arc<Bounce>> = self
                .instances
                .locked()
                .values()
                .flatten()
                .cloned()
                .collect();
            for peer in &bounce_peers {
                for b in &instances {
                    b.forget_peer(peer);
                }
            }
            // The owner side may have forgotten this reader's agent already
            // (engine::bounce::ReaderAgents); nothing is left to undo then.
            if let Err(e) = self.inner.invalidate_remote_md(&inner_remote) {
                tracing::debug!(remote, inner = %inner_remote, "inner agent had nothing to invalidate ({e})");
            }
            tracing::debug!(remote, "disconnected");
        }
        Ok(())
    }

    /// Whether `agent`'s host arena is reached by cross-memory attach (its
    /// process proven on this host), so its DRAM transfers take the CMA path.
    fn reached_by_cma(&self, agent: &str) -> bool {
        self.remotes
            .locked()
            .get(agent)
            .is_some_and(|r| r.arenas.iter().any(|a| a.arena.cma.is_some()))
    }

    fn inner_remote(&self, remote: &str) -> Result<Arc<str>> {
        if remote == self.local_name {
            return Ok(self.inner_name.clone());
        }
        self.remotes
            .locked()
            .get(remote)
            .map(|r| r.inner.clone())
            .ok_or_else(|| {
                Error::new(
                    Status::NotFound,
                    format!("agent {remote:?} is unknown to BOUNCE (load its metadata first)"),
                )
            })
    }

    // ---- transfers ---------------------------------------------------------------

    /// Why neither of BOUNCE's own paths can take a transfer of this shape,
    /// decided before any descriptor is looked at: such a transfer goes to
    /// the UCX delegate untouched (counted here as prepared and by reason).
    /// The transfer's custom parameter is checked here already, whichever
    /// path takes it.
    pub fn early_fallback(&self, shape: &Shape, args: &XferArgs) -> Result<Option<Fallback>> {
        if !args.custom_param.is_empty() {
            TransferParams::parse(&args.custom_param)?;
        }
        let reason = early_reason(&self.config, shape, || self.sums_first(shape));
        if let Some(r) = reason {
            self.count_ucx_routed(r);
        }
        Ok(reason)
    }

    /// Whether the arena's size limit is tested before the check's pass,
    /// with a sum of its own over the local list, or after it, with the
    /// byte total the pass finds. After, when the pass runs in parts on
    /// the preparation pool: a serial sum over a list that long (1 MiB
    /// read cold for 32,768 descriptors, 50-60 us on the H200 host) costs
    /// more than the parallel pass it could spare a transfer the limit
    /// refuses, which then goes to UCX after the pass.
    fn sums_first(&self, shape: &Shape) -> bool {
        self.peer
            .fill_pool(shape.descriptors as usize, PARALLEL_PLAN_MIN_DESCRIPTORS)
            .is_none()
    }

    /// Counts a transfer that the UCX delegate carries, prepared and by
    /// reason.
    pub fn count_ucx_routed(&self, reason: Fallback) {
        EngineStats::bump(&self.stats.counters.transfers_prepared);
        self.stats.fell_back(reason);
    }

    /// The fewest descriptors any of BOUNCE's own paths takes between
    /// memory of kinds `local` and `remote` (see [`route_floor`]).
    pub fn route_floor(&self, local: MemKind, remote: MemKind) -> u64 {
        route_floor(&self.config, local, remote)
    }

    /// Why a transfer with fewer descriptors than [`Engine::route_floor`]
    /// goes to UCX ([`below_floor_reason`]).
    pub fn below_floor_reason(&self, local_transfer: bool) -> Fallback {
        below_floor_reason(&self.config, local_transfer)
    }

    /// The NIXL call in which the engine's preparation of a request runs,
    /// which its errors name: the request's first post with
    /// [`Config::prepare_at_post`], else `prepXfer`.
    pub fn preparing_call(&self) -> &'static str {
        if self.config.prepare_at_post {
            "postXfer (the request's first post prepares it)"
        } else {
            "prepXfer"
        }
    }

    /// What a preparation refuses before any descriptor is looked at (the
    /// lists' counts, an unknown remote agent, a malformed custom
    /// parameter); `Ok(true)`: the rest of the preparation waits for the
    /// request's first post ([`Config::prepare_at_post`]). `kinds`: the
    /// lists' memory (`None`: a kind BOUNCE does not serve).
    pub fn admit_xfer(
        &self,
        local: usize,
        remote: usize,
        kinds: [Option<MemKind>; 2],
        agent: &str,
        args: &XferArgs,
    ) -> Result<bool> {
        same_counts(local, remote)?;
        self.inner_remote(agent)?;
        if !args.custom_param.is_empty() {
            TransferParams::parse(&args.custom_param)?;
        }
        // The first post will share the preparation with the pool: wake it
        // now, while the client goes from here to the post. Not where the
        // post will not use it: a transfer within this agent goes to UCX,
        // and host memory on both sides with a peer reached by cross-memory
        // attach takes the CMA path (one thread prepares it).
        if self.config.prepare_at_post && self.config.enabled && agent != self.local_name {
            let min = PARALLEL_PLAN_MIN_DESCRIPTORS.min(peer::WARM_PARALLEL_FILL_MIN_DESCRIPTORS);
            if let Some(pool) = self.peer.fill_pool(local, min) {
                let cma = kinds == [Some(MemKind::Dram); 2]
                    && self.config.enable_cma
                    && self.reached_by_cma(agent);
                if !cma {
                    pool.warm(FILL_POOL_WARM);
                }
            }
        }
        Ok(self.config.prepare_at_post)
    }

    /// Checks a transfer's descriptors and prepares it on one of BOUNCE's own
    /// paths; `None`: the UCX delegate carries it (the reason is counted).
    /// Called after [`Engine::early_fallback`] let it through (which checked
    /// the custom parameter); `entered`: when the plugin's share of the
    /// preparation began (`prepare_ns` counts from there).
    #[allow(clippy::too_many_arguments)]
    pub fn prep_xfer(
        &self,
        op: Op,
        local: Descs<'_>,
        remote: Descs<'_>,
        agent: &str,
        args: XferArgs,
        shape: &Shape,
        entered: std::time::Instant,
    ) -> Result<Option<Request>> {
        same_counts(local.len(), remote.len())?;
        let inner_remote = self.inner_remote(agent)?;
        EngineStats::bump(&self.stats.counters.transfers_prepared);
        let peer_gate = peer::gate(&self.config, shape).is_ok();
        // Real clients' transfers (every descriptor one length, in mapped
        // regions): one pass from NIXL's descriptors to the uploaded table.
        // Anything it declines is decided by the checked path below.
        if peer_gate {
            let before_table = entered.elapsed().as_nanos() as u64;
            if let Some(x) = self
                .peer
                .prepare_pairs(op, &local, &remote, inner_remote.clone())
            {
                self.count_peer_prepared(&x, Some(before_table));
                return Ok(Some(Request {
                    route: Route::PeerMapped(x),
                    args,
                }));
            }
        }
        if cma_shape(&self.config, shape) {
            if let Some(xfer) = self.cma.prepare(op, &local, &remote) {
                EngineStats::bump(&self.stats.counters.hot.cma_prepared);
                return Ok(Some(Request {
                    route: Route::Cma(CmaRequest {
                        xfer,
                        peer_inner: inner_remote,
                        limit: std::time::Duration::ZERO,
                        reported: false,
                    }),
                    args,
                }));
            }
            // What the CMA path declined (a peer elsewhere, or between two
            // processes blocks too large for it) goes to the arena's
            // routing; when the arena's gate already refuses the shape, it
            // is UCX's with no further pass over the descriptors (as
            // `early_fallback` would have decided without the CMA path).
            if let Err(reason) = arena_early_gate(&self.config, shape, || self.sums_first(shape)) {
                self.stats.fell_back(reason);
                return Ok(None);
            }
        }
        let check_began = std::time::Instant::now();
        // The arena is the likely route of what comes this far when the
        // peer-mapped path is not open to it: its plan may be packed in
        // the check's pass.
        let (checked, early) = self.check(op, local, remote, !peer_gate)?;
        let check_ns = check_began.elapsed().as_nanos() as u64;
        // The byte total the routing's size limit needs, from the pass.
        if let (Ok(survey), TotalBytes::Of(_, total)) = (&checked.survey, shape.bytes) {
            let _ = total.set(survey.payload());
        }
        let (local, remote) = (&checked.local, &checked.remote);
        if peer_gate {
            if let Some(x) = self.peer_mapped_route(op, local, remote, &inner_remote) {
                return Ok(Some(Request {
                    route: Route::PeerMapped(x),
                    args,
                }));
            }
        }

        match self.choose_route(op, &checked, shape) {
            Ok((instance, peer)) => {
                // Planned straight from NIXL's lists, once here, reused by
                // every post.
                let plan_began = std::time::Instant::now();
                let plan = checked.survey.clone().and_then(|survey| match early {
                    // Packed in the check's pass, for this instance and
                    // these descriptors (the survey assumed is the one
                    // found).
                    Some(e)
                        if Arc::ptr_eq(&e.packing.instance, &instance)
                            && e.packing.spec.survey == survey =>
                    {
                        let plan = plan::assemble(&survey, e.chunks)?;
                        let c = &self.stats.counters.hot;
                        EngineStats::add(&c.arena_plans_in_parts, 1);
                        EngineStats::add(&c.arena_plans_with_check, 1);
                        EngineStats::add(&c.arena_plan_parts, e.help.parts);
                        EngineStats::add(&c.arena_plan_parts_helped, e.help.helped);
                        Ok(Arc::new(plan))
                    }
                    _ => self.plan(&instance, op, &checked, survey),
                });
                match plan {
                    Ok(plan) => {
                        let c = &self.stats.counters.hot;
                        EngineStats::add(&c.arena_prepared, 1);
                        EngineStats::add(&c.arena_check_ns, check_ns);
                        EngineStats::add(&c.arena_plan_ns, plan_began.elapsed().as_nanos() as u64);
                        return Ok(Some(Request {
                            route: Route::Bounce(BounceXfer {
                                read: op == Op::Read,
                                instance,
                                peer: peer.id.clone(),
                                peer_arena: peer,
                                peer_inner: inner_remote,
                                plan,
                                ticket: None,
                                reported: false,
                            }),
                            args,
                        }));
                    }
                    Err(e) => {
                        tracing::info!(agent = %self.local_name, "bounce path cannot plan this transfer ({e}); using UCX");
                        self.stats.fell_back(Fallback::Unplannable);
                    }
                }
            }
            Err(reason) => self.stats.fell_back(reason),
        }

        Ok(None)
    }

    /// The peer-mapped path for a transfer the one-pass table declined (see
    /// [`peer`]): copies merged into runs; `None` sends it on to the bounce
    /// path's routing.
    fn peer_mapped_route<'a>(
        &self,
        op: Op,
        local: &Side<'a>,
        remote: &Side<'a>,
        inner_remote: &Arc<str>,
    ) -> Option<peer::PeerXfer> {
        let device = local.ranges().next()?.dev;
        let peer_alloc = |md: Option<&'a Md>| md.and_then(Md::peer_alloc);
        // Peers elsewhere (or not exporting) are the common case off one
        // host: no log, no count. One look per distinct region.
        if !remote.distinct_mds().all(|md| peer_alloc(md).is_some()) {
            return None;
        }
        let pairs = local.ranges().zip(remote.iter()).map(|(l, (r, md))| {
            let alloc = peer_alloc(md)
                .ok_or("a remote descriptor in memory not exported for peer mapping")?;
            if l.dev != device {
                return Err("local descriptors on more than one GPU");
            }
            Ok((l.addr as u64, r.addr as u64, l.len as u64, alloc))
        });
        match self.peer.prepare(
            op,
            device as usize,
            local.len(),
            pairs,
            inner_remote.clone(),
        ) {
            Ok(x) => {
                self.count_peer_prepared(&x, None);
                Some(x)
            }
            Err(e) => {
                tracing::info!(agent = %self.local_name, "peer-mapped path unavailable for this transfer ({e}); trying the bounce path");
                self.stats.bump_named("peer_map_unavailable");
                None
            }
        }
    }

    /// Counts a transfer prepared on the peer-mapped path, with the time
    /// its table took (built, uploaded) and, for the one-pass table, the
    /// time the preparation spent before it (`before_table` ns).
    fn count_peer_prepared(&self, x: &peer::PeerXfer, before_table: Option<u64>) {
        let (t, c) = (&x.table.times, &self.stats.counters.hot);
        let add = EngineStats::add;
        add(&c.peer_prepared, 1);
        add(&c.peer_prepare_ns, t.fill + t.upload);
        if x.table.inline() {
            add(&c.peer_inline_tables, 1);
        }
        add(&c.peer_fill_ns, t.fill);
        add(&c.peer_setup_ns, t.setup);
        add(&c.peer_upload_ns, t.upload);
        add(&c.peer_upload_alloc_ns, t.alloc);
        add(&c.peer_upload_copy_ns, t.copy);
        add(&c.peer_upload_order_ns, t.order);
        if let Some(h) = &x.help {
            add(&c.peer_fill_parts, h.parts);
            if h.helped > 0 {
                add(&c.peer_fill_parts_helped, h.helped);
                add(&c.peer_fill_tables_helped, 1);
                add(&c.peer_fill_first_help_ns, h.first_help_ns);
            }
        }
        if let Some(ns) = before_table {
            add(&c.prepare_before_table_ns, ns);
        }
    }

    /// Checks both lists ([`Checked`]): from
    /// [`PARALLEL_PLAN_MIN_DESCRIPTORS`] on, in parts on the preparation
    /// pool (a cold list is read at several threads' pace). With `pack`
    /// (the arena is the likely route), each part also packs its chunks of
    /// the plan while its descriptors are in the cache ([`Packing`]); those
    /// come back with the packing they assumed.
    fn check<'a>(
        &self,
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        pack: bool,
    ) -> Result<(Checked<'a>, Option<EarlyPlan>)> {
        if let Some(fill) = self
            .peer
            .fill_pool(local.len(), PARALLEL_PLAN_MIN_DESCRIPTORS)
        {
            let packing = pack.then(|| Packing::of(op, &local, &remote)).flatten();
            if let Some((checked, help, chunks)) =
                Checked::in_parts(op, local, remote, fill, packing.as_ref().map(|p| &p.spec))
            {
                let c = &self.stats.counters.hot;
                EngineStats::add(&c.arena_check_parts, help.parts);
                EngineStats::add(&c.arena_check_parts_helped, help.helped);
                EngineStats::add(&c.arena_check_first_help_ns, help.first_help_ns);
                let early = packing.zip(chunks).map(|(packing, chunks)| EarlyPlan {
                    packing,
                    chunks,
                    help,
                });
                return Ok((checked?, early));
            }
        }
        // The regions kept from the last check, unless another check
        // holds them.
        let mut kept = peer::take_kept(&self.kept_regions);
        Ok((
            Checked::with_kept(op, local, remote, kept.as_deref_mut())?,
            None,
        ))
    }

    /// A bounce transfer's plan. A large one whose descriptors are all one
    /// length is packed in parts of whole chunks on the preparation pool's
    /// threads beside this one ([`peer::FillPool::share`]) and assembled;
    /// anything else, or what the pool declines, in one pass.
    fn plan(
        &self,
        instance: &Bounce,
        op: Op,
        checked: &Checked<'_>,
        survey: Survey,
    ) -> std::result::Result<Arc<Plan>, PlanError> {
        let runtime = &instance.runtime;
        let options = runtime.plan_options();
        let cut = plan::cut(&survey, &options);
        let n = survey.descriptors();
        let fill = self.peer.fill_pool(n, PARALLEL_PLAN_MIN_DESCRIPTORS);
        if let (Some(k), Some(fill)) = (cut.per_chunk, fill) {
            // Parts of whole chunks, of about the pool's part length.
            let parts = fill.parts(n, k);
            let pack = |range: std::ops::Range<usize>| {
                let first = range.start;
                let descriptors = checked.descriptors_in(op, range);
                plan::pack(
                    descriptors,
                    first,
                    &survey,
                    cut.cap,
                    options.merge_runs,
                    runtime.run_pool(),
                )
                .ok()
            };
            if parts.len() > 1 {
                if let Some((packed, help)) = fill.share(parts, pack) {
                    let c = &self.stats.counters.hot;
                    EngineStats::add(&c.arena_plans_in_parts, 1);
                    EngineStats::add(&c.arena_plan_parts, help.parts);
                    EngineStats::add(&c.arena_plan_parts_helped, help.helped);
                    EngineStats::add(&c.arena_plan_first_help_ns, help.first_help_ns);
                    let chunks = packed.into_iter().flatten().collect();
                    return plan::assemble(&survey, chunks).map(Arc::new);
                }
            }
        }
        runtime.plan(checked.descriptors(op), survey)
    }

    /// Decides the path of a transfer: the local instance and the peer's for
    /// the bounce path. The instances come with the descriptors' metadata:
    /// every local descriptor must lie in memory of one location with an
    /// instance, every remote one in memory of one peer instance.
    fn choose_route(
        &self,
        op: Op,
        checked: &Checked<'_>,
        shape: &Shape,
    ) -> std::result::Result<(Arc<Bounce>, Arc<PeerBounce>), Fallback> {
        if !self.config.enabled {
            return Err(Fallback::BounceDisabled);
        }
        let (local_instance, peer) = (checked.local_instance, checked.peer);
        let input = RouteInput {
            op,
            local: shape.local,
            remote: shape.remote,
            descriptors: shape.descriptors,
            bytes: shape.bytes.get(),
            peer_capable: peer.is_some(),
            peer_reads: peer.is_some_and(|p| p.read),
            local_transfer: shape.local_transfer,
            local_arena: local_instance.is_some(),
            vram_arena: local_instance.is_some_and(|b| b.location.arena_kind() == MemKind::Vram)
                || peer.is_some_and(|p| p.arena.mem == nixl_sys::MemType::Vram),
        };
        let poisoned = local_instance.is_some_and(|b| b.runtime.poisoned().is_some());
        bounce::route(&self.config, poisoned, &input)?;
        if shape.local != shape.remote && !input.vram_arena {
            self.stats.bump_named("arena_mixed_staged");
        }
        match (local_instance, peer) {
            (Some(b), Some(p)) => Ok((b.clone(), p.clone())),
            (None, _) => Err(Fallback::NoLocalArena),
            (_, None) => Err(Fallback::PeerNotBounceCapable),
        }
    }

    /// Posts (or re-posts) a request.
    pub fn post_xfer(&self, req: &mut Request, mut args: XferArgs) -> Result<Status> {
        // NIXL hands the custom parameter to prepXfer only; keep the one
        // given at preparation unless the post brings its own.
        if args.custom_param.is_empty() {
            args.custom_param = std::mem::take(&mut req.args.custom_param);
        }
        let per_transfer = TransferParams::parse(&args.custom_param)?;
        if self.failpoints.is_set("panic_in_post_xfer") {
            // With a lock held, as a bug inside the engine would: teardown
            // must still take it (crate::sync's policy).
            let _held = self.remotes.locked();
            panic!("failpoint panic_in_post_xfer");
        }
        req.args = args;
        EngineStats::bump(&self.stats.counters.transfers_posted);
        match &mut req.route {
            Route::Bounce(b) => {
                if b.ticket.as_ref().is_some_and(|t| t.outcome().is_none()) {
                    return Err(Error::new(
                        Status::RepostActive,
                        "the bounce transfer is still running",
                    ));
                }
                b.instance.ensure_peer(&b.peer_arena);
                let runtime = &b.instance.runtime;
                let notif = req.args.notif.take().map(|message| DeferredNotif {
                    inner_agent: b.peer_inner.clone(),
                    message,
                });
                let deadline = per_transfer
                    .deadline_ms
                    .map(std::time::Duration::from_millis);
                let (peer, plan) = (b.peer.clone(), b.plan.clone());
                b.ticket = Some(if b.read {
                    runtime.submit_read(peer, plan, notif, deadline)
                } else {
                    runtime.submit(peer, plan, notif, deadline)
                });
                b.reported = false;
                let c = &self.stats.counters.hot;
                EngineStats::bump(&c.bounce_submitted);
                EngineStats::add(&c.bounce_bytes, b.plan.payload_bytes);
                Ok(Status::InProgress)
            }
            Route::PeerMapped(x) => {
                if x.launch.as_ref().is_some_and(|l| l.running()) {
                    return Err(Error::new(
                        Status::RepostActive,
                        "the peer-mapped transfer is still running",
                    ));
                }
                // From here a failure leaves no earlier outcome behind.
                x.launch = None;
                // Ready to send the notification before anything runs, so
                // that no copy is left running behind an error.
                let notify = match &req.args.notif {
                    Some(_) => Some(
                        self.peer
                            .notifier(&self.inner)
                            .map_err(|e| Error::new(Status::Backend, e))?,
                    ),
                    None => None,
                };
                let launch = match x.table.launch(&x.mappings) {
                    Ok(l) => l,
                    Err(e) => {
                        EngineStats::bump(&self.stats.counters.transfers_failed);
                        self.stats.bump_named("peer_map_failed");
                        return Err(Error::new(Status::Backend, e));
                    }
                };
                x.launch = Some(launch.clone());
                x.limit = self.request_limit(&per_transfer);
                x.reported = false;
                let c = &self.stats.counters.hot;
                EngineStats::bump(&c.peer_submitted);
                EngineStats::add(&c.peer_bytes, x.table.bytes());
                if let (Some(notify), Some(message)) = (notify, req.args.notif.take()) {
                    notify.after(launch, x.limit, x.peer_inner.clone(), message);
                }
                Ok(Status::InProgress)
            }
            Route::Cma(c) => {
                if c.xfer.running() {
                    return Err(Error::new(
                        Status::RepostActive,
                        "the CMA transfer is still running",
                    ));
                }
                c.limit = self.request_limit(&per_transfer);
                c.reported = false;
                let hot = &self.stats.counters.hot;
                EngineStats::bump(&hot.cma_submitted);
                EngineStats::add(&hot.cma_bytes, c.xfer.bytes);
                let notify = req
                    .args
                    .notif
                    .take()
                    .map(|m| (self.inner.clone(), c.peer_inner.clone(), m));
                match self.cma.post(&mut c.xfer, notify) {
                    None => Ok(Status::InProgress),
                    Some(r) => self.cma_outcome(c, r),
                }
            }
        }
    }

    /// How long a posted copy of BOUNCE's own paths may run: the
    /// transfer's deadline, else the configured one, else the no-progress
    /// timeout.
    fn request_limit(&self, per_transfer: &TransferParams) -> std::time::Duration {
        per_transfer
            .deadline_ms
            .or((self.config.request_deadline_ms > 0).then_some(self.config.request_deadline_ms))
            .map_or(
                std::time::Duration::from_millis(self.config.request_timeout_ms),
                std::time::Duration::from_millis,
            )
    }

    /// A CMA copy's result as NIXL's status, counted once per post.
    fn cma_outcome(
        &self,
        c: &mut CmaRequest,
        r: std::result::Result<(), String>,
    ) -> Result<Status> {
        let first = !std::mem::replace(&mut c.reported, true);
        match r {
            Ok(()) => {
                if first {
                    self.stats.bump_named("cma_succeeded");
                }
                Ok(Status::Success)
            }
            Err(e) => {
                if first {
                    EngineStats::bump(&self.stats.counters.transfers_failed);
                    self.stats.bump_named("cma_failed");
                }
                Err(Error::new(
                    Status::Backend,
                    format!("CMA transfer failed: {e}"),
                ))
            }
        }
    }

    pub fn check_xfer(&self, req: &mut Request) -> Result<Status> {
        match &mut req.route {
            Route::Bounce(b) => {
                let Some(ticket) = &b.ticket else {
                    return Err(Error::new(
                        Status::NotPosted,
                        "the bounce transfer was not posted",
                    ));
                };
                match ticket.outcome() {
                    None => Ok(Status::InProgress),
                    Some(Ok(())) => Ok(Status::Success),
                    Some(Err(reason)) => {
                        if !b.reported {
                            b.reported = true;
                            EngineStats::bump(&self.stats.counters.transfers_failed);
                        }
                        Err(Error::new(
                            failure_status(reason),
                            format!("bounce transfer to {} failed: {reason:?}", b.peer),
                        ))
                    }
                }
            }
            Route::PeerMapped(x) => {
                let Some(launch) = &x.launch else {
                    return Err(Error::new(
                        Status::NotPosted,
                        "the peer-mapped transfer was not posted",
                    ));
                };
                launch.expire(x.limit);
                let outcome = launch.poll();
                let first = !x.reported && outcome.is_some();
                if first {
                    x.reported = true;
                }
                match outcome {
                    None => Ok(Status::InProgress),
                    Some(Ok(())) => {
                        if first {
                            self.stats.bump_named("peer_map_succeeded");
                        }
                        Ok(Status::Success)
                    }
                    Some(Err(e)) => {
                        if first {
                            EngineStats::bump(&self.stats.counters.transfers_failed);
                            self.stats.bump_named("peer_map_failed");
                        }
                        Err(Error::new(Status::Backend, e))
                    }
                }
            }
            Route::Cma(c) => {
                if !c.xfer.posted() {
                    return Err(Error::new(
                        Status::NotPosted,
                        "the CMA transfer was not posted",
                    ));
                }
                match c.xfer.outcome(c.limit) {
                    None => Ok(Status::InProgress),
                    Some(r) => self.cma_outcome(c, r),
                }
            }
        }
    }

    /// Releases a request. A bounce request still running is cancelled: the
    /// call returns at once, and the runtime reclaims its regions only once
    /// nothing can still touch them.
    pub fn release_req(&self, req: Request) -> Result<()> {
        match &req.route {
            Route::Bounce(b) => {
                if let Some(t) = &b.ticket {
                    if t.outcome().is_none() {
                        b.instance.runtime.cancel(t);
                        self.stats.bump_named("bounce_cancelled");
                    }
                }
            }
            // A running kernel cannot be stopped: its bytes still land (as
            // a released UCX transfer's may), but no notification is sent.
            // Its table is freed after it, its mappings closed after it.
            Route::PeerMapped(x) => {
                if let Some(l) = x.launch.as_ref().filter(|l| l.running()) {
                    l.cancelled.store(true, Ordering::SeqCst);
                    self.stats.bump_named("peer_map_cancelled");
                }
            }
            // Stops at the copy's next system call; a deregistration of its
            // memory waits for that.
            Route::Cma(c) => {
                if c.xfer.cancel() {
                    self.stats.bump_named("cma_cancelled");
                }
            }
        }
        drop(req);
        Ok(())
    }

    /// Why the bounce arena is poisoned, if it is.
    pub fn poisoned(&self) -> Option<String> {
        let map = self.instances.locked();
        map.iter().find_map(|(loc, b)| {
            b.as_ref()
                .and_then(|b| b.runtime.poisoned())
                .map(|why| format!("{loc}: {why}"))
        })
    }

    // ---- notifications -------------------------------------------------------------

    /// Drains received notifications as (sending agent, message) pairs.
    pub fn get_notifs(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let notifs = self
            .hub
            .take_user()
            .map_err(|e| Error::new(Status::Backend, format!("reading notifications: {e}")))?;
        let out: Vec<(String, Vec<u8>)> = notifs
            .into_iter()
            .map(|(inner_agent, msg)| {
                let outer = inner_agent
                    .strip_suffix(INNER_SUFFIX)
                    .unwrap_or(&inner_agent)
                    .to_string();
                (outer, msg)
            })
            .collect();
        self.stats
            .counters
            .notifs_received
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let snapshot = self.stats.snapshot();
        tracing::info!(agent = %self.local_name, counters = ?snapshot.counters, "BOUNCE engine shutting down");
    }
}

/// Sums the counters of every bounce instance (for the stats snapshot).
fn instances_stats(
    instances: Instances,
    readers: Arc<bounce::ReaderAgents>,
) -> crate::stats::StatsSource {
    Box::new(move || {
        let map = instances.locked();
        let mut total = BTreeMap::new();
        let mut poisoned = None;
        for (loc, b) in map.iter() {
            let Some(b) = b else { continue };
            let (counters, p) = (b.runtime.stats_source())();
            for (k, v) in counters {
                *total.entry(k).or_insert(0) += v;
            }
            if poisoned.is_none() {
                poisoned = p.map(|why| format!("{loc}: {why}"));
            }
        }
        total.insert(
            "bounce_instances".into(),
            map.values().flatten().count() as u64,
        );
        total.insert("reader_agents_loaded".into(), readers.loaded() as u64);
        (total, poisoned)
    })
}

fn failure_status(reason: crate::proto::FailureReason) -> Status {
    use crate::proto::FailureReason as F;
    match reason {
        F::Cancelled => Status::Canceled,
        F::PeerLost | F::PeerUnreachable => Status::RemoteDisconnect,
        F::SourceRefused => Status::InvalidParam,
        _ => Status::Backend,
    }
}

/// The backend options NIXL lists for BOUNCE (`get_backend_options`), with
/// their defaults: BOUNCE's own. UCX's parameters are accepted too and passed
/// to the UCX delegate and the inner agent's UCX backend.
pub fn advertised_options() -> Vec<(String, String)> {
    Config::describe()
        .into_iter()
        .map(|s| (s.key.to_string(), s.default))
        .collect()
}

/// Threads for a path's parallel work: `configured`, or with 0 what `auto`
/// makes of this machine's cores; never more than the cores.
fn threads(configured: usize, auto: impl Fn(usize) -> usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if configured > 0 {
        configured.min(cores)
    } else {
        auto(cores).min(cores)
    }
}

/// Regions made by hand for unit tests of the paths' preparations: the
/// `Md`s NIXL's handles resolve to, and descriptors in them.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Every test region's length.
    pub const REGION: usize = 1 << 20;

    /// A DRAM region of `REGION` bytes at `base`.
    pub fn md(base: usize, owner: MdOwner) -> Md {
        Md {
            magic: MD_MAGIC,
            range: Range {
                addr: base,
                len: REGION,
                dev: 0,
            },
            kind: MemKind::Dram,
            owner,
        }
    }

    /// Memory this agent registered, with no bounce instance.
    pub fn registered() -> MdOwner {
        MdOwner::Registered {
            public_data: Vec::new(),
            bounce: None,
            staged: None,
        }
    }

    /// A descriptor `off` bytes into `m`.
    pub fn at(m: &Md, off: usize, len: usize) -> RawDesc {
        RawDesc {
            addr: m.range.addr + off,
            len,
            dev: 0,
            md: m as *const Md as *const std::ffi::c_void,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_params_parse() {
        assert_eq!(
            TransferParams::parse(b"").unwrap(),
            TransferParams::default()
        );
        assert_eq!(
            TransferParams::parse(b"deadline_ms=250")
                .unwrap()
                .deadline_ms,
            Some(250)
        );
        assert_eq!(
            TransferParams::parse(b" deadline_ms = 7 ;")
                .unwrap()
                .deadline_ms,
            Some(7)
        );
        assert!(TransferParams::parse(b"deadline_ms=soon")
            .unwrap_err()
            .message
            .contains("deadline_ms"));
        assert!(TransferParams::parse(b"bogus=1")
            .unwrap_err()
            .message
            .contains("\"bogus\""));
        assert!(TransferParams::parse(b"novalue").is_err());
        assert!(TransferParams::parse(&[0xff]).is_err());
    }

    proptest::proptest! {
        /// The shim's short cut agrees with the engine: below a pair of
        /// kinds' floor, every shape goes to UCX for the reason
        /// `below_floor_reason` gives; at the floor, some shape does not.
        #[test]
        fn the_route_floor_agrees_with_the_early_decision(
            enabled in proptest::prelude::any::<bool>(),
            peer_map in proptest::prelude::any::<bool>(),
            mins in proptest::collection::vec(0u64..3000, 4),
            local_vram in proptest::prelude::any::<bool>(),
            remote_vram in proptest::prelude::any::<bool>(),
            local_transfer in proptest::prelude::any::<bool>(),
            descriptors in 0u64..3000,
            average in 1u64..(1 << 20),
            sum_first in proptest::prelude::any::<bool>(),
        ) {
            let cfg = Config {
                enabled,
                enable_peer_map: peer_map,
                min_descriptor_count: mins[0],
                vram_min_descriptor_count: mins[1],
                peer_map_min_descriptor_count: mins[2],
                mixed_min_descriptor_count: mins[3],
                ..Config::default()
            };
            let kind = |vram| if vram { MemKind::Vram } else { MemKind::Dram };
            let (local, remote) = (kind(local_vram), kind(remote_vram));
            let shape = |descriptors: u64, local_transfer| Shape {
                local,
                remote,
                descriptors,
                bytes: TotalBytes::Known(descriptors * average),
                local_transfer,
            };
            let floor = route_floor(&cfg, local, remote);
            if descriptors < floor {
                proptest::prop_assert_eq!(
                    early_reason(&cfg, &shape(descriptors, local_transfer), || sum_first),
                    Some(below_floor_reason(&cfg, local_transfer))
                );
            }
            if floor != u64::MAX {
                // The smallest shape at the floor is let through.
                let small = Shape { bytes: TotalBytes::Known(floor), ..shape(floor, false) };
                proptest::prop_assert_eq!(early_reason(&cfg, &small, || sum_first), None);
            }
        }
    }

    #[test]
    fn range_cover_checks_device_and_overflow() {
        let outer = Range {
            addr: 100,
            len: 100,
            dev: 0,
        };
        assert!(outer.covers(&Range {
            addr: 100,
            len: 100,
            dev: 0
        }));
        assert!(outer.covers(&Range {
            addr: 150,
            len: 10,
            dev: 0
        }));
        assert!(!outer.covers(&Range {
            addr: 150,
            len: 51,
            dev: 0
        }));
        assert!(!outer.covers(&Range {
            addr: 150,
            len: 10,
            dev: 1
        }));
        assert!(!outer.covers(&Range {
            addr: usize::MAX,
            len: 2,
            dev: 0
        }));
    }

    mod checked {
        use super::*;
        use crate::dataplane::PeerArena;
        use crate::engine::testing::{at, md, registered, REGION};
        use nixl_sys::MemType;

        fn remote(peer: &str) -> MdOwner {
            MdOwner::Remote {
                agent: peer.into(),
                bounce: Some(peer_bounce(peer, MemType::Dram)),
                staged: None,
                peer: None,
                mapped: std::sync::OnceLock::new(),
                cma: None,
            }
        }

        fn peer_bounce(id: &str, mem: MemType) -> Arc<PeerBounce> {
            Arc::new(PeerBounce {
                id: PeerId::new(id),
                arena: PeerArena {
                    inner_agent: format!("{id}/bounce"),
                    base: 0,
                    device: 0,
                    mem,
                    cma: None,
                },
                key: 7,
                read: true,
                heartbeats: true,
                data_path_v2: true,
            })
        }

        #[test]
        fn dram_meets_a_peers_gpu_through_its_host_staged_arena() {
            // A peer's VRAM region with its GPU's two instances.
            let vram = Box::leak(Box::new(md(
                1 << 40,
                MdOwner::Remote {
                    agent: "peer".into(),
                    bounce: Some(peer_bounce("peer-vram", MemType::Vram)),
                    staged: Some(peer_bounce("peer-staged", MemType::Dram)),
                    peer: None,
                    mapped: std::sync::OnceLock::new(),
                    cma: None,
                },
            )));
            let local = Box::leak(Box::new(md(1 << 32, registered())));
            let (l, r) = ([at(local, 0, 4096)], [at(vram, 0, 4096)]);
            let resolve = |p: *const std::ffi::c_void| p as *const Md;
            for (kind, want) in [(MemKind::Dram, "peer-staged"), (MemKind::Vram, "peer-vram")] {
                // SAFETY: both handles are the leaked `Md`s above.
                let (ld, rd) = unsafe {
                    (
                        Descs::new(kind, &l, &resolve),
                        Descs::new(MemKind::Vram, &r, &resolve),
                    )
                };
                let c = Checked::new(Op::Write, ld, rd).expect("checked");
                assert_eq!(c.peer.map(|p| p.id.as_str()), Some(want), "local {kind:?}");
                let packing = Packing::of(Op::Write, &ld, &rd);
                assert!(packing.is_none(), "no local instance here");
            }
            // Without a host-staged instance, the peer's only one.
            let plain = Box::leak(Box::new(md(
                1 << 40,
                MdOwner::Remote {
                    agent: "peer".into(),
                    bounce: Some(peer_bounce("peer-vram", MemType::Vram)),
                    staged: None,
                    peer: None,
                    mapped: std::sync::OnceLock::new(),
                    cma: None,
                },
            )));
            assert_eq!(
                plain.arena_for(true).map(|p| p.id.as_str()),
                Some("peer-vram")
            );
            assert_eq!(
                vram.arena_for(false).map(|p| p.id.as_str()),
                Some("peer-vram")
            );
        }

        /// `f` of the check of a WRITE from `l` to `r`, after checking
        /// that the check in parts of every length finds the same.
        fn check<T>(l: &[RawDesc], r: &[RawDesc], f: impl FnOnce(Result<Checked<'_>>) -> T) -> T {
            // NIXL's handles are not the `Md`s' addresses (the shim's table
            // maps one to the other): here a tag tells them apart, so that a
            // check using a handle as an `Md` would fail.
            const TAG: usize = 0x5a5a_0000;
            let tagged = |d: &[RawDesc]| -> Vec<RawDesc> {
                d.iter()
                    .map(|x| RawDesc {
                        md: match x.md.is_null() {
                            true => x.md,
                            false => (x.md as usize ^ TAG) as *const std::ffi::c_void,
                        },
                        ..*x
                    })
                    .collect()
            };
            let (l, r) = (&tagged(l)[..], &tagged(r)[..]);
            let resolve = |p: *const std::ffi::c_void| (p as usize ^ TAG) as *const Md;
            // SAFETY: every handle is one of the test's leaked `Md`s or
            // null.
            let (ld, rd) = unsafe {
                (
                    Descs::new(MemKind::Dram, l, &resolve),
                    Descs::new(MemKind::Dram, r, &resolve),
                )
            };
            let one_pass = Checked::new(Op::Write, ld, rd);
            // With the regions kept: cold (every one resolved and kept), then
            // warm (every one found), then kept from other lists of the same
            // regions (the first half of these, and these reversed).
            let mut kept = KeptRegions::default();
            for round in ["cold", "warm"] {
                let c = Checked::with_kept(Op::Write, ld, rd, Some(&mut kept));
                assert_eq!(facts(&c), facts(&one_pass), "regions kept, {round}");
            }
            let (rl, rr): (Vec<_>, Vec<_>) = l.iter().rev().zip(r.iter().rev()).unzip();
            let half = l.len() / 2;
            let (hl, hr) = (l[..half].to_vec(), r[..half].to_vec());
            for (what, kl, kr) in [("the first half", &hl, &hr), ("reversed", &rl, &rr)] {
                // SAFETY: as above.
                let (kd, kr) = unsafe {
                    (
                        Descs::new(MemKind::Dram, kl, &resolve),
                        Descs::new(MemKind::Dram, kr, &resolve),
                    )
                };
                let mut kept = KeptRegions::default();
                let _ = Checked::with_kept(Op::Write, kd, kr, Some(&mut kept));
                let c = Checked::with_kept(Op::Write, ld, rd, Some(&mut kept));
                assert_eq!(facts(&c), facts(&one_pass), "regions kept from {what}");
            }
            let mut fill = fill_pool();
            for part_len in 1..=l.len() {
                fill.part_len = part_len;
                let (parts, _, _) =
                    Checked::in_parts(Op::Write, ld, rd, &fill, None).expect("the pool is free");
                assert_eq!(facts(&parts), facts(&one_pass), "in parts of {part_len}");
            }
            f(one_pass)
        }

        /// A pool of two workers beside the calling thread.
        fn fill_pool() -> peer::FillPool {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            peer::FillPool::new(pool, 1)
        }

        /// What a check found, to compare.
        fn facts(c: &Result<Checked<'_>>) -> std::result::Result<String, String> {
            match c {
                Ok(c) => Ok(format!(
                    "peer {:?}, instance {:?}, survey {:?}",
                    c.peer,
                    c.local_instance.map(Arc::as_ptr),
                    c.survey
                )),
                Err(e) => Err(e.to_string()),
            }
        }

        /// Not a benchmark: how long the check of vLLM's 128-token READ
        /// (64 regions a side, 8 blocks each: 512 descriptors) takes here,
        /// warm and cold, its handles resolved through a hash table as the
        /// shim's. `cargo test --release --lib check_cost -- --ignored
        /// --nocapture`
        #[test]
        #[ignore]
        fn check_cost() {
            let (regions, blocks, len) = (64usize, 8usize, 8192usize);
            // Each region's metadata on pages of its own, as registrations
            // made over time leave them.
            let leak = |m: Md| -> &'static Md {
                Box::leak(vec![0u8; 3 * 4096].into_boxed_slice());
                Box::leak(Box::new(m))
            };
            let local: Vec<&Md> = (0..regions)
                .map(|i| leak(md((1 << 32) + i * REGION, registered())))
                .collect();
            let remote: Vec<&Md> = (0..regions)
                .map(|i| leak(md((1 << 40) + i * REGION, remote("peer"))))
                .collect();
            let (mut l, mut r) = (Vec::new(), Vec::new());
            for (lm, rm) in local.iter().zip(&remote) {
                for b in 0..blocks {
                    l.push(at(lm, (b * 7919) % 64 * len, len));
                    r.push(at(rm, (b * 104_729) % 64 * len, len));
                }
            }
            // The shim's table: NIXL's handle -> BOUNCE's metadata.
            let table: HashMap<usize, usize> = local
                .iter()
                .chain(&remote)
                .map(|m| (*m as *const Md as usize, *m as *const Md as usize))
                .collect();
            let resolve = |p: *const std::ffi::c_void| {
                table
                    .get(&(p as usize))
                    .map_or(std::ptr::null(), |m| *m as *const Md)
            };
            // SAFETY: every handle resolves to a leaked `Md`.
            let (ld, rd) = unsafe {
                (
                    Descs::new(MemKind::Dram, &l, &resolve),
                    Descs::new(MemKind::Dram, &r, &resolve),
                )
            };
            let mut sweep = vec![0u8; 64 << 20];
            for keep in [false, true] {
                let mut kept = KeptRegions::default();
                let mut once = || {
                    let t = std::time::Instant::now();
                    let k = keep.then_some(&mut kept);
                    let c = Checked::with_kept(Op::Read, ld, rd, k).expect("checked");
                    let ns = t.elapsed().as_nanos();
                    assert!(c.peer.is_some() && c.survey.is_ok());
                    ns
                };
                let warm = (0..2000).map(|_| once()).min().unwrap();
                let mut cold: Vec<u128> = (0..50u8)
                    .map(|i| {
                        sweep
                            .iter_mut()
                            .step_by(64)
                            .for_each(|b| *b = b.wrapping_add(i));
                        once()
                    })
                    .collect();
                cold.sort_unstable();
                println!(
                    "Checked of {} descriptors in {regions} runs, regions kept {keep}: warm {:.1} us (best of 2000), cold {:.1} us (median of 50)",
                    l.len(),
                    warm as f64 / 1e3,
                    cold[25] as f64 / 1e3
                );
            }
            std::hint::black_box(&sweep);
        }

        /// Two local and two remote regions, alive for the test.
        fn regions() -> &'static [Md; 4] {
            Box::leak(Box::new([
                md(1 << 32, registered()),
                md((1 << 32) + REGION, registered()),
                md(1 << 40, remote("peer")),
                md((1 << 40) + REGION, remote("peer")),
            ]))
        }

        #[test]
        fn a_plain_transfer_passes_with_its_peer_and_survey() {
            let [l0, l1, r0, r1] = regions();
            let l = [at(l0, 0, 4096), at(l0, 8192, 4096), at(l1, 0, 4096)];
            let r = [at(r0, 4096, 4096), at(r0, 0, 4096), at(r1, 64, 4096)];
            let plan = check(&l, &r, |c| {
                let c = c.expect("checked");
                assert_eq!(c.peer.map(|p| p.id.as_str()), Some("peer"));
                assert!(c.local_instance.is_none(), "no local arena here");
                crate::proto::plan::build_surveyed(
                    c.descriptors(Op::Write),
                    c.survey.clone().expect("plannable"),
                    crate::proto::plan::PlanOptions::capped(1 << 20, true),
                    &crate::proto::RunPool::default(),
                )
                .expect("planned")
            });
            assert_eq!(plan.payload_bytes, 3 * 4096);
            let src: Vec<u64> = plan.chunks[0]
                .gather_runs
                .iter()
                .flat_map(|r| r.copies())
                .map(|c| c.1)
                .collect();
            assert_eq!(src, l.iter().map(|d| d.addr as u64).collect::<Vec<_>>());
        }

        #[test]
        fn two_peers_share_no_arena() {
            let [l0, _, r0, _] = regions();
            let other: &'static Md = Box::leak(Box::new(md(1 << 44, remote("other"))));
            let (l, r) = (
                [at(l0, 0, 64), at(l0, 64, 64)],
                [at(r0, 0, 64), at(other, 0, 64)],
            );
            check(&l, &r, |c| assert!(c.expect("checked").peer.is_none()));
        }

        #[test]
        fn each_fault_is_named_wherever_it_lies_in_a_run() {
            let [l0, _, r0, _] = regions();
            let good = || (vec![at(l0, 0, 64); 4], vec![at(r0, 0, 64); 4]);
            assert!(check(&good().0, &good().1, |c| c.is_ok()));
            // At the run's first pair (checked in full) and inside the run
            // (checked inline, then in full to name it).
            for i in [0, 2] {
                let msg = |l: &[RawDesc], r: &[RawDesc]| {
                    check(l, r, |c| match c {
                        Err(e) => e.to_string(),
                        Ok(_) => panic!("descriptor {i}: passed"),
                    })
                };
                let (mut l, r) = good();
                l[i] = at(l0, 64, REGION);
                let m = msg(&l, &r);
                assert!(
                    m.contains(&format!("local descriptor {i} ("))
                        && m.contains("outside its registered region"),
                    "{m}"
                );
                let (l, mut r) = good();
                r[i].addr = usize::MAX - 8;
                let m = msg(&l, &r);
                assert!(
                    m.contains(&format!("remote descriptor {i} wraps around")),
                    "{m}"
                );
                let (mut l, r) = good();
                l[i].dev = 1;
                let m = msg(&l, &r);
                assert!(m.contains(&format!("local descriptor {i} (")), "{m}");
                let (l, mut r) = good();
                r[i].len = 32;
                let m = msg(&l, &r);
                assert!(
                    m.contains(&format!(
                        "descriptor {i}: local length 64 differs from remote length 32"
                    )),
                    "{m}"
                );
                let stray = Md {
                    magic: 0,
                    ..md(0, registered())
                };
                let stray: &'static Md = Box::leak(Box::new(stray));
                let (mut l, r) = good();
                l[i].md = stray as *const Md as *const std::ffi::c_void;
                let m = msg(&l, &r);
                assert!(
                    m.contains(&format!("local descriptor {i} carries metadata")),
                    "{m}"
                );
            }
        }

        #[test]
        fn what_planning_refuses_is_not_an_error_but_no_survey() {
            let [l0, _, r0, _] = regions();
            let mut l = vec![at(l0, 0, 64); 3];
            let r = vec![at(r0, 0, 64); 3];
            // A null handle is not checked against a region (NIXL's own
            // lists always carry one): planning still sees its device.
            l[1] = RawDesc {
                addr: 4096,
                len: 64,
                dev: 3,
                md: std::ptr::null(),
            };
            check(&l, &r, |c| {
                let c = c.expect("checked");
                assert_eq!(
                    c.survey.clone().unwrap_err(),
                    PlanError::MixedSourceDevices {
                        index: 1,
                        expected: 0,
                        found: 3
                    }
                );
                assert!(c.local_instance.is_none());
            });
        }

        proptest::proptest! {
            /// The plan packed in the check's pass is the plan made after
            /// it, for every part length; a list that is not what the
            /// packing assumed (one descriptor of another length) gives no
            /// chunks.
            #[test]
            fn the_plan_packed_in_the_check_is_the_plan(
                n in 1usize..80,
                len in 1usize..100,
                cap in 64u64..600,
                min_chunks in 1u64..4,
                part_len in 1usize..12,
                odd in proptest::option::of(0usize..40),
                read in proptest::bool::ANY,
            ) {
                let op = if read { Op::Read } else { Op::Write };
                let [l0, _, r0, _] = regions();
                let mut l: Vec<_> = (0..n).map(|i| at(l0, 128 * i, len)).collect();
                let mut r: Vec<_> = (0..n).map(|i| at(r0, 256 * i + 64, len)).collect();
                if let Some(i) = odd {
                    (l[i % n].len, r[i % n].len) = (len + 1, len + 1);
                }
                let resolve = |p: *const std::ffi::c_void| p as *const Md;
                // SAFETY: every handle is one of the test's leaked `Md`s.
                let (ld, rd) = unsafe {
                    (Descs::new(MemKind::Dram, &l, &resolve), Descs::new(MemKind::Dram, &r, &resolve))
                };
                let options = plan::PlanOptions { max_chunk_bytes: cap, merge_runs: true, min_chunks, min_chunk_bytes: 64 };
                let pool = crate::proto::RunPool::default();
                let first = pair_descriptor(op, l[0].range(), r[0].range());
                let Some(spec) = PackSpec::new(Survey::uniform(&first, n), options, pool.clone()) else {
                    return Ok(());
                };
                let fill = peer::FillPool { part_len, ..fill_pool() };
                let (checked, _, chunks) =
                    Checked::in_parts(op, ld, rd, &fill, Some(&spec)).expect("the pool is free");
                let checked = checked.expect("checked");
                let survey = checked.survey.clone().expect("plannable");
                let made = plan::build_surveyed(checked.descriptors(op), survey, options, &pool).unwrap();
                match chunks {
                    Some(chunks) => {
                        proptest::prop_assert_eq!(&survey, &spec.survey);
                        proptest::prop_assert_eq!(plan::assemble(&survey, chunks).unwrap(), made);
                    }
                    // Not packed: fewer parts of whole chunks than the
                    // pool's three threads, or not the list assumed.
                    None => {
                        let step = spec.per_chunk * part_len.div_ceil(spec.per_chunk);
                        proptest::prop_assert!(
                            n.div_ceil(step) < 3 || (odd.is_some() && survey != spec.survey)
                        )
                    }
                }
            }

            /// Whatever is wrong, and wherever: the check in parts names
            /// what the one pass names and finds the same facts (`check`
            /// compares them at every part length).
            #[test]
            fn in_parts_the_check_finds_what_one_pass_finds(
                faults in proptest::collection::vec((0usize..24, 0u8..9), 0..4),
                n in 1usize..24,
            ) {
                let [l0, l1, r0, r1] = regions();
                let other: &'static Md = Box::leak(Box::new(md(1 << 44, remote("other"))));
                let mut l: Vec<_> = (0..n).map(|i| at(l0, 64 * i, 64)).collect();
                let mut r: Vec<_> = (0..n).map(|i| at(r0, 128 * i, 64)).collect();
                for (i, fault) in faults {
                    let i = i % n;
                    match fault {
                        0 => l[i] = at(l0, 64, REGION),
                        1 => r[i].addr = usize::MAX - 8,
                        2 => r[i].len = 32,
                        3 => {
                            l[i] = RawDesc { addr: 4096, len: 64, dev: 3, md: std::ptr::null() }
                        }
                        4 => r[i] = at(other, 0, 64),
                        5 => l[i] = at(l1, 0, 64),
                        6 => r[i] = at(r1, 0, 64),
                        7 => (l[i].len, r[i].len) = (32, 32),
                        _ => (l[i].len, r[i].len) = (0, 0),
                    }
                }
                check(&l, &r, |_| ());
            }
        }
    }
}
