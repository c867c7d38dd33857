//! The READ direction.
//!
//! A READ is a WRITE with the roles of the two agents swapped: the reader
//! plans the transfer (owner sources -> its own destinations), sends the
//! owner the gather side of the plan in one READ message, and grants itself
//! credits in its own arena for the flow, exactly as it grants a peer's
//! WRITE flow (one credit scheduler, one round-robin ring, the same
//! fairness). The owner validates every source range, then serves the READ
//! with its ordinary sender machinery (gather, write into the granted
//! region, READ_DATA); the reader scatters each chunk by its own plan and
//! answers READ_ACK. The reader's request completes when every chunk is
//! scattered.
//!
//! ```text
//! reader                                    owner
//!   READ(request, key, data path, chunks) -->  validate sources (else READ_END(SourceRefused))
//!   READ_GRANT(credits)                   -->  gather -> write into the reader's region
//!                                         <--  READ_DATA(chunk, region)
//!   scatter by own plan, READ_ACK         -->
//!   ... every chunk scattered: Complete(Success)
//! ```
//!
//! Ending early mirrors WRITE's CANCEL/REFUSE pair with the roles swapped:
//! - the reader gives up (cancel, timeout, deadline, scatter failure,
//!   poison, shutdown): its flow's regions are quarantined (the owner may
//!   still write) and READ_REFUSE tells the owner, which fails its serving
//!   request and answers READ_END once none of its writes can land; READ_END
//!   frees the quarantine;
//! - the owner gives up (refused sources, gather or write failure, its own
//!   timeout, poison, shutdown): it sends READ_END once none of its writes
//!   can land; the reader fails the request and reclaims the flow at once.
//!
//! This module holds the reader's side (its requests); the owner's side is
//! a [`super::sender`] request whose messages take the READ types.
//!
//! The reader never trusts the owner with its memory: READ_DATA carries no
//! runs, the reader scatters by the plan it made itself (the destinations
//! are still checked against registered memory by the runtime).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::endpoint::{due_failure, expiry, Action, Ctx, FailureReason, Outcome, SubmitError};
use super::plan::Plan;
use super::wire::{
    Message, ReadChunk, RefuseReason, HEADER_LEN, MAX_MESSAGE_BYTES, MAX_MESSAGE_RUNS,
};
use super::{FlowId, PeerId, RegionHandle, RequestId, Run, Runs, Time};

/// The data owner's check of the source ranges a READ asks for: `Ok` only
/// when every copy of every run reads memory the owner registered with
/// BOUNCE and exports to `reader`. The one question the protocol core asks
/// of its environment; it must answer from the registrations alone.
pub trait SourceCheck: Send {
    /// Whether `reader` may read every copy of `runs` (`addr` = source).
    fn check(&self, reader: &PeerId, runs: &[Run]) -> Result<(), String>;
}

/// How a failed READ leaves its flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The reader gives up while the owner may still write: quarantine the
    /// flow and send READ_REFUSE (the owner's READ_END frees it).
    Refuse,
    /// The owner sent READ_END: none of its writes can land any more.
    OwnerEnded,
    /// The owner is forgotten: `forget_peer` reclaims the flow.
    PeerGone,
}

#[derive(Debug)]
struct Read {
    peer: PeerId,
    plan: Arc<Plan>,
    acked: usize,
    /// Scatters of this read still running.
    scatters: u32,
    last_progress: Time,
    deadline: Option<Time>,
    failed: Option<FailureReason>,
    completed: bool,
}

impl Read {
    fn active(&self) -> bool {
        self.failed.is_none()
    }
}

/// The reader's requests.
#[derive(Debug, Default)]
pub(crate) struct Reads {
    reads: BTreeMap<RequestId, Read>,
    /// Regions being scattered for a read, and which.
    scattering: BTreeMap<RegionHandle, RequestId>,
    /// How the owner writes into this agent's arena (sent in every READ).
    pub data_path: Vec<u8>,
    /// The data path sent instead to owners that read only an older form.
    pub peer_data_paths: BTreeMap<PeerId, Vec<u8>>,
}

/// The READ_REFUSE reason for a reader-side failure.
fn refuse_reason(reason: FailureReason) -> RefuseReason {
    match reason {
        FailureReason::Poisoned => RefuseReason::Poisoned,
        FailureReason::Shutdown => RefuseReason::ShuttingDown,
        FailureReason::ScatterFailed => RefuseReason::ScatterFailed,
        _ => RefuseReason::Cancelled,
    }
}

/// The reader's failure for an owner's READ_END reason.
fn end_failure(reason: RefuseReason) -> FailureReason {
    match reason {
        RefuseReason::SourceRefused => FailureReason::SourceRefused,
        RefuseReason::ProtocolViolation | RefuseReason::ChunkTooLarge => {
            FailureReason::ProtocolError
        }
        _ => FailureReason::Rejected,
    }
}

impl Reads {
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Plans a READ of `descriptors` (`src` = the owner's memory, `dst` =
    /// ours) from `peer` as request `id`: sends READ and registers the flow
    /// this agent will grant itself credits for.
    pub fn submit(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        id: RequestId,
        peer: &PeerId,
        plan: Arc<Plan>,
        deadline: Option<Duration>,
    ) -> Result<(), SubmitError> {
        let read = Message::Read {
            request: id,
            key: ctx.key_for(peer),
            endpoint: ctx.cfg.local_endpoint.clone(),
            data_path: self
                .peer_data_paths
                .get(peer)
                .unwrap_or(&self.data_path)
                .clone(),
            chunks: plan
                .chunks
                .iter()
                .map(|c| ReadChunk {
                    size: c.bytes,
                    runs: c.gather_runs.clone(),
                })
                .collect(),
        };
        // One message carries every chunk's source runs: it must fit the
        // control channel (a WRITE's DATA carries one chunk's).
        let bytes = HEADER_LEN + read.payload_len_hint();
        let entries = read.run_entries();
        if bytes > MAX_MESSAGE_BYTES || entries > MAX_MESSAGE_RUNS {
            return Err(SubmitError::ReadTooLarge {
                bytes,
                max: MAX_MESSAGE_BYTES,
                entries,
                max_entries: MAX_MESSAGE_RUNS,
            });
        }
        ctx.stats.submitted += 1;
        if plan.chunks.is_empty() {
            ctx.stats.succeeded += 1;
            ctx.actions.push_back(Action::Complete {
                request: id,
                outcome: Outcome::Success,
            });
            return Ok(());
        }
        let flow = FlowId::read(peer.clone(), id);
        if let Err(e) = ctx.sched.add_flow(now, flow, &plan.chunk_sizes()) {
            // The plan respects the local chunk cap: this cannot happen.
            tracing::error!(target: "nixl_bounce::proto", "READ {id} from {peer} cannot be scheduled: {e}");
            ctx.stats.failed += 1;
            ctx.actions.push_back(Action::Complete {
                request: id,
                outcome: Outcome::Failure(FailureReason::ProtocolError),
            });
            return Ok(());
        }
        // READ goes before the first READ_GRANT (the grant comes from the
        // scheduling pass after this call; actions are executed in order).
        ctx.send(peer, read);
        self.reads.insert(
            id,
            Read {
                peer: peer.clone(),
                plan,
                acked: 0,
                scatters: 0,
                last_progress: now,
                deadline: deadline.or(ctx.cfg.request_deadline).map(|d| now.after(d)),
                failed: None,
                completed: false,
            },
        );
        Ok(())
    }

    /// The scatter runs of chunk `chunk` of the live read `id` from `from`
    /// (`None`: not ours, not live, or no such chunk).
    pub fn scatter_runs(&self, from: &PeerId, id: RequestId, chunk: u32) -> Option<Runs> {
        let read = self.reads.get(&id)?;
        if read.peer != *from || !read.active() {
            return None;
        }
        Some(read.plan.chunks.get(chunk as usize)?.scatter_runs.clone())
    }

    /// A scatter of `region` for read `id` started.
    pub fn scatter_started(&mut self, now: Time, id: RequestId, region: RegionHandle) {
        if let Some(read) = self.reads.get_mut(&id) {
            read.scatters += 1;
            read.last_progress = now;
            self.scattering.insert(region, id);
        }
    }

    /// The scatter of `region` ended (`ok`: the bytes are in place). Does
    /// nothing for a region that no read scatters.
    pub fn scatter_ended(&mut self, ctx: &mut Ctx, now: Time, region: RegionHandle, ok: bool) {
        let Some(id) = self.scattering.remove(&region) else {
            return;
        };
        let Some(read) = self.reads.get_mut(&id) else {
            return;
        };
        read.scatters -= 1;
        if !read.active() {
            self.settle(ctx, id);
            return;
        }
        if !ok {
            // The receiver role already aborted the flow (READ_REFUSE sent,
            // regions quarantined).
            self.fail(ctx, id, FailureReason::ScatterFailed, Ending::Refuse);
            return;
        }
        read.acked += 1;
        read.last_progress = now;
        if read.acked == read.plan.chunks.len() {
            read.completed = true;
            ctx.stats.succeeded += 1;
            ctx.actions.push_back(Action::Complete {
                request: id,
                outcome: Outcome::Success,
            });
            self.reads.remove(&id);
        }
    }

    /// The owner stopped serving read `id` (READ_END): none of its writes
    /// can land any more, so the flow's regions are free (those being
    /// scattered once their scatter ends).
    pub fn on_end(&mut self, ctx: &mut Ctx, from: &PeerId, id: RequestId, reason: RefuseReason) {
        let live = self
            .reads
            .get(&id)
            .is_some_and(|r| r.peer == *from && r.active());
        if live {
            tracing::warn!(target: "nixl_bounce::proto", "{from} ended READ {id}: {reason:?}");
            self.fail(ctx, id, end_failure(reason), Ending::OwnerEnded);
        } else {
            let flow = FlowId::read(from.clone(), id);
            ctx.sched.reclaim_flow(&flow);
            ctx.sched.release_quarantine(&flow);
        }
    }

    /// Fails read `id` with `reason` if it is live. Returns whether it was.
    pub fn fail(
        &mut self,
        ctx: &mut Ctx,
        id: RequestId,
        reason: FailureReason,
        ending: Ending,
    ) -> bool {
        let Some(read) = self.reads.get_mut(&id) else {
            return false;
        };
        if !read.active() {
            return false;
        }
        read.failed = Some(reason);
        let flow = FlowId::read(read.peer.clone(), id);
        match ending {
            Ending::OwnerEnded => {
                ctx.sched.reclaim_flow(&flow);
                ctx.sched.release_quarantine(&flow);
            }
            Ending::PeerGone => {}
            Ending::Refuse => {
                // A flow the receiver role already aborted (expiry, scatter
                // failure) is gone and its READ_REFUSE already sent.
                if ctx.sched.has_flow(&flow) {
                    ctx.sched.quarantine_flow(&flow);
                    let peer = read.peer.clone();
                    ctx.send(
                        &peer,
                        Message::ReadRefuse {
                            request: id,
                            reason: refuse_reason(reason),
                        },
                    );
                }
            }
        }
        self.settle(ctx, id);
        true
    }

    /// After a failure: `Complete` once no scatter of the read still writes
    /// the destinations, then the record goes.
    fn settle(&mut self, ctx: &mut Ctx, id: RequestId) {
        let Some(read) = self.reads.get_mut(&id) else {
            return;
        };
        let Some(reason) = read.failed else {
            return;
        };
        if read.scatters > 0 {
            return;
        }
        if !read.completed {
            read.completed = true;
            ctx.stats.failed += 1;
            ctx.actions.push_back(Action::Complete {
                request: id,
                outcome: Outcome::Failure(reason),
            });
        }
        self.reads.remove(&id);
    }

    pub fn fail_all(&mut self, ctx: &mut Ctx, reason: FailureReason) {
        let ids: Vec<RequestId> = self.reads.keys().copied().collect();
        for id in ids {
            self.fail(ctx, id, reason, Ending::Refuse);
        }
    }

    /// Whether a read from `peer` is still tracked.
    pub fn has_peer(&self, peer: &PeerId) -> bool {
        self.reads.values().any(|r| r.peer == *peer)
    }

    /// Fails every read from `peer`.
    pub fn fail_peer(
        &mut self,
        ctx: &mut Ctx,
        peer: &PeerId,
        reason: FailureReason,
        ending: Ending,
    ) {
        let ids: Vec<RequestId> = self
            .reads
            .iter()
            .filter(|(_, r)| r.peer == *peer)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.fail(ctx, id, reason, ending);
        }
    }

    pub fn on_timeout(&mut self, ctx: &mut Ctx, now: Time) {
        let timeout = ctx.cfg.request_timeout;
        let due: Vec<(RequestId, FailureReason)> = self
            .reads
            .iter()
            .filter(|(_, r)| r.active())
            .filter_map(|(&id, r)| {
                due_failure(now, r.last_progress, r.deadline, timeout).map(|why| (id, why))
            })
            .collect();
        for (id, reason) in due {
            self.fail(ctx, id, reason, Ending::Refuse);
        }
    }

    pub fn next_timeout(&self, ctx: &Ctx) -> Option<Time> {
        self.reads
            .values()
            .filter(|r| r.active())
            .map(|r| expiry(r.last_progress, r.deadline, ctx.cfg.request_timeout))
            .min()
    }

    /// Every region a read scatters is held by that read's flow (scattering)
    /// or orphaned.
    pub fn check_invariants(&self, ctx: &Ctx) -> Result<(), String> {
        for (region, id) in &self.scattering {
            let read = self
                .reads
                .get(id)
                .ok_or_else(|| format!("scattering region {region} of an unknown read {id}"))?;
            match ctx.sched.owner(*region) {
                Some(super::credit::Owner::Flow(f))
                    if *f == FlowId::read(read.peer.clone(), *id) => {}
                Some(super::credit::Owner::Orphan) => {}
                other => {
                    return Err(format!(
                        "read {id} scatters {region}, which is owned by {other:?}"
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The owner's validation of a READ before anything is read: sizes within
/// the chunk cap, runs inside their chunk, and every source range admitted
/// by `check`. Returns the refusal reason and what was wrong.
pub(crate) fn validate_read(
    max_chunk: u64,
    reader: &PeerId,
    chunks: &[ReadChunk],
    check: Option<&dyn SourceCheck>,
) -> Result<(), (RefuseReason, String)> {
    for (i, c) in chunks.iter().enumerate() {
        if c.size == 0 || c.size > max_chunk {
            return Err((
                RefuseReason::ChunkTooLarge,
                format!("chunk {i} has {} bytes (must be 1..={max_chunk})", c.size),
            ));
        }
        super::receiver::validate_run_list(&c.runs, c.size)
            .map_err(|why| (RefuseReason::ProtocolViolation, format!("chunk {i}: {why}")))?;
    }
    let Some(check) = check else {
        return Err((
            RefuseReason::SourceRefused,
            "this agent exports no memory for READ".into(),
        ));
    };
    for (i, c) in chunks.iter().enumerate() {
        check
            .check(reader, &c.runs)
            .map_err(|why| (RefuseReason::SourceRefused, format!("chunk {i}: {why}")))?;
    }
    Ok(())
}

/// At most this many READs may have credits waiting for their READ message.
pub const MAX_EARLY_READS: usize = 1024;

/// The data owner's memory of READs it does not serve (yet, or any more).
///
/// Control messages may be reordered, so a READ_GRANT can overtake its
/// READ: its credits are held until the READ arrives (bounded in number and
/// time; past the request timeout the owner answers READ_END, freeing the
/// reader's regions). A READ that was refused, or abandoned by a READ_REFUSE
/// that overtook it, is remembered for a while so that a late READ is not
/// served.
#[derive(Debug, Default)]
pub(crate) struct OwnerBook {
    early: BTreeMap<(PeerId, RequestId), (Time, Vec<super::wire::Credit>)>,
    tombstones: BTreeMap<(PeerId, RequestId), Time>,
}

impl OwnerBook {
    pub fn is_tombstoned(&self, reader: &PeerId, request: RequestId) -> bool {
        self.tombstones.contains_key(&(reader.clone(), request))
    }

    /// Never serve `reader`'s READ `request` (for the tombstone lifetime).
    pub fn tombstone(&mut self, ctx: &Ctx, now: Time, reader: &PeerId, request: RequestId) {
        let key = (reader.clone(), request);
        self.early.remove(&key);
        self.tombstones
            .insert(key, now.after(ctx.cfg.tombstone_ttl));
    }

    /// The credits that arrived before the READ.
    pub fn take(&mut self, reader: &PeerId, request: RequestId) -> Vec<super::wire::Credit> {
        self.early
            .remove(&(reader.clone(), request))
            .map(|(_, c)| c)
            .unwrap_or_default()
    }

    /// Holds credits for a READ not seen yet. False when too many READs
    /// wait, or when this one would hold more credits than a READ has
    /// chunks (the caller answers READ_END).
    pub fn hold(
        &mut self,
        ctx: &Ctx,
        now: Time,
        reader: &PeerId,
        request: RequestId,
        credits: Vec<super::wire::Credit>,
    ) -> bool {
        let key = (reader.clone(), request);
        if !self.early.contains_key(&key) && self.early.len() >= MAX_EARLY_READS {
            return false;
        }
        let entry = self
            .early
            .entry(key)
            .or_insert_with(|| (now.after(ctx.cfg.request_timeout), Vec::new()));
        // A READ has at most MAX_READ_CHUNKS chunks, so no honest reader
        // holds more credits for one: refuse a peer that piles them up.
        if entry.1.len() + credits.len() > super::wire::MAX_READ_CHUNKS as usize {
            return false;
        }
        entry.1.extend(credits);
        true
    }

    /// Drops expired tombstones; returns the READs whose credits waited too
    /// long for their READ (now tombstoned: the caller answers READ_END).
    pub fn on_timeout(&mut self, ctx: &Ctx, now: Time) -> Vec<(PeerId, RequestId)> {
        self.tombstones.retain(|_, &mut until| until > now);
        let expired: Vec<(PeerId, RequestId)> = self
            .early
            .iter()
            .filter(|(_, (until, _))| *until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for (reader, request) in &expired {
            self.tombstone(ctx, now, reader, *request);
        }
        expired
    }

    pub fn next_timeout(&self) -> Option<Time> {
        let early = self.early.values().map(|(t, _)| *t).min();
        let tomb = self.tombstones.values().min().copied();
        [early, tomb].into_iter().flatten().min()
    }

    /// Forgets the credits `reader` sent ahead of its READs (it is gone).
    /// Its tombstones stay until they expire: a READ still on its way (the
    /// channel may reorder; a forgotten reader may come back) must not be
    /// served after its READ_REFUSE or after its serve ended, when the
    /// reader may have given its regions to another flow.
    pub fn forget(&mut self, reader: &PeerId) {
        self.early.retain(|(p, _), _| p != reader);
    }

    /// Whether credits of `reader` wait for their READ.
    pub fn holds(&self, reader: &PeerId) -> bool {
        self.early.keys().any(|(p, _)| p == reader)
    }

    /// READs with held credits.
    pub fn early_len(&self) -> usize {
        self.early.len()
    }
}
