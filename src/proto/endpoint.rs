//! One local agent: the shared arena scheduler plus the sender and receiver
//! roles, driven by events and handing out [`Action`]s.
//!
//! The runtime owns one `Endpoint` per agent (on its reactor thread) and:
//! 1. feeds every event into a `handle_*` method (with the current time);
//! 2. drains [`Endpoint::poll_action`] and executes each action in order
//!    (actions for one peer must be executed in the order given: a
//!    [`Action::Connect`] precedes the first message to that peer);
//! 3. calls [`Endpoint::handle_timeout`] when [`Endpoint::poll_timeout`]
//!    says so.
//!
//! Contract with the runtime (what the protocol relies on):
//! - every `StartGather`, `PostWrite` and `StartScatter` is eventually
//!   answered by exactly one of its `handle_*_done` / `_failed` / `_stuck`
//!   events; `failed` with `quiesced = true` means nothing touches the
//!   memory any more; when that cannot be established, report `stuck` (or
//!   `quiesced = false`) and the arena is poisoned;
//! - `handle_write_done` means the data is visible at the target;
//! - [`Endpoint::forget_peer`] is called only after the data path to that
//!   peer is torn down (no write from or to it can still land);
//! - request ids are never reused across incarnations of an agent: seed
//!   [`EndpointConfig::request_id_base`] from a random or clock value.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use super::credit::{CreditScheduler, HeldBytes, Offer, Owner, SchedError, SchedulerParams};
use super::plan::{self, Descriptor, Plan, PlanError, PlanOptions};
use super::read::{self, Ending, OwnerBook, Reads, SourceCheck};
use super::receiver::Receiver;
use super::sender::Sender;
use super::wire::{Message, RefuseReason, WireError};
use super::{ChunkRef, FlowId, PeerId, RegionHandle, RequestId, Runs, Time};
use crate::config::Config;

/// Protocol parameters of one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointConfig {
    /// Usable arena capacity (power of two).
    pub arena_capacity: u64,
    /// Buddy granularity.
    pub granularity: u64,
    /// Chunk cap.
    pub max_chunk: u64,
    /// A request is cut into at least this many chunks, none below
    /// `min_chunk` bytes ([`plan::chunk_cap`]); 0 or 1: by the cap alone.
    pub min_chunks: u32,
    pub min_chunk: u64,
    /// Per-flow in-flight cap W.
    pub window: u32,
    /// No-progress timeout per request.
    pub request_timeout: Duration,
    /// Absolute deadline per request, if any.
    pub request_deadline: Option<Duration>,
    /// A receiver flow with no message for this long is aborted.
    pub flow_idle_timeout: Duration,
    /// How long a cancelled flow id is remembered (late WANTs ignored).
    pub tombstone_ttl: Duration,
    /// Eager gather.
    pub eager_gather: bool,
    /// Copy launches ([`Action::StartGather`], [`Action::StartScatter`])
    /// are handed out after every other pending action (see
    /// [`ActionQueue`]); else all in the order they arose.
    pub launches_last: bool,
    /// Coalesce runs.
    pub merge_runs: bool,
    /// Keep a local reserve block (see [`super::credit`]).
    pub local_reserve: bool,
    /// Standing credits this agent offers as a receiver: one slot of
    /// `min_chunk` bytes (at most `max_chunk`) for each of up to this many
    /// sender peers ([`super::credit`], "Standing slots"); 0: none.
    pub standing_slots: u32,
    /// This agent's control endpoint, sent in every WANT.
    pub local_endpoint: Vec<u8>,
    /// First request id (see the module docs).
    pub request_id_base: u64,
    /// This endpoint's incarnation: it must differ from every other
    /// incarnation of the same agent name, and grow from one to the next
    /// (the engine takes the wall clock). As a receiver, its standing
    /// offers' tokens count up from it: a sender never takes a token at or
    /// below one it claimed from that receiver, forgetting it or not. As a
    /// sender, its WANT_STANDINGs name it: a receiver's offer goes to one
    /// incarnation, and another under the same name (which cannot know
    /// what the first claimed) is neither sent it again nor takes it.
    pub incarnation: u64,
    /// The key peers' WANTs and CANCELs must carry (see
    /// [`super::wire::Handshake::access_key`]); 0 in tests that do not care.
    pub access_key: u64,
}

impl EndpointConfig {
    /// Derives the protocol parameters from a validated [`Config`].
    pub fn from_config(
        config: &Config,
        local_endpoint: Vec<u8>,
        request_id_base: u64,
    ) -> EndpointConfig {
        let timeout = Duration::from_millis(config.request_timeout_ms.max(1));
        EndpointConfig {
            arena_capacity: config.arena_usable_capacity(),
            granularity: config.arena_allocation_granularity_bytes,
            max_chunk: config.max_chunk_size_bytes,
            min_chunks: config.min_chunks_per_request,
            min_chunk: config.min_chunk_size_bytes,
            window: config.max_inflight_chunks_per_request,
            request_timeout: timeout,
            request_deadline: (config.request_deadline_ms > 0)
                .then(|| Duration::from_millis(config.request_deadline_ms)),
            flow_idle_timeout: timeout * 2,
            tombstone_ttl: timeout * 4,
            eager_gather: config.enable_eager_gather,
            launches_last: config.copy_launches_last,
            merge_runs: !config.disable_scatter_run_merging,
            local_reserve: true,
            standing_slots: config.standing_credit_peers,
            local_endpoint,
            request_id_base,
            incarnation: request_id_base & (u64::MAX >> 2),
            access_key: 0,
        }
    }
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureReason {
    /// No progress within the request timeout.
    Timeout,
    /// Cancelled by the application.
    Cancelled,
    /// The peer was forgotten (lost).
    PeerLost,
    /// The control channel to the peer is down (the peer died, hangs, or
    /// the network is gone); unlike [`FailureReason::PeerLost`] its data
    /// path is still there, so the CANCEL still follows.
    PeerUnreachable,
    /// A write failed.
    WriteFailed,
    /// A gather failed.
    GatherFailed,
    /// The receiver refused or aborted the flow.
    Rejected,
    /// The endpoint shut down.
    Shutdown,
    /// The local arena is poisoned.
    Poisoned,
    /// The request's absolute deadline passed.
    DeadlineExceeded,
    /// The peer broke the protocol (impossible credit, ...).
    ProtocolError,
    /// The receiver's scatter failed.
    RemoteScatterFailed,
    /// READ: the data owner refused a source range (not memory it
    /// registered with BOUNCE); nothing was read.
    SourceRefused,
    /// READ: a local scatter of the data failed.
    ScatterFailed,
}

/// The terminal outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every chunk was written and scattered.
    Success,
    /// The request failed; its destination bytes are unspecified.
    Failure(FailureReason),
}

/// Work for the runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Register `peer`'s control endpoint (learned from its WANT) so replies
    /// can reach it. On failure call [`Endpoint::forget_peer`].
    Connect {
        /// The peer.
        peer: PeerId,
        /// Its endpoint bytes.
        endpoint: Vec<u8>,
    },
    /// Send a control message (encode with [`Message::encode`]).
    Send {
        /// Destination.
        peer: PeerId,
        /// The message.
        message: Message,
    },
    /// Copy application memory into local region `region` (`runs` are
    /// relative to the region; `addr` is the source). Answer with
    /// `handle_gather_done` / `handle_gather_failed`.
    StartGather {
        /// The chunk.
        chunk: ChunkRef,
        /// Local staging region.
        region: RegionHandle,
        /// Copies.
        runs: Runs,
    },
    /// Write `len` bytes from local `local` into the peer's region `remote`
    /// (address: the peer's arena base + offset). Answer with
    /// `handle_write_done` / `handle_write_failed` / `handle_write_stuck`.
    PostWrite {
        /// The chunk.
        chunk: ChunkRef,
        /// Target agent.
        peer: PeerId,
        /// Local source region.
        local: RegionHandle,
        /// Remote target region.
        remote: RegionHandle,
        /// Bytes.
        len: u64,
    },
    /// Copy local region `region` out to application memory (`runs` are
    /// validated against the region; `addr` is the destination). Answer
    /// with `handle_scatter_done` / `handle_scatter_failed`.
    StartScatter {
        /// The flow.
        flow: FlowId,
        /// Chunk index.
        chunk: u32,
        /// The region.
        region: RegionHandle,
        /// Copies.
        runs: Runs,
    },
    /// READ, on the data owner: `peer` will be written to through the data
    /// path it described (opaque bytes from its READ). Make it a write
    /// target unless it already is with the same description; on failure
    /// do nothing (the writes to it then fail).
    LoadDataPath {
        /// The reader.
        peer: PeerId,
        /// Its description of how to write into its arena.
        data_path: Vec<u8>,
    },
    /// `peer` is unreachable, the application never loaded it (a reader
    /// known only through its READs, or a sender only through its WANTs),
    /// and nothing of it is left here (no request, serve, READ, flow,
    /// region or held credit): tear down its control connection and the
    /// data path its READs described, then call [`Endpoint::forget_peer`].
    /// Idempotent; emitted by [`Endpoint::peer_unreachable`].
    ForgetPeer {
        /// The peer.
        peer: PeerId,
    },
    /// A request reached its terminal outcome (exactly once per request).
    Complete {
        /// The request.
        request: RequestId,
        /// Its outcome.
        outcome: Outcome,
    },
    /// The arena was poisoned (emitted once): the runtime should stop
    /// routing transfers to the bounce path and plan a restart.
    Poisoned {
        /// What happened.
        cause: String,
    },
}

/// Why a submission was refused synchronously (no request was created).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The arena is poisoned.
    #[error("bounce arena is poisoned ({0}); use the standard path")]
    Poisoned(String),
    /// The endpoint is shut down.
    #[error("bounce endpoint is shut down")]
    ShutDown,
    /// The descriptors cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A READ whose message (every chunk's source runs) would exceed what
    /// the control channel carries.
    #[error("the READ's request message ({bytes} bytes, {entries} source runs or copies) exceeds the control message limit ({max} bytes, {max_entries} entries); split the transfer")]
    ReadTooLarge {
        /// Encoded size of the READ message.
        bytes: usize,
        /// The byte limit.
        max: usize,
        /// Run-list entries it would carry.
        entries: usize,
        /// The entry limit (`wire::MAX_MESSAGE_RUNS`).
        max_entries: usize,
    },
    /// A plan made with other options than this endpoint's.
    #[error("the plan has a {chunk}-byte chunk, more than this endpoint's {max}-byte chunk cap (plan with Endpoint::plan)")]
    ChunkTooLarge {
        /// The offending chunk's size.
        chunk: u64,
        /// This endpoint's cap.
        max: u64,
    },
}

/// When a live request expires: at its deadline or `timeout` after its
/// last progress, whichever comes first.
pub(crate) fn expiry(last_progress: Time, deadline: Option<Time>, timeout: Duration) -> Time {
    let t = last_progress.after(timeout);
    deadline.map_or(t, |d| d.min(t))
}

/// The failure due at `now` for a live request, if any: a passed deadline
/// (even with progress) before the no-progress timeout.
pub(crate) fn due_failure(
    now: Time,
    last_progress: Time,
    deadline: Option<Time>,
    timeout: Duration,
) -> Option<FailureReason> {
    if deadline.is_some_and(|d| now >= d) {
        Some(FailureReason::DeadlineExceeded)
    } else if now >= last_progress.after(timeout) {
        Some(FailureReason::Timeout)
    } else {
        None
    }
}

/// Counters for observability (and the simulation's checks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests submitted.
    pub submitted: u64,
    /// Requests succeeded.
    pub succeeded: u64,
    /// Requests failed.
    pub failed: u64,
    /// Control messages that failed to decode.
    pub malformed: u64,
    /// DATA dropped because the region is not (or no longer) the flow's.
    pub late_data: u64,
    /// Messages ignored as stale or unexpected.
    pub ignored: u64,
    /// Credits granted to remote flows.
    pub grants: u64,
    /// WANT/CANCEL refused for a wrong access key.
    pub unauthorized: u64,
    /// Local staging acquisitions that had to wait (parked credits).
    pub parked: u64,
    /// READs served to the end (data owner).
    pub reads_served: u64,
    /// READs refused before anything was read (bad sources, bad chunks,
    /// wrong key, poisoned or shutting down).
    pub reads_refused: u64,
    /// Standing credits offered to senders (receiver).
    pub standing_offered: u64,
    /// Requests whose first chunk took a standing credit (sender).
    pub standing_claimed: u64,
    /// Flows whose first chunk came in a standing slot, claimed by their
    /// WANT, with no grant (receiver).
    pub standing_taken: u64,
}

/// The actions waiting for the runtime, in two lines: copy launches
/// ([`Action::StartGather`], [`Action::StartScatter`]) and everything else,
/// each in the order it arose; the second line goes first
/// (`launches_last`; else one line).
///
/// Why: filling a launch's run table costs the reactor tens of
/// microseconds for a large chunk, so a message or a
/// chunk write queued behind a request's launches waited for all of them.
/// None of the others depends on a launch still queued: a chunk's write
/// and DATA follow its gather's *done* event, an ACK its scatter's, a
/// failed request's completion waits until none of its gathers runs (a
/// queued one counts as running), and the actions that must keep their
/// order (Connect, then the messages to that peer; LoadDataPath, then the
/// serve's writes) share one line.
#[derive(Debug, Default)]
pub(crate) struct ActionQueue {
    others: VecDeque<Action>,
    launches: VecDeque<Action>,
    launches_last: bool,
}

impl ActionQueue {
    fn new(launches_last: bool) -> Self {
        ActionQueue {
            launches_last,
            ..ActionQueue::default()
        }
    }

    pub fn push_back(&mut self, action: Action) {
        let launch = matches!(
            action,
            Action::StartGather { .. } | Action::StartScatter { .. }
        );
        if launch && self.launches_last {
            self.launches.push_back(action);
        } else {
            self.others.push_back(action);
        }
    }

    pub fn pop_front(&mut self) -> Option<Action> {
        self.others
            .pop_front()
            .or_else(|| self.launches.pop_front())
    }

    /// The next action that is not a launch (any action when launches are
    /// not held back).
    pub fn pop_other(&mut self) -> Option<Action> {
        if self.launches_last {
            self.others.pop_front()
        } else {
            self.pop_front()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.others.is_empty() && self.launches.is_empty()
    }
}

/// State shared by both roles.
pub(crate) struct Ctx {
    pub cfg: EndpointConfig,
    pub sched: CreditScheduler,
    pub actions: ActionQueue,
    pub poisoned: Option<String>,
    pub shut_down: bool,
    pub stats: Stats,
    pub plan_options: PlanOptions,
    /// Access keys of the peers this agent sends to (from their handshakes).
    pub peer_keys: std::collections::HashMap<PeerId, u64>,
    /// The peers this agent sends to whose handshakes offer standing
    /// credits ([`super::wire::Capabilities::STANDING`]).
    pub standing_peers: std::collections::HashSet<PeerId>,
}

impl Ctx {
    /// The access key for WANTs and CANCELs to `peer` (0 if unknown).
    pub fn key_for(&self, peer: &PeerId) -> u64 {
        self.peer_keys.get(peer).copied().unwrap_or(0)
    }

    pub fn send(&mut self, peer: &PeerId, message: Message) {
        self.actions.push_back(Action::Send {
            peer: peer.clone(),
            message,
        });
    }

    /// Marks the arena poisoned (idempotent). The endpoint then fails the
    /// work that depends on new allocations.
    pub fn poison(&mut self, cause: String) {
        if self.poisoned.is_none() {
            tracing::error!(target: "nixl_bounce::proto", "arena poisoned: {cause}");
            self.sched.poison();
            self.actions.push_back(Action::Poisoned {
                cause: cause.clone(),
            });
            self.poisoned = Some(cause);
        }
    }
}

/// Invariant violations found by [`Endpoint::check_invariants`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// One local agent. See the module docs.
pub struct Endpoint {
    ctx: Ctx,
    sender: Sender,
    receiver: Receiver,
    reads: Reads,
    owner_book: OwnerBook,
    source_check: Option<Box<dyn SourceCheck>>,
    handled_poison: bool,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("stats", &self.ctx.stats)
            .field("poisoned", &self.ctx.poisoned)
            .field("shut_down", &self.ctx.shut_down)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// A fresh endpoint over an empty arena.
    pub fn new(cfg: EndpointConfig) -> Result<Endpoint, SchedError> {
        let sched = CreditScheduler::new(SchedulerParams {
            capacity: cfg.arena_capacity,
            granularity: cfg.granularity,
            window: cfg.window,
            max_chunk: cfg.max_chunk,
            local_reserve: cfg.local_reserve,
            standing_slots: cfg.standing_slots,
            standing_len: cfg.min_chunk,
            token_base: cfg.incarnation,
        })?;
        let plan_options = PlanOptions {
            max_chunk_bytes: cfg.max_chunk,
            merge_runs: cfg.merge_runs,
            min_chunks: u64::from(cfg.min_chunks),
            min_chunk_bytes: cfg.min_chunk,
        };
        let sender = Sender::new(cfg.request_id_base);
        let actions = ActionQueue::new(cfg.launches_last);
        Ok(Endpoint {
            ctx: Ctx {
                cfg,
                sched,
                actions,
                poisoned: None,
                shut_down: false,
                stats: Stats::default(),
                plan_options,
                peer_keys: std::collections::HashMap::new(),
                standing_peers: std::collections::HashSet::new(),
            },
            sender,
            receiver: Receiver::default(),
            reads: Reads::default(),
            owner_book: OwnerBook::default(),
            source_check: None,
            handled_poison: false,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.ctx.cfg
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        self.ctx.stats
    }

    /// Why the arena is poisoned, if it is.
    pub fn poisoned(&self) -> Option<&str> {
        self.ctx.poisoned.as_deref()
    }

    /// Arena bytes per owner class.
    pub fn arena_usage(&self) -> HeldBytes {
        self.ctx.sched.held_bytes()
    }

    /// Free arena bytes.
    pub fn arena_free(&self) -> u64 {
        self.ctx.sched.free_bytes()
    }

    /// Who holds `region` of this agent's arena.
    pub fn region_owner(&self, region: RegionHandle) -> Option<&Owner> {
        self.ctx.sched.owner(region)
    }

    /// The peer `region`, a standing slot, is assigned to (until that
    /// peer gives it back), if it is one and assigned.
    pub fn slot_peer(&self, region: RegionHandle) -> Option<&PeerId> {
        self.ctx.sched.slot_peer(region)
    }

    /// Who holds `region` of this agent's arena, and its granted length.
    pub fn region_info(&self, region: RegionHandle) -> Option<(&Owner, u64)> {
        self.ctx.sched.region(region)
    }

    /// Live receiver flows.
    pub fn flow_count(&self) -> usize {
        self.ctx.sched.flow_count()
    }

    /// Requests still tracked: WRITEs and served READs (live, or failed
    /// with operations still running) and this agent's READs.
    pub fn request_count(&self) -> usize {
        self.sender.len() + self.reads.len() + self.owner_book.early_len()
    }

    /// Decides which source ranges peers may READ (without one, every READ
    /// is refused).
    pub fn set_source_check(&mut self, check: Box<dyn SourceCheck>) {
        self.source_check = Some(check);
    }

    /// How a data owner writes into this agent's arena: opaque bytes sent in
    /// every READ and handed to the owner's runtime
    /// ([`Action::LoadDataPath`]).
    pub fn set_read_data_path(&mut self, data_path: Vec<u8>) {
        self.reads.data_path = data_path;
    }

    /// The data path READs to `peer` carry instead of the one
    /// [`Endpoint::set_read_data_path`] set (an owner that reads only an
    /// older form of it), until the peer is forgotten; `None`: that one.
    pub fn set_peer_data_path(&mut self, peer: &PeerId, data_path: Option<Vec<u8>>) {
        match data_path {
            Some(path) => self.reads.peer_data_paths.insert(peer.clone(), path),
            None => self.reads.peer_data_paths.remove(peer),
        };
    }

    /// The reader's request id if local request `id` serves a READ (its
    /// chunks land in the reader's flow `FlowId::read(us, that id)`).
    pub fn serves_read(&self, id: RequestId) -> Option<RequestId> {
        self.sender.serves(id)
    }

    /// The standing offer local request `id` claimed, if it did (its
    /// chunk 0 is written into that slot without a grant), and the
    /// incarnation it claimed it as.
    pub fn request_claim(&self, id: RequestId) -> Option<(super::wire::Claim, u64)> {
        Some((self.sender.claim_of(id)?, self.ctx.cfg.incarnation))
    }

    /// Plans a READ from `peer` and starts it: `descriptors` go from the
    /// peer's memory (`src_*`) to this agent's (`dst_*`). The request ends
    /// with exactly one [`Action::Complete`], once every chunk is scattered
    /// (or, after a failure, once no scatter of it still runs).
    pub fn submit_read(
        &mut self,
        now: Time,
        peer: &PeerId,
        descriptors: &[Descriptor],
        deadline: Option<Duration>,
    ) -> Result<RequestId, SubmitError> {
        let plan = self.plan(descriptors)?;
        self.submit_read_plan(now, peer, plan, deadline)
    }

    /// As [`Endpoint::submit_read`], for a plan made by [`Endpoint::plan`]
    /// (sources on the peer, destinations here).
    pub fn submit_read_plan(
        &mut self,
        now: Time,
        peer: &PeerId,
        plan: Arc<Plan>,
        deadline: Option<Duration>,
    ) -> Result<RequestId, SubmitError> {
        self.check_submission(&plan)?;
        let id = self.sender.next_id();
        self.reads
            .submit(&mut self.ctx, now, id, peer, plan, deadline)?;
        self.pump(now);
        Ok(id)
    }

    /// Whether a new request may start: not shut down, not poisoned, and
    /// every chunk of its plan within this endpoint's chunk cap (a plan
    /// made with other options would ask for regions no peer grants).
    fn check_submission(&self, plan: &Plan) -> Result<(), SubmitError> {
        if self.ctx.shut_down {
            return Err(SubmitError::ShutDown);
        }
        if let Some(cause) = &self.ctx.poisoned {
            return Err(SubmitError::Poisoned(cause.clone()));
        }
        let max = self.ctx.plan_options.max_chunk_bytes;
        match plan.chunks.iter().find(|c| c.bytes > max) {
            Some(c) => Err(SubmitError::ChunkTooLarge {
                chunk: c.bytes,
                max,
            }),
            None => Ok(()),
        }
    }

    /// Plans `descriptors` and starts a transfer to `peer`. The request ends
    /// with exactly one [`Action::Complete`].
    pub fn submit(
        &mut self,
        now: Time,
        peer: &PeerId,
        descriptors: &[Descriptor],
    ) -> Result<RequestId, SubmitError> {
        self.submit_with_deadline(now, peer, descriptors, None)
    }

    /// As [`Endpoint::submit`], with a deadline for this request that
    /// overrides the configured `request_deadline` (past it the request fails
    /// with [`FailureReason::DeadlineExceeded`], even if it would still
    /// succeed; its regions are reclaimed only once nothing touches them).
    pub fn submit_with_deadline(
        &mut self,
        now: Time,
        peer: &PeerId,
        descriptors: &[Descriptor],
        deadline: Option<Duration>,
    ) -> Result<RequestId, SubmitError> {
        let plan = self.plan(descriptors)?;
        self.submit_plan(now, peer, plan, deadline)
    }

    /// Plans `descriptors` with this endpoint's options. A plan depends only
    /// on the descriptors, so a transfer posted many times is planned once
    /// (when it is prepared) and submitted with [`Endpoint::submit_plan`].
    pub fn plan(&self, descriptors: &[Descriptor]) -> Result<Arc<Plan>, PlanError> {
        plan::build(descriptors, self.ctx.plan_options).map(Arc::new)
    }

    /// The options [`Endpoint::plan`] uses.
    pub fn plan_options(&self) -> PlanOptions {
        self.ctx.plan_options
    }

    /// Starts a transfer of a plan made by [`Endpoint::plan`] (or with the
    /// same options); `deadline` as for [`Endpoint::submit_with_deadline`].
    pub fn submit_plan(
        &mut self,
        now: Time,
        peer: &PeerId,
        plan: Arc<Plan>,
        deadline: Option<Duration>,
    ) -> Result<RequestId, SubmitError> {
        self.check_submission(&plan)?;
        let id = self
            .sender
            .submit(&mut self.ctx, now, peer, plan, deadline)?;
        self.pump(now);
        Ok(id)
    }

    /// Starts a transfer known so far by its chunks' sizes (what the WANT
    /// carries), so that the GRANT's round trip runs while the caller
    /// still packs the chunks' copies; they come with
    /// [`Endpoint::plan_ready`], and until then nothing is gathered or
    /// written. The caller that cannot finish the plan cancels the request
    /// ([`Endpoint::cancel`]); one that never comes back is ended by the
    /// request timeout, as a request whose credits never come. Its
    /// deadline comes with its plan.
    pub fn submit_sized(
        &mut self,
        now: Time,
        peer: &PeerId,
        sizes: &[u64],
    ) -> Result<RequestId, SubmitError> {
        self.check_submission(&Plan::sized(sizes))?;
        let id = self.sender.submit_sized(&mut self.ctx, now, peer, sizes)?;
        self.pump(now);
        Ok(id)
    }

    /// Chunk `c`'s copies of a request from [`Endpoint::submit_sized`],
    /// ahead of its whole plan: gathered and written as any chunk's, its
    /// DATA held until [`Endpoint::plan_ready`]. Returns whether they were
    /// taken: not when the request is not waiting for them, nor when the
    /// chunk is not the size the WANT carried, which cancels the request.
    pub fn chunk_ready(
        &mut self,
        now: Time,
        request: RequestId,
        c: usize,
        chunk: plan::Chunk,
    ) -> bool {
        let taken = self.sender.on_chunk(&mut self.ctx, now, request, c, chunk);
        self.pump(now);
        taken
    }

    /// The whole plan of a request from [`Endpoint::submit_sized`], every
    /// descriptor checked: the chunks not brought yet are staged, and the
    /// DATA of those written goes out. Returns whether it was taken: not
    /// when the request is not waiting for it (unknown, ended or planned),
    /// nor when the plan's chunk sizes are not those the WANT carried,
    /// which cancels it. `deadline` as for
    /// [`Endpoint::submit_with_deadline`], counted from now.
    pub fn plan_ready(
        &mut self,
        now: Time,
        request: RequestId,
        plan: Arc<Plan>,
        deadline: Option<Duration>,
    ) -> bool {
        let taken = self
            .sender
            .on_plan(&mut self.ctx, now, request, plan, deadline);
        self.pump(now);
        taken
    }

    /// Cancels a request (it fails with [`FailureReason::Cancelled`]).
    /// Returns false if it is unknown or already terminal.
    pub fn cancel(&mut self, now: Time, request: RequestId) -> bool {
        let done = self
            .sender
            .fail(&mut self.ctx, request, FailureReason::Cancelled)
            || self.reads.fail(
                &mut self.ctx,
                request,
                FailureReason::Cancelled,
                Ending::Refuse,
            );
        self.pump(now);
        done
    }

    /// A control message arrived from `from` as bytes.
    pub fn handle_control(
        &mut self,
        now: Time,
        from: &PeerId,
        bytes: &[u8],
    ) -> Result<(), WireError> {
        match Message::decode(bytes) {
            Ok(msg) => {
                self.handle_message(now, from, msg);
                Ok(())
            }
            Err(e) => {
                self.ctx.stats.malformed += 1;
                tracing::warn!(target: "nixl_bounce::proto", "malformed control message from {from}: {e}");
                Err(e)
            }
        }
    }

    /// A decoded control message arrived from `from`.
    pub fn handle_message(&mut self, now: Time, from: &PeerId, msg: Message) {
        match msg {
            Message::Read { request, key, .. } if key != self.ctx.cfg.access_key => {
                self.ctx.stats.unauthorized += 1;
                self.ctx.stats.reads_refused += 1;
                tracing::warn!(target: "nixl_bounce::proto", "READ from {from} with a wrong access key refused");
                self.ctx.send(
                    from,
                    Message::ReadEnd {
                        request,
                        reason: RefuseReason::ProtocolViolation,
                    },
                );
            }
            Message::Want { request, key, .. } | Message::Cancel { request, key, .. }
                if key != self.ctx.cfg.access_key =>
            {
                // Not from a peer that loaded this agent's metadata (or a
                // stale key from before a restart): no flow, no grant.
                self.ctx.stats.unauthorized += 1;
                tracing::warn!(target: "nixl_bounce::proto", "WANT/CANCEL from {from} with a wrong access key refused");
                self.ctx.send(
                    from,
                    Message::Refuse {
                        request,
                        reason: super::wire::RefuseReason::ProtocolViolation,
                    },
                );
            }
            Message::Want {
                request,
                chunk_sizes,
                endpoint,
                standing,
                incarnation,
                ..
            } => self.receiver.on_want(
                &mut self.ctx,
                now,
                from,
                request,
                &chunk_sizes,
                endpoint,
                standing,
                incarnation,
            ),
            Message::Standing {
                token,
                region,
                len,
                incarnation,
            } => {
                if incarnation == self.ctx.cfg.incarnation {
                    self.sender
                        .on_standing(&mut self.ctx, from, token, region, len)
                } else {
                    // Offered to another incarnation of this agent's name.
                    self.ctx.stats.ignored += 1;
                }
            }
            Message::Return { key, .. } if key != self.ctx.cfg.access_key => {
                // Only a sender that was offered the slot has the key.
                self.ctx.stats.unauthorized += 1;
                tracing::warn!(target: "nixl_bounce::proto", "a standing offer given back by {from} with a wrong access key: ignored");
            }
            Message::Return {
                offer, incarnation, ..
            } => {
                let (offer, region) = Offer::named(offer, incarnation);
                self.receiver.on_return(&mut self.ctx, from, offer, region)
            }
            Message::Cancel {
                request,
                endpoint,
                claim,
                incarnation,
                ..
            } => self.receiver.on_cancel(
                &mut self.ctx,
                now,
                from,
                request,
                endpoint,
                claim.map(|c| Offer::named(c, incarnation)),
            ),
            Message::Data {
                request,
                chunk,
                region,
                runs,
            } => self
                .receiver
                .on_data(&mut self.ctx, now, from, request, chunk, region, runs),
            // WRITE messages name our WRITE requests only: a serve (our
            // side of a READ) takes READ_GRANT / READ_ACK / READ_REFUSE,
            // keyed by the reader's id.
            Message::Grant { request, .. }
            | Message::Ack { request, .. }
            | Message::Refuse { request, .. }
                if self.sender.serves(request).is_some() =>
            {
                self.ctx.stats.ignored += 1;
                tracing::warn!(target: "nixl_bounce::proto", "a WRITE message from {from} names {request}, which serves a READ: ignored");
            }
            Message::Grant { request, credits } => {
                self.sender
                    .on_grant(&mut self.ctx, now, from, request, &credits)
            }
            Message::Ack {
                request,
                chunk,
                region,
            } => self
                .sender
                .on_ack(&mut self.ctx, now, from, request, chunk, region),
            Message::Refuse { request, reason } => {
                self.sender.on_refuse(&mut self.ctx, from, request, reason)
            }
            Message::Read {
                request,
                endpoint,
                data_path,
                chunks,
                ..
            } => self.on_read(now, from, request, endpoint, data_path, chunks),
            Message::ReadGrant { request, credits } => {
                match self.sender.serving(from, request) {
                    Some(id) => self.sender.on_grant(&mut self.ctx, now, from, id, &credits),
                    None if self.owner_book.is_tombstoned(from, request) => {
                        self.ctx.stats.ignored += 1;
                    }
                    // The READ is late (reordered) or lost: hold the credits.
                    None => {
                        if !self.owner_book.hold(&self.ctx, now, from, request, credits) {
                            self.end_unknown_read(now, from, request);
                        }
                    }
                }
            }
            Message::ReadAck {
                request,
                chunk,
                region,
            } => match self.sender.serving(from, request) {
                Some(id) => self
                    .sender
                    .on_ack(&mut self.ctx, now, from, id, chunk, region),
                None => self.ctx.stats.ignored += 1,
            },
            Message::ReadRefuse { request, reason } => match self.sender.serving(from, request) {
                Some(id) => self.sender.on_refuse(&mut self.ctx, from, id, reason),
                None => self.end_unknown_read(now, from, request),
            },
            Message::ReadData {
                request,
                chunk,
                region,
            } => match self.reads.scatter_runs(from, request, chunk) {
                Some(runs) => {
                    let flow = crate::proto::FlowId::read(from.clone(), request);
                    if self
                        .receiver
                        .accept_data(&mut self.ctx, now, flow, chunk, region, runs)
                    {
                        self.reads.scatter_started(now, request, region);
                    }
                }
                None => {
                    self.ctx.stats.late_data += 1;
                    tracing::debug!(target: "nixl_bounce::proto", "dropping READ_DATA {from}/read {request}#{chunk}: no such live read");
                }
            },
            Message::ReadEnd { request, reason } => {
                self.reads.on_end(&mut self.ctx, from, request, reason)
            }
        }
        self.pump(now);
    }

    /// The data owner's side of a READ: validate everything before anything
    /// is read, then serve it like a WRITE into the reader's granted regions.
    fn on_read(
        &mut self,
        now: Time,
        from: &PeerId,
        request: RequestId,
        endpoint: Vec<u8>,
        data_path: Vec<u8>,
        chunks: Vec<super::wire::ReadChunk>,
    ) {
        self.receiver
            .register_endpoint(&mut self.ctx, from, endpoint);
        if self.sender.serving(from, request).is_some()
            || self.owner_book.is_tombstoned(from, request)
        {
            self.ctx.stats.ignored += 1;
            return;
        }
        let refusal = if self.ctx.poisoned.is_some() {
            Err((RefuseReason::Poisoned, "the arena is poisoned".to_string()))
        } else if self.ctx.shut_down {
            Err((RefuseReason::ShuttingDown, "shutting down".to_string()))
        } else if !self.sender.accepts_path(from, &data_path) {
            // Another incarnation of the reader's arena (it restarted, or
            // this READ is a stale one from before): not while READs
            // through the other one may still write.
            Err((
                RefuseReason::Expired,
                "the reader's arena changed while READs into the previous one run".to_string(),
            ))
        } else {
            read::validate_read(
                self.ctx.cfg.max_chunk,
                from,
                &chunks,
                self.source_check.as_deref(),
            )
        };
        if let Err((reason, why)) = refusal {
            self.ctx.stats.reads_refused += 1;
            tracing::warn!(target: "nixl_bounce::proto", "READ {request} from {from} refused ({reason:?}): {why}");
            self.ctx.send(from, Message::ReadEnd { request, reason });
            self.owner_book.tombstone(&self.ctx, now, from, request);
            return;
        }
        if !data_path.is_empty() {
            self.ctx.actions.push_back(Action::LoadDataPath {
                peer: from.clone(),
                data_path: data_path.clone(),
            });
        }
        if let Some(id) = self.sender.serve(now, from, request, &data_path, chunks) {
            let early = self.owner_book.take(from, request);
            if !early.is_empty() {
                self.sender.on_grant(&mut self.ctx, now, from, id, &early);
            }
        }
    }

    /// A READ this agent will not serve: none of our writes for it can
    /// land, say so (the reader frees the flow's regions) and never serve it
    /// later. A poisoned agent vouches for nothing.
    fn end_unknown_read(&mut self, now: Time, from: &PeerId, request: RequestId) {
        self.ctx.stats.ignored += 1;
        self.owner_book.tombstone(&self.ctx, now, from, request);
        if self.ctx.poisoned.is_none() {
            self.ctx.send(
                from,
                Message::ReadEnd {
                    request,
                    reason: RefuseReason::Expired,
                },
            );
        }
    }

    /// The gather of `chunk` finished.
    pub fn handle_gather_done(&mut self, now: Time, chunk: ChunkRef) {
        self.sender.on_gather_done(&mut self.ctx, now, chunk);
        self.pump(now);
    }

    /// The gather of `chunk` failed. `quiesced`: nothing still writes its
    /// staging region (else the arena is poisoned).
    pub fn handle_gather_failed(&mut self, now: Time, chunk: ChunkRef, quiesced: bool) {
        self.sender.on_gather_failed(&mut self.ctx, chunk, quiesced);
        self.pump(now);
    }

    /// The write of `chunk` completed (data visible at the target).
    pub fn handle_write_done(&mut self, now: Time, chunk: ChunkRef) {
        self.sender.on_write_done(&mut self.ctx, now, chunk);
        self.pump(now);
    }

    /// The write of `chunk` reached a failed terminal state (nothing reads
    /// its source any more, nothing more lands at the target).
    pub fn handle_write_failed(&mut self, now: Time, chunk: ChunkRef) {
        self.sender.on_write_failed(&mut self.ctx, chunk);
        self.pump(now);
    }

    /// The write of `chunk` can never be proven terminal: the arena is
    /// poisoned and the request fails.
    pub fn handle_write_stuck(&mut self, now: Time, chunk: ChunkRef) {
        self.sender.on_write_stuck(&mut self.ctx, chunk);
        self.pump(now);
    }

    /// The scatter of `region` finished.
    pub fn handle_scatter_done(&mut self, now: Time, region: RegionHandle) {
        self.receiver.on_scatter_done(&mut self.ctx, now, region);
        self.reads.scatter_ended(&mut self.ctx, now, region, true);
        self.pump(now);
    }

    /// The scatter of `region` failed. `quiesced`: nothing still reads the
    /// region (else the arena is poisoned).
    pub fn handle_scatter_failed(&mut self, now: Time, region: RegionHandle, quiesced: bool) {
        self.receiver
            .on_scatter_failed(&mut self.ctx, now, region, quiesced);
        self.reads.scatter_ended(&mut self.ctx, now, region, false);
        self.pump(now);
    }

    /// Fires due timers (request timeouts and deadlines, idle receiver
    /// flows, tombstone expiry).
    pub fn handle_timeout(&mut self, now: Time) {
        self.sender.on_timeout(&mut self.ctx, now);
        self.reads.on_timeout(&mut self.ctx, now);
        for (reader, request) in self.owner_book.on_timeout(&self.ctx, now) {
            tracing::warn!(target: "nixl_bounce::proto", "READ_GRANT from {reader} for {request}, but its READ never came");
            self.end_unknown_read(now, &reader, request);
        }
        self.receiver.on_timeout(&mut self.ctx, now);
        self.pump(now);
    }

    /// The earliest time [`Endpoint::handle_timeout`] has work.
    pub fn poll_timeout(&self) -> Option<Time> {
        [
            self.sender.next_timeout(&self.ctx),
            self.reads.next_timeout(&self.ctx),
            self.owner_book.next_timeout(),
            self.receiver.next_timeout(&self.ctx),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The peer is gone and its data path torn down: fail its requests
    /// ([`FailureReason::PeerLost`]) and reclaim its flows. Its access key
    /// goes too (the application loads it again to send to it).
    pub fn forget_peer(&mut self, now: Time, peer: &PeerId) {
        // Before its key goes: the give-back carries it.
        self.sender.return_standing_to(&mut self.ctx, peer);
        self.ctx.peer_keys.remove(peer);
        self.ctx.standing_peers.remove(peer);
        self.reads.peer_data_paths.remove(peer);
        self.sender.forget_peer(&mut self.ctx, peer);
        self.reads.fail_peer(
            &mut self.ctx,
            peer,
            FailureReason::PeerLost,
            Ending::PeerGone,
        );
        self.owner_book.forget(peer);
        self.receiver.forget_peer(&mut self.ctx, peer);
        self.pump(now);
    }

    /// The control channel to `peer` is down (the peer died, is stopped, or
    /// the network between us is gone) while its data path may still be up:
    /// its live requests fail with [`FailureReason::PeerUnreachable`] (their
    /// CANCEL still follows once their writes ended, for a peer that comes
    /// back), and its live flows are aborted, their regions quarantined (a
    /// stopped peer may still write when it resumes) until its CANCEL or
    /// [`Endpoint::forget_peer`].
    ///
    /// Call it again while the peer stays unreachable (requests submitted
    /// meanwhile fail too). A peer the application never loaded (no
    /// [`Endpoint::set_peer_key`]) is one only the peer itself can speak
    /// for: once nothing of it is left here (its serves ended, their writes
    /// with them; no flow or region of it), [`Action::ForgetPeer`] asks the
    /// runtime to forget it, so that readers that READ and die do not pile
    /// up. A loaded peer stays until the application forgets it.
    pub fn peer_unreachable(&mut self, now: Time, peer: &PeerId) {
        self.sender
            .fail_peer(&mut self.ctx, peer, FailureReason::PeerUnreachable);
        // A receiver we cannot hear from may be another incarnation when
        // it is back: its offer is asked for again.
        self.sender.drop_standing(peer);
        // Our READs from it too: their flows are aborted just below, so
        // they could only end at their timeout.
        self.reads.fail_peer(
            &mut self.ctx,
            peer,
            FailureReason::PeerUnreachable,
            Ending::Refuse,
        );
        self.receiver
            .abort_peer(&mut self.ctx, now, peer, super::wire::RefuseReason::Expired);
        self.pump(now);
        if !self.ctx.peer_keys.contains_key(peer) && !self.holds_peer(peer) {
            self.ctx
                .actions
                .push_back(Action::ForgetPeer { peer: peer.clone() });
        }
    }

    /// Whether anything of `peer` is live here: a request to it or a serve
    /// of its READ (also a failed one whose operations still run), a READ
    /// from it, one of its flows or a region granted to or quarantined for
    /// one, credits of its waiting for their READ.
    pub fn holds_peer(&self, peer: &PeerId) -> bool {
        self.sender.has_peer(peer)
            || self.reads.has_peer(peer)
            || self.ctx.sched.holds_peer(peer)
            || self.owner_book.holds(peer)
    }

    /// Whether this endpoint keeps any state about `peer` (beyond
    /// tombstones, which expire): its key, its endpoint, the data path of
    /// its READs, or anything [`Endpoint::holds_peer`] counts.
    pub fn knows_peer(&self, peer: &PeerId) -> bool {
        self.ctx.peer_keys.contains_key(peer)
            || self.receiver.knows(peer)
            || self.sender.knows_reader(peer)
            || self.holds_peer(peer)
    }

    /// Records the access key of `peer` (from its handshake): every WANT and
    /// CANCEL sent to it carries this key. This also marks the peer as
    /// loaded by the application, which alone forgets it
    /// ([`Endpoint::forget_peer`]); a peer never loaded is forgotten once
    /// unreachable with nothing of it left ([`Endpoint::peer_unreachable`]).
    pub fn set_peer_key(&mut self, peer: &PeerId, key: u64) {
        self.ctx.peer_keys.insert(peer.clone(), key);
    }

    /// Records that `peer`'s handshake offers standing credits
    /// ([`super::wire::Capabilities::STANDING`]): WANTs to it say what
    /// this agent does with them, and its offers are taken
    /// ([`super::credit`], "Standing slots"; [`Message::Standing`]).
    pub fn set_peer_standing(&mut self, peer: &PeerId) {
        self.ctx.standing_peers.insert(peer.clone());
    }

    /// This agent stops serving `peer` while the peer may still be alive
    /// (its metadata was invalidated locally): the peer's live flows are
    /// refused, so its requests fail now rather than at their timeout. Call
    /// [`Endpoint::forget_peer`] afterwards, once the data path is down.
    pub fn release_peer(&mut self, now: Time, peer: &PeerId) {
        self.reads
            .fail_peer(&mut self.ctx, peer, FailureReason::PeerLost, Ending::Refuse);
        self.receiver
            .abort_peer(&mut self.ctx, now, peer, super::wire::RefuseReason::Expired);
        self.pump(now);
    }

    /// Shuts down: every live request fails with
    /// [`FailureReason::Shutdown`], live flows are refused, nothing new is
    /// granted or accepted. Operations already handed out must still be
    /// reported.
    pub fn shutdown(&mut self, now: Time) {
        if !self.ctx.shut_down {
            self.ctx.shut_down = true;
            self.sender.return_standing(&mut self.ctx);
            self.sender.fail_all(&mut self.ctx, FailureReason::Shutdown);
            self.reads.fail_all(&mut self.ctx, FailureReason::Shutdown);
            self.receiver
                .abort_all(&mut self.ctx, now, super::wire::RefuseReason::ShuttingDown);
        }
        self.pump(now);
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.ctx.actions.pop_front()
    }

    /// With `launches_last`, the next action that is not a copy launch
    /// (launches wait until this returns `None`); else [`Endpoint::poll_action`].
    pub fn poll_action_not_launch(&mut self) -> Option<Action> {
        self.ctx.actions.pop_other()
    }

    /// Whether an action waits for [`Endpoint::poll_action`].
    pub fn has_actions(&self) -> bool {
        !self.ctx.actions.is_empty()
    }

    /// Re-runs allocation after any state change: parked credits first,
    /// then remote grants, then (when a remote flow or a parked credit
    /// still waits for space) eviction of uncredited eager staging and a
    /// second pass, then new eager staging.
    fn pump(&mut self, now: Time) {
        if self.ctx.poisoned.is_some() && !self.handled_poison {
            self.handled_poison = true;
            self.sender.fail_all(&mut self.ctx, FailureReason::Poisoned);
            self.reads.fail_all(&mut self.ctx, FailureReason::Poisoned);
            self.receiver
                .abort_all(&mut self.ctx, now, super::wire::RefuseReason::Poisoned);
        }
        self.sender.retry_parked(&mut self.ctx);
        if !self.ctx.shut_down {
            self.receiver.schedule(&mut self.ctx);
        }
        let starved = self.sender.has_eager_ready()
            && (self.sender.has_parked() || self.ctx.sched.has_blocked_flow());
        if starved && self.sender.evict_eager(&mut self.ctx) > 0 {
            self.sender.retry_parked(&mut self.ctx);
            if !self.ctx.shut_down {
                self.receiver.schedule(&mut self.ctx);
            }
        }
        self.sender.eager_fill(&mut self.ctx);
        for (reader, request) in self.sender.take_ended_serves() {
            self.owner_book.tombstone(&self.ctx, now, &reader, request);
        }
    }

    /// Checks the scheduler's conservation invariant and that every local
    /// staging region is referenced by exactly one sender chunk.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.ctx
            .sched
            .check_invariants()
            .map_err(InvariantViolation)?;
        let mut staged = self.sender.staged_regions();
        staged.sort_unstable();
        let before = staged.len();
        staged.dedup();
        if staged.len() != before {
            return Err(InvariantViolation(
                "a staging region is used by two chunks".into(),
            ));
        }
        let local = self.ctx.sched.local_regions();
        if staged != local {
            return Err(InvariantViolation(format!(
                "sender staging regions {staged:?} differ from the scheduler's local regions {local:?}"
            )));
        }
        self.reads
            .check_invariants(&self.ctx)
            .map_err(InvariantViolation)
    }
}

#[cfg(test)]
mod tests;
