//! The bounce path of one engine: an instance (arena, control channel,
//! protocol endpoint, reactor) per memory location in use, the admission of
//! peers' instances, and the routing decision.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nixl_sys::{Agent, MemType};

use crate::config::{Config, IoThreadUse};
use crate::control::notif::{NotifChannel, NotifHub};
use crate::control::tcp::{TcpChannel, TcpConfig};
use crate::control::zmq::{BindSpec, ZmqChannel, ZmqConfig};
use crate::control::ControlChannel;
use crate::copy::host::HostCopy;
use crate::copy::{CopyEngine, RegionSpan};
use crate::dataplane::{Arena, CmaTarget, DataPlane, HostArena, PeerArena};
use crate::engine::cma::{Cma, CmaPeer};
use crate::engine::conn_info::{ArenaSeal, CmaExport, DataPath};
use crate::failpoint::Failpoints;
use crate::proto::wire::{Capabilities, ControlKind, Handshake, Incompatible, WIRE_VERSION};
use crate::proto::PeerId;
use crate::proto::{Endpoint, EndpointConfig};
use crate::runtime::{Parts, PeerCallError, Runtime};
use crate::sync::Locked;

use super::{MemKind, Op, TotalBytes};

/// The memory an instance serves: host memory, or the memory of one GPU;
/// for a GPU, with its arena in the GPU's memory or, `host_staged`, in
/// host memory pinned for it (the instance for mixed-memory transfers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    pub kind: MemKind,
    pub device: u64,
    pub host_staged: bool,
}

impl Location {
    /// The instance with its arena in the memory it serves.
    pub fn of(kind: MemKind, device: u64) -> Self {
        Location {
            kind,
            device,
            host_staged: false,
        }
    }

    /// GPU `device`'s host-staged instance.
    pub fn staged(device: u64) -> Self {
        Location {
            kind: MemKind::Vram,
            device,
            host_staged: true,
        }
    }

    /// The memory the arena lives in.
    pub fn arena_kind(&self) -> MemKind {
        match self.host_staged {
            true => MemKind::Dram,
            false => self.kind,
        }
    }

    /// The arena's device id as NIXL names it (0 for host memory).
    pub fn arena_device(&self) -> u64 {
        match self.arena_kind() {
            MemKind::Dram => 0,
            MemKind::Vram => self.device,
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.kind, self.host_staged) {
            (MemKind::Dram, _) => f.write_str("DRAM"),
            (MemKind::Vram, false) => write!(f, "VRAM device {}", self.device),
            (MemKind::Vram, true) => {
                write!(f, "VRAM device {}, staged in host memory", self.device)
            }
        }
    }
}

/// The bounce path for one memory location of one engine: its arena, control
/// channel, protocol endpoint and reactor. Created when memory at that
/// location is first registered. Field order matters: the runtime (which
/// reads and writes the arena) stops before the arena is released.
pub struct Bounce {
    pub location: Location,
    pub handshake: Handshake,
    /// The inner agent's metadata for the arena (peers load it to write).
    pub arena_metadata: Vec<u8>,
    pub runtime: Runtime,
    /// Peers this instance's runtime already knows (to add each once).
    known_peers: Mutex<HashSet<PeerId>>,
    /// The data path READs carry to owners without `DATA_PATH_V2`, where it
    /// differs from the current one.
    data_path_v1: Option<Vec<u8>>,
    _arena: Arc<dyn Arena>,
    /// A host arena's seal ([`ArenaSeal`]): where a same-host owner checks
    /// that a READ's data path names this live arena. Kept (at a fixed
    /// address) as long as the arena.
    _seal: Option<Box<[u8; 32]>>,
}

impl std::fmt::Debug for Bounce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounce")
            .field("location", &self.location)
            .field("handshake", &self.handshake)
            .finish_non_exhaustive()
    }
}

/// Everything an instance shares with its engine.
pub struct Shared<'a> {
    pub inner: &'a Agent,
    pub inner_name: &'a str,
    /// The inner agent's metadata from its creation (its connection).
    pub inner_md: &'a [u8],
    pub hub: &'a Arc<NotifHub>,
    pub agent: &'a str,
    pub config: &'a Config,
    pub failpoints: &'a Failpoints,
    /// The readers' agents loaded for served READs, over all instances.
    pub readers: &'a Arc<ReaderAgents>,
    /// The engine's CMA path: chunk writes between host arenas of one host.
    pub cma: &'a Arc<super::cma::Cma>,
}

impl Bounce {
    /// Allocates and registers the arena at `location`, binds the control
    /// channel and starts the reactor.
    pub fn start(shared: &Shared<'_>, location: Location) -> Result<Self, String> {
        let config = shared.config;
        let capacity = config.arena_usable_capacity();
        let (arena, copier): (Arc<dyn Arena>, Arc<dyn CopyEngine>) = match location.kind {
            MemKind::Dram => {
                let arena = HostArena::new(capacity as usize)
                    .map_err(|e| format!("allocating the {capacity}-byte host arena: {e}"))?;
                (Arc::new(arena), Arc::new(HostCopy::default()))
            }
            MemKind::Vram if location.host_staged => {
                crate::copy::staged_arena(location.device, capacity as usize, config)?
            }
            MemKind::Vram => crate::copy::device_arena(location.device, capacity as usize, config)?,
        };
        let data = DataPlane::new(shared.inner.clone(), &*arena, Some(shared.cma.clone()))?;
        let arena_metadata = data.arena_metadata()?;
        let control = config.control_kind();
        let liveness = (config.peer_liveness_timeout_ms > 0)
            .then(|| Duration::from_millis(config.peer_liveness_timeout_ms));
        // Tests shrink the per-peer send queue (messages) to fill it.
        let send_bound = shared.failpoints.value("control_send_hwm");
        let bind = || {
            if config.control_bind_loopback {
                BindSpec::loopback()
            } else if !config.control_interface.is_empty() {
                BindSpec::interface(config.control_interface.clone())
            } else {
                BindSpec::auto()
            }
        };
        let channel: Box<dyn ControlChannel> = match control {
            ControlKind::NixlNotif => Box::new(
                NotifChannel::new(shared.hub.clone())
                    .map_err(|e| e.to_string())?
                    .with_active_poll(std::time::Duration::from_micros(config.notif_poll_us))
                    .with_liveness(Duration::from_millis(config.peer_liveness_timeout_ms)),
            ),
            ControlKind::Tcp => {
                let defaults = TcpConfig::default();
                let tcp = TcpConfig {
                    liveness_timeout: liveness,
                    send_queue: send_bound
                        .map_or(defaults.send_queue, |n| n.clamp(1, 1 << 20) as usize),
                };
                Box::new(TcpChannel::new(&bind(), tcp).map_err(|e| e.to_string())?)
            }
            ControlKind::Zmq => {
                let defaults = ZmqConfig::default();
                let zmq = ZmqConfig {
                    liveness_timeout: liveness,
                    send_hwm: send_bound
                        .map_or(defaults.send_hwm, |n| n.clamp(1, i32::MAX as u64) as i32),
                    ..defaults
                };
                Box::new(ZmqChannel::new(&bind(), zmq).map_err(|e| e.to_string())?)
            }
        };
        let endpoint_bytes = channel.local_endpoint().as_bytes().to_vec();
        let access_key = u64::from_le_bytes(random_bytes()?);
        let mut endpoint = Endpoint::new(EndpointConfig {
            access_key,
            incarnation: incarnation(),
            ..EndpointConfig::from_config(config, endpoint_bytes.clone(), request_id_base())
        })
        .map_err(|e| format!("protocol endpoint: {e}"))?;
        // A host arena's seal, for owners that write into it by
        // cross-memory attach.
        let seal = match (location.arena_kind(), shared.cma.export()) {
            (MemKind::Dram, Some(export)) => {
                let mut seal = ArenaSeal {
                    addr: 0,
                    token: random_bytes()?,
                    len: arena.len() as u64,
                };
                let kept = Box::new(seal.image(arena.base() as u64));
                seal.addr = kept.as_ptr() as u64;
                Some((export, seal, kept))
            }
            _ => None,
        };
        // Every READ tells the data owner how to write into this arena.
        let data_path = DataPath {
            kind: location.arena_kind() as u8,
            device: location.arena_device(),
            base: arena.base() as u64,
            inner_agent: shared.inner_name.to_string(),
            conn_md: shared.inner_md.to_vec(),
            arena_md: arena_metadata.clone(),
            // A host arena: a same-host owner may write it by cross-memory
            // attach, once it found the seal.
            cma: seal.as_ref().map(|(e, seal, _)| (*e, *seal)),
        };
        endpoint.set_read_data_path(data_path.encode());
        // Without its CMA block the data path is of version 1, which owners
        // that do not advertise DATA_PATH_V2 (older builds) read.
        let data_path_v1 = data_path.cma.is_some().then(|| {
            DataPath {
                cma: None,
                ..data_path
            }
            .encode()
        });
        let mut handshake = Handshake {
            endpoint: endpoint_bytes,
            arena_base: arena.base() as u64,
            arena_device: location.arena_device() as u32,
            access_key,
            ..local_handshake(config, control)
        };
        // Play peers built without a capability (tests of the negotiation).
        for (failpoint, capability) in [
            ("advertise_no_read", Capabilities::READ),
            ("advertise_no_heartbeats", Capabilities::HEARTBEATS),
            ("advertise_no_standing", Capabilities::STANDING),
            ("advertise_no_data_path_v2", Capabilities::DATA_PATH_V2),
            ("no_cancel_capability", Capabilities::CANCEL),
        ] {
            if shared.failpoints.is_set(failpoint) {
                handshake.capabilities = handshake.capabilities.without(capability);
            }
        }
        let notifier = shared.inner.clone();
        let (loader, unloader) = (shared.readers.clone(), shared.readers.clone());
        let workers = (config.scatter_worker_count as usize).clamp(1, 64);
        let runtime = Runtime::start(Parts {
            name: format!("{} {location}", shared.agent),
            endpoint,
            channel,
            data,
            arena: RegionSpan {
                addr: arena.base(),
                len: arena.len(),
            },
            copier,
            copy_workers: workers,
            busy_poll: std::time::Duration::from_micros(config.busy_poll_us),
            reactor_busy_poll: std::time::Duration::from_micros(
                match config.reactor_busy_poll_us {
                    0 => config.busy_poll_us,
                    us => us,
                },
            ),
            receive_pass: std::time::Duration::from_micros(config.receive_pass_us),
            chunk_writes: config
                .chunk_writes_for(location.arena_kind() == MemKind::Vram)
                .unwrap_or(IoThreadUse::Never),
            chunk_writer_threads: config.chunk_writer_threads as usize,
            copy_launches: config.copy_launches().unwrap_or(IoThreadUse::Always),
            group_copy_launches: config.group_copy_launches,
            failpoints: shared.failpoints.clone(),
            notify: Box::new(move |target: &str, msg: &[u8]| {
                notifier
                    .send_notification(target, msg, None)
                    .map_err(|e| PeerCallError::Nixl {
                        call: format!("sending a notification to {target}"),
                        cause: e.to_string(),
                    })
            }),
            load_data_path: Box::new(move |bytes: &[u8]| loader.load(bytes)),
            unload_data_path: Box::new(move |bytes: &[u8]| unloader.unload(bytes)),
        })
        .map_err(|e| format!("starting the reactor: {e}"))?;
        tracing::info!(agent = shared.agent, %location, capacity, "bounce arena ready");
        Ok(Self {
            location,
            handshake,
            arena_metadata,
            runtime,
            known_peers: Mutex::new(HashSet::new()),
            data_path_v1,
            _arena: arena,
            _seal: seal.map(|(_, _, kept)| kept),
        })
    }

    /// Tells this instance's runtime about `peer` (once). The set stays
    /// locked while the command is queued: a second thread that finds the
    /// peer known queues its transfer after it.
    pub fn ensure_peer(&self, peer: &PeerBounce) {
        let mut known = self.known_peers.locked();
        if known.insert(peer.id.clone()) {
            let data_path = match peer.data_path_v2 {
                true => None,
                false => self.data_path_v1.clone(),
            };
            self.runtime.add_peer(
                peer.id.clone(),
                peer.arena.clone(),
                peer.key,
                peer.heartbeats,
                peer.standing,
                data_path,
            );
        }
    }

    /// Forgets `peer`: as a target of our writes, and as a sender whose
    /// flows we serve (which we may hold without ever having written to it).
    pub fn forget_peer(&self, peer: &PeerId) {
        let mut known = self.known_peers.locked();
        known.remove(peer);
        self.runtime.forget_peer(peer.clone());
    }
}

impl Drop for Bounce {
    /// Stops the reactor first. An arena it could not prove quiescent (a
    /// write or copy that never ended) is poisoned: a transport may still
    /// read or write it, so its memory is leaked rather than handed back to
    /// the allocator (fail-closed).
    fn drop(&mut self) {
        self.runtime.stop();
        if let Some(why) = self.runtime.poisoned() {
            tracing::error!(
                location = %self.location,
                bytes = self._arena.len(),
                "leaking the poisoned bounce arena ({why}): it may still be written"
            );
            std::mem::forget(self._arena.clone());
        }
    }
}

impl crate::engine::conn_info::PublicBounce {
    /// What peers need of `instance` to reach it: its arena's memory and
    /// registration, and its handshake.
    pub fn of(instance: &Bounce) -> Self {
        Self {
            kind: instance.location.arena_kind() as u8,
            arena_md: instance.arena_metadata.clone(),
            handshake: instance.handshake.encode(),
        }
    }
}

/// The readers' agents our inner agent loaded to serve their READs (the
/// data paths their READs described), counted over the engine's instances:
/// a reader's agent is invalidated in the inner agent when no instance
/// writes to it any more, unless the application loaded that agent itself
/// (its metadata then belongs to the application's own transfers).
pub struct ReaderAgents {
    inner: Agent,
    inner_name: String,
    /// The application's remote agents (see `Engine::remotes`).
    remotes: Arc<Mutex<HashMap<String, super::Remote>>>,
    /// Loaded data paths per reader's inner agent name. Loading and
    /// unloading hold this lock, so one instance cannot invalidate an agent
    /// another is loading.
    loads: Mutex<HashMap<String, usize>>,
    /// Control rides the inner agent's notifications: a reader's agent is
    /// then never invalidated (see [`ReaderAgents::unload`]).
    keep_loaded: bool,
    /// Proves a reader's process on this host (its data path's CMA block).
    cma: Arc<Cma>,
    /// The highest data-path version read (lower only where a failpoint
    /// plays an older build: `advertise_no_data_path_v2`).
    max_data_path: u16,
}

impl std::fmt::Debug for ReaderAgents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaderAgents")
            .field("loads", &self.loads)
            .finish_non_exhaustive()
    }
}

impl ReaderAgents {
    pub(super) fn new(
        inner: Agent,
        inner_name: String,
        remotes: Arc<Mutex<HashMap<String, super::Remote>>>,
        keep_loaded: bool,
        cma: Arc<Cma>,
        failpoints: &Failpoints,
    ) -> Self {
        Self {
            inner,
            inner_name,
            remotes,
            loads: Mutex::new(HashMap::new()),
            keep_loaded,
            cma,
            max_data_path: match failpoints.is_set("advertise_no_data_path_v2") {
                true => 1,
                false => crate::engine::conn_info::DATA_PATH_VERSION,
            },
        }
    }

    /// Makes a reader's arena (described in its READ) a write target of
    /// our inner agent. Loading what the inner agent already knows (a peer
    /// we also write to) fails harmlessly; a data path that really is
    /// unusable makes the chunk writes fail, and with them the READ.
    fn load(&self, bytes: &[u8]) -> Result<PeerArena, PeerCallError> {
        let dp = DataPath::decode_up_to(bytes, self.max_data_path)?;
        let vram = dp.kind == MemKind::Vram as u8;
        let cma = match &dp.cma {
            Some((export, seal)) if !vram => self.sealed(export, seal, dp.base, &dp.inner_agent),
            _ => None,
        };
        let mut loads = self.loads.locked();
        for (what, md) in [("connection", &dp.conn_md), ("arena", &dp.arena_md)] {
            if md.is_empty() {
                continue;
            }
            if let Err(e) = self.inner.load_remote_md(md) {
                tracing::debug!(reader = %dp.inner_agent, "loading the reader's {what} metadata: {e} (already known?)");
            }
        }
        *loads.entry(dp.inner_agent.clone()).or_default() += 1;
        Ok(PeerArena {
            inner_agent: dp.inner_agent,
            base: dp.base,
            device: dp.device,
            mem: if vram { MemType::Vram } else { MemType::Dram },
            cma,
        })
    }

    /// A reader's host arena as a target of chunk writes by cross-memory
    /// attach ([`CmaTarget::of`]): its process proven on this host, and
    /// the seal found where the data path says, naming this arena.
    /// Otherwise `None`: the writes go through NIXL.
    fn sealed(
        &self,
        export: &CmaExport,
        seal: &ArenaSeal,
        base: u64,
        reader: &str,
    ) -> Option<CmaTarget> {
        let peer = self.cma.peer(export)?;
        let CmaPeer::Process { pid, .. } = *peer else {
            return None;
        };
        match super::cma::seal_found(pid, seal, base) {
            Ok(true) => CmaTarget::of(peer, seal.len),
            Ok(false) => {
                tracing::warn!(%reader, pid, "a READ's data path names a host arena whose seal is not where it says; its chunk writes go through NIXL");
                None
            }
            Err(e) => {
                tracing::warn!(%reader, pid, "reading a READ's arena seal: {e}; its chunk writes go through NIXL");
                None
            }
        }
    }

    /// Undoes one [`ReaderAgents::load`] of `bytes` (nothing writes through
    /// it any more): the reader's agent is invalidated with the last one,
    /// unless the application loaded it or it is our own.
    fn unload(&self, bytes: &[u8]) -> Result<(), PeerCallError> {
        let dp = DataPath::decode(bytes)?;
        let mut loads = self.loads.locked();
        let Some(n) = loads.get_mut(&dp.inner_agent) else {
            return Ok(());
        };
        *n -= 1;
        if *n > 0 {
            return Ok(());
        }
        loads.remove(&dp.inner_agent);
        if dp.inner_agent == self.inner_name {
            return Ok(());
        }
        if self.keep_loaded {
            // Over NIXL notifications the reader's messages come through
            // this very agent entry: invalidating it breaks the UCX
            // connection the reader sends on, so a reader forgotten while
            // stopped could never reach us again (its READs would time
            // out). The entry stays, as for a sender known by its WANTs.
            tracing::debug!(reader = %dp.inner_agent, "reader's data path given up; its agent stays loaded (notification control)");
            return Ok(());
        }
        // Held while invalidating: the application's loads take this lock
        // before they load into the inner agent.
        let remotes = self.remotes.locked();
        if remotes.values().any(|r| *r.inner == *dp.inner_agent) {
            return Ok(());
        }
        self.inner
            .invalidate_remote_md(&dp.inner_agent)
            .map_err(|e| PeerCallError::Nixl {
                call: format!("invalidating reader agent {:?}", dp.inner_agent),
                cause: e.to_string(),
            })?;
        tracing::debug!(reader = %dp.inner_agent, "reader's agent invalidated");
        Ok(())
    }

    /// Readers' agents loaded now (tests and stats).
    pub fn loaded(&self) -> usize {
        self.loads.locked().len()
    }
}

/// The handshake fields that depend only on the configuration (what two
/// peers must agree on).
pub fn local_handshake(config: &Config, control: ControlKind) -> Handshake {
    Handshake {
        wire_version: WIRE_VERSION,
        control,
        capabilities: Capabilities::CANCEL
            .with(Capabilities::READ)
            .with(Capabilities::HEARTBEATS)
            .with(Capabilities::DATA_PATH_V2)
            .with(match config.standing_credit_peers {
                0 => Capabilities(0),
                _ => Capabilities::STANDING,
            }),
        arena_usable_capacity: config.arena_usable_capacity(),
        max_chunk_size: config.max_chunk_size_bytes,
        arena_base: 0,
        arena_device: 0,
        access_key: 0,
        endpoint: Vec::new(),
    }
}

/// A peer's bounce instance for the memory a remote region lives in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerBounce {
    pub id: PeerId,
    pub arena: PeerArena,
    /// The peer's access key (carried by every WANT/CANCEL/READ to it).
    pub key: u64,
    /// The peer serves READs over the bounce path.
    pub read: bool,
    /// The peer answers the notification channel's heartbeats.
    pub heartbeats: bool,
    /// The peer offers standing credits (`Capabilities::STANDING`).
    pub standing: bool,
    /// The peer reads data paths of version 2 (`Capabilities::DATA_PATH_V2`).
    pub data_path_v2: bool,
    /// How UCX reaches the peer, for the DRAM arena's gate.
    pub reach: Reach,
}

/// How the UCX delegate reaches a peer, as far as the DRAM arena's gate is
/// concerned: its gate was measured on one host, where UCX copies through
/// shared memory; over TCP UCX pays a message per descriptor, and the arena
/// wins from far fewer descriptors, of any size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reach {
    /// On this host, or not known to be elsewhere.
    #[default]
    Near,
    /// On another host (its boot id differs from ours) while this host has
    /// no RDMA device UCX may use ([`tcp_only_host`]).
    Tcp,
}

impl Reach {
    /// A peer whose regions name the host `peer_host` (its boot id; `None`:
    /// not said, e.g. a build without CMA blocks), seen from `our_host`
    /// (ours; `None`: unknown) on a host that is `tcp_only` or not.
    pub fn of(peer_host: Option<[u8; 16]>, our_host: Option<[u8; 16]>, tcp_only: bool) -> Reach {
        match (peer_host, our_host) {
            (Some(p), Some(o)) if p != o && tcp_only => Reach::Tcp,
            _ => Reach::Near,
        }
    }
}

/// Whether UCX on this host can reach another host only over TCP: no RDMA
/// device in `/sys/class/infiniband`, or `UCX_TLS` naming no RDMA transport
/// (read once).
pub fn tcp_only_host() -> bool {
    static TCP_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TCP_ONLY.get_or_init(|| {
        let devices = std::fs::read_dir("/sys/class/infiniband")
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        !devices || !ucx_tls_allows_rdma(std::env::var("UCX_TLS").ok().as_deref())
    })
}

/// Whether a `UCX_TLS` value lets UCX use an RDMA transport: unset, `all`,
/// a list naming one (`rc`, `dc`, `ud`, `ib`, `srd`, `gga` and their
/// variants, such as `rc_mlx5` or `ud:aux`), or an exclusion list (`^...`)
/// that leaves one (`^ib` leaves none, nor does excluding `rc`, `dc`, `ud`,
/// `srd` and `gga` each).
pub fn ucx_tls_allows_rdma(tls: Option<&str>) -> bool {
    const RDMA: [&str; 6] = ["rc", "dc", "ud", "ib", "srd", "gga"];
    let family = |name: &str| {
        let name = name.trim();
        let name = name.split(':').next().unwrap_or(name);
        RDMA.iter()
            .find(|r| name == **r || name.starts_with(&format!("{r}_")))
            .copied()
    };
    let Some(tls) = tls.map(str::trim).filter(|t| !t.is_empty()) else {
        return true;
    };
    if let Some(excluded) = tls.strip_prefix('^') {
        let gone: Vec<&str> = excluded.split(',').filter_map(family).collect();
        return !gone.contains(&"ib")
            && !RDMA
                .iter()
                .filter(|r| **r != "ib")
                .all(|r| gone.contains(r));
    }
    tls.split(',')
        .any(|t| t.trim() == "all" || family(t).is_some())
}

/// Checks a peer's advertised bounce instance against our configuration.
/// On refusal: the counter naming the reason, and the reason.
///
/// `cma`: the peer's process, proven on this host: chunk writes into a host
/// arena of it go by cross-memory attach, bounded by its usable capacity.
pub fn admit(
    config: &Config,
    kind: MemKind,
    inner_agent: &str,
    peer: &Handshake,
    cma: Option<Arc<CmaPeer>>,
) -> Result<PeerBounce, (RareCounter, String)> {
    local_handshake(config, config.control_kind())
        .check_compatible(peer)
        .map_err(|e: Incompatible| (incompatibility_counter(&e), e.to_string()))?;
    let id = peer_id_of(&peer.endpoint).ok_or((
        (|c| &c.peer_incompatible_endpoint) as RareCounter,
        "the peer's control endpoint is not text".to_string(),
    ))?;
    Ok(PeerBounce {
        id,
        key: peer.access_key,
        read: peer.capabilities.contains(Capabilities::READ),
        heartbeats: peer.capabilities.contains(Capabilities::HEARTBEATS),
        standing: peer.capabilities.contains(Capabilities::STANDING),
        data_path_v2: peer.capabilities.contains(Capabilities::DATA_PATH_V2),
        reach: Reach::Near,
        arena: PeerArena {
            inner_agent: inner_agent.to_string(),
            base: peer.arena_base,
            device: u64::from(peer.arena_device),
            mem: match kind {
                MemKind::Dram => MemType::Dram,
                MemKind::Vram => MemType::Vram,
            },
            cma: match kind {
                MemKind::Dram => cma.and_then(|p| CmaTarget::of(p, peer.arena_usable_capacity)),
                MemKind::Vram => None,
            },
        },
    })
}

/// The counter an incompatible peer instance bumps (its transfers then
/// count as `fallback_peer_not_bounce_capable`).
fn incompatibility_counter(e: &Incompatible) -> RareCounter {
    match e {
        Incompatible::WireVersion { .. } => |c| &c.peer_incompatible_wire_version,
        Incompatible::ControlKind { .. } => |c| &c.peer_incompatible_control_kind,
        Incompatible::MaxChunk { .. } => |c| &c.peer_incompatible_chunk_size,
        Incompatible::NoCancel => |c| &c.peer_incompatible_no_cancel,
        Incompatible::NoEndpoint => |c| &c.peer_incompatible_endpoint,
    }
}

/// Which of the rare counters an event bumps.
pub type RareCounter = fn(&crate::stats::RareCounters) -> &std::sync::atomic::AtomicU64;

/// The protocol's name for a peer: its control endpoint up to the first NUL
/// byte (a notification endpoint carries the peer's metadata after one; the
/// channel names senders without it).
pub fn peer_id_of(endpoint: &[u8]) -> Option<crate::proto::PeerId> {
    let head = endpoint.split(|&b| b == 0).next().unwrap_or_default();
    std::str::from_utf8(head)
        .ok()
        .filter(|s| !s.is_empty())
        .map(crate::proto::PeerId::new)
}

/// `N` random bytes from the kernel (the arena's access key, its seal).
fn random_bytes<const N: usize>() -> Result<[u8; N], String> {
    let mut buf = [0u8; N];
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        return Err(format!(
            "getrandom failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(buf)
}

/// Request ids must not repeat across incarnations of an agent (the peer may
/// remember a cancelled id): start from the clock and the process id.
/// The protocol endpoint's incarnation: nanoseconds of the wall clock (a
/// quarter of them, room for the standing offers' tokens to count up from
/// it), so a restarted agent's is another, larger one: its offers start
/// above its last incarnation's, which its senders remember having
/// claimed, and receivers tell it from its last as a sender.
fn incarnation() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos >> 2
}

fn request_id_base() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 40)
}

/// Why a transfer takes the standard (UCX) path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fallback {
    BounceDisabled,
    Poisoned,
    PeerNotBounceCapable,
    /// A READ from a peer whose bounce instance does not serve READs.
    PeerLacksRead,
    LocalTransfer,
    NoLocalArena,
    TooFewDescriptors,
    DescriptorsTooLarge,
    /// The descriptors cannot be planned (e.g. sources on several devices).
    Unplannable,
}

impl Fallback {
    /// Every reason, in [`Fallback::index`] order.
    pub const ALL: [Fallback; 9] = [
        Self::BounceDisabled,
        Self::Poisoned,
        Self::PeerNotBounceCapable,
        Self::PeerLacksRead,
        Self::LocalTransfer,
        Self::NoLocalArena,
        Self::TooFewDescriptors,
        Self::DescriptorsTooLarge,
        Self::Unplannable,
    ];

    /// The reason's place in [`Fallback::ALL`] (a new reason must be given
    /// one here before it compiles).
    pub const fn index(self) -> usize {
        match self {
            Self::BounceDisabled => 0,
            Self::Poisoned => 1,
            Self::PeerNotBounceCapable => 2,
            Self::PeerLacksRead => 3,
            Self::LocalTransfer => 4,
            Self::NoLocalArena => 5,
            Self::TooFewDescriptors => 6,
            Self::DescriptorsTooLarge => 7,
            Self::Unplannable => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::BounceDisabled => "fallback_bounce_disabled",
            Self::Poisoned => "fallback_poisoned",
            Self::PeerNotBounceCapable => "fallback_peer_not_bounce_capable",
            Self::PeerLacksRead => "fallback_peer_lacks_read",
            Self::LocalTransfer => "fallback_local_transfer",
            Self::NoLocalArena => "fallback_no_local_arena",
            Self::TooFewDescriptors => "fallback_too_few_descriptors",
            Self::DescriptorsTooLarge => "fallback_descriptors_too_large",
            Self::Unplannable => "fallback_unplannable",
        }
    }
}

/// What the routing decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput {
    pub op: Op,
    pub local: MemKind,
    pub remote: MemKind,
    pub descriptors: u64,
    pub bytes: u64,
    pub peer_capable: bool,
    /// The peer's instance serves READs (its handshake has the capability).
    pub peer_reads: bool,
    pub local_transfer: bool,
    /// All local descriptors lie in memory of one location that has a bounce
    /// instance.
    pub local_arena: bool,
    /// A GPU's own (VRAM) arena is on either side of the chosen pair (for a
    /// mixed transfer: no host-staged arena there).
    pub vram_arena: bool,
    /// How UCX reaches the peer.
    pub reach: Reach,
}

/// The routing rule: a WRITE to, or a READ from, memory of a peer whose
/// instance passed the handshake (for a READ: and serves READs), between
/// that memory and memory with a local bounce instance, with many small
/// descriptors.
pub fn route(cfg: &Config, poisoned: bool, r: &RouteInput) -> Result<(), Fallback> {
    if !cfg.enabled {
        return Err(Fallback::BounceDisabled);
    }
    if poisoned {
        return Err(Fallback::Poisoned);
    }
    if r.local_transfer {
        return Err(Fallback::LocalTransfer);
    }
    if !r.local_arena {
        return Err(Fallback::NoLocalArena);
    }
    if !r.peer_capable {
        return Err(Fallback::PeerNotBounceCapable);
    }
    if r.op == Op::Read && !r.peer_reads {
        return Err(Fallback::PeerLacksRead);
    }
    let mut gate = arena_gate(cfg, r.local, r.remote, r.reach);
    if r.local != r.remote && r.vram_arena {
        gate.min_descriptors = gate
            .min_descriptors
            .max(cfg.mixed_unstaged_min_descriptor_count);
    }
    gate.admit(r.descriptors, r.bytes.into())
}

/// Which transfers a path takes by their shape, where it beats UCX: at
/// least `min_descriptors` descriptors, of average size at most
/// `max_average_bytes` (0: no limit). Each path has its own, measured
/// (docs/design.md §3 "Routing by benefit").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeGate {
    pub min_descriptors: u64,
    pub max_average_bytes: u64,
}

impl ShapeGate {
    /// The gate that admits whatever either of two admits (for a decision
    /// made before the peer, and so the gate that applies, is known).
    pub fn loosest(self, other: ShapeGate) -> ShapeGate {
        ShapeGate {
            min_descriptors: self.min_descriptors.min(other.min_descriptors),
            max_average_bytes: if self.max_average_bytes == 0 || other.max_average_bytes == 0 {
                0
            } else {
                self.max_average_bytes.max(other.max_average_bytes)
            },
        }
    }

    /// Admits `descriptors` of `bytes` in all (summed only when this gate
    /// has a size limit), or says why not.
    pub fn admit(self, descriptors: u64, bytes: TotalBytes<'_>) -> Result<(), Fallback> {
        if descriptors < self.min_descriptors.max(1) {
            return Err(Fallback::TooFewDescriptors);
        }
        if self.max_average_bytes > 0
            && bytes.get() > self.max_average_bytes.saturating_mul(descriptors)
        {
            return Err(Fallback::DescriptorsTooLarge);
        }
        Ok(())
    }
}

/// The bounce arena's gate: DRAM on both sides (a peer reached over TCP has
/// its own, [`Reach`]), VRAM on both, or mixed (the size limit is VRAM's
/// whenever VRAM is on either side). A mixed
/// transfer's is the host-staged arenas' here; [`route`] raises it to
/// `mixed_unstaged_min_descriptor_count` once the chosen pair has a VRAM
/// arena (this lower one is the early decision's, made before the pair
/// is known, so that it never refuses what the pair would take).
pub fn arena_gate(cfg: &Config, local: MemKind, remote: MemKind, reach: Reach) -> ShapeGate {
    if local == MemKind::Vram || remote == MemKind::Vram {
        ShapeGate {
            min_descriptors: if local == remote {
                cfg.vram_min_descriptor_count
            } else {
                cfg.mixed_min_descriptor_count
            },
            max_average_bytes: cfg.vram_max_average_descriptor_size_bytes,
        }
    } else if reach == Reach::Tcp {
        ShapeGate {
            min_descriptors: cfg.tcp_min_descriptor_count,
            max_average_bytes: cfg.tcp_max_average_descriptor_size_bytes,
        }
    } else {
        ShapeGate {
            min_descriptors: cfg.min_descriptor_count,
            max_average_bytes: cfg.max_average_descriptor_size_bytes,
        }
    }
}

/// The CMA path's gate (DRAM on both sides).
pub fn cma_gate(cfg: &Config) -> ShapeGate {
    ShapeGate {
        min_descriptors: cfg.cma_min_descriptor_count,
        max_average_bytes: 0,
    }
}

/// The peer-mapped path's gate.
pub fn peer_map_gate(cfg: &Config) -> ShapeGate {
    ShapeGate {
        min_descriptors: cfg.peer_map_min_descriptor_count,
        max_average_bytes: cfg.peer_map_max_average_descriptor_size_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> RouteInput {
        RouteInput {
            op: Op::Write,
            local: MemKind::Dram,
            remote: MemKind::Dram,
            descriptors: 4096,
            bytes: 4096 * 4096,
            peer_capable: true,
            peer_reads: true,
            local_transfer: false,
            local_arena: true,
            vram_arena: false,
            reach: Reach::Near,
        }
    }

    #[test]
    fn a_mixed_transfer_through_a_vram_arena_has_the_unstaged_gate() {
        let cfg = Config::default();
        let mixed = |n: u64, vram_arena| RouteInput {
            remote: MemKind::Vram,
            descriptors: n,
            bytes: n * 4096,
            vram_arena,
            ..input()
        };
        // Through host-staged arenas on both sides: the mixed gate (64).
        assert_eq!(route(&cfg, false, &mixed(64, false)), Ok(()));
        // A GPU's own arena on one side: the unstaged gate (512).
        assert_eq!(
            route(&cfg, false, &mixed(511, true)),
            Err(Fallback::TooFewDescriptors)
        );
        assert_eq!(route(&cfg, false, &mixed(512, true)), Ok(()));
        // Never below the mixed gate.
        let low = Config {
            mixed_unstaged_min_descriptor_count: 8,
            ..Config::default()
        };
        assert_eq!(
            route(&low, false, &mixed(63, true)),
            Err(Fallback::TooFewDescriptors)
        );
        // VRAM on both sides: a VRAM arena is the rule, not this gate.
        let both = RouteInput {
            local: MemKind::Vram,
            ..mixed(256, true)
        };
        assert_eq!(route(&cfg, false, &both), Ok(()));
    }

    #[test]
    fn each_pair_of_memory_kinds_has_its_arena_gate() {
        let cfg = Config::default();
        let (d, v) = (MemKind::Dram, MemKind::Vram);
        let admits = |l, r, n: u64| {
            arena_gate(&cfg, l, r, Reach::Near)
                .admit(n, (n * 4096).into())
                .is_ok()
        };
        // DRAM on both sides: 1024; VRAM on both: 256; mixed: 64.
        assert!(!admits(d, d, 1023) && admits(d, d, 1024));
        assert!(!admits(v, v, 255) && admits(v, v, 256));
        for (l, r) in [(d, v), (v, d)] {
            assert!(!admits(l, r, 63) && admits(l, r, 64), "{l:?} -> {r:?}");
        }
    }

    #[test]
    fn a_peer_reached_over_tcp_has_the_tcp_gate_for_dram_only() {
        let cfg = Config::default();
        let shape = |n: u64, size: u64, reach| RouteInput {
            descriptors: n,
            bytes: n * size,
            reach,
            ..input()
        };
        // Near: 1024 descriptors of at most 8 KiB on average.
        let near = |n, size| route(&cfg, false, &shape(n, size, Reach::Near));
        assert_eq!(near(256, 4096), Err(Fallback::TooFewDescriptors));
        assert_eq!(near(4096, 32 << 10), Err(Fallback::DescriptorsTooLarge));
        // Over TCP: from 256 descriptors, of up to 1 MiB on average.
        let tcp = |n, size| route(&cfg, false, &shape(n, size, Reach::Tcp));
        assert_eq!(tcp(255, 4096), Err(Fallback::TooFewDescriptors));
        assert_eq!(tcp(256, 4096), Ok(()));
        assert_eq!(tcp(4096, 32 << 10), Ok(()));
        assert_eq!(tcp(256, 1 << 20), Ok(()));
        assert_eq!(tcp(256, 2 << 20), Err(Fallback::DescriptorsTooLarge));
        // VRAM keeps its own gate whatever the reach.
        let vram = |reach| {
            let r = RouteInput {
                local: MemKind::Vram,
                remote: MemKind::Vram,
                ..shape(255, 4096, reach)
            };
            route(&cfg, false, &r)
        };
        assert_eq!(vram(Reach::Tcp), Err(Fallback::TooFewDescriptors));
        assert_eq!(vram(Reach::Tcp), vram(Reach::Near));
    }

    #[test]
    fn only_another_host_over_tcp_is_reached_over_tcp() {
        let (a, b) = (Some([1u8; 16]), Some([2u8; 16]));
        assert_eq!(Reach::of(b, a, true), Reach::Tcp);
        // The same host, an RDMA-capable host, or a host not said: near.
        assert_eq!(Reach::of(a, a, true), Reach::Near);
        assert_eq!(Reach::of(b, a, false), Reach::Near);
        assert_eq!(Reach::of(None, a, true), Reach::Near);
        assert_eq!(Reach::of(b, None, true), Reach::Near);
    }

    #[test]
    fn ucx_tls_allows_rdma_unless_it_names_none() {
        for tls in [
            None,
            Some(""),
            Some("all"),
            Some("^tcp"),
            Some("rc,tcp"),
            Some("dc_x"),
            Some("ib"),
        ] {
            assert!(ucx_tls_allows_rdma(tls), "{tls:?}");
        }
        for tls in ["tcp", "tcp,self", "sm,tcp", "cma,posix,tcp", "rcache"] {
            assert!(!ucx_tls_allows_rdma(Some(tls)), "{tls}");
        }
    }

    #[test]
    fn the_loosest_of_two_gates_admits_what_either_admits() {
        let near = ShapeGate {
            min_descriptors: 1024,
            max_average_bytes: 8192,
        };
        let tcp = ShapeGate {
            min_descriptors: 256,
            max_average_bytes: 0,
        };
        assert_eq!(near.loosest(tcp), tcp);
        assert_eq!(tcp.loosest(near), tcp);
        let a = ShapeGate {
            min_descriptors: 16,
            max_average_bytes: 4096,
        };
        assert_eq!(
            a.loosest(near),
            ShapeGate {
                min_descriptors: 16,
                max_average_bytes: 8192
            }
        );
    }

    #[test]
    fn a_host_staged_instance_has_its_arena_in_host_memory() {
        let own = Location::of(MemKind::Vram, 3);
        let staged = Location::staged(3);
        assert_ne!(own, staged, "two instances of one GPU");
        assert_eq!((own.arena_kind(), own.arena_device()), (MemKind::Vram, 3));
        assert_eq!(
            (staged.arena_kind(), staged.arena_device()),
            (MemKind::Dram, 0)
        );
        let dram = Location::of(MemKind::Dram, 0);
        assert_eq!((dram.arena_kind(), dram.arena_device()), (MemKind::Dram, 0));
        assert_eq!(staged.to_string(), "VRAM device 3, staged in host memory");
        assert_eq!(own.to_string(), "VRAM device 3");
    }

    #[test]
    fn admit_reads_the_heartbeats_capability() {
        let cfg = Config {
            use_nixl_notifications: true,
            ..Config::default()
        };
        let mut ours = local_handshake(&cfg, ControlKind::NixlNotif);
        assert!(ours.capabilities.contains(Capabilities::HEARTBEATS));
        ours.endpoint = b"nixl:peer/bounce".to_vec();
        let admitted = admit(&cfg, MemKind::Dram, "peer/bounce", &ours, None).unwrap();
        assert!(admitted.heartbeats && admitted.read);
        // A build before heartbeats: admitted all the same, never PINGed.
        ours.capabilities = Capabilities::CANCEL.with(Capabilities::READ);
        let older = admit(&cfg, MemKind::Dram, "peer/bounce", &ours, None).unwrap();
        assert!(!older.heartbeats && older.read);
    }

    #[test]
    fn eligible_transfers_take_the_bounce_path() {
        let cfg = Config {
            enabled: true,
            ..Config::default()
        };
        assert_eq!(route(&cfg, false, &input()), Ok(()));
    }

    #[test]
    fn each_gate_names_its_fallback() {
        let on = Config {
            enabled: true,
            ..Config::default()
        };
        let off = Config {
            enabled: false,
            ..Config::default()
        };
        assert_eq!(route(&off, false, &input()), Err(Fallback::BounceDisabled));
        assert_eq!(route(&on, true, &input()), Err(Fallback::Poisoned));
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    op: Op::Read,
                    ..input()
                }
            ),
            Ok(())
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    op: Op::Read,
                    peer_reads: false,
                    ..input()
                }
            ),
            Err(Fallback::PeerLacksRead)
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    peer_reads: false,
                    ..input()
                }
            ),
            Ok(()),
            "WRITE needs no READ capability"
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    remote: MemKind::Vram,
                    ..input()
                }
            ),
            Ok(())
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    local_arena: false,
                    ..input()
                }
            ),
            Err(Fallback::NoLocalArena)
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    peer_capable: false,
                    ..input()
                }
            ),
            Err(Fallback::PeerNotBounceCapable)
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    local_transfer: true,
                    ..input()
                }
            ),
            Err(Fallback::LocalTransfer)
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    descriptors: 10,
                    bytes: 40960,
                    ..input()
                }
            ),
            Err(Fallback::TooFewDescriptors)
        );
        assert_eq!(
            route(
                &on,
                false,
                &RouteInput {
                    bytes: 4096 * 65536,
                    ..input()
                }
            ),
            Err(Fallback::DescriptorsTooLarge)
        );
    }
}
