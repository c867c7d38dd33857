//! The ZMQ control channel: one ROUTER bound to a routable address receives
//! from every peer; one DEALER per peer sends to that peer's ROUTER.
//!
//! Each DEALER's routing id is this channel's own endpoint string, so the
//! receiving ROUTER learns who sent every message without trusting the
//! payload, and can answer on the reverse path (`add_peer(&incoming.from)`).
//!
//! Wire format: the DEALER sends exactly one frame (the message); the ROUTER
//! therefore receives exactly two, `[routing id, message]`. Anything else (a
//! raw client sending several frames, a routing id that is not an endpoint)
//! is dropped whole with a warning: multipart messages are read atomically,
//! so frames never desynchronise.
//!
//! Sockets: `ZMQ_LINGER` 0 everywhere (closing never waits for the network),
//! `ZMQ_ROUTER_HANDOVER` on the ROUTER (a forgotten peer that reconnects with
//! the same routing id takes over its stale connection instead of having its
//! messages silently dropped), `ZMQ_IPV6` on the ROUTER when it binds an IPv6
//! address and always on DEALERs (harmless for IPv4), a send high-water mark
//! per DEALER, and sends with `ZMQ_DONTWAIT` so a full queue is reported as
//! [`SendError::WouldBlock`] instead of blocking the reactor.
//!
//! Liveness (when [`ZmqConfig::liveness_timeout`] is set): each DEALER sends
//! ZMTP heartbeats every quarter of the timeout and drops a connection that
//! stays silent for the whole timeout (a stopped peer, a dead link); a socket
//! monitor per DEALER tracks whether its connection is up (handshake done)
//! or down (never connected, disconnected). A peer down for the timeout
//! after a failure (disconnected, heartbeat unanswered, connection refused),
//! or never connected for three timeouts (no failure seen: perhaps only a
//! slow machine), is reported by [`ControlChannel::unreachable_peers`] until
//! it is up again (ZMQ keeps reconnecting, so a peer that comes back is
//! simply up again).
//!
//! Context: one `zmq::Context` per channel (not per peer, not per process).
//! A bounce engine owns one channel, so this costs one ZMQ IO thread per
//! engine, and dropping the channel terminates the context, joining its
//! threads: nothing of ZMQ outlives the engine, which matters for a plugin
//! that NIXL may unload. A removed peer's DEALER stays open for
//! [`DEALER_LINGER_MS`] so that what it queued (the REFUSEs telling a
//! forgotten peer its flows are over) can leave, then closes with linger 0
//! (adding the peer again within that moment takes the same socket back), so
//! a long-lived server holds sockets only for its current peers.

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::sync::Locked;

use super::{ControlChannel, ControlError, ControlKind, Endpoint, Incoming, PeerHandle, SendError};

/// The endpoint form this channel accepts, for error messages.
const TCP_FORM: &str = "tcp://<ip>:<port>";

/// Tunables of a [`ZmqChannel`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqConfig {
    /// Messages queued per peer before `send` drops (`ZMQ_SNDHWM`).
    pub send_hwm: i32,
    /// Messages queued on the receiving ROUTER per connection before ZMQ
    /// stops reading from it (`ZMQ_RCVHWM`).
    pub recv_hwm: i32,
    /// Largest message accepted from the network; a peer sending a larger one
    /// is disconnected by ZMQ (`ZMQ_MAXMSGSIZE`, bounds memory against raw
    /// clients). Negative means unlimited.
    pub max_message_bytes: i64,
    /// A peer whose connection has been down this long is reported by
    /// [`ControlChannel::unreachable_peers`]; DEALERs send ZMTP heartbeats
    /// every quarter of it and drop a connection silent for all of it (a
    /// stopped peer, a dead link). `None`: no liveness tracking.
    pub liveness_timeout: Option<Duration>,
}

impl Default for ZmqConfig {
    fn default() -> Self {
        Self {
            send_hwm: 4096,
            recv_hwm: 4096,
            max_message_bytes: crate::proto::wire::MAX_MESSAGE_BYTES as i64,
            liveness_timeout: None,
        }
    }
}

/// Where the ROUTER binds. The port is always chosen by the kernel.
///
/// Resolution order: an explicit [`address`](Self::address); else the
/// [`interface`](Self::interface)'s address (IPv4 preferred); else
/// auto-detection: the source address of the default route (IPv4, then
/// IPv6), then the first non-loopback interface that is up. Loopback is
/// chosen only when `allow_loopback` is set, or, with a warning, when
/// auto-detection finds nothing else.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BindSpec {
    /// Name of the network interface whose address to bind (e.g. `eth0`).
    pub interface: Option<String>,
    /// Bind exactly this address (tests, or configuration naming an IP).
    pub address: Option<IpAddr>,
    /// Whether a loopback address may be bound on purpose. Peers on other
    /// hosts cannot reach it.
    pub allow_loopback: bool,
}

impl BindSpec {
    /// Auto-detect a routable address.
    pub fn auto() -> Self {
        Self::default()
    }

    /// Use the address of the named interface.
    pub fn interface(name: impl Into<String>) -> Self {
        Self {
            interface: Some(name.into()),
            ..Self::default()
        }
    }

    /// Bind exactly `address` (loopback addresses are allowed).
    pub fn address(address: IpAddr) -> Self {
        Self {
            address: Some(address),
            allow_loopback: true,
            ..Self::default()
        }
    }

    /// Bind 127.0.0.1 (single-host tests).
    pub fn loopback() -> Self {
        Self::address(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// Chooses the address to bind, per the rules in the type's docs.
    pub fn resolve(&self) -> Result<IpAddr, ControlError> {
        if let Some(ip) = self.address {
            check_bindable(ip, self.allow_loopback)?;
            return Ok(ip);
        }
        let interfaces = interface_addresses().map_err(|e| {
            ControlError::BindAddress(format!("listing network interfaces failed: {e}"))
        })?;
        if let Some(name) = &self.interface {
            return address_of_interface(&interfaces, name, self.allow_loopback);
        }
        Ok(auto_detect(&interfaces, self.allow_loopback))
    }
}

fn check_bindable(ip: IpAddr, allow_loopback: bool) -> Result<(), ControlError> {
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(ControlError::BindAddress(format!(
            "{ip} cannot be advertised to peers; give a unicast address of this host"
        )));
    }
    if ip.is_loopback() && !allow_loopback {
        return Err(ControlError::BindAddress(format!(
            "refusing to bind loopback address {ip}: peers on other hosts cannot reach it (set allow_loopback)"
        )));
    }
    Ok(())
}

/// One address of one network interface, as `getifaddrs` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddress {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// One of its addresses.
    pub ip: IpAddr,
    /// `IFF_UP` is set.
    pub up: bool,
    /// `IFF_LOOPBACK` is set.
    pub loopback: bool,
}

impl InterfaceAddress {
    /// Whether peers can be told to connect to this address: up, unicast,
    /// not link-local IPv6 (that would need a scope id).
    fn usable(&self) -> bool {
        self.up
            && !self.ip.is_unspecified()
            && !self.ip.is_multicast()
            && !is_ipv6_link_local(self.ip)
    }

    fn is_loopback(&self) -> bool {
        self.loopback || self.ip.is_loopback()
    }
}

fn is_ipv6_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

/// Lists every IPv4/IPv6 address of every interface (`getifaddrs`).
pub fn interface_addresses() -> std::io::Result<Vec<InterfaceAddress>> {
    /// Frees the list on every exit path.
    struct List(*mut libc::ifaddrs);
    impl Drop for List {
        fn drop(&mut self) {
            if !self.0.is_null() {
                // SAFETY: the pointer came from a successful getifaddrs, is
                // freed exactly once (here), and no reference into the list
                // outlives `List` (everything is copied out before).
                unsafe { libc::freeifaddrs(self.0) };
            }
        }
    }

    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success getifaddrs stores a
    // heap-allocated list there, on failure it returns -1 and sets errno.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let list = List(head);

    let mut out = Vec::new();
    let mut cur = list.0;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list owned by `list`, which
        // stays alive (not freed) for this whole loop; we only read it.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points to a sockaddr of the
        // list; every sockaddr starts with `sa_family`.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: the family is AF_INET, so the kernel stored a
                // `sockaddr_in` at this address.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family is AF_INET6, so the kernel stored a
                // `sockaddr_in6` at this address.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        // SAFETY: `ifa_name` is non-null and points to a NUL-terminated
        // string owned by the list, alive for this iteration; it is copied.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let flags = ifa.ifa_flags;
        out.push(InterfaceAddress {
            name,
            ip,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    Ok(out)
}

fn address_of_interface(
    interfaces: &[InterfaceAddress],
    name: &str,
    allow_loopback: bool,
) -> Result<IpAddr, ControlError> {
    let of_name: Vec<&InterfaceAddress> = interfaces.iter().filter(|i| i.name == name).collect();
    if of_name.is_empty() {
        let mut names: Vec<&str> = interfaces.iter().map(|i| i.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        return Err(ControlError::BindAddress(format!(
            "network interface \"{name}\" does not exist or has no IP address (interfaces with addresses: {})",
            names.join(", ")
        )));
    }
    let best = of_name
        .iter()
        .filter(|i| i.usable())
        .min_by_key(|i| if i.ip.is_ipv4() { 0 } else { 1 })
        .ok_or_else(|| {
            ControlError::BindAddress(format!(
                "network interface \"{name}\" is down or has only link-local/unusable addresses"
            ))
        })?;
    check_bindable(best.ip, allow_loopback)?;
    Ok(best.ip)
}

/// The source address the kernel would use to reach `probe`: a UDP socket is
/// connected (which only looks up the route; nothing is sent).
fn route_source_address(probe: SocketAddr) -> Option<IpAddr> {
    let unspecified: SocketAddr = if probe.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(unspecified).ok()?;
    socket.connect(probe).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

fn auto_detect(interfaces: &[InterfaceAddress], allow_loopback: bool) -> IpAddr {
    let is_usable_here = |ip: IpAddr| {
        interfaces
            .iter()
            .any(|i| i.ip == ip && i.usable() && !i.is_loopback())
    };
    let probes: [SocketAddr; 2] = [
        (Ipv4Addr::new(8, 8, 8, 8), 53).into(),
        (
            Ipv6Addr::new(0x2001, 0x4860, 0x4860, 0, 0, 0, 0, 0x8888),
            53,
        )
            .into(),
    ];
    for probe in probes {
        if let Some(ip) = route_source_address(probe).filter(|ip| is_usable_here(*ip)) {
            tracing::debug!(%ip, "control channel: using the default route's source address");
            return ip;
        }
    }
    let first_up = interfaces
        .iter()
        .filter(|i| i.usable() && !i.is_loopback())
        .min_by_key(|i| if i.ip.is_ipv4() { 0 } else { 1 });
    if let Some(i) = first_up {
        tracing::debug!(ip = %i.ip, interface = %i.name, "control channel: no default route; using the first interface that is up");
        return i.ip;
    }
    if !allow_loopback {
        tracing::warn!("control channel: this host has no routable address; binding 127.0.0.1, reachable only from this host");
    }
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

/// Validates a peer endpoint (`tcp://<ip>:<port>`, IPv6 bracketed, port
/// 1..65535, a unicast address) and returns its socket address.
pub fn parse_tcp_endpoint(endpoint: &Endpoint) -> Result<SocketAddr, ControlError> {
    let invalid = |reason: &str| ControlError::InvalidEndpoint {
        endpoint: endpoint.display_name(),
        expected: TCP_FORM,
        reason: reason.to_string(),
    };
    let text = endpoint
        .as_str()
        .ok_or_else(|| invalid("it is not UTF-8 text"))?;
    if text.len() > 255 {
        return Err(invalid("it is longer than 255 bytes"));
    }
    let rest = text
        .strip_prefix("tcp://")
        .ok_or_else(|| invalid("the scheme must be tcp://"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid("the port is missing"))?;
    let ip: IpAddr = if let Some(inner) = host.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| invalid("the opening '[' has no closing ']'"))?;
        let v6: Ipv6Addr = inner
            .parse()
            .map_err(|_| invalid(&format!("\"{inner}\" is not an IPv6 address")))?;
        IpAddr::V6(v6)
    } else if host.contains(':') {
        return Err(invalid(
            "an IPv6 address must be bracketed, e.g. tcp://[::1]:5555",
        ));
    } else {
        let v4: Ipv4Addr = host.parse().map_err(|_| {
            invalid(&format!(
                "\"{host}\" is not an IPv4 address (host names are not accepted)"
            ))
        })?;
        IpAddr::V4(v4)
    };
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(invalid(&format!("{ip} is not a unicast address")));
    }
    if matches!(ip, IpAddr::V4(v4) if v4.is_broadcast()) {
        return Err(invalid("the broadcast address cannot be connected to"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| invalid(&format!("the port \"{port}\" is not a number in 1..65535")))?;
    if port == 0 {
        return Err(invalid("the port must be in 1..65535, not 0"));
    }
    Ok(SocketAddr::new(ip, port))
}

/// The canonical text of an endpoint (`tcp://1.2.3.4:5`, `tcp://[::1]:5`).
pub(crate) fn canonical(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// A registered peer: its DEALER and bookkeeping.
struct Peer {
    endpoint: String,
    socket: zmq::Socket,
    dropped: u64,
    link: Option<Link>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        if self.link.is_some() {
            // Stop the monitor while its reader is still connected: events
            // the closing DEALER emits later would otherwise block the IO
            // thread on a reader that is gone.
            // SAFETY: the socket is a live DEALER owned by this peer, used
            // only by this thread; a null endpoint deregisters monitoring
            // (zmq_socket_monitor's documented form).
            let rc = unsafe {
                zmq_sys::zmq_socket_monitor(self.socket.as_mut_ptr(), std::ptr::null(), 0)
            };
            if rc != 0 {
                tracing::warn!(endpoint = %self.endpoint, "control channel: stopping a link monitor failed");
            }
        }
    }
}

/// The state of a DEALER's connection, from its socket monitor: up from a
/// completed ZMTP handshake until a disconnection (the peer closed or died,
/// or a heartbeat went unanswered). A new peer starts down.
struct Link {
    monitor: zmq::Socket,
    up: bool,
    down_since: Instant,
    /// Since it went down, ZMQ saw a failure (a disconnection, a refused
    /// connection), not just slowness.
    failed: bool,
    /// This outage was already logged.
    reported: bool,
}

impl Link {
    const EVENTS: i32 = zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32
        | zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::CONNECT_RETRIED as i32;
    /// Whether the peer counts as unreachable at `now`.
    fn unreachable(&self, now: Instant, timeout: Duration) -> bool {
        super::down_too_long(self.up, self.failed, self.down_since, now, timeout)
    }

    /// Applies the monitor's pending events.
    fn update(&mut self, now: Instant) {
        // Each event is two frames: 16-bit event id + 32-bit value (host
        // byte order), then the peer's address.
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some(id) = frames.first().and_then(|f| f.get(..2)) else {
                continue;
            };
            let id = u16::from_ne_bytes([id[0], id[1]]);
            tracing::debug!(
                event = id,
                peer = %String::from_utf8_lossy(frames.get(1).map_or(&[][..], |f| f)),
                "control channel: link event"
            );
            if id == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                self.up = true;
                self.failed = false;
                self.reported = false;
            } else if id == zmq::SocketEvent::DISCONNECTED.to_raw() {
                if self.up {
                    self.up = false;
                    self.down_since = now;
                }
                self.failed = true;
            } else if id == zmq::SocketEvent::CONNECT_RETRIED.to_raw() {
                // A connection attempt failed (refused, unreachable).
                self.failed = true;
            }
        }
    }
}

impl Drop for ZmqChannel {
    fn drop(&mut self) {
        // The context terminates after the sockets; give the last queued
        // messages (REFUSEs sent by a shutting-down endpoint) a bounded
        // moment to leave instead of discarding them.
        for peer in self
            .peers
            .values()
            .chain(self.closing.iter().map(|(_, p)| p))
        {
            let _ = peer.socket.set_linger(DEALER_LINGER_MS);
        }
    }
}

/// The ZMQ control channel (see the module docs).
/// How long, once a DEALER is closed (its peer forgotten, or the channel
/// itself closed), ZMQ keeps trying to deliver its queued messages (a
/// forgetting or shutting-down receiver's REFUSEs).
pub const DEALER_LINGER_MS: i32 = 100;

pub struct ZmqChannel {
    // Sockets are declared before the context; each socket also keeps the
    // context alive, so dropping the channel closes every socket and then
    // terminates the context.
    router: zmq::Socket,
    peers: HashMap<PeerHandle, Peer>,
    by_endpoint: HashMap<String, PeerHandle>,
    /// Removed peers, closed once their moment to send what they queued is
    /// over (see the module docs).
    closing: Vec<(Instant, Peer)>,
    next_peer: u64,
    local: Endpoint,
    config: ZmqConfig,
    /// In-process wake-up: `waker()` pushes an empty message that makes a
    /// waiting `recv` return (the ROUTER and this socket are polled together).
    wake_rx: zmq::Socket,
    wake_tx: Arc<Mutex<zmq::Socket>>,
    context: zmq::Context,
}

impl std::fmt::Debug for ZmqChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqChannel")
            .field("local", &self.local)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl ZmqChannel {
    /// Creates the channel: resolves the bind address, binds the ROUTER on a
    /// kernel-chosen port and reads the real endpoint back.
    pub fn new(bind: &BindSpec, config: ZmqConfig) -> Result<Self, ControlError> {
        let ip = bind.resolve()?;
        let context = zmq::Context::new();
        let router = context
            .socket(zmq::ROUTER)
            .map_err(|e| ControlError::zmq("creating the ROUTER", e))?;
        let setup = |what: &str, r: zmq::Result<()>| {
            r.map_err(|e| ControlError::zmq(format!("setting {what} on the ROUTER"), e))
        };
        setup("ZMQ_LINGER", router.set_linger(0))?;
        setup("ZMQ_ROUTER_HANDOVER", router.set_router_handover(true))?;
        setup("ZMQ_RCVHWM", router.set_rcvhwm(config.recv_hwm))?;
        setup(
            "ZMQ_MAXMSGSIZE",
            router.set_maxmsgsize(config.max_message_bytes),
        )?;
        if ip.is_ipv6() {
            setup("ZMQ_IPV6", router.set_ipv6(true))?;
        }
        let bind_at = match ip {
            IpAddr::V4(v4) => format!("tcp://{v4}:*"),
            IpAddr::V6(v6) => format!("tcp://[{v6}]:*"),
        };
        router
            .bind(&bind_at)
            .map_err(|e| ControlError::zmq(format!("binding the ROUTER to {bind_at}"), e))?;
        let last = router
            .get_last_endpoint()
            .map_err(|e| ControlError::zmq("reading ZMQ_LAST_ENDPOINT", e))?
            .map_err(|raw| {
                ControlError::BindAddress(format!("ZMQ_LAST_ENDPOINT is not UTF-8: {raw:?}"))
            })?;
        let addr = parse_tcp_endpoint(&Endpoint::from(last.as_str()))?;
        let local = Endpoint::from(canonical(addr));
        // One inproc pair per channel (the context is the channel's own, so
        // the name only has to be unique within it).
        let wake_rx = context
            .socket(zmq::PULL)
            .map_err(|e| ControlError::zmq("creating the wake-up socket", e))?;
        wake_rx
            .set_linger(0)
            .and_then(|()| wake_rx.bind("inproc://wake"))
            .map_err(|e| ControlError::zmq("binding the wake-up socket", e))?;
        let wake_tx = context
            .socket(zmq::PUSH)
            .map_err(|e| ControlError::zmq("creating the wake-up sender", e))?;
        wake_tx
            .set_linger(0)
            .and_then(|()| wake_tx.set_sndhwm(1))
            .and_then(|()| wake_tx.connect("inproc://wake"))
            .map_err(|e| ControlError::zmq("connecting the wake-up sender", e))?;
        tracing::info!(endpoint = %local, "ZMQ control channel bound");
        Ok(Self {
            router,
            peers: HashMap::new(),
            by_endpoint: HashMap::new(),
            closing: Vec::new(),
            next_peer: 1,
            local,
            config,
            wake_rx,
            wake_tx: Arc::new(Mutex::new(wake_tx)),
            context,
        })
    }

    /// Number of registered peers (each holds exactly one DEALER).
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// Closes the removed peers' DEALERs whose moment is over.
    fn close_removed(&mut self) {
        if !self.closing.is_empty() {
            let now = Instant::now();
            self.closing.retain(|(due, _)| *due > now);
        }
    }

    /// A DEALER connected to `endpoint`, with its link monitor when liveness
    /// is tracked (`monitor_id` names the monitor's inproc endpoint).
    fn connect_dealer(
        &self,
        endpoint: &str,
        monitor_id: u64,
    ) -> Result<(zmq::Socket, Option<Link>), ControlError> {
        let ctx = |what: &str| format!("{what} for peer {endpoint}");
        let dealer = self
            .context
            .socket(zmq::DEALER)
            .map_err(|e| ControlError::zmq(ctx("creating a DEALER"), e))?;
        // Linger 0 while in use; closing sets DEALER_LINGER_MS so the last
        // queued messages may leave (`remove_peer`, Drop for the channel).
        dealer
            .set_linger(0)
            .map_err(|e| ControlError::zmq(ctx("setting ZMQ_LINGER"), e))?;
        dealer
            .set_sndhwm(self.config.send_hwm)
            .map_err(|e| ControlError::zmq(ctx("setting ZMQ_SNDHWM"), e))?;
        dealer
            .set_ipv6(true)
            .map_err(|e| ControlError::zmq(ctx("setting ZMQ_IPV6"), e))?;
        dealer
            .set_identity(self.local.as_bytes())
            .map_err(|e| ControlError::zmq(ctx("setting the routing id"), e))?;
        let link = match self.config.liveness_timeout {
            Some(timeout) => {
                let ms = |d: Duration| i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1);
                dealer
                    .set_heartbeat_ivl(ms(timeout / 4))
                    .and_then(|()| dealer.set_heartbeat_timeout(ms(timeout)))
                    .map_err(|e| ControlError::zmq(ctx("setting ZMQ_HEARTBEAT_IVL/TIMEOUT"), e))?;
                // libzmq sends monitor events from its IO thread with a
                // blocking send: the reader must never make that wait (it
                // would stall every socket of the channel). So the reader
                // connects before the DEALER does (no event lost, none sent
                // to nobody), its queue is unbounded (RCVHWM 0; it is drained
                // every reactor check), and the monitor is stopped before
                // the reader goes (`Drop for Peer`).
                let at = format!("inproc://link-{monitor_id}");
                dealer
                    .monitor(&at, Link::EVENTS)
                    .map_err(|e| ControlError::zmq(ctx("monitoring the DEALER"), e))?;
                let monitor = self
                    .context
                    .socket(zmq::PAIR)
                    .and_then(|m| m.set_linger(0).map(|()| m))
                    .and_then(|m| m.set_rcvhwm(0).map(|()| m))
                    .and_then(|m| m.connect(&at).map(|()| m))
                    .map_err(|e| ControlError::zmq(ctx("connecting the DEALER's monitor"), e))?;
                Some(Link {
                    monitor,
                    up: false,
                    down_since: Instant::now(),
                    failed: false,
                    reported: false,
                })
            }
            None => None,
        };
        dealer
            .connect(endpoint)
            .map_err(|e| ControlError::zmq(ctx("connecting"), e))?;
        Ok((dealer, link))
    }

    /// Turns one ROUTER message into an [`Incoming`], or `None` (with a
    /// warning) when it is malformed.
    fn parse_message(&self, mut frames: Vec<Vec<u8>>) -> Option<Incoming> {
        if frames.len() != 2 {
            tracing::warn!(
                frames = frames.len(),
                "control channel: dropping a message with {} frames (expected a routing id and one payload frame)",
                frames.len()
            );
            return None;
        }
        let payload = frames.pop().unwrap_or_default();
        let id = Endpoint::from_bytes(frames.pop().unwrap_or_default());
        match parse_tcp_endpoint(&id) {
            Ok(addr) => Some(Incoming {
                from: Endpoint::from(canonical(addr)),
                payload,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "control channel: dropping a message whose routing id is not a peer endpoint");
                None
            }
        }
    }
}

impl ControlChannel for ZmqChannel {
    fn local_endpoint(&self) -> &Endpoint {
        &self.local
    }

    fn add_peer(&mut self, endpoint: &Endpoint) -> Result<PeerHandle, ControlError> {
        let key = canonical(parse_tcp_endpoint(endpoint)?);
        if let Some(handle) = self.by_endpoint.get(&key) {
            return Ok(*handle);
        }
        let handle = PeerHandle::new(self.next_peer);
        self.next_peer += 1;
        // A peer removed a moment ago gets its socket back (one connection,
        // one routing id at the remote ROUTER).
        let peer = match self.closing.iter().position(|(_, p)| p.endpoint == key) {
            Some(i) => self.closing.swap_remove(i).1,
            None => {
                let (socket, link) = self.connect_dealer(&key, handle.id())?;
                Peer {
                    endpoint: key.clone(),
                    socket,
                    dropped: 0,
                    link,
                }
            }
        };
        tracing::debug!(%handle, endpoint = %key, "control channel: peer added");
        self.by_endpoint.insert(key, handle);
        self.peers.insert(handle, peer);
        Ok(handle)
    }

    fn remove_peer(&mut self, peer: PeerHandle) -> bool {
        let Some(removed) = self.peers.remove(&peer) else {
            return false;
        };
        self.by_endpoint.remove(&removed.endpoint);
        tracing::debug!(handle = %peer, endpoint = %removed.endpoint, dropped = removed.dropped, "control channel: peer removed");
        // Closed (linger 0) once what it queued (a REFUSE) had a moment to
        // leave.
        let due = Instant::now() + Duration::from_millis(DEALER_LINGER_MS as u64);
        self.closing.push((due, removed));
        true
    }

    fn send(&mut self, peer: PeerHandle, msg: &[u8]) -> Result<(), SendError> {
        let entry = self
            .peers
            .get_mut(&peer)
            .ok_or(SendError::UnknownPeer(peer))?;
        let mut attempts = 0;
        loop {
            match entry.socket.send(msg, zmq::DONTWAIT) {
                Ok(()) => return Ok(()),
                Err(zmq::Error::EAGAIN) => {
                    entry.dropped += 1;
                    tracing::warn!(
                        endpoint = %entry.endpoint,
                        dropped_total = entry.dropped,
                        bytes = msg.len(),
                        "control channel: send queue full (peer slow or unreachable); message dropped"
                    );
                    return Err(SendError::WouldBlock {
                        endpoint: entry.endpoint.clone(),
                    });
                }
                Err(zmq::Error::EINTR) if attempts < 3 => attempts += 1,
                Err(e) => {
                    return Err(SendError::Failed {
                        endpoint: entry.endpoint.clone(),
                        reason: e.to_string(),
                    })
                }
            }
        }
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Incoming>, ControlError> {
        self.close_removed();
        let deadline = super::deadline_after(timeout);
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            // Round up so a sub-millisecond wait still waits.
            let ms = i64::try_from(remaining.as_micros().div_ceil(1000)).unwrap_or(i64::MAX);
            let mut items = [
                self.router.as_poll_item(zmq::POLLIN),
                self.wake_rx.as_poll_item(zmq::POLLIN),
            ];
            match zmq::poll(&mut items, ms) {
                Ok(0) => return Ok(None),
                Ok(_) => {}
                Err(zmq::Error::EINTR) => continue,
                Err(e) => return Err(ControlError::zmq("polling the ROUTER", e)),
            }
            let (router_ready, woken) = (items[0].is_readable(), items[1].is_readable());
            if woken {
                while self.wake_rx.recv_bytes(zmq::DONTWAIT).is_ok() {}
                if !router_ready {
                    return Ok(None);
                }
            }
            match self.router.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    if let Some(incoming) = self.parse_message(frames) {
                        return Ok(Some(incoming));
                    }
                }
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {}
                Err(e) => return Err(ControlError::zmq("receiving on the ROUTER", e)),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    fn kind(&self) -> ControlKind {
        ControlKind::Zmq
    }

    fn unreachable_peers(&mut self) -> Vec<PeerHandle> {
        let Some(timeout) = self.config.liveness_timeout else {
            return Vec::new();
        };
        let now = Instant::now();
        let mut down = Vec::new();
        for (handle, peer) in &mut self.peers {
            let Some(link) = &mut peer.link else {
                continue;
            };
            link.update(now);
            if link.unreachable(now, timeout) {
                if !link.reported {
                    link.reported = true;
                    tracing::warn!(
                        endpoint = %peer.endpoint,
                        "control channel: no connection to the peer for {:?}; it is unreachable",
                        now.duration_since(link.down_since)
                    );
                }
                down.push(*handle);
            }
        }
        down
    }

    fn waker(&self) -> super::Waker {
        let tx = self.wake_tx.clone();
        Arc::new(move || {
            // The mutex serialises use of the socket across threads (ZMQ
            // sockets may move between threads behind a full barrier). A
            // full queue means a wake-up is already pending: nothing to do.
            let _ = tx.locked().send(&[] as &[u8], zmq::DONTWAIT);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_forms() {
        let a = parse_tcp_endpoint(&Endpoint::from("tcp://[::1]:0005")).unwrap();
        assert_eq!(canonical(a), "tcp://[::1]:5");
        let b = parse_tcp_endpoint(&Endpoint::from("tcp://10.1.2.3:65535")).unwrap();
        assert_eq!(canonical(b), "tcp://10.1.2.3:65535");
    }

    #[test]
    fn link_local_is_recognised() {
        assert!(is_ipv6_link_local("fe80::1".parse().unwrap()));
        assert!(!is_ipv6_link_local("fd00::1".parse().unwrap()));
        assert!(!is_ipv6_link_local("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn interface_listing_includes_loopback() {
        let list = interface_addresses().unwrap();
        assert!(
            list.iter().any(|i| i.ip.is_loopback() && i.loopback),
            "{list:?}"
        );
    }
}
