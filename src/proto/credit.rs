//! The credit scheduler: the single owner of the arena.
//!
//! Every byte of the arena is at any time in exactly one of these states
//! (the *conservation invariant*, checked by [`CreditScheduler::check_invariants`]):
//!
//! | state | meaning |
//! |---|---|
//! | free | in the buddy allocator's free lists |
//! | held by a flow | granted to exactly one remote flow (a remote write target, possibly being scattered) |
//! | held locally | gather staging of the local sender role (eager or credit-backed) |
//! | orphaned | its flow was reclaimed while a scatter still read it; freed when the scatter ends |
//! | quarantined | its flow was aborted by the receiver while the sender might still write into it; freed when the sender cancels (after its writes ended) or the peer is forgotten (its data path torn down) |
//! | local reserve | one max-chunk block kept for credit-backed local staging (see below) |
//! | standing | a standing slot: kept for one sender peer, offered to it as a standing credit (see below) |
//!
//! # Scheduling
//!
//! Remote flows wait in a round-robin *ring* with a *cursor*. One call to
//! [`CreditScheduler::schedule`] repeats sweeps over the ring, starting at the
//! cursor; a sweep hands out at most one region, to the first flow that
//! (a) has pending chunks, (b) holds fewer than `W` regions and (c) whose next
//! chunk fits in the arena right now; the cursor then moves past that flow.
//! Scheduling stops when a whole sweep grants nothing. So grants alternate
//! across flows (A, B, A, B, ...), a single flow never holds more than `W`
//! regions (its pipeline depth) and an arena that is full is backpressure,
//! not an error.
//!
//! # Drain mode
//!
//! A flow whose next chunk did not fit is *blocked*. Every grant to another
//! flow while it is blocked *bypasses* it. A *round* is one grant to each of
//! the other flows in the ring, i.e. `ring_len - 1` grants (at least 1).
//! When a blocked flow has been bypassed for two full rounds
//! (`bypassed >= 2 * max(1, ring_len - 1)`), the scheduler enters drain mode
//! for the longest-blocked such flow: no new remote grant and no new eager
//! local staging is issued until that flow's next chunk fits; regions already
//! handed out keep completing and freeing space. Since every chunk is at most
//! `max_chunk` bytes and `max_chunk` is at most the usable capacity minus the
//! reserve, an emptied arena always fits it, so drain mode always ends.
//!
//! # Local staging and the reserve
//!
//! The local sender role takes gather staging from the same arena:
//! `acquire_local(bytes, eager)`. Eager staging (before any credit exists)
//! is capped at half of the shared arena (the reserve excluded) and only
//! happens while no remote flow is blocked for space; when one is, the
//! sender gives uncredited eager regions back (see `sender`), so eager
//! staging is purely opportunistic and can never hold space a grant needs.
//! Credit-backed staging is not capped and, when the shared space is full,
//! falls back to the *local reserve*: one block of the max chunk size taken
//! at start-up (only when the arena holds at least two such blocks). The
//! reserve guarantees that a local sender holding a credit can always stage
//! eventually, without waiting on any remote party, which breaks the
//! bidirectional cycle "my arena is full of your grants, yours of mine".
//!
//! # Standing slots
//!
//! A few regions of `standing_len` bytes (`standing_slots`), taken at
//! start-up beside the reserve and never returned to the allocator, serve
//! standing credits: a slot is assigned to one sender peer for the
//! scheduler's life ([`CreditScheduler::assign_standing`]), offered to it
//! under a token ([`CreditScheduler::standing_offers`]), and becomes chunk 0
//! of the flow whose WANT claims it ([`CreditScheduler::add_claimed_flow`]),
//! so that flow's first chunk needs no grant. When that region is freed (its
//! scatter ended, the flow was cancelled, its quarantine released) the slot
//! returns to its peer, to be offered again. A slot never changes peers:
//! whatever a peer may still write into it, only that peer's own flows ever
//! read it, so forgetting a peer (which cannot prove its writes ended) never
//! hands its slot to another. Only a peer that gives its live offer back
//! ([`CreditScheduler::return_standing`], as it shuts down) frees its slot
//! for another. Taken only where the largest chunk still fits
//! the rest of the arena, so drain mode still ends.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use thiserror::Error;

use super::buddy::BuddyAllocator;
use super::wire::{Claim, Credit};
use super::{FlowId, PeerId, RegionHandle, Time};

/// Scheduler construction parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerParams {
    /// Usable arena capacity (a power of two).
    pub capacity: u64,
    /// Buddy granularity (a power of two, <= capacity).
    pub granularity: u64,
    /// Per-flow in-flight cap W (>= 1).
    pub window: u32,
    /// Largest chunk (<= capacity).
    pub max_chunk: u64,
    /// Keep a local reserve block (see the module docs).
    pub local_reserve: bool,
    /// Standing slots to take (see the module docs); 0: none.
    pub standing_slots: u32,
    /// Bytes of one standing slot.
    pub standing_len: u64,
    /// The first standing offer's token (offers count up from it).
    pub token_base: u64,
}

/// Scheduler errors: misuse by the caller or a peer, never a panic.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SchedError {
    /// Invalid parameters.
    #[error("invalid scheduler parameters: {0}")]
    Params(String),
    /// A WANT for a flow that already exists.
    #[error("flow {0} already exists")]
    DuplicateFlow(FlowId),
    /// A flow with no chunks.
    #[error("flow {0} has no chunks")]
    EmptyFlow(FlowId),
    /// A chunk that can never be granted.
    #[error("flow {flow}: chunk {chunk} has {bytes} bytes; chunks must be 1..={max} bytes")]
    BadChunkSize {
        /// The flow.
        flow: FlowId,
        /// Chunk index.
        chunk: u32,
        /// Its size.
        bytes: u64,
        /// The largest allowed.
        max: u64,
    },
    /// An operation on a region the caller does not own in the required way.
    #[error("region {region} is not {expected}")]
    WrongOwner {
        /// The region.
        region: RegionHandle,
        /// What was required.
        expected: &'static str,
    },
}

/// Who holds a region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Granted to a remote flow.
    Flow(FlowId),
    /// Local gather staging.
    Local {
        /// Counted against the eager budget.
        eager: bool,
    },
    /// Reclaimed while scattering; freed when the scatter ends.
    Orphan,
    /// Possibly still written by the flow's sender; freed when the sender
    /// cancels the flow (after its writes ended) or the peer is forgotten.
    Quarantine(FlowId),
    /// The idle local reserve block.
    Reserve,
    /// A standing slot not in a flow, assigned to a peer
    /// ([`CreditScheduler::slot_peer`]) and offered to one incarnation of
    /// it (`None`: to be offered, or assigned to no peer yet).
    Standing {
        /// The live offer.
        offer: Option<Offer>,
    },
}

/// A standing slot's offer: the token that names it and the incarnation of
/// the peer it was sent to, the only one that may claim it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// Grows with every offer of this scheduler.
    pub token: u64,
    /// The sender's incarnation ([`super::wire::Message::Want`]).
    pub incarnation: u64,
}

impl Offer {
    /// The offer `claim` names, as sender incarnation `incarnation` names
    /// it (in a claim, a CANCEL or a give-back), and its slot.
    pub fn named(claim: Claim, incarnation: u64) -> (Offer, RegionHandle) {
        let Claim { token, region } = claim;
        (Offer { token, incarnation }, region)
    }
}

#[derive(Clone, Debug)]
struct RegionEntry {
    block: u64,
    len: u64,
    owner: Owner,
    chunk: u32,
    scattering: bool,
}

#[derive(Clone, Debug)]
struct FlowState {
    pending: VecDeque<(u32, u64)>,
    held: BTreeSet<u64>,
    /// Grant sequence number when the flow was first found blocked.
    blocked_since: Option<u64>,
    bypassed: u64,
    last_activity: Time,
}

impl FlowState {
    fn wants_more(&self, window: u32) -> bool {
        !self.pending.is_empty() && self.held.len() < window as usize
    }
}

/// One credit handed to one flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The flow.
    pub flow: FlowId,
    /// The credit.
    pub credit: Credit,
}

/// A region granted to a flow, as seen by the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldRegion {
    /// The chunk it was granted for.
    pub chunk: u32,
    /// Granted bytes.
    pub len: u64,
    /// A scatter is reading it.
    pub scattering: bool,
}

/// What ended when a scatter finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScatterEnd {
    /// The region belonged to a live flow; it is freed and the chunk can be
    /// acknowledged.
    Owned {
        /// The flow.
        flow: FlowId,
        /// The chunk.
        chunk: u32,
    },
    /// The flow had been reclaimed; the orphan region is freed now.
    Orphaned,
}

/// Counts of what a reclaim did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Flows removed.
    pub flows: usize,
    /// Regions freed at once.
    pub freed: usize,
    /// Regions left as orphans until their scatter ends.
    pub orphaned: usize,
    /// Regions quarantined.
    pub quarantined: usize,
}

/// The credit scheduler. See the module docs.
#[derive(Clone, Debug)]
pub struct CreditScheduler {
    buddy: BuddyAllocator,
    window: u32,
    max_chunk: u64,
    eager_cap: u64,
    eager_bytes: u64,
    regions: BTreeMap<u64, RegionEntry>,
    flows: BTreeMap<FlowId, FlowState>,
    ring: Vec<FlowId>,
    cursor: usize,
    grant_seq: u64,
    drain: Option<FlowId>,
    reserve: Option<u64>,
    /// Standing slots (offset -> the peer it is assigned to).
    slots: BTreeMap<u64, Option<PeerId>>,
    next_token: u64,
    poisoned: bool,
}

impl CreditScheduler {
    /// A scheduler over an empty arena.
    pub fn new(params: SchedulerParams) -> Result<CreditScheduler, SchedError> {
        let buddy = BuddyAllocator::new(params.capacity, params.granularity)
            .map_err(|e| SchedError::Params(e.to_string()))?;
        if params.window == 0 {
            return Err(SchedError::Params("window W must be at least 1".into()));
        }
        if params.max_chunk == 0 || params.max_chunk > params.capacity {
            return Err(SchedError::Params(format!(
                "max chunk {} must be 1..={}",
                params.max_chunk, params.capacity
            )));
        }
        let mut s = CreditScheduler {
            buddy,
            window: params.window,
            max_chunk: params.max_chunk,
            eager_cap: 0,
            eager_bytes: 0,
            regions: BTreeMap::new(),
            flows: BTreeMap::new(),
            ring: Vec::new(),
            cursor: 0,
            grant_seq: 0,
            drain: None,
            reserve: None,
            slots: BTreeMap::new(),
            next_token: params.token_base,
            poisoned: false,
        };
        let block = s.buddy.block_size_for(params.max_chunk).unwrap_or(u64::MAX);
        if params.local_reserve && block <= params.capacity / 2 {
            if let Some(off) = s.buddy.alloc(params.max_chunk) {
                s.regions.insert(
                    off,
                    RegionEntry {
                        block,
                        len: block,
                        owner: Owner::Reserve,
                        chunk: 0,
                        scattering: false,
                    },
                );
                s.reserve = Some(off);
            }
        }
        s.take_standing_slots(
            params.standing_slots,
            params.standing_len.min(params.max_chunk),
        );
        s.eager_cap = (s.buddy.free_bytes()) / 2;
        Ok(s)
    }

    /// Takes up to `n` standing slots of `len` bytes, as many as leave the
    /// largest chunk a block of its own (so drain mode still ends).
    fn take_standing_slots(&mut self, n: u32, len: u64) {
        if len == 0 {
            return;
        }
        for _ in 0..n {
            let Some(off) = self.buddy.alloc(len) else {
                break;
            };
            let fits = match self.buddy.alloc(self.max_chunk) {
                Some(probe) => {
                    let _ = self.buddy.free(probe);
                    true
                }
                None => false,
            };
            if !fits {
                let _ = self.buddy.free(off);
                break;
            }
            let block = self.buddy.block_size(off).unwrap_or(len);
            self.regions.insert(
                off,
                RegionEntry {
                    block,
                    len: block,
                    owner: Owner::Standing { offer: None },
                    chunk: 0,
                    scattering: false,
                },
            );
            self.slots.insert(off, None);
        }
    }

    /// Gives `peer` a standing slot if it has none and one is unassigned.
    /// Returns whether it has one.
    pub fn assign_standing(&mut self, peer: &PeerId) -> bool {
        if self.slots.values().any(|p| p.as_ref() == Some(peer)) {
            return true;
        }
        let Some(slot) = self.slots.values_mut().find(|p| p.is_none()) else {
            return false;
        };
        *slot = Some(peer.clone());
        true
    }

    /// The peer the standing slot `region` is assigned to, if it is one
    /// and assigned.
    pub fn slot_peer(&self, region: RegionHandle) -> Option<&PeerId> {
        self.slots.get(&region.0)?.as_ref()
    }

    /// Offers every assigned slot that is free and not offered yet, to the
    /// incarnation `target` names for its peer (none: not to be sent to
    /// now), under a new token: (peer, offer, region, bytes). Nothing once
    /// poisoned.
    pub fn standing_offers(
        &mut self,
        target: impl Fn(&PeerId) -> Option<u64>,
    ) -> Vec<(PeerId, Offer, RegionHandle, u64)> {
        let mut out = Vec::new();
        if self.poisoned {
            return out;
        }
        // The slots, not every region: this runs after every event.
        for (&off, peer) in &self.slots {
            let (Some(peer), Some(e)) = (peer, self.regions.get_mut(&off)) else {
                continue;
            };
            if let Owner::Standing { offer: live @ None } = &mut e.owner {
                let Some(incarnation) = target(peer) else {
                    continue;
                };
                self.next_token = self.next_token.wrapping_add(1);
                let offer = Offer {
                    token: self.next_token,
                    incarnation,
                };
                *live = Some(offer);
                out.push((peer.clone(), offer, RegionHandle(off), e.block));
            }
        }
        out
    }

    /// `peer`'s live offer, if its slot is free and offered: (offer,
    /// region, bytes).
    pub fn standing_offer(&self, peer: &PeerId) -> Option<(Offer, RegionHandle, u64)> {
        let (&off, _) = self.slots.iter().find(|(_, p)| p.as_ref() == Some(peer))?;
        let e = self.regions.get(&off)?;
        match e.owner {
            Owner::Standing { offer: Some(o) } => Some((o, RegionHandle(off), e.block)),
            _ => None,
        }
    }

    /// `peer`'s `offer` of `region` is spent (its sender claimed it, and
    /// the request that claimed it ended with its writes before its flow
    /// existed here): the slot is offered anew. Returns whether it was that
    /// live offer.
    pub fn spend_standing(&mut self, peer: &PeerId, offer: Offer, region: RegionHandle) -> bool {
        if self.slot_peer(region) != Some(peer) {
            return false;
        }
        match self.regions.get_mut(&region.0) {
            Some(RegionEntry {
                owner: Owner::Standing { offer: live },
                ..
            }) if *live == Some(offer) => {
                *live = None;
                true
            }
            _ => false,
        }
    }

    /// `peer` gives back its `offer` of `region`, held and never claimed:
    /// while an offer of a slot is live none of its peer's writes can land
    /// there (the slot is offered only once free, its last claim's writes
    /// ended), and this one will not be claimed, so the slot leaves its
    /// peer and may be assigned to any ([`CreditScheduler::assign_standing`]).
    /// Returns whether it was that live offer.
    pub fn return_standing(&mut self, peer: &PeerId, offer: Offer, region: RegionHandle) -> bool {
        if !self.spend_standing(peer, offer, region) {
            return false;
        }
        if let Some(slot) = self.slots.get_mut(&region.0) {
            *slot = None;
        }
        true
    }

    /// Whether `region` is `peer`'s slot, live under `offer`.
    pub fn is_standing_offer(&self, peer: &PeerId, offer: Offer, region: RegionHandle) -> bool {
        self.standing_offer(peer)
            .is_some_and(|(o, r, _)| o == offer && r == region)
    }

    /// Whether `region` is a standing slot assigned to `peer` and offered
    /// (not in a flow).
    pub fn is_offered_slot(&self, peer: &PeerId, region: RegionHandle) -> bool {
        self.standing_offer(peer)
            .is_some_and(|(_, r, _)| r == region)
    }

    /// Usable arena capacity.
    pub fn capacity(&self) -> u64 {
        self.buddy.capacity()
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.buddy.free_bytes()
    }

    /// Bytes of eager local staging.
    pub fn eager_bytes(&self) -> u64 {
        self.eager_bytes
    }

    /// Number of live flows.
    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// The live flows, in key order.
    pub fn flow_ids(&self) -> Vec<FlowId> {
        self.flows.keys().cloned().collect()
    }

    /// Whether `flow` exists.
    pub fn has_flow(&self, flow: &FlowId) -> bool {
        self.flows.contains_key(flow)
    }

    /// Whether anything of `peer` is in the arena: one of its flows, or a
    /// region granted to or quarantined for one.
    pub fn holds_peer(&self, peer: &PeerId) -> bool {
        self.flows.keys().any(|f| f.peer == *peer)
            || self.regions.values().any(
                |e| matches!(&e.owner, Owner::Flow(f) | Owner::Quarantine(f) if f.peer == *peer),
            )
    }

    /// Number of allocated regions of any owner (the reserve included).
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// The largest chunk a flow may ask for.
    pub fn max_chunk(&self) -> u64 {
        self.max_chunk
    }

    /// Who holds `region`, if it is allocated.
    pub fn owner(&self, region: RegionHandle) -> Option<&Owner> {
        self.regions.get(&region.0).map(|e| &e.owner)
    }

    /// Who holds `region` and its granted length, if it is allocated.
    pub fn region(&self, region: RegionHandle) -> Option<(&Owner, u64)> {
        self.regions.get(&region.0).map(|e| (&e.owner, e.len))
    }

    /// Bytes held in each owner class: (flows, local, orphan, quarantine, reserve).
    pub fn held_bytes(&self) -> HeldBytes {
        let mut h = HeldBytes::default();
        for e in self.regions.values() {
            match e.owner {
                Owner::Flow(_) => h.flows += e.block,
                Owner::Local { .. } => h.local += e.block,
                Owner::Orphan => h.orphan += e.block,
                Owner::Quarantine(_) => h.quarantine += e.block,
                Owner::Reserve => h.reserve += e.block,
                Owner::Standing { .. } => h.standing += e.block,
            }
        }
        h
    }

    /// The flow currently being drained, if any.
    pub fn drain_flow(&self) -> Option<&FlowId> {
        self.drain.as_ref()
    }

    /// Whether a remote flow waits for space (its next chunk did not fit, or
    /// drain mode is on). Eager staging yields to it: no new eager staging,
    /// and uncredited eager regions should be given back.
    pub fn has_blocked_flow(&self) -> bool {
        self.drain.is_some()
            || self
                .flows
                .values()
                .any(|f| f.blocked_since.is_some() && f.wants_more(self.window))
    }

    /// Marks the arena poisoned: no region is ever allocated again.
    pub fn poison(&mut self) {
        self.poisoned = true;
    }

    /// Whether the arena is poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Registers a flow wanting `chunk_sizes` (chunk i has index i).
    pub fn add_flow(
        &mut self,
        now: Time,
        flow: FlowId,
        chunk_sizes: &[u64],
    ) -> Result<(), SchedError> {
        if self.flows.contains_key(&flow) {
            return Err(SchedError::DuplicateFlow(flow));
        }
        if chunk_sizes.is_empty() {
            return Err(SchedError::EmptyFlow(flow));
        }
        let mut pending = VecDeque::with_capacity(chunk_sizes.len());
        for (i, &bytes) in chunk_sizes.iter().enumerate() {
            let chunk = u32::try_from(i).unwrap_or(u32::MAX);
            if bytes == 0 || bytes > self.max_chunk || i > u32::MAX as usize {
                return Err(SchedError::BadChunkSize {
                    flow,
                    chunk,
                    bytes,
                    max: self.max_chunk,
                });
            }
            pending.push_back((chunk, bytes));
        }
        self.flows.insert(
            flow.clone(),
            FlowState {
                pending,
                held: BTreeSet::new(),
                blocked_since: None,
                bypassed: 0,
                last_activity: now,
            },
        );
        self.ring.push(flow);
        Ok(())
    }

    /// Registers a flow wanting `chunk_sizes` whose chunk 0 is written into
    /// `peer`'s standing slot `region`, live under `offer` (the flow's WANT
    /// claimed it): the slot becomes chunk 0's region, held by the flow as
    /// if granted, and the other chunks wait for grants as any flow's.
    pub fn add_claimed_flow(
        &mut self,
        now: Time,
        flow: FlowId,
        chunk_sizes: &[u64],
        offer: Offer,
        region: RegionHandle,
    ) -> Result<(), SchedError> {
        if !self.is_standing_offer(&flow.peer, offer, region) {
            return Err(SchedError::WrongOwner {
                region,
                expected:
                    "the standing slot offered to this incarnation of this peer under this token",
            });
        }
        let first = chunk_sizes.first().copied().unwrap_or(0);
        let slot_len = self.regions.get(&region.0).map_or(0, |e| e.block);
        if first > slot_len {
            return Err(SchedError::BadChunkSize {
                flow,
                chunk: 0,
                bytes: first,
                max: slot_len,
            });
        }
        self.add_flow(now, flow.clone(), chunk_sizes)?;
        if let Some(f) = self.flows.get_mut(&flow) {
            f.pending.pop_front();
            f.held.insert(region.0);
        }
        if let Some(e) = self.regions.get_mut(&region.0) {
            e.owner = Owner::Flow(flow);
            e.chunk = 0;
            e.len = first;
        }
        Ok(())
    }

    /// Records activity on `flow` (resets its idle timer).
    pub fn touch(&mut self, flow: &FlowId, now: Time) {
        if let Some(f) = self.flows.get_mut(flow) {
            f.last_activity = now;
        }
    }

    /// Flows idle for at least `ttl` at `now`.
    pub fn idle_flows(&self, now: Time, ttl: Duration) -> Vec<FlowId> {
        self.flows
            .iter()
            .filter(|(_, f)| now.since(f.last_activity) >= ttl)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The earliest time a flow becomes idle for `ttl`.
    pub fn next_idle_deadline(&self, ttl: Duration) -> Option<Time> {
        self.flows
            .values()
            .map(|f| f.last_activity.after(ttl))
            .min()
    }

    /// The region `region` if it is held by `flow`.
    pub fn held(&self, flow: &FlowId, region: RegionHandle) -> Option<HeldRegion> {
        let e = self.regions.get(&region.0)?;
        match &e.owner {
            Owner::Flow(f) if f == flow => Some(HeldRegion {
                chunk: e.chunk,
                len: e.len,
                scattering: e.scattering,
            }),
            _ => None,
        }
    }

    /// Hands out credits (see the module docs). Returns the new grants in
    /// the order they were made.
    pub fn schedule(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        if self.poisoned {
            return grants;
        }
        loop {
            if let Some(d) = self.drain.clone() {
                let eligible = self
                    .flows
                    .get(&d)
                    .is_some_and(|f| f.wants_more(self.window));
                if !eligible {
                    self.drain = None;
                    continue;
                }
                match self.try_grant(&d) {
                    Some(g) => {
                        self.drain = None;
                        if let Some(pos) = self.ring.iter().position(|k| *k == d) {
                            self.cursor = (pos + 1) % self.ring.len();
                        }
                        grants.push(g);
                        continue;
                    }
                    None => break,
                }
            }
            let n = self.ring.len();
            if n == 0 {
                break;
            }
            let mut granted = false;
            for step in 0..n {
                let idx = (self.cursor + step) % n;
                let key = self.ring[idx].clone();
                if !self
                    .flows
                    .get(&key)
                    .is_some_and(|f| f.wants_more(self.window))
                {
                    continue;
                }
                if let Some(g) = self.try_grant(&key) {
                    self.cursor = (idx + 1) % n;
                    grants.push(g);
                    granted = true;
                    break;
                }
                let seq = self.grant_seq;
                if let Some(f) = self.flows.get_mut(&key) {
                    f.blocked_since.get_or_insert(seq);
                }
            }
            if !granted {
                break;
            }
            self.maybe_enter_drain();
        }
        grants
    }

    fn try_grant(&mut self, key: &FlowId) -> Option<Grant> {
        let &(chunk, bytes) = self.flows.get(key)?.pending.front()?;
        let offset = self.buddy.alloc(bytes)?;
        let block = self.buddy.block_size(offset).unwrap_or(bytes);
        self.regions.insert(
            offset,
            RegionEntry {
                block,
                len: bytes,
                owner: Owner::Flow(key.clone()),
                chunk,
                scattering: false,
            },
        );
        if let Some(f) = self.flows.get_mut(key) {
            f.pending.pop_front();
            f.held.insert(offset);
            f.blocked_since = None;
            f.bypassed = 0;
        }
        for (k, f) in self.flows.iter_mut() {
            if k != key && f.blocked_since.is_some() {
                f.bypassed += 1;
            }
        }
        self.grant_seq += 1;
        Some(Grant {
            flow: key.clone(),
            credit: Credit {
                chunk,
                region: RegionHandle(offset),
                len: bytes,
            },
        })
    }

    fn maybe_enter_drain(&mut self) {
        if self.drain.is_some() {
            return;
        }
        let threshold = 2 * (self.ring.len().saturating_sub(1).max(1) as u64);
        let window = self.window;
        self.drain = self
            .flows
            .iter()
            .filter(|(_, f)| f.bypassed >= threshold && f.wants_more(window))
            .filter_map(|(k, f)| f.blocked_since.map(|s| (s, k)))
            .min()
            .map(|(_, k)| k.clone());
    }

    /// A scatter starts reading `region` of `flow`.
    pub fn begin_scatter(
        &mut self,
        flow: &FlowId,
        region: RegionHandle,
    ) -> Result<HeldRegion, SchedError> {
        match self.regions.get_mut(&region.0) {
            Some(e) if e.owner == Owner::Flow(flow.clone()) && !e.scattering => {
                e.scattering = true;
                Ok(HeldRegion {
                    chunk: e.chunk,
                    len: e.len,
                    scattering: true,
                })
            }
            _ => Err(SchedError::WrongOwner {
                region,
                expected: "held by this flow and not scattering",
            }),
        }
    }

    /// The scatter of `region` ended (successfully or not, but quiesced): the
    /// region is freed and its flow erased when done.
    pub fn finish_scatter(&mut self, region: RegionHandle) -> Result<ScatterEnd, SchedError> {
        let end = match self.regions.get(&region.0) {
            Some(RegionEntry {
                owner: Owner::Flow(f),
                scattering: true,
                chunk,
                ..
            }) => ScatterEnd::Owned {
                flow: f.clone(),
                chunk: *chunk,
            },
            Some(RegionEntry {
                owner: Owner::Orphan,
                ..
            }) => ScatterEnd::Orphaned,
            _ => {
                return Err(SchedError::WrongOwner {
                    region,
                    expected: "being scattered",
                })
            }
        };
        self.free_region(region.0);
        if let ScatterEnd::Owned { flow, .. } = &end {
            if let Some(f) = self.flows.get_mut(flow) {
                f.held.remove(&region.0);
            }
            self.erase_if_done(flow);
        }
        Ok(end)
    }

    fn free_region(&mut self, offset: u64) {
        if self.slots.contains_key(&offset) {
            // A standing slot goes back to its peer, never to the allocator.
            if let Some(e) = self.regions.get_mut(&offset) {
                e.owner = Owner::Standing { offer: None };
                e.len = e.block;
                e.scattering = false;
            }
            return;
        }
        if self.regions.remove(&offset).is_some() {
            // The entry mirrors a buddy allocation; a mismatch is caught by
            // check_invariants.
            let _ = self.buddy.free(offset);
        }
    }

    fn erase_if_done(&mut self, flow: &FlowId) {
        let done = self
            .flows
            .get(flow)
            .is_some_and(|f| f.pending.is_empty() && f.held.is_empty());
        if done {
            self.remove_flow(flow);
        }
    }

    fn remove_flow(&mut self, flow: &FlowId) -> Option<FlowState> {
        let state = self.flows.remove(flow)?;
        if let Some(pos) = self.ring.iter().position(|k| k == flow) {
            self.ring.remove(pos);
            if pos < self.cursor {
                self.cursor -= 1;
            }
            if self.cursor >= self.ring.len() {
                self.cursor = 0;
            }
        }
        if self.drain.as_ref() == Some(flow) {
            self.drain = None;
        }
        Some(state)
    }

    /// Removes `flow` now: pending chunks are dropped, regions nobody reads
    /// are freed, regions being scattered become orphans (freed when their
    /// scatter ends). Only for flows whose peer can no longer write into
    /// them (the sender cancelled after all its writes ended, or the peer's
    /// data path is gone).
    pub fn reclaim_flow(&mut self, flow: &FlowId) -> Reclaimed {
        self.reclaim_inner(flow, false)
    }

    /// Like [`CreditScheduler::reclaim_flow`] for a flow whose peer might
    /// still write into its granted regions: those are quarantined (never
    /// reused) until [`CreditScheduler::reclaim_peer`] for that peer.
    pub fn quarantine_flow(&mut self, flow: &FlowId) -> Reclaimed {
        self.reclaim_inner(flow, true)
    }

    fn reclaim_inner(&mut self, flow: &FlowId, quarantine: bool) -> Reclaimed {
        let mut r = Reclaimed::default();
        let Some(state) = self.remove_flow(flow) else {
            return r;
        };
        r.flows = 1;
        for off in state.held {
            let Some(e) = self.regions.get_mut(&off) else {
                continue;
            };
            if e.scattering {
                e.owner = Owner::Orphan;
                e.scattering = false;
                r.orphaned += 1;
            } else if quarantine {
                e.owner = Owner::Quarantine(flow.clone());
                r.quarantined += 1;
            } else {
                self.free_region(off);
                r.freed += 1;
            }
        }
        r
    }

    /// Reclaims every flow of `peer` and frees its quarantined regions (the
    /// caller guarantees the peer's data path is torn down).
    pub fn reclaim_peer(&mut self, peer: &PeerId) -> Reclaimed {
        let mut total = Reclaimed::default();
        let keys: Vec<FlowId> = self
            .flows
            .keys()
            .filter(|k| k.peer == *peer)
            .cloned()
            .collect();
        for k in keys {
            let r = self.reclaim_flow(&k);
            total.flows += r.flows;
            total.freed += r.freed;
            total.orphaned += r.orphaned;
        }
        let quarantined: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, e)| matches!(&e.owner, Owner::Quarantine(f) if f.peer == *peer))
            .map(|(&o, _)| o)
            .collect();
        for off in quarantined {
            self.free_region(off);
            total.freed += 1;
        }
        total
    }

    /// Frees the quarantined regions of `flow` (its sender reported, by
    /// cancelling, that none of its writes can still land). Returns how many.
    pub fn release_quarantine(&mut self, flow: &FlowId) -> usize {
        let offs: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, e)| matches!(&e.owner, Owner::Quarantine(f) if f == flow))
            .map(|(&o, _)| o)
            .collect();
        for &off in &offs {
            self.free_region(off);
        }
        offs.len()
    }

    /// Local staging regions, in offset order.
    pub fn local_regions(&self) -> Vec<RegionHandle> {
        self.regions
            .iter()
            .filter(|(_, e)| matches!(e.owner, Owner::Local { .. }))
            .map(|(&o, _)| RegionHandle(o))
            .collect()
    }

    /// Takes a local gather-staging region of at least `bytes` bytes.
    /// `eager` staging (no credit yet) is capped at half of the shared arena
    /// (the reserve excluded) and refused while a remote flow waits for
    /// space; credit-backed staging may use the reserve.
    pub fn acquire_local(&mut self, bytes: u64, eager: bool) -> Option<RegionHandle> {
        if self.poisoned || bytes == 0 || bytes > self.max_chunk {
            return None;
        }
        let block = self.buddy.block_size_for(bytes)?;
        if eager && (self.has_blocked_flow() || self.eager_bytes + block > self.eager_cap) {
            return None;
        }
        if let Some(offset) = self.buddy.alloc(bytes) {
            self.regions.insert(
                offset,
                RegionEntry {
                    block,
                    len: bytes,
                    owner: Owner::Local { eager },
                    chunk: 0,
                    scattering: false,
                },
            );
            if eager {
                self.eager_bytes += block;
            }
            return Some(RegionHandle(offset));
        }
        if !eager {
            let off = self.reserve?;
            let e = self.regions.get_mut(&off)?;
            if e.owner == Owner::Reserve && e.block >= bytes {
                e.owner = Owner::Local { eager: false };
                e.len = bytes;
                return Some(RegionHandle(off));
            }
        }
        None
    }

    /// A credit arrived for an eagerly staged region: it no longer counts
    /// against the eager budget.
    pub fn promote_local(&mut self, region: RegionHandle) -> Result<(), SchedError> {
        match self.regions.get_mut(&region.0) {
            Some(e) if e.owner == Owner::Local { eager: true } => {
                e.owner = Owner::Local { eager: false };
                self.eager_bytes -= e.block;
                Ok(())
            }
            Some(e) if e.owner == Owner::Local { eager: false } => Ok(()),
            _ => Err(SchedError::WrongOwner {
                region,
                expected: "held locally",
            }),
        }
    }

    /// Returns a local staging region (nothing reads or writes it anymore).
    pub fn release_local(&mut self, region: RegionHandle) -> Result<(), SchedError> {
        let Some(e) = self.regions.get_mut(&region.0) else {
            return Err(SchedError::WrongOwner {
                region,
                expected: "held locally",
            });
        };
        let eager = match e.owner {
            Owner::Local { eager } => eager,
            _ => {
                return Err(SchedError::WrongOwner {
                    region,
                    expected: "held locally",
                })
            }
        };
        if eager {
            self.eager_bytes -= e.block;
        }
        if self.reserve == Some(region.0) {
            e.owner = Owner::Reserve;
            e.len = e.block;
        } else {
            self.free_region(region.0);
        }
        Ok(())
    }

    /// Checks the conservation invariant and every internal cross-reference.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.buddy.check_invariants().map_err(|e| e.to_string())?;
        let buddy_blocks: Vec<(u64, u64)> = self.buddy.allocated_blocks().collect();
        let region_blocks: Vec<(u64, u64)> =
            self.regions.iter().map(|(&o, e)| (o, e.block)).collect();
        if buddy_blocks != region_blocks {
            return Err(format!(
                "allocator blocks {buddy_blocks:?} differ from owned regions {region_blocks:?}"
            ));
        }
        let held: u64 = self.regions.values().map(|e| e.block).sum();
        if held + self.buddy.free_bytes() != self.buddy.capacity() {
            return Err(format!(
                "conservation: held {held} + free {} != capacity {}",
                self.buddy.free_bytes(),
                self.buddy.capacity()
            ));
        }
        let mut eager = 0;
        for (&off, e) in &self.regions {
            if e.len == 0 || e.len > e.block {
                return Err(format!(
                    "region {off:#x}: length {} vs block {}",
                    e.len, e.block
                ));
            }
            match &e.owner {
                Owner::Flow(f) => {
                    let ok = self.flows.get(f).is_some_and(|s| s.held.contains(&off));
                    if !ok {
                        return Err(format!(
                            "region {off:#x} claims flow {f} which does not hold it"
                        ));
                    }
                }
                Owner::Local { eager: true } => eager += e.block,
                Owner::Reserve if self.reserve != Some(off) => {
                    return Err(format!(
                        "region {off:#x} marked reserve but the reserve is {:?}",
                        self.reserve
                    ));
                }
                Owner::Standing { .. } if !self.slots.contains_key(&off) => {
                    return Err(format!("region {off:#x} marked standing but is no slot"));
                }
                _ => {}
            }
            if e.scattering && !matches!(e.owner, Owner::Flow(_)) {
                return Err(format!("region {off:#x} scattering without a flow"));
            }
        }
        if eager != self.eager_bytes {
            return Err(format!(
                "eager bytes {} but eager regions sum to {eager}",
                self.eager_bytes
            ));
        }
        if self.eager_bytes > self.eager_cap {
            return Err(format!(
                "eager bytes {} above the cap {}",
                self.eager_bytes, self.eager_cap
            ));
        }
        let mut assigned = BTreeSet::new();
        for (off, peer) in &self.slots {
            if let Some(p) = peer {
                if !assigned.insert(p) {
                    return Err(format!("{p} is assigned a second standing slot, {off:#x}"));
                }
            }
            match self.regions.get(off).map(|e| &e.owner) {
                Some(Owner::Standing { offer: Some(_) }) if peer.is_none() => {
                    return Err(format!("standing slot {off:#x} offered to no peer"))
                }
                Some(Owner::Standing { .. }) => {}
                Some(Owner::Flow(f) | Owner::Quarantine(f)) if peer.as_ref() == Some(&f.peer) => {}
                Some(Owner::Orphan) if peer.is_some() => {}
                other => {
                    return Err(format!(
                        "standing slot {off:#x} of {peer:?} owned by {other:?}"
                    ))
                }
            }
        }
        if let Some(r) = self.reserve {
            match self.regions.get(&r).map(|e| &e.owner) {
                Some(Owner::Reserve) | Some(Owner::Local { eager: false }) => {}
                other => return Err(format!("reserve {r:#x} owned by {other:?}")),
            }
        }
        for (k, f) in &self.flows {
            if f.held.len() > self.window as usize {
                return Err(format!(
                    "flow {k} holds {} regions, above W = {}",
                    f.held.len(),
                    self.window
                ));
            }
            for off in &f.held {
                match self.regions.get(off) {
                    Some(e) if e.owner == Owner::Flow(k.clone()) => {}
                    other => {
                        return Err(format!("flow {k} lists region {off:#x} owned by {other:?}"))
                    }
                }
            }
            if f.pending.is_empty() && f.held.is_empty() {
                return Err(format!("finished flow {k} was not erased"));
            }
        }
        let ring: BTreeSet<&FlowId> = self.ring.iter().collect();
        if ring.len() != self.ring.len()
            || ring.len() != self.flows.len()
            || !self.flows.keys().all(|k| ring.contains(k))
        {
            return Err("ring and flow table disagree".into());
        }
        if !self.ring.is_empty() && self.cursor >= self.ring.len() {
            return Err(format!(
                "cursor {} outside the ring of {}",
                self.cursor,
                self.ring.len()
            ));
        }
        if let Some(d) = &self.drain {
            if !self.flows.contains_key(d) {
                return Err(format!("draining unknown flow {d}"));
            }
        }
        Ok(())
    }
}

/// Arena bytes per owner class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// Granted to remote flows.
    pub flows: u64,
    /// Local staging.
    pub local: u64,
    /// Orphans awaiting scatter completion.
    pub orphan: u64,
    /// Quarantined.
    pub quarantine: u64,
    /// Idle reserve.
    pub reserve: u64,
    /// Standing slots not in a flow.
    pub standing: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn flow(p: &str, r: u64) -> FlowId {
        FlowId::write(PeerId::new(p), super::super::RequestId(r))
    }

    fn sched(capacity: u64, window: u32, max_chunk: u64, reserve: bool) -> CreditScheduler {
        sched_standing(capacity, window, max_chunk, reserve, 0, 0)
    }

    fn sched_standing(
        capacity: u64,
        window: u32,
        max_chunk: u64,
        reserve: bool,
        standing_slots: u32,
        standing_len: u64,
    ) -> CreditScheduler {
        CreditScheduler::new(SchedulerParams {
            capacity,
            granularity: 64,
            window,
            max_chunk,
            local_reserve: reserve,
            standing_slots,
            standing_len,
            token_base: 0,
        })
        .unwrap()
    }

    /// Standing slots are taken only while the largest chunk keeps a
    /// block of its own; a claimed slot is chunk 0 of its flow, comes back
    /// to its peer (never to the allocator) when freed, and is offered
    /// again under a larger token; a slot never changes peers (unless
    /// given back, `standing_slots_given_back_serve_another`).
    #[test]
    fn standing_slots_serve_one_peer_each() {
        // 1024 bytes, the reserve 256 at 0: slots of 128 at 256, 384, 512
        // and 640 leave the block of 256 at 768; a fifth would split it.
        let mut s = sched_standing(1024, 2, 256, true, 8, 128);
        assert_eq!(s.held_bytes().standing, 4 * 128);
        assert!(s.buddy.alloc(256).is_some_and(|o| s.buddy.free(o).is_ok()));
        let (a, b) = (PeerId::new("a"), PeerId::new("b"));
        assert!(s.assign_standing(&a) && s.assign_standing(&a));
        let offers = s.standing_offers(|_| Some(7));
        assert_eq!(offers.len(), 1);
        let (peer, offer, region, len) = offers[0].clone();
        assert_eq!((peer, offer.incarnation, len), (a.clone(), 7, 128));
        assert!(s.standing_offers(|_| Some(7)).is_empty(), "offered once");
        assert_eq!(s.standing_offer(&a), Some((offer, region, 128)));
        // A claim with another token, by another incarnation, or with a
        // first chunk too large, fails.
        let f = flow("a", 1);
        for other in others_than(offer) {
            assert!(s
                .add_claimed_flow(Time::ZERO, f.clone(), &[64], other, region)
                .is_err());
        }
        assert!(s
            .add_claimed_flow(Time::ZERO, f.clone(), &[200], offer, region)
            .is_err());
        s.add_claimed_flow(Time::ZERO, f.clone(), &[100, 200], offer, region)
            .unwrap();
        assert_eq!(
            s.held(&f, region),
            Some(HeldRegion {
                chunk: 0,
                len: 100,
                scattering: false
            })
        );
        let g = s.schedule();
        assert_eq!(names(&g), vec!["a#1"], "only chunk 1 is granted");
        assert!(s.standing_offers(|_| Some(7)).is_empty(), "in a flow");
        s.begin_scatter(&f, region).unwrap();
        s.finish_scatter(region).unwrap();
        let again = s.standing_offers(|_| Some(7));
        assert_eq!(again.len(), 1);
        assert!(again[0].1.token > offer.token && again[0].2 == region);
        // Forgetting `a` keeps its slot; `b` gets another, never `a`'s.
        s.reclaim_peer(&a);
        assert!(s.assign_standing(&b));
        let to_b = s.standing_offers(|_| Some(7));
        assert_eq!(to_b.len(), 1);
        assert_ne!(to_b[0].2, region);
        assert!(matches!(s.owner(region), Some(Owner::Standing { .. })));
        assert_eq!(s.slot_peer(region), Some(&a));
        s.check_invariants().unwrap();
        // Where the largest chunk is half the arena beside a reserve, none.
        let s = sched_standing(1024, 2, 512, true, 4, 64);
        assert_eq!(s.held_bytes().standing, 0);
    }

    /// A slot whose live offer its peer gives back (held, never claimed)
    /// leaves that peer and serves the next that asks; a give-back of an
    /// offer that is not the live one (another token or incarnation)
    /// changes nothing.
    #[test]
    fn standing_slots_given_back_serve_another() {
        let mut s = sched_standing(1024, 2, 256, true, 1, 128);
        let (a, b) = (PeerId::new("a"), PeerId::new("b"));
        assert!(s.assign_standing(&a));
        let (_, offer, region, _) = s.standing_offers(|_| Some(7))[0].clone();
        assert!(!s.assign_standing(&b), "one slot, a's");
        for stale in others_than(offer) {
            assert!(!s.return_standing(&a, stale, region));
        }
        assert!(!s.return_standing(&b, offer, region), "not b's to give");
        assert!(s.return_standing(&a, offer, region));
        assert_eq!(s.slot_peer(region), None);
        assert!(s.assign_standing(&b));
        assert_eq!(s.slot_peer(region), Some(&b));
        let to_b = s.standing_offers(|_| Some(9));
        assert_eq!(to_b.len(), 1);
        assert!(to_b[0].1.token > offer.token && to_b[0].2 == region);
        s.check_invariants().unwrap();
    }

    /// Offers that are not `offer`: another token, another incarnation.
    fn others_than(offer: Offer) -> [Offer; 2] {
        [
            Offer {
                token: offer.token + 1,
                ..offer
            },
            Offer {
                incarnation: offer.incarnation + 1,
                ..offer
            },
        ]
    }

    fn names(gs: &[Grant]) -> Vec<String> {
        gs.iter()
            .map(|g| format!("{}#{}", g.flow.peer, g.credit.chunk))
            .collect()
    }

    fn finish(s: &mut CreditScheduler, g: &Grant) {
        s.begin_scatter(&g.flow, g.credit.region).unwrap();
        s.finish_scatter(g.credit.region).unwrap();
    }

    #[test]
    fn seed_example_alternates_and_respects_w() {
        let mut s = sched(4 * 64, 2, 64, false);
        s.add_flow(Time::ZERO, flow("A", 1), &[64, 64, 64]).unwrap();
        s.add_flow(Time::ZERO, flow("B", 1), &[64, 64]).unwrap();
        let g = s.schedule();
        assert_eq!(names(&g), ["A#0", "B#0", "A#1", "B#1"]);
        s.check_invariants().unwrap();
        assert!(s.schedule().is_empty());
        finish(&mut s, &g[0]);
        let g2 = s.schedule();
        assert_eq!(names(&g2), ["A#2"]);
        for x in g[1..].iter().chain(&g2) {
            finish(&mut s, x);
            s.check_invariants().unwrap();
        }
        assert_eq!(s.flow_count(), 0, "finished flows are erased");
        assert_eq!(s.free_bytes(), s.capacity());
    }

    #[test]
    fn arena_backpressure_is_not_an_error() {
        let mut s = sched(256, 8, 128, false);
        s.add_flow(Time::ZERO, flow("A", 1), &[128, 128, 128])
            .unwrap();
        let g = s.schedule();
        assert_eq!(g.len(), 2);
        assert!(s.schedule().is_empty());
        finish(&mut s, &g[0]);
        assert_eq!(s.schedule().len(), 1);
    }

    #[test]
    fn bad_wants_rejected() {
        let mut s = sched(256, 2, 128, false);
        assert!(matches!(
            s.add_flow(Time::ZERO, flow("A", 1), &[]),
            Err(SchedError::EmptyFlow(_))
        ));
        assert!(matches!(
            s.add_flow(Time::ZERO, flow("A", 1), &[129]),
            Err(SchedError::BadChunkSize { .. })
        ));
        assert!(matches!(
            s.add_flow(Time::ZERO, flow("A", 1), &[0]),
            Err(SchedError::BadChunkSize { .. })
        ));
        s.add_flow(Time::ZERO, flow("A", 1), &[1]).unwrap();
        assert!(matches!(
            s.add_flow(Time::ZERO, flow("A", 1), &[1]),
            Err(SchedError::DuplicateFlow(_))
        ));
    }

    #[test]
    fn drain_mode_lets_a_large_chunk_through() {
        // Small flows keep the arena busy; B's big chunk needs the whole arena.
        let mut s = sched(512, 4, 512, false);
        s.add_flow(Time::ZERO, flow("A", 1), &[64; 100]).unwrap();
        s.add_flow(Time::ZERO, flow("C", 1), &[64; 100]).unwrap();
        let mut live = s.schedule();
        s.add_flow(Time::ZERO, flow("B", 1), &[512]).unwrap();
        let mut got_big = false;
        for _ in 0..200 {
            let Some(g) = live.first().cloned() else {
                break;
            };
            live.remove(0);
            finish(&mut s, &g);
            let new = s.schedule();
            s.check_invariants().unwrap();
            if new.iter().any(|g| g.flow.peer.as_str() == "B") {
                got_big = true;
                break;
            }
            live.extend(new);
        }
        assert!(got_big, "drain mode must let B's whole-arena chunk through");
    }

    #[test]
    fn drain_blocks_eager_but_not_credit_backed_staging() {
        let mut s = sched(512, 4, 512, false);
        s.add_flow(Time::ZERO, flow("A", 1), &[64; 50]).unwrap();
        s.add_flow(Time::ZERO, flow("C", 1), &[64; 50]).unwrap();
        let mut live = s.schedule();
        s.add_flow(Time::ZERO, flow("B", 1), &[512]).unwrap();
        while s.drain_flow().is_none() {
            let g = live.remove(0);
            finish(&mut s, &g);
            live.extend(s.schedule());
        }
        assert_eq!(s.acquire_local(64, true), None);
        // Credit-backed staging still allowed when space exists.
        let g = live.remove(0);
        finish(&mut s, &g);
        assert!(s.acquire_local(64, false).is_some());
    }

    #[test]
    fn reclaim_defers_scattering_regions() {
        let mut s = sched(512, 4, 128, false);
        let f = flow("A", 1);
        s.add_flow(Time::ZERO, f.clone(), &[128, 128, 128]).unwrap();
        let g = s.schedule();
        s.begin_scatter(&f, g[0].credit.region).unwrap();
        let r = s.reclaim_flow(&f);
        assert_eq!((r.freed, r.orphaned), (2, 1));
        assert_eq!(s.owner(g[0].credit.region), Some(&Owner::Orphan));
        s.check_invariants().unwrap();
        // The orphan is not reusable until its scatter ends.
        assert_eq!(s.free_bytes(), 512 - 128);
        assert_eq!(
            s.finish_scatter(g[0].credit.region).unwrap(),
            ScatterEnd::Orphaned
        );
        assert_eq!(s.free_bytes(), 512);
        assert!(s.finish_scatter(g[0].credit.region).is_err());
    }

    #[test]
    fn quarantine_until_peer_forgotten() {
        let mut s = sched(512, 4, 128, false);
        let f = flow("A", 1);
        s.add_flow(Time::ZERO, f.clone(), &[128, 128]).unwrap();
        s.schedule();
        assert_eq!(
            s.idle_flows(Time::from_millis(5), Duration::from_millis(5)),
            vec![f.clone()]
        );
        let r = s.quarantine_flow(&f);
        assert_eq!(r.quarantined, 2);
        assert_eq!(s.held_bytes().quarantine, 256);
        s.check_invariants().unwrap();
        s.reclaim_peer(&PeerId::new("A"));
        assert_eq!(s.free_bytes(), 512);
    }

    #[test]
    fn eager_cap_is_half_the_arena() {
        let mut s = sched(1024, 4, 256, false);
        assert!(s.acquire_local(256, true).is_some());
        let b = s.acquire_local(256, true).unwrap();
        assert_eq!(s.acquire_local(64, true), None, "eager capped at half");
        assert!(
            s.acquire_local(256, false).is_some(),
            "credit-backed not capped"
        );
        s.promote_local(b).unwrap();
        assert!(s.acquire_local(64, true).is_some());
        s.check_invariants().unwrap();
    }

    #[test]
    fn reserve_serves_credit_backed_staging_when_full() {
        let mut s = sched(1024, 8, 256, true);
        assert_eq!(s.held_bytes().reserve, 256);
        s.add_flow(Time::ZERO, flow("A", 1), &[256; 8]).unwrap();
        assert_eq!(
            s.schedule().len(),
            3,
            "remote grants cannot take the reserve"
        );
        assert_eq!(s.acquire_local(64, true), None);
        let r = s.acquire_local(200, false).expect("reserve");
        assert_eq!(s.acquire_local(64, false), None);
        s.check_invariants().unwrap();
        s.release_local(r).unwrap();
        assert_eq!(s.held_bytes().reserve, 256);
        s.check_invariants().unwrap();
    }

    #[test]
    fn poisoned_arena_allocates_nothing() {
        let mut s = sched(1024, 8, 256, false);
        s.add_flow(Time::ZERO, flow("A", 1), &[256]).unwrap();
        s.poison();
        assert!(s.schedule().is_empty());
        assert_eq!(s.acquire_local(64, false), None);
    }

    #[test]
    fn wrong_owner_operations_are_errors() {
        let mut s = sched(1024, 8, 256, false);
        let f = flow("A", 1);
        s.add_flow(Time::ZERO, f.clone(), &[256]).unwrap();
        let g = s.schedule();
        let r = g[0].credit.region;
        assert!(s.release_local(r).is_err());
        assert!(s.begin_scatter(&flow("B", 1), r).is_err());
        assert!(s.finish_scatter(r).is_err());
        s.begin_scatter(&f, r).unwrap();
        assert!(s.begin_scatter(&f, r).is_err());
        assert!(s.promote_local(RegionHandle(999)).is_err());
    }

    proptest! {
        /// Random operation sequences keep every invariant, never exceed W,
        /// and a flow whose chunks fit is eventually served (no starvation).
        #[test]
        fn random_operations_keep_invariants(
            ops in proptest::collection::vec((0u8..8, 0usize..6, 1u64..300, any::<prop::sample::Index>()), 1..150),
            reserve in any::<bool>(),
            slots in 0u32..3,
        ) {
            let mut s = sched_standing(1024, 3, 256, reserve, slots, 64);
            let mut offered: Vec<(PeerId, Offer, RegionHandle, u64)> = Vec::new();
            let mut live: Vec<Grant> = Vec::new();
            let mut scattering: Vec<Grant> = Vec::new();
            let mut locals: Vec<RegionHandle> = Vec::new();
            let mut next_id = 0u64;
            for (op, who, bytes, pick) in ops {
                match op {
                    0 => {
                        next_id += 1;
                        let sizes: Vec<u64> = (0..(who + 1)).map(|i| (bytes * (i as u64 + 1)) % 256 + 1).collect();
                        s.add_flow(Time::ZERO, flow(&format!("p{who}"), next_id), &sizes).unwrap();
                    }
                    1 if !live.is_empty() => {
                        let g = live.swap_remove(pick.index(live.len()));
                        if s.begin_scatter(&g.flow, g.credit.region).is_ok() { scattering.push(g); }
                    }
                    2 if !scattering.is_empty() => {
                        let g = scattering.swap_remove(pick.index(scattering.len()));
                        s.finish_scatter(g.credit.region).unwrap();
                    }
                    3 => {
                        if let Some(r) = s.acquire_local(bytes, who % 2 == 0) { locals.push(r); }
                    }
                    4 if !locals.is_empty() => {
                        let r = locals.swap_remove(pick.index(locals.len()));
                        s.release_local(r).unwrap();
                    }
                    5 => {
                        let peer = PeerId::new(&format!("p{who}"));
                        s.reclaim_peer(&peer);
                        live.retain(|g| g.flow.peer != peer);
                    }
                    6 => {
                        s.assign_standing(&PeerId::new(&format!("p{who}")));
                    }
                    // A claim of an offer, live or spent (a stale one fails).
                    7 if !offered.is_empty() => {
                        let (peer, offer, region, len) = offered.swap_remove(pick.index(offered.len()));
                        next_id += 1;
                        let f = FlowId::write(peer, super::super::RequestId(next_id));
                        let sizes = [bytes % len + 1, bytes % 256 + 1];
                        if s.add_claimed_flow(Time::ZERO, f.clone(), &sizes, offer, region).is_ok() {
                            live.push(Grant {
                                flow: f,
                                credit: Credit { chunk: 0, region, len: sizes[0] },
                            });
                        }
                    }
                    _ => {}
                }
                offered.extend(s.standing_offers(|_| Some(0)));
                live.extend(s.schedule());
                s.check_invariants().map_err(TestCaseError::fail)?;
            }
            // Drain everything: all flows must finish (no starvation).
            for r in locals.drain(..) { s.release_local(r).unwrap(); }
            live.extend(s.schedule());
            for _ in 0..10_000 {
                if let Some(g) = scattering.pop() {
                    s.finish_scatter(g.credit.region).unwrap();
                } else if let Some(g) = live.pop() {
                    s.begin_scatter(&g.flow, g.credit.region).unwrap();
                    scattering.push(g);
                } else {
                    break;
                }
                live.extend(s.schedule());
                s.check_invariants().map_err(TestCaseError::fail)?;
            }
            prop_assert_eq!(s.flow_count(), 0);
            let held = s.held_bytes();
            prop_assert_eq!(s.free_bytes() + held.reserve + held.standing, 1024);
        }
    }
}
