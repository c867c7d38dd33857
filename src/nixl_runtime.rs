//! Locating the NIXL C API (`libnixl_capi.so`) that `nixl-sys` needs.
//!
//! `nixl-sys` (feature `stub-api`) `dlopen`s `"libnixl_capi.so"` by bare name
//! on first use. Inside a NIXL process the right copy is the one installed
//! next to the `libnixl.so` that loaded this plugin, which is usually not on
//! the library search path. So before the first `nixl-sys` call we find the
//! loaded `libnixl.so` and load its sibling by absolute path; the dynamic
//! loader then matches the later by-name `dlopen` against that object's
//! `SONAME`, and users export no paths by hand.

use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use std::sync::OnceLock;

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
            match dlopen_global(&candidate) {
                Ok(()) => return Ok(candidate),
                Err(e) => tried.push(format!("{}: {e}", candidate.display())),
            }
        }
    } else {
        tried.push(format!("{CORE} is not loaded in this process"));
    }
    // Fall back to the normal search path (LD_LIBRARY_PATH, ld.so.cache).
    match dlopen_global(Path::new(CAPI)) {
        Ok(()) => Ok(loaded_object_path(CAPI).unwrap_or_else(|| PathBuf::from(CAPI))),
        Err(e) => {
            tried.push(format!("{CAPI} on the library search path: {e}"));
            Err(format!("cannot load the NIXL C API: {}", tried.join("; ")))
        }
    }
}

fn dlopen_global(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| "path contains a NUL byte".to_string())?;
    // SAFETY: `c` is a valid NUL-terminated string; dlopen has no other
    // preconditions. The handle is deliberately leaked: the library must stay
    // loaded for the life of the process (nixl-sys keeps function pointers).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by libc.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown dlopen error".to_string()
        } else {
            // SAFETY: non-null dlerror results are NUL-terminated strings.
            unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(msg);
    }
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
