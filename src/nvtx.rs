//! NVTX ranges for Nsight Systems timelines, loaded at run time.
//!
//! At first use this `dlopen`s an NVTX library: the path in
//! `NIXL_BOUNCE_NVTX_LIB` if set, else `libnvToolsExt.so.1`, else
//! `libnvToolsExt.so` (the NVTX v2 library, which itself forwards to the
//! profiler's injection library named by `NVTX_INJECTION64_PATH` when Nsight
//! runs the process). Python environments with CUDA wheels usually carry it
//! (`nvidia/nvtx/lib/libnvToolsExt.so.1`); point `NIXL_BOUNCE_NVTX_LIB` at it.
//! No library (or no symbols) means every call is a no-op, never an error.
//!
//! cudarc's `nvtx` feature is not used: it loads the same library but panics
//! when it is absent.
//!
//! TODO: speak the NVTX3 injection protocol directly (read
//! `NVTX_INJECTION64_PATH`, call `InitializeInjectionNvtx2`) so no v2
//! library is needed; CUDA 13 toolkits no longer ship `libnvToolsExt.so`.

use std::ffi::{c_char, c_int, CStr, CString};
use std::marker::PhantomData;
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

type PushFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PopFn = unsafe extern "C" fn() -> c_int;

struct Nvtx {
    push: PushFn,
    pop: PopFn,
}

fn load() -> Option<Nvtx> {
    let mut names: Vec<std::ffi::OsString> = Vec::new();
    names.extend(std::env::var_os("NIXL_BOUNCE_NVTX_LIB"));
    names.push("libnvToolsExt.so.1".into());
    names.push("libnvToolsExt.so".into());
    for name in &names {
        // SAFETY: loading the NVTX library runs only its initialisers, which
        // have no preconditions.
        let Ok(lib) = (unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) }) else {
            continue;
        };
        // SAFETY: the symbols are the NVTX C API functions
        // `int nvtxRangePushA(const char*)` and `int nvtxRangePop(void)`.
        let found = unsafe {
            // `Option` of a function pointer: `None` for a null symbol.
            match (
                lib.get::<Option<PushFn>>(c"nvtxRangePushA").map(|s| *s),
                lib.get::<Option<PopFn>>(c"nvtxRangePop").map(|s| *s),
            ) {
                (Ok(Some(push)), Ok(Some(pop))) => Some(Nvtx { push, pop }),
                _ => None,
            }
        };
        let Some(nvtx) = found else { continue };
        // Kept loaded for the life of the process, so that the function
        // pointers stay valid.
        let _ = lib.into_raw();
        tracing::debug!("NVTX ranges enabled through {}", name.to_string_lossy());
        return Some(nvtx);
    }
    None
}

fn lib() -> Option<&'static Nvtx> {
    static LIB: OnceLock<Option<Nvtx>> = OnceLock::new();
    LIB.get_or_init(load).as_ref()
}

/// Whether an NVTX library was found.
pub fn enabled() -> bool {
    lib().is_some()
}

/// An open NVTX range; closed (popped) on drop. NVTX ranges are per thread,
/// so the guard cannot move to another thread.
#[must_use = "the range closes when this guard is dropped"]
pub struct Range {
    pushed: bool,
    _not_send: PhantomData<*const ()>,
}

impl Drop for Range {
    fn drop(&mut self) {
        if self.pushed {
            if let Some(l) = lib() {
                // SAFETY: pops the range this guard pushed on this thread.
                unsafe { (l.pop)() };
            }
        }
    }
}

/// Opens a range named `name` (no-op without an NVTX library).
pub fn range(name: &CStr) -> Range {
    let pushed = match lib() {
        Some(l) => {
            // SAFETY: name is NUL-terminated and outlives the call (NVTX
            // copies the message).
            unsafe { (l.push)(name.as_ptr()) };
            true
        }
        None => false,
    };
    Range {
        pushed,
        _not_send: PhantomData,
    }
}

/// Like [`range`] for a name built at run time (allocates only when NVTX is on).
pub fn range_str(name: &str) -> Range {
    if lib().is_none() {
        return Range {
            pushed: false,
            _not_send: PhantomData,
        };
    }
    match CString::new(name.replace('\0', " ")) {
        Ok(c) => range(&c),
        Err(_) => Range {
            pushed: false,
            _not_send: PhantomData,
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_nest_and_never_fail() {
        let _outer = super::range(c"outer");
        {
            let _inner = super::range_str("inner 1");
        }
        let _ = super::enabled();
    }
}
