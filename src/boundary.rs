//! The crate's one way to stop a panic.
//!
//! A panic must not unwind into NIXL's C++ (that aborts the host process),
//! nor end the IO thread or a copy worker unseen. Every place that stops one
//! goes through [`catch`], which hands back the panic's message; what to do
//! with it (an error status, a broken engine, a poisoned arena) is the
//! caller's. `ffi`'s entry points use it through `ffi::boundary`.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `body`; a panic inside it becomes `Err(its message)`.
///
/// The closure is asserted unwind-safe: every caller either discards what
/// the body touched (a broken engine refuses all but teardown; a poisoned
/// arena is leaked) or only reads it afterwards under the lock policy of
/// [`crate::sync`].
pub fn catch<T>(body: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(body)).map_err(|p| message(&*p))
}

/// The text of a panic's payload (`panic!`'s message, or a placeholder).
pub fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message() {
        assert_eq!(catch(|| 7), Ok(7));
        assert_eq!(
            catch(|| -> u8 { panic!("static text") }),
            Err("static text".into())
        );
        let n = 3;
        assert_eq!(
            catch(|| -> u8 { panic!("formatted {n}") }),
            Err("formatted 3".into())
        );
        assert_eq!(
            catch(|| std::panic::panic_any(5u32)),
            Err("a panic without a message".into())
        );
    }
}
