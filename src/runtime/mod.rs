//! The runtime: the thin shell that runs the sans-IO [`crate::proto::Endpoint`].
//!
//! One reactor thread per engine owns the endpoint, the control channel and
//! the data plane. Application threads talk to it through [`Runtime`]
//! (commands in a queue, results in per-request [`Ticket`]s); copy workers run
//! gathers and scatters and report back. Nothing here decides anything: every
//! decision is the endpoint's, every action it emits is carried out here.
//!
//! Polling (`run_loop`): copy workers, the chunk writer and application
//! submissions wake the control channel when they have something, so the
//! reactor waits there: up to the next protocol timer or [`IDLE_WAIT`].
//! It does not wait (it yields) while a copy it launched is running, while
//! a posted write is due to be polled (sleeping the writer's pause instead
//! when no copy runs), or, with `reactor_busy_poll_us` (or `busy_poll_us`),
//! for that long after the last event of a live transfer.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod reactor;
mod targets;
mod ticket;
mod trace;
mod workers;
mod writes;
pub(crate) use reactor::precise_timers;
use reactor::Reactor;
pub use targets::{InUse, Refused, ScatterTargets};
pub use ticket::Ticket;
pub use trace::ENV as TRACE_ENV;
use trace::{Step, Trace};
use workers::{copy_worker, next_job, CopyJob, WorkerReport};
use writes::{ChunkWriter, PostError, WriteJob, WriteOutcome};

use crate::config::IoThreadUse;
use crate::control::{ControlChannel, Endpoint as ControlEndpoint, PeerHandle};
use crate::copy::{CopyEngine, Direction, RegionSpan};
use crate::dataplane::{DataPlane, PeerArena};
use crate::proto::endpoint::{Action, Endpoint, FailureReason, Outcome, SubmitError};
use crate::proto::plan::{self, Descriptor, Plan, PlanError, PlanOptions, Survey};
use crate::proto::wire::{Message, MessageType};
use crate::proto::{ChunkRef, PeerId, RegionHandle, RequestId, Run, RunPool, Runs, Time};
use crate::sync::Locked;

/// Longest the idle reactor sleeps in the control channel.
pub const IDLE_WAIT: Duration = Duration::from_millis(10);
/// How often the reactor asks the control channel which peers are
/// unreachable.
pub const LIVENESS_CHECK_EVERY: Duration = Duration::from_millis(100);
/// How long a forgotten peer's in-flight writes may take to finish before
/// the arena is declared poisoned.
pub const QUIESCE_BOUND: Duration = Duration::from_secs(5);

/// A user notification to deliver once the request's data is in place.
#[derive(Debug, Clone)]
pub struct DeferredNotif {
    /// The peer's inner agent name.
    pub inner_agent: std::sync::Arc<str>,
    pub message: Vec<u8>,
}

enum Command {
    Submit {
        /// READ from `peer` (else WRITE to it).
        read: bool,
        peer: PeerId,
        plan: Arc<Plan>,
        ticket: Arc<Ticket>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
        /// When the client's thread queued it ([`trace::monotonic_ns`]),
        /// for the timeline (0 when none is kept).
        queued_ns: u64,
    },
    /// A WRITE to `peer` known so far by its chunks' sizes: its WANT goes
    /// out now; [`Command::Planned`] follows.
    Announce {
        peer: PeerId,
        sizes: Vec<u64>,
        ticket: Arc<Ticket>,
        queued_ns: u64,
    },
    /// Chunk `c`'s copies of an announced WRITE, ahead of its plan.
    ChunkReady {
        ticket: Arc<Ticket>,
        c: usize,
        chunk: plan::Chunk,
    },
    /// The plan, and the notification, of an announced WRITE.
    Planned {
        ticket: Arc<Ticket>,
        plan: Arc<Plan>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
    },
    Cancel {
        ticket: Arc<Ticket>,
        /// Withdrawn by the engine itself (an announced WRITE that took
        /// another route): not counted or logged as a failed transfer.
        withdrawn: bool,
    },
    AddPeer {
        peer: PeerId,
        arena: PeerArena,
        key: u64,
        heartbeats: bool,
        standing: bool,
        data_path: Option<Vec<u8>>,
    },
    ForgetPeer {
        peer: PeerId,
    },
}

crate::stats::typed_counters! {
    /// Counters the runtime keeps (read by the engine's stats; all in every
    /// snapshot).
    pub struct RuntimeCounters {
        chunks_written => "chunks_written",
        bytes_written => "bytes_written",
        chunks_scattered => "chunks_scattered",
        scatter_refused => "scatter_refused",
        write_failures => "write_failures",
        copy_failures => "copy_failures",
        /// Gathers and scatters the IO thread launched together with others
        /// of its pass, one launch for them all (`group_copy_launches`).
        copies_launched_together => "copies_launched_together",
        control_send_drops => "control_send_drops",
        grants => "grants",
        malformed_messages => "malformed_messages",
        late_data => "late_data",
        /// WANT/CANCEL refused for a wrong access key.
        unauthorized => "unauthorized",
        /// READs this agent served to the end, and refused (bad sources, ...).
        reads_served => "reads_served",
        reads_refused => "reads_refused",
        succeeded => "bounce_succeeded",
        failed => "bounce_failed",
        timeouts => "bounce_timeouts",
        /// Requests that passed their deadline.
        deadlines => "bounce_deadlines_exceeded",
        cancelled => "bounce_cancels",
        /// WRITEs whose WANT went out before their plan (`announce_writes`),
        /// and of them those withdrawn (the transfer took another route,
        /// or its preparation failed).
        announced => "bounce_announced",
        withdrawn => "bounce_withdrawn",
        /// Chunks of announced WRITEs taken ahead of their plan.
        chunks_ahead => "bounce_chunks_ahead",
        /// Standing credits offered to senders and taken by their WANTs
        /// (receiving: chunks that came with no grant), and WRITEs whose
        /// first chunk took one (sending).
        standing_offered => "bounce_standing_offered",
        standing_taken => "bounce_standing_taken",
        standing_claimed => "bounce_standing_claimed",
        /// Times a peer was found unreachable (control connection down too
        /// long; once per outage).
        peers_unreachable => "peers_unreachable",
        /// Unreachable peers the application never loaded (readers known
        /// only by their READs), forgotten once nothing of them was left.
        peers_forgotten => "peers_forgotten",
        /// Gauges: peers the control channel holds a connection for, and
        /// readers' data paths loaded for served READs.
        control_peers => "control_peers",
        /// Heartbeats the control channel sent (NIXL notifications only).
        control_pings_sent => "control_pings_sent",
        reader_data_paths => "reader_data_paths",
        /// Time spent, summed over operations (for the benchmark's
        /// breakdown): gathers and scatters running, copy jobs waiting for
        /// a worker, chunk writes from post to completion, requests from
        /// submission to outcome.
        gather_ns => "gather_ns",
        scatter_ns => "scatter_ns",
        copy_queue_ns => "copy_queue_ns",
        write_ns => "write_ns",
        request_ns => "request_ns",
        /// Of `write_ns`: the writer thread preparing and posting the writes.
        write_post_ns => "write_post_ns",
        /// Chunk writes by cross-memory attach (host arenas on one host).
        chunk_writes_cma => "chunk_writes_cma",
        /// Control round trips of WRITEs: submission -> the request's first
        /// GRANT, and DATA sent -> its ACK (the peer's scatter included).
        grant_wait_ns => "grant_wait_ns",
        ack_wait_ns => "ack_wait_ns",
    }
    also {
        /// The arena now, in bytes, by owner (gauges; they sum to its
        /// capacity).
        arena: ArenaGauges,
    }
}

/// Where the arena's bytes are, set after every protocol event and read
/// whole, under one lock: read gauge by gauge, a region that moved between
/// two reads (quarantined to free, say) was counted twice or not at all.
#[derive(Debug, Default)]
pub struct ArenaGauges(Mutex<ArenaBytes>);

/// The arena's bytes by owner; they sum to its capacity.
#[derive(Debug, Default, Clone, Copy)]
pub struct ArenaBytes {
    pub free: u64,
    pub reserve: u64,
    /// Granted to remote flows.
    pub flows: u64,
    /// Local gather staging.
    pub local: u64,
    /// Reclaimed, waiting for an operation still running on them.
    pub orphan: u64,
    /// Kept from a sender that may still write.
    pub quarantine: u64,
    /// Standing slots not in a flow (kept for their senders).
    pub standing: u64,
}

impl ArenaGauges {
    pub fn set(&self, bytes: ArenaBytes) {
        *self.0.locked() = bytes;
    }

    pub fn get(&self) -> ArenaBytes {
        *self.0.locked()
    }
}

struct Shared {
    commands: Mutex<Vec<Command>>,
    /// Wakes the reactor out of its wait in the control channel.
    waker: crate::control::Waker,
    stop: AtomicBool,
    poisoned: Mutex<Option<String>>,
    counters: RuntimeCounters,
}

impl Shared {
    /// Records that `agent`'s arena is poisoned (for its stats and the
    /// process-wide report), with an error log saying why; the first cause
    /// is the one kept.
    fn poison(&self, agent: &str, cause: String) {
        let mut poisoned = self.poisoned.locked();
        if poisoned.is_none() {
            tracing::error!(
                agent,
                "bounce arena poisoned, bounce path disabled: {cause}"
            );
            crate::stats::record_poisoned(agent, &cause);
            *poisoned = Some(cause);
        } else {
            tracing::error!(agent, "bounce arena (already poisoned): {cause}");
        }
    }
}

/// Handle to a running reactor. Dropping it shuts the reactor down: every
/// live request fails, in-flight operations are waited for (bounded), and
/// the thread is joined.
pub struct Runtime {
    shared: Arc<Shared>,
    plan_options: PlanOptions,
    /// Storage of the plans' run lists, reused from plan to plan.
    run_pool: RunPool,
    copier: Arc<dyn CopyEngine>,
    thread: Option<JoinHandle<()>>,
    pub targets: Arc<ScatterTargets>,
    /// Whether the IO thread keeps a timeline (`NIXL_BOUNCE_TRACE`): only
    /// then does a submission read the clock for it.
    traced: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("poisoned", &self.poisoned())
            .finish_non_exhaustive()
    }
}

/// The data owner's check of READ sources: registered memory only (the
/// check an RDMA key gives the standard path's READ).
struct RegisteredSources(Arc<ScatterTargets>);

impl crate::proto::read::SourceCheck for RegisteredSources {
    fn check(&self, _reader: &PeerId, runs: &[Run]) -> Result<(), String> {
        self.0.admits(runs).map_err(|e| e.to_string())
    }
}

/// Why the engine could not do what the reactor asked of it for a peer:
/// load or unload a reader's data path, or send a notification.
#[derive(Debug, thiserror::Error)]
pub enum PeerCallError {
    /// A data path's bytes do not decode.
    #[error("the reader's data path: {0}")]
    DataPath(#[from] crate::engine::conn_info::MetadataError),
    /// A call of the inner agent failed: `call` says which, and on what.
    #[error("{call}: {cause}")]
    Nixl {
        /// The call and its subject.
        call: String,
        /// NIXL's error.
        cause: String,
    },
}

/// Loads a reader's data-path description (from its READ) and returns how
/// to write into its arena.
pub type DataPathLoader = Box<dyn Fn(&[u8]) -> Result<PeerArena, PeerCallError> + Send>;
/// Undoes one [`DataPathLoader`] call for that description (once nothing
/// writes through it any more).
pub type DataPathUnloader = Box<dyn Fn(&[u8]) -> Result<(), PeerCallError> + Send>;

/// Everything the reactor needs, built by the engine.
/// Sends a user notification (target agent, message) through the inner
/// agent.
pub type Notify = Box<dyn Fn(&str, &[u8]) -> Result<(), PeerCallError> + Send>;

pub struct Parts {
    pub name: String,
    pub endpoint: Endpoint,
    pub channel: Box<dyn ControlChannel>,
    pub data: DataPlane,
    pub arena: RegionSpan,
    pub copier: Arc<dyn CopyEngine>,
    pub copy_workers: usize,
    /// Poll this long after the last event before sleeping (see
    /// `Config::busy_poll_us`).
    pub busy_poll: Duration,
    /// The IO thread's own (see `Config::reactor_busy_poll_us`).
    pub reactor_busy_poll: Duration,
    /// The longest pass of reading control messages (see
    /// `Config::receive_pass_us`); zero: until none is ready.
    pub receive_pass: Duration,
    /// Which thread posts and polls chunk writes (`Config::chunk_writes`).
    pub chunk_writes: IoThreadUse,
    /// Writer threads (`Config::chunk_writer_threads`).
    pub chunk_writer_threads: usize,
    /// Where CUDA copies are launched (`Config::copy_launches`).
    pub copy_launches: IoThreadUse,
    /// Copies launched in one pass go as one launch per direction
    /// (`Config::group_copy_launches`).
    pub group_copy_launches: bool,
    pub failpoints: crate::failpoint::Failpoints,
    /// Sends a user notification through the inner agent.
    pub notify: Notify,
    /// Makes a reader's arena a write target (served READs).
    pub load_data_path: DataPathLoader,
    /// Gives up a reader's arena loaded by `load_data_path`.
    pub unload_data_path: DataPathUnloader,
}

impl Runtime {
    pub fn start(parts: Parts) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            commands: Mutex::new(Vec::new()),
            waker: parts.channel.waker(),
            stop: AtomicBool::new(false),
            poisoned: Mutex::new(None),
            counters: RuntimeCounters::default(),
        });
        let targets = Arc::new(ScatterTargets::default());
        let plan_options = parts.endpoint.plan_options();
        let (job_tx, job_rx) = mpsc::channel::<CopyJob>();
        let (done_tx, done_rx) = mpsc::channel::<WorkerReport>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::new();
        for i in 0..parts.copy_workers.max(1) {
            let (rx, tx, copier) = (job_rx.clone(), done_tx.clone(), parts.copier.clone());
            let waker = shared.waker.clone();
            let t = targets.clone();
            let spin = parts.busy_poll;
            let delays = (
                parts.failpoints.delay("delay_gather_ms"),
                parts.failpoints.delay("delay_scatter_ms"),
            );
            workers.push(
                std::thread::Builder::new()
                    .name(format!("bounce-copy-{i}"))
                    .spawn(move || copy_worker(rx, tx, copier, waker, t, spin, delays))?,
            );
        }
        // A failpoint's delay before each post belongs on the writer thread.
        let write_delay = parts.failpoints.delay("delay_write_ms");
        let posting = if write_delay.is_zero() {
            parts.chunk_writes
        } else {
            IoThreadUse::Never
        };
        let writer = ChunkWriter::start(
            parts.name.clone(),
            parts.data,
            posting,
            shared.clone(),
            (parts.busy_poll, write_delay),
            parts.chunk_writer_threads,
        )?;
        let launch_here = [
            parts.failpoints.delay("delay_gather_ms").is_zero(),
            parts.failpoints.delay("delay_scatter_ms").is_zero(),
        ];
        let mut endpoint = parts.endpoint;
        endpoint.set_source_check(Box::new(RegisteredSources(targets.clone())));
        let reactor = Reactor {
            name: parts.name.clone(),
            endpoint,
            load_data_path: parts.load_data_path,
            unload_data_path: parts.unload_data_path,
            data_paths: HashMap::new(),
            channel: parts.channel,
            writer,
            trace: Trace::from_env(&parts.name),
            write_outcomes: Vec::new(),
            arena: parts.arena,
            busy_poll: parts.reactor_busy_poll,
            receive_pass: parts.receive_pass,
            notify: parts.notify,
            failpoints: parts.failpoints,
            shared: shared.clone(),
            targets: targets.clone(),
            start: Instant::now(),
            jobs: Some(job_tx),
            done: done_rx,
            copies_in_flight: 0,
            copier: parts.copier.clone(),
            launched: Vec::new(),
            launch_here,
            copy_launches: parts.copy_launches,
            group_copy_launches: parts.group_copy_launches,
            held: Vec::new(),
            holding: false,
            writes: Vec::new(),
            peers: HashMap::new(),
            handles: HashMap::new(),
            unreachable: HashSet::new(),
            liveness_checked: Instant::now(),
            tickets: HashMap::new(),
            awaiting_grant: HashMap::new(),
            withdrawn: HashSet::new(),
            awaiting_ack: HashMap::new(),
            workers,
        };
        let traced = reactor.trace.is_some();
        let thread = std::thread::Builder::new()
            .name(format!("bounce-io-{}", parts.name))
            .spawn(move || reactor.run())?;
        Ok(Self {
            shared,
            plan_options,
            run_pool: RunPool::default(),
            copier: parts.copier.clone(),
            thread: Some(thread),
            targets,
            traced,
        })
    }

    fn push(&self, c: Command) {
        self.shared.commands.locked().push(c);
        (self.shared.waker)();
    }

    /// The options its plans are made with.
    pub fn plan_options(&self) -> PlanOptions {
        self.plan_options
    }

    /// The storage its plans' run lists come from.
    pub fn run_pool(&self) -> &RunPool {
        &self.run_pool
    }

    /// Plans a transfer of the descriptors `descriptors` yields, which
    /// `survey` was fed ([`plan::build_surveyed`]), for [`Runtime::submit`].
    /// A plan depends only on the descriptors: make it once when the
    /// transfer is prepared and submit it on every post.
    pub fn plan(
        &self,
        descriptors: impl Iterator<Item = Descriptor>,
        survey: Survey,
    ) -> Result<Arc<Plan>, PlanError> {
        plan::build_surveyed(descriptors, survey, self.plan_options, &self.run_pool).map(Arc::new)
    }

    pub fn submit(
        &self,
        peer: PeerId,
        plan: Arc<Plan>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
    ) -> Arc<Ticket> {
        self.submit_command(false, peer, plan, notif, deadline)
    }

    /// Starts a bounce READ from `peer` of a plan made by
    /// [`Runtime::plan`] whose sources (`src_*`) are the peer's memory and
    /// destinations (`dst_*`) ours. The ticket succeeds once every byte is
    /// scattered; `notif` then goes to the peer (NIXL's READ notification
    /// semantics).
    pub fn submit_read(
        &self,
        peer: PeerId,
        plan: Arc<Plan>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
    ) -> Arc<Ticket> {
        self.submit_command(true, peer, plan, notif, deadline)
    }

    /// Starts a WRITE to `peer` known so far by its chunks' sizes
    /// ([`plan::Cut::sizes`]): its WANT goes out now, so that the GRANT's
    /// round trip runs while the caller packs the plan, which
    /// [`Runtime::plan_ready`] then brings (with the notification). A
    /// caller that ends up not sending it withdraws it
    /// ([`Runtime::withdraw`]).
    pub fn announce(&self, peer: PeerId, sizes: Vec<u64>) -> Arc<Ticket> {
        let ticket = Ticket::new();
        self.push(Command::Announce {
            peer,
            sizes,
            ticket: ticket.clone(),
            queued_ns: self.queued_ns(),
        });
        ticket
    }

    /// Chunk `c`'s copies of a WRITE started by [`Runtime::announce`],
    /// packed ahead of its plan, every descriptor of the chunk checked: it
    /// is gathered and written as soon as it is credited, its DATA held
    /// until [`Runtime::plan_ready`] (a WRITE withdrawn instead moves
    /// nothing into its destination). Called from the preparation's
    /// threads as each chunk is packed.
    pub fn chunk_ready(&self, ticket: &Arc<Ticket>, c: usize, chunk: plan::Chunk) {
        self.push(Command::ChunkReady {
            ticket: ticket.clone(),
            c,
            chunk,
        });
    }

    /// The plan of a WRITE started by [`Runtime::announce`], whose chunk
    /// sizes must be those announced (else the request fails, cancelled),
    /// the notification its success sends, and its deadline (counted from
    /// here, the post, as a submitted request's is).
    pub fn plan_ready(
        &self,
        ticket: &Arc<Ticket>,
        plan: Arc<Plan>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
    ) {
        self.push(Command::Planned {
            ticket: ticket.clone(),
            plan,
            notif,
            deadline,
        });
    }

    /// Ends an announced WRITE that will not be sent after all (its
    /// transfer took another route, or its preparation failed): cancelled
    /// as [`Runtime::cancel`] does, its regions reclaimed safely, but not
    /// counted as a failed transfer.
    pub fn withdraw(&self, ticket: &Arc<Ticket>) {
        if ticket.outcome().is_none() {
            self.push(Command::Cancel {
                ticket: ticket.clone(),
                withdrawn: true,
            });
        }
    }

    fn queued_ns(&self) -> u64 {
        if self.traced {
            trace::monotonic_ns()
        } else {
            0
        }
    }

    fn submit_command(
        &self,
        read: bool,
        peer: PeerId,
        plan: Arc<Plan>,
        notif: Option<DeferredNotif>,
        deadline: Option<Duration>,
    ) -> Arc<Ticket> {
        let ticket = Ticket::new();
        self.push(Command::Submit {
            read,
            peer,
            plan,
            ticket: ticket.clone(),
            notif,
            deadline,
            queued_ns: self.queued_ns(),
        });
        ticket
    }

    /// Cancels a request (it fails; its regions are reclaimed safely).
    pub fn cancel(&self, ticket: &Arc<Ticket>) {
        if ticket.outcome().is_none() {
            self.push(Command::Cancel {
                ticket: ticket.clone(),
                withdrawn: false,
            });
        }
    }

    /// Makes `peer` a write target: its arena, the access key its WANTs
    /// must carry, whether it answers the control channel's heartbeats
    /// (its handshake's `HEARTBEATS` capability), whether it offers
    /// standing credits (`STANDING`), and the data path READs
    /// from it carry where not this instance's own (an older owner's).
    pub fn add_peer(
        &self,
        peer: PeerId,
        arena: PeerArena,
        key: u64,
        heartbeats: bool,
        standing: bool,
        data_path: Option<Vec<u8>>,
    ) {
        self.push(Command::AddPeer {
            peer,
            arena,
            key,
            heartbeats,
            standing,
            data_path,
        });
    }

    pub fn forget_peer(&self, peer: PeerId) {
        self.push(Command::ForgetPeer { peer });
    }

    /// Why the arena is poisoned, if it is.
    pub fn poisoned(&self) -> Option<String> {
        self.shared.poisoned.locked().clone()
    }

    pub fn counters(&self) -> &RuntimeCounters {
        &self.shared.counters
    }

    /// A reader of the runtime's counters and poison state for the engine's
    /// stats snapshot (holds the shared state, not the reactor).
    pub fn stats_source(&self) -> crate::stats::StatsSource {
        let shared = self.shared.clone();
        let copier = self.copier.clone();
        Box::new(move || {
            let c = &shared.counters;
            let a = c.arena.get();
            let arena = [
                ("arena_free_bytes", a.free),
                ("arena_reserve_bytes", a.reserve),
                ("arena_flow_bytes", a.flows),
                ("arena_local_bytes", a.local),
                ("arena_orphan_bytes", a.orphan),
                ("arena_quarantine_bytes", a.quarantine),
                ("arena_standing_bytes", a.standing),
            ];
            let mut map: std::collections::BTreeMap<String, u64> = c
                .named()
                .map(|(k, v)| (k, v.load(Ordering::Relaxed)))
                .chain(arena)
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            map.extend(
                copier
                    .phase_counters()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v)),
            );
            (map, shared.poisoned.locked().clone())
        })
    }
}

impl Runtime {
    /// Shuts the reactor down (see [`Runtime`]); idempotent. Afterwards
    /// [`Runtime::poisoned`] says whether the arena may still be touched.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        (self.shared.waker)();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the bounce reactor thread panicked during shutdown");
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}
