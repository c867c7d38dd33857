//! nixl-bounce: a NIXL backend plugin.
