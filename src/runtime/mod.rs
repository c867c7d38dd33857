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
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod trace;
mod writes;
pub use trace::ENV as TRACE_ENV;
use trace::{Step, Trace};
use writes::{ChunkWriter, WriteJob, WriteOutcome};

use crate::config::IoThreadUse;
use crate::control::{ControlChannel, Endpoint as ControlEndpoint, PeerHandle};
use crate::copy::{CopyEngine, Direction, RegionSpan};
use crate::dataplane::{DataPlane, PeerArena};
use crate::proto::endpoint::{Action, Endpoint, FailureReason, Outcome};
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

/// Status values of a ticket (NIXL status codes).
const IN_PROGRESS: i32 = 1;
const SUCCESS: i32 = 0;

/// The application's view of one bounce request.
#[derive(Debug)]
pub struct Ticket {
    status: AtomicI32,
    failure: Mutex<Option<FailureReason>>,
    request: Mutex<Option<RequestId>>,
}

impl Ticket {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            status: AtomicI32::new(IN_PROGRESS),
            failure: Mutex::new(None),
            request: Mutex::new(None),
        })
    }
    /// `None` while running; then `Ok(())` or the failure reason.
    pub fn outcome(&self) -> Option<Result<(), FailureReason>> {
        match self.status.load(Ordering::Acquire) {
            IN_PROGRESS => None,
            SUCCESS => Some(Ok(())),
            _ => Some(Err(self
                .failure
                .locked()
                .unwrap_or(FailureReason::Rejected))),
        }
    }
    fn finish(&self, outcome: Result<(), FailureReason>) {
        if let Err(reason) = outcome {
            *self.failure.locked() = Some(reason);
            self.status.store(-1, Ordering::Release);
        } else {
            self.status.store(SUCCESS, Ordering::Release);
        }
    }
}

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
    },
    Cancel {
        ticket: Arc<Ticket>,
    },
    AddPeer {
        peer: PeerId,
        arena: PeerArena,
        key: u64,
        heartbeats: bool,
        data_path: Option<Vec<u8>>,
    },
    ForgetPeer {
        peer: PeerId,
    },
}

/// Counters the runtime keeps (read by the engine's stats).
#[derive(Debug, Default)]
pub struct RuntimeCounters {
    pub chunks_written: AtomicU64,
    pub bytes_written: AtomicU64,
    pub chunks_scattered: AtomicU64,
    pub scatter_refused: AtomicU64,
    pub write_failures: AtomicU64,
    pub copy_failures: AtomicU64,
    pub control_send_drops: AtomicU64,
    pub grants: AtomicU64,
    pub malformed_messages: AtomicU64,
    pub late_data: AtomicU64,
    /// WANT/CANCEL refused for a wrong access key.
    pub unauthorized: AtomicU64,
    /// READs this agent served to the end, and refused (bad sources, ...).
    pub reads_served: AtomicU64,
    pub reads_refused: AtomicU64,
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub timeouts: AtomicU64,
    /// Requests that passed their deadline.
    pub deadlines: AtomicU64,
    pub cancelled: AtomicU64,
    /// Times a peer was found unreachable (control connection down too
    /// long; once per outage).
    pub peers_unreachable: AtomicU64,
    /// Unreachable peers the application never loaded (readers known only
    /// by their READs), forgotten once nothing of them was left.
    pub peers_forgotten: AtomicU64,
    /// The arena now, in bytes, by owner (gauges; they sum to its capacity).
    pub arena: ArenaGauges,
    /// Gauges: peers the control channel holds a connection for, and
    /// readers' data paths loaded for served READs.
    pub control_peers: AtomicU64,
    /// Heartbeats the control channel sent (NIXL notifications only).
    pub control_pings_sent: AtomicU64,
    pub reader_data_paths: AtomicU64,
    /// Time spent, summed over operations (for the benchmark's breakdown):
    /// gathers and scatters running, copy jobs waiting for a worker, chunk
    /// writes from post to completion, requests from submission to outcome.
    pub gather_ns: AtomicU64,
    pub scatter_ns: AtomicU64,
    pub copy_queue_ns: AtomicU64,
    pub write_ns: AtomicU64,
    pub request_ns: AtomicU64,
    /// Of `write_ns`: the writer thread preparing and posting the writes.
    pub write_post_ns: AtomicU64,
    /// Chunk writes by cross-memory attach (host arenas on one host).
    pub chunk_writes_cma: AtomicU64,
    /// Control round trips of WRITEs: submission -> the request's first
    /// GRANT, and DATA sent -> its ACK (the peer's scatter included).
    pub grant_wait_ns: AtomicU64,
    pub ack_wait_ns: AtomicU64,
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
}

impl ArenaGauges {
    pub fn set(&self, bytes: ArenaBytes) {
        *self.0.locked() = bytes;
    }

    pub fn get(&self) -> ArenaBytes {
        *self.0.locked()
    }
}

/// Application memory the copies may touch, and what they touch now.
///
/// The receiver scatters only into memory registered with this backend at
/// the instance's location (the check an RDMA key gives the standard path):
/// destinations arrive over the network. And since NIXL users may free a
/// buffer once `deregisterMem` returns, deregistration waits until no gather
/// or scatter still reads or writes that range.
#[derive(Debug, Default)]
pub struct ScatterTargets {
    inner: Mutex<Targets>,
    released: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Targets {
    /// Every registration, as (start, len); registrations may repeat.
    registered: Vec<(usize, usize)>,
    /// Their union as sorted, disjoint, non-adjacent [start, end) intervals.
    union: Vec<(u64, u64)>,
    /// Application ranges [start, end) of copies in flight, by token.
    in_use: HashMap<u64, (u64, u64)>,
    next_token: u64,
}

/// Marks one copy's application range as in use until it is returned with
/// [`ScatterTargets::release`].
#[derive(Debug)]
pub struct InUse(u64);

impl Targets {
    fn rebuild(&mut self) {
        let mut v: Vec<(u64, u64)> = self
            .registered
            .iter()
            .map(|&(a, l)| (a as u64, (a as u64).saturating_add(l as u64)))
            .collect();
        v.sort_unstable();
        let mut union: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match union.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => union.push((s, e)),
            }
        }
        self.union = union;
    }

    /// The interval of the union that holds [start, end), if one does.
    fn covering(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let i = self.union.partition_point(|&(s, _)| s <= start);
        (i > 0 && end <= self.union[i - 1].1).then(|| self.union[i - 1])
    }

    /// Whether [start, end) lies inside one interval of the union.
    fn covers(&self, start: u64, end: u64) -> bool {
        self.covering(start, end).is_some()
    }

    /// Checks `runs` (see [`ScatterTargets::admits`]) and returns the
    /// application range they span, [lowest start, highest end) ((0, 0)
    /// for none), in the same pass.
    fn admits(&self, runs: &[Run]) -> Result<(u64, u64), String> {
        // A request's runs mostly lie in one registration: the interval
        // that held the last run is tried before the search.
        let mut last = (1u64, 0u64); // empty
        let mut span = (u64::MAX, 0u64);
        for (i, run) in runs.iter().enumerate() {
            let end = run
                .addr_end()
                .ok_or_else(|| format!("run {i} wraps around"))?;
            span = (span.0.min(run.addr), span.1.max(end));
            if last.0 <= run.addr && end <= last.1 {
                continue;
            }
            if let Some(interval) = self.covering(run.addr, end) {
                last = interval;
                continue;
            }
            for (_, addr, len) in run.copies() {
                let copy_end = addr
                    .checked_add(len)
                    .ok_or_else(|| format!("run {i} wraps around"))?;
                if !self.covers(addr, copy_end) {
                    return Err(format!(
                        "run {i} touches [{addr:#x}, {copy_end:#x}), outside every memory region registered with BOUNCE"
                    ));
                }
            }
        }
        Ok(if runs.is_empty() { (0, 0) } else { span })
    }

    /// Marks the application range [start, end) in use.
    fn track(&mut self, (start, end): (u64, u64)) -> InUse {
        self.next_token += 1;
        self.in_use.insert(self.next_token, (start, end));
        InUse(self.next_token)
    }
}

impl ScatterTargets {
    pub fn add(&self, addr: usize, len: usize) {
        let mut t = self.inner.locked();
        t.registered.push((addr, len));
        t.rebuild();
    }

    /// Forgets a registration, then waits (up to `bound`) until no copy in
    /// flight touches [addr, addr + len). Returns false if one still does.
    pub fn remove(&self, addr: usize, len: usize, bound: Duration) -> bool {
        let mut t = self.inner.locked();
        if let Some(i) = t.registered.iter().position(|&x| x == (addr, len)) {
            t.registered.swap_remove(i);
            t.rebuild();
        }
        let (lo, hi) = (addr as u64, (addr as u64).saturating_add(len as u64));
        let deadline = Instant::now() + bound;
        loop {
            if !t.in_use.values().any(|&(s, e)| s < hi && lo < e) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            t = crate::sync::wait_timeout(&self.released, t, left).0;
        }
    }

    /// Whether every copy of every run lands inside registered memory. A run
    /// whose whole span is registered passes at once; otherwise (a strided
    /// run over several registrations, or across a gap between them) each
    /// copy is checked on its own.
    pub fn admits(&self, runs: &[Run]) -> Result<(), String> {
        self.inner.locked().admits(runs).map(|_| ())
    }

    /// Admits a scatter and marks its destinations in use, atomically with
    /// respect to deregistration.
    pub fn admit_scatter(&self, runs: &[Run]) -> Result<InUse, String> {
        let mut t = self.inner.locked();
        let span = t.admits(runs)?;
        Ok(t.track(span))
    }

    /// Admits a gather (its sources must be registered memory: for a
    /// served READ they come from the network) and marks them in use,
    /// atomically with respect to deregistration.
    pub fn admit_gather(&self, runs: &[Run]) -> Result<InUse, String> {
        self.admit_scatter(runs)
    }

    /// The copy holding `token` is over.
    pub fn release(&self, token: InUse) {
        self.inner.locked().in_use.remove(&token.0);
        self.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(addr: u64, len: u64, count: u32, stride: u64) -> Run {
        Run {
            region_offset: 0,
            addr,
            len,
            count,
            region_stride: len,
            addr_stride: stride,
        }
    }

    #[test]
    fn deregistration_waits_for_copies_in_flight() {
        let t = Arc::new(ScatterTargets::default());
        t.add(0x1000, 0x1000);
        let token = t.admit_scatter(&[run(0x1100, 0x100, 1, 0)]).unwrap();
        assert!(
            !t.remove(0x1000, 0x1000, Duration::from_millis(20)),
            "a scatter still writes there"
        );
        let t2 = t.clone();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            t2.release(token);
        });
        assert!(
            t.remove(0x1000, 0x1000, Duration::from_secs(5)),
            "released within the bound"
        );
        releaser.join().unwrap();
        t.add(0x9000, 0x100);
        let other = t.admit_gather(&[run(0x9000, 0x10, 1, 0)]).unwrap();
        assert!(
            t.admit_gather(&[run(0x9000, 0x10, 2, 0x100)]).is_err(),
            "a gather (a served READ's sources) outside registered memory is refused"
        );
        assert!(
            t.remove(0x1000, 0x1000, Duration::ZERO),
            "copies elsewhere do not hold it up"
        );
        t.release(other);
    }

    #[test]
    fn scatter_targets_admit_copies_inside_registered_memory_only() {
        let t = ScatterTargets::default();
        t.add(0x1000, 0x1000);
        t.add(0x2000, 0x1000); // adjacent: one interval [0x1000, 0x3000)
        t.add(0x5000, 0x1000); // gap [0x3000, 0x5000)
        assert!(
            t.admits(&[run(0x1800, 0x1000, 1, 0)]).is_ok(),
            "a copy across adjacent registrations"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 2, 0x4000)]).is_ok(),
            "strided copies on both sides of a gap"
        );
        assert!(
            t.admits(&[run(0x2f00, 0x200, 1, 0)]).is_err(),
            "a copy running into the gap"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 3, 0x2000)]).is_err(),
            "the middle copy lands in the gap"
        );
        assert!(
            t.admits(&[run(0x6000, 1, 1, 0)]).is_err(),
            "past the last registration"
        );
        assert!(t.admits(&[run(u64::MAX - 1, 4, 1, 0)]).is_err(), "wrapping");
        // Later runs are tried against the interval of the one before
        // first: that shortcut must not admit what leaves it.
        assert!(
            t.admits(&[run(0x1000, 0x100, 1, 0), run(0x5000, 0x100, 1, 0)])
                .is_ok(),
            "runs in two intervals"
        );
        assert!(
            t.admits(&[run(0x1000, 0x100, 1, 0), run(0x2f00, 0x200, 1, 0)])
                .is_err(),
            "a run leaving the interval that held the run before"
        );
        assert!(
            t.admits(&[run(0x5000, 0x100, 1, 0), run(0x4f00, 0x200, 1, 0)])
                .is_err(),
            "a run starting before that interval"
        );
        // The range marked in use spans every run: deregistering any part
        // of it waits for the copy.
        let in_use = t
            .admit_scatter(&[run(0x5800, 0x100, 1, 0), run(0x1000, 0x100, 1, 0)])
            .expect("admitted");
        assert!(
            !t.remove(0x5000, 0x1000, Duration::ZERO),
            "the last run's registration"
        );
        t.add(0x5000, 0x1000);
        assert!(
            !t.remove(0x1000, 0x1000, Duration::ZERO),
            "the first run's registration"
        );
        t.add(0x1000, 0x1000);
        t.release(in_use);
        assert!(t.remove(0x2000, 0x1000, Duration::ZERO));
        assert!(
            t.admits(&[run(0x1800, 0x1000, 1, 0)]).is_err(),
            "after deregistration"
        );
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
        self.0.admits(runs)
    }
}

/// Loads a reader's data-path description (from its READ) and returns how
/// to write into its arena.
pub type DataPathLoader = Box<dyn Fn(&[u8]) -> Result<PeerArena, String> + Send>;
/// Undoes one [`DataPathLoader`] call for that description (once nothing
/// writes through it any more).
pub type DataPathUnloader = Box<dyn Fn(&[u8]) -> Result<(), String> + Send>;

/// Everything the reactor needs, built by the engine.
/// Sends a user notification (target agent, message) through the inner
/// agent.
pub type Notify = Box<dyn Fn(&str, &[u8]) -> Result<(), String> + Send>;

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
    /// Which thread posts and polls chunk writes (`Config::chunk_writes`).
    pub chunk_writes: IoThreadUse,
    /// Writer threads (`Config::chunk_writer_threads`).
    pub chunk_writer_threads: usize,
    /// Where CUDA copies are launched (`Config::copy_launches`).
    pub copy_launches: IoThreadUse,
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
            writes: Vec::new(),
            peers: HashMap::new(),
            handles: HashMap::new(),
            unreachable: HashSet::new(),
            liveness_checked: Instant::now(),
            tickets: HashMap::new(),
            awaiting_grant: HashMap::new(),
            awaiting_ack: HashMap::new(),
            workers,
        };
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
        });
        ticket
    }

    /// Cancels a request (it fails; its regions are reclaimed safely).
    pub fn cancel(&self, ticket: &Arc<Ticket>) {
        if ticket.outcome().is_none() {
            self.push(Command::Cancel {
                ticket: ticket.clone(),
            });
        }
    }

    /// Makes `peer` a write target: its arena, the access key its WANTs
    /// must carry, whether it answers the control channel's heartbeats
    /// (its handshake's `HEARTBEATS` capability), and the data path READs
    /// from it carry where not this instance's own (an older owner's).
    pub fn add_peer(
        &self,
        peer: PeerId,
        arena: PeerArena,
        key: u64,
        heartbeats: bool,
        data_path: Option<Vec<u8>>,
    ) {
        self.push(Command::AddPeer {
            peer,
            arena,
            key,
            heartbeats,
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
            let rows = [
                ("chunks_written", &c.chunks_written),
                ("bytes_written", &c.bytes_written),
                ("chunks_scattered", &c.chunks_scattered),
                ("scatter_refused", &c.scatter_refused),
                ("write_failures", &c.write_failures),
                ("copy_failures", &c.copy_failures),
                ("control_send_drops", &c.control_send_drops),
                ("grants", &c.grants),
                ("malformed_messages", &c.malformed_messages),
                ("late_data", &c.late_data),
                ("unauthorized", &c.unauthorized),
                ("reads_served", &c.reads_served),
                ("reads_refused", &c.reads_refused),
                ("bounce_succeeded", &c.succeeded),
                ("bounce_failed", &c.failed),
                ("bounce_timeouts", &c.timeouts),
                ("bounce_deadlines_exceeded", &c.deadlines),
                ("bounce_cancels", &c.cancelled),
                ("peers_unreachable", &c.peers_unreachable),
                ("peers_forgotten", &c.peers_forgotten),
                ("control_peers", &c.control_peers),
                ("control_pings_sent", &c.control_pings_sent),
                ("reader_data_paths", &c.reader_data_paths),
                ("gather_ns", &c.gather_ns),
                ("scatter_ns", &c.scatter_ns),
                ("copy_queue_ns", &c.copy_queue_ns),
                ("write_ns", &c.write_ns),
                ("request_ns", &c.request_ns),
                ("write_post_ns", &c.write_post_ns),
                ("chunk_writes_cma", &c.chunk_writes_cma),
                ("grant_wait_ns", &c.grant_wait_ns),
                ("ack_wait_ns", &c.ack_wait_ns),
            ];
            let a = c.arena.get();
            let arena = [
                ("arena_free_bytes", a.free),
                ("arena_reserve_bytes", a.reserve),
                ("arena_flow_bytes", a.flows),
                ("arena_local_bytes", a.local),
                ("arena_orphan_bytes", a.orphan),
                ("arena_quarantine_bytes", a.quarantine),
            ];
            let mut map: std::collections::BTreeMap<String, u64> = rows
                .into_iter()
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

struct CopyJob {
    id: CopyId,
    /// Launch it and hand it back to the reactor to poll
    /// ([`CopyEngine::try_launch`]) when the engine can; else (or when no
    /// execution context is free) copy it here, blocking.
    launch: bool,
    queued_at: Instant,
    /// The application range it touches, released when the copy is over.
    in_use: InUse,
    direction: Direction,
    span: RegionSpan,
    runs: Runs,
}

#[derive(Debug, Clone, Copy)]
enum CopyId {
    Gather(ChunkRef),
    Scatter(RegionHandle),
}

struct CopyDone {
    id: CopyId,
    result: Result<(), crate::copy::CopyError>,
    /// Queued -> started, and started -> finished.
    queued: Duration,
    ran: Duration,
}

/// A copy launched (a CUDA kernel is queued and an event marks its end), by
/// the IO thread or a copy worker, and polled by the IO thread instead of a
/// worker blocking on its stream.
struct Launched {
    id: CopyId,
    copy: Box<dyn crate::copy::LaunchedCopy>,
    in_use: InUse,
    /// Queued (for a worker) -> started.
    queued: Duration,
    started: Instant,
}

/// What a copy worker reports: a copy it ran, or one it launched.
enum WorkerReport {
    Done(CopyDone),
    Launched(Launched),
}

/// Takes the next job from `jobs`: polls for up to `spin` first (the next
/// chunk of a live transfer usually follows within microseconds, and a
/// sleeping thread takes tens of microseconds to wake), then blocks.
/// `None` once the sending side is gone.
fn next_job<T>(jobs: &Mutex<Receiver<T>>, spin: Duration) -> Option<T> {
    use std::sync::mpsc::TryRecvError;
    if !spin.is_zero() {
        let until = Instant::now() + spin;
        loop {
            match jobs.locked().try_recv() {
                Ok(j) => return Some(j),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) if Instant::now() >= until => break,
                Err(TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
    }
    jobs.locked().recv().ok()
}

fn copy_worker(
    jobs: Arc<Mutex<Receiver<CopyJob>>>,
    done: Sender<WorkerReport>,
    copier: Arc<dyn CopyEngine>,
    waker: crate::control::Waker,
    targets: Arc<ScatterTargets>,
    spin: Duration,
    // Failpoint delays of gathers and scatters (zero normally).
    (gather_delay, scatter_delay): (Duration, Duration),
) {
    let failed = |direction, panic: String| crate::copy::CopyError {
        direction,
        reason: format!("the copy engine panicked: {panic}"),
        quiesced: false,
    };
    loop {
        let Some(job) = next_job(&jobs, spin) else {
            return; // the reactor is gone
        };
        let delay = match job.id {
            CopyId::Gather(_) => gather_delay,
            CopyId::Scatter(_) => scatter_delay,
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let started = Instant::now();
        let queued = started.duration_since(job.queued_at);
        // Launched here, polled by the reactor: this worker only fills the
        // table and launches (the host's share of a large copy).
        let launched = if job.launch {
            crate::boundary::catch(|| copier.try_launch(job.direction, job.span, &job.runs))
                .unwrap_or_else(|panic| Some(Err(failed(job.direction, panic))))
        } else {
            None
        };
        let report = match launched {
            Some(Ok(copy)) => WorkerReport::Launched(Launched {
                id: job.id,
                copy,
                in_use: job.in_use,
                queued,
                started,
            }),
            // Refused or failed to launch, or (None) no context free or an
            // engine that cannot launch: copied here, blocking.
            launched => {
                let result = match launched {
                    Some(Err(e)) => Err(e),
                    _ => crate::boundary::catch(|| copier.copy(job.direction, job.span, &job.runs))
                        .unwrap_or_else(|panic| Err(failed(job.direction, panic))),
                };
                // A copy that failed without quiescing may still touch the
                // memory: keep it marked (deregistration then reports it)
                // rather than lie.
                if result.as_ref().map_or_else(|e| e.quiesced, |_| true) {
                    targets.release(job.in_use);
                }
                WorkerReport::Done(CopyDone {
                    id: job.id,
                    result,
                    queued,
                    ran: started.elapsed(),
                })
            }
        };
        if done.send(report).is_err() {
            return;
        }
        waker();
    }
}

/// Makes this thread's timed waits end when asked: its polling pauses
/// (the writer's 20 us, the notification channel's 10 us) would otherwise
/// be stretched by Linux's default timer slack of 50 us, to 60-70 us.
/// Threads it spawns later inherit the setting.
pub(crate) fn precise_timers() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes one integer (nanoseconds) and changes
    // only the calling thread's timer slack; nothing is read or written
    // through a pointer.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong);
    }
}

struct PeerState {
    arena: PeerArena,
    /// From the peer's handshake (the application loaded its metadata),
    /// not from a data path one of its READs described: a READ never
    /// replaces it.
    known: bool,
    /// Its handshake says it answers the control channel's heartbeats.
    heartbeats: bool,
}

/// Which copy launches [`Reactor::execute_actions`] carries out when
/// `copy_launches_last` holds them back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Launches {
    /// Every pending action (shutdown: every launch is answered).
    All,
    /// Every other action and at most one launch (the run loop's pass).
    One,
    /// Every other action only (after reading a message or a command).
    None,
}

struct Reactor {
    name: String,
    endpoint: Endpoint,
    channel: Box<dyn ControlChannel>,
    writer: ChunkWriter,
    /// The steps' timeline, when asked for (`NIXL_BOUNCE_TRACE`).
    trace: Option<Trace>,
    /// Scratch for the writes' outcomes, reused from turn to turn.
    write_outcomes: Vec<WriteOutcome>,
    arena: RegionSpan,
    busy_poll: Duration,
    notify: Notify,
    load_data_path: DataPathLoader,
    unload_data_path: DataPathUnloader,
    /// The data-path description each reader's arena was loaded from.
    data_paths: HashMap<PeerId, Vec<u8>>,
    failpoints: crate::failpoint::Failpoints,
    shared: Arc<Shared>,
    targets: Arc<ScatterTargets>,
    start: Instant,
    jobs: Option<Sender<CopyJob>>,
    done: Receiver<WorkerReport>,
    /// Copies handed to workers or launched here, not yet finished.
    copies_in_flight: usize,
    /// For copies launched on this thread (see `start_copy`).
    copier: Arc<dyn CopyEngine>,
    /// Copies launched on this thread, polled by `drain_copies`.
    launched: Vec<Launched>,
    /// Whether gathers / scatters may be launched without blocking (not
    /// while a failpoint delays them: the delay belongs on a worker).
    launch_here: [bool; 2],
    /// Which of those the IO thread launches itself.
    copy_launches: IoThreadUse,
    /// Chunk writes posted or handed to the writer thread: chunk, peer,
    /// bytes, when.
    writes: Vec<(ChunkRef, PeerId, u64, Instant)>,
    /// Peers we send data to (from their handshake).
    peers: HashMap<PeerId, PeerState>,
    /// Control-channel handles by peer.
    handles: HashMap<PeerId, PeerHandle>,
    /// Peers the control channel reports unreachable, and when it was last
    /// asked.
    unreachable: HashSet<PeerId>,
    liveness_checked: Instant,
    tickets: HashMap<RequestId, (Arc<Ticket>, Option<DeferredNotif>, Instant)>,
    /// For the control round-trip timers: requests still waiting for their
    /// first GRANT, and DATA messages waiting for their ACK.
    awaiting_grant: HashMap<RequestId, Instant>,
    awaiting_ack: HashMap<(RequestId, u32), Instant>,
    workers: Vec<JoinHandle<()>>,
}

impl Reactor {
    fn now(&self) -> Time {
        Time::from_nanos(self.start.elapsed().as_nanos() as u64)
    }

    /// Records a step in the timeline, if one is kept.
    fn trace(&mut self, step: Step, request: RequestId, chunk: Option<u32>) {
        if let Some(t) = &mut self.trace {
            t.record(step, request, chunk);
        }
    }

    /// Records a step of one of this side's chunks, if a timeline is kept:
    /// a chunk of a served READ under the reader's request id, which its
    /// messages carry, so that both sides of a READ line up too.
    fn trace_chunk(&mut self, step: Step, chunk: ChunkRef) {
        if let Some(t) = &mut self.trace {
            let id = self.endpoint.serves_read(chunk.request);
            t.record(step, id.unwrap_or(chunk.request), Some(chunk.chunk));
        }
    }

    /// Records a control message sent or received (`send`), if a timeline
    /// is kept.
    fn trace_message(&mut self, send: bool, bytes: &[u8]) {
        if let Some(t) = &mut self.trace {
            if let Some((ty, request, chunk)) = crate::proto::wire::peek(bytes) {
                t.record(
                    if send { Step::Send(ty) } else { Step::Recv(ty) },
                    request,
                    chunk,
                );
            }
        }
    }

    /// The IO thread. A panic in it (a bug) must not end in a freed arena
    /// under running copies and writes, nor in requests that never end:
    /// the arena is then poisoned (so it is leaked, not freed, and new
    /// transfers take UCX) and every live request fails.
    fn run(mut self) {
        precise_timers();
        let outcome = crate::boundary::catch(|| self.run_loop())
            .and_then(|()| crate::boundary::catch(|| self.shutdown()));
        if let Err(what) = outcome {
            self.mark_poisoned(format!("the IO thread panicked: {what}"));
            self.leak_launched();
            for (_, (ticket, _, _)) in self.tickets.drain() {
                ticket.finish(Err(FailureReason::Poisoned));
            }
        }
    }

    fn run_loop(&mut self) {
        let mut last_event = Instant::now();
        while !self.shared.stop.load(Ordering::SeqCst) {
            let mut progressed = self.drain_commands();
            progressed |= self.drain_copies();
            progressed |= self.poll_writes();
            // Copy launches left for after what this pass reads.
            progressed |= self.endpoint.has_actions();
            // Copy workers and the writer thread wake the channel when they
            // finish something, so the reactor only waits. While transfers
            // are live it polls for `busy_poll` after the last event first:
            // the next message or completion usually comes within
            // microseconds, and waking a sleeping thread costs tens.
            // Copies launched here are polled (their events) without
            // sleeping: they end within microseconds to a few hundred. So
            // are writes posted here, paced by `ChunkWriter::pause`.
            let write_pause = self.writer.pause();
            let spinning = !progressed
                && (!self.launched.is_empty()
                    || write_pause.is_some()
                    || (self.live() && last_event.elapsed() < self.busy_poll));
            let wait = if progressed || spinning {
                Duration::ZERO
            } else {
                let until_timer = self.endpoint.poll_timeout().map(|t| t.since(self.now()));
                until_timer.map_or(IDLE_WAIT, |d| d.min(IDLE_WAIT))
            };
            if self.receive(wait) || progressed {
                last_event = Instant::now();
            } else if spinning {
                match write_pause {
                    Some(p) if !p.is_zero() && self.launched.is_empty() => std::thread::sleep(p),
                    _ => std::thread::yield_now(),
                }
            }
            self.check_liveness();
            self.fire_timers();
            self.execute_actions(Launches::One);
        }
    }

    /// Whether anything is in flight (requests, flows, copies, writes).
    fn live(&self) -> bool {
        self.endpoint.request_count() > 0
            || self.endpoint.flow_count() > 0
            || self.copies_in_flight > 0
            || !self.writes.is_empty()
    }

    /// Peers the control channel reports unreachable: their requests
    /// (also those submitted during the outage) fail and their flows are
    /// aborted, instead of waiting for timeouts.
    fn check_liveness(&mut self) {
        if self.liveness_checked.elapsed() < LIVENESS_CHECK_EVERY {
            return;
        }
        self.liveness_checked = Instant::now();
        let down = self.channel.unreachable_peers();
        let peers: Vec<PeerId> = self
            .handles
            .iter()
            .filter(|(_, h)| down.contains(h))
            .map(|(p, _)| p.clone())
            .collect();
        self.unreachable.retain(|p| peers.contains(p));
        for peer in peers {
            if self.unreachable.insert(peer.clone()) {
                self.shared
                    .counters
                    .peers_unreachable
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(agent = %self.name, %peer, "peer unreachable: failing its requests, aborting its flows");
            }
            let now = self.now();
            self.endpoint.peer_unreachable(now, &peer);
        }
    }

    fn drain_commands(&mut self) -> bool {
        let cmds = std::mem::take(&mut *self.shared.commands.locked());
        let any = !cmds.is_empty();
        for c in cmds {
            let now = self.now();
            match c {
                Command::Submit {
                    read,
                    peer,
                    plan,
                    ticket,
                    notif,
                    deadline,
                } => {
                    let bytes = match self.trace {
                        Some(_) => plan.chunks.iter().map(|c| c.bytes).sum(),
                        None => 0,
                    };
                    let submitted = if read {
                        self.endpoint.submit_read_plan(now, &peer, plan, deadline)
                    } else {
                        self.endpoint.submit_plan(now, &peer, plan, deadline)
                    };
                    match submitted {
                        Ok(id) => {
                            if let Some(t) = &mut self.trace {
                                t.submitted(id, bytes);
                            }
                            *ticket.request.locked() = Some(id);
                            let now = Instant::now();
                            self.tickets.insert(id, (ticket, notif, now));
                            if !read {
                                // READs are granted by this side.
                                self.awaiting_grant.insert(id, now);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(agent = %self.name, "bounce submission refused: {e}");
                            ticket.finish(Err(FailureReason::Rejected));
                        }
                    }
                }
                Command::Cancel { ticket } => {
                    if let Some(id) = *ticket.request.locked() {
                        self.endpoint.cancel(now, id);
                    }
                }
                Command::AddPeer {
                    peer,
                    arena,
                    key,
                    heartbeats,
                    data_path,
                } => {
                    self.endpoint.set_peer_key(&peer, key);
                    self.endpoint.set_peer_data_path(&peer, data_path);
                    self.peers.insert(
                        peer.clone(),
                        PeerState {
                            arena,
                            known: true,
                            heartbeats,
                        },
                    );
                    if let Some(h) = self.handles.get(&peer).copied() {
                        self.watch_if_it_answers(&peer, h);
                    }
                }
                Command::ForgetPeer { peer } => self.forget_peer(&peer),
            }
            self.execute_actions(Launches::None);
        }
        any
    }

    fn forget_peer(&mut self, peer: &PeerId) {
        // A peer added again later is new: its outages count and log anew.
        self.unreachable.remove(peer);
        // Tell the peer its flows here are over (it may be alive: a local
        // invalidation), so its requests fail now, not at their timeout.
        let now = self.now();
        self.endpoint.release_peer(now, peer);
        self.execute_actions(Launches::None);
        // Tear the data path down first: no write to the peer may still run.
        let deadline = Instant::now() + QUIESCE_BOUND;
        while self.writes.iter().any(|w| &w.1 == peer) && Instant::now() < deadline {
            if !self.poll_writes() {
                // Held away from `recv`: the other peers must still hear us.
                self.channel.keep_alive();
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let now = self.now();
        let stuck: Vec<ChunkRef> = self
            .writes
            .iter()
            .filter(|w| &w.1 == peer)
            .map(|w| w.0)
            .collect();
        for chunk in stuck {
            tracing::error!(agent = %self.name, %peer, %chunk, "write to a forgotten peer never finished");
            self.endpoint.handle_write_stuck(now, chunk);
        }
        self.writes.retain(|w| &w.1 != peer);
        self.peers.remove(peer);
        self.unload_data_path(peer);
        if let Some(h) = self.handles.remove(peer) {
            self.channel.remove_peer(h);
        }
        self.endpoint.forget_peer(now, peer);
    }

    /// Gives up the data path `peer`'s READs described, if one was loaded
    /// (no write may go through it any more).
    fn unload_data_path(&mut self, peer: &PeerId) {
        if let Some(dp) = self.data_paths.remove(peer) {
            if let Err(e) = (self.unload_data_path)(&dp) {
                tracing::warn!(agent = %self.name, %peer, "giving up the reader's data path: {e}");
            }
        }
    }

    /// The endpoint's [`Action::ForgetPeer`]: `peer` is unreachable, the
    /// application never loaded it, and nothing of it is left (no serve
    /// writes to it). Its control socket, the data path its READs
    /// described and its entries here go; a later READ from it starts
    /// afresh.
    fn forget_unreachable(&mut self, peer: &PeerId) {
        // The endpoint decided this before any other event; checked again
        // here, fail-closed.
        let loaded = self.peers.get(peer).is_some_and(|p| p.known);
        let writing = self.writes.iter().any(|w| &w.1 == peer);
        if loaded || writing || self.endpoint.holds_peer(peer) {
            tracing::error!(agent = %self.name, %peer, loaded, writing, "not forgetting a peer still in use");
            return;
        }
        self.unreachable.remove(peer);
        self.peers.remove(peer);
        self.unload_data_path(peer);
        if let Some(h) = self.handles.remove(peer) {
            self.channel.remove_peer(h);
        }
        let now = self.now();
        self.endpoint.forget_peer(now, peer);
        self.shared
            .counters
            .peers_forgotten
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(agent = %self.name, %peer, "forgot an unreachable peer the application never loaded");
    }

    fn drain_copies(&mut self) -> bool {
        let mut any = false;
        while let Ok(report) = self.done.try_recv() {
            any = true;
            match report {
                WorkerReport::Done(done) => self.copy_finished(done),
                WorkerReport::Launched(l) => self.launched.push(l),
            }
        }
        // A poll queries the copy's event; only after an error does it
        // synchronise the stream (to learn whether the copy is quiet), and
        // a stream whose context reported an error returns at once. A copy
        // that never ends keeps answering "running": its request still fails
        // at its timeout, its regions stay held (never reused), and shutdown
        // poisons and leaks the arena after its quiescence bound (as for a
        // worker blocked on such a copy).
        let mut i = 0;
        while i < self.launched.len() {
            let Some(result) = self.launched[i].copy.poll() else {
                i += 1;
                continue;
            };
            any = true;
            let l = self.launched.swap_remove(i);
            self.launched_copy_ended(l.id, l.in_use, l.queued, l.started, result);
        }
        any
    }

    /// A copy launched here ended (or failed to launch). As on a worker: a
    /// copy that failed without quiescing may still touch the memory, so
    /// its range stays marked.
    fn launched_copy_ended(
        &mut self,
        id: CopyId,
        in_use: InUse,
        queued: Duration,
        started: Instant,
        result: Result<(), crate::copy::CopyError>,
    ) {
        if result.as_ref().map_or_else(|e| e.quiesced, |_| true) {
            self.targets.release(in_use);
        }
        self.copy_finished(CopyDone {
            id,
            result,
            queued,
            ran: started.elapsed(),
        });
    }

    fn copy_finished(&mut self, done: CopyDone) {
        self.copies_in_flight -= 1;
        match done.id {
            CopyId::Gather(chunk) => self.trace_chunk(Step::GatherDone, chunk),
            CopyId::Scatter(region) => {
                if let Some(t) = &mut self.trace {
                    t.scatter_done(region);
                }
            }
        }
        let now = self.now();
        let c = &self.shared.counters;
        c.copy_queue_ns
            .fetch_add(done.queued.as_nanos() as u64, Ordering::Relaxed);
        match done.id {
            CopyId::Gather(_) => c
                .gather_ns
                .fetch_add(done.ran.as_nanos() as u64, Ordering::Relaxed),
            CopyId::Scatter(_) => c
                .scatter_ns
                .fetch_add(done.ran.as_nanos() as u64, Ordering::Relaxed),
        };
        match (done.id, done.result) {
            (CopyId::Gather(chunk), Ok(())) => self.endpoint.handle_gather_done(now, chunk),
            (CopyId::Gather(chunk), Err(e)) => {
                c.copy_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(agent = %self.name, %chunk, "gather failed: {e}");
                self.endpoint.handle_gather_failed(now, chunk, e.quiesced);
            }
            (CopyId::Scatter(region), Ok(())) => {
                c.chunks_scattered.fetch_add(1, Ordering::Relaxed);
                self.endpoint.handle_scatter_done(now, region);
            }
            (CopyId::Scatter(region), Err(e)) => {
                c.copy_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(agent = %self.name, %region, "scatter failed: {e}");
                self.endpoint.handle_scatter_failed(now, region, e.quiesced);
            }
        }
    }

    /// Takes the writer thread's outcomes.
    fn poll_writes(&mut self) -> bool {
        let mut any = false;
        let mut outcomes = std::mem::take(&mut self.write_outcomes);
        self.writer.poll(&mut outcomes);
        for outcome in outcomes.drain(..) {
            any = true;
            let (chunk, failure) = match outcome {
                WriteOutcome::Done(c) => (c, None),
                WriteOutcome::Failed(c, e) => (c, Some(e)),
            };
            let Some(i) = self.writes.iter().position(|w| w.0 == chunk) else {
                continue; // reported stuck already (a forgotten peer)
            };
            let (_, _, len, posted) = self.writes.swap_remove(i);
            self.trace_chunk(Step::WriteDone, chunk);
            let c = &self.shared.counters;
            c.write_ns
                .fetch_add(posted.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let now = self.now();
            match failure {
                None => {
                    c.chunks_written.fetch_add(1, Ordering::Relaxed);
                    c.bytes_written.fetch_add(len, Ordering::Relaxed);
                    self.endpoint.handle_write_done(now, chunk);
                }
                Some(e) => {
                    c.write_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(agent = %self.name, %chunk, "{e}");
                    self.endpoint.handle_write_failed(now, chunk);
                }
            }
        }
        self.write_outcomes = outcomes;
        any
    }

    fn receive(&mut self, wait: Duration) -> bool {
        let mut any = false;
        let mut wait = wait;
        // Take everything that is ready, blocking at most once.
        loop {
            match self.channel.recv(wait) {
                Ok(Some(incoming)) => {
                    any = true;
                    wait = Duration::ZERO;
                    // Commands queued before this message arrived apply
                    // first: forgetting a peer, then loading it again, must
                    // not forget the flow its next WANT opens.
                    self.drain_commands();
                    let Some(from) = incoming.from.as_str().map(PeerId::new) else {
                        tracing::warn!(agent = %self.name, "control message from a non-UTF-8 endpoint dropped");
                        continue;
                    };
                    self.time_round_trip(&incoming.payload);
                    self.trace_message(false, &incoming.payload);
                    let now = self.now();
                    if self
                        .endpoint
                        .handle_control(now, &from, &incoming.payload)
                        .is_err()
                    {
                        self.shared
                            .counters
                            .malformed_messages
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    self.execute_actions(Launches::None);
                }
                Ok(None) => return any,
                Err(e) => {
                    tracing::warn!(agent = %self.name, "control channel receive failed: {e}");
                    return any;
                }
            }
        }
    }

    /// Feeds the GRANT and ACK round-trip timers from an incoming message.
    fn time_round_trip(&mut self, payload: &[u8]) {
        let c = &self.shared.counters;
        match crate::proto::wire::peek(payload) {
            Some((ty, request, _)) if ty == MessageType::Grant as u8 => {
                if let Some(t) = self.awaiting_grant.remove(&request) {
                    c.grant_wait_ns
                        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
            }
            Some((ty, request, Some(chunk))) if ty == MessageType::Ack as u8 => {
                if let Some(t) = self.awaiting_ack.remove(&(request, chunk)) {
                    c.ack_wait_ns
                        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
            }
            _ => {}
        }
    }

    fn fire_timers(&mut self) {
        let now = self.now();
        if self.endpoint.poll_timeout().is_some_and(|t| t <= now) {
            self.endpoint.handle_timeout(now);
        }
    }

    /// Keeps `peer`'s channel handle, watched if it answers heartbeats.
    fn register_handle(&mut self, peer: PeerId, h: PeerHandle) {
        self.watch_if_it_answers(&peer, h);
        self.handles.insert(peer, h);
    }

    /// A peer whose handshake says it answers heartbeats is watched from
    /// now on (its handshake or its handle may come first).
    fn watch_if_it_answers(&mut self, peer: &PeerId, h: PeerHandle) {
        if self.peers.get(peer).is_some_and(|p| p.heartbeats) {
            self.channel.watch_liveness(h);
        }
    }

    fn handle(&mut self, peer: &PeerId) -> Option<PeerHandle> {
        if let Some(h) = self.handles.get(peer) {
            return Some(*h);
        }
        match self.channel.add_peer(&ControlEndpoint::from(peer.as_str())) {
            Ok(h) => {
                self.register_handle(peer.clone(), h);
                Some(h)
            }
            Err(e) => {
                tracing::warn!(agent = %self.name, %peer, "cannot reach peer's control endpoint: {e}");
                None
            }
        }
    }

    /// Carries out the endpoint's pending actions, copy launches as `launches`
    /// says when `copy_launches_last` holds them back (otherwise every
    /// action, in order).
    fn execute_actions(&mut self, launches: Launches) {
        let held_back = self.endpoint.config().launches_last;
        let mut launched = false;
        loop {
            let action = match launches {
                // At most one copy launch per pass of the run loop, once
                // everything else is done: it then reads what arrived (a
                // GRANT, a finished gather) before the next launch, and the
                // endpoint hands the actions that follow from it out before
                // the remaining launches.
                Launches::One if held_back && launched => self.endpoint.poll_action_not_launch(),
                // Reading a message or a command: no launch, the run loop's
                // own pass launches.
                Launches::None if held_back => self.endpoint.poll_action_not_launch(),
                _ => self.endpoint.poll_action(),
            };
            let Some(action) = action else { break };
            let now = self.now();
            launched |= matches!(
                action,
                Action::StartGather { .. } | Action::StartScatter { .. }
            );
            self.execute(now, action);
        }
        self.publish_stats();
    }

    /// Carries out one of the endpoint's actions.
    fn execute(&mut self, now: Time, action: Action) {
        match action {
            Action::Connect { peer, endpoint } => {
                // The endpoint a WANT carries (for notification channels
                // it includes the peer's metadata) registers the reverse
                // path for `peer`, the name the channel gives the sender.
                match self
                    .channel
                    .add_peer(&ControlEndpoint::from_bytes(endpoint))
                {
                    Ok(h) => self.register_handle(peer, h),
                    Err(e) => {
                        tracing::warn!(agent = %self.name, %peer, "peer's advertised endpoint is unusable ({e}); forgetting it");
                        self.endpoint.forget_peer(now, &peer);
                    }
                }
            }
            Action::Send { peer, message } => {
                let withheld = matches!(message, crate::proto::wire::Message::Grant { .. })
                    && self.failpoints.is_set("withhold_grant");
                if withheld || self.failpoints.is_set("drop_control") {
                    self.shared
                        .counters
                        .control_send_drops
                        .fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let bytes = message.encode();
                self.trace_message(true, &bytes);
                if let Message::Data { request, chunk, .. } = &message {
                    self.awaiting_ack.insert((*request, *chunk), Instant::now());
                }
                if let Some(h) = self.handle(&peer) {
                    if let Err(e) = self.channel.send(h, &bytes) {
                        self.shared
                            .counters
                            .control_send_drops
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(agent = %self.name, %peer, kind = ?message.message_type(), "control message dropped: {e}");
                    }
                }
            }
            Action::StartGather {
                chunk,
                region,
                runs,
            } => {
                self.trace_chunk(Step::GatherStart, chunk);
                if self.failpoints.is_set("panic_in_io_thread") {
                    panic!("failpoint panic_in_io_thread");
                }
                let in_use = match self.targets.admit_gather(&runs) {
                    Ok(t) => t,
                    Err(why) => {
                        tracing::error!(agent = %self.name, %chunk, "gather refused: {why}");
                        self.endpoint.handle_gather_failed(now, chunk, true);
                        return;
                    }
                };
                self.start_copy(
                    CopyId::Gather(chunk),
                    Direction::Gather,
                    region,
                    runs,
                    in_use,
                );
            }
            Action::StartScatter {
                flow,
                chunk,
                region,
                runs,
            } => {
                if let Some(t) = &mut self.trace {
                    t.scatter_started(region, flow.request, chunk);
                }
                let in_use = match self.targets.admit_scatter(&runs) {
                    Ok(t) => t,
                    Err(why) => {
                        self.shared
                            .counters
                            .scatter_refused
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::error!(agent = %self.name, %flow, chunk, "DATA refused: {why}");
                        self.endpoint.handle_scatter_failed(now, region, true);
                        return;
                    }
                };
                self.start_copy(
                    CopyId::Scatter(region),
                    Direction::Scatter,
                    region,
                    runs,
                    in_use,
                );
            }
            Action::PostWrite {
                chunk,
                peer,
                local,
                remote,
                len,
            } => {
                self.trace_chunk(Step::WritePost, chunk);
                // Counted from before the post, wherever it is posted.
                let posting = Instant::now();
                let posted = match self.peers.get(&peer) {
                    _ if self.failpoints.is_set("fail_chunk_writes") => {
                        Err("failpoint fail_chunk_writes".to_string())
                    }
                    // Accepted, never posted, never ending: a hung transport.
                    Some(_) if self.failpoints.is_set("stuck_chunk_writes") => Ok(()),
                    Some(p) => {
                        let job = WriteJob {
                            chunk,
                            arena: p.arena.clone(),
                            local: local.0,
                            remote: remote.0,
                            len,
                        };
                        self.writer.post(job)
                    }
                    None => Err(format!("no data path to peer {peer}")),
                };
                match posted {
                    Ok(()) => self.writes.push((chunk, peer, len, posting)),
                    Err(e) => {
                        self.shared
                            .counters
                            .write_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::error!(agent = %self.name, %chunk, "{e}");
                        self.endpoint.handle_write_failed(now, chunk);
                    }
                }
            }
            Action::LoadDataPath { peer, data_path } => {
                // A peer whose handshake we loaded is written where its
                // handshake says: a READ cannot aim our writes elsewhere.
                let known = self.peers.get(&peer).is_some_and(|p| p.known);
                if !known && self.data_paths.get(&peer) != Some(&data_path) {
                    match (self.load_data_path)(&data_path) {
                        Ok(arena) => {
                            self.peers.insert(
                                peer.clone(),
                                PeerState {
                                    arena,
                                    known: false,
                                    heartbeats: false,
                                },
                            );
                            // The endpoint takes another data path only
                            // once nothing writes through the previous
                            // one; loaded first, given up second, so an
                            // agent both name stays loaded.
                            if let Some(old) = self.data_paths.insert(peer.clone(), data_path) {
                                if let Err(e) = (self.unload_data_path)(&old) {
                                    tracing::warn!(agent = %self.name, %peer, "giving up the reader's previous data path: {e}");
                                }
                            }
                        }
                        Err(e) => {
                            tracing::warn!(agent = %self.name, %peer, "cannot write into the reader's arena ({e}); its READ fails");
                        }
                    }
                }
            }
            Action::ForgetPeer { peer } => self.forget_unreachable(&peer),
            Action::Complete { request, outcome } => self.complete(request, outcome),
            Action::Poisoned { cause } => self.mark_poisoned(cause),
        }
    }

    /// The endpoint's counters and the arena's use, for the engine's stats.
    fn publish_stats(&mut self) {
        let s = self.endpoint.stats();
        let c = &self.shared.counters;
        c.grants.store(s.grants, Ordering::Relaxed);
        c.late_data.store(s.late_data, Ordering::Relaxed);
        c.unauthorized.store(s.unauthorized, Ordering::Relaxed);
        c.reads_served.store(s.reads_served, Ordering::Relaxed);
        c.reads_refused.store(s.reads_refused, Ordering::Relaxed);
        let held = self.endpoint.arena_usage();
        c.arena.set(ArenaBytes {
            free: self.endpoint.arena_free(),
            reserve: held.reserve,
            flows: held.flows,
            local: held.local,
            orphan: held.orphan,
            quarantine: held.quarantine,
        });
        c.control_peers
            .store(self.handles.len() as u64, Ordering::Relaxed);
        c.control_pings_sent
            .store(self.channel.pings_sent(), Ordering::Relaxed);
        c.reader_data_paths
            .store(self.data_paths.len() as u64, Ordering::Relaxed);
    }

    /// Gives up on the copies launched here without waiting for them
    /// (dropping one synchronises its stream, which may never return when
    /// the device is stuck): the arena is poisoned and leaked, so nothing
    /// reuses what they may still touch, and their source ranges stay
    /// marked in use.
    fn leak_launched(&mut self) {
        for l in self.launched.drain(..) {
            std::mem::forget(l);
        }
        // Copies a worker launched and handed back, not yet taken: dropping
        // one would synchronise its stream, which may never finish.
        while let Ok(report) = self.done.try_recv() {
            if let WorkerReport::Launched(l) = report {
                std::mem::forget(l);
            }
        }
    }

    /// Records that the arena is poisoned (for this engine's stats and the
    /// process-wide report), with an error log saying why; the first cause
    /// is the one kept.
    fn mark_poisoned(&self, cause: String) {
        self.shared.poison(&self.name, cause);
    }

    fn start_copy(
        &mut self,
        id: CopyId,
        direction: Direction,
        region: RegionHandle,
        runs: Runs,
        in_use: InUse,
    ) {
        let offset = region.0 as usize;
        let span = RegionSpan {
            addr: self.arena.addr + offset,
            len: self.arena.len.saturating_sub(offset),
        };
        // Copies go on the GPU from here when the engine can launch without
        // blocking (the CUDA engine: completion is seen by polling the
        // copy's event): no hand-off to a worker and back, which costs two
        // thread wake-ups per copy. The host engine's memcpy blocks, so it
        // stays on the workers.
        // `copy_launches` may send the launch to a copy worker under load
        // (another copy running) or always: the worker fills the table and
        // launches, then hands the copy back to be polled here.
        let here = match self.copy_launches {
            IoThreadUse::Always => true,
            IoThreadUse::Never => false,
            IoThreadUse::WhenIdle => self.copies_in_flight == 0,
        };
        let launchable = self.launch_here[direction as usize];
        if launchable && here {
            let started = Instant::now();
            if let Some(launched) = self.copier.try_launch(direction, span, &runs) {
                self.copies_in_flight += 1;
                match launched {
                    Ok(copy) => self.launched.push(Launched {
                        id,
                        copy,
                        in_use,
                        queued: Duration::ZERO,
                        started,
                    }),
                    // Refused or failed to launch: it ends here.
                    Err(e) => self.launched_copy_ended(id, in_use, Duration::ZERO, started, Err(e)),
                }
                return;
            }
            // Not now (or not this engine): a worker takes it.
        }
        let job = CopyJob {
            id,
            // With `copy_launches=io_thread` a worker only takes what the IO
            // thread could not launch (no context free): it copies, blocking.
            launch: launchable && self.copy_launches != IoThreadUse::Always,
            queued_at: Instant::now(),
            in_use,
            direction,
            span,
            runs,
        };
        let sent = match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        let sent = match sent {
            Ok(()) => true,
            Err(job) => {
                self.targets.release(job.in_use);
                false
            }
        };
        if sent {
            self.copies_in_flight += 1;
        } else {
            let now = self.now();
            match id {
                CopyId::Gather(chunk) => self.endpoint.handle_gather_failed(now, chunk, true),
                CopyId::Scatter(region) => self.endpoint.handle_scatter_failed(now, region, true),
            }
        }
    }

    fn complete(&mut self, request: RequestId, outcome: Outcome) {
        self.trace(Step::Complete, request, None);
        self.awaiting_grant.remove(&request);
        self.awaiting_ack.retain(|k, _| k.0 != request);
        let Some((ticket, notif, submitted)) = self.tickets.remove(&request) else {
            return;
        };
        self.shared
            .counters
            .request_ns
            .fetch_add(submitted.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let c = &self.shared.counters;
        let result = match outcome {
            Outcome::Success => match notif {
                // The data is scattered (every chunk was ACKed after its
                // scatter), so the notification now means "the data is there".
                Some(n) => (self.notify)(&n.inner_agent, &n.message).map_err(|e| {
                    tracing::error!(agent = %self.name, "transfer done but its notification failed: {e}");
                    FailureReason::Rejected
                }),
                None => Ok(()),
            },
            Outcome::Failure(reason) => {
                match reason {
                    FailureReason::Timeout => {
                        c.timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    FailureReason::DeadlineExceeded => {
                        c.deadlines.fetch_add(1, Ordering::Relaxed);
                    }
                    FailureReason::Cancelled => {
                        c.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                tracing::warn!(agent = %self.name, %request, ?reason, "bounce transfer failed");
                Err(reason)
            }
        };
        if result.is_ok() {
            c.succeeded.fetch_add(1, Ordering::Relaxed);
        } else {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
        ticket.finish(result);
    }

    /// Fails everything live, waits (bounded) for operations already
    /// handed out, then stops the copy workers.
    fn shutdown(&mut self) {
        let now = self.now();
        self.endpoint.shutdown(now);
        self.execute_actions(Launches::All);
        let deadline = Instant::now() + QUIESCE_BOUND;
        while (self.copies_in_flight > 0 || !self.writes.is_empty()) && Instant::now() < deadline {
            let progressed = self.drain_copies() | self.poll_writes();
            self.execute_actions(Launches::All);
            if !progressed {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if self.copies_in_flight > 0 || !self.writes.is_empty() {
            self.mark_poisoned(format!(
                "shutdown with {} copies and {} chunk writes still running after {QUIESCE_BOUND:?}",
                self.copies_in_flight,
                self.writes.len()
            ));
            self.leak_launched();
        }
        for (_, (ticket, _, _)) in self.tickets.drain() {
            ticket.finish(Err(FailureReason::Shutdown));
        }
        self.jobs = None; // closes the job queue: workers exit
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        // What a worker launched after the last drain was never polled.
        self.leak_launched();
        self.writer.close();
    }
}
