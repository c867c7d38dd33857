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
mod descs;
pub mod ipc;
pub mod params;
mod route;
mod types;

pub use descs::*;
pub use route::*;
pub use types::*;

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

/// The fewest descriptors whose arena plan is packed in parts on several
/// threads (`Engine::plan`): from here, packing on one thread takes several
/// times a worker's wake-up (docs/benchmarks.md, "Figures behind the
/// code").
const PARALLEL_PLAN_MIN_DESCRIPTORS: usize = 8192;

/// How long the preparation pool's workers, woken when a large request is
/// admitted in `prepXfer`, wait for its first post ([`ipc::FillPool::warm`]):
/// well over a client's own time from `prepXfer` to the post.
const FILL_POOL_WARM: std::time::Duration = std::time::Duration::from_micros(300);

/// What this engine knows about a remote agent.
#[derive(Debug, Clone)]
struct Remote {
    /// Its inner agent's name: shared, since every preparation takes it.
    inner: Arc<str>,
    /// The peer's bounce instances whose arena metadata we loaded.
    bounce_peers: HashSet<PeerId>,
    /// The peer arenas its regions carry, one `Arc` for equal ones: a
    /// preparation compares its regions' arenas by pointer, where comparing
    /// their names read two cold strings per run of descriptors.
    arenas: Vec<Arc<PeerBounce>>,
    /// How UCX reaches it, once a region said (over TCP if any did).
    reach: Option<bounce::Reach>,
}

/// Bounce instances by memory location (`None`: set-up failed, not retried).
type Instances = Arc<Mutex<HashMap<Location, Option<Arc<Bounce>>>>>;

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
    peer: ipc::IpcMaps,
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

impl Engine {
    /// Creates the engine for agent `local_name` with the backend parameters
    /// given to `createBackend("BOUNCE", params)`.
    pub fn new(local_name: &str, params: BTreeMap<String, String>) -> Result<Self> {
        crate::logging::init();
        if local_name.is_empty() {
            return Err(Error::invalid("the agent name is empty"));
        }
        crate::nixl_capi::ensure_capi_loaded().map_err(|e| Error::new(Status::Backend, e))?;

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
        let peer = ipc::IpcMaps::new(&config);
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
                        EngineStats::bump(&self.stats.counters.rare.peer_map_exported);
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
                reach: None,
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
        reach: bounce::Reach,
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
            Ok(p) => PeerBounce { reach, ..p },
            Err((counter, why)) => {
                EngineStats::bump(counter(&self.stats.counters.rare));
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
        let reach = bounce::Reach::of(
            public.cma.as_ref().map(|e| e.host),
            crate::copy::ipc::identity().map(|i| i.host),
            bounce::tcp_only_host(),
        );
        if let Some(r) = self.remotes.locked().get_mut(remote) {
            if r.reach.is_none() || reach == bounce::Reach::Tcp {
                r.reach = Some(reach);
            }
        }
        let md = Box::new(Md {
            magic: MD_MAGIC,
            range,
            kind,
            owner: MdOwner::Remote {
                agent: remote.to_string(),
                bounce: public.bounce.as_ref().and_then(|b| {
                    self.admit_peer_instance(remote, &inner_remote, b, cma_peer.clone(), reach)
                }),
                staged: match kind {
                    MemKind::Vram => public.staged.as_ref().and_then(|b| {
                        self.admit_peer_instance(remote, &inner_remote, b, cma_peer.clone(), reach)
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

    /// How UCX reaches `agent`, where it matters and is known: on a host
    /// that reaches others over TCP only, once one of its regions said.
    pub(super) fn reach_of(&self, agent: &str) -> Option<bounce::Reach> {
        if !bounce::tcp_only_host() {
            return Some(bounce::Reach::Near);
        }
        self.remotes.locked().get(agent).and_then(|r| r.reach)
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
            let min = PARALLEL_PLAN_MIN_DESCRIPTORS.min(ipc::WARM_PARALLEL_FILL_MIN_DESCRIPTORS);
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
        let peer_gate = ipc::gate(&self.config, shape).is_ok();
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
            let reach = self.reach_of(agent);
            if let Err(reason) =
                arena_early_gate(&self.config, shape, reach, || self.sums_first(shape))
            {
                self.stats.fell_back(reason);
                return Ok(None);
            }
        }
        // The arena is the likely route of what comes this far when the
        // peer-mapped path is not open to it: its plan may be packed in the
        // check's pass, and a WRITE's WANT may go out now.
        let packing = if peer_gate {
            None
        } else {
            self.packing(op, &local, &remote)
        };
        let announced = packing.as_ref().and_then(|p| self.announce(op, p, shape));
        let check_began = std::time::Instant::now();
        let (checked, early) = self.check(op, local, remote, packing, announced.as_ref())?;
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
                // Whether the plan is the chunks packed in the check (then
                // those an announced WRITE was handed ahead of it).
                let mut from_check = false;
                let plan = checked.survey.clone().and_then(|survey| match early {
                    // Packed in the check's pass, for this instance and
                    // these descriptors (the survey assumed is the one
                    // found).
                    Some(e)
                        if Arc::ptr_eq(&e.packing.instance, &instance)
                            && e.packing.spec.survey == survey =>
                    {
                        let plan = plan::assemble(&survey, e.chunks)?;
                        from_check = true;
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
                        // Dropped (withdrawn) unless the transfer is the
                        // one it announced; one that was handed chunks
                        // ahead must have them in its plan.
                        let announced = announced.filter(|a| {
                            a.fits(&instance, &peer, &plan) && (from_check || !a.handed_any())
                        });
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
                                announced,
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

    /// The packing a check in parts on the preparation pool
    /// ([`PARALLEL_PLAN_MIN_DESCRIPTORS`] descriptors or more) may do of
    /// the arena's plan ([`Packing::of`]); `None` for a check in one pass.
    fn packing(&self, op: Op, local: &Descs<'_>, remote: &Descs<'_>) -> Option<Packing> {
        self.peer
            .fill_pool(local.len(), PARALLEL_PLAN_MIN_DESCRIPTORS)?;
        Packing::of(op, local, remote)
    }

    /// Sends the WANT of a WRITE over the arena before its descriptors are
    /// checked and packed (`announce_writes`, with `prepare_at_post`: the
    /// post that prepares it submits it next), so that the GRANT's round
    /// trip runs under that work, and its chunks are taken as they are
    /// packed. Only for a request the check packs in parts (`packing`,
    /// [`Engine::packing`]: a smaller one's preparation, 20-40 us on the
    /// GPU hosts, is about what announcing costs it, and it gained
    /// nothing; docs/benchmarks.md, thirty-sixth session), whose route and
    /// chunk sizes its first pair of descriptors and its count foretell:
    /// the local instance and the peer's arena of that pair, which the
    /// routing admits for the bytes of `count` descriptors of its length.
    /// The caller keeps the result only if the transfer turns out so
    /// ([`Announced::fits`]); dropped, it is withdrawn.
    fn announce(&self, op: Op, packing: &Packing, shape: &Shape) -> Option<Announced> {
        if !(self.config.prepare_at_post && self.config.announce_writes && op == Op::Write) {
            return None;
        }
        let Packing {
            instance,
            peer,
            spec,
        } = packing;
        let sizes = spec.chunk_sizes()?;
        let payload = spec.survey.payload();
        self.route_between(op, shape, Some(instance), Some(peer), payload)
            .ok()?;
        instance.ensure_peer(peer);
        let ticket = instance.runtime.announce(peer.id.clone(), sizes.clone());
        Some(Announced::new(
            ticket,
            instance.clone(),
            peer.clone(),
            sizes,
        ))
    }

    /// Counts a transfer prepared on the peer-mapped path, with the time
    /// its table took (built, uploaded) and, for the one-pass table, the
    /// time the preparation spent before it (`before_table` ns).
    fn count_peer_prepared(&self, x: &ipc::IpcXfer, before_table: Option<u64>) {
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
    /// pool (a cold list is read at several threads' pace). With `packing`
    /// (the arena is the likely route, [`Engine::packing`]), each part also
    /// packs its chunks of the plan while its descriptors are in the cache;
    /// those come back with the packing they assumed. A WRITE `announced`
    /// for that packing is handed each chunk as soon as it is packed
    /// ([`Announced::chunk_ready`]).
    fn check<'a>(
        &self,
        op: Op,
        local: Descs<'a>,
        remote: Descs<'a>,
        packing: Option<Packing>,
        announced: Option<&Announced>,
    ) -> Result<(Checked<'a>, Option<EarlyPlan>)> {
        if let Some(fill) = self
            .peer
            .fill_pool(local.len(), PARALLEL_PLAN_MIN_DESCRIPTORS)
        {
            let hand =
                announced.map(|a| move |c: usize, chunk: &plan::Chunk| a.chunk_ready(c, chunk));
            let hook = hand.as_ref().map(|h| h as &descs::ChunkHook<'_>);
            let spec = packing.as_ref().map(|p| &p.spec);
            if let Some((checked, help, chunks)) =
                Checked::in_parts(op, local, remote, fill, spec, hook)
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
        let mut kept = ipc::take_kept(&self.kept_regions);
        Ok((
            Checked::with_kept(op, local, remote, kept.as_deref_mut())?,
            None,
        ))
    }

    /// A bounce transfer's plan. A large one whose descriptors are all one
    /// length is packed in parts of whole chunks on the preparation pool's
    /// threads beside this one ([`ipc::FillPool::share`]) and assembled;
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
                b.ticket = Some(match b.announced.take() {
                    // Its WANT went out while it was prepared.
                    Some(announced) => {
                        let ticket = announced.take();
                        runtime.plan_ready(&ticket, plan, notif, deadline);
                        ticket
                    }
                    None if b.read => runtime.submit_read(peer, plan, notif, deadline),
                    None => runtime.submit(peer, plan, notif, deadline),
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
                // Posted again: a client that reposts a request posts it
                // many times (a fixed pattern, a benchmark's loop), and an
                // uploaded table's launch costs 3-4 us less than one that
                // passes up to 32 KiB of parameter (design.md §3). One
                // upload now; if none can be had it stays inline.
                if x.launch.is_some() && x.table.inline() {
                    match x.table.upload() {
                        Ok(true) => {
                            EngineStats::bump(&self.stats.counters.hot.peer_inline_uploaded)
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!("a reposted table stays inline: {e}"),
                    }
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
                        EngineStats::bump(&self.stats.counters.rare.peer_map_failed);
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
                    EngineStats::bump(&self.stats.counters.rare.cma_succeeded);
                }
                Ok(Status::Success)
            }
            Err(e) => {
                if first {
                    EngineStats::bump(&self.stats.counters.transfers_failed);
                    EngineStats::bump(&self.stats.counters.rare.cma_failed);
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
                            EngineStats::bump(&self.stats.counters.rare.peer_map_succeeded);
                        }
                        Ok(Status::Success)
                    }
                    Some(Err(e)) => {
                        if first {
                            EngineStats::bump(&self.stats.counters.transfers_failed);
                            EngineStats::bump(&self.stats.counters.rare.peer_map_failed);
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
                        EngineStats::bump(&self.stats.counters.rare.bounce_cancelled);
                    }
                }
            }
            // A running kernel cannot be stopped: its bytes still land (as
            // a released UCX transfer's may), but no notification is sent.
            // Its table is freed after it, its mappings closed after it.
            Route::PeerMapped(x) => {
                if let Some(l) = x.launch.as_ref().filter(|l| l.running()) {
                    l.cancelled.store(true, Ordering::SeqCst);
                    EngineStats::bump(&self.stats.counters.rare.peer_map_cancelled);
                }
            }
            // Stops at the copy's next system call; a deregistration of its
            // memory waits for that.
            Route::Cma(c) => {
                if c.xfer.cancel() {
                    EngineStats::bump(&self.stats.counters.rare.cma_cancelled);
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
mod tests;
