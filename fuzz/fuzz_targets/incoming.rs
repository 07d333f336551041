//! Arbitrary bytes as the main and data connections of a destination over the fake VMM:
//! `ferry_migrate_testkit::fuzz::incoming` says what must hold.
#![no_main]

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    let _ = ferry_migrate_testkit::fuzz::incoming(input);
});
