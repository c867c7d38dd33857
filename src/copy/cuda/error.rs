//! What can go wrong on the GPU side, typed: the CUDA engines, the IPC
//! mappings and device buffers all answer with a [`CudaError`].

use std::fmt::Display;

/// A failure of the CUDA driver, NVRTC, or of what was asked of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA here: no driver library, no device, `cuInit`
    /// failed, or no kernel target for this GPU. The GPU paths are off.
    #[error("{0}")]
    Unavailable(String),
    /// A call failed (the driver's, NVRTC's, or an allocation beneath
    /// them): `call` says which, and on what.
    #[error("{call}: {cause}")]
    Call {
        /// The call and its subject.
        call: String,
        /// The error it returned.
        cause: String,
    },
    /// The CUDA library panicked inside `what` (a missing symbol).
    #[error("{what}: the CUDA library panicked: {panic}")]
    Panicked {
        /// What was being done.
        what: String,
        /// The panic's message.
        panic: String,
    },
    /// A request the engine cannot take: outside a buffer or region, too
    /// large for a table, an address no allocation holds.
    #[error("{0}")]
    Invalid(String),
    /// Nothing became free, or nothing finished, in time.
    #[error("{0}")]
    Timeout(String),
}

impl CudaError {
    /// A failed call.
    pub fn call(call: impl Into<String>, cause: impl Display) -> CudaError {
        CudaError::Call {
            call: call.into(),
            cause: cause.to_string(),
        }
    }
}

/// For callers whose errors are text (the tools, the copy engine's
/// `CopyError` reason).
impl From<CudaError> for String {
    fn from(e: CudaError) -> String {
        e.to_string()
    }
}
