//! The application's view of one bounce request: a status set once, read
//! lock-free by `checkXfer`.

use super::*;

/// Status values of a ticket (NIXL status codes).
const IN_PROGRESS: i32 = crate::engine::Status::InProgress as i32;
const SUCCESS: i32 = crate::engine::Status::Success as i32;
/// Any other value: failed, the reason in `failure`.
const FAILED: i32 = -1;

/// The application's view of one bounce request.
#[derive(Debug)]
pub struct Ticket {
    status: AtomicI32,
    failure: Mutex<Option<FailureReason>>,
    pub(super) request: Mutex<Option<RequestId>>,
}

impl Ticket {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            status: AtomicI32::new(IN_PROGRESS),
            failure: Mutex::new(None),
            request: Mutex::new(None),
        })
    }
    /// `None` while running; then `Ok(())` or the failure reason.
    pub fn outcome(&self) -> Option<Result<(), FailureReason>> {
        match self.status.load(Ordering::Acquire) {
            IN_PROGRESS => None,
            SUCCESS => Some(Ok(())),
            _ => Some(Err(self
                .failure
                .locked()
                .unwrap_or(FailureReason::Rejected))),
        }
    }
    pub(super) fn finish(&self, outcome: Result<(), FailureReason>) {
        if let Err(reason) = outcome {
            *self.failure.locked() = Some(reason);
            self.status.store(FAILED, Ordering::Release);
        } else {
            self.status.store(SUCCESS, Ordering::Release);
        }
    }
}
