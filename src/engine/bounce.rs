//! The bounce path of one engine: its arena, control channel, protocol
//! endpoint and reactor, plus the routing decision.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use nixl_sys::{Agent, MemType};

use crate::config::Config;
use crate::control::zmq::{BindSpec, ZmqChannel, ZmqConfig};
use crate::control::notif::{NotifChannel, NotifHub};
use crate::control::ControlChannel;
use crate::copy::host::HostCopy;
use crate::copy::RegionSpan;
use crate::failpoint::Failpoints;
use crate::dataplane::{DataPlane, HostArena, PeerArena};
use crate::proto::wire::{Capabilities, ControlKind, Handshake, Incompatible, WIRE_VERSION};
use crate::proto::{Endpoint, EndpointConfig};
use crate::runtime::{Parts, Runtime};

use super::{MemKind, Op};

/// A running bounce path. Field order matters: the runtime (which reads and
/// writes the arena) stops before the arena is unmapped.
pub struct Bounce {
    pub config: Config,
    pub handshake: Handshake,
    pub runtime: Runtime,
    _arena: Arc<HostArena>,
}

impl std::fmt::Debug for Bounce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounce").field("handshake", &self.handshake).finish_non_exhaustive()
    }
}

impl Bounce {
    /// Allocates and registers the arena, binds the control channel and
    /// starts the reactor. Must run before the inner agent's metadata is
    /// taken, so that the arena's registration travels in it.
    pub fn start(
        inner: &Agent,
        hub: &Arc<NotifHub>,
        agent: &str,
        config: Config,
        failpoints: &Failpoints,
    ) -> Result<Self, String> {
        let capacity = config.arena_usable_capacity();
        let arena = Arc::new(
            HostArena::new(capacity as usize)
                .map_err(|e| format!("allocating the {capacity}-byte host arena: {e}"))?,
        );
        let data = DataPlane::new(inner.clone(), &arena)?;
        let (channel, control): (Box<dyn ControlChannel>, ControlKind) = if config.use_nixl_notifications {
            let ch = NotifChannel::new(hub.clone()).map_err(|e| e.to_string())?;
            (Box::new(ch), ControlKind::NixlNotif)
        } else {
            let bind = if config.control_bind_loopback {
                BindSpec::loopback()
            } else if !config.control_interface.is_empty() {
                BindSpec::interface(config.control_interface.clone())
            } else {
                BindSpec::auto()
            };
            let ch = ZmqChannel::new(&bind, ZmqConfig::default()).map_err(|e| e.to_string())?;
            (Box::new(ch), ControlKind::Zmq)
        };
        let endpoint_bytes = channel.local_endpoint().as_bytes().to_vec();
        let endpoint = Endpoint::new(EndpointConfig::from_config(&config, endpoint_bytes.clone(), request_id_base()))
            .map_err(|e| format!("protocol endpoint: {e}"))?;
        let handshake = Handshake {
            wire_version: WIRE_VERSION,
            control,
            capabilities: Capabilities::CANCEL,
            arena_usable_capacity: capacity,
            max_chunk_size: config.max_chunk_size_bytes,
            arena_base: arena.base() as u64,
            arena_device: 0,
            endpoint: endpoint_bytes,
        };
        let notifier = inner.clone();
        let workers = (config.scatter_worker_count as usize).clamp(1, 64);
        let runtime = Runtime::start(Parts {
            name: agent.to_string(),
            endpoint,
            channel,
            data,
            arena: RegionSpan { addr: arena.base(), len: arena.len() },
            copier: Arc::new(HostCopy::default()),
            copy_workers: workers,
            failpoints: failpoints.clone(),
            notify: Box::new(move |target: &str, msg: &[u8]| {
                notifier.send_notification(target, msg, None).map_err(|e| e.to_string())
            }),
        })
        .map_err(|e| format!("starting the reactor: {e}"))?;
        Ok(Self { config, handshake, runtime, _arena: arena })
    }

    /// Whether a peer advertising `peer` can be served by the bounce path.
    pub fn accepts(&self, peer: &Handshake) -> Result<PeerArena, Incompatible> {
        self.handshake.check_compatible(peer)?;
        Ok(PeerArena {
            inner_agent: String::new(),
            base: peer.arena_base,
            device: u64::from(peer.arena_device),
            mem: MemType::Dram,
        })
    }
}

/// The protocol's name for a peer: its control endpoint up to the first NUL
/// byte (a notification endpoint carries the peer's metadata after one; the
/// channel names senders without it).
pub fn peer_id_of(endpoint: &[u8]) -> Option<crate::proto::PeerId> {
    let head = endpoint.split(|&b| b == 0).next().unwrap_or_default();
    std::str::from_utf8(head).ok().filter(|s| !s.is_empty()).map(crate::proto::PeerId::new)
}

/// Request ids must not repeat across incarnations of an agent (the peer may
/// remember a cancelled id): start from the clock and the process id.
fn request_id_base() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 40)
}

/// Why a transfer takes the standard (UCX) path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fallback {
    BounceDisabled,
    Poisoned,
    NotWrite,
    MemoryKind,
    PeerNotBounceCapable,
    LocalTransfer,
    TooFewDescriptors,
    DescriptorsTooLarge,
}

impl Fallback {
    pub fn name(self) -> &'static str {
        match self {
            Self::BounceDisabled => "fallback_bounce_disabled",
            Self::Poisoned => "fallback_poisoned",
            Self::NotWrite => "fallback_not_write",
            Self::MemoryKind => "fallback_memory_kind",
            Self::PeerNotBounceCapable => "fallback_peer_not_bounce_capable",
            Self::LocalTransfer => "fallback_local_transfer",
            Self::TooFewDescriptors => "fallback_too_few_descriptors",
            Self::DescriptorsTooLarge => "fallback_descriptors_too_large",
        }
    }
    pub const ALL: [Fallback; 8] = [
        Self::BounceDisabled,
        Self::Poisoned,
        Self::NotWrite,
        Self::MemoryKind,
        Self::PeerNotBounceCapable,
        Self::LocalTransfer,
        Self::TooFewDescriptors,
        Self::DescriptorsTooLarge,
    ];
}

/// What the routing decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput {
    pub op: Op,
    pub local: MemKind,
    pub remote: MemKind,
    pub descriptors: u64,
    pub bytes: u64,
    pub peer_capable: bool,
    pub local_transfer: bool,
}

/// The routing rule: WRITE between memory the arena serves, to a peer that
/// passed the handshake, with many small descriptors.
pub fn route(cfg: &Config, poisoned: bool, r: &RouteInput) -> Result<(), Fallback> {
    if !cfg.enabled {
        return Err(Fallback::BounceDisabled);
    }
    if poisoned {
        return Err(Fallback::Poisoned);
    }
    if r.op != Op::Write {
        return Err(Fallback::NotWrite);
    }
    if r.local != MemKind::Dram || r.remote != MemKind::Dram {
        return Err(Fallback::MemoryKind);
    }
    if r.local_transfer {
        return Err(Fallback::LocalTransfer);
    }
    if !r.peer_capable {
        return Err(Fallback::PeerNotBounceCapable);
    }
    if r.descriptors < cfg.min_descriptor_count.max(1) {
        return Err(Fallback::TooFewDescriptors);
    }
    if r.bytes > cfg.max_average_descriptor_size_bytes.saturating_mul(r.descriptors) {
        return Err(Fallback::DescriptorsTooLarge);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> RouteInput {
        RouteInput {
            op: Op::Write,
            local: MemKind::Dram,
            remote: MemKind::Dram,
            descriptors: 4096,
            bytes: 4096 * 4096,
            peer_capable: true,
            local_transfer: false,
        }
    }

    #[test]
    fn eligible_transfers_take_the_bounce_path() {
        let cfg = Config { enabled: true, ..Config::default() };
        assert_eq!(route(&cfg, false, &input()), Ok(()));
    }

    #[test]
    fn each_gate_names_its_fallback() {
        let on = Config { enabled: true, ..Config::default() };
        let off = Config { enabled: false, ..Config::default() };
        assert_eq!(route(&off, false, &input()), Err(Fallback::BounceDisabled));
        assert_eq!(route(&on, true, &input()), Err(Fallback::Poisoned));
        assert_eq!(route(&on, false, &RouteInput { op: Op::Read, ..input() }), Err(Fallback::NotWrite));
        assert_eq!(route(&on, false, &RouteInput { remote: MemKind::Vram, ..input() }), Err(Fallback::MemoryKind));
        assert_eq!(route(&on, false, &RouteInput { peer_capable: false, ..input() }), Err(Fallback::PeerNotBounceCapable));
        assert_eq!(route(&on, false, &RouteInput { local_transfer: true, ..input() }), Err(Fallback::LocalTransfer));
        assert_eq!(route(&on, false, &RouteInput { descriptors: 10, bytes: 40960, ..input() }), Err(Fallback::TooFewDescriptors));
        assert_eq!(
            route(&on, false, &RouteInput { bytes: 4096 * 65536, ..input() }),
            Err(Fallback::DescriptorsTooLarge)
        );
    }
}
