//! The destination's answers to crafted streams over real TCP loopback, without /dev/kvm: each
//! malformed stream is refused with an error that names what is wrong, and the well-formed one
//! is accepted, whichever way the destination lands pages.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use ferry_migrate::wire::Capabilities;
use ferry_migrate::wire::{self, HEADER_SIZE, Header, Kind, Role};
use ferry_migrate::{PageLanding, destination};
use ferry_migrate_testkit::FakeVm;
use ferry_migrate_testkit::craft::{
    cat, data_hello, end, hello, main_hello, main_hello_asking, pages, pages_checked,
    preempt_hello, record, runs, section, zero_runs,
};
use ferry_migrate_testkit::loopback::{acceptor, feed, feed_vm};

const MIB: u64 = 1 << 20;
/// Both ways a destination lands pages: every crafted stream is fed to each.
const LANDINGS: [PageLanding; 2] = [PageLanding::Mapping, PageLanding::File];

/// `bytes` with byte `at` changed, as a faulty link would.
fn flipped(mut bytes: Vec<u8>, at: usize) -> Vec<u8> {
    bytes[at] ^= 0x10;
    bytes
}

/// A crafted stream: name, main connection bytes, data connections' bytes, expected error.
type Crafted = (&'static str, Vec<u8>, Vec<Vec<u8>>, &'static str);

#[test]
fn crafted_bad_streams_are_refused_with_a_clear_error() {
    let ok = main_hello();
    let state = section(1, 0, b"abc");
    let complete = record(Header::new(Kind::Complete, 0, 0), &[]);
    let mut bad_magic = ok.clone();
    bad_magic[0] = b'X';
    let mut bad_version = ok.clone();
    bad_version[8] = 9;
    let good_data = cat(&[
        data_hello(1),
        pages(&[0x1000]),
        zero_runs(&[(0x4000, 2)]),
        end(1),
    ]);
    // (name, main bytes, data channel bytes, expected error)
    let table: Vec<Crafted> = vec![
        ("bad magic", bad_magic, vec![], "bad magic"),
        (
            "bad version",
            bad_version,
            vec![],
            "protocol version 9 is not supported",
        ),
        (
            "wrong memory size",
            hello(Role::Main, 0, 1, 16 * MIB, 1),
            vec![],
            "memory sizes differ",
        ),
        (
            "no channels",
            hello(Role::Main, 0, 1, 8 * MIB, 0),
            vec![],
            "0 data channels announced",
        ),
        (
            "data role first",
            data_hello(1),
            vec![],
            "the first connection must be the main channel",
        ),
        (
            "truncated hello",
            ok[..20].to_vec(),
            vec![],
            "closed the connection while reading the hello",
        ),
        // Data channel handshake misuse.
        (
            "unknown uuid",
            ok.clone(),
            vec![hello(Role::Data, 1, 9, 8 * MIB, 1)],
            "not the one in progress",
        ),
        (
            "channel id out of range",
            ok.clone(),
            vec![data_hello(2)],
            "out of range 1..=1",
        ),
        (
            "channel id zero",
            ok.clone(),
            vec![data_hello(0)],
            "out of range 1..=1",
        ),
        (
            "duplicate channel",
            hello(Role::Main, 0, 1, 8 * MIB, 2),
            vec![
                hello(Role::Data, 1, 1, 8 * MIB, 2),
                hello(Role::Data, 1, 1, 8 * MIB, 2),
            ],
            "data channel 1 connected twice",
        ),
        (
            "channel never connects",
            hello(Role::Main, 0, 1, 8 * MIB, 2),
            vec![hello(Role::Data, 1, 1, 8 * MIB, 2)],
            "data channel 2 never connected",
        ),
        (
            "second main connection",
            ok.clone(),
            vec![main_hello()],
            "extra connections must be data channels",
        ),
        // Page records on a data channel.
        (
            "address out of range",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[8 * MIB])])],
            "outside guest RAM",
        ),
        (
            "address far out",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[1 << 40])])],
            "outside guest RAM",
        ),
        (
            "unaligned address",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x1001])])],
            "not page aligned",
        ),
        (
            "unordered addresses",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x2000, 0x1000])])],
            "not strictly increasing",
        ),
        (
            "page twice in a pass",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x1000]), pages(&[0x1000])])],
            "sent twice in one pass",
        ),
        (
            "zero run leaves RAM",
            ok.clone(),
            vec![cat(&[data_hello(1), zero_runs(&[(8 * MIB - 4096, 2)])])],
            "leaves its RAM region",
        ),
        (
            "empty zero run",
            ok.clone(),
            vec![cat(&[data_hello(1), zero_runs(&[(0, 0)])])],
            "is empty",
        ),
        (
            "oversized batch",
            ok.clone(),
            vec![cat(&[
                data_hello(1),
                Header::new(Kind::Pages, 100_000, 100_000 * 4104)
                    .encode()
                    .to_vec(),
            ])],
            "exceeds the limit of 512",
        ),
        (
            "closed mid-batch",
            ok.clone(),
            vec![pages(&[0x1000])[..200].to_vec()]
                .into_iter()
                .map(|p| cat(&[data_hello(1), p]))
                .collect(),
            "closed the connection while receiving pages",
        ),
        (
            "state on a data channel",
            ok.clone(),
            vec![cat(&[data_hello(1), state.clone()])],
            "DeviceState record on a data channel",
        ),
        // The main channel.
        (
            "pages on the main channel",
            cat(&[ok.clone(), pages(&[0])]),
            vec![data_hello(1)],
            "Pages record on the main channel",
        ),
        (
            "unknown kind",
            cat(&[ok.clone(), {
                let mut h = [0u8; HEADER_SIZE];
                h[0] = 42;
                wire::reseal_header(&mut h);
                h.to_vec()
            }]),
            vec![data_hello(1)],
            "unknown record kind 42",
        ),
        (
            "pass out of order",
            cat(&[ok.clone(), end(2)]),
            vec![data_hello(1)],
            "end of pass 2 after pass 0",
        ),
        (
            "state before memory",
            cat(&[ok.clone(), state.clone()]),
            vec![data_hello(1)],
            "device state before any memory pass",
        ),
        (
            "oversized section",
            cat(&[
                ok.clone(),
                end(1),
                Header::device_state(1 << 30).encode().to_vec(),
            ]),
            vec![cat(&[data_hello(1), end(1)])],
            "exceeds the limit of 1048592",
        ),
        (
            "complete without state",
            cat(&[ok.clone(), end(1), complete.clone()]),
            vec![cat(&[data_hello(1), end(1)])],
            "Complete without any device state",
        ),
        (
            "unknown section for this VMM",
            cat(&[ok.clone(), end(1), section(2, 0, b"x"), complete.clone()]),
            vec![good_data.clone()],
            "the fake VM has only a vCPU section",
        ),
        (
            "one section instance twice",
            cat(&[
                ok.clone(),
                end(1),
                section(1, 1, b"a"),
                section(1, 1, b"b"),
                complete.clone(),
            ]),
            vec![good_data.clone()],
            "section 1 instance 1 sent twice",
        ),
        (
            "section shorter than its header",
            cat(&[
                ok.clone(),
                end(1),
                record(Header::new(Kind::DeviceState, 0, 8), &[1; 8]),
            ]),
            vec![good_data.clone()],
            "shorter than its 16-byte section header",
        ),
        (
            "resumed from the source",
            cat(&[
                ok.clone(),
                record(Header::new(Kind::Resumed, 0, 24), &[0; 24]),
            ]),
            vec![data_hello(1)],
            "Resumed record on the main channel",
        ),
        // Who said it: the source's Error records are the source's words, named as such.
        (
            "the source's error on the main channel",
            cat(&[
                ok.clone(),
                record(Header::new(Kind::Error, 0, 9), b"disk full"),
            ]),
            vec![data_hello(1)],
            "the source reported an error: disk full",
        ),
        (
            "the source's error on a data channel",
            ok.clone(),
            vec![cat(&[
                data_hello(1),
                record(Header::new(Kind::Error, 0, 9), b"disk full"),
            ])],
            "data channel 1: the source reported an error: disk full",
        ),
        // Bytes changed on the way: each checksum names what it protects.
        (
            "a header's byte changed",
            cat(&[ok.clone(), flipped(end(1), 4)]),
            vec![data_hello(1)],
            "a record header's checksum does not match",
        ),
        (
            "a device-state byte changed",
            cat(&[
                ok.clone(),
                end(1),
                flipped(section(1, 0, b"abc"), HEADER_SIZE + 17),
            ]),
            vec![good_data.clone()],
            "DeviceState record's payload checksum does not match (the whole payload",
        ),
        (
            "a section header's byte changed",
            cat(&[
                ok.clone(),
                end(1),
                flipped(section(1, 0, b"abc"), HEADER_SIZE + 4),
            ]),
            vec![good_data.clone()],
            "DeviceState record's payload checksum does not match",
        ),
        (
            "a page address changed",
            ok.clone(),
            vec![cat(&[
                data_hello(1),
                flipped(pages(&[0x1000]), HEADER_SIZE + 1),
            ])],
            "data channel 1: invalid migration stream: the Pages record's payload checksum does not match (the page addresses",
        ),
        (
            "a zero run changed",
            ok.clone(),
            vec![cat(&[
                data_hello(1),
                flipped(zero_runs(&[(0x4000, 2)]), HEADER_SIZE + 8),
            ])],
            "the ZeroRuns record's payload checksum does not match",
        ),
        (
            "a page's data changed, page checksums granted",
            main_hello_asking(Capabilities::CHECKSUM_PAGES),
            vec![cat(&[
                data_hello(1),
                flipped(
                    pages_checked(&[0x1000, 0x3000], true),
                    HEADER_SIZE + 16 + 5000,
                ),
            ])],
            "the Pages record's payload checksum does not match (its addresses and page data",
        ),
        (
            "page checksums granted, a record without them",
            main_hello_asking(Capabilities::CHECKSUM_PAGES),
            vec![cat(&[data_hello(1), pages(&[0x1000])])],
            "the Pages record's payload checksum does not match (its addresses and page data",
        ),
        (
            "a hello's byte changed",
            flipped(ok.clone(), 20),
            vec![],
            "the hello's checksum does not match",
        ),
        (
            "truncated before Complete",
            cat(&[ok.clone(), end(1), state.clone()]),
            vec![good_data.clone()],
            "closed the connection",
        ),
    ];
    for landing in LANDINGS {
        for (name, main, data, want) in &table {
            let err = feed(main, data, landing);
            assert!(err.contains(want), "{name}, {landing:?}: got '{err}'");
            // What this destination found itself is never put in the source's mouth.
            assert_eq!(
                err.contains("reported an error"),
                want.contains("the source reported"),
                "{name}: '{err}' blames the wrong side"
            );
        }
    }
}

/// Postcopy's records and the preempt connection, crafted wrong: each is refused with the
/// reason, including page data for a page the source did not list and a second preempt
/// connection.
#[test]
fn crafted_bad_postcopy_streams_are_refused_with_a_clear_error() {
    let both = Capabilities::POSTCOPY.with(Capabilities::PREEMPT);
    let pc = main_hello_asking(both);
    let postcopy = record(Header::new(Kind::Postcopy, 0, 0), &[]);
    let state = section(1, 0, b"abc");
    let pass_1 = cat(&[data_hello(1), end(1)]);
    let table: Vec<Crafted> = vec![
        (
            "a discard list without the capability",
            cat(&[main_hello(), end(1), runs(Kind::Discard, &[(0x1000, 1)])]),
            vec![pass_1.clone()],
            "Discard record without the postcopy capability",
        ),
        (
            "a preempt connection without the capability",
            main_hello(),
            vec![preempt_hello(1)],
            "the preempt capability was not granted",
        ),
        (
            "a preempt connection with a foreign uuid",
            pc.clone(),
            vec![preempt_hello(7)],
            "a preempt connection names migration",
        ),
        (
            "a second preempt connection",
            pc.clone(),
            vec![preempt_hello(1), preempt_hello(1)],
            "a second preempt connection",
        ),
        (
            "a discard list outside RAM",
            cat(&[pc.clone(), end(1), runs(Kind::Discard, &[(1 << 40, 1)])]),
            vec![pass_1.clone(), preempt_hello(1)],
            "outside guest RAM",
        ),
        (
            "a page discarded twice",
            cat(&[
                pc.clone(),
                end(1),
                runs(Kind::Discard, &[(0x1000, 2)]),
                runs(Kind::Discard, &[(0x2000, 1)]),
            ]),
            vec![pass_1.clone(), preempt_hello(1)],
            "page 0x2000 discarded twice",
        ),
        (
            "page data for a page not on the discard list",
            cat(&[
                pc.clone(),
                end(1),
                runs(Kind::Discard, &[(0x1000, 1)]),
                state.clone(),
                postcopy.clone(),
            ]),
            vec![
                cat(&[pass_1.clone(), postcopy.clone(), pages(&[0x2000])]),
                preempt_hello(1),
            ],
            "postcopy page 0x2000 is not on the discard list",
        ),
        (
            "a pass end after the switch",
            cat(&[
                pc.clone(),
                end(1),
                runs(Kind::Discard, &[(0x1000, 1)]),
                state.clone(),
                postcopy.clone(),
            ]),
            vec![
                cat(&[pass_1.clone(), postcopy.clone(), end(2)]),
                preempt_hello(1),
            ],
            "EndOfPass on a data channel after postcopy started",
        ),
        (
            "pages on the main connection without main-pages",
            cat(&[
                pc.clone(),
                end(1),
                runs(Kind::Discard, &[(0x1000, 1)]),
                state.clone(),
                postcopy.clone(),
                pages(&[0x1000]),
            ]),
            vec![cat(&[pass_1.clone(), postcopy.clone()]), preempt_hello(1)],
            "Pages record on the main channel during postcopy",
        ),
        (
            "a page on the main connection not on the discard list",
            cat(&[
                main_hello_asking(Capabilities::POSTCOPY.with(Capabilities::MAIN_PAGES)),
                end(1),
                runs(Kind::Discard, &[(0x1000, 1)]),
                state.clone(),
                postcopy.clone(),
                pages(&[0x2000]),
            ]),
            vec![cat(&[pass_1.clone(), postcopy.clone()])],
            "postcopy page 0x2000 is not on the discard list",
        ),
        (
            "pages on the preempt connection before the switch",
            cat(&[pc.clone(), end(1)]),
            vec![pass_1.clone(), cat(&[preempt_hello(1), pages(&[0x1000])])],
            "Pages on the preempt connection before Postcopy",
        ),
    ];
    for (name, main, data, want) in &table {
        let err = feed(main, data, PageLanding::Mapping);
        assert!(err.contains(want), "{name}: got '{err}'");
    }
}

/// A source that dies after the switch (its connections end without Complete): the guest ran
/// on the destination, so the destination cannot hand it back; it names the failure and asks
/// its VMM to stop the VM for good (the known cost of postcopy without recovery).
#[test]
fn a_source_that_dies_in_postcopy_leaves_the_destination_stopped_with_a_clear_error() {
    let postcopy = record(Header::new(Kind::Postcopy, 0, 0), &[]);
    let main = cat(&[
        main_hello_asking(Capabilities::POSTCOPY),
        end(1),
        runs(Kind::Discard, &[(0x1000, 4)]),
        section(1, 0, b"abc"),
        postcopy.clone(),
    ]);
    let data = cat(&[data_hello(1), end(1), postcopy, pages(&[0x1000])]);
    let (err, dst) = feed_vm(&main, &[data], PageLanding::Mapping);
    assert!(err.contains("the source's last pages"), "{err}");
    assert!(dst.resumed, "the guest ran on the destination");
    let why = dst
        .abandoned
        .clone()
        .expect("the VMM was told to stop the VM");
    assert!(why.contains("the source's last pages"), "{why}");
}

/// The well-formed version of the streams above is accepted: so each row fails for the reason
/// it states, and pages and zero runs land where they should.
#[test]
fn a_crafted_good_stream_is_accepted() {
    for landing in LANDINGS {
        good_stream_lands(landing);
    }
}

fn good_stream_lands(landing: PageLanding) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    dst.landing = landing;
    std::thread::scope(|s| {
        let r = s.spawn(|| {
            let main = listener.accept().unwrap().0;
            destination::receive(&mut dst, main, &mut acceptor(&listener))
        });
        let mut main = TcpStream::connect(addr).unwrap();
        main.write_all(&main_hello()).unwrap();
        let mut data = TcpStream::connect(addr).unwrap();
        data.write_all(&cat(&[
            data_hello(1),
            pages(&[0x1000, 0x2000]),
            end(1),
            zero_runs(&[(0x1000, 1)]),
            end(2),
        ]))
        .unwrap();
        data.shutdown(std::net::Shutdown::Write).unwrap();
        main.write_all(&cat(&[
            end(1),
            end(2),
            section(1, 0, b"abc"),
            record(Header::new(Kind::Complete, 0, 0), &[]),
        ]))
        .unwrap();
        let mut sink = Vec::new();
        let _ = main.read_to_end(&mut sink);
        r.join().unwrap().unwrap();
    });
    assert!(dst.resumed);
    let mem = dst.contents();
    assert_eq!(
        &mem[0x1000..0x1004],
        &[0; 4],
        "{landing:?}: pass 2's zero run replaced pass 1's data"
    );
    assert_eq!(&mem[0x2000..0x2004], &[0xab; 4]);
}

/// A source that falls silent: when, its main connection's bytes, its data connections'.
type Silent = (&'static str, Vec<u8>, Vec<Vec<u8>>);

/// A source that connects, sends part of pass 1 and then nothing at all, its connections left
/// open (stopped, hung): the destination gives up on it after its peer timeout, naming the
/// silence, and at every phase it waits in: the data channels' connection, and precopy.
#[test]
fn a_silent_source_is_given_up_after_the_peer_timeout() {
    let timeout = std::time::Duration::from_millis(300);
    // (when it fell silent, the main connection's bytes, the data connections')
    let cases: [Silent; 2] = [
        ("before its data channels", main_hello(), vec![]),
        (
            "in pass 1",
            main_hello(),
            vec![cat(&[data_hello(1), pages(&[0x1000])])],
        ),
    ];
    for (when, main, data) in cases {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut dst = FakeVm::new(8 * MIB, 1);
        let control = std::sync::Arc::new(destination::IncomingControl::default());
        control.set_peer_timeout(Some(timeout));
        let started = std::time::Instant::now();
        let error = std::thread::scope(|s| {
            let receiver = s.spawn(|| {
                let main = listener.accept().unwrap().0;
                destination::receive_with(&mut dst, main, &mut acceptor(&listener), control)
            });
            // Kept open, and silent, until the destination is done.
            let mut conns = vec![TcpStream::connect(addr).unwrap()];
            conns[0].write_all(&main).unwrap();
            for d in &data {
                let mut c = TcpStream::connect(addr).unwrap();
                c.write_all(d).unwrap();
                conns.push(c);
            }
            receiver.join().unwrap().expect_err("a silent source")
        });
        let took = started.elapsed();
        assert!(
            error
                .to_string()
                .contains("sent nothing for longer than the timeout"),
            "{when}: {error}"
        );
        // Far below the 10 s the data channels have, or the 600 s a record has.
        assert!(took < std::time::Duration::from_secs(5), "{when}: {took:?}");
    }
}
