//! nixl-bounce: a NIXL backend plugin that gathers many small scattered
//! descriptors into a registered arena, moves each chunk with one write into
//! the peer's arena, and lets the receiver scatter it to the final
//! destinations.
//!
//! # The determinism contract of `proto/`
//!
//! [`proto`] is the whole protocol (planning, wire codec, arena allocation,
//! credit scheduling, sender and receiver state machines) as pure Rust:
//!
//! - no threads, sockets, clocks, GPU or NIXL calls, no global state and no
//!   randomness: the same sequence of `handle_*` calls (with the same
//!   [`proto::Time`] values) produces the same sequence of actions;
//! - time is always an argument; timers are reported by `poll_timeout` and
//!   fired by calling `handle_timeout`;
//! - effects leave only through `poll_action` as [`proto::Action`] values,
//!   which the runtime executes (gather, write, scatter, send, complete) and
//!   whose results it feeds back as events;
//! - malformed input (wire bytes, descriptors, peer behaviour) is an error
//!   value or a counted, logged drop, never a panic;
//! - no `unsafe`.
//!
//! This is what lets `tests/sim.rs` run tens of thousands of seeded,
//! reproducible scenarios with simulated memory, loss, reordering and
//! crashes.
//!
//! [`config`] turns environment variables and backend parameters into a
//! validated [`config::Config`].

pub mod config;
pub mod proto;
