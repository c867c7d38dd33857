//! Fault injection for tests and fault drills.
//!
//! `NIXL_BOUNCE_FAILPOINTS` holds a comma-separated list of failpoints,
//! `name` or `name=value`, read when an engine is created. Unset (the normal
//! case) nothing is injected and each check is one branch on an empty map.
//!
//! | name | effect |
//! |---|---|
//! | `panic_in_post_xfer` | `postXfer` panics holding the engine's peer table lock (checks the FFI panic boundary, and that teardown still runs) |
//! | `panic_in_io_thread` | the IO thread panics when it starts a gather (checks its containment) |
//! | `fail_chunk_writes` | every chunk write reports failure |
//! | `stuck_chunk_writes` | chunk writes are never posted and never end (a hung transport) |
//! | `drop_control` | every outgoing control message is dropped |
//! | `advertise_no_read` | the handshake omits the READ capability (a peer built before READ) |
//! | `withhold_grant` | outgoing GRANTs are dropped (the receiver reserves regions, the sender never hears) |
//! | `delay_gather_ms=N` | each gather waits N ms before it copies |
//! | `delay_write_ms=N` | each chunk write waits N ms before it is posted |
//! | `delay_scatter_ms=N` | each scatter waits N ms before it copies |
//! | `no_cancel_capability` | the handshake does not advertise CANCEL (a peer without it) |
//! | `advertise_no_heartbeats` | the handshake omits the HEARTBEATS capability (a peer built before the notification channel's heartbeats) |
//! | `advertise_no_data_path_v2` | the handshake omits the DATA_PATH_V2 capability, and READs' data paths above version 1 are refused by name (an owner built before READs carried the reader's CMA block) |
//! | `control_send_hwm=N` | control sends queue at most N messages per peer (the direct TCP channel's send queue, or ZMQ's high-water mark; saturation drills) |
//! | `another_host` | this process names a host of its own (a random boot id) in what it exports: its peers on this machine take it for another host (two-host runs in network namespaces, `scripts/two-hosts.sh`) |

use std::collections::BTreeMap;
use std::time::Duration;

pub const ENV: &str = "NIXL_BOUNCE_FAILPOINTS";

/// Known failpoints (anything else in the variable is warned about).
pub const KNOWN: &[&str] = &[
    "panic_in_post_xfer",
    "panic_in_io_thread",
    "fail_chunk_writes",
    "stuck_chunk_writes",
    "drop_control",
    "advertise_no_read",
    "withhold_grant",
    "delay_gather_ms",
    "delay_write_ms",
    "delay_scatter_ms",
    "no_cancel_capability",
    "advertise_no_heartbeats",
    "advertise_no_data_path_v2",
    "control_send_hwm",
    "another_host",
];

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Failpoints(BTreeMap<String, Option<u64>>);

impl Failpoints {
    pub fn from_env() -> Self {
        std::env::var(ENV)
            .map(|v| Self::parse(&v))
            .unwrap_or_default()
    }

    pub fn parse(spec: &str) -> Self {
        let mut set = BTreeMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => match v.trim().parse::<u64>() {
                    Ok(v) => (n.trim(), Some(v)),
                    Err(_) => {
                        tracing::warn!(
                            "{ENV}: failpoint {item:?} ignored: its value is not a number"
                        );
                        continue;
                    }
                },
                None => (item, None),
            };
            if KNOWN.contains(&name) {
                set.insert(name.to_string(), value);
            } else {
                tracing::warn!(
                    "{ENV}: unknown failpoint {name:?} ignored (known: {})",
                    KNOWN.join(", ")
                );
            }
        }
        if !set.is_empty() {
            tracing::warn!("{ENV}: fault injection active: {set:?}");
        }
        Self(set)
    }

    pub fn is_set(&self, name: &str) -> bool {
        !self.0.is_empty() && self.0.contains_key(name)
    }

    /// The value of `name=N`, if set with one.
    pub fn value(&self, name: &str) -> Option<u64> {
        if self.0.is_empty() {
            return None;
        }
        self.0.get(name).copied().flatten()
    }

    /// The delay of a `*_ms=N` failpoint (zero when unset).
    pub fn delay(&self, name: &str) -> Duration {
        Duration::from_millis(self.value(name).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_names_and_values_and_ignores_the_rest() {
        let f = Failpoints::parse(
            " drop_control, nonsense ,fail_chunk_writes, delay_gather_ms = 250, delay_write_ms=x",
        );
        assert!(f.is_set("drop_control"));
        assert!(f.is_set("fail_chunk_writes"));
        assert!(!f.is_set("nonsense"));
        assert_eq!(f.delay("delay_gather_ms"), Duration::from_millis(250));
        assert!(!f.is_set("delay_write_ms"), "a value that is not a number");
        assert_eq!(f.delay("delay_scatter_ms"), Duration::ZERO);
        assert!(!Failpoints::default().is_set("drop_control"));
    }
}
