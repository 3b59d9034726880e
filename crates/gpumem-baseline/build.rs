//! Builds the C++17 baseline (only when a benchmark or test depends on this crate).
fn main() {
    println!("cargo:rerun-if-changed=src/pytorch_design.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(3)
        .flag_if_supported("-fno-exceptions")
        .file("src/pytorch_design.cpp")
        .compile("pytorch_design");
}
