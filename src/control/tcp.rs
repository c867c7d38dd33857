//! The direct TCP control channel: the reactor's own sockets, no transport
//! thread between the protocol and the kernel.
//!
//! Over ZMQ every control message crosses two more threads (the sender's
//! ZMQ I/O thread, then the receiver's), each of which must wake; a round
//! trip (WANT -> GRANT, DATA -> ACK) takes six hand-offs where two are
//! needed (design.md §5, "Thread hand-offs per control round trip"). Here
//! the reactor writes a message straight into a non-blocking TCP socket
//! and the peer's reactor, waiting in `epoll` on its sockets (through
//! `mio`), is the one thread woken by its arrival.
//!
//! Shape, as the ZMQ channel's: one listening socket bound to a routable
//! address receives from every peer; one outgoing connection per peer
//! sends to that peer's listener. Endpoints are the same
//! `tcp://<ip>:<port>` text, validated the same way.
//!
//! Wire format of an outgoing connection: a hello first (`NXBT`, format 1,
//! the heartbeat interval the connector wants in ms as u32 LE, then its own
//! endpoint as u16 LE length + bytes), then frames of u32 LE length +
//! message. The listener's side answers on the same connection with single
//! bytes: [`ACK`] once the hello is read, then a [`BEAT`] every interval
//! the connector asked for. Anything else (a bad hello, a frame larger
//! than [`crate::proto::wire::MAX_MESSAGE_BYTES`], an unknown byte) closes
//! that connection with a warning; messages never desynchronise.
//!
//! Liveness (with [`TcpConfig::liveness_timeout`]): a connection is up once
//! the listener's ACK arrives, and fails when the peer closes it, an error
//! ends it, or nothing is heard on it for the whole timeout (a stopped
//! process, a dead host); a failed connection is tried again every
//! [`RECONNECT_MS`]. As over ZMQ, a peer down for the timeout after a
//! failure, or never up for three timeouts, is reported by
//! [`ControlChannel::unreachable_peers`] until it is up again. The
//! listener's beats are written by its reactor, so a reactor that could not
//! poll for longer than two beat intervals starts every peer's silence
//! again when it polls again (its own deafness is not their silence), and
//! a connection not ACKed within the timeout is opened again; the one
//! loop that holds a reactor for long calls [`ControlChannel::keep_alive`].
//!
//! Sends never block: a message that cannot be written at once is queued
//! (also while connecting, and after a failure until the listener's ACK
//! shows a reading peer), at most [`TcpConfig::send_queue`] messages a
//! peer, beyond which `send` drops it with [`SendError::WouldBlock`]. A
//! removed peer's connection stays open for [`LINGER_MS`] so that what it
//! queued (REFUSEs) can leave.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::zmq::{canonical, parse_tcp_endpoint, BindSpec};
use super::{ControlChannel, ControlError, ControlKind, Endpoint, Incoming, PeerHandle, SendError};
use crate::proto::wire::MAX_MESSAGE_BYTES;

/// The hello's magic and format.
const HELLO_MAGIC: &[u8; 4] = b"NXBT";
const HELLO_FORMAT: u8 = 1;
/// The listener's answer to a hello.
pub const ACK: u8 = 1;
/// The listener's heartbeat.
pub const BEAT: u8 = 2;
/// How long a failed connection waits before it is tried again.
pub const RECONNECT_MS: u64 = 100;
/// How long a removed peer's connection stays open for what it queued.
pub const LINGER_MS: u64 = 100;

/// Bytes read from one accepted connection per turn.
const READ_BUDGET: usize = 4 << 20;
/// Messages received and not yet taken by `recv` beyond which sockets are
/// left unread for a turn.
const INBOX_CAP: usize = 4096;

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);

/// Tunables of a [`TcpChannel`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// Messages queued per peer before `send` drops.
    pub send_queue: usize,
    /// A peer whose connection has been down this long is reported by
    /// [`ControlChannel::unreachable_peers`]; the listener beats every
    /// quarter of it and a connection silent for all of it fails. `None`:
    /// no liveness tracking (the connection still comes back after a
    /// failure).
    pub liveness_timeout: Option<Duration>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            send_queue: 4096,
            liveness_timeout: None,
        }
    }
}

/// One connection to a peer's listener, and what waits to be written on it.
struct Outgoing {
    endpoint: String,
    addr: SocketAddr,
    /// `None` while waiting to reconnect.
    stream: Option<TcpStream>,
    token: Token,
    /// The TCP connection is established (the hello may still be queued).
    connected: bool,
    /// The listener's ACK arrived on this connection.
    up: bool,
    /// Frames to write, the hello first on a new connection; `written` bytes
    /// of the front one are already out.
    queue: VecDeque<Vec<u8>>,
    written: usize,
    /// Since when the peer is down (not up), and whether a failure (not
    /// only slowness) was seen since.
    down_since: Instant,
    failed: bool,
    reported: bool,
    last_heard: Instant,
    /// When the current connection was opened.
    opened: Instant,
    reconnect_at: Option<Instant>,
    dropped: u64,
}

/// A connection a peer opened to our listener.
struct Accepted {
    stream: TcpStream,
    addr: SocketAddr,
    buf: Vec<u8>,
    /// The sender's endpoint, once its hello is read.
    from: Option<Endpoint>,
    beat_every: Option<Duration>,
    next_beat: Instant,
    /// The ACK was written.
    acked: bool,
    /// Beats due and not yet written (each one byte).
    owed: usize,
}

/// The direct TCP control channel (see the module docs).
pub struct TcpChannel {
    poll: Poll,
    events: Events,
    listener: TcpListener,
    waker: Arc<mio::Waker>,
    local: Endpoint,
    config: TcpConfig,
    peers: HashMap<PeerHandle, Outgoing>,
    by_endpoint: HashMap<String, PeerHandle>,
    /// Outgoing connections by their token (accepted ones are keyed by
    /// theirs in `accepted`).
    by_token: HashMap<Token, PeerHandle>,
    accepted: HashMap<Token, Accepted>,
    closing: Vec<(Instant, Outgoing)>,
    inbox: VecDeque<Incoming>,
    /// Accepted connections with bytes left to read (their read budget ran
    /// out, or the inbox was full): read again before waiting, as no new
    /// edge-triggered event will say so.
    unread: Vec<Token>,
    /// An accept failed for lack of resources: try again at the next turn.
    accept_again: bool,
    next_peer: u64,
    next_token: usize,
    last_service: Instant,
}

impl std::fmt::Debug for TcpChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpChannel")
            .field("local", &self.local)
            .field("peers", &self.peers.len())
            .field("accepted", &self.accepted.len())
            .finish()
    }
}

fn io_err(context: impl Into<String>, source: io::Error) -> ControlError {
    ControlError::Io {
        context: context.into(),
        source,
    }
}

/// A frame: u32 LE length, then the message.
fn frame(msg: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + msg.len());
    f.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    f.extend_from_slice(msg);
    f
}

fn hello(local: &Endpoint, beat_every: Option<Duration>) -> Vec<u8> {
    let ms = beat_every.map_or(0, |d| {
        u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
    });
    let ep = local.as_bytes();
    let mut h = Vec::with_capacity(11 + ep.len());
    h.extend_from_slice(HELLO_MAGIC);
    h.push(HELLO_FORMAT);
    h.extend_from_slice(&ms.to_le_bytes());
    h.extend_from_slice(&(ep.len() as u16).to_le_bytes());
    h.extend_from_slice(ep);
    h
}

/// What a hello at the start of `buf` says: `Ok(None)` when it is not all
/// there yet; else its length, the sender's endpoint and beat interval.
fn parse_hello(buf: &[u8]) -> Result<Option<(usize, Endpoint, Option<Duration>)>, String> {
    if buf.len() < 11 {
        return Ok(None);
    }
    if &buf[..4] != HELLO_MAGIC || buf[4] != HELLO_FORMAT {
        return Err("the connection does not start with a BOUNCE control hello".into());
    }
    let ms = u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]);
    let n = u16::from_le_bytes([buf[9], buf[10]]) as usize;
    if buf.len() < 11 + n {
        return Ok(None);
    }
    let ep = Endpoint::from_bytes(&buf[11..11 + n]);
    let addr = parse_tcp_endpoint(&ep).map_err(|e| format!("its hello names no endpoint: {e}"))?;
    let beat = (ms > 0).then(|| Duration::from_millis(u64::from(ms)));
    Ok(Some((11 + n, Endpoint::from(canonical(addr)), beat)))
}

impl TcpChannel {
    /// Creates the channel: resolves the bind address and listens on a
    /// kernel-chosen port.
    pub fn new(bind: &BindSpec, config: TcpConfig) -> Result<Self, ControlError> {
        let ip = bind.resolve()?;
        let poll = Poll::new().map_err(|e| io_err("creating the poller", e))?;
        let mut listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| io_err(format!("binding the control listener to {ip}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("reading the listener's address", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| io_err("polling the listener", e))?;
        let waker = mio::Waker::new(poll.registry(), WAKER)
            .map_err(|e| io_err("creating the wake-up", e))?;
        let local = Endpoint::from(canonical(addr));
        tracing::info!(endpoint = %local, "direct TCP control channel listening");
        Ok(Self {
            poll,
            events: Events::with_capacity(256),
            listener,
            waker: Arc::new(waker),
            local,
            config,
            peers: HashMap::new(),
            by_endpoint: HashMap::new(),
            by_token: HashMap::new(),
            accepted: HashMap::new(),
            closing: Vec::new(),
            inbox: VecDeque::new(),
            unread: Vec::new(),
            accept_again: false,
            next_peer: 1,
            next_token: 2,
            last_service: Instant::now(),
        })
    }

    /// Number of registered peers.
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// Connections peers opened to this channel and that are still open.
    pub fn accepted_count(&self) -> usize {
        self.accepted.len()
    }

    fn token(&mut self) -> Token {
        let t = Token(self.next_token);
        self.next_token += 1;
        t
    }

    fn beat_every(&self) -> Option<Duration> {
        self.config.liveness_timeout.map(|t| t / 4)
    }

    /// Opens `out`'s connection (again), its hello queued first (a failed
    /// connection's half-written frame and unsent hello were dropped by
    /// [`Self::fail_since`]).
    fn connect(&mut self, handle: PeerHandle) {
        let token = self.token();
        let hello = hello(&self.local, self.beat_every());
        let Some(out) = self.peers.get_mut(&handle) else {
            return;
        };
        out.queue.push_front(hello);
        out.connected = false;
        out.up = false;
        out.reconnect_at = None;
        out.opened = Instant::now();
        self.by_token.remove(&out.token);
        out.token = token;
        match TcpStream::connect(out.addr) {
            Ok(mut s) => {
                match self.poll.registry().register(
                    &mut s,
                    token,
                    Interest::READABLE | Interest::WRITABLE,
                ) {
                    Ok(()) => {
                        out.stream = Some(s);
                        self.by_token.insert(token, handle);
                    }
                    Err(e) => {
                        tracing::warn!(endpoint = %out.endpoint, error = %e, "control channel: cannot poll a new connection");
                        Self::fail(self.poll.registry(), out, Instant::now());
                    }
                }
            }
            Err(e) => {
                tracing::debug!(endpoint = %out.endpoint, error = %e, "control channel: connect failed");
                Self::fail(self.poll.registry(), out, Instant::now());
            }
        }
    }

    /// Ends `out`'s connection after a failure (out of `registry`'s
    /// poll); it is tried again later. A peer that was up is down from
    /// `since` (when it went silent, for a silence; else now).
    fn fail_since(registry: &mio::Registry, out: &mut Outgoing, now: Instant, since: Instant) {
        if let Some(mut s) = out.stream.take() {
            let _ = registry.deregister(&mut s);
        }
        if out.up {
            out.down_since = since;
        }
        out.connected = false;
        out.up = false;
        out.failed = true;
        if out.written > 0 {
            // The peer got part of a frame: the next connection starts
            // clean.
            out.queue.pop_front();
            out.written = 0;
        }
        if out
            .queue
            .front()
            .is_some_and(|f| f.starts_with(HELLO_MAGIC))
        {
            out.queue.pop_front();
        }
        out.reconnect_at = Some(now + Duration::from_millis(RECONNECT_MS));
    }

    fn fail(registry: &mio::Registry, out: &mut Outgoing, now: Instant) {
        Self::fail_since(registry, out, now, now);
    }

    /// Writes what `out` has queued, as far as the socket takes it.
    /// `Err`: the connection failed.
    fn flush(out: &mut Outgoing) -> io::Result<()> {
        let Some(stream) = out.stream.as_mut() else {
            return Ok(());
        };
        if !out.connected {
            return Ok(());
        }
        // After a failure, messages wait for the listener's ACK (a process
        // that is stopped, or a host whose kernel still accepts, takes a
        // connection but reads nothing: they queue here, where the queue's
        // bound applies, not in the kernel's buffer); the first connection
        // writes at once.
        let write_messages = out.up || !out.failed;
        while let Some(front) = out.queue.front() {
            if !write_messages && !front.starts_with(HELLO_MAGIC) {
                return Ok(());
            }
            match stream.write(&front[out.written..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    out.written += n;
                    if out.written == front.len() {
                        out.queue.pop_front();
                        out.written = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// An event on an outgoing connection: it connected, can take more, or
    /// the listener answered (ACK, beats) or closed it.
    fn on_outgoing(out: &mut Outgoing, readable: bool, now: Instant) -> io::Result<()> {
        let Some(stream) = out.stream.as_mut() else {
            return Ok(());
        };
        if !out.connected {
            if let Some(e) = stream.take_error()? {
                return Err(e);
            }
            match stream.peer_addr() {
                Ok(_) => {
                    out.connected = true;
                    let _ = stream.set_nodelay(true);
                }
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        if readable {
            let mut buf = [0u8; 64];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => {
                        if let Some(b) = buf[..n].iter().find(|b| **b != ACK && **b != BEAT) {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!(
                                    "the listener sent byte {b}, which is neither ACK nor a beat"
                                ),
                            ));
                        }
                        out.last_heard = now;
                        if !out.up {
                            out.up = true;
                            out.failed = false;
                            out.reported = false;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Self::flush(out)
    }

    /// Reads what an accepted connection brought, at most
    /// [`READ_BUDGET`] bytes (so one busy sender cannot hold the reactor),
    /// taking out whole messages as they complete. `Ok(true)`: the budget
    /// ran out before the socket did (read it again without waiting for
    /// an event); `Err`: close it (empty: the peer closed it).
    fn on_accepted(
        conn: &mut Accepted,
        inbox: &mut VecDeque<Incoming>,
        now: Instant,
    ) -> Result<bool, String> {
        let mut chunk = [0u8; 64 * 1024];
        let mut read = 0;
        let ended = loop {
            if read >= READ_BUDGET {
                break None;
            }
            match conn.stream.read(&mut chunk) {
                Ok(0) => break Some(String::new()),
                Ok(n) => {
                    read += n;
                    conn.buf.extend_from_slice(&chunk[..n]);
                    // A bad hello or an oversized length is refused as soon
                    // as its bytes are in, before more is read.
                    Self::take_messages(conn, inbox, now)?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Some(format!("reading failed: {e}")),
            }
        };
        if let Some(why) = ended {
            return Err(why);
        }
        if conn.buf.is_empty() && conn.buf.capacity() > 1 << 20 {
            conn.buf = Vec::new();
        }
        Self::answer(conn, now)?;
        Ok(read >= READ_BUDGET)
    }

    /// Takes the hello and every whole message out of `conn.buf`.
    fn take_messages(
        conn: &mut Accepted,
        inbox: &mut VecDeque<Incoming>,
        now: Instant,
    ) -> Result<(), String> {
        let mut at = 0;
        if conn.from.is_none() {
            match parse_hello(&conn.buf)? {
                None => return Ok(()),
                Some((n, from, beat)) => {
                    at = n;
                    conn.from = Some(from);
                    conn.beat_every = beat;
                    conn.next_beat = beat.map_or(now, |b| now + b);
                }
            }
        }
        if let Some(from) = &conn.from {
            while conn.buf.len() - at >= 4 {
                let b = &conn.buf[at..at + 4];
                let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
                if len > MAX_MESSAGE_BYTES {
                    return Err(format!(
                        "a frame of {len} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
                    ));
                }
                if conn.buf.len() - at - 4 < len {
                    break;
                }
                inbox.push_back(Incoming {
                    from: from.clone(),
                    payload: conn.buf[at + 4..at + 4 + len].to_vec(),
                });
                at += 4 + len;
            }
        }
        conn.buf.drain(..at);
        Ok(())
    }

    /// Writes the ACK and the beats due on an accepted connection.
    fn answer(conn: &mut Accepted, now: Instant) -> Result<(), String> {
        if conn.from.is_none() {
            return Ok(());
        }
        while !conn.acked {
            match conn.stream.write(&[ACK]) {
                Ok(0) => return Ok(()),
                Ok(_) => conn.acked = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("writing the ACK failed: {e}")),
            }
        }
        if let Some(every) = conn.beat_every {
            if now >= conn.next_beat {
                conn.owed += 1;
                conn.next_beat = now + every;
            }
        }
        while conn.owed > 0 {
            let bytes = [BEAT; 8];
            let n = conn.owed.min(bytes.len());
            match conn.stream.write(&bytes[..n]) {
                Ok(0) => break,
                Ok(k) => conn.owed -= k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("writing a beat failed: {e}")),
            }
        }
        Ok(())
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, addr)) => {
                    let token = self.token();
                    if let Err(e) = self.poll.registry().register(
                        &mut stream,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        tracing::warn!(%addr, error = %e, "control channel: cannot poll an accepted connection");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.accepted.insert(
                        token,
                        Accepted {
                            stream,
                            addr,
                            buf: Vec::new(),
                            from: None,
                            beat_every: None,
                            next_beat: Instant::now(),
                            acked: false,
                            owed: 0,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors or memory: the backlog waits for
                    // the next turn (no new event would come for it).
                    // Anything else concerned one connection only.
                    let scarce = matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    );
                    tracing::warn!(error = %e, "control channel: accept failed");
                    if scarce {
                        self.accept_again = true;
                        return;
                    }
                }
            }
        }
    }

    fn close_accepted(&mut self, token: Token, why: &str) {
        if let Some(mut c) = self.accepted.remove(&token) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            if !why.is_empty() {
                tracing::warn!(addr = %c.addr, from = ?c.from, "control channel: closing a connection: {why}");
            }
        }
    }

    /// Timers: reconnections due, beats due, silent connections, removed
    /// peers whose moment is over.
    fn service(&mut self, now: Instant) {
        let gap = now.duration_since(self.last_service);
        let deaf = self.beat_every().is_some_and(|every| gap > 2 * every);
        self.last_service = now;
        if std::mem::take(&mut self.accept_again) {
            self.accept_all();
        }
        // A connection that never got its ACK (a connect stuck unanswered,
        // a listener that never read the hello) is tried again after this.
        let stuck_after = self
            .config
            .liveness_timeout
            .unwrap_or(Duration::from_secs(1));
        let stuck: Vec<PeerHandle> = self
            .peers
            .iter()
            .filter(|(_, o)| {
                o.stream.is_some() && !o.up && now.duration_since(o.opened) >= stuck_after
            })
            .map(|(h, _)| *h)
            .collect();
        for h in stuck {
            if let Some(out) = self.peers.get_mut(&h) {
                Self::fail(self.poll.registry(), out, now);
            }
        }
        let due: Vec<PeerHandle> = self
            .peers
            .iter()
            .filter(|(_, o)| o.reconnect_at.is_some_and(|t| t <= now))
            .map(|(h, _)| *h)
            .collect();
        for h in due {
            self.connect(h);
        }
        if let Some(timeout) = self.config.liveness_timeout {
            for out in self.peers.values_mut() {
                if deaf {
                    // The reactor's own deafness is not the peers' silence,
                    // nor their outage.
                    out.last_heard = now;
                    if !out.up {
                        out.down_since = (out.down_since + gap).min(now);
                    }
                }
                if out.up && now.duration_since(out.last_heard) >= timeout {
                    tracing::warn!(endpoint = %out.endpoint, "control channel: nothing heard from the peer for {timeout:?}; reconnecting");
                    // Unreachable at once: its silence is the timeout.
                    let since = out.last_heard;
                    Self::fail_since(self.poll.registry(), out, now, since);
                }
            }
        }
        let mut broken = Vec::new();
        for (token, conn) in &mut self.accepted {
            if let Err(why) = Self::answer(conn, now) {
                broken.push((*token, why));
            }
        }
        for (token, why) in broken {
            self.close_accepted(token, &why);
        }
        if !self.closing.is_empty() {
            for (_, out) in &mut self.closing {
                let _ = Self::flush(out);
            }
            let registry = self.poll.registry();
            self.closing.retain_mut(|(due, out)| {
                let keep = *due > now && !out.queue.is_empty();
                if !keep {
                    if let Some(s) = out.stream.as_mut() {
                        // Unread beats in the receive buffer would make the
                        // close a reset, which discards what is still
                        // unsent (the REFUSEs the linger is for).
                        let mut sink = [0u8; 256];
                        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
                        let _ = registry.deregister(s);
                    }
                }
                keep
            });
        }
    }

    /// Polls once, up to `wait`; returns whether the waker fired.
    fn poll_once(&mut self, wait: Duration) -> Result<bool, ControlError> {
        let wait = if self.unread.is_empty() {
            wait
        } else {
            Duration::ZERO
        };
        match self.poll.poll(&mut self.events, Some(wait)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(false),
            Err(e) => return Err(io_err("polling the control sockets", e)),
        }
        let now = Instant::now();
        let mut woken = false;
        let ready: Vec<(Token, bool)> = self
            .events
            .iter()
            .map(|e| {
                (
                    e.token(),
                    e.is_readable() || e.is_read_closed() || e.is_error(),
                )
            })
            .collect();
        for (token, readable) in ready {
            match token {
                WAKER => woken = true,
                LISTENER => self.accept_all(),
                t if self.accepted.contains_key(&t) => {
                    if !self.unread.contains(&t) {
                        self.unread.push(t);
                    }
                }
                t => match self.by_token.get(&t).copied() {
                    Some(h) => {
                        let Some(out) = self.peers.get_mut(&h) else {
                            continue;
                        };
                        if let Err(e) = Self::on_outgoing(out, readable, now) {
                            tracing::debug!(endpoint = %out.endpoint, error = %e, "control channel: connection to the peer failed");
                            Self::fail(self.poll.registry(), out, now);
                        }
                    }
                    None => {
                        // A removed peer's lingering connection.
                        for (_, out) in &mut self.closing {
                            if out.token == t {
                                let _ = Self::on_outgoing(out, readable, now);
                            }
                        }
                    }
                },
            }
        }
        self.read_accepted(now);
        self.service(now);
        Ok(woken)
    }

    /// Reads the accepted connections that have bytes waiting, each up to
    /// its budget, while the inbox has room.
    fn read_accepted(&mut self, now: Instant) {
        let tokens = std::mem::take(&mut self.unread);
        for t in tokens {
            if self.inbox.len() >= INBOX_CAP {
                self.unread.push(t);
                continue;
            }
            let Some(conn) = self.accepted.get_mut(&t) else {
                continue;
            };
            match Self::on_accepted(conn, &mut self.inbox, now) {
                Ok(true) => self.unread.push(t),
                Ok(false) => {}
                Err(why) => self.close_accepted(t, &why),
            }
        }
    }
}

impl ControlChannel for TcpChannel {
    fn local_endpoint(&self) -> &Endpoint {
        &self.local
    }

    fn add_peer(&mut self, endpoint: &Endpoint) -> Result<PeerHandle, ControlError> {
        let addr = parse_tcp_endpoint(endpoint)?;
        let key = canonical(addr);
        if let Some(handle) = self.by_endpoint.get(&key) {
            return Ok(*handle);
        }
        let handle = PeerHandle::new(self.next_peer);
        self.next_peer += 1;
        let now = Instant::now();
        // A peer removed a moment ago gets its connection back.
        if let Some(i) = self.closing.iter().position(|(_, o)| o.endpoint == key) {
            let out = self.closing.swap_remove(i).1;
            self.by_token.insert(out.token, handle);
            self.peers.insert(handle, out);
        } else {
            self.peers.insert(
                handle,
                Outgoing {
                    endpoint: key.clone(),
                    addr,
                    stream: None,
                    token: Token(usize::MAX),
                    connected: false,
                    up: false,
                    queue: VecDeque::new(),
                    written: 0,
                    down_since: now,
                    failed: false,
                    reported: false,
                    last_heard: now,
                    opened: now,
                    reconnect_at: None,
                    dropped: 0,
                },
            );
            self.connect(handle);
        }
        tracing::debug!(%handle, endpoint = %key, "control channel: peer added");
        self.by_endpoint.insert(key, handle);
        Ok(handle)
    }

    fn remove_peer(&mut self, peer: PeerHandle) -> bool {
        let Some(out) = self.peers.remove(&peer) else {
            return false;
        };
        self.by_endpoint.remove(&out.endpoint);
        self.by_token.remove(&out.token);
        tracing::debug!(handle = %peer, endpoint = %out.endpoint, dropped = out.dropped, "control channel: peer removed");
        self.closing
            .push((Instant::now() + Duration::from_millis(LINGER_MS), out));
        true
    }

    fn send(&mut self, peer: PeerHandle, msg: &[u8]) -> Result<(), SendError> {
        let out = self
            .peers
            .get_mut(&peer)
            .ok_or(SendError::UnknownPeer(peer))?;
        if msg.len() > MAX_MESSAGE_BYTES {
            return Err(SendError::Failed {
                endpoint: out.endpoint.clone(),
                reason: format!(
                    "a message of {} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit",
                    msg.len()
                ),
            });
        }
        if out.queue.len() >= self.config.send_queue {
            out.dropped += 1;
            tracing::warn!(
                endpoint = %out.endpoint,
                dropped_total = out.dropped,
                bytes = msg.len(),
                "control channel: send queue full (peer slow or unreachable); message dropped"
            );
            return Err(SendError::WouldBlock {
                endpoint: out.endpoint.clone(),
            });
        }
        out.queue.push_back(frame(msg));
        if let Err(e) = Self::flush(out) {
            tracing::debug!(endpoint = %out.endpoint, error = %e, "control channel: connection to the peer failed while sending");
            Self::fail(self.poll.registry(), out, Instant::now());
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Incoming>, ControlError> {
        if let Some(m) = self.inbox.pop_front() {
            return Ok(Some(m));
        }
        let deadline = super::deadline_after(timeout);
        // Timers (reconnections, beats, removed peers) need a turn at least
        // this often while the caller waits.
        let tick = self
            .beat_every()
            .map_or(Duration::from_millis(RECONNECT_MS), |b| b / 2)
            .clamp(
                Duration::from_millis(1),
                Duration::from_millis(RECONNECT_MS / 2),
            );
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let woken = self.poll_once(remaining.min(tick))?;
            if let Some(m) = self.inbox.pop_front() {
                return Ok(Some(m));
            }
            if woken || Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    fn kind(&self) -> ControlKind {
        ControlKind::Tcp
    }

    fn unreachable_peers(&mut self) -> Vec<PeerHandle> {
        let Some(timeout) = self.config.liveness_timeout else {
            return Vec::new();
        };
        let now = Instant::now();
        let mut down = Vec::new();
        for (handle, out) in &mut self.peers {
            if super::down_too_long(out.up, out.failed, out.down_since, now, timeout) {
                if !out.reported {
                    out.reported = true;
                    tracing::warn!(
                        endpoint = %out.endpoint,
                        "control channel: no connection to the peer for {:?}; it is unreachable",
                        now.duration_since(out.down_since)
                    );
                }
                down.push(*handle);
            }
        }
        down
    }

    fn keep_alive(&mut self) {
        // Beats owed, connections' answers read; protocol messages stay in
        // the inbox, in order.
        let _ = self.poll_once(Duration::ZERO);
    }

    fn waker(&self) -> super::Waker {
        let w = self.waker.clone();
        Arc::new(move || {
            let _ = w.wake();
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel(liveness: Option<Duration>) -> TcpChannel {
        TcpChannel::new(
            &BindSpec::loopback(),
            TcpConfig {
                liveness_timeout: liveness,
                ..TcpConfig::default()
            },
        )
        .expect("channel")
    }

    /// The next message `rx` receives within 5 s, `tx` polled meanwhile
    /// (a channel writes what it queued only when its owner polls it).
    fn next(rx: &mut TcpChannel, tx: &mut TcpChannel) -> Option<Incoming> {
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            let _ = tx.recv(Duration::ZERO).expect("recv");
            if let Some(m) = rx.recv(Duration::from_millis(2)).expect("recv") {
                return Some(m);
            }
        }
        None
    }

    #[test]
    fn messages_arrive_in_order_with_the_senders_endpoint() {
        let (mut a, mut b) = (channel(None), channel(None));
        let to_b = a.add_peer(b.local_endpoint()).expect("add");
        for i in 0..100u32 {
            let msg = vec![i as u8; (i as usize) * 977];
            a.send(to_b, &msg).expect("send");
        }
        for i in 0..100u32 {
            let m = next(&mut b, &mut a).expect("message");
            assert_eq!(m.from, *a.local_endpoint());
            assert_eq!(m.payload, vec![i as u8; (i as usize) * 977]);
        }
        // The reverse path, by the endpoint the message carried.
        let back = b.add_peer(a.local_endpoint()).expect("reverse");
        b.send(back, b"ack").expect("send");
        assert_eq!(next(&mut a, &mut b).expect("reply").payload, b"ack");
    }

    #[test]
    fn the_waker_ends_a_wait() {
        let mut a = channel(None);
        let wake = a.waker();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            wake();
        });
        let t0 = Instant::now();
        assert!(a.recv(Duration::from_secs(10)).expect("recv").is_none());
        assert!(t0.elapsed() < Duration::from_secs(5));
        t.join().expect("waker thread");
    }

    #[test]
    fn a_raw_client_is_cut_off_and_the_channel_goes_on() {
        let (mut a, mut b) = (channel(None), channel(None));
        let addr = parse_tcp_endpoint(b.local_endpoint()).expect("addr");
        let mut raw = std::net::TcpStream::connect(addr).expect("raw connect");
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").expect("raw write");
        let _ = b.recv(Duration::from_millis(100));
        let to_b = a.add_peer(b.local_endpoint()).expect("add");
        a.send(to_b, b"after").expect("send");
        assert_eq!(next(&mut b, &mut a).expect("message").payload, b"after");
        assert_eq!(
            b.accepted_count(),
            1,
            "the raw client's connection was closed"
        );
    }

    /// A sender that keeps writing cannot hold the reactor: an oversized
    /// length is refused before more is read, and a flood of valid
    /// messages is read a budget at a time.
    #[test]
    fn a_flooding_sender_does_not_hold_the_reactor() {
        let mut b = channel(None);
        let addr = parse_tcp_endpoint(b.local_endpoint()).expect("addr");
        for oversized in [true, false] {
            let mut raw = std::net::TcpStream::connect(addr).expect("raw connect");
            raw.write_all(&hello(&Endpoint::from("tcp://127.0.0.1:9"), None))
                .expect("hello");
            if oversized {
                raw.write_all(&u32::MAX.to_le_bytes()).expect("length");
            }
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flood = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let chunk: Vec<u8> = (0..16_384).flat_map(|_| frame(&[])).collect();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        if raw.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                })
            };
            for _ in 0..20 {
                let t0 = Instant::now();
                let _ = b.recv(Duration::ZERO).expect("recv");
                assert!(
                    t0.elapsed() < Duration::from_millis(500),
                    "oversized={oversized}: one recv took {:?}",
                    t0.elapsed()
                );
                while b.inbox.len() > 1 {
                    b.inbox.pop_front();
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            if oversized {
                assert_eq!(b.accepted_count(), 0, "the oversized sender was cut off");
            }
            drop(flood);
        }
    }

    #[test]
    fn an_oversized_frame_closes_its_connection() {
        let mut b = channel(None);
        let addr = parse_tcp_endpoint(b.local_endpoint()).expect("addr");
        let mut raw = std::net::TcpStream::connect(addr).expect("raw connect");
        raw.write_all(&hello(&Endpoint::from("tcp://127.0.0.1:9"), None))
            .expect("hello");
        raw.write_all(&u32::MAX.to_le_bytes()).expect("length");
        assert!(b.recv(Duration::from_millis(200)).expect("recv").is_none());
        assert_eq!(b.accepted_count(), 0);
    }

    #[test]
    fn a_peer_that_never_listens_is_unreachable() {
        // The peer's listener is gone: sends queue and the peer is
        // reported unreachable after the timeout.
        let mut a = channel(Some(Duration::from_millis(200)));
        let gone = channel(None);
        let ep = gone.local_endpoint().clone();
        drop(gone);
        let h = a.add_peer(&ep).expect("add");
        a.send(h, b"lost").expect("queued");
        let end = Instant::now() + Duration::from_secs(3);
        while a.unreachable_peers().is_empty() {
            assert!(Instant::now() < end, "never reported unreachable");
            let _ = a.recv(Duration::from_millis(20));
        }
        assert_eq!(a.unreachable_peers(), vec![h]);
    }

    #[test]
    fn a_peer_that_stops_answering_is_unreachable_and_comes_back() {
        let timeout = Duration::from_millis(200);
        let (mut a, mut b) = (channel(Some(timeout)), channel(Some(timeout)));
        let h = a.add_peer(b.local_endpoint()).expect("add");
        // Up: both poll for a while.
        let end = Instant::now() + Duration::from_millis(300);
        while Instant::now() < end {
            let _ = a.recv(Duration::from_millis(5));
            let _ = b.recv(Duration::from_millis(5));
        }
        assert!(a.unreachable_peers().is_empty(), "up while b answers");
        // b stops polling (a stopped process): no beats.
        let end = Instant::now() + Duration::from_secs(3);
        while a.unreachable_peers().is_empty() {
            assert!(Instant::now() < end, "a silent peer was never reported");
            let _ = a.recv(Duration::from_millis(20));
        }
        // b polls again: the connection comes back.
        let end = Instant::now() + Duration::from_secs(3);
        while !a.unreachable_peers().is_empty() {
            assert!(Instant::now() < end, "the peer never came back");
            let _ = a.recv(Duration::from_millis(5));
            let _ = b.recv(Duration::from_millis(5));
        }
        a.send(h, b"again").expect("send");
        assert_eq!(next(&mut b, &mut a).expect("message").payload, b"again");
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let mut a = TcpChannel::new(
            &BindSpec::loopback(),
            TcpConfig {
                send_queue: 4,
                liveness_timeout: None,
            },
        )
        .expect("channel");
        let gone = channel(None);
        let ep = gone.local_endpoint().clone();
        drop(gone);
        let h = a.add_peer(&ep).expect("add");
        let results: Vec<bool> = (0..8).map(|_| a.send(h, b"x").is_ok()).collect();
        assert!(results.iter().any(|ok| !ok), "{results:?}");
        assert!(matches!(a.send(h, b"x"), Err(SendError::WouldBlock { .. })));
    }

    #[test]
    fn removed_peers_are_unknown_and_their_queue_leaves() {
        let (mut a, mut b) = (channel(None), channel(None));
        let h = a.add_peer(b.local_endpoint()).expect("add");
        a.send(h, b"last words").expect("send");
        assert!(a.remove_peer(h));
        assert!(!a.remove_peer(h));
        assert!(matches!(a.send(h, b"x"), Err(SendError::UnknownPeer(_))));
        let end = Instant::now() + Duration::from_secs(2);
        let mut got = None;
        while got.is_none() && Instant::now() < end {
            let _ = a.recv(Duration::from_millis(5));
            got = b.recv(Duration::from_millis(5)).expect("recv");
        }
        assert_eq!(got.expect("the queued message").payload, b"last words");
    }
}
