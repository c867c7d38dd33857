//! The NIXL-notification control channel: control messages ride NIXL
//! notifications through the engine's inner UCX agent, so no TCP socket is
//! needed.
//!
//! The inner agent also carries the *user's* notifications (those NIXL
//! returns from `getNotifs`). A [`NotifHub`], shared by the engine and the
//! reactor, therefore drains the agent and splits what arrives: a message
//! that starts with [`CONTROL_PREFIX`] goes to the control queue (read by
//! [`NotifChannel::recv`]), anything else to the user queue (read by the
//! engine through [`NotifHub::take_user`], in arrival order per sender).
//!
//! Endpoints: `nixl:<inner agent name>`, optionally followed by a NUL byte
//! and the agent's serialized connection metadata. The full form is what a
//! channel advertises ([`ControlChannel::local_endpoint`]) and what travels
//! in every WANT: a receiver that never loaded the sender's metadata loads it
//! in `add_peer` and can then answer (the reverse-path bootstrap). The short
//! form is what [`Incoming::from`] carries (a notification only names its
//! sender); `add_peer` with it works once the agent's metadata has been
//! loaded, by this channel or by the engine.
//!
//! Liveness ([`NotifChannel::with_liveness`]): a notification to a dead
//! agent is never answered and nothing says so, so the channel keeps its
//! own heartbeats ([`super::heartbeat`]). It PINGs every peer it watches
//! every quarter of the timeout, answers every PING with a PONG, and counts
//! anything that arrives from a peer as heard. It watches the peers whose
//! handshake advertises `HEARTBEATS` ([`ControlChannel::watch_liveness`]) and
//! the registered peers that PING it (they answer heartbeats, by definition:
//! that is how an owner learns of readers it never loaded). A channel that
//! could not read for longer than a PING interval gives every peer a new
//! timeout ([`NotifChannel::note_poll`]). A heartbeat is a control
//! notification that starts with [`HEARTBEAT_MAGIC`], which no protocol
//! message does; it never reaches the protocol or the user queue. A PING
//! carries the sender's full endpoint, so a peer that never loaded the
//! sender can answer it (the same bootstrap as a WANT's).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sync::Locked;

use super::heartbeat::Heartbeats;
use super::{ControlChannel, ControlError, ControlKind, Endpoint, Incoming, PeerHandle, SendError};

/// The first bytes of every control message sent as a NIXL notification. A
/// user notification starting with these bytes would be taken for a control
/// message; they are chosen to make that practically impossible
/// (non-ASCII, non-UTF-8 first byte).
pub const CONTROL_PREFIX: [u8; 8] = *b"\xb0\x0bBNCctl";

/// The first bytes, after [`CONTROL_PREFIX`], of the channel's own
/// heartbeats (a protocol message starts with the wire magic, `NXBM`). Only
/// a peer whose handshake advertises `HEARTBEATS`, or that PINGed us, is
/// sent one: a build without heartbeats would drop it as malformed.
pub const HEARTBEAT_MAGIC: [u8; 4] = *b"NXHB";
/// A heartbeat's kind, the byte after [`HEARTBEAT_MAGIC`]. A PING carries
/// the sender's full endpoint after it; a PONG nothing.
const PING: u8 = 1;
const PONG: u8 = 2;

/// The endpoint scheme of this channel.
const SCHEME: &str = "nixl:";
const ENDPOINT_FORM: &str = "nixl:<agent>[\\0<metadata>]";
/// Longest accepted agent name.
const MAX_AGENT_NAME: usize = 1024;
/// Control messages held for the reactor before new ones are dropped.
const CONTROL_QUEUE_CAP: usize = 1 << 16;

/// A failed NIXL call, as seen by a [`NotifSource`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op} failed: {reason}")]
pub struct NotifError {
    /// What was attempted, e.g. `getNotifs`.
    pub op: String,
    /// Why it failed, printable.
    pub reason: String,
}

impl NotifError {
    fn new(op: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self {
            op: op.into(),
            reason: reason.to_string(),
        }
    }
}

/// Where notifications come from and go to: the inner NIXL agent in the
/// product (implemented for [`nixl_sys::Agent`]), a fake in unit tests.
pub trait NotifSource: Send + Sync {
    /// This agent's name (what peers pass to `send`).
    fn local_name(&self) -> String;
    /// This agent's serialized metadata, enough for a peer to send to it.
    fn local_metadata(&self) -> Result<Vec<u8>, NotifError>;
    /// Every notification received since the last call, as (sending agent,
    /// message), in arrival order per sender.
    fn fetch(&self) -> Result<Vec<(String, Vec<u8>)>, NotifError>;
    /// Sends one notification; must not block on the network.
    fn send(&self, to_agent: &str, msg: &[u8]) -> Result<(), NotifError>;
    /// Loads a peer's metadata; returns the agent name it describes.
    fn load_peer(&self, metadata: &[u8]) -> Result<String, NotifError>;
}

impl NotifSource for nixl_sys::Agent {
    fn local_name(&self) -> String {
        self.name()
    }

    fn local_metadata(&self) -> Result<Vec<u8>, NotifError> {
        self.get_local_md()
            .map_err(|e| NotifError::new("getLocalMD", e))
    }

    fn fetch(&self) -> Result<Vec<(String, Vec<u8>)>, NotifError> {
        let mut map = nixl_sys::NotificationMap::new()
            .map_err(|e| NotifError::new("allocating a notification map", e))?;
        self.get_notifications(&mut map, None)
            .map_err(|e| NotifError::new("getNotifs", e))?;
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(str::to_string))
            .collect();
        let mut out = Vec::new();
        for agent in agents {
            let n = map
                .get_notifications_size(&agent)
                .map_err(|e| NotifError::new("counting notifications", e))?;
            for i in 0..n {
                let msg = map
                    .get_notification_bytes(&agent, i)
                    .map_err(|e| NotifError::new("reading a notification", e))?;
                out.push((agent.clone(), msg));
            }
        }
        Ok(out)
    }

    fn send(&self, to_agent: &str, msg: &[u8]) -> Result<(), NotifError> {
        self.send_notification(to_agent, msg, None)
            .map_err(|e| NotifError::new(format!("genNotif to {to_agent:?}"), e))
    }

    fn load_peer(&self, metadata: &[u8]) -> Result<String, NotifError> {
        self.load_remote_md(metadata)
            .map_err(|e| NotifError::new("loadRemoteMD", e))
    }
}

/// Whether a received notification is a control message.
pub fn is_control(msg: &[u8]) -> bool {
    msg.starts_with(&CONTROL_PREFIX)
}

#[derive(Default)]
struct Queues {
    control: VecDeque<(String, Vec<u8>)>,
    user: VecDeque<(String, Vec<u8>)>,
    control_dropped: u64,
}

/// Splits the inner agent's notifications between the engine (user
/// notifications) and the control channel. Thread safe; share it in an
/// [`Arc`].
pub struct NotifHub {
    source: Arc<dyn NotifSource>,
    /// Held across `source.fetch()` and the split, so that two threads
    /// draining at once cannot reorder one sender's notifications.
    queues: Mutex<Queues>,
    control_arrived: Condvar,
    /// Set by [`NotifHub::wake`]; makes a waiting `recv` return early.
    woken: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for NotifHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifHub")
            .field("agent", &self.source.local_name())
            .finish_non_exhaustive()
    }
}

impl NotifHub {
    /// A hub over `source` (the inner agent).
    pub fn new(source: Arc<dyn NotifSource>) -> Self {
        Self {
            source,
            queues: Mutex::new(Queues::default()),
            control_arrived: Condvar::new(),
            woken: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The source this hub drains.
    pub fn source(&self) -> &Arc<dyn NotifSource> {
        &self.source
    }

    /// Pulls every pending notification from the source once and files each
    /// into the control or the user queue. Returns how many were pulled.
    pub fn drain(&self) -> Result<usize, NotifError> {
        let mut q = self.queues.locked();
        let fetched = self.source.fetch()?;
        let n = fetched.len();
        let mut control_added = false;
        for (from, msg) in fetched {
            if is_control(&msg) {
                if q.control.len() >= CONTROL_QUEUE_CAP {
                    q.control_dropped += 1;
                    tracing::warn!(from = %from, dropped_total = q.control_dropped, "control queue full; control notification dropped");
                    continue;
                }
                q.control
                    .push_back((from, msg[CONTROL_PREFIX.len()..].to_vec()));
                control_added = true;
            } else {
                q.user.push_back((from, msg));
            }
        }
        drop(q);
        if control_added {
            self.control_arrived.notify_all();
        }
        Ok(n)
    }

    /// Drains the source, then hands over every queued user notification as
    /// (sending agent, message), in arrival order per sender. This is what
    /// the engine's `getNotifs` returns. If draining fails, what was already
    /// queued stays queued and the error is returned.
    pub fn take_user(&self) -> Result<Vec<(String, Vec<u8>)>, NotifError> {
        self.drain()?;
        Ok(self.queues.locked().user.drain(..).collect())
    }

    /// Queues a user notification the engine synthesised (e.g. a bounce
    /// transfer's notification, delivered once its data was scattered). It is
    /// delivered after everything already queued from that sender.
    pub fn push_user(&self, from: impl Into<String>, msg: Vec<u8>) {
        self.queues.locked().user.push_back((from.into(), msg));
    }

    /// Pops the oldest control message (prefix removed), if any.
    pub fn take_control(&self) -> Option<(String, Vec<u8>)> {
        self.queues.locked().control.pop_front()
    }

    /// Takes the queued control messages (prefix removed) that `pick`
    /// chooses, in order, leaving the others queued in theirs.
    pub fn take_control_where(&self, pick: impl Fn(&[u8]) -> bool) -> Vec<(String, Vec<u8>)> {
        let mut q = self.queues.locked();
        let (taken, kept): (VecDeque<_>, VecDeque<_>) =
            q.control.drain(..).partition(|(_, m)| pick(m));
        q.control = kept;
        taken.into()
    }

    /// Waits up to `max` for a control message to be queued by any drainer.
    /// Wakes a `recv` waiting on this hub.
    pub fn wake(&self) {
        self.woken.store(true, std::sync::atomic::Ordering::SeqCst);
        let _q = self.queues.locked();
        self.control_arrived.notify_all();
    }

    fn take_wake(&self) -> bool {
        self.woken.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    fn wait_for_control(&self, max: Duration) {
        let q = self.queues.locked();
        if q.control.is_empty() && !self.woken.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = self.control_arrived.wait_timeout(q, max);
        }
    }
}

/// Builds a notification-channel endpoint: `nixl:<agent>`, plus `\0` and the
/// metadata when given.
pub fn notif_endpoint(agent: &str, metadata: Option<&[u8]>) -> Endpoint {
    let mut bytes =
        Vec::with_capacity(SCHEME.len() + agent.len() + 1 + metadata.map_or(0, <[u8]>::len));
    bytes.extend_from_slice(SCHEME.as_bytes());
    bytes.extend_from_slice(agent.as_bytes());
    if let Some(md) = metadata.filter(|md| !md.is_empty()) {
        bytes.push(0);
        bytes.extend_from_slice(md);
    }
    Endpoint::from_bytes(bytes)
}

/// Splits a notification-channel endpoint into the agent name and the
/// metadata (if carried), validating both.
pub fn parse_notif_endpoint(endpoint: &Endpoint) -> Result<(&str, Option<&[u8]>), ControlError> {
    let invalid = |reason: &str| ControlError::InvalidEndpoint {
        endpoint: endpoint.display_name(),
        expected: ENDPOINT_FORM,
        reason: reason.to_string(),
    };
    let rest = endpoint
        .as_bytes()
        .strip_prefix(SCHEME.as_bytes())
        .ok_or_else(|| invalid("the scheme must be nixl:"))?;
    let (name, metadata) = match rest.iter().position(|b| *b == 0) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..]).filter(|md| !md.is_empty())),
        None => (rest, None),
    };
    let name = std::str::from_utf8(name).map_err(|_| invalid("the agent name is not UTF-8"))?;
    if name.is_empty() {
        return Err(invalid("the agent name is empty"));
    }
    if name.len() > MAX_AGENT_NAME {
        return Err(invalid(&format!(
            "the agent name is longer than {MAX_AGENT_NAME} bytes"
        )));
    }
    Ok((name, metadata))
}

/// The NIXL-notification control channel (see the module docs).
pub struct NotifChannel {
    hub: Arc<NotifHub>,
    local: Endpoint,
    local_name: String,
    peers: HashMap<PeerHandle, String>,
    by_agent: HashMap<String, PeerHandle>,
    /// Agents whose metadata this channel loaded into the inner agent.
    loaded: HashSet<String>,
    next_peer: u64,
    /// The pause between polls while an exchange is under way (zero: the
    /// idle back-off always), and when one last was.
    active_poll: Duration,
    last_active: Option<Instant>,
    /// The liveness of the peers that answer heartbeats (`None`: off).
    heartbeats: Option<Heartbeats>,
    /// When the next PING is due (a check per `recv`, not a scan).
    next_beat: Option<Instant>,
    /// When this channel last read the inner agent: after a longer gap the
    /// silence was ours, not the peers' (see [`NotifChannel::note_poll`]).
    last_poll: Option<Instant>,
    /// This channel's PING: the framed heartbeat with its full endpoint.
    ping: Vec<u8>,
    pings_sent: u64,
}

/// How long after the last control message sent or received an exchange
/// counts as under way (the channel then polls every `active_poll`).
const ACTIVE_WINDOW: Duration = Duration::from_millis(5);

/// The idle back-off's first and longest pause between polls.
const FIRST_PAUSE: Duration = Duration::from_micros(50);
const LONGEST_PAUSE: Duration = Duration::from_millis(1);

impl std::fmt::Debug for NotifChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifChannel")
            .field("agent", &self.local_name)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl NotifChannel {
    /// A channel over `hub`'s agent. Its endpoint carries the agent's current
    /// metadata, so create it right after the inner agent's backend exists.
    pub fn new(hub: Arc<NotifHub>) -> Result<Self, ControlError> {
        let local_name = hub.source().local_name();
        let metadata = hub
            .source()
            .local_metadata()
            .map_err(|e| ControlError::Nixl {
                context: "reading the inner agent's metadata".into(),
                reason: e.to_string(),
            })?;
        let local = notif_endpoint(&local_name, Some(&metadata));
        let ping = [
            &CONTROL_PREFIX[..],
            &HEARTBEAT_MAGIC,
            &[PING],
            local.as_bytes(),
        ]
        .concat();
        Ok(Self {
            hub,
            local,
            local_name,
            peers: HashMap::new(),
            by_agent: HashMap::new(),
            loaded: HashSet::new(),
            next_peer: 1,
            active_poll: Duration::ZERO,
            last_active: None,
            heartbeats: None,
            next_beat: None,
            last_poll: None,
            ping,
            pings_sent: 0,
        })
    }

    /// Tracks the liveness of the peers that answer heartbeats against
    /// `timeout` (zero: off; PINGs are answered either way), as
    /// `peer_liveness_timeout_ms` does for ZMQ: see the module docs.
    pub fn with_liveness(mut self, timeout: Duration) -> Self {
        self.heartbeats = (!timeout.is_zero()).then(|| Heartbeats::new(timeout));
        self
    }

    /// Watches `peer` if liveness is on (idempotent).
    fn watch(&mut self, peer: PeerHandle) {
        if let Some(hb) = &mut self.heartbeats {
            if !hb.is_watched(peer) {
                let now = Instant::now();
                hb.watch(peer, now);
                self.next_beat = Some(now);
            }
        }
    }

    /// Records that the channel reads the inner agent now. A gap longer
    /// than a PING interval since the last read (the reactor was held, or
    /// the process descheduled or stopped) means nothing could be heard
    /// meanwhile: every watched peer's silence starts again now, so that our
    /// own deafness is not taken for theirs.
    fn note_poll(&mut self, now: Instant) {
        if let (Some(hb), Some(last)) = (&mut self.heartbeats, self.last_poll) {
            if now.saturating_duration_since(last) > hb.interval() {
                hb.excuse_all(now);
            }
        }
        self.last_poll = Some(now);
    }

    /// Sends the PINGs that are due.
    fn beat(&mut self, now: Instant) {
        let Some(hb) = &mut self.heartbeats else {
            return;
        };
        if self.next_beat.is_none_or(|t| t > now) {
            return;
        }
        for peer in hb.due(now) {
            if let Some(agent) = self.peers.get(&peer) {
                self.pings_sent += 1;
                if let Err(e) = self.hub.source().send(agent, &self.ping) {
                    // Its silence will tell; no warning every interval.
                    tracing::debug!(agent = %agent, error = %e, "notification control channel: PING not sent");
                }
            }
        }
        self.next_beat = hb.next_due();
    }

    /// Something arrived from `agent`.
    fn heard(&mut self, agent: &str) {
        let (Some(hb), Some(peer)) = (&mut self.heartbeats, self.by_agent.get(agent)) else {
            return;
        };
        if hb.heard(*peer, Instant::now()) {
            tracing::info!(
                agent,
                "notification control channel: the peer answers again; it is reachable"
            );
        }
    }

    /// Answers or counts one heartbeat (`msg` after [`CONTROL_PREFIX`],
    /// starting with [`HEARTBEAT_MAGIC`]) from `from`.
    fn on_heartbeat(&mut self, from: String, msg: &[u8]) {
        match msg.get(HEARTBEAT_MAGIC.len()) {
            Some(&PING) => {
                // It carries the sender's own endpoint, so that a peer that
                // never loaded the sender (an owner, of a reader) can answer.
                let endpoint = Endpoint::from_bytes(&msg[HEARTBEAT_MAGIC.len() + 1..]);
                let metadata = match parse_notif_endpoint(&endpoint) {
                    Ok((agent, metadata)) if agent == from => metadata,
                    Ok((agent, _)) => {
                        tracing::warn!(from = %from, agent, "notification control channel: a PING names another agent than its sender; dropped");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(from = %from, error = %e, "notification control channel: malformed PING dropped");
                        return;
                    }
                };
                // A peer that PINGs answers PINGs: a registered sender is
                // watched from now on, and heard, answered or not.
                if let Some(peer) = self.by_agent.get(&from).copied() {
                    self.watch(peer);
                }
                self.heard(&from);
                let pong = [&CONTROL_PREFIX[..], &HEARTBEAT_MAGIC, &[PONG]].concat();
                let source = self.hub.source();
                // The metadata is loaded only when the answer needs it, and
                // then whatever this channel loaded before (the inner agent
                // may have forgotten the sender since). It is not recorded
                // as this channel's: no handle holds it.
                let answered = source.send(&from, &pong).or_else(|e| match metadata {
                    Some(md) => source
                        .load_peer(md)
                        .and_then(|_| source.send(&from, &pong))
                        .map_err(|e| e.to_string()),
                    None => Err(e.to_string()),
                });
                if let Err(e) = answered {
                    tracing::debug!(agent = %from, error = %e, "notification control channel: cannot answer a PING");
                }
            }
            Some(&PONG) => self.heard(&from),
            _ => {
                tracing::debug!(from = %from, "notification control channel: heartbeat of an unknown kind dropped")
            }
        }
    }

    /// Answers the heartbeats queued for this channel now, leaving its
    /// protocol messages queued in order: for a reactor held away from
    /// `recv` (a forgotten peer's writes draining), so that its peers still
    /// hear it.
    fn service_heartbeats(&mut self) {
        if self.hub.drain().is_err() {
            return;
        }
        self.note_poll(Instant::now());
        for (from, msg) in self
            .hub
            .take_control_where(|m| m.starts_with(&HEARTBEAT_MAGIC))
        {
            self.on_heartbeat(from, &msg);
        }
        self.beat(Instant::now());
    }

    /// The next protocol message queued, answering the heartbeats before it.
    fn next_message(&mut self) -> Option<Incoming> {
        while let Some((from, msg)) = self.hub.take_control() {
            if msg.starts_with(&HEARTBEAT_MAGIC) {
                self.on_heartbeat(from, &msg);
                continue;
            }
            return Some(self.received((from, msg)));
        }
        None
    }

    /// Polls every `pause` (at most 1 ms; instead of backing off) while a
    /// control exchange is under way: within [`ACTIVE_WINDOW`] of the last
    /// message sent or received. A reply then waits for at most `pause` plus
    /// one drain, where the back-off left it up to 1 ms late
    /// (`notif_poll_us`). Under steady traffic the reactor thus polls the
    /// inner agent every `pause` all the time.
    pub fn with_active_poll(mut self, pause: Duration) -> Self {
        // Never slower than the idle back-off's longest pause.
        self.active_poll = pause.min(LONGEST_PAUSE);
        self
    }

    fn active(&self) -> bool {
        !self.active_poll.is_zero()
            && self
                .last_active
                .is_some_and(|t| t.elapsed() < ACTIVE_WINDOW)
    }

    fn received(&mut self, (from, payload): (String, Vec<u8>)) -> Incoming {
        self.last_active = Some(Instant::now());
        self.heard(&from);
        Incoming {
            from: notif_endpoint(&from, None),
            payload,
        }
    }

    /// The agent this channel sends from.
    pub fn local_agent(&self) -> &str {
        &self.local_name
    }

    /// Number of registered peers.
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    fn load_metadata(&mut self, agent: &str, metadata: &[u8]) -> Result<(), ControlError> {
        if self.loaded.contains(agent) {
            return Ok(());
        }
        let loaded = self
            .hub
            .source()
            .load_peer(metadata)
            .map_err(|e| ControlError::Nixl {
                context: format!("loading the metadata of peer agent {agent:?}"),
                reason: e.to_string(),
            })?;
        if loaded != agent {
            return Err(ControlError::InvalidEndpoint {
                endpoint: notif_endpoint(agent, None).display_name(),
                expected: ENDPOINT_FORM,
                reason: format!("its metadata describes agent {loaded:?}"),
            });
        }
        self.loaded.insert(agent.to_string());
        Ok(())
    }
}

impl ControlChannel for NotifChannel {
    fn local_endpoint(&self) -> &Endpoint {
        &self.local
    }

    fn add_peer(&mut self, endpoint: &Endpoint) -> Result<PeerHandle, ControlError> {
        let (agent, metadata) = parse_notif_endpoint(endpoint)?;
        if let Some(md) = metadata {
            self.load_metadata(agent, md)?;
        }
        if let Some(handle) = self.by_agent.get(agent) {
            return Ok(*handle);
        }
        let handle = PeerHandle::new(self.next_peer);
        self.next_peer += 1;
        tracing::debug!(%handle, agent, "notification control channel: peer added");
        self.by_agent.insert(agent.to_string(), handle);
        self.peers.insert(handle, agent.to_string());
        Ok(handle)
    }

    /// Forgets the peer. Its metadata stays loaded in the inner agent, which
    /// the data plane shares; invalidating it is the engine's decision.
    fn remove_peer(&mut self, peer: PeerHandle) -> bool {
        let Some(agent) = self.peers.remove(&peer) else {
            return false;
        };
        self.by_agent.remove(&agent);
        self.loaded.remove(&agent);
        if let Some(hb) = &mut self.heartbeats {
            hb.unwatch(peer);
        }
        tracing::debug!(handle = %peer, agent = %agent, "notification control channel: peer removed");
        true
    }

    fn send(&mut self, peer: PeerHandle, msg: &[u8]) -> Result<(), SendError> {
        let agent = self.peers.get(&peer).ok_or(SendError::UnknownPeer(peer))?;
        let mut framed = Vec::with_capacity(CONTROL_PREFIX.len() + msg.len());
        framed.extend_from_slice(&CONTROL_PREFIX);
        framed.extend_from_slice(msg);
        self.last_active = Some(Instant::now());
        self.hub.source().send(agent, &framed).map_err(|e| {
            tracing::warn!(agent = %agent, error = %e, "notification control channel: send failed; message dropped");
            SendError::Failed {
                endpoint: notif_endpoint(agent, None).display_name(),
                reason: format!("{e} (is the peer's metadata loaded? add it with the full endpoint from its WANT)"),
            }
        })
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Incoming>, ControlError> {
        let deadline = super::deadline_after(timeout);
        // NIXL has no blocking wait for notifications: poll the agent, every
        // `active_poll` while an exchange is under way, else backing off from
        // 50 us to 1 ms, and wake early when another thread's drain files a
        // control message.
        let mut pause = FIRST_PAUSE;
        loop {
            let now = Instant::now();
            self.note_poll(now);
            self.beat(now);
            if let Some(m) = self.next_message() {
                return Ok(Some(m));
            }
            self.hub.drain().map_err(|e| ControlError::Nixl {
                context: "reading notifications".into(),
                reason: e.to_string(),
            })?;
            if let Some(m) = self.next_message() {
                return Ok(Some(m));
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() || self.hub.take_wake() {
                return Ok(None);
            }
            if self.active() {
                self.hub.wait_for_control(self.active_poll.min(remaining));
            } else {
                self.hub.wait_for_control(pause.min(remaining));
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
        }
    }

    fn kind(&self) -> ControlKind {
        ControlKind::NixlNotif
    }

    fn watch_liveness(&mut self, peer: PeerHandle) {
        if self.peers.contains_key(&peer) {
            self.watch(peer);
        }
    }

    fn keep_alive(&mut self) {
        self.service_heartbeats();
    }

    fn pings_sent(&self) -> u64 {
        self.pings_sent
    }

    fn unreachable_peers(&mut self) -> Vec<PeerHandle> {
        let now = Instant::now();
        self.note_poll(now);
        self.beat(now);
        let Some(hb) = &mut self.heartbeats else {
            return Vec::new();
        };
        let mut down = Vec::new();
        for (peer, first) in hb.unreachable(now) {
            if let (Some(silent), Some(agent)) = (first, self.peers.get(&peer)) {
                tracing::warn!(agent = %agent, "notification control channel: no answer from the peer for {silent:?}; it is unreachable");
            }
            down.push(peer);
        }
        down
    }

    fn waker(&self) -> super::Waker {
        let hub = self.hub.clone();
        Arc::new(move || hub.wake())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-memory "fabric": agents with inboxes; `send` appends to the
    /// target's inbox when the sender has loaded the target's metadata.
    /// Notifications waiting for one agent: (sender, message).
    type Inbox = Vec<(String, Vec<u8>)>;

    #[derive(Default)]
    struct Fabric {
        inboxes: Mutex<HashMap<String, Inbox>>,
    }

    struct FakeAgent {
        name: String,
        fabric: Arc<Fabric>,
        known: Mutex<HashSet<String>>,
        fail_fetch: std::sync::atomic::AtomicBool,
        fetches: std::sync::atomic::AtomicUsize,
    }

    impl FakeAgent {
        fn new(fabric: &Arc<Fabric>, name: &str) -> Arc<Self> {
            fabric.inboxes.locked().insert(name.to_string(), Vec::new());
            Arc::new(Self {
                name: name.into(),
                fabric: fabric.clone(),
                known: Mutex::new(HashSet::new()),
                fail_fetch: Default::default(),
                fetches: Default::default(),
            })
        }

        /// Delivers a raw notification to this agent, as if `from` sent it.
        fn deliver(&self, from: &str, msg: &[u8]) {
            self.fabric
                .inboxes
                .locked()
                .get_mut(&self.name)
                .unwrap()
                .push((from.into(), msg.to_vec()));
        }
    }

    impl NotifSource for FakeAgent {
        fn local_name(&self) -> String {
            self.name.clone()
        }
        fn local_metadata(&self) -> Result<Vec<u8>, NotifError> {
            Ok(format!("md-of:{}", self.name).into_bytes())
        }
        fn fetch(&self) -> Result<Vec<(String, Vec<u8>)>, NotifError> {
            self.fetches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.fail_fetch.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(NotifError::new("getNotifs", "injected failure"));
            }
            Ok(std::mem::take(
                self.fabric.inboxes.locked().get_mut(&self.name).unwrap(),
            ))
        }
        fn send(&self, to_agent: &str, msg: &[u8]) -> Result<(), NotifError> {
            if !self.known.locked().contains(to_agent) {
                return Err(NotifError::new(
                    format!("genNotif to {to_agent:?}"),
                    "unknown remote agent",
                ));
            }
            let mut inboxes = self.fabric.inboxes.locked();
            let inbox = inboxes
                .get_mut(to_agent)
                .ok_or_else(|| NotifError::new("genNotif", "no such agent"))?;
            inbox.push((self.name.clone(), msg.to_vec()));
            Ok(())
        }
        fn load_peer(&self, metadata: &[u8]) -> Result<String, NotifError> {
            let name = std::str::from_utf8(metadata)
                .ok()
                .and_then(|s| s.strip_prefix("md-of:"))
                .ok_or_else(|| NotifError::new("loadRemoteMD", "bad metadata"))?;
            self.known.locked().insert(name.to_string());
            Ok(name.to_string())
        }
    }

    fn control(msg: &[u8]) -> Vec<u8> {
        [&CONTROL_PREFIX[..], msg].concat()
    }

    #[test]
    fn hub_splits_control_from_user_and_keeps_per_sender_order() {
        let fabric = Arc::new(Fabric::default());
        let a = FakeAgent::new(&fabric, "a");
        let hub = NotifHub::new(a.clone());
        a.deliver("x", b"user-x-1");
        a.deliver("x", &control(b"ctl-x-1"));
        a.deliver("y", b"user-y-1");
        a.deliver("x", b"user-x-2");
        a.deliver("y", &control(b"ctl-y-1"));
        a.deliver("x", &CONTROL_PREFIX[..4]); // a short user message is not control
        assert_eq!(hub.drain().unwrap(), 6);
        hub.push_user("y", b"synthesised".to_vec());
        a.deliver("x", b"user-x-3");

        let user = hub.take_user().unwrap();
        let of = |who: &str| -> Vec<Vec<u8>> {
            user.iter()
                .filter(|(f, _)| f == who)
                .map(|(_, m)| m.clone())
                .collect()
        };
        assert_eq!(
            of("x"),
            vec![
                b"user-x-1".to_vec(),
                b"user-x-2".to_vec(),
                CONTROL_PREFIX[..4].to_vec(),
                b"user-x-3".to_vec()
            ]
        );
        assert_eq!(of("y"), vec![b"user-y-1".to_vec(), b"synthesised".to_vec()]);
        assert_eq!(hub.take_control(), Some(("x".into(), b"ctl-x-1".to_vec())));
        assert_eq!(hub.take_control(), Some(("y".into(), b"ctl-y-1".to_vec())));
        assert_eq!(hub.take_control(), None);
        assert!(hub.take_user().unwrap().is_empty());
    }

    #[test]
    fn a_failed_drain_keeps_queued_user_notifications() {
        let fabric = Arc::new(Fabric::default());
        let a = FakeAgent::new(&fabric, "a");
        let hub = NotifHub::new(a.clone());
        a.deliver("x", b"kept");
        hub.drain().unwrap();
        a.fail_fetch
            .store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(hub.take_user().is_err());
        a.fail_fetch
            .store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            hub.take_user().unwrap(),
            vec![("x".to_string(), b"kept".to_vec())]
        );
    }

    #[test]
    fn concurrent_drainers_keep_per_sender_order() {
        let fabric = Arc::new(Fabric::default());
        let a = FakeAgent::new(&fabric, "a");
        let hub = Arc::new(NotifHub::new(a.clone()));
        let producer = {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..5000u32 {
                    if i % 3 == 0 {
                        a.deliver("s", &control(&i.to_le_bytes()));
                    } else {
                        a.deliver("s", &i.to_le_bytes());
                    }
                }
            })
        };
        let engine = {
            let hub = hub.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let deadline = Instant::now() + Duration::from_secs(20);
                while got.len() < 3333 && Instant::now() < deadline {
                    got.extend(
                        hub.take_user()
                            .unwrap()
                            .into_iter()
                            .map(|(_, m)| u32::from_le_bytes(m.try_into().unwrap())),
                    );
                }
                got
            })
        };
        let mut control_seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while control_seen.len() < 1667 && Instant::now() < deadline {
            hub.drain().unwrap();
            while let Some((_, m)) = hub.take_control() {
                control_seen.push(u32::from_le_bytes(m.try_into().unwrap()));
            }
        }
        producer.join().unwrap();
        let user_seen = engine.join().unwrap();
        assert_eq!(
            control_seen,
            (0..5000).filter(|i| i % 3 == 0).collect::<Vec<_>>()
        );
        assert_eq!(
            user_seen,
            (0..5000).filter(|i| i % 3 != 0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn channels_talk_over_the_reverse_path() {
        let fabric = Arc::new(Fabric::default());
        let a_agent = FakeAgent::new(&fabric, "a/bounce");
        let b_agent = FakeAgent::new(&fabric, "b/bounce");
        let a_hub = Arc::new(NotifHub::new(a_agent.clone()));
        let b_hub = Arc::new(NotifHub::new(b_agent.clone()));
        let mut a = NotifChannel::new(a_hub.clone()).unwrap();
        let mut b = NotifChannel::new(b_hub.clone()).unwrap();
        assert_eq!(a.kind(), ControlKind::NixlNotif);

        // A knows B's full endpoint (from B's handshake); B knows nothing of A.
        let to_b = a.add_peer(b.local_endpoint()).unwrap();
        assert_eq!(a.add_peer(b.local_endpoint()).unwrap(), to_b, "idempotent");
        a.send(to_b, b"WANT").unwrap();
        a_agent.send("b/bounce", b"user notification").unwrap();
        let got = b.recv(Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(got.payload, b"WANT");
        assert_eq!(got.from, notif_endpoint("a/bounce", None));

        // Replying to the short form fails until A's metadata is loaded...
        let short = b.add_peer(&got.from).unwrap();
        let err = b.send(short, b"GRANT").unwrap_err().to_string();
        assert!(err.contains("unknown remote agent"), "{err}");
        // ...which the full endpoint carried in the WANT does.
        let full = b.add_peer(a.local_endpoint()).unwrap();
        assert_eq!(full, short, "one handle per agent");
        b.send(full, b"GRANT").unwrap();
        let reply = a.recv(Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(
            (reply.from, reply.payload),
            (notif_endpoint("b/bounce", None), b"GRANT".to_vec())
        );

        // The user notification went to the engine's queue, not the channel.
        assert!(b.recv(Duration::from_millis(20)).unwrap().is_none());
        assert_eq!(
            b_hub.take_user().unwrap(),
            vec![("a/bounce".to_string(), b"user notification".to_vec())]
        );

        assert!(b.remove_peer(full));
        assert!(matches!(b.send(full, b"x"), Err(SendError::UnknownPeer(_))));
    }

    /// Two channels over the fake fabric with liveness against `timeout`;
    /// A has loaded B (B's handshake), B knows nothing of A.
    fn beating_pair(timeout: Duration) -> (NotifChannel, NotifChannel, Arc<NotifHub>) {
        // (Each pair has a fabric of its own.)
        let fabric = Arc::new(Fabric::default());
        let hub = |name| Arc::new(NotifHub::new(FakeAgent::new(&fabric, name)));
        let b_hub = hub("b/bounce");
        let a = NotifChannel::new(hub("a/bounce"))
            .unwrap()
            .with_liveness(timeout);
        let b = NotifChannel::new(b_hub.clone())
            .unwrap()
            .with_liveness(timeout);
        (a, b, b_hub)
    }

    /// Runs the channels that are alive for `span`; no protocol message may
    /// surface meanwhile (heartbeats are the channel's own).
    fn run_for(span: Duration, live: &mut [&mut NotifChannel]) {
        let end = Instant::now() + span;
        while Instant::now() < end {
            for ch in live.iter_mut() {
                assert!(ch.recv(Duration::from_millis(2)).unwrap().is_none());
            }
        }
    }

    #[test]
    fn heartbeats_find_a_silent_peer_unreachable_both_ways_and_see_it_come_back() {
        const T: Duration = Duration::from_millis(200);
        let (mut a, mut b, b_hub) = beating_pair(T);
        let to_b = a.add_peer(b.local_endpoint()).unwrap();
        a.watch_liveness(to_b); // B's handshake advertises HEARTBEATS
        run_for(T * 2, &mut [&mut a, &mut b]);
        assert!(a.unreachable_peers().is_empty(), "B answers");
        assert!(
            b_hub.take_user().unwrap().is_empty(),
            "heartbeats are not user notifications"
        );

        // A PINGs, so it answers PINGs: once B registers A (the reverse path
        // of a WANT or a READ), A's next PING makes B watch it too.
        let to_a = b.add_peer(&notif_endpoint("a/bounce", None)).unwrap();
        run_for(T * 2, &mut [&mut a, &mut b]);
        assert!(a.unreachable_peers().is_empty() && b.unreachable_peers().is_empty());

        // B stops (its channel is not polled): A finds it unreachable after
        // the timeout, and keeps saying so.
        run_for(T + T / 2, &mut [&mut a]);
        assert_eq!(a.unreachable_peers(), vec![to_b]);
        assert_eq!(a.unreachable_peers(), vec![to_b]);
        // B resumes: A hears it again. B, which could hear nothing while it
        // did not read, does not take its own deafness for A's silence.
        assert!(b.unreachable_peers().is_empty());
        run_for(T, &mut [&mut a, &mut b]);
        assert!(a.unreachable_peers().is_empty() && b.unreachable_peers().is_empty());

        // Now A stops: B, which never loaded A, finds it unreachable.
        run_for(T + T / 2, &mut [&mut b]);
        assert_eq!(b.unreachable_peers(), vec![to_a]);
        // A removed peer is forgotten, its liveness with it.
        assert!(b.remove_peer(to_a));
        assert!(b.unreachable_peers().is_empty());
    }

    #[test]
    fn a_peer_not_known_to_answer_heartbeats_is_never_pinged_nor_found_unreachable() {
        const T: Duration = Duration::from_millis(100);
        let (mut a, b, b_hub) = beating_pair(T);
        // B's handshake lacks HEARTBEATS (an older build): no watch.
        let to_b = a.add_peer(b.local_endpoint()).unwrap();
        run_for(T * 4, &mut [&mut a]);
        assert!(a.unreachable_peers().is_empty());
        b_hub.drain().unwrap();
        assert!(b_hub.take_control().is_none(), "B was sent a heartbeat");
        // Liveness off: a watched peer is not pinged either.
        let (a2, b2, b2_hub) = beating_pair(Duration::ZERO);
        let mut a2 = a2;
        let to_b2 = a2.add_peer(b2.local_endpoint()).unwrap();
        a2.watch_liveness(to_b2);
        run_for(T * 2, &mut [&mut a2]);
        assert!(a2.unreachable_peers().is_empty());
        b2_hub.drain().unwrap();
        assert!(b2_hub.take_control().is_none());
        assert!(a.remove_peer(to_b));
    }

    #[test]
    fn forged_and_malformed_heartbeats_are_dropped_unanswered_and_a_ping_loads_its_sender() {
        let fabric = Arc::new(Fabric::default());
        let a_agent = FakeAgent::new(&fabric, "a/bounce");
        let b_agent = FakeAgent::new(&fabric, "b/bounce");
        let b_hub = Arc::new(NotifHub::new(b_agent.clone()));
        let mut b = NotifChannel::new(b_hub.clone())
            .unwrap()
            .with_liveness(Duration::from_secs(10));
        // B could answer A: a wrong answer would show in A's inbox.
        b_agent.load_peer(b"md-of:a/bounce").unwrap();
        let beat = |rest: &[u8]| [&CONTROL_PREFIX[..], &HEARTBEAT_MAGIC, rest].concat();
        let ping_of = |agent: &str| {
            let md = format!("md-of:{agent}");
            [
                &[PING][..],
                notif_endpoint(agent, Some(md.as_bytes())).as_bytes(),
            ]
            .concat()
        };
        // As if A sent them: a PING naming another agent, a PING without an
        // endpoint, a heartbeat of an unknown kind.
        for rest in [ping_of("c/bounce"), vec![PING], vec![9]] {
            b_agent.deliver("a/bounce", &beat(&rest));
        }
        assert!(b.recv(Duration::from_millis(20)).unwrap().is_none());
        assert!(
            a_agent.fetch().unwrap().is_empty(),
            "something was answered"
        );
        assert!(!b_agent.known.locked().contains("c/bounce"));
        // A real PING from an agent the inner agent forgot (or never
        // loaded): B loads the metadata it carries and answers.
        b_agent.known.locked().clear();
        b_agent.deliver("a/bounce", &beat(&ping_of("a/bounce")));
        assert!(b.recv(Duration::from_millis(20)).unwrap().is_none());
        assert_eq!(
            a_agent.fetch().unwrap(),
            vec![("b/bounce".to_string(), beat(&[PONG]))]
        );
        assert!(b_hub.take_user().unwrap().is_empty());
    }

    #[test]
    fn keep_alive_answers_heartbeats_and_leaves_protocol_messages_queued_in_order() {
        let fabric = Arc::new(Fabric::default());
        let a_agent = FakeAgent::new(&fabric, "a/bounce");
        let b_agent = FakeAgent::new(&fabric, "b/bounce");
        let mut b = NotifChannel::new(Arc::new(NotifHub::new(b_agent.clone())))
            .unwrap()
            .with_liveness(Duration::from_secs(10));
        let a_endpoint = notif_endpoint("a/bounce", Some(b"md-of:a/bounce"));
        let ping = [
            &CONTROL_PREFIX[..],
            &HEARTBEAT_MAGIC,
            &[PING],
            a_endpoint.as_bytes(),
        ]
        .concat();
        b_agent.deliver("a/bounce", &control(b"WANT 1"));
        b_agent.deliver("a/bounce", &ping);
        b_agent.deliver("a/bounce", &control(b"WANT 2"));
        // A reactor held away from recv (a forgotten peer's writes draining).
        b.keep_alive();
        let pong = [&CONTROL_PREFIX[..], &HEARTBEAT_MAGIC, &[PONG]].concat();
        assert_eq!(
            a_agent.fetch().unwrap(),
            vec![("b/bounce".to_string(), pong)]
        );
        let got: Vec<Vec<u8>> = (0..2)
            .map(|_| b.recv(Duration::from_millis(20)).unwrap().unwrap().payload)
            .collect();
        assert_eq!(got, vec![b"WANT 1".to_vec(), b"WANT 2".to_vec()]);
        assert!(b.recv(Duration::from_millis(5)).unwrap().is_none());
    }

    #[test]
    fn recv_times_out_promptly() {
        let fabric = Arc::new(Fabric::default());
        let mut a =
            NotifChannel::new(Arc::new(NotifHub::new(FakeAgent::new(&fabric, "a")))).unwrap();
        let t = Instant::now();
        assert!(a.recv(Duration::from_millis(30)).unwrap().is_none());
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(30) && took < Duration::from_secs(1),
            "{took:?}"
        );
        assert!(a.recv(Duration::ZERO).unwrap().is_none());
        let to_self = a.add_peer(&a.local_endpoint().clone()).unwrap();
        a.send(to_self, b"self").unwrap();
        assert_eq!(a.recv(Duration::MAX).unwrap().unwrap().payload, b"self");
    }

    #[test]
    fn endpoints_are_validated() {
        let fabric = Arc::new(Fabric::default());
        let mut a =
            NotifChannel::new(Arc::new(NotifHub::new(FakeAgent::new(&fabric, "a")))).unwrap();
        for (input, expected) in [
            (&b"tcp://127.0.0.1:5"[..], "scheme must be nixl:"),
            (b"nixl:", "agent name is empty"),
            (b"nixl:\0md-of:x", "agent name is empty"),
            (b"nixl:\xff", "not UTF-8"),
            (b"nixl:x\0garbage", "bad metadata"),
            (b"nixl:x\0md-of:y", "describes agent \"y\""),
        ] {
            let err = a
                .add_peer(&Endpoint::from_bytes(input))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{input:?}: {err}");
        }
        let long = format!("nixl:{}", "n".repeat(2000));
        assert!(a
            .add_peer(&Endpoint::from(long))
            .unwrap_err()
            .to_string()
            .contains("longer than"));
        assert_eq!(a.peer_count(), 0);
        let (name, md) = parse_notif_endpoint(a.local_endpoint()).unwrap();
        assert_eq!((name, md), ("a", Some(&b"md-of:a"[..])));
        assert_eq!(
            a.local_endpoint().display_name(),
            "nixl:a (+8 bytes of metadata)"
        );
    }

    /// Within the active window after a message, `recv` polls every
    /// `active_poll`; an idle channel (or `active_poll` zero) backs off from
    /// 50 us to 1 ms. Counted as the source's fetches during one 8 ms wait
    /// (the back-off makes 13 at most; the tight poll many more, even on a
    /// loaded machine).
    #[test]
    fn an_exchange_under_way_is_polled_tightly_and_an_idle_channel_backs_off() {
        // As on the IO thread, where the channel runs.
        crate::runtime::precise_timers();
        let fabric = Arc::new(Fabric::default());
        let fetches_in_one_wait = |name: &str, active: Duration, recent: bool| {
            let agent = FakeAgent::new(&fabric, name);
            let mut ch = NotifChannel::new(Arc::new(NotifHub::new(agent.clone())))
                .unwrap()
                .with_active_poll(active);
            if recent {
                ch.last_active = Some(Instant::now());
            }
            let before = agent.fetches.load(std::sync::atomic::Ordering::Relaxed);
            assert!(ch.recv(Duration::from_millis(8)).unwrap().is_none());
            agent.fetches.load(std::sync::atomic::Ordering::Relaxed) - before
        };
        // A machine loaded by other tests can hold this thread for whole
        // 8 ms waits: the comparison gets three tries (a back-off that polled
        // too often would fail every one).
        let mut seen = Vec::new();
        for attempt in 0..3 {
            let tight =
                fetches_in_one_wait(&format!("tight{attempt}"), Duration::from_micros(10), true);
            let off = fetches_in_one_wait(&format!("off{attempt}"), Duration::ZERO, true);
            let idle =
                fetches_in_one_wait(&format!("idle{attempt}"), Duration::from_micros(10), false);
            for (what, n) in [("notif_poll_us=0", off), ("idle", idle)] {
                assert!(
                    n <= 14,
                    "{what}: {n} fetches in 8 ms; the back-off makes 13 at most"
                );
            }
            if tight > 2 * off.max(idle) {
                return;
            }
            seen.push((tight, off, idle));
        }
        panic!("under way, (fetches in 8 ms, against backing off with notif_poll_us=0 / idle): {seen:?}");
    }
}
