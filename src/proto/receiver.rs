//! The receiver role: flows, grants, DATA validation, scatter, ACK.
//!
//! ```text
//! WANT --> flow (pending chunks) --schedule--> GRANT (region held by the flow)
//! DATA(region, runs) --valid, region held by this flow--> StartScatter
//! scatter done --> region freed, ACK, reschedule
//! ```
//!
//! Guards:
//! - *late DATA*: a DATA whose region is not (or no longer) held by its flow
//!   for that chunk is dropped; it never scatters a region now owned by
//!   someone else;
//! - *run validation*: every run of a DATA must lie inside the granted
//!   length of the region; otherwise the flow is aborted (REFUSE) and its
//!   regions quarantined;
//! - *orphans*: reclaiming a flow while a scatter reads one of its regions
//!   defers that region's free until the scatter ends;
//! - *quarantine*: when the receiver aborts a flow on its own (expiry,
//!   refusal, shutdown, poison), the sender may still be writing: the
//!   flow's regions are kept out of use until the sender's CANCEL (sent
//!   only after its writes ended) or until the peer is forgotten.
//!
//! The reader of a READ is the receiver of that READ's flow
//! ([`FlowKind::Read`]): the same grants, DATA checks, scatters and aborts,
//! with the READ message types (READ_GRANT, READ_ACK, READ_REFUSE) and the
//! scatter runs taken from the reader's own plan (see [`super::read`]).

use std::collections::{BTreeMap, BTreeSet};

use super::credit::{Offer, ScatterEnd};
use super::endpoint::{Action, Ctx};
use super::wire::{Credit, Message, RefuseReason, StandingUse};
use super::{FlowId, FlowKind, PeerId, RegionHandle, RequestId, Run, Runs, Time};

/// Upper bound on the copies one DATA may expand to.
pub const MAX_COPIES_PER_CHUNK: u64 = 1 << 24;

/// The receiver role's state.
#[derive(Debug, Default)]
pub(crate) struct Receiver {
    /// Cancelled or aborted flows: a late WANT for them is ignored.
    tombstones: BTreeMap<FlowId, Time>,
    /// Peers whose endpoint was handed to the runtime.
    known_peers: BTreeSet<PeerId>,
    /// A DATA into a peer's offered standing slot whose claiming WANT has
    /// not come yet (a channel that reorders), by slot: the request and
    /// the runs. At most one a slot; taken by the claim, dropped by the
    /// request's CANCEL.
    early: BTreeMap<RegionHandle, (PeerId, RequestId, Runs)>,
    /// Senders whose last WANT was a WANT_STANDING, and the incarnation it
    /// named: only they are sent offers (a peer back under the same name
    /// as an older build is not), each to that incarnation.
    takes_offers: BTreeMap<PeerId, u64>,
}

/// [`validate_runs`] for a run list, read as packed copies when it is
/// ([`Copies`](super::Copies)): the same verdict without building its runs (they are built
/// only to word an error).
pub(crate) fn validate_run_list(runs: &Runs, region_len: u64) -> Result<(), String> {
    if let Some(c) = runs.copies() {
        let n = c.addrs().len() as u64;
        if c.region_end() <= region_len && n <= MAX_COPIES_PER_CHUNK && c.addresses_fit() {
            return Ok(());
        }
    }
    validate_runs(runs, region_len)
}

/// Why DATA runs are invalid.
pub(crate) fn validate_runs(runs: &[Run], region_len: u64) -> Result<(), String> {
    if runs.is_empty() {
        return Err("no runs".into());
    }
    let mut copies = 0u64;
    for (i, r) in runs.iter().enumerate() {
        if r.len == 0 || r.count == 0 {
            return Err(format!("run {i} is empty"));
        }
        let end = r.region_end().ok_or_else(|| format!("run {i} overflows"))?;
        if end > region_len {
            return Err(format!(
                "run {i} ends at {end}, beyond the granted {region_len} bytes"
            ));
        }
        r.addr_end()
            .ok_or_else(|| format!("run {i} address range overflows"))?;
        copies = copies.saturating_add(u64::from(r.count));
    }
    if copies > MAX_COPIES_PER_CHUNK {
        return Err(format!(
            "{copies} copies exceed the limit {MAX_COPIES_PER_CHUNK}"
        ));
    }
    Ok(())
}

/// The STANDING message of `offer` of `region` (`len` bytes).
fn standing_message(offer: Offer, region: RegionHandle, len: u64) -> Message {
    Message::Standing {
        token: offer.token,
        region,
        len,
        incarnation: offer.incarnation,
    }
}

/// REFUSE for a WRITE flow, READ_REFUSE for a READ flow.
fn refuse(flow: &FlowId, reason: RefuseReason) -> Message {
    match flow.kind {
        FlowKind::Write => Message::Refuse {
            request: flow.request,
            reason,
        },
        FlowKind::Read => Message::ReadRefuse {
            request: flow.request,
            reason,
        },
    }
}

impl Receiver {
    pub fn register_endpoint(&mut self, ctx: &mut Ctx, from: &PeerId, endpoint: Vec<u8>) {
        if !endpoint.is_empty() && !self.known_peers.contains(from) {
            self.known_peers.insert(from.clone());
            ctx.actions.push_back(Action::Connect {
                peer: from.clone(),
                endpoint,
            });
        }
    }

    /// Whether `peer`'s endpoint was handed to the runtime.
    pub fn knows(&self, peer: &PeerId) -> bool {
        self.known_peers.contains(peer)
    }

    fn tombstone(&mut self, ctx: &Ctx, flow: FlowId, now: Time) {
        self.tombstones
            .insert(flow, now.after(ctx.cfg.tombstone_ttl));
    }

    /// Aborts a live flow on the receiver's own initiative: tell the sender,
    /// quarantine its regions (the sender may still write), remember it.
    fn abort(&mut self, ctx: &mut Ctx, now: Time, flow: &FlowId, reason: RefuseReason) {
        ctx.sched.quarantine_flow(flow);
        ctx.send(&flow.peer, refuse(flow, reason));
        self.tombstone(ctx, flow.clone(), now);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn on_want(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        request: RequestId,
        chunk_sizes: &[u64],
        endpoint: Vec<u8>,
        standing: StandingUse,
        incarnation: u64,
    ) {
        self.register_endpoint(ctx, from, endpoint);
        match standing {
            StandingUse::None => self.takes_offers.remove(from),
            _ => self.takes_offers.insert(from.clone(), incarnation),
        };
        let claim = standing.claim().map(|c| Offer::named(c, incarnation));
        self.add_want(ctx, now, from, request, chunk_sizes, claim);
        let serving = ctx.poisoned.is_none() && !ctx.shut_down;
        if serving && standing != StandingUse::None && ctx.sched.assign_standing(from) {
            // A sender that holds none of our offers gets the live one
            // again (it may have been forgotten there), if it went to this
            // incarnation: another one under the same name cannot know
            // whether the first claimed it, and waits until the first's
            // claim or CANCEL ends it. A new one goes out with the next
            // schedule.
            if standing == StandingUse::Wanted {
                if let Some((offer, region, len)) = ctx.sched.standing_offer(from) {
                    if offer.incarnation == incarnation {
                        ctx.send(from, standing_message(offer, region, len));
                    }
                }
            }
        }
    }

    fn add_want(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        request: RequestId,
        chunk_sizes: &[u64],
        claim: Option<(Offer, RegionHandle)>,
    ) {
        let refuse = if ctx.poisoned.is_some() {
            Some(RefuseReason::Poisoned)
        } else if ctx.shut_down {
            Some(RefuseReason::ShuttingDown)
        } else {
            None
        };
        if let Some(reason) = refuse {
            ctx.send(from, Message::Refuse { request, reason });
            return;
        }
        let flow = FlowId::write(from.clone(), request);
        // A claim whose request was cancelled already (its CANCEL came
        // first) was spent by that CANCEL.
        if self.tombstones.contains_key(&flow) || ctx.sched.has_flow(&flow) {
            ctx.stats.ignored += 1;
            return;
        }
        let added = match claim {
            Some((offer, region)) => {
                ctx.sched
                    .add_claimed_flow(now, flow.clone(), chunk_sizes, offer, region)
            }
            None => ctx.sched.add_flow(now, flow.clone(), chunk_sizes),
        };
        match added {
            Ok(()) => {
                let Some((_, region)) = claim else {
                    return;
                };
                ctx.stats.standing_taken += 1;
                // Its first chunk may be written already, and its DATA here.
                if let Some((peer, early_request, runs)) = self.early.remove(&region) {
                    if peer == *from && early_request == request {
                        self.accept_data(ctx, now, flow, 0, region, runs);
                    } else {
                        ctx.stats.late_data += 1;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: "nixl_bounce::proto", "refusing WANT from {from}: {e}");
                let reason = match e {
                    super::credit::SchedError::BadChunkSize { .. } => RefuseReason::ChunkTooLarge,
                    _ => RefuseReason::ProtocolViolation,
                };
                // A claim refused keeps its offer until the request's
                // CANCEL, which names it: chunk 0 may be in the slot.
                ctx.send(from, Message::Refuse { request, reason });
                self.tombstone(ctx, flow, now);
            }
        }
    }

    pub fn on_cancel(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        request: RequestId,
        endpoint: Vec<u8>,
        claim: Option<(Offer, RegionHandle)>,
    ) {
        self.register_endpoint(ctx, from, endpoint);
        let flow = FlowId::write(from.clone(), request);
        // The request claimed an offer (its incarnation's), and none of
        // its writes can land any more. If its claim never made a flow here
        // (it has not come, it was lost with the connection, or it was
        // refused), the offer is still live: spent, with a DATA kept for
        // the claim; the claim, if it comes, finds a tombstone. Otherwise
        // the slot is the flow's and is freed with it just below.
        if let Some((offer, region)) = claim {
            ctx.sched.spend_standing(from, offer, region);
            self.early
                .retain(|_, (p, r, _)| !(p == from && *r == request));
        }
        // The sender cancels only once none of its writes can land: every
        // region of the flow that no scatter reads is free to reuse.
        ctx.sched.reclaim_flow(&flow);
        ctx.sched.release_quarantine(&flow);
        self.tombstone(ctx, flow, now);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn on_data(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        from: &PeerId,
        request: RequestId,
        chunk: u32,
        region: RegionHandle,
        runs: Runs,
    ) {
        let flow = FlowId::write(from.clone(), request);
        if chunk == 0
            && !ctx.sched.has_flow(&flow)
            && !self.tombstones.contains_key(&flow)
            && ctx.sched.is_offered_slot(from, region)
        {
            // Written into the sender's standing slot before its claiming
            // WANT arrived: kept for the claim.
            self.early.insert(region, (from.clone(), request, runs));
            return;
        }
        self.accept_data(
            ctx,
            now,
            FlowId::write(from.clone(), request),
            chunk,
            region,
            runs,
        );
    }

    /// DATA (or READ_DATA, with the reader's own runs) for `flow`: starts
    /// the scatter if the region is the flow's for that chunk and the runs
    /// fit it. Returns whether a scatter started.
    pub fn accept_data(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        flow: FlowId,
        chunk: u32,
        region: RegionHandle,
        runs: Runs,
    ) -> bool {
        let from = &flow.peer;
        let held = ctx
            .sched
            .held(&flow, region)
            .filter(|h| h.chunk == chunk && !h.scattering);
        let Some(held) = held else {
            ctx.stats.late_data += 1;
            tracing::debug!(target: "nixl_bounce::proto", "dropping late DATA {flow}#{chunk} {region}");
            return false;
        };
        if let Err(why) = validate_run_list(&runs, held.len) {
            tracing::warn!(target: "nixl_bounce::proto", "invalid DATA from {from} for {flow}#{chunk}: {why}");
            self.abort(ctx, now, &flow, RefuseReason::ProtocolViolation);
            return false;
        }
        if ctx.sched.begin_scatter(&flow, region).is_err() {
            ctx.stats.late_data += 1;
            return false;
        }
        ctx.sched.touch(&flow, now);
        ctx.actions.push_back(Action::StartScatter {
            flow,
            chunk,
            region,
            runs,
        });
        true
    }

    pub fn on_scatter_done(&mut self, ctx: &mut Ctx, _now: Time, region: RegionHandle) {
        match ctx.sched.finish_scatter(region) {
            Ok(ScatterEnd::Owned { flow, chunk }) => {
                // A standing slot this frees is offered again by the
                // schedule that follows, right behind the ACK (before it,
                // the offer's send delayed every such ACK: 8 -> 38 us from
                // the scatter's end on the 2-core VM).
                let request = flow.request;
                let ack = match flow.kind {
                    FlowKind::Write => Message::Ack {
                        request,
                        chunk,
                        region,
                    },
                    FlowKind::Read => Message::ReadAck {
                        request,
                        chunk,
                        region,
                    },
                };
                ctx.send(&flow.peer, ack)
            }
            Ok(ScatterEnd::Orphaned) => {}
            Err(e) => {
                ctx.stats.ignored += 1;
                tracing::warn!(target: "nixl_bounce::proto", "scatter done for {region}: {e}");
            }
        }
    }

    pub fn on_scatter_failed(
        &mut self,
        ctx: &mut Ctx,
        now: Time,
        region: RegionHandle,
        quiesced: bool,
    ) {
        if !quiesced {
            ctx.poison(format!(
                "scatter of {region} failed and could not be synchronised"
            ));
            return;
        }
        match ctx.sched.finish_scatter(region) {
            Ok(ScatterEnd::Owned { flow, .. }) => {
                // No ACK: the destination bytes are not there.
                if ctx.sched.has_flow(&flow) {
                    self.abort(ctx, now, &flow, RefuseReason::ScatterFailed);
                } else {
                    ctx.send(&flow.peer, refuse(&flow, RefuseReason::ScatterFailed));
                    self.tombstone(ctx, flow, now);
                }
            }
            Ok(ScatterEnd::Orphaned) => {}
            Err(e) => {
                ctx.stats.ignored += 1;
                tracing::warn!(target: "nixl_bounce::proto", "scatter failed for {region}: {e}");
            }
        }
    }

    /// A sender's incarnation gives back the offer it held and never
    /// claimed, and takes no more: the slot leaves the peer, to be
    /// assigned to the next sender that asks (the peer's next incarnation
    /// among them).
    pub fn on_return(&mut self, ctx: &mut Ctx, from: &PeerId, offer: Offer, region: RegionHandle) {
        if self.takes_offers.get(from) == Some(&offer.incarnation) {
            self.takes_offers.remove(from);
        }
        ctx.sched.return_standing(from, offer, region);
    }

    /// Offers each free standing slot of a peer whose endpoint we have
    /// under a new token.
    fn offer_standing(&mut self, ctx: &mut Ctx) {
        if ctx.shut_down {
            return;
        }
        let (known, takes) = (&self.known_peers, &self.takes_offers);
        for (peer, offer, region, len) in ctx
            .sched
            .standing_offers(|p| takes.get(p).copied().filter(|_| known.contains(p)))
        {
            ctx.stats.standing_offered += 1;
            ctx.send(&peer, standing_message(offer, region, len));
        }
    }

    /// Grants what the arena allows and sends one GRANT per flow, and
    /// offers the free standing slots.
    pub fn schedule(&mut self, ctx: &mut Ctx) {
        self.offer_standing(ctx);
        let grants = ctx.sched.schedule();
        if grants.is_empty() {
            return;
        }
        ctx.stats.grants += grants.len() as u64;
        let mut by_flow: BTreeMap<FlowId, Vec<Credit>> = BTreeMap::new();
        let mut order = Vec::new();
        for g in grants {
            if !by_flow.contains_key(&g.flow) {
                order.push(g.flow.clone());
            }
            by_flow.entry(g.flow).or_default().push(g.credit);
        }
        for flow in order {
            if let Some(credits) = by_flow.remove(&flow) {
                let request = flow.request;
                let grant = match flow.kind {
                    FlowKind::Write => Message::Grant { request, credits },
                    FlowKind::Read => Message::ReadGrant { request, credits },
                };
                ctx.send(&flow.peer, grant);
            }
        }
    }

    pub fn on_timeout(&mut self, ctx: &mut Ctx, now: Time) {
        for flow in ctx.sched.idle_flows(now, ctx.cfg.flow_idle_timeout) {
            tracing::warn!(target: "nixl_bounce::proto", "flow {flow} idle too long; aborting");
            self.abort(ctx, now, &flow, RefuseReason::Expired);
        }
        self.tombstones.retain(|_, &mut until| until > now);
    }

    pub fn next_timeout(&self, ctx: &Ctx) -> Option<Time> {
        let idle = ctx.sched.next_idle_deadline(ctx.cfg.flow_idle_timeout);
        let tomb = self.tombstones.values().min().copied();
        [idle, tomb].into_iter().flatten().min()
    }

    pub fn forget_peer(&mut self, ctx: &mut Ctx, peer: &PeerId) {
        ctx.sched.reclaim_peer(peer);
        self.known_peers.remove(peer);
        self.takes_offers.remove(peer);
        self.early.retain(|_, (p, _, _)| p != peer);
    }

    /// Aborts every live flow of `peer` (see [`Receiver::abort`]).
    pub fn abort_peer(&mut self, ctx: &mut Ctx, now: Time, peer: &PeerId, reason: RefuseReason) {
        for flow in ctx.sched.flow_ids().into_iter().filter(|f| &f.peer == peer) {
            self.abort(ctx, now, &flow, reason);
        }
    }

    pub fn abort_all(&mut self, ctx: &mut Ctx, now: Time, reason: RefuseReason) {
        for flow in ctx.sched.flow_ids() {
            self.abort(ctx, now, &flow, reason);
        }
    }

    /// Tombstones currently remembered.
    #[allow(dead_code)]
    pub fn tombstone_count(&self) -> usize {
        self.tombstones.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::proto::testing::arb_copies;

    proptest! {
        /// The check of a DATA's packed copies gives the check of its
        /// runs' verdict, in a region that now holds them and now not.
        #[test]
        fn packed_copies_are_checked_as_their_runs(
            c in arb_copies(),
            slack in prop_oneof![Just(0i64), -8192..8192i64],
        ) {
            let region_len = c.region_end().saturating_add_signed(slack);
            let list = Runs::from_copies(c);
            let fast = validate_run_list(&list, region_len);
            let slow = validate_runs(&Runs::from(list.to_vec()), region_len);
            prop_assert_eq!(fast.is_ok(), slow.is_ok(), "{:?} / {:?}", fast, slow);
        }
    }
}
