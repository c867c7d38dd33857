//! nixl-bounce: a NIXL backend plugin (`libplugin_BOUNCE.so`) that is a
//! drop-in replacement for NIXL's UCX backend and, for transfers made of many
//! small descriptors, gathers them into a registered arena and moves each
//! chunk with one write ("bounce buffers").
//!
//! Crate map:
//! - [`ffi`]: the `extern "C"` entry points the C++ shim (`plugin/`) calls;
//!   the panic boundary and handle ownership live there.
//! - [`engine`]: the backend itself: registration, metadata, connections,
//!   transfers and notifications, delegated to an inner NIXL agent that owns a
//!   UCX backend.
//! - [`nixl_runtime`]: finds the NIXL C API next to the NIXL that loaded us.
//! - [`logging`]: `tracing` set-up from `NIXL_BOUNCE_LOG` / `NIXL_BOUNCE_LOG_FILE`.

pub mod control;
pub mod engine;
pub mod ffi;
pub mod logging;
pub mod nixl_runtime;
