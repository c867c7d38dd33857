//! The data plane: the arena, registered once with the inner UCX agent, and
//! one NIXL WRITE per chunk from a local region into a region of the peer's
//! arena; or, between two host arenas on one host, one copy by cross-memory
//! attach on the CMA path's threads (UCX copies those inside its post, one
//! at a time).

pub mod vram;

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::cma::{Cma, CmaPeer, CmaXfer};
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp,
    XferRequest, XferStatus,
};

/// Page-aligned host memory for the arena (anonymous mapping, released on drop).
#[derive(Debug)]
pub struct HostArena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; which thread
// touches which byte is decided by the protocol (one owner per region).
unsafe impl Send for HostArena {}
// SAFETY: as above; &HostArena only hands out addresses.
unsafe impl Sync for HostArena {}

impl HostArena {
    pub fn new(len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "arena size is zero",
            ));
        }
        // SAFETY: an anonymous private mapping with no address hint; the
        // result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: NonNull::new(p as *mut u8).expect("mmap never returns NULL on success"),
            len,
        })
    }
    pub fn base(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in new().
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

impl MemoryRegion for HostArena {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for HostArena {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// A bounce arena: registered memory the protocol carves into regions. Host
/// memory ([`HostArena`]) or device memory (the CUDA arena).
pub trait Arena: NixlDescriptor + Send + Sync + std::fmt::Debug {
    /// Address of the first byte (a device address for device memory).
    fn base(&self) -> usize;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Arena for HostArena {
    fn base(&self) -> usize {
        HostArena::base(self)
    }
    fn len(&self) -> usize {
        HostArena::len(self)
    }
}

/// Lends any arena (also behind `dyn`) to nixl-sys, which registers sized
/// descriptors only.
#[derive(Debug)]
struct ArenaRef<'a, A: Arena + ?Sized>(&'a A);

impl<A: Arena + ?Sized> MemoryRegion for ArenaRef<'_, A> {
    unsafe fn as_ptr(&self) -> *const u8 {
        // SAFETY: forwards to the arena's own as_ptr under the same contract.
        unsafe { self.0.as_ptr() }
    }
    fn size(&self) -> usize {
        self.0.size()
    }
}

impl<A: Arena + ?Sized> NixlDescriptor for ArenaRef<'_, A> {
    fn mem_type(&self) -> MemType {
        self.0.mem_type()
    }
    fn device_id(&self) -> u64 {
        self.0.device_id()
    }
}

/// Where a peer's arena lives, from its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerArena {
    /// The peer's inner agent (the write target).
    pub inner_agent: String,
    pub base: u64,
    pub device: u64,
    pub mem: MemType,
    /// A host arena of a process proven on this host: chunk writes into it
    /// go by cross-memory attach.
    pub cma: Option<CmaTarget>,
}

/// A peer's host arena as the CMA path reaches it: the proven process and
/// the arena's length, which bounds every write into it (UCX's remote key
/// bounds its writes; a cross-memory write has only this check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmaTarget {
    peer: Arc<CmaPeer>,
    len: u64,
}

impl CmaTarget {
    /// The arena of `len` bytes of a proven peer, when that peer is another
    /// process: two agents of this one keep NIXL's writes, which cannot
    /// reach an arena freed under them (a memory copy would fault).
    pub fn of(peer: Arc<CmaPeer>, len: u64) -> Option<Self> {
        matches!(*peer, CmaPeer::Process { .. }).then_some(Self { peer, len })
    }
}

/// Issues chunk writes through the inner agent (or the CMA path).
#[derive(Debug)]
pub struct DataPlane {
    agent: Agent,
    arena_base: usize,
    arena_len: usize,
    arena_mem: MemType,
    arena_dev: u64,
    /// The engine's CMA path, for writes between two host arenas of one
    /// host (`None`: every write goes through the inner agent).
    cma: Option<Arc<Cma>>,
    _registration: RegistrationHandle,
}

/// A chunk write in flight.
pub enum ChunkWrite {
    Nixl(XferRequest),
    Cma(CmaXfer),
}

/// How long a chunk write by cross-memory attach may run before it is
/// stopped and fails (a 64 MiB chunk takes a few milliseconds).
const CMA_WRITE_LIMIT: Duration = Duration::from_secs(60);

impl std::fmt::Debug for ChunkWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Nixl(_) => "ChunkWrite(nixl)",
            Self::Cma(_) => "ChunkWrite(cma)",
        })
    }
}

impl ChunkWrite {
    /// Stops a cross-memory write still running (at its next piece);
    /// whether it was one. A NIXL write cannot be stopped.
    pub fn cancel(&self) -> bool {
        matches!(self, Self::Cma(x) if x.cancel())
    }

    /// Whether it is a cross-memory write that may still touch either
    /// arena.
    pub fn copying(&self) -> bool {
        matches!(self, Self::Cma(x) if x.running())
    }
}

/// Where a chunk write stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteState {
    InProgress,
    /// Complete at the target (NIXL's UCX backend flushes before reporting success).
    Done,
    Failed(DataPlaneError),
}

/// Why the arena's registration or export, or a chunk write, failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataPlaneError {
    /// A call of the inner UCX agent failed: `call` says which, and on what.
    #[error("{call}: {cause}")]
    Nixl {
        /// The call and its subject.
        call: String,
        /// NIXL's error.
        cause: String,
    },
    /// A chunk write's range leaves one of the two arenas, or wraps.
    #[error("{0}")]
    OutOfRange(String),
    /// The copy by cross-memory attach failed.
    #[error("{what}: {cause}")]
    Cma {
        /// The write.
        what: String,
        /// The CMA path's error.
        cause: String,
    },
}

impl DataPlaneError {
    fn nixl(call: impl Into<String>, cause: impl std::fmt::Display) -> DataPlaneError {
        DataPlaneError::Nixl {
            call: call.into(),
            cause: cause.to_string(),
        }
    }
}

/// For callers whose errors are text (the engine's set-up).
impl From<DataPlaneError> for String {
    fn from(e: DataPlaneError) -> String {
        e.to_string()
    }
}

impl DataPlane {
    /// Registers `arena` with the inner agent (once, for the engine's life);
    /// `cma`: the engine's CMA path, for writes into host arenas of this
    /// host when this arena is host memory too.
    pub fn new<A: Arena + ?Sized>(
        agent: Agent,
        arena: &A,
        cma: Option<Arc<Cma>>,
    ) -> Result<Self, DataPlaneError> {
        let registration = agent.register_memory(&ArenaRef(arena), None).map_err(|e| {
            DataPlaneError::nixl(
                format!(
                    "registering the {}-byte arena with the inner UCX agent",
                    arena.len()
                ),
                e,
            )
        })?;
        Ok(Self {
            agent,
            arena_base: arena.base(),
            arena_len: arena.len(),
            arena_mem: arena.mem_type(),
            arena_dev: arena.device_id(),
            cma: cma.filter(|_| arena.mem_type() == MemType::Dram),
            _registration: registration,
        })
    }

    /// The inner agent's metadata for the arena alone: what a peer loads to
    /// be able to write into it.
    pub fn arena_metadata(&self) -> Result<Vec<u8>, DataPlaneError> {
        let mut descs = nixl_sys::RegDescList::new(self.arena_mem)
            .map_err(|e| DataPlaneError::nixl("descriptor list", e))?;
        descs.add_desc(self.arena_base, self.arena_len, self.arena_dev);
        self.agent
            .get_local_partial_md(&descs, None)
            .map_err(|e| DataPlaneError::nixl("exporting the arena's metadata", e))
    }

    /// Starts writing `len` bytes at local arena offset `local` into the
    /// peer's arena at offset `remote`.
    pub fn post_write(
        &self,
        peer: &PeerArena,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<ChunkWrite, DataPlaneError> {
        let end = local
            .checked_add(len)
            .filter(|&e| e <= self.arena_len as u64);
        if end.is_none() || len == 0 {
            return Err(DataPlaneError::OutOfRange(format!(
                "chunk write of {len} bytes at local offset {local} leaves the arena"
            )));
        }
        if let Some(w) = self.post_cma(peer, local, remote, len)? {
            return Ok(w);
        }
        let mut l = XferDescList::new(self.arena_mem)
            .map_err(|e| DataPlaneError::nixl("descriptor list", e))?;
        l.add_desc(
            self.arena_base + local as usize,
            len as usize,
            self.arena_dev,
        );
        let mut r =
            XferDescList::new(peer.mem).map_err(|e| DataPlaneError::nixl("descriptor list", e))?;
        let target = peer
            .base
            .checked_add(remote)
            .ok_or_else(|| DataPlaneError::OutOfRange("remote region address overflows".into()))?;
        r.add_desc(target as usize, len as usize, peer.device);
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &l, &r, &peer.inner_agent, None)
            .map_err(|e| {
                DataPlaneError::nixl(
                    format!("preparing a {len}-byte chunk write to {}", peer.inner_agent),
                    e,
                )
            })?;
        match self.agent.post_xfer_req(&req, None) {
            Ok(_) => Ok(ChunkWrite::Nixl(req)),
            Err(e) => Err(DataPlaneError::nixl(
                format!("posting a {len}-byte chunk write to {}", peer.inner_agent),
                e,
            )),
        }
    }

    /// The write by cross-memory attach, when both arenas are host memory
    /// and the peer's process is proven on this host; `None`: go through
    /// the inner agent.
    fn post_cma(
        &self,
        peer: &PeerArena,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<Option<ChunkWrite>, DataPlaneError> {
        let (Some(cma), Some(target)) = (&self.cma, &peer.cma) else {
            return Ok(None);
        };
        if peer.mem != MemType::Dram {
            return Ok(None);
        }
        if remote.checked_add(len).is_none_or(|e| e > target.len) {
            return Err(DataPlaneError::OutOfRange(format!(
                "chunk write of {len} bytes at offset {remote} leaves {}'s {}-byte arena",
                peer.inner_agent, target.len
            )));
        }
        let (Some(from), Some(to)) = (
            (self.arena_base as u64).checked_add(local),
            peer.base.checked_add(remote),
        ) else {
            return Err(DataPlaneError::OutOfRange(
                "chunk write address overflows".into(),
            ));
        };
        let Some(mut x) = cma.chunk_write(target.peer.clone(), from, to, len) else {
            return Ok(None);
        };
        match cma.post(&mut x, None) {
            Some(Err(e)) => Err(DataPlaneError::Cma {
                what: format!(
                    "{len}-byte chunk write to {} by cross-memory attach",
                    peer.inner_agent
                ),
                cause: e,
            }),
            _ => Ok(Some(ChunkWrite::Cma(x))),
        }
    }

    pub fn poll(&self, w: &ChunkWrite) -> WriteState {
        match w {
            ChunkWrite::Nixl(req) => match self.agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => WriteState::Done,
                Ok(XferStatus::InProgress) => WriteState::InProgress,
                Err(e) => WriteState::Failed(DataPlaneError::nixl("chunk write failed", e)),
            },
            ChunkWrite::Cma(x) => match x.outcome(CMA_WRITE_LIMIT) {
                // Failed by its time limit, a part may still be copying.
                None => WriteState::InProgress,
                Some(_) if x.running() => WriteState::InProgress,
                Some(Ok(())) => WriteState::Done,
                Some(Err(e)) => WriteState::Failed(DataPlaneError::Cma {
                    what: "chunk write by cross-memory attach".into(),
                    cause: e,
                }),
            },
        }
    }
}
