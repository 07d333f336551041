//! Arbitrary bytes through every decoder of the wire module:
//! `ferry_migrate_testkit::fuzz::wire` says what must hold.
#![no_main]

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    ferry_migrate_testkit::fuzz::wire(input);
});
