//! The reactor: the one thread that owns the endpoint, the control channel
//! and the data plane, and carries out every action the endpoint emits.

use super::workers::{CopyDone, CopyId, CopyJob, CopyWork, Launched, WorkerReport};
use super::*;

/// Makes this thread's timed waits end when asked: its polling pauses
/// (tens of microseconds) would otherwise be stretched by Linux's default
/// timer slack of 50 us.
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

pub(super) struct PeerState {
    pub(super) arena: PeerArena,
    /// From the peer's handshake (the application loaded its metadata),
    /// not from a data path one of its READs described: a READ never
    /// replaces it.
    pub(super) known: bool,
    /// Its handshake says it answers the control channel's heartbeats.
    pub(super) heartbeats: bool,
}

/// The most copies launched as one (`launch_held`).
const MAX_COPIES_TOGETHER: usize = 1 << 16;

/// Which copy launches [`Reactor::execute_actions`] carries out when
/// `copy_launches_last` holds them back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Launches {
    /// Every pending action (shutdown: every launch is answered).
    All,
    /// Every other action and at most one launch (the run loop's pass).
    One,
    /// Every other action only (after reading a message or a command).
    None,
}

pub(super) struct Reactor {
    pub(super) name: String,
    pub(super) endpoint: Endpoint,
    pub(super) channel: Box<dyn ControlChannel>,
    pub(super) writer: ChunkWriter,
    /// The steps' timeline, when asked for (`NIXL_BOUNCE_TRACE`).
    pub(super) trace: Option<Trace>,
    /// Scratch for the writes' outcomes, reused from turn to turn.
    pub(super) write_outcomes: Vec<WriteOutcome>,
    pub(super) arena: RegionSpan,
    pub(super) busy_poll: Duration,
    /// The longest pass of `receive_all` (zero: until no message is ready).
    pub(super) receive_pass: Duration,
    pub(super) notify: Notify,
    pub(super) load_data_path: DataPathLoader,
    pub(super) unload_data_path: DataPathUnloader,
    /// The data-path description each reader's arena was loaded from.
    pub(super) data_paths: HashMap<PeerId, Vec<u8>>,
    pub(super) failpoints: crate::failpoint::Failpoints,
    pub(super) shared: Arc<Shared>,
    pub(super) targets: Arc<ScatterTargets>,
    pub(super) start: Instant,
    pub(super) jobs: Option<Sender<CopyJob>>,
    pub(super) done: Receiver<WorkerReport>,
    /// Copies handed to workers or launched here, not yet finished.
    pub(super) copies_in_flight: usize,
    /// For copies launched on this thread (see `start_copy`).
    pub(super) copier: Arc<dyn CopyEngine>,
    /// Copies launched on this thread, polled by `drain_copies`.
    pub(super) launched: Vec<Launched>,
    /// Whether gathers / scatters may be launched without blocking (not
    /// while a failpoint delays them: the delay belongs on a worker).
    pub(super) launch_here: [bool; 2],
    /// Which of those the IO thread launches itself.
    pub(super) copy_launches: IoThreadUse,
    /// Copies the IO thread launches in one pass go as one launch per
    /// direction where the engine can (`group_copy_launches`).
    pub(super) group_copy_launches: bool,
    /// Launches held until the end of the pass (see `group_copy_launches`).
    pub(super) held: Vec<CopyWork>,
    /// Set while a loop reads messages or commands: launches are held
    /// until it ends, so that a burst of them goes as one.
    pub(super) holding: bool,
    /// Chunk writes posted or handed to the writer thread: chunk, peer,
    /// bytes, when.
    pub(super) writes: Vec<(ChunkRef, PeerId, u64, Instant)>,
    /// Peers we send data to (from their handshake).
    pub(super) peers: HashMap<PeerId, PeerState>,
    /// Control-channel handles by peer.
    pub(super) handles: HashMap<PeerId, PeerHandle>,
    /// Peers the control channel reports unreachable, and when it was last
    /// asked.
    pub(super) unreachable: HashSet<PeerId>,
    pub(super) liveness_checked: Instant,
    pub(super) tickets: HashMap<RequestId, (Arc<Ticket>, Option<DeferredNotif>, Instant)>,
    /// For the control round-trip timers: requests still waiting for their
    /// first GRANT, and DATA messages waiting for their ACK.
    pub(super) awaiting_grant: HashMap<RequestId, Instant>,
    pub(super) awaiting_ack: HashMap<(RequestId, u32), Instant>,
    /// Requests the engine withdrew ([`super::Runtime::withdraw`]): their
    /// end is not a failed transfer.
    pub(super) withdrawn: HashSet<RequestId>,
    pub(super) workers: Vec<JoinHandle<()>>,
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

    /// Records that a gather or scatter launched, or (`done`) was seen
    /// finished, if a timeline is kept.
    fn trace_copy(&mut self, id: CopyId, done: bool) {
        match id {
            CopyId::Gather(chunk) => {
                let step = if done {
                    Step::GatherDone
                } else {
                    Step::GatherLaunched
                };
                self.trace_chunk(step, chunk);
            }
            CopyId::Scatter(region) => {
                if let Some(t) = &mut self.trace {
                    t.scatter_step(region, done);
                }
            }
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
    pub(super) fn run(mut self) {
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
        if any {
            // Nested in `receive`, whose own end launches what is held.
            let outer = std::mem::replace(&mut self.holding, true);
            self.run_commands(cmds);
            self.holding = outer;
            if !outer && !self.held.is_empty() {
                self.execute_actions(Launches::None);
            }
        }
        any
    }

    fn run_commands(&mut self, cmds: Vec<Command>) {
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
                    queued_ns,
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
                    self.submitted(submitted, read, ticket, notif, bytes, queued_ns);
                }
                Command::Announce {
                    peer,
                    sizes,
                    ticket,
                    queued_ns,
                } => {
                    let bytes = sizes.iter().sum();
                    self.shared
                        .counters
                        .announced
                        .fetch_add(1, Ordering::Relaxed);
                    let submitted = self.endpoint.submit_sized(now, &peer, &sizes);
                    self.submitted(submitted, false, ticket, None, bytes, queued_ns);
                }
                Command::ChunkReady { ticket, c, chunk } => {
                    let id = *ticket.request.locked();
                    if id.is_some_and(|id| self.endpoint.chunk_ready(now, id, c, chunk)) {
                        self.shared
                            .counters
                            .chunks_ahead
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                Command::Planned {
                    ticket,
                    plan,
                    notif,
                    deadline,
                } => {
                    // Nothing to do for a request that was refused, or has
                    // ended (it failed, and its ticket says so).
                    let Some(id) = *ticket.request.locked() else {
                        continue;
                    };
                    if let Some(entry) = self.tickets.get_mut(&id) {
                        entry.1 = notif;
                    }
                    self.endpoint.plan_ready(now, id, plan, deadline);
                }
                Command::Cancel { ticket, withdrawn } => {
                    if let Some(id) = *ticket.request.locked() {
                        if withdrawn && self.tickets.contains_key(&id) {
                            self.withdrawn.insert(id);
                        }
                        if !self.endpoint.cancel(now, id) {
                            // It had failed already (while its preparation
                            // ran): a failure, not a withdrawal.
                            self.withdrawn.remove(&id);
                        }
                    }
                }
                Command::AddPeer {
                    peer,
                    arena,
                    key,
                    heartbeats,
                    standing,
                    data_path,
                } => {
                    self.endpoint.set_peer_key(&peer, key);
                    if standing {
                        self.endpoint.set_peer_standing(&peer);
                    }
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
    }

    fn forget_peer(&mut self, peer: &PeerId) {
        // What is held for other peers runs while this one's writes drain.
        if !self.held.is_empty() {
            self.launch_held();
        }
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
            for (id, in_use) in l.together {
                self.launched_copy_ended(id, in_use, l.queued, l.started, result.clone());
            }
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
        self.trace_copy(done.id, true);
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
        let outer = std::mem::replace(&mut self.holding, true);
        let any = self.receive_all(wait);
        self.holding = outer;
        if !outer && !self.held.is_empty() {
            self.execute_actions(Launches::None);
        }
        any
    }

    /// Reads every message that is ready, waiting at most `wait` for the
    /// first, for at most `receive_pass` from the first read on: the
    /// copies the messages started are held until the pass ends (one
    /// launch for a burst), and nothing launched or written is polled
    /// during it, so a stream of messages that never lets up (a large
    /// request's DATAs, each read more slowly than they are sent) must not
    /// hold them all until its last message. What is left is read in the
    /// loop's next pass, after those launches and polls.
    fn receive_all(&mut self, wait: Duration) -> bool {
        let mut any = false;
        let mut wait = wait;
        let mut first_read: Option<Instant> = None;
        // Take everything that is ready, blocking at most once.
        loop {
            if let Some(t) = first_read {
                if !self.receive_pass.is_zero() && t.elapsed() >= self.receive_pass {
                    return any;
                }
            }
            match self.channel.recv(wait) {
                Ok(Some(incoming)) => {
                    any = true;
                    wait = Duration::ZERO;
                    first_read.get_or_insert_with(Instant::now);
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
    /// action, in order). The copies held for grouping (`launch_held`) are
    /// launched at the end, unless a loop reading a batch of input holds
    /// them until its own end (`holding`).
    fn execute_actions(&mut self, launches: Launches) {
        let held_back = self.endpoint.config().launches_last;
        let mut launched = false;
        loop {
            self.execute_pending(launches, held_back, &mut launched);
            if self.holding || self.held.is_empty() {
                break;
            }
            // A launch that fails gives the endpoint more to do.
            self.launch_held();
        }
        self.publish_stats();
    }

    fn execute_pending(&mut self, launches: Launches, held_back: bool, launched: &mut bool) {
        loop {
            let action = match launches {
                // At most one copy launch per pass of the run loop, once
                // everything else is done: it then reads what arrived (a
                // GRANT, a finished gather) before the next launch, and the
                // endpoint hands the actions that follow from it out before
                // the remaining launches.
                Launches::One if held_back && *launched => self.endpoint.poll_action_not_launch(),
                // Reading a message or a command: no launch, the run loop's
                // own pass launches.
                Launches::None if held_back => self.endpoint.poll_action_not_launch(),
                _ => self.endpoint.poll_action(),
            };
            let Some(action) = action else { break };
            let now = self.now();
            *launched |= matches!(
                action,
                Action::StartGather { .. } | Action::StartScatter { .. }
            );
            self.execute(now, action);
        }
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
                        Err(PostError::Failpoint("fail_chunk_writes"))
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
                    None => Err(PostError::NoDataPath(peer.clone())),
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
        c.standing_offered
            .store(s.standing_offered, Ordering::Relaxed);
        c.standing_claimed
            .store(s.standing_claimed, Ordering::Relaxed);
        c.standing_taken.store(s.standing_taken, Ordering::Relaxed);
        let held = self.endpoint.arena_usage();
        c.arena.set(ArenaBytes {
            free: self.endpoint.arena_free(),
            reserve: held.reserve,
            flows: held.flows,
            local: held.local,
            orphan: held.orphan,
            quarantine: held.quarantine,
            standing: held.standing,
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
        let copy = CopyWork {
            id,
            direction,
            span: RegionSpan {
                addr: self.arena.addr + offset,
                len: self.arena.len.saturating_sub(offset),
            },
            runs,
            in_use,
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
            // Held copies count: under load they go to the workers.
            IoThreadUse::WhenIdle => self.copies_in_flight == 0 && self.held.is_empty(),
        };
        let launchable = self.launch_here[direction as usize];
        if launchable && here {
            // Launched with the pass's others at its end (`launch_held`)
            // while a copy of its direction runs or waits there; else at
            // once (as Nagle's rule sends a segment while nothing is
            // unacknowledged): a burst's first copy does not wait for the
            // others' checks and their group's table, and the rest are
            // grouped while it runs.
            if self.group_copy_launches && self.copies_under_way(direction) {
                self.held.push(copy);
                return;
            }
            return self.launch_now_or_hand_over(copy);
        }
        self.hand_to_worker(copy, launchable)
    }

    /// Whether a copy of `direction` is held for launch or launched on
    /// this thread and not yet seen done. Copies on the workers do not
    /// count: one is there only when no execution context was free, and
    /// then a launch here would go to a worker too.
    fn copies_under_way(&self, direction: Direction) -> bool {
        self.held.iter().any(|c| c.direction == direction)
            || self.launched.iter().any(|l| l.id.direction() == direction)
    }

    /// Launches a copy here, or, when the engine cannot now (no context
    /// free, or an engine that copies on workers), hands it to a worker.
    fn launch_now_or_hand_over(&mut self, copy: CopyWork) {
        if let Err(copy) = self.launch_now(copy) {
            self.hand_to_worker(copy, true);
        }
    }

    /// Launches the copies held in this pass: those of one direction
    /// together where the engine can (one table, launch and event for a
    /// burst of chunks), else one by one.
    fn launch_held(&mut self) {
        let held = std::mem::take(&mut self.held);
        let (gathers, scatters): (Vec<_>, Vec<_>) = held
            .into_iter()
            .partition(|c| c.direction == Direction::Gather);
        for mut copies in [gathers, scatters] {
            // Groups of at most MAX_COPIES_TOGETHER copies (a 1 MiB pair
            // table), so that a long burst neither waits for its last
            // message nor grows the tables without bound.
            while !copies.is_empty() {
                let mut total = 0usize;
                let take = copies
                    .iter()
                    .take_while(|c| {
                        total += c.runs.copies().map_or(1, |c| c.addrs().len());
                        total <= MAX_COPIES_TOGETHER
                    })
                    .count()
                    .max(1);
                let rest = copies.split_off(take);
                let group = match self.launch_together(copies) {
                    Ok(()) => Vec::new(),
                    Err(group) => group,
                };
                for copy in group {
                    self.launch_now_or_hand_over(copy);
                }
                copies = rest;
            }
        }
    }

    /// Launches `group` (copies of one direction) as one copy; gives it
    /// back when the engine does not take it so.
    fn launch_together(&mut self, group: Vec<CopyWork>) -> Result<(), Vec<CopyWork>> {
        let Some(direction) = group
            .first()
            .map(|c| c.direction)
            .filter(|_| group.len() > 1)
        else {
            return Err(group);
        };
        let started = Instant::now();
        let lists: Vec<(RegionSpan, &Runs)> = group.iter().map(|c| (c.span, &c.runs)).collect();
        let Some(launched) = self.copier.try_launch_together(direction, &lists) else {
            return Err(group);
        };
        self.shared
            .counters
            .copies_launched_together
            .fetch_add(group.len() as u64, Ordering::Relaxed);
        self.track_launch(group, started, launched);
        Ok(())
    }

    /// Launches one copy here; gives it back when the engine cannot now
    /// (no context free, or an engine that copies on workers).
    fn launch_now(&mut self, copy: CopyWork) -> Result<(), CopyWork> {
        let started = Instant::now();
        let Some(launched) = self
            .copier
            .try_launch(copy.direction, copy.span, &copy.runs)
        else {
            return Err(copy);
        };
        self.track_launch(vec![copy], started, launched);
        Ok(())
    }

    /// Polls `launched`, the one copy of `copies` (one or more) launched
    /// here at `started`; when it was refused or failed to launch, every
    /// one of them ends here with that error.
    fn track_launch(
        &mut self,
        copies: Vec<CopyWork>,
        started: Instant,
        launched: Result<Box<dyn crate::copy::LaunchedCopy>, crate::copy::CopyError>,
    ) {
        self.copies_in_flight += copies.len();
        if self.trace.is_some() && launched.is_ok() {
            for c in &copies {
                self.trace_copy(c.id, false);
            }
        }
        let mut members = copies.into_iter().map(|c| (c.id, c.in_use));
        let (id, in_use) = members.next().expect("a launch copies at least one");
        match launched {
            Ok(copy) => self.launched.push(Launched {
                id,
                copy,
                in_use,
                together: members.collect(),
                queued: Duration::ZERO,
                started,
            }),
            Err(e) => {
                for (id, in_use) in members {
                    self.launched_copy_ended(id, in_use, Duration::ZERO, started, Err(e.clone()));
                }
                self.launched_copy_ended(id, in_use, Duration::ZERO, started, Err(e));
            }
        }
    }

    /// Queues a copy for the copy workers (`launch`: a worker may launch it
    /// and hand it back to be polled here).
    fn hand_to_worker(&mut self, copy: CopyWork, launchable: bool) {
        let id = copy.id;
        let job = CopyJob {
            work: copy,
            // With `copy_launches=io_thread` a worker only takes what the IO
            // thread could not launch (no context free): it copies, blocking.
            launch: launchable && self.copy_launches != IoThreadUse::Always,
            queued_at: Instant::now(),
        };
        let sent = match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        let sent = match sent {
            Ok(()) => true,
            Err(job) => {
                self.targets.release(job.work.in_use);
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

    /// Keeps the ticket of a request the endpoint took (`submitted`), or
    /// fails it.
    fn submitted(
        &mut self,
        submitted: Result<RequestId, SubmitError>,
        read: bool,
        ticket: Arc<Ticket>,
        notif: Option<DeferredNotif>,
        bytes: u64,
        queued_ns: u64,
    ) {
        match submitted {
            Ok(id) => {
                if let Some(t) = &mut self.trace {
                    t.submitted(id, bytes, queued_ns);
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

    fn complete(&mut self, request: RequestId, outcome: Outcome) {
        self.trace(Step::Complete, request, None);
        self.awaiting_grant.remove(&request);
        self.awaiting_ack.retain(|k, _| k.0 != request);
        let Some((ticket, notif, submitted)) = self.tickets.remove(&request) else {
            return;
        };
        if self.withdrawn.remove(&request) {
            // The engine's own: no transfer failed.
            self.shared
                .counters
                .withdrawn
                .fetch_add(1, Ordering::Relaxed);
            ticket.finish(match outcome {
                Outcome::Success => Ok(()),
                Outcome::Failure(reason) => Err(reason),
            });
            return;
        }
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
