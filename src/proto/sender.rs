//! The sender role: request and chunk lifecycle.
//!
//! Per chunk:
//!
//! ```text
//! Idle --eager acquire--> Gathering --gather done--> Gathered --credit--> Writing
//! Idle --credit, staging ok--> Gathering --gather done (credit held)--> Writing
//! Idle --credit, arena full--> Parked --staging ok--> Gathering
//! Writing --write done--> Written (DATA sent, staging released) --ACK--> Acked
//! Gathered (no credit) --a remote flow or parked credit waits--> Idle (evicted)
//! ```
//!
//! A request may be submitted by its chunks' sizes alone
//! ([`Sender::submit_sized`]): its WANT goes out at once, while the caller
//! still checks and packs the descriptors, so the GRANT's round trip runs
//! under that work. A chunk without its copies stays Idle (a credit that
//! comes is kept); [`Sender::on_chunk`] brings one chunk's copies as soon
//! as they are packed, and that chunk is gathered and written as any
//! other, but its DATA (which makes the receiver scatter into the
//! destination) is held (`Held`) until [`Sender::on_plan`] brings the whole
//! plan: every descriptor checked, so that a transfer refused by its check
//! moves no byte into its destination.
//!
//! A request succeeds when every chunk is acked. It fails (exactly once) on
//! timeout, deadline, cancel, peer loss, write or gather failure, refusal,
//! protocol error, poisoning or shutdown. After a failure the request stays
//! tracked as long as any of its operations still runs:
//! - its `Complete` is emitted once no gather reads its source memory;
//! - a staging region under a running gather or write is *orphaned*: freed
//!   only when that operation reports a terminal state;
//! - its CANCEL (empty WANT) is sent only once none of its writes can still
//!   land in the receiver's regions, so the receiver may reuse them at once.
//!
//! The same machinery serves READs on the data owner ([`Sender::serve`]): a
//! serving request is planned by the reader (its READ carries the chunks
//! and their gather runs), sends no WANT (the reader already has the flow),
//! and speaks the READ types: READ_DATA instead of DATA, READ_END (with a
//! reason) instead of CANCEL, and no `Complete` (nobody local waits for it).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use super::endpoint::{due_failure, expiry, Action, Ctx, FailureReason, Outcome, SubmitError};
use super::plan::{Chunk, Plan};
use super::wire::{Claim, Credit, Message, ReadChunk, RefuseReason, StandingUse};
use super::{ChunkRef, PeerId, RegionHandle, RequestId, Run, Runs, Time};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    Parked,
    Gathering(RegionHandle),
    Gathered(RegionHandle),
    Writing(RegionHandle),
    /// Written, its DATA held until the request's plan is whole.
    Held,
    Written,
    Acked,
    Abandoned,
}

#[derive(Clone, Debug)]
struct Slot {
    credit: Option<Credit>,
    stage: Stage,
    /// Whether the chunk's copies are known (always, once planned).
    ready: bool,
}

#[derive(Debug)]
struct Request {
    peer: PeerId,
    /// The reader's request id when this request serves a READ.
    serves: Option<RequestId>,
    plan: Arc<Plan>,
    /// Whether the whole plan is known, every descriptor checked; `false`
    /// while only the chunks' sizes, and the copies of those chunks that
    /// are `ready`, are ([`Sender::submit_sized`]): their DATA is held.
    planned: bool,
    slots: Vec<Slot>,
    acked: usize,
    last_progress: Time,
    deadline: Option<Time>,
    failed: Option<FailureReason>,
    completed: bool,
    cancel_pending: bool,
    /// A write may land at any time in the future: never send CANCEL.
    cancel_forbidden: bool,
    /// The standing offer its WANT claimed (chunk 0's region), named again
    /// by its CANCEL: a receiver that never saw the claim spends it then.
    claim: Option<Claim>,
    gathers: u32,
    writes: u32,
    /// Chunks holding a staging region (Gathering, Gathered, Writing).
    staged: u32,
    /// First chunk that may still be Idle.
    next_idle: usize,
}

impl Request {
    fn active(&self) -> bool {
        self.failed.is_none()
    }
}

/// The sender role's state.
#[derive(Debug)]
pub(crate) struct Sender {
    next_id: u64,
    requests: BTreeMap<RequestId, Request>,
    parked: VecDeque<ChunkRef>,
    /// Chunks eagerly gathered and still waiting for their credit (the only
    /// ones eviction has to look at).
    eager_ready: BTreeSet<ChunkRef>,
    /// Staging regions abandoned by stuck operations (never released).
    leaked: Vec<RegionHandle>,
    /// Requests serving READs, by (reader, reader's request id).
    served: BTreeMap<(PeerId, RequestId), RequestId>,
    /// The data path each reader's serves write through.
    reader_paths: BTreeMap<PeerId, Vec<u8>>,
    /// Serves removed since the endpoint last looked (see
    /// [`Sender::take_ended_serves`]).
    ended_serves: Vec<(PeerId, RequestId)>,
    /// The standing credit held from each receiver: one region its next
    /// request's first chunk may be written into at once.
    standing: BTreeMap<PeerId, Standing>,
    /// The largest token claimed from (or given back to) each receiver: an
    /// offer at or below it is one already used (a re-sent offer that
    /// crossed the claim or the give-back).
    /// Kept when the receiver is forgotten (a copy may arrive after it is
    /// loaded again); one entry a receiver ever sent to.
    claimed: BTreeMap<PeerId, u64>,
}

/// A standing credit: a receiver's offer of one region ([`Message::Standing`]).
#[derive(Clone, Copy, Debug)]
struct Standing {
    token: u64,
    region: RegionHandle,
    len: u64,
}

/// The READ_END reason for a failed serving request.
fn end_reason(reason: FailureReason) -> RefuseReason {
    match reason {
        FailureReason::Poisoned => RefuseReason::Poisoned,
        FailureReason::Shutdown => RefuseReason::ShuttingDown,
        FailureReason::Timeout => RefuseReason::Expired,
        FailureReason::Rejected | FailureReason::Cancelled => RefuseReason::Cancelled,
        _ => RefuseReason::SenderFailed,
    }
}

impl Sender {
    pub fn new(request_id_base: u64) -> Sender {
        Sender {
            next_id: request_id_base,
            requests: BTreeMap::new(),
            parked: VecDeque::new(),
            eager_ready: BTreeSet::new(),
            leaked: Vec::new(),
            served: BTreeMap::new(),
            reader_paths: BTreeMap::new(),
            ended_serves: Vec::new(),
            standing: BTreeMap::new(),
            claimed: BTreeMap::new(),
        }
    }

    /// A receiver offers a standing credit: kept if the receiver is one
    /// whose offers this agent takes and the offer is newer than any held
    /// or claimed from it.
    pub fn on_standing(
        &mut self,
        ctx: &mut Ctx,
        from: &PeerId,
        token: u64,
        region: RegionHandle,
        len: u64,
    ) {
        let stale = self.claimed.get(from).is_some_and(|&c| token <= c)
            || self.standing.get(from).is_some_and(|s| token <= s.token);
        if !ctx.standing_peers.contains(from) || stale {
            ctx.stats.ignored += 1;
            return;
        }
        self.standing
            .insert(from.clone(), Standing { token, region, len });
    }

    /// What a new request to `peer` whose first chunk has `first` bytes
    /// does with `peer`'s standing credit: claims it (taken here) if it
    /// fits, else says whether one is held.
    fn use_standing(&mut self, ctx: &Ctx, peer: &PeerId, first: u64) -> StandingUse {
        if !ctx.standing_peers.contains(peer) {
            return StandingUse::None;
        }
        match self.standing.get(peer) {
            Some(s) if first <= s.len => {
                let s = *s;
                self.standing.remove(peer);
                self.claimed.insert(peer.clone(), s.token);
                StandingUse::Claimed {
                    token: s.token,
                    region: s.region,
                }
            }
            Some(_) => StandingUse::Held,
            None => StandingUse::Wanted,
        }
    }

    /// Whether a READ from `reader` through `data_path` may be served: a
    /// reader's serves all write through one data path (one incarnation of
    /// its arena); another one is accepted only once none of them is live,
    /// so no write meant for one incarnation reaches another.
    pub fn accepts_path(&self, reader: &PeerId, data_path: &[u8]) -> bool {
        let live = self
            .served
            .range((reader.clone(), RequestId(0))..=(reader.clone(), RequestId(u64::MAX)))
            .next()
            .is_some();
        !live || !matches!(self.reader_paths.get(reader), Some(p) if p != data_path)
    }

    /// A fresh request id (also used for READs, which share the id space).
    pub fn next_id(&mut self) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    /// The local request serving `reader`'s READ `request`, if any.
    pub fn serving(&self, reader: &PeerId, request: RequestId) -> Option<RequestId> {
        self.served.get(&(reader.clone(), request)).copied()
    }

    /// The standing offer request `id` claimed, if any.
    pub fn claim_of(&self, id: RequestId) -> Option<Claim> {
        self.requests.get(&id)?.claim
    }

    /// The reader's request id if local request `id` serves a READ.
    pub fn serves(&self, id: RequestId) -> Option<RequestId> {
        self.requests.get(&id)?.serves
    }

    /// Starts serving `reader`'s validated READ `request`: gathers from the
    /// chunks' runs, writes into the regions the reader grants. Returns the
    /// local request id (`None`: already being served).
    pub fn serve(
        &mut self,
        now: Time,
        reader: &PeerId,
        request: RequestId,
        data_path: &[u8],
        chunks: Vec<ReadChunk>,
    ) -> Option<RequestId> {
        if self.served.contains_key(&(reader.clone(), request)) {
            return None;
        }
        let id = self.next_id();
        self.reader_paths.insert(reader.clone(), data_path.to_vec());
        let plan = Plan {
            payload_bytes: chunks
                .iter()
                .flat_map(|c| c.runs.iter())
                .filter_map(Run::total_bytes)
                .fold(0u64, u64::saturating_add),
            chunks: chunks
                .into_iter()
                .map(|c| Chunk {
                    bytes: c.size,
                    pieces: c
                        .runs
                        .iter()
                        .map(|r| r.count)
                        .fold(0u32, u32::saturating_add),
                    gather_runs: c.runs,
                    scatter_runs: Runs::default(),
                })
                .collect(),
            src_dev: 0,
            dst_dev: 0,
        };
        self.served.insert((reader.clone(), request), id);
        self.insert(id, reader, Some(request), Arc::new(plan), now, None);
        Some(id)
    }

    fn insert(
        &mut self,
        id: RequestId,
        peer: &PeerId,
        serves: Option<RequestId>,
        plan: Arc<Plan>,
        now: Time,
        deadline: Option<Time>,
    ) {
        let n = plan.chunks.len();
        self.requests.insert(
            id,
            Request {
                peer: peer.clone(),
                serves,
                plan,
                planned: true,
                slots: vec![
                    Slot {
                        credit: None,
                        stage: Stage::Idle,
                        ready: true,
                    };
                    n
                ],
                acked: 0,
                last_progress: now,
                deadline,
                failed: None,
                completed: false,
                cancel_pending: false,
                cancel_forbidden: false,
                claim: None,
                gathers: 0,
                writes: 0,
                staged: 0,
                next_idle: 0,
            },
        );
    }

    /// The message that retracts request `id` once none of its writes can
    /// land: CANCEL, or READ_END for a serving request.
    fn end_message(ctx: &Ctx, id: RequestId, req: &Request) -> Message {
        match req.serves {
            None => Message::Cancel {
                request: id,
                endpoint: ctx.cfg.local_endpoint.clone(),
                key: ctx.key_for(&req.peer),
                claim: req.claim,
                incarnation: req.claim.map_or(0, |_| ctx.cfg.incarnation),
            },
            Some(request) => Message::ReadEnd {
                request,
                reason: end_reason(req.failed.unwrap_or(FailureReason::Cancelled)),
            },
        }
    }

    /// Forgets request `id` (and its READ mapping).
    fn remove(&mut self, id: RequestId) {
        if let Some(req) = self.requests.remove(&id) {
            if let Some(r) = req.serves {
                self.served.remove(&(req.peer.clone(), r));
                self.ended_serves.push((req.peer, r));
            }
        }
    }

    /// Serves (reader, reader's request) that ended since the last call:
    /// the endpoint tombstones them, so a READ_GRANT still on its way is
    /// ignored instead of held as credits for a READ yet to come.
    pub fn take_ended_serves(&mut self) -> Vec<(PeerId, RequestId)> {
        std::mem::take(&mut self.ended_serves)
    }

    /// Whether credits wait for staging space.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether a request with `peer` is still tracked (a WRITE to it or a
    /// serve of its READ; live, or failed with operations still running).
    pub fn has_peer(&self, peer: &PeerId) -> bool {
        self.requests.values().any(|r| r.peer == *peer)
    }

    /// Whether the data path `peer`'s READs write through is recorded.
    pub fn knows_reader(&self, peer: &PeerId) -> bool {
        self.reader_paths.contains_key(peer)
    }

    /// Whether eagerly gathered chunks wait for their credit.
    pub fn has_eager_ready(&self) -> bool {
        !self.eager_ready.is_empty()
    }

    /// Every staging region referenced by a chunk (plus leaked ones).
    pub fn staged_regions(&self) -> Vec<RegionHandle> {
        let mut out = self.leaked.clone();
        for r in self.requests.values() {
            for s in &r.slots {
                if let Stage::Gathering(x) | Stage::Gathered(x) | Stage::Writing(x) = s.stage {
                    out.push(x);
                }
            }
        }
        out
    }

    pub fn submit(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        peer: &PeerId,
        plan: Arc<Plan>,
        deadline: Option<std::time::Duration>,
    ) -> Result<RequestId, SubmitError> {
        self.submit_as(ctx, now, peer, plan, true, deadline)
    }

    /// Submits a request known by its chunks' sizes alone (the WANT's
    /// content): the WANT goes out now, the chunks' copies come with
    /// [`Sender::on_plan`].
    pub fn submit_sized(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        peer: &PeerId,
        sizes: &[u64],
    ) -> Result<RequestId, SubmitError> {
        let plan = Plan::sized(sizes);
        self.submit_as(ctx, now, peer, Arc::new(plan), false, None)
    }

    fn submit_as(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        peer: &PeerId,
        plan: Arc<Plan>,
        planned: bool,
        deadline: Option<std::time::Duration>,
    ) -> Result<RequestId, SubmitError> {
        let id = self.next_id();
        ctx.stats.submitted += 1;
        if plan.chunks.is_empty() {
            ctx.stats.succeeded += 1;
            ctx.actions.push_back(Action::Complete {
                request: id,
                outcome: Outcome::Success,
            });
            return Ok(id);
        }
        let standing = self.use_standing(ctx, peer, plan.chunks[0].bytes);
        ctx.send(
            peer,
            Message::Want {
                request: id,
                chunk_sizes: plan.chunk_sizes(),
                endpoint: ctx.cfg.local_endpoint.clone(),
                key: ctx.key_for(peer),
                standing,
                incarnation: match standing {
                    StandingUse::None => 0,
                    _ => ctx.cfg.incarnation,
                },
            },
        );
        let deadline = deadline.or(ctx.cfg.request_deadline).map(|d| now.after(d));
        self.insert(id, peer, None, plan, now, deadline);
        if let Some(req) = self.requests.get_mut(&id) {
            req.planned = planned;
            for slot in &mut req.slots {
                slot.ready = planned;
            }
            // The claimed standing region is chunk 0's credit, there now.
            if let Some(claim @ Claim { region, .. }) = standing.claim() {
                ctx.stats.standing_claimed += 1;
                req.claim = Some(claim);
                req.slots[0].credit = Some(Credit {
                    chunk: 0,
                    region,
                    len: req.plan.chunks[0].bytes,
                });
                if planned {
                    Self::stage_credited(ctx, &mut self.parked, id, req, 0);
                }
            }
        }
        Ok(id)
    }

    /// Brings the copies of chunk `c` of request `id`, submitted by its
    /// sizes ([`Sender::submit_sized`]), ahead of its whole plan: the chunk
    /// is staged if credited, else left to the eager gather and its credit;
    /// once written, its DATA waits for [`Sender::on_plan`]. Returns whether
    /// they were taken: not when `id` is not waiting for its plan, when the
    /// chunk has its copies already, or when they are not the size the
    /// WANT carried, which fails the request (cancelled).
    pub fn on_chunk(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        id: RequestId,
        c: usize,
        chunk: Chunk,
    ) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if req.planned || !req.active() || req.slots.get(c).is_none_or(|s| s.ready) {
            return false;
        }
        if chunk.bytes != req.plan.chunks[c].bytes {
            tracing::warn!(target: "nixl_bounce::proto", "chunk {c} of {id} does not have the size its WANT carried; cancelled");
            self.fail(ctx, id, FailureReason::Cancelled);
            return false;
        }
        Arc::make_mut(&mut req.plan).chunks[c] = chunk;
        req.slots[c].ready = true;
        req.last_progress = now;
        if req.slots[c].credit.is_some() && req.slots[c].stage == Stage::Idle {
            Self::stage_credited(ctx, &mut self.parked, id, req, c);
        }
        true
    }

    /// Brings the whole plan of request `id`, submitted by its sizes
    /// ([`Sender::submit_sized`]), every descriptor checked: each credited
    /// chunk not staged yet is staged as its credit would have been, the
    /// others wait for theirs (or the eager gather), and the DATA of every
    /// chunk already written goes out. Returns whether it was taken: not
    /// when `id` is not waiting for its plan (unknown, ended, planned), nor
    /// when the plan's chunks are not the sizes its WANT carried (the
    /// receiver's regions were granted for those) or not the chunks
    /// brought ahead of it (which may be written already), which fails the
    /// request (cancelled).
    pub fn on_plan(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        id: RequestId,
        plan: Arc<Plan>,
        deadline: Option<std::time::Duration>,
    ) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if req.planned || !req.active() {
            return false;
        }
        // The sizes the WANT carried, and the chunks brought ahead (which
        // may be gathered and written already) as they are in the plan:
        // their DATA scatters by the plan's copies.
        let same = plan.chunks.len() == req.plan.chunks.len()
            && plan
                .chunks
                .iter()
                .zip(&req.plan.chunks)
                .zip(&req.slots)
                .all(|((a, b), slot)| {
                    a.bytes == b.bytes
                        && (!slot.ready
                            || (a.gather_runs.same(&b.gather_runs)
                                && a.scatter_runs.same(&b.scatter_runs)))
                });
        if !same {
            tracing::warn!(target: "nixl_bounce::proto", "the plan of {id} is not the chunks its WANT and the chunks brought ahead of it said; cancelled");
            self.fail(ctx, id, FailureReason::Cancelled);
            return false;
        }
        req.plan = plan;
        req.planned = true;
        req.last_progress = now;
        // Counted from the plan, as a submitted request's is from its
        // submission: the preparation before it is not the transfer's.
        req.deadline = deadline.or(ctx.cfg.request_deadline).map(|d| now.after(d));
        for c in 0..req.slots.len() {
            req.slots[c].ready = true;
            match req.slots[c].stage {
                Stage::Idle if req.slots[c].credit.is_some() => {
                    Self::stage_credited(ctx, &mut self.parked, id, req, c);
                }
                Stage::Held => Self::send_data(ctx, id, req, c),
                _ => {}
            }
        }
        true
    }

    fn start_gather(
        ctx: &mut Ctx,
        id: RequestId,
        req: &mut Request,
        chunk: usize,
        region: RegionHandle,
    ) {
        req.slots[chunk].stage = Stage::Gathering(region);
        req.gathers += 1;
        req.staged += 1;
        ctx.actions.push_back(Action::StartGather {
            chunk: ChunkRef {
                request: id,
                chunk: chunk as u32,
            },
            region,
            runs: req.plan.chunks[chunk].gather_runs.clone(),
        });
    }

    fn post_write(
        ctx: &mut Ctx,
        id: RequestId,
        req: &mut Request,
        chunk: usize,
        local: RegionHandle,
    ) {
        let Some(credit) = req.slots[chunk].credit else {
            return;
        };
        req.slots[chunk].stage = Stage::Writing(local);
        req.writes += 1;
        ctx.actions.push_back(Action::PostWrite {
            chunk: ChunkRef {
                request: id,
                chunk: chunk as u32,
            },
            peer: req.peer.clone(),
            local,
            remote: credit.region,
            len: req.plan.chunks[chunk].bytes,
        });
    }

    /// Eagerly stages the next idle chunks of live requests (no credit yet),
    /// at most W staged chunks per request, within the eager budget. Skipped
    /// while credits are parked: those need the memory more.
    pub fn eager_fill(&mut self, ctx: &mut Ctx) {
        if !ctx.cfg.eager_gather
            || !self.parked.is_empty()
            || ctx.poisoned.is_some()
            || ctx.shut_down
        {
            return;
        }
        let window = ctx.cfg.window;
        for (&id, req) in self.requests.iter_mut() {
            if !req.active() {
                continue;
            }
            while req.staged < window {
                while req.next_idle < req.slots.len()
                    && req.slots[req.next_idle].stage != Stage::Idle
                {
                    req.next_idle += 1;
                }
                let c = req.next_idle;
                // In order: a chunk without its copies yet stops it.
                if c >= req.slots.len() || !req.slots[c].ready {
                    break;
                }
                let Some(region) = ctx.sched.acquire_local(req.plan.chunks[c].bytes, true) else {
                    return;
                };
                Self::start_gather(ctx, id, req, c, region);
            }
        }
    }

    /// Stages parked credits in arrival order while the arena allows.
    pub fn retry_parked(&mut self, ctx: &mut Ctx) {
        while let Some(&cref) = self.parked.front() {
            let Some(req) = self.requests.get_mut(&cref.request) else {
                self.parked.pop_front();
                continue;
            };
            let c = cref.chunk as usize;
            if !req.active() || req.slots.get(c).map(|s| s.stage) != Some(Stage::Parked) {
                self.parked.pop_front();
                continue;
            }
            let Some(region) = ctx.sched.acquire_local(req.plan.chunks[c].bytes, false) else {
                return;
            };
            self.parked.pop_front();
            Self::start_gather(ctx, cref.request, req, c, region);
        }
    }

    pub fn on_grant(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        id: RequestId,
        credits: &[Credit],
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            // Unknown (finished long ago or never ours): retract the flow so
            // the receiver frees the regions at once.
            ctx.stats.ignored += 1;
            ctx.send(
                from,
                Message::cancel(id, ctx.cfg.local_endpoint.clone(), ctx.key_for(from)),
            );
            return;
        };
        if req.peer != *from {
            ctx.stats.ignored += 1;
            tracing::warn!(target: "nixl_bounce::proto", "GRANT for {id} from {from}, but the request goes to {}", req.peer);
            return;
        }
        if !req.active() {
            ctx.stats.ignored += 1;
            if !req.cancel_pending && !req.cancel_forbidden && req.writes == 0 {
                let msg = Self::end_message(ctx, id, req);
                ctx.send(from, msg);
            }
            return;
        }
        let mut bad = false;
        for credit in credits {
            let c = credit.chunk as usize;
            let valid = req
                .slots
                .get(c)
                .is_some_and(|s| s.credit.is_none() && credit.len >= req.plan.chunks[c].bytes);
            if !valid {
                tracing::warn!(target: "nixl_bounce::proto", "impossible credit {credit:?} for {id} from {from}");
                bad = true;
                break;
            }
            req.slots[c].credit = Some(*credit);
            req.last_progress = now;
            match req.slots[c].stage {
                // Without its copies yet, the chunk keeps its credit until
                // `on_plan`.
                Stage::Idle if req.slots[c].ready => {
                    Self::stage_credited(ctx, &mut self.parked, id, req, c);
                }
                Stage::Gathering(region) => {
                    let _ = ctx.sched.promote_local(region);
                }
                Stage::Gathered(region) => {
                    self.eager_ready.remove(&ChunkRef {
                        request: id,
                        chunk: credit.chunk,
                    });
                    let _ = ctx.sched.promote_local(region);
                    Self::post_write(ctx, id, req, c, region);
                }
                _ => {}
            }
        }
        if bad {
            self.fail(ctx, id, FailureReason::ProtocolError);
        }
    }

    /// Stages idle chunk `c` of request `id`, which has its credit and its
    /// copies: gathered at once where the arena has room, else parked
    /// behind the credits parked before it (never overtaking them).
    fn stage_credited(
        ctx: &mut Ctx,
        parked: &mut VecDeque<ChunkRef>,
        id: RequestId,
        req: &mut Request,
        c: usize,
    ) {
        let region = if parked.is_empty() {
            ctx.sched.acquire_local(req.plan.chunks[c].bytes, false)
        } else {
            None
        };
        match region {
            Some(region) => Self::start_gather(ctx, id, req, c, region),
            None => {
                req.slots[c].stage = Stage::Parked;
                ctx.stats.parked += 1;
                parked.push_back(ChunkRef {
                    request: id,
                    chunk: c as u32,
                });
            }
        }
    }

    pub fn on_gather_done(&mut self, ctx: &mut Ctx, now: Time, cref: ChunkRef) {
        let Some(req) = self.requests.get_mut(&cref.request) else {
            ctx.stats.ignored += 1;
            return;
        };
        let c = cref.chunk as usize;
        let Some(Stage::Gathering(region)) = req.slots.get(c).map(|s| s.stage) else {
            ctx.stats.ignored += 1;
            return;
        };
        req.gathers -= 1;
        if !req.active() {
            let _ = ctx.sched.release_local(region);
            req.slots[c].stage = Stage::Abandoned;
            req.staged -= 1;
            self.settle(ctx, cref.request);
            return;
        }
        req.last_progress = now;
        if req.slots[c].credit.is_some() {
            Self::post_write(ctx, cref.request, req, c, region);
        } else if ctx.sched.has_blocked_flow() || !self.parked.is_empty() {
            // Eager staging yields to remote flows and parked credits
            // waiting for space.
            let _ = ctx.sched.release_local(region);
            req.slots[c].stage = Stage::Idle;
            req.staged -= 1;
            req.next_idle = req.next_idle.min(c);
        } else {
            req.slots[c].stage = Stage::Gathered(region);
            self.eager_ready.insert(cref);
        }
    }

    /// Gives back every eagerly gathered region that has no credit yet (the
    /// chunk returns to Idle and is gathered again when its credit comes).
    /// Called while a remote flow or a parked credit waits for space.
    /// Returns how many.
    pub fn evict_eager(&mut self, ctx: &mut Ctx) -> usize {
        let mut evicted = 0;
        for cref in std::mem::take(&mut self.eager_ready) {
            let Some(req) = self.requests.get_mut(&cref.request) else {
                continue;
            };
            let c = cref.chunk as usize;
            let Some(slot) = req.slots.get_mut(c) else {
                continue;
            };
            if let (Stage::Gathered(region), None) = (slot.stage, slot.credit) {
                let _ = ctx.sched.release_local(region);
                slot.stage = Stage::Idle;
                req.staged -= 1;
                req.next_idle = req.next_idle.min(c);
                evicted += 1;
            }
        }
        evicted
    }

    pub fn on_gather_failed(&mut self, ctx: &mut Ctx, cref: ChunkRef, quiesced: bool) {
        let Some(req) = self.requests.get_mut(&cref.request) else {
            ctx.stats.ignored += 1;
            return;
        };
        let c = cref.chunk as usize;
        let Some(Stage::Gathering(region)) = req.slots.get(c).map(|s| s.stage) else {
            ctx.stats.ignored += 1;
            return;
        };
        req.gathers -= 1;
        req.staged -= 1;
        req.slots[c].stage = Stage::Abandoned;
        if quiesced {
            let _ = ctx.sched.release_local(region);
        } else {
            self.leaked.push(region);
            ctx.poison(format!(
                "gather of {cref} failed and could not be synchronised"
            ));
        }
        self.fail(ctx, cref.request, FailureReason::GatherFailed);
        self.settle(ctx, cref.request);
    }

    pub fn on_write_done(&mut self, ctx: &mut Ctx, now: Time, cref: ChunkRef) {
        let Some((req, c, region)) = self.writing(cref) else {
            ctx.stats.ignored += 1;
            return;
        };
        req.writes -= 1;
        req.staged -= 1;
        let _ = ctx.sched.release_local(region);
        if !req.active() {
            req.slots[c].stage = Stage::Abandoned;
            self.settle(ctx, cref.request);
            return;
        }
        req.last_progress = now;
        if req.planned {
            Self::send_data(ctx, cref.request, req, c);
        } else {
            req.slots[c].stage = Stage::Held;
        }
    }

    /// Sends the DATA (or READ_DATA) of written chunk `c`.
    fn send_data(ctx: &mut Ctx, id: RequestId, req: &mut Request, c: usize) {
        req.slots[c].stage = Stage::Written;
        if let Some(credit) = req.slots[c].credit {
            let msg = match req.serves {
                None => Message::Data {
                    request: id,
                    chunk: c as u32,
                    region: credit.region,
                    runs: req.plan.chunks[c].scatter_runs.clone(),
                },
                Some(request) => Message::ReadData {
                    request,
                    chunk: c as u32,
                    region: credit.region,
                },
            };
            let peer = req.peer.clone();
            ctx.send(&peer, msg);
        }
    }

    pub fn on_write_failed(&mut self, ctx: &mut Ctx, cref: ChunkRef) {
        let Some((req, c, region)) = self.writing(cref) else {
            ctx.stats.ignored += 1;
            return;
        };
        req.writes -= 1;
        req.staged -= 1;
        req.slots[c].stage = Stage::Abandoned;
        let _ = ctx.sched.release_local(region);
        self.fail(ctx, cref.request, FailureReason::WriteFailed);
        self.settle(ctx, cref.request);
    }

    pub fn on_write_stuck(&mut self, ctx: &mut Ctx, cref: ChunkRef) {
        let Some((req, c, region)) = self.writing(cref) else {
            ctx.stats.ignored += 1;
            return;
        };
        // The write may still read the staging region and land remotely at
        // any time: never release the region, never cancel the flow.
        req.writes -= 1;
        req.staged -= 1;
        req.slots[c].stage = Stage::Abandoned;
        req.cancel_forbidden = true;
        req.cancel_pending = false;
        self.leaked.push(region);
        ctx.poison(format!("write of {cref} can never be proven complete"));
        self.fail(ctx, cref.request, FailureReason::Poisoned);
        self.settle(ctx, cref.request);
    }

    fn writing(&mut self, cref: ChunkRef) -> Option<(&mut Request, usize, RegionHandle)> {
        let req = self.requests.get_mut(&cref.request)?;
        let c = cref.chunk as usize;
        match req.slots.get(c)?.stage {
            Stage::Writing(region) => Some((req, c, region)),
            _ => None,
        }
    }

    pub fn on_ack(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        id: RequestId,
        chunk: u32,
        region: RegionHandle,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            ctx.stats.ignored += 1;
            return;
        };
        let c = chunk as usize;
        let matches = req.peer == *from
            && req.active()
            && req.slots.get(c).is_some_and(|s| {
                s.stage == Stage::Written && s.credit.map(|k| k.region) == Some(region)
            });
        if !matches {
            ctx.stats.ignored += 1;
            return;
        }
        req.slots[c].stage = Stage::Acked;
        req.acked += 1;
        req.last_progress = now;
        if req.acked == req.slots.len() {
            req.completed = true;
            if req.serves.is_some() {
                ctx.stats.reads_served += 1;
            } else {
                ctx.stats.succeeded += 1;
                ctx.actions.push_back(Action::Complete {
                    request: id,
                    outcome: Outcome::Success,
                });
            }
            self.remove(id);
        }
    }

    pub fn on_refuse(&mut self, ctx: &mut Ctx, from: &PeerId, id: RequestId, reason: RefuseReason) {
        let ours = self
            .requests
            .get(&id)
            .is_some_and(|r| r.peer == *from && r.active());
        if !ours {
            ctx.stats.ignored += 1;
            return;
        }
        tracing::warn!(target: "nixl_bounce::proto", "{from} refused {id}: {reason:?}");
        let why = match reason {
            RefuseReason::ScatterFailed => FailureReason::RemoteScatterFailed,
            _ => FailureReason::Rejected,
        };
        self.fail(ctx, id, why);
    }

    /// Fails `id` with `reason` if it is live. Returns whether it was.
    pub fn fail(&mut self, ctx: &mut Ctx, id: RequestId, reason: FailureReason) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if !req.active() {
            return false;
        }
        req.failed = Some(reason);
        for slot in req.slots.iter_mut() {
            match slot.stage {
                Stage::Idle | Stage::Parked | Stage::Held => slot.stage = Stage::Abandoned,
                Stage::Gathered(region) => {
                    let _ = ctx.sched.release_local(region);
                    req.staged -= 1;
                    slot.stage = Stage::Abandoned;
                    // A stale entry in `eager_ready` is skipped by eviction.
                }
                _ => {}
            }
        }
        req.cancel_pending = reason != FailureReason::PeerLost && !req.cancel_forbidden;
        self.settle(ctx, id);
        true
    }

    /// After a failure: emit Complete once no gather runs, CANCEL once no
    /// write runs, and forget the request once nothing runs.
    fn settle(&mut self, ctx: &mut Ctx, id: RequestId) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(reason) = req.failed else {
            return;
        };
        if !req.completed && req.gathers == 0 {
            req.completed = true;
            if req.serves.is_none() {
                ctx.stats.failed += 1;
                ctx.actions.push_back(Action::Complete {
                    request: id,
                    outcome: Outcome::Failure(reason),
                });
            }
        }
        if req.cancel_pending && req.writes == 0 {
            req.cancel_pending = false;
            let peer = req.peer.clone();
            let msg = Self::end_message(ctx, id, req);
            ctx.send(&peer, msg);
        }
        if req.completed && req.gathers == 0 && req.writes == 0 {
            self.remove(id);
        }
    }

    pub fn fail_all(&mut self, ctx: &mut Ctx, reason: FailureReason) {
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail(ctx, id, reason);
        }
    }

    /// Gives back every standing credit held and never claimed (this
    /// incarnation is shutting down; [`Sender::return_standing_to`]).
    pub fn return_standing(&mut self, ctx: &mut Ctx) {
        let peers: Vec<PeerId> = self.standing.keys().cloned().collect();
        for peer in peers {
            self.return_standing_to(ctx, &peer);
        }
    }

    /// Gives back the standing credit held from `peer`, never claimed
    /// (this agent forgets `peer` or shuts down): while it was held none
    /// of this agent's writes could land in its slot, so the receiver may
    /// assign the slot to any sender at once ([`Message::Return`]).
    pub fn return_standing_to(&mut self, ctx: &mut Ctx, peer: &PeerId) {
        let Some(s) = self.standing.remove(peer) else {
            return;
        };
        // Never taken again: a copy re-sent before the give-back may still
        // come, and the slot may be another sender's by then.
        let floor = self.claimed.entry(peer.clone()).or_default();
        *floor = (*floor).max(s.token);
        let message = Message::Return {
            key: ctx.key_for(peer),
            offer: Claim {
                token: s.token,
                region: s.region,
            },
            incarnation: ctx.cfg.incarnation,
        };
        ctx.send(peer, message);
    }

    /// Drops the standing credit held from `peer` (its receiver keeps the
    /// offer and sends it again to a WANT that says none is held).
    pub fn drop_standing(&mut self, peer: &PeerId) {
        self.standing.remove(peer);
    }

    /// Fails every live request to `peer` with `reason`.
    pub fn fail_peer(&mut self, ctx: &mut Ctx, peer: &PeerId, reason: FailureReason) {
        let ids: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.peer == *peer)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.fail(ctx, id, reason);
        }
    }

    pub fn forget_peer(&mut self, ctx: &mut Ctx, peer: &PeerId) {
        self.reader_paths.remove(peer);
        // The offer goes (given back first by the endpoint, while the
        // peer's key is known); the tokens claimed stay: a copy of a
        // claimed offer may still be on its way, and the peer may be
        // loaded again.
        self.standing.remove(peer);
        self.fail_peer(ctx, peer, FailureReason::PeerLost);
        for r in self.requests.values_mut().filter(|r| r.peer == *peer) {
            r.cancel_pending = false;
        }
    }

    pub fn on_timeout(&mut self, ctx: &mut Ctx, now: Time) {
        let timeout = ctx.cfg.request_timeout;
        let due: Vec<(RequestId, FailureReason)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.active())
            .filter_map(|(&id, r)| {
                due_failure(now, r.last_progress, r.deadline, timeout).map(|why| (id, why))
            })
            .collect();
        for (id, reason) in due {
            self.fail(ctx, id, reason);
        }
    }

    pub fn next_timeout(&self, ctx: &Ctx) -> Option<Time> {
        self.requests
            .values()
            .filter(|r| r.active())
            .map(|r| expiry(r.last_progress, r.deadline, ctx.cfg.request_timeout))
            .min()
    }
}
