//! Round trips and hostile inputs for every encoding in the wire module.

use super::*;

fn hello() -> Hello {
    Hello {
        role: Role::Main,
        channel: 0,
        uuid: [7; 16],
        memory_size: 2 << 30,
        status: 0,
        channels: 2,
        capabilities: Capabilities(1 << 40),
        postcopy_page_shift: 0,
    }
}

#[test]
fn hello_round_trips_and_checks_everything() {
    let h = hello();
    assert_eq!(Hello::decode(&h.encode()), Ok(h));
    let mut b = h.encode();
    b[0] = b'X';
    reseal_hello(&mut b);
    assert!(matches!(Hello::decode(&b), Err(WireError::BadMagic(_))));
    let mut b = h.encode();
    b[8] = 1;
    reseal_hello(&mut b);
    assert_eq!(Hello::decode(&b), Err(WireError::Version(1)));
    // The range: the oldest version still spoken is read, one past either end is refused.
    for (version, read) in [
        (OLDEST_VERSION - 1, false),
        (OLDEST_VERSION, true),
        (VERSION, true),
        (VERSION + 1, false),
    ] {
        let mut b = h.encode();
        b[8..12].copy_from_slice(&version.to_le_bytes());
        reseal_hello(&mut b);
        match Hello::decode(&b) {
            Ok(got) => assert!(read && got == h, "version {version}"),
            Err(e) => {
                assert!(
                    !read && e == WireError::Version(version),
                    "version {version}"
                );
                assert!(
                    e.to_string()
                        .contains(&format!("speaks versions {OLDEST_VERSION} to {VERSION}"))
                );
            }
        }
    }
    let mut b = h.encode();
    b[12] = 0;
    reseal_hello(&mut b);
    assert_eq!(Hello::decode(&b), Err(WireError::Role(0)));
    let mut b = h.encode();
    b[12] = 5;
    reseal_hello(&mut b);
    assert_eq!(Hello::decode(&b), Err(WireError::Role(5)));
    let mut b = h.encode();
    b[41] = 0x20;
    reseal_hello(&mut b);
    assert_eq!(Hello::decode(&b), Err(WireError::PageSize(0x2000)));
    let mut b = h.encode();
    b[59] = 1;
    reseal_hello(&mut b);
    assert_eq!(Hello::decode(&b), Err(WireError::Reserved("hello")));
    let data = Hello {
        role: Role::Data,
        channel: 1,
        ..h
    };
    assert_eq!(
        Hello::decode(&data.encode()),
        Err(WireError::DataCapabilities(1 << 40))
    );
    let preempt = Hello {
        role: Role::Preempt,
        channel: 0,
        ..h
    };
    assert_eq!(
        Hello::decode(&preempt.encode()),
        Err(WireError::DataCapabilities(1 << 40)),
        "a preempt hello carries no capabilities either"
    );
    let preempt = Hello {
        capabilities: Capabilities::NONE,
        postcopy_page_shift: 0,
        ..preempt
    };
    assert_eq!(Hello::decode(&preempt.encode()), Ok(preempt));
}

#[test]
fn capabilities_are_granted_as_the_common_subset() {
    let asked = Capabilities(0b1011);
    let granted = asked.grant(Capabilities(0b0110));
    assert_eq!(granted, Capabilities(0b0010));
    assert!(granted.is_subset(asked));
    assert!(!Capabilities(0b0100).is_subset(asked));
    let unknown = Capabilities(0b1000 | 1 << 40);
    assert_eq!(unknown.grant(Capabilities::SUPPORTED), Capabilities::NONE);
}

#[test]
fn section_headers_round_trip_and_refuse_zero_ids_and_reserved_bytes() {
    let h = SectionHeader {
        id: SectionId(0x4c41_5043),
        instance: 3,
        version: 7,
    };
    let mut payload = h.encode().to_vec();
    payload.extend_from_slice(b"state");
    assert_eq!(SectionHeader::decode(&payload), Ok((h, &b"state"[..])));
    let mut b = h.encode();
    b[0..4].fill(0);
    assert_eq!(SectionHeader::decode(&b), Err(WireError::InvalidSection));
    let mut b = h.encode();
    b[15] = 1;
    assert_eq!(
        SectionHeader::decode(&b),
        Err(WireError::Reserved("section header"))
    );
    assert_eq!(
        SectionHeader::decode(&b[..15]),
        Err(WireError::SectionHeader(15))
    );
}

#[test]
fn headers_round_trip() {
    for h in [
        Header::pages(512),
        Header::zero_runs(1),
        Header::new(Kind::EndOfPass, 3, 0),
        Header::device_state(9000),
        Header::new(Kind::Complete, 0, 0),
        Header::new(Kind::Error, 0, 12),
        Header::new(Kind::Resumed, 0, RESUMED_SIZE),
        Header::new(Kind::Received, 0, RECEIVED_SIZE),
        Header::runs(Kind::Discard, 4096),
        Header::new(Kind::Postcopy, 0, 0),
        Header::runs(Kind::PageRequest, 1),
        Header::new(Kind::Done, 0, DONE_SIZE),
    ] {
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }
}

#[test]
fn hostile_headers_are_refused() {
    let table: &[(Header, &str)] = &[
        (
            Header::new(Kind::Pages, 513, 513 * 4104),
            "exceeds the limit of 512",
        ),
        (Header::new(Kind::Pages, 2, 4104), "does not match 8208"),
        (Header::new(Kind::Pages, 0, 0), "empty batch"),
        (
            Header::new(Kind::ZeroRuns, 4097, 4097 * 16),
            "exceeds the limit of 4096",
        ),
        (Header::new(Kind::ZeroRuns, 1, 8), "does not match 16"),
        (
            Header::device_state((1 << 20) + 1),
            "exceeds the limit of 1048592",
        ),
        (
            Header::new(Kind::DeviceState, 0, 15),
            "shorter than its 16-byte section header",
        ),
        (Header::new(Kind::DeviceState, 1, 20), "reserved bytes"),
        (Header::new(Kind::Complete, 2, 0), "reserved bytes"),
        (
            Header::new(Kind::Error, 0, 1 << 40),
            "exceeds the limit of 4096",
        ),
        (Header::new(Kind::EndOfPass, 1, 8), "must be empty"),
        (Header::new(Kind::Complete, 0, 1), "must be empty"),
        (Header::new(Kind::Received, 0, 15), "does not match 16"),
        (Header::new(Kind::Received, 0, 17), "does not match 16"),
        (Header::new(Kind::Received, 0, 1 << 40), "does not match 16"),
        (Header::new(Kind::Received, 1, 16), "reserved bytes"),
        (
            Header::runs(Kind::Discard, 4097),
            "exceeds the limit of 4096",
        ),
        (Header::new(Kind::Discard, 0, 0), "empty batch"),
        (Header::new(Kind::PageRequest, 2, 16), "does not match 32"),
        (Header::new(Kind::PageRequest, 0, 0), "empty batch"),
        (Header::new(Kind::Postcopy, 1, 0), "reserved bytes"),
        (Header::new(Kind::Postcopy, 0, 8), "must be empty"),
        (Header::new(Kind::Done, 0, 1), "does not match 280"),
        (Header::new(Kind::Done, 3, DONE_SIZE), "reserved bytes"),
    ];
    for (h, want) in table {
        let err = Header::decode(&h.encode()).unwrap_err().to_string();
        assert!(err.contains(want), "{h:?}: {err}");
    }
    let mut b = Header::new(Kind::Complete, 0, 0).encode();
    b[0] = 99;
    reseal_header(&mut b);
    assert_eq!(Header::decode(&b), Err(WireError::UnknownKind(99)));
    let mut b = Header::new(Kind::Complete, 0, 0).encode();
    b[2] = 1;
    reseal_header(&mut b);
    assert_eq!(
        Header::decode(&b),
        Err(WireError::Reserved("record header"))
    );
}

#[test]
fn a_changed_byte_anywhere_in_a_hello_or_header_is_refused_by_its_checksum() {
    let h = hello().encode();
    for at in 12..HELLO_SIZE {
        for bit in 0..8 {
            let mut b = h;
            b[at] ^= 1 << bit;
            assert_eq!(
                Hello::decode(&b),
                Err(WireError::HelloChecksum("hello")),
                "byte {at} bit {bit}"
            );
        }
    }
    let header = Header::new(Kind::Error, 0, 5).seal(b"hello").encode();
    for at in 0..HEADER_SIZE {
        for bit in 0..8 {
            let mut b = header;
            b[at] ^= 1 << bit;
            assert_eq!(
                Header::decode(&b),
                Err(WireError::HeaderChecksum),
                "byte {at} bit {bit}"
            );
        }
    }
}

#[test]
fn a_payload_checksum_covers_what_the_header_says() {
    let pages = Header::pages(2);
    assert_eq!(pages.covered(false), 16);
    assert_eq!(pages.covered(true), pages.len);
    let error = Header::new(Kind::Error, 0, 4);
    assert_eq!(error.covered(false), 4);
    let sealed = error.seal(b"oops");
    assert_eq!(sealed.crc, crc(b"oops"));
    assert_eq!(sealed.check(crc(b"oops"), "the whole payload"), Ok(()));
    let e = sealed.check(crc(b"oopS"), "the whole payload").unwrap_err();
    assert!(matches!(
        e,
        WireError::PayloadChecksum {
            kind: Kind::Error,
            ..
        }
    ));
    assert!(
        e.to_string()
            .contains("Error record's payload checksum does not match"),
        "{e}"
    );
    // The one CRC32C every side must agree on (RFC 3720's check value).
    assert_eq!(crc(b"123456789"), 0xe306_9283);
    assert_eq!(crc_append(crc(b"1234"), b"56789"), crc(b"123456789"));
}

#[test]
fn received_round_trips_and_refuses_other_lengths() {
    for r in [
        Received::default(),
        Received {
            bytes: 16 << 20,
            pages: 4096,
        },
        Received {
            bytes: u64::MAX,
            pages: u64::MAX,
        },
    ] {
        assert_eq!(Received::decode(&r.encode()), Ok(r));
    }
    let b = Received {
        bytes: 0x0102_0304_0506_0708,
        pages: 9,
    }
    .encode();
    assert_eq!(b[0], 0x08, "little-endian");
    assert_eq!(b[8], 9);
    for len in [0, 8, 15, 17, 24] {
        let payload = vec![0u8; len];
        assert!(
            matches!(
                Received::decode(&payload),
                Err(WireError::Length { expected: 16, .. })
            ),
            "{len} bytes"
        );
    }
    // Kind 8 is Received, 24 the last kind; the kind after it is unknown, and 0 invalid.
    assert_eq!(Kind::from_u16(8), Kind::Received);
    assert_eq!(Kind::from_u16(12), Kind::Done);
    assert_eq!(Kind::from_u16(13), Kind::Missing);
    assert_eq!(Kind::from_u16(14), Kind::Resume);
    assert_eq!(Kind::from_u16(15), Kind::VmConfig);
    assert_eq!(Kind::from_u16(16), Kind::LocalRam);
    assert_eq!(Kind::from_u16(19), Kind::Go);
    assert_eq!(Kind::from_u16(20), Kind::CompressedPages);
    assert_eq!(Kind::from_u16(21), Kind::StateChunk);
    assert_eq!(Kind::from_u16(22), Kind::StateReady);
    assert_eq!(Kind::from_u16(23), Kind::LocalDevices);
    assert_eq!(Kind::from_u16(24), Kind::DevicesAdopted);
    assert_eq!(Kind::from_u16(25), Kind::Invalid);
    assert_eq!(Kind::from_u16(0), Kind::Invalid);
}

#[test]
fn progress_is_granted_only_when_asked() {
    let p = Capabilities::PROGRESS;
    assert_eq!(p.grant(Capabilities::SUPPORTED), p);
    assert_eq!(
        Capabilities::NONE.grant(Capabilities::SUPPORTED),
        Capabilities::NONE
    );
    assert!(Capabilities(p.0 | 1).contains(p));
    assert!(!Capabilities::NONE.contains(p));
}

#[test]
fn postcopy_is_bit_0_and_runs_encode_as_address_and_count() {
    assert_eq!(Capabilities::POSTCOPY, Capabilities(1));
    assert!(Capabilities::SUPPORTED.contains(Capabilities::POSTCOPY));
    let both = Capabilities::POSTCOPY.with(Capabilities::PROGRESS);
    assert_eq!(both.grant(Capabilities::SUPPORTED), both);
    let b = encode_runs(&[(0x1000, 2), (0x8000_0000, 1)]);
    assert_eq!(b.len(), 32);
    assert_eq!(
        decode_addresses(&b).collect::<Vec<_>>(),
        vec![0x1000, 2, 0x8000_0000, 1]
    );
}

#[test]
fn latencies_bucket_by_powers_of_two_and_round_trip() {
    let mut l = Latencies::default();
    for us in [0, 1, 3, 100, 130, 200, 5000] {
        l.add(us);
    }
    assert_eq!(l.requests, 7);
    assert_eq!(l.max_us, 5000);
    assert_eq!(l.buckets[0], 2, "0 and 1 µs");
    assert_eq!(l.buckets[1], 1, "3 µs is in [2, 4)");
    assert_eq!(l.buckets[6], 1, "100 µs is in [64, 128)");
    assert_eq!(l.buckets[7], 2, "130 and 200 µs are in [128, 256)");
    assert_eq!(l.buckets[12], 1, "5000 µs is in [4096, 8192)");
    assert_eq!(
        l.quantile_us(0.5),
        128,
        "the 4th of 7 is 100 µs, bucket [64, 128)"
    );
    assert_eq!(l.quantile_us(1.0), 5000, "capped by the maximum");
    let b = l.encode();
    assert_eq!(b.len() as u64, DONE_SIZE);
    assert_eq!(Latencies::decode(&b), Ok(l));
    assert!(Latencies::decode(&b[..8]).is_err());
}

#[test]
fn addresses_decode_in_order() {
    let mut bytes = Vec::new();
    for a in [0x1000u64, 0x2000, 0x1_0000_0000] {
        bytes.extend_from_slice(&a.to_le_bytes());
    }
    assert_eq!(
        decode_addresses(&bytes).collect::<Vec<_>>(),
        vec![0x1000, 0x2000, 0x1_0000_0000]
    );
}

#[test]
fn recovery_records_and_hello_are_checked() {
    // Missing is runs like Discard; Resume has no payload and no count.
    assert!(Header::runs(Kind::Missing, 2).validate().is_ok());
    assert!(Header::new(Kind::Missing, 0, 0).validate().is_err());
    assert!(Header::new(Kind::Missing, 1, 15).validate().is_err());
    assert!(Header::new(Kind::Resume, 0, 0).validate().is_ok());
    assert!(Header::new(Kind::Resume, 0, 8).validate().is_err());
    assert!(Header::new(Kind::Resume, 1, 0).validate().is_err());
    // A recovery hello carries capabilities, as the main one does; a data hello does not.
    let resume = Hello {
        role: Role::Resume,
        channel: 0,
        uuid: [7; 16],
        memory_size: 1 << 30,
        status: 0,
        channels: 2,
        capabilities: Capabilities::POSTCOPY.with(Capabilities::RECOVER),
        postcopy_page_shift: 0,
    };
    assert_eq!(Hello::decode(&resume.encode()), Ok(resume));
    let data = Hello {
        role: Role::Data,
        ..resume
    };
    assert_eq!(
        Hello::decode(&data.encode()),
        Err(WireError::DataCapabilities(resume.capabilities.0))
    );
}

#[test]
fn a_vm_config_is_bounded_and_countless() {
    let ok = Header::new(Kind::VmConfig, 0, MAX_CONFIG_BYTES);
    assert_eq!(Header::decode(&ok.encode()).unwrap(), ok);
    let long = Header::new(Kind::VmConfig, 0, MAX_CONFIG_BYTES + 1);
    assert!(matches!(
        Header::decode(&long.encode()),
        Err(WireError::TooLong { .. })
    ));
    let counted = Header::new(Kind::VmConfig, 1, 10);
    assert!(matches!(
        Header::decode(&counted.encode()),
        Err(WireError::Reserved(_))
    ));
}

#[test]
fn an_error_record_counts_only_its_code() {
    for code in [ERROR_FAILED, ERROR_CANCELLED] {
        let ok = Header::new(Kind::Error, code, 10);
        assert_eq!(Header::decode(&ok.encode()).unwrap(), ok);
    }
    let unknown = Header::new(Kind::Error, ERROR_CANCELLED + 1, 10);
    assert!(matches!(
        Header::decode(&unknown.encode()),
        Err(WireError::Reserved(_))
    ));
}

#[test]
fn resumed_records_carry_the_load_parts_and_refuse_malformed_ones() {
    let part = |name: &str, ms: f64, bytes: u64| crate::state_part::StatePart {
        name: name.into(),
        ms,
        bytes,
    };
    let r = ResumedRecord {
        load_ns: 1_500_000,
        resume_ns: 20_000,
        cpu_ns: 7,
        parts: vec![part("vcpu 0", 0.012, 4096), part("é", 1.0, 0)],
    };
    let (h, payload) = r.encode();
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    assert_eq!((h.count, h.len), (2, payload.len() as u64));
    assert_eq!(ResumedRecord::decode(h.count, &payload), Ok(r));

    let long = ResumedRecord {
        parts: vec![part(&"ü".repeat(40), 0.0, 0)],
        ..ResumedRecord::default()
    };
    let (h, payload) = long.encode();
    let back = ResumedRecord::decode(h.count, &payload).unwrap();
    assert_eq!(
        back.parts[0].name,
        "ü".repeat(32),
        "cut at 64 bytes, whole characters"
    );

    let (_, payload) = ResumedRecord {
        parts: vec![part("vcpu 0", 0.0, 0)],
        ..ResumedRecord::default()
    }
    .encode();
    let table: [(u32, Vec<u8>, &str); 4] = [
        (2, payload.clone(), "part 1 is malformed (cut short)"),
        (0, payload.clone(), "bytes after the last part"),
        (1, payload[..payload.len() - 1].to_vec(), "name cut short"),
        (
            1,
            [&payload[..payload.len() - 6], b"\xff\xfe\xfd\xfc\xfb\xfa"].concat(),
            "name not UTF-8",
        ),
    ];
    for (count, bytes, want) in table {
        let err = ResumedRecord::decode(count, &bytes)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{want}: got {err}");
    }
    assert!(Header::decode(&Header::new(Kind::Resumed, MAX_STATE_PARTS + 1, 24).encode()).is_err());
    assert!(Header::decode(&Header::new(Kind::Resumed, 1, 24 + 18 + 65).encode()).is_err());
    assert!(Header::decode(&Header::new(Kind::Resumed, 0, 23).encode()).is_err());
    assert!(
        ResumedRecord::decode(0, &[0; 23]).is_err(),
        "short, undecoded header"
    );
}

#[test]
fn local_devices_round_trip_and_name_each_descriptor_once() {
    let disk = LocalDevice {
        id: SectionId(7),
        instance: 1,
        fd: 0,
    };
    let tap = LocalDevice {
        id: SectionId(9),
        instance: 0,
        fd: 1,
    };
    let (h, payload) = LocalDevice::encode_all(&[disk, tap]);
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    assert_eq!(h.len, 2 * LOCAL_DEVICE_SIZE);
    assert_eq!(LocalDevice::decode_all(&payload, 2), Ok(vec![disk, tap]));
    let bad = |devices: &[LocalDevice], fds| {
        LocalDevice::decode_all(&LocalDevice::encode_all(devices).1, fds)
    };
    for (devices, fds) in [
        // A descriptor that did not come, one that came and is named by nobody.
        (&[disk, tap][..], 1),
        (&[disk][..], 2),
        // A device or a descriptor named twice, a section id that names nothing.
        (&[disk, LocalDevice { fd: 1, ..disk }][..], 2),
        (&[disk, LocalDevice { fd: 0, ..tap }][..], 2),
        (
            &[LocalDevice {
                id: SectionId(0),
                ..disk
            }][..],
            1,
        ),
    ] {
        assert!(
            matches!(bad(devices, fds), Err(WireError::LocalDevice { .. })),
            "{devices:?} with {fds}"
        );
    }
    let mut reserved = payload.clone();
    reserved[12] = 1;
    assert_eq!(
        LocalDevice::decode_all(&reserved, 2),
        Err(WireError::Reserved("local device"))
    );
    // Counted and bounded like any batch, never empty.
    let too_many = Header::new(
        Kind::LocalDevices,
        MAX_LOCAL_DEVICES + 1,
        u64::from(MAX_LOCAL_DEVICES + 1) * LOCAL_DEVICE_SIZE,
    );
    assert!(Header::decode(&too_many.encode()).is_err());
    assert!(Header::decode(&Header::new(Kind::LocalDevices, 0, 0).encode()).is_err());
}

#[test]
fn local_regions_round_trip_and_refuse_what_cannot_be_mapped() {
    let regions = [
        LocalRegion {
            gpa: 0,
            size: 3 << 30,
            file_offset: 0,
            fd: 0,
        },
        LocalRegion {
            gpa: 4 << 30,
            size: 1 << 30,
            file_offset: 3 << 30,
            fd: 0,
        },
    ];
    let (h, payload) = LocalRegion::encode_all(&regions);
    let mut raw = h.encode();
    assert_eq!(Header::decode(&raw), Ok(h));
    assert_eq!(LocalRegion::decode_all(&payload, 1), Ok(regions.to_vec()));
    // The descriptor it names must have come with it.
    assert!(matches!(
        LocalRegion::decode_all(&payload, 0),
        Err(WireError::LocalRegion { index: 0, .. })
    ));
    let bad = |r: LocalRegion| LocalRegion::decode_all(&LocalRegion::encode_all(&[r]).1, 1);
    for r in [
        LocalRegion {
            size: 0,
            ..regions[0]
        },
        LocalRegion {
            gpa: 100,
            ..regions[0]
        },
        LocalRegion {
            file_offset: 1,
            ..regions[0]
        },
        LocalRegion {
            gpa: u64::MAX - 4095,
            ..regions[0]
        },
    ] {
        assert!(
            matches!(bad(r), Err(WireError::LocalRegion { .. })),
            "{r:?}"
        );
    }
    // Counted and bounded like any batch, and its answers carry nothing.
    raw[4..8].copy_from_slice(&(MAX_LOCAL_REGIONS + 1).to_le_bytes());
    reseal_header(&mut raw);
    assert!(matches!(
        Header::decode(&raw),
        Err(WireError::TooMany { .. })
    ));
    for kind in [Kind::RamAdopted, Kind::Loaded, Kind::Go] {
        let h = Header::new(kind, 0, 8);
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(WireError::NotEmpty { .. })
        ));
    }
}

/// A hello carries the version of what it asks for: 4 unless it asks for (or grants) the local
/// handover, so that a version 4 peer reads every hello it could take part in, and a version 4
/// hello cannot ask for what version 5 added.
#[test]
fn a_hello_carries_the_version_its_capabilities_need() {
    let version_of = |h: &Hello| u32::from_le_bytes(h.encode()[8..12].try_into().unwrap());
    let plain = hello();
    assert_eq!(version_of(&plain), OLDEST_VERSION);
    let local = Hello {
        capabilities: plain.capabilities.with(Capabilities::LOCAL),
        ..plain
    };
    assert_eq!(version_of(&local), VERSION);
    assert_eq!(Hello::decode(&local.encode()), Ok(local));
    let mut b = local.encode();
    b[8..12].copy_from_slice(&OLDEST_VERSION.to_le_bytes());
    reseal_hello(&mut b);
    assert!(matches!(Hello::decode(&b), Err(WireError::Reserved(_))));
}
