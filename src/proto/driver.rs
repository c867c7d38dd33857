//! A driver that plays the runtime for endpoints in tests.
//!
//! [`Pair`] holds two [`Node`]s (an [`Endpoint`] with simulated
//! application memory and arena) and carries out what their actions ask
//! for: control messages are encoded, checked to round-trip and decoded on
//! the way; gathers, writes and scatters move bytes in the simulated
//! memory; outcomes and the other actions are recorded. Nothing moves
//! until the test says so, one kind of step at a time ([`Pair::deliver`],
//! [`Pair::gather`], [`Pair::write`], [`Pair::scatter`]) or until all is
//! quiet ([`Pair::drive`]), so a test can stop anywhere and inject the
//! event it is about. The model is quinn-proto's `tests/util.rs` `Pair`.
//!
//! [`Memory`] (the byte moves) and [`carry`] (the codec check) are also
//! what the simulation (`tests/sim.rs`) runs its randomly timed, randomly
//! failing operations with.

use std::collections::VecDeque;
use std::time::Duration;

use super::endpoint::{Action, Endpoint};
use super::plan::Descriptor;
use super::wire::Message;
use super::{ChunkRef, FlowId, Outcome, PeerId, RegionHandle, RequestId, Run, Runs, Time};
use crate::splitmix::SplitMix64;

/// Encodes `message` for the wire and checks that it decodes to itself:
/// to the same runs, or, for a list kept as packed copies, to the copies'
/// own runs (the plan may hold two contiguous copies as one run twice as
/// long: the same bytes, `Copies::same_copies_as`).
pub fn carry(message: &Message) -> Result<Vec<u8>, String> {
    let bytes = message.encode();
    match Message::decode(&bytes) {
        Ok(back) if back == *message || back == as_sent(message) => Ok(bytes),
        Ok(back) => Err(format!("{message:?} decodes as {back:?}")),
        Err(e) => Err(format!("{message:?} does not decode: {e}")),
    }
}

/// `message` with each run list kept as packed copies replaced by the
/// copies' own runs: what the wire carries.
fn as_sent(message: &Message) -> Message {
    let own = |runs: &Runs| match runs.copies() {
        Some(c) => Runs::from_copies(c.clone()),
        None => runs.clone(),
    };
    let mut m = message.clone();
    match &mut m {
        Message::Data { runs, .. } => *runs = own(runs),
        Message::Read { chunks, .. } => {
            for c in chunks {
                c.runs = own(&c.runs);
            }
        }
        _ => {}
    }
    m
}

/// One agent's simulated memory: the application's bytes (addressed from
/// 0) and its arena (addressed by region offset).
#[derive(Clone)]
pub struct Memory {
    /// Application memory.
    pub mem: Vec<u8>,
    /// The bounce arena.
    pub arena: Vec<u8>,
}

impl Memory {
    /// `mem_len` bytes of application memory filled from `seed`, and a
    /// zeroed arena of `arena_len` bytes.
    pub fn new(mem_len: usize, arena_len: usize, seed: u64) -> Memory {
        let mut rng = SplitMix64::new(seed);
        let mut mem = vec![0u8; mem_len];
        for word in mem.chunks_mut(8) {
            word.copy_from_slice(&rng.next_u64().to_le_bytes()[..word.len()]);
        }
        Memory {
            mem,
            arena: vec![0u8; arena_len],
        }
    }

    /// A gather: copies `runs` from application memory below `readable`
    /// into `region`.
    pub fn gather(
        &mut self,
        region: RegionHandle,
        runs: &[Run],
        readable: u64,
    ) -> Result<(), String> {
        for (off, addr, len) in runs.iter().flat_map(Run::copies) {
            let from = span(addr, len, readable.min(self.mem.len() as u64))
                .ok_or_else(|| format!("gather reads [{addr}, +{len}), outside readable memory"))?;
            let to = span(region.0 + off, len, self.arena.len() as u64).ok_or_else(|| {
                format!("gather into {region}+{off} ({len} bytes) leaves the arena")
            })?;
            self.arena[to].copy_from_slice(&self.mem[from]);
        }
        Ok(())
    }

    /// A scatter: copies `(region_offset, addr, len)` out of `region` into
    /// application memory.
    pub fn scatter(
        &mut self,
        region: RegionHandle,
        copies: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), String> {
        for (off, addr, len) in copies {
            let from = span(region.0 + off, len, self.arena.len() as u64).ok_or_else(|| {
                format!("scatter from {region}+{off} ({len} bytes) leaves the arena")
            })?;
            let to = span(addr, len, self.mem.len() as u64)
                .ok_or_else(|| format!("scatter writes [{addr}, +{len}), outside memory"))?;
            let bytes = self.arena[from].to_vec();
            self.mem[to].copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// The `len` staged bytes of local region `local` (a write's source).
    pub fn staged(&self, local: RegionHandle, len: u64) -> Result<&[u8], String> {
        let at = span(local.0, len, self.arena.len() as u64)
            .ok_or_else(|| format!("write source {local} ({len} bytes) leaves the arena"))?;
        Ok(&self.arena[at])
    }

    /// A write landing: `bytes` into region `remote` of this arena.
    pub fn land(&mut self, remote: RegionHandle, bytes: &[u8]) -> Result<(), String> {
        let at = span(remote.0, bytes.len() as u64, self.arena.len() as u64).ok_or_else(|| {
            format!(
                "write into {remote} ({} bytes) leaves the arena",
                bytes.len()
            )
        })?;
        self.arena[at].copy_from_slice(bytes);
        Ok(())
    }
}

/// `[at, at + len)` as an index range, if it ends at or below `limit`.
fn span(at: u64, len: u64, limit: u64) -> Option<std::ops::Range<usize>> {
    let end = at.checked_add(len).filter(|&e| e <= limit)?;
    Some(usize::try_from(at).ok()?..usize::try_from(end).ok()?)
}

/// A gather an endpoint started and the driver has not finished.
#[derive(Clone, Debug)]
pub struct Gather {
    /// The chunk.
    pub chunk: ChunkRef,
    /// Its staging region.
    pub region: RegionHandle,
    /// The copies.
    pub runs: Runs,
}

/// A write an endpoint posted and the driver has not finished.
#[derive(Clone, Debug)]
pub struct Write {
    /// The chunk.
    pub chunk: ChunkRef,
    /// The agent written to.
    pub peer: PeerId,
    /// The staged source.
    pub local: RegionHandle,
    /// The region written.
    pub remote: RegionHandle,
    /// Bytes.
    pub len: u64,
}

/// A scatter an endpoint started and the driver has not finished.
#[derive(Clone, Debug)]
pub struct Scatter {
    /// The flow.
    pub flow: FlowId,
    /// Its chunk.
    pub chunk: u32,
    /// The region scattered from.
    pub region: RegionHandle,
    /// The copies.
    pub runs: Runs,
}

/// An endpoint, its memory, and what its actions left to the driver.
pub struct Node {
    /// The agent's name (what its peer knows it by).
    pub name: PeerId,
    /// The endpoint.
    pub ep: Endpoint,
    /// Its memory.
    pub memory: Memory,
    /// Control messages on their way to this node (sender, bytes), oldest
    /// first.
    pub inbound: VecDeque<(PeerId, Vec<u8>)>,
    /// Gathers running.
    pub gathers: VecDeque<Gather>,
    /// Writes running.
    pub writes: VecDeque<Write>,
    /// Scatters running.
    pub scatters: VecDeque<Scatter>,
    /// Outcomes, in order.
    pub completed: Vec<(RequestId, Outcome)>,
    /// Every message sent, in order.
    pub sent: Vec<Message>,
    /// The other actions (`Connect`, `LoadDataPath`, `ForgetPeer`,
    /// `Poisoned`), in order.
    pub events: Vec<Action>,
}

/// Application memory of each node: the tests' descriptors lie below it.
const MEM: usize = 64 * 1024;

impl Node {
    fn new(name: &str, ep: Endpoint, seed: u64) -> Node {
        let arena = usize::try_from(ep.config().arena_capacity).expect("arena fits memory");
        Node {
            name: PeerId::new(name),
            memory: Memory::new(MEM, arena, seed),
            ep,
            inbound: VecDeque::new(),
            gathers: VecDeque::new(),
            writes: VecDeque::new(),
            scatters: VecDeque::new(),
            completed: Vec::new(),
            sent: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Whether nothing was recorded and nothing runs: no message sent, no
    /// outcome, no other action, no copy (messages on their way to it
    /// aside).
    pub fn is_quiet(&self) -> bool {
        self.sent.is_empty()
            && self.completed.is_empty()
            && self.events.is_empty()
            && self.gathers.is_empty()
            && self.writes.is_empty()
            && self.scatters.is_empty()
    }

    /// Takes the messages sent since the last call.
    pub fn take_sent(&mut self) -> Vec<Message> {
        std::mem::take(&mut self.sent)
    }

    /// Takes the outcomes reported since the last call.
    pub fn take_completed(&mut self) -> Vec<(RequestId, Outcome)> {
        std::mem::take(&mut self.completed)
    }

    /// Takes the other actions seen since the last call.
    pub fn take_events(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.events)
    }

    /// Whether every destination of `descs` in this node holds the bytes
    /// of its source in `source`.
    pub fn holds_copy_of(&self, source: &Node, descs: &[Descriptor]) -> bool {
        descs.iter().all(|d| {
            let (s, t) = (d.src_addr as usize, d.dst_addr as usize);
            let len = d.len as usize;
            source.memory.mem[s..s + len] == self.memory.mem[t..t + len]
        })
    }
}

/// One of a [`Pair`]'s two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The first node.
    A,
    /// The second node.
    B,
}

/// Two endpoints and the runtime between them.
pub struct Pair {
    /// The first node.
    pub a: Node,
    /// The second node.
    pub b: Node,
    /// Virtual time: every step the driver takes advances it by 1 us.
    pub now: Time,
}

impl Pair {
    /// Two nodes named `a` and `b` around the given endpoints.
    pub fn new(a: (&str, Endpoint), b: (&str, Endpoint)) -> Pair {
        Pair {
            a: Node::new(a.0, a.1, 1),
            b: Node::new(b.0, b.1, 2),
            now: Time::ZERO,
        }
    }

    /// The node on `side`.
    pub fn node(&mut self, side: Side) -> &mut Node {
        match side {
            Side::A => &mut self.a,
            Side::B => &mut self.b,
        }
    }

    /// The node on `side` and the other one.
    fn both(&mut self, side: Side) -> (&mut Node, &mut Node) {
        match side {
            Side::A => (&mut self.a, &mut self.b),
            Side::B => (&mut self.b, &mut self.a),
        }
    }

    fn tick(&mut self) -> Time {
        self.now = self.now.after(Duration::from_micros(1));
        self.now
    }

    /// Takes both endpoints' actions (messages go to the other node's
    /// inbound queue, copies to the queues of their kind), then checks both
    /// endpoints' invariants: after every step the driver takes, and
    /// after whatever a test did to an endpoint before calling it.
    pub fn poll(&mut self) {
        for side in [Side::A, Side::B] {
            let (node, other) = self.both(side);
            while let Some(action) = node.ep.poll_action() {
                match action {
                    Action::Send { peer, message } => {
                        assert_eq!(peer, other.name, "{} sends to a stranger", node.name);
                        let bytes = carry(&message).unwrap_or_else(|e| panic!("{e}"));
                        other.inbound.push_back((node.name.clone(), bytes));
                        node.sent.push(message);
                    }
                    Action::StartGather {
                        chunk,
                        region,
                        runs,
                    } => node.gathers.push_back(Gather {
                        chunk,
                        region,
                        runs,
                    }),
                    Action::PostWrite {
                        chunk,
                        peer,
                        local,
                        remote,
                        len,
                    } => node.writes.push_back(Write {
                        chunk,
                        peer,
                        local,
                        remote,
                        len,
                    }),
                    Action::StartScatter {
                        flow,
                        chunk,
                        region,
                        runs,
                    } => node.scatters.push_back(Scatter {
                        flow,
                        chunk,
                        region,
                        runs,
                    }),
                    Action::Complete { request, outcome } => {
                        node.completed.push((request, outcome));
                    }
                    other => node.events.push(other),
                }
            }
        }
        for node in [&self.a, &self.b] {
            node.ep
                .check_invariants()
                .unwrap_or_else(|e| panic!("{}: {e}", node.name));
        }
    }

    /// Takes the queue `queue` of `side`'s node and carries out each entry
    /// with `each` (one tick apart); how many there were.
    fn finish<T>(
        &mut self,
        side: Side,
        queue: fn(&mut Node) -> &mut VecDeque<T>,
        mut each: impl FnMut(&mut Node, &mut Node, Time, &T),
    ) -> usize {
        self.poll();
        let ops = std::mem::take(queue(self.node(side)));
        for op in &ops {
            let now = self.tick();
            let (node, other) = self.both(side);
            each(node, other, now, op);
        }
        self.poll();
        ops.len()
    }

    /// Delivers every message queued to `to`; returns how many.
    pub fn deliver(&mut self, to: Side) -> usize {
        self.finish(
            to,
            |n| &mut n.inbound,
            |node, _, now, (from, bytes)| {
                node.ep
                    .handle_control(now, from, bytes)
                    .unwrap_or_else(|e| {
                        panic!("{}: carried bytes failed to decode: {e}", node.name)
                    });
            },
        )
    }

    /// Finishes every gather running on `side`, moving its bytes; returns
    /// how many.
    pub fn gather(&mut self, side: Side) -> usize {
        self.finish(
            side,
            |n| &mut n.gathers,
            |node, _, now, g| {
                node.memory
                    .gather(g.region, &g.runs, u64::MAX)
                    .unwrap_or_else(|e| panic!("{}: {e}", node.name));
                node.ep.handle_gather_done(now, g.chunk);
            },
        )
    }

    /// Finishes every write running on `side`, landing its bytes in the
    /// other node's arena; returns how many.
    pub fn write(&mut self, side: Side) -> usize {
        self.finish(
            side,
            |n| &mut n.writes,
            |node, other, now, w| {
                assert_eq!(w.peer, other.name, "{} writes to a stranger", node.name);
                let bytes = node.memory.staged(w.local, w.len).map(<[u8]>::to_vec);
                bytes
                    .and_then(|b| other.memory.land(w.remote, &b))
                    .unwrap_or_else(|e| panic!("{}: {e}", node.name));
                node.ep.handle_write_done(now, w.chunk);
            },
        )
    }

    /// Finishes every scatter running on `side`, moving its bytes; returns
    /// how many.
    pub fn scatter(&mut self, side: Side) -> usize {
        self.finish(
            side,
            |n| &mut n.scatters,
            |node, _, now, s| {
                node.memory
                    .scatter(s.region, s.runs.iter().flat_map(Run::copies))
                    .unwrap_or_else(|e| panic!("{}: {e}", node.name));
                node.ep.handle_scatter_done(now, s.region);
            },
        )
    }

    /// One round: delivers, then finishes the gathers, writes and scatters
    /// running, on both sides; whether anything happened.
    pub fn step(&mut self) -> bool {
        let mut done = 0;
        for side in [Side::A, Side::B] {
            done += self.deliver(side);
            done += self.gather(side);
            done += self.write(side);
            done += self.scatter(side);
        }
        done > 0
    }

    /// Steps until nothing is left to carry.
    pub fn drive(&mut self) {
        for _ in 0..10_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the pair did not settle in 10,000 steps");
    }
}
