//! Checks of what travels besides RAM: the VM's configuration, which a destination checks
//! before the source pauses (a migration's hello, a snapshot's header), and the device state,
//! saved, timed and loaded, or refused.

use std::time::Instant;

use ferry_migrate::wire::SectionId;
use ferry_migrate::{DestinationVm, Section, SourceVm, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{check_parts, ok, refused, saved_state, state_bytes};

/// A paused source saves its state as sections, and runs again after.
pub fn paused_source_saves_state<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("pause", src.pause());
    let sections = ok("save_state", src.save_state());
    assert!(!sections.is_empty(), "save_state returned no sections");
    ok("resume", src.resume());
}

/// What `state_parts` says after a save fits it (see `check_parts`: bounded, named, no more
/// time than the call took, no more bytes than the sections hold), and describes the last
/// save alone: a second save of the same VM reports the same parts again, not twice as many.
/// Empty after both is a VMM that does not time its parts.
pub fn source_state_parts_describe_the_last_save<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("pause", src.pause());
    let mut names = Vec::new();
    for save in ["the first save", "a second save"] {
        let t = Instant::now();
        let sections = ok("save_state", src.save_state());
        let took = t.elapsed();
        let parts = src.state_parts();
        check_parts(
            &format!("state_parts after {save}"),
            &parts,
            took,
            state_bytes(&sections),
        );
        names.push(parts.into_iter().map(|p| p.name).collect::<Vec<_>>());
    }
    assert_eq!(
        names[1], names[0],
        "state_parts after a second save of the same VM names other parts"
    );
    ok("resume", src.resume());
}

/// What a paused source saved, a fresh destination loads.
pub fn destination_loads_the_sources_state<F: Fixture>(f: &mut F) {
    let sections = saved_state(f);
    let mut dst = f.destination();
    ok("load_state", dst.load_state(&sections));
}

/// A destination refuses, with an error, a section of another version, a section without its
/// data, and a section of a kind the source never saved.
pub fn destination_refuses_bad_state<F: Fixture>(f: &mut F) {
    let good = saved_state(f);
    let mut dst = f.destination();
    let mut bad: Vec<(String, Vec<Section>)> = Vec::new();
    for i in 0..good.len() {
        let mut v = good.clone();
        v[i].version = v[i].version.wrapping_add(1);
        bad.push((format!("section {i} with version + 1"), v));
        if !good[i].data.is_empty() {
            let mut v = good.clone();
            v[i].data.clear();
            bad.push((format!("section {i} without its data"), v));
        }
    }
    let mut v = good.clone();
    v.push(unknown_section(&good));
    bad.push(("an unknown section".into(), v));
    for (what, sections) in bad {
        refused(&format!("load_state of {what}"), || {
            dst.load_state(&sections)
        });
    }
}

/// The source describes its configuration (`config`), a destination configured alike takes
/// it (`check_config`), and refuses it cut short or garbled, with an error: a destination that
/// cannot take the guest must say so before the source pauses. Or the source cannot describe
/// its VM (`Unsupported`): a migration then sends no description and a snapshot records none,
/// so the destination is asked nothing.
pub fn destination_checks_the_sources_config<F: Fixture>(f: &mut F) {
    let src = f.source();
    let config = match src.config() {
        Err(VmError::Unsupported { .. }) => return,
        r => ok("config", r),
    };
    // An empty description is what a snapshot records for a VMM that cannot describe its VM,
    // and its restore checks nothing: a description must say something.
    assert!(!config.is_empty(), "config() is Ok and empty");
    let dst = f.destination();
    ok(
        "check_config of the source's own config()",
        dst.check_config(&config),
    );
    let cut = config[..config.len() / 2].to_vec();
    let garbled: Vec<u8> = config.iter().map(|b| !b).collect();
    for (what, bytes) in [
        ("cut to its first half", cut),
        ("with every bit flipped", garbled),
    ] {
        refused(
            &format!("check_config of the source's config {what}"),
            || dst.check_config(&bytes),
        );
    }
}

/// A section of a kind no section in `saved` has. The only place the suite names a section
/// kind, so that a change to how sections are named touches one function.
fn unknown_section(saved: &[Section]) -> Section {
    let id = SectionId(
        saved
            .iter()
            .map(|s| s.id.0)
            .max()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1),
    );
    assert!(saved.iter().all(|s| s.id != id), "the source saved {id}");
    Section {
        id,
        instance: 0,
        version: 1,
        data: vec![0; 8],
    }
}
