//! Control channels: how the credit protocol's messages (the eleven of
//! [`crate::proto::wire::MessageType`]: WANT / GRANT / DATA / ACK / REFUSE for
//! a WRITE, their six READ counterparts; a cancel is an empty WANT) travel
//! between two bounce engines.
//!
//! A [`ControlChannel`] is an unreliable, per-peer FIFO datagram pipe used by
//! exactly one thread (the engine's reactor). Three implementations exist and
//! the choice must match on both sides (the handshake checks [`ControlKind`]):
//!
//! - [`tcp::TcpChannel`] (default): a listener bound to a routable
//!   address receives; one outgoing connection per peer sends, over TCP
//!   sockets the reactor owns (no transport thread between the reactor and
//!   the kernel: two thread wake-ups a round trip instead of ZMQ's six).
//!   Endpoints look like `tcp://10.0.0.7:41234` or `tcp://[fd00::7]:41234`.
//! - [`zmq::ZmqChannel`]: the same endpoints and shape with ZMQ sockets: a
//!   ROUTER receives, one DEALER per peer sends.
//! - [`notif::NotifChannel`]: messages ride NIXL notifications through the
//!   engine's inner UCX agent (no TCP). Endpoints name the peer's inner agent
//!   and may carry its connection metadata (see [`notif`]).
//!
//! All three identify the sender of every message by the sender's own endpoint
//! ([`Incoming::from`]), so a receiver can answer on the reverse path with
//! `add_peer(&incoming.from)` even if it never loaded the sender's metadata.
//!
//! Delivery is best effort: `send` never blocks and drops (returning
//! [`SendError::WouldBlock`]) when the peer's queue is full. The protocol
//! above recovers through its request timeouts.

use std::fmt;
use std::time::Duration;

pub mod heartbeat;
pub mod notif;
pub mod tcp;
pub mod zmq;

pub use self::notif::{NotifChannel, NotifHub, NotifSource};

pub use self::tcp::{TcpChannel, TcpConfig};
pub use self::zmq::{BindSpec, ZmqChannel, ZmqConfig};

/// Which transport carries the control messages. Both peers must use the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControlKind {
    /// ZMQ over TCP ([`zmq::ZmqChannel`]).
    Zmq,
    /// NIXL notifications through the inner agent ([`notif::NotifChannel`]).
    NixlNotif,
    /// TCP sockets the reactor owns ([`tcp::TcpChannel`]).
    Tcp,
}

impl ControlKind {
    /// The kind's stable name, as used in configuration and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ControlKind::Zmq => "zmq",
            ControlKind::NixlNotif => "nixl_notif",
            ControlKind::Tcp => "tcp",
        }
    }
}

impl fmt::Display for ControlKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How peers reach a control channel: opaque bytes whose meaning belongs to
/// the channel kind (a `tcp://ip:port` string for ZMQ; an agent name, possibly
/// with connection metadata, for NIXL notifications). It travels in the
/// handshake and in every WANT.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint(Vec<u8>);

impl Endpoint {
    /// Wraps raw endpoint bytes (as received in a handshake or a WANT).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The endpoint's bytes, for encoding into messages.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The endpoint as text, when it is UTF-8 (always so for ZMQ endpoints).
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// Consumes the endpoint, returning its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// A short printable form for logs and error messages: the UTF-8 text up
    /// to the first NUL byte (a NIXL-notification endpoint's metadata is
    /// omitted), escaped.
    pub fn display_name(&self) -> String {
        let head = self.0.split(|b| *b == 0).next().unwrap_or(&[]);
        let mut s = String::from_utf8_lossy(head).escape_debug().to_string();
        if head.len() < self.0.len() {
            s.push_str(&format!(
                " (+{} bytes of metadata)",
                self.0.len() - head.len()
            ));
        }
        s
    }
}

impl From<&str> for Endpoint {
    fn from(s: &str) -> Self {
        Self(s.as_bytes().to_vec())
    }
}

impl From<String> for Endpoint {
    fn from(s: String) -> Self {
        Self(s.into_bytes())
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display_name())
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Endpoint({:?})", self.display_name())
    }
}

/// A peer registered with [`ControlChannel::add_peer`]. Handles are never
/// reused within one channel, so a handle kept after `remove_peer` is simply
/// unknown (sends to it fail with [`SendError::UnknownPeer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerHandle(u64);

impl PeerHandle {
    pub(crate) fn new(id: u64) -> Self {
        Self(id)
    }

    /// The handle's number (for logs).
    pub fn id(self) -> u64 {
        self.0
    }
}

impl fmt::Display for PeerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// One received control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// The sender's own endpoint, as the channel identified it; pass it to
    /// [`ControlChannel::add_peer`] to reply.
    pub from: Endpoint,
    /// The message bytes, exactly as the sender passed them to `send`.
    pub payload: Vec<u8>,
}

/// Errors of channel set-up, peer registration and receiving.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// An endpoint failed validation; nothing was connected.
    #[error("endpoint \"{endpoint}\" is not a valid {expected} address: {reason}")]
    InvalidEndpoint {
        /// The offending endpoint, printable.
        endpoint: String,
        /// The expected form, e.g. `tcp://<ip>:<port>`.
        expected: &'static str,
        /// What exactly was wrong.
        reason: String,
    },
    /// No address to bind could be chosen (interface missing, no address...).
    #[error("cannot choose an address to bind the control channel: {0}")]
    BindAddress(String),
    /// A ZMQ call failed.
    #[error("ZMQ failed while {context}: {source}")]
    Zmq {
        /// What the channel was doing.
        context: String,
        /// ZMQ's error.
        source: ::zmq::Error,
    },
    /// A socket call of the direct TCP channel failed.
    #[error("the control channel failed while {context}: {source}")]
    Io {
        /// What the channel was doing.
        context: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A NIXL call made for the notification channel failed.
    #[error("NIXL failed while {context}: {reason}")]
    Nixl {
        /// What the channel was doing.
        context: String,
        /// NIXL's error, printable.
        reason: String,
    },
}

impl ControlError {
    pub(crate) fn zmq(context: impl Into<String>, source: ::zmq::Error) -> Self {
        Self::Zmq {
            context: context.into(),
            source,
        }
    }
}

/// Errors of [`ControlChannel::send`]. In every case the message was dropped.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The peer's send queue is full (the peer is slow, stalled or
    /// unreachable); the message was dropped instead of blocking.
    #[error("the send queue to {endpoint} is full; message dropped")]
    WouldBlock {
        /// The peer's endpoint, printable.
        endpoint: String,
    },
    /// The handle is not (or no longer) registered.
    #[error("{0} is not a registered peer of this control channel")]
    UnknownPeer(PeerHandle),
    /// The transport refused the message for another reason.
    #[error("sending to {endpoint} failed: {reason}")]
    Failed {
        /// The peer's endpoint, printable.
        endpoint: String,
        /// Why, printable.
        reason: String,
    },
}

/// A bidirectional, best-effort, per-peer FIFO message channel between bounce
/// engines. Owned and used by the single reactor thread; object safe.
pub trait ControlChannel: Send {
    /// What peers use to reach this channel (advertised in the handshake and
    /// carried in every WANT).
    fn local_endpoint(&self) -> &Endpoint;

    /// Registers a peer to send to, validating `endpoint` before any
    /// connection is attempted. Adding an already registered endpoint returns
    /// the existing handle.
    fn add_peer(&mut self, endpoint: &Endpoint) -> Result<PeerHandle, ControlError>;

    /// Forgets a peer and releases everything held for it (sockets, queued
    /// messages). Returns whether the handle was registered.
    fn remove_peer(&mut self, peer: PeerHandle) -> bool;

    /// Queues one message for `peer`. Never blocks: when the peer's queue is
    /// full the message is dropped with a warning and
    /// [`SendError::WouldBlock`] is returned.
    fn send(&mut self, peer: PeerHandle, msg: &[u8]) -> Result<(), SendError>;

    /// Waits up to `timeout` for one message (`Duration::ZERO` only polls).
    /// Malformed input from the network is dropped with a warning and never
    /// surfaces as an error.
    fn recv(&mut self, timeout: Duration) -> Result<Option<Incoming>, ControlError>;

    /// Which transport this is.
    fn kind(&self) -> ControlKind;

    /// Peers whose connection is down and has been for the channel's
    /// liveness timeout (the peer died, is stopped, or the network between
    /// us is gone), reported on every call until they are up again. A
    /// channel without a liveness signal reports none; requests to such
    /// peers end at their timeout.
    fn unreachable_peers(&mut self) -> Vec<PeerHandle> {
        Vec::new()
    }

    /// The peer's handshake says it answers this channel's heartbeats:
    /// track its liveness (reported by [`ControlChannel::unreachable_peers`]).
    /// A channel whose transport tracks its connections itself (ZMQ) needs
    /// no such word and ignores it.
    fn watch_liveness(&mut self, _peer: PeerHandle) {}

    /// Keeps the channel's own liveness going while the caller cannot
    /// `recv` for a while (answers heartbeats, leaving protocol messages
    /// queued). A channel whose transport does that on its own threads (ZMQ)
    /// has nothing to do.
    fn keep_alive(&mut self) {}

    /// The heartbeats this channel sent so far (`control_pings_sent`; 0 for
    /// a channel whose transport keeps them).
    fn pings_sent(&self) -> u64 {
        0
    }

    /// A handle any thread may call to make a `recv` that is waiting (or the
    /// next one) return early, e.g. when the application submitted work.
    fn waker(&self) -> Waker;
}

/// Wakes a channel's `recv` from another thread (see
/// [`ControlChannel::waker`]). Cheap and non-blocking.
pub type Waker = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Whether a peer whose connection is down (`up` false) since `down_since`
/// counts as unreachable at `now`: after `timeout` once a failure was seen
/// (refused, closed, silent), after three timeouts when none was (perhaps
/// only a slow machine's first connection). The rule of every channel that
/// tracks connections (ZMQ, direct TCP).
pub(crate) fn down_too_long(
    up: bool,
    failed: bool,
    down_since: std::time::Instant,
    now: std::time::Instant,
    timeout: Duration,
) -> bool {
    const SLOW_GRACE: u32 = 3;
    let grace = if failed {
        timeout
    } else {
        timeout * SLOW_GRACE
    };
    !up && now.duration_since(down_since) >= grace
}

/// `now + timeout`, saturating far in the future for huge timeouts (such as
/// `Duration::MAX`) instead of panicking on overflow.
pub(crate) fn deadline_after(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_can_move_to_the_reactor_thread() {
        fn assert_send<T: Send + ?Sized>() {}
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send::<Box<dyn ControlChannel>>();
        assert_send::<ZmqChannel>();
        assert_send::<NotifChannel>();
        assert_send::<TcpChannel>();
        assert_send_sync::<NotifHub>();
    }

    #[test]
    fn endpoint_display_hides_metadata() {
        let ep = Endpoint::from_bytes(&b"nixl:a/bounce\0\x01\x02"[..]);
        assert_eq!(ep.display_name(), "nixl:a/bounce (+3 bytes of metadata)");
        assert_eq!(Endpoint::from("tcp://[::1]:5").to_string(), "tcp://[::1]:5");
        assert_eq!(ControlKind::NixlNotif.to_string(), "nixl_notif");
    }
}
