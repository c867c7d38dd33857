//! Locating the NIXL C API (`libnixl_capi.so`) that `nixl-sys` needs.
//!
//! `nixl-sys` (feature `stub-api`) `dlopen`s `"libnixl_capi.so"` by bare name
//! on first use. Inside a NIXL process the right copy is the one installed
//! next to the `libnixl.so` that loaded this plugin, which is usually not on
//! the library search path. So before the first `nixl-sys` call we find the
//! loaded `libnixl.so` and load its sibling by absolute path; the dynamic
//! loader then matches the later by-name `dlopen` against that object's
//! `SONAME`, and users export no paths by hand.

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

const CAPI: &str = "libnixl_capi.so";
const CORE: &str = "libnixl.so";

static CAPI_PATH: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Makes sure `libnixl_capi.so` is loaded, preferring the copy beside the
/// loaded `libnixl.so`. Returns where it was found, or why it was not.
pub fn ensure_capi_loaded() -> Result<PathBuf, String> {
    CAPI_PATH.get_or_init(load_capi).clone()
}

fn load_capi() -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    if let Some(core) = loaded_object_path(CORE) {
        if let Some(dir) = core.parent() {
            let candidate = dir.join(CAPI);
            match load_global(&candidate) {
                Ok(()) => return Ok(candidate),
                Err(e) => tried.push(format!("{}: {e}", candidate.display())),
            }
        }
    } else {
        tried.push(format!("{CORE} is not loaded in this process"));
    }
    // Fall back to the normal search path (LD_LIBRARY_PATH, ld.so.cache).
    match load_global(Path::new(CAPI)) {
        Ok(()) => Ok(loaded_object_path(CAPI).unwrap_or_else(|| PathBuf::from(CAPI))),
        Err(e) => {
            tried.push(format!("{CAPI} on the library search path: {e}"));
            Err(format!("cannot load the NIXL C API: {}", tried.join("; ")))
        }
    }
}

/// A loader error with the loader's own reason (`dlerror`'s text, which
/// libloading keeps as the error's source).
pub fn loader_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(reason) => format!("{e}: {reason}"),
        None => e.to_string(),
    }
}

/// Loads the library at `path` for the life of the process, its symbols
/// global (as NIXL's C API must be for nixl-sys's later by-name load).
pub fn load_global(path: &Path) -> Result<(), String> {
    // SAFETY: loading NIXL's C API runs only its own initialisers, as
    // nixl-sys's own load of it would. The handle is deliberately leaked
    // (`into_raw`): the library must stay loaded for the life of the process
    // (nixl-sys keeps function pointers into it).
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| loader_error(&e))?;
    let _ = lib.into_raw();
    Ok(())
}

/// The path of a loaded shared object whose file name is `file_name`.
pub fn loaded_object_path(file_name: &str) -> Option<PathBuf> {
    struct Search<'a> {
        file_name: &'a str,
        found: Option<PathBuf>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: dl_iterate_phdr passes a valid info pointer for the duration
        // of the callback, and `data` is the &mut Search we passed in below.
        let (info, search) = unsafe { (&*info, &mut *(data as *mut Search<'_>)) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: dlpi_name is a NUL-terminated string owned by the loader.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) };
        let path = Path::new(OsStr::from_bytes(name.to_bytes()));
        if path.file_name().is_some_and(|f| f == search.file_name) {
            search.found = Some(path.to_path_buf());
            return 1;
        }
        0
    }
    let mut search = Search {
        file_name,
        found: None,
    };
    // SAFETY: `visit` matches the callback signature and only touches
    // `search`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(
            Some(visit),
            &mut search as *mut Search<'_> as *mut libc::c_void,
        )
    };
    search.found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_load_says_why() {
        let e = load_global(Path::new("/nonexistent/libnixl_capi.so")).unwrap_err();
        assert!(e.contains("No such file"), "{e}");
    }
}
