//! The crate's one lock policy: a poisoned lock is taken as it is.
//!
//! A panic on a thread that held a lock is caught at the FFI boundary (which
//! marks the engine broken) or on the thread that had it (the reactor, a copy
//! worker). What runs afterwards is NIXL's teardown: deregistration,
//! disconnect, release. Refusing it with a second panic would leak the very
//! resources teardown is there to free, so every lock in the crate is taken
//! through [`Locked`], never with `lock().expect(..)` (one exception,
//! `engine::ipc::take_kept`, resets a poisoned cache on purpose). The state behind each
//! lock is a map, a queue or a single slot that is written in one step, so a
//! panic leaves nothing half-changed that teardown could misread.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError, TryLockError, WaitTimeoutResult};
use std::time::Duration;

/// Takes a mutex whether or not a panic poisoned it (the module's policy).
pub trait Locked<T: ?Sized> {
    fn locked(&self) -> MutexGuard<'_, T>;
    /// The lock if it is free now, poisoned or not; `None` only while
    /// another thread holds it.
    fn try_locked(&self) -> Option<MutexGuard<'_, T>>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
    fn try_locked(&self) -> Option<MutexGuard<'_, T>> {
        match self.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// [`Condvar::wait_timeout`] under the same policy.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    dur: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    cv.wait_timeout(guard, dur)
        .unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
        assert_eq!(m.try_locked().map(|g| *g), Some(2));
        let held = m.locked();
        assert!(m.try_locked().is_none(), "held elsewhere: not taken");
        drop(held);
    }
}
