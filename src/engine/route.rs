//! Routing: which path takes a transfer (the UCX delegate, the bounce
//! arena, cross-memory attach, the peer-mapped copy), decided the same way
//! for every path, and the request each path keeps.

use super::*;
use bounce::{tcp_only_host, Reach};

/// A transfer request owned by NIXL's request handle.
pub struct Request {
    pub(super) route: Route,
    pub(super) args: XferArgs,
}

pub(super) enum Route {
    /// The bounce path.
    Bounce(BounceXfer),
    /// The peer-mapped path: one kernel through a mapping of the peer's
    /// memory.
    PeerMapped(ipc::IpcXfer),
    /// The CMA path: DRAM copied straight to or from the peer process.
    Cma(CmaRequest),
}

pub(super) struct CmaRequest {
    pub(super) xfer: cma::CmaXfer,
    /// The peer's inner agent (target of the completion notification).
    pub(super) peer_inner: Arc<str>,
    pub(super) limit: std::time::Duration,
    pub(super) reported: bool,
}

pub(super) struct BounceXfer {
    /// A READ from the peer (else a WRITE to it).
    pub(super) read: bool,
    /// The local instance that runs it.
    pub(super) instance: Arc<Bounce>,
    pub(super) peer: PeerId,
    pub(super) peer_arena: Arc<PeerBounce>,
    /// The peer's inner agent (target of the completion notification).
    pub(super) peer_inner: Arc<str>,
    /// Made when the request is prepared; every post submits it.
    pub(super) plan: Arc<Plan>,
    /// A WRITE announced before its plan ([`Announced`]): its first post
    /// brings the plan to this request rather than submitting another.
    pub(super) announced: Option<Announced>,
    pub(super) ticket: Option<Arc<Ticket>>,
    pub(super) reported: bool,
}

/// A WRITE whose WANT went out before its descriptors were checked and its
/// chunks packed ([`Runtime::announce`](crate::runtime::Runtime::announce),
/// `announce_writes`): the route and the chunk sizes it assumed, foretold
/// from its first pair of descriptors and its count. Withdrawn when
/// dropped unless its ticket was taken ([`Announced::take`]).
pub(super) struct Announced {
    ticket: Option<Arc<Ticket>>,
    instance: Arc<Bounce>,
    peer: Arc<PeerBounce>,
    sizes: Vec<u64>,
    /// Whether a chunk was handed to it ahead of its plan.
    handed: std::sync::atomic::AtomicBool,
}

impl Announced {
    pub(super) fn new(
        ticket: Arc<Ticket>,
        instance: Arc<Bounce>,
        peer: Arc<PeerBounce>,
        sizes: Vec<u64>,
    ) -> Self {
        Announced {
            ticket: Some(ticket),
            instance,
            peer,
            sizes,
            handed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a chunk was handed to it ahead of its plan.
    pub(super) fn handed_any(&self) -> bool {
        self.handed.load(Ordering::Relaxed)
    }

    /// Whether the transfer took the route it was announced for, with the
    /// chunk sizes announced.
    pub(super) fn fits(&self, instance: &Arc<Bounce>, peer: &Arc<PeerBounce>, plan: &Plan) -> bool {
        Arc::ptr_eq(&self.instance, instance)
            && Arc::ptr_eq(&self.peer, peer)
            && plan.chunk_sizes() == self.sizes
    }

    /// Hands chunk `c`, packed ahead of the plan (every descriptor of it
    /// checked), to the request ([`Runtime::chunk_ready`](crate::runtime::Runtime::chunk_ready)).
    pub(super) fn chunk_ready(&self, c: usize, chunk: &plan::Chunk) {
        if let Some(ticket) = &self.ticket {
            self.handed.store(true, Ordering::Relaxed);
            self.instance.runtime.chunk_ready(ticket, c, chunk.clone());
        }
    }

    /// The request's ticket, to bring it its plan.
    pub(super) fn take(mut self) -> Arc<Ticket> {
        self.ticket
            .take()
            .expect("an announced request's ticket is taken once")
    }
}

impl Drop for Announced {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.instance.runtime.withdraw(&ticket);
        }
    }
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

/// Why a transfer of this shape goes to the UCX delegate before anything
/// per descriptor is looked at; `None`: one of BOUNCE's paths may take it.
/// `reach`: how UCX reaches the peer, where known ([`Engine::reach_of`]).
/// With `sum_first` false the arena's gate counts descriptors only: its
/// size limit is then applied by [`bounce::route`] with the byte total
/// the check's pass finds (see [`Engine::sums_first`]).
pub fn early_reason(
    cfg: &Config,
    shape: &Shape,
    reach: Option<Reach>,
    sum_first: impl FnOnce() -> bool,
) -> Option<Fallback> {
    if !cfg.enabled || shape.local_transfer {
        Some(below_floor_reason(cfg, shape.local_transfer))
    } else if ipc::gate(cfg, shape).is_ok() || cma_shape(cfg, shape) {
        None
    } else {
        arena_early_gate(cfg, shape, reach, sum_first).err()
    }
}

/// The arena's gate before the check: in full, or its descriptor count
/// only when it has a size limit and `sum_first` (asked only then) says
/// the limit waits for the check's byte total.
pub(super) fn arena_early_gate(
    cfg: &Config,
    shape: &Shape,
    reach: Option<Reach>,
    sum_first: impl FnOnce() -> bool,
) -> std::result::Result<(), Fallback> {
    let gate = early_arena_gate(cfg, shape.local, shape.remote, reach, tcp_only_host());
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

/// The arena's gate before the routing: the peer's own where its reach is
/// known; otherwise, on a host that reaches others over TCP only
/// (`tcp_only`), the loosest of the near and the TCP gates, so that it
/// never refuses what the peer's own would take ([`bounce::route`] applies
/// that one).
pub(super) fn early_arena_gate(
    cfg: &Config,
    local: MemKind,
    remote: MemKind,
    reach: Option<Reach>,
    tcp_only: bool,
) -> bounce::ShapeGate {
    match reach {
        Some(r) => bounce::arena_gate(cfg, local, remote, r),
        None if tcp_only => bounce::arena_gate(cfg, local, remote, Reach::Near)
            .loosest(bounce::arena_gate(cfg, local, remote, Reach::Tcp)),
        None => bounce::arena_gate(cfg, local, remote, Reach::Near),
    }
}

/// NIXL's two lists pair descriptor by descriptor.
pub(super) fn same_counts(local: usize, remote: usize) -> Result<()> {
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
pub(super) fn cma_shape(cfg: &Config, shape: &Shape) -> bool {
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
    let arena = early_arena_gate(cfg, local, remote, None, tcp_only_host())
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
    /// Why neither of BOUNCE's own paths can take a transfer of this shape,
    /// decided before any descriptor is looked at: such a transfer goes to
    /// the UCX delegate untouched (counted here as prepared and by reason).
    /// The transfer's custom parameter is checked here already, whichever
    /// path takes it.
    pub fn early_fallback(
        &self,
        shape: &Shape,
        agent: &str,
        args: &XferArgs,
    ) -> Result<Option<Fallback>> {
        if !args.custom_param.is_empty() {
            TransferParams::parse(&args.custom_param)?;
        }
        let reach = self.reach_of(agent);
        let reason = early_reason(&self.config, shape, reach, || self.sums_first(shape));
        if let Some(r) = reason {
            self.count_ucx_routed(r);
        }
        Ok(reason)
    }

    /// Whether the arena's size limit is tested before the check's pass,
    /// with a sum of its own over the local list, or after it, with the
    /// byte total the pass finds. After, when the pass runs in parts on
    /// the preparation pool: a serial sum over a list that long (1 MiB
    /// read cold for 32,768 descriptors) costs
    /// more than the parallel pass it could spare a transfer the limit
    /// refuses, which then goes to UCX after the pass.
    pub(super) fn sums_first(&self, shape: &Shape) -> bool {
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

    /// The peer-mapped path for a transfer the one-pass table declined (see
    /// [`ipc`]): copies merged into runs; `None` sends it on to the bounce
    /// path's routing.
    pub(super) fn peer_mapped_route<'a>(
        &self,
        op: Op,
        local: &Side<'a>,
        remote: &Side<'a>,
        inner_remote: &Arc<str>,
    ) -> Option<ipc::IpcXfer> {
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
                EngineStats::bump(&self.stats.counters.rare.peer_map_unavailable);
                None
            }
        }
    }

    /// Decides the path of a transfer: the local instance and the peer's for
    /// the bounce path. The instances come with the descriptors' metadata:
    /// every local descriptor must lie in memory of one location with an
    /// instance, every remote one in memory of one peer instance.
    pub(super) fn choose_route(
        &self,
        op: Op,
        checked: &Checked<'_>,
        shape: &Shape,
    ) -> std::result::Result<(Arc<Bounce>, Arc<PeerBounce>), Fallback> {
        let (local_instance, peer) = (checked.local_instance, checked.peer);
        self.route_between(op, shape, local_instance, peer, shape.bytes.get())?;
        let vram_arena = local_instance.is_some_and(|b| b.location.arena_kind() == MemKind::Vram)
            || peer.is_some_and(|p| p.arena.mem == nixl_sys::MemType::Vram);
        if shape.local != shape.remote && !vram_arena {
            EngineStats::bump(&self.stats.counters.rare.arena_mixed_staged);
        }
        match (local_instance, peer) {
            (Some(b), Some(p)) => Ok((b.clone(), p.clone())),
            (None, _) => Err(Fallback::NoLocalArena),
            (_, None) => Err(Fallback::PeerNotBounceCapable),
        }
    }

    /// Whether the arena may carry a transfer of `shape` (`bytes` in all)
    /// from `local_instance` to `peer` ([`bounce::route`]).
    pub(super) fn route_between(
        &self,
        op: Op,
        shape: &Shape,
        local_instance: Option<&Arc<Bounce>>,
        peer: Option<&Arc<PeerBounce>>,
        bytes: u64,
    ) -> std::result::Result<(), Fallback> {
        if !self.config.enabled {
            return Err(Fallback::BounceDisabled);
        }
        let input = RouteInput {
            op,
            local: shape.local,
            remote: shape.remote,
            descriptors: shape.descriptors,
            bytes,
            peer_capable: peer.is_some(),
            peer_reads: peer.is_some_and(|p| p.read),
            local_transfer: shape.local_transfer,
            local_arena: local_instance.is_some(),
            vram_arena: local_instance.is_some_and(|b| b.location.arena_kind() == MemKind::Vram)
                || peer.is_some_and(|p| p.arena.mem == nixl_sys::MemType::Vram),
            reach: peer.map_or(bounce::Reach::Near, |p| p.reach),
        };
        let poisoned = local_instance.is_some_and(|b| b.runtime.poisoned().is_some());
        bounce::route(&self.config, poisoned, &input)
    }
}
