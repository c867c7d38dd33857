//! Fault injection for tests and fault drills.
//!
//! `NIXL_BOUNCE_FAILPOINTS` holds a comma-separated list of failpoint names,
//! read when an engine is created. Unset (the normal case) nothing is
//! injected and each check is one branch on an empty set.
//!
//! | name | effect |
//! |---|---|
//! | `panic_in_post_xfer` | `postXfer` panics (checks the FFI panic boundary) |
//! | `fail_chunk_writes` | every chunk write reports failure |
//! | `drop_control` | every outgoing control message is dropped |
//! | `advertise_no_read` | the handshake omits the READ capability (a peer built before READ) |

use std::collections::BTreeSet;

pub const ENV: &str = "NIXL_BOUNCE_FAILPOINTS";

/// Known failpoints (anything else in the variable is warned about).
pub const KNOWN: &[&str] = &[
    "panic_in_post_xfer",
    "fail_chunk_writes",
    "drop_control",
    "advertise_no_read",
];

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Failpoints(BTreeSet<String>);

impl Failpoints {
    pub fn from_env() -> Self {
        std::env::var(ENV)
            .map(|v| Self::parse(&v))
            .unwrap_or_default()
    }

    pub fn parse(spec: &str) -> Self {
        let mut set = BTreeSet::new();
        for name in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if KNOWN.contains(&name) {
                set.insert(name.to_string());
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
        !self.0.is_empty() && self.0.contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_names_and_ignores_unknown_ones() {
        let f = Failpoints::parse(" drop_control, nonsense ,fail_chunk_writes");
        assert!(f.is_set("drop_control"));
        assert!(f.is_set("fail_chunk_writes"));
        assert!(!f.is_set("nonsense"));
        assert!(!Failpoints::default().is_set("drop_control"));
    }
}
