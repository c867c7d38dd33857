//! Builds the C++ shim (plugin/) and generates Rust declarations of the C
//! boundary types (include/bounce_ffi.h).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=plugin/bounce_plugin.cpp");
    println!("cargo:rerun-if-changed=include/bounce_ffi.h");
    println!("cargo:rerun-if-changed=include/nixl_abi/nixl_abi.h");
    // dlopen/dladdr of the UCX delegate (libdl is part of libc from glibc 2.34).
    println!("cargo:rustc-link-lib=dl");

    // The shim must match NIXL's C++20 / libstdc++ (C++11 string ABI) build.
    // Hidden visibility keeps our inline copies of NIXL's classes private to
    // this library; the only exported symbols are the Rust-declared entry
    // points in src/ffi/.
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("plugin/bounce_plugin.cpp")
        .include("include")
        .flag("-fvisibility=hidden")
        .flag("-fvisibility-inlines-hidden")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .flag_if_supported("-Wno-unused-parameter")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .compile("bounce_shim");

    // Types and constants only: the functions declared in the header are
    // implemented in Rust (src/ffi/), not imported.
    let bindings = bindgen::Builder::default()
        .header("include/bounce_ffi.h")
        .allowlist_type("bounce_.*")
        .allowlist_var("BOUNCE_.*")
        .derive_debug(true)
        .derive_default(true)
        .layout_tests(true)
        .generate()
        .expect("bindgen could not parse include/bounce_ffi.h (is libclang installed? apt-get install libclang-dev)");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("bounce_ffi.rs"))
        .expect("writing the generated bindings");
}
