//! The values the C boundary carries: statuses and errors, memory kinds,
//! operations, ranges, the metadata handed to NIXL, NIXL's descriptors, and
//! the per-transfer settings of its custom parameter.

use super::*;

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
    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Self::new(Status::InvalidParam, message)
    }
    pub(super) fn nixl(context: &str, e: NixlError) -> Self {
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
#[repr(u8)]
pub enum MemKind {
    Dram = sys::BOUNCE_MEM_DRAM as u8,
    Vram = sys::BOUNCE_MEM_VRAM as u8,
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
    pub(super) fn end(&self) -> Option<usize> {
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
    pub(super) magic: u64,
    pub range: Range,
    pub kind: MemKind,
    pub owner: MdOwner,
}

/// Tags live [`Md`] objects, so that what the shim's table resolves a
/// descriptor's metadata to can be checked before it is used.
pub(super) const MD_MAGIC: u64 = 0x4e58_424d_445f_4f4b; // "NXBMD_OK"

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
        peer: Option<Arc<ipc::RemoteAlloc>>,
        /// The region as this process addresses it, once a preparation
        /// found it (see [`ipc::MappedRegion`]).
        mapped: std::sync::OnceLock<ipc::MappedRegion>,
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
    pub fn peer_alloc(&self) -> Option<&Arc<ipc::RemoteAlloc>> {
        match &self.owner {
            MdOwner::Remote { peer: Some(a), .. } => Some(a),
            _ => None,
        }
    }

    /// The bounce instance of this agent's registered region.
    pub(super) fn instance(&self) -> Option<&Arc<Bounce>> {
        match &self.owner {
            MdOwner::Registered {
                bounce: Some(b), ..
            } => Some(b),
            _ => None,
        }
    }

    /// The peer's bounce arena of this remote region.
    pub(super) fn arena(&self) -> Option<&Arc<PeerBounce>> {
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
    pub(super) fn instance_for(&self, mixed: bool) -> Option<&Arc<Bounce>> {
        match &self.owner {
            MdOwner::Registered {
                staged: Some(h), ..
            } if mixed => Some(h),
            _ => self.instance(),
        }
    }

    /// [`Md::instance_for`] for a remote region: the peer's arena.
    pub(super) fn arena_for(&self, mixed: bool) -> Option<&Arc<PeerBounce>> {
        match &self.owner {
            MdOwner::Remote {
                staged: Some(h), ..
            } if mixed => Some(h),
            _ => self.arena(),
        }
    }

    /// Where a remote region kept its mapping ([`ipc::MappedRegion`]).
    pub fn mapped(&self) -> Option<&std::sync::OnceLock<ipc::MappedRegion>> {
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
// parts, engine::ipc).
unsafe impl Send for RawDesc {}
// SAFETY: as above.
unsafe impl Sync for RawDesc {}

// A table's parts read `Md`s from several threads through `&Md` made from
// raw pointers, which the compiler does not check: it must be Sync.
const _: () = {
    pub(super) const fn sync<T: Sync>() {}
    sync::<Md>()
};

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
