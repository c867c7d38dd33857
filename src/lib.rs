//! nixl-bounce: a NIXL backend plugin (`libplugin_BOUNCE.so`) that is a
//! drop-in replacement for NIXL's UCX backend and, for transfers made of many
//! small descriptors, gathers them into a registered arena, moves each chunk
//! with one write into the peer's arena, and lets the receiver scatter it to
//! the final destinations ("bounce buffers").
//!
//! Crate map:
//! - [`ffi`]: the `extern "C"` entry points the C++ shim (`plugin/`) calls;
//!   handle ownership lives there, and every entry runs inside the panic
//!   boundary ([`boundary`]).
//! - [`engine`]: the backend itself: registration, metadata, connections,
//!   routing, transfers and notifications; what BOUNCE does not accelerate
//!   runs on NIXL's own UCX engine, which the shim creates and calls (the
//!   UCX delegate). Its three paths of its own: the bounce arena (an inner
//!   NIXL agent serves it; `engine::bounce`), cross-memory attach between
//!   processes on one host (`engine::cma`), and one kernel over a CUDA IPC
//!   mapping of the peer's GPU memory (`engine::ipc`).
//! - [`config`]: environment variables and backend parameters -> a validated
//!   [`config::Config`].
//! - [`proto`]: the pure protocol (see below).
//! - [`runtime`]: the reactor thread and copy workers that run [`proto`].
//! - [`control`]: control channels (direct TCP, ZMQ, NIXL notifications)
//!   and their heartbeats.
//! - [`dataplane`]: the arena (host or GPU memory) and the chunk writes
//!   through the inner agent.
//! - [`copy`]: the copy engines: memcpy for DRAM, cross-memory attach
//!   (`copy::cma`), the CUDA gather/scatter kernel (`copy::cuda`) and the
//!   peer-mapped copy (`copy::ipc`).
//! - [`failpoint`]: fault injection (`NIXL_BOUNCE_FAILPOINTS`) for tests.
//! - [`nixl_capi`]: finds the NIXL C API next to the NIXL that loaded us.
//! - [`stats`]: per-engine counters, exported to C as `nixl_bounce_stats`.
//! - [`logging`]: `tracing` set-up from `NIXL_BOUNCE_LOG` / `NIXL_BOUNCE_LOG_FILE`.
//! - [`nvtx`]: NVTX ranges for Nsight Systems, when an NVTX library loads.
//! - [`sync`], [`boundary`]: the crate's one lock policy and its one way to
//!   stop a panic.
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

// The documentation is for the people who work on the plugin
// (`cargo doc --document-private-items`, checked by scripts/test.sh), so it
// links private items freely.
#![allow(rustdoc::private_intra_doc_links)]

pub mod boundary;
pub mod config;
pub mod control;
pub mod copy;
pub mod dataplane;
pub mod engine;
pub mod failpoint;
pub mod ffi;
#[cfg(feature = "harness")]
pub mod harness;
pub mod logging;
pub mod nixl_capi;
pub mod nvtx;
pub mod proto;
pub mod runtime;
pub mod splitmix;
pub mod stats;
pub mod sync;
