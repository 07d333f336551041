//! Arbitrary bytes as a snapshot file, opened and read whole by the snapshot reader:
//! `ferry_migrate_testkit::fuzz::snapshot` says what must hold (under libFuzzer's memory limit,
//! a reader that allocates for what the file does not hold is a crash).
#![no_main]

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    let _ = ferry_migrate_testkit::fuzz::snapshot(input);
});
