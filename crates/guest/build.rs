//! Link arguments for the guest kernel: no C runtime, a static non-PIE image placed by
//! `guest.ld` at 1 MiB, and no build-id note (the only note must be the PVH entry).

fn main() {
    println!("cargo:rerun-if-changed=guest.ld");
    if std::env::var_os("CARGO_FEATURE_KERNEL").is_none() {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    for arg in [
        "-nostartfiles",
        "-nostdlib",
        "-static",
        "-no-pie",
        "-Wl,--build-id=none",
        "-Wl,--gc-sections",
        "-Wl,-z,noexecstack",
        "-Wl,-z,max-page-size=4096",
    ] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
    println!("cargo:rustc-link-arg-bins=-Wl,-T,{dir}/guest.ld");
}
