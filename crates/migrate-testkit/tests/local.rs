//! The local handover over the fake VMM, without /dev/kvm: real Unix sockets, real memfds
//! passed as `SCM_RIGHTS`. The destination maps the source's own memory (no page is sent), and
//! the guest runs in exactly one of the two: the destination only on Go, the source again on
//! any failure before it.

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use ferry_migrate::destination;
use ferry_migrate::source::{self, SourceParams};
use ferry_migrate::{Control, MigrateError, Policy};
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;

fn params() -> SourceParams {
    let mut p = SourceParams::new(Policy::default(), [3; 16]);
    p.mode = ferry_migrate::source::Mode::Local;
    p.peer_timeout = Some(Duration::from_secs(5));
    p
}

/// No data channel connects in a local handover: an accept that is never called.
fn no_channels(_: Instant) -> std::io::Result<UnixStream> {
    panic!("a local handover opened a data channel")
}

/// Hands `src` over to `dst` over a socket pair; `cut` runs on the destination's stream
/// before it receives (a test may break it on purpose).
fn hand_over(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
) -> (
    Result<ferry_migrate::MigrationStats, MigrateError>,
    Result<destination::ReceiveStats, MigrateError>,
) {
    let (a, b) = UnixStream::pair().unwrap();
    std::thread::scope(|s| {
        let receiver = s.spawn(|| destination::receive(dst, b, &mut no_channels));
        let connect = || -> std::io::Result<UnixStream> { panic!("a local handover reconnected") };
        let sent = source::migrate(src, a, &connect, p, &Control::default());
        (sent, receiver.join().unwrap())
    })
}

#[test]
fn a_local_handover_maps_the_source_s_memory_and_sends_no_page() {
    let mut src = FakeVm::new(64 * MIB, 2);
    src.fill(3);
    src.start_writers(Writers {
        threads: 2,
        seed: 11,
        zero_percent: 0,
        interval: Duration::from_micros(50),
    });
    std::thread::sleep(Duration::from_millis(50));
    let mut dst = FakeVm::new(64 * MIB, 2);
    let (sent, received) = hand_over(&mut src, &mut dst, &params());
    let stats = sent.expect("the handover");
    received.expect("the destination");
    assert!(
        src.is_paused(),
        "the source must not run a guest it handed over"
    );
    assert!(dst.resumed && dst.state == src.state, "{:?}", dst.state);
    assert_eq!(stats.pages_normal + stats.pages_zero, 0, "{stats:?}");
    assert!(stats.passes.is_empty(), "{stats:?}");
    // Hello, configuration, the layout, the state, Complete, Go: well under a page.
    assert!(stats.bytes_sent < 4096, "{} bytes sent", stats.bytes_sent);
    // One memory, not a copy: what the destination writes, the source's mapping shows.
    src.stop_writers();
    let before = src.contents();
    assert_eq!(dst.contents(), before);
    dst.write(0, &[0xab; 8]).unwrap();
    assert_eq!(src.contents()[..8], [0xab; 8]);
}

#[test]
fn a_destination_that_refuses_the_state_leaves_the_guest_running_at_the_source() {
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(5);
    let before = src.contents();
    // A section version the fake destination does not load.
    src.state[0].version = 9;
    let mut dst = FakeVm::new(16 * MIB, 1);
    let (sent, received) = hand_over(&mut src, &mut dst, &params());
    let e = sent.expect_err("refused");
    assert!(
        matches!(e, MigrateError::Remote(..)) && e.to_string().contains("version 9"),
        "{e}"
    );
    received.expect_err("the destination failed");
    assert!(!src.is_paused(), "the source resumes its guest");
    assert!(!dst.resumed);
    assert_eq!(src.contents(), before, "nothing was written");
}

#[test]
fn a_destination_gone_before_go_leaves_the_guest_running_at_the_source() {
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(7);
    let (a, b) = UnixStream::pair().unwrap();
    // A destination that takes the memory, reads the state, and vanishes before Loaded.
    let gone = std::thread::spawn(move || {
        use std::io::Read;
        let mut b = b;
        let mut dst = FakeVm::new(16 * MIB, 1);
        let cut = b.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Wait until the session is well under way, then cut the connection.
            std::thread::sleep(Duration::from_millis(200));
            let _ = cut.shutdown(std::net::Shutdown::Both);
            let _ = (&cut).read(&mut buf);
        });
        let r = destination::receive(&mut dst, b.try_clone().unwrap(), &mut no_channels);
        reader.join().unwrap();
        let _ = b.read(&mut [0u8; 1]);
        (r, dst.resumed)
    });
    // A source whose guest takes long to save, so that the cut lands after the pause.
    src.state[0].data = vec![1; 1 << 10];
    let slow = SlowSave(src);
    let mut slow = slow;
    let connect = || -> std::io::Result<UnixStream> { panic!("reconnected") };
    let sent = source::migrate(&mut slow, a, &connect, &params(), &Control::default());
    let (received, resumed) = gone.join().unwrap();
    let e = sent.expect_err("the destination went away");
    assert!(!matches!(e, MigrateError::Unacknowledged(_)), "{e}");
    received.expect_err("cut");
    assert!(!resumed, "no Go, no guest at the destination");
    assert!(!slow.0.is_paused(), "the source resumes its guest: {e}");
}

#[test]
fn local_needs_a_socket_that_carries_descriptors() {
    // Over TCP the destination does not offer it, and the source says how to fix that.
    let mut src = FakeVm::new(16 * MIB, 1);
    let mut dst = FakeVm::new(16 * MIB, 1);
    let (sent, _) = ferry_migrate_testkit::loopback::migrate(
        &mut src,
        &mut dst,
        &params(),
        &Control::default(),
    );
    let e = sent.expect_err("refused");
    assert!(e.to_string().contains("migrate without --local"), "{e}");
    assert!(!src.is_paused());
    // Postcopy beside it cannot be asked for: both are values of `Mode`.
}

/// A source VM whose state save takes 400 ms, as one with a stuck device would.
struct SlowSave(FakeVm);

// SAFETY: every call goes to the fake, whose `ram()` keeps its promise.
unsafe impl ferry_migrate::SourceVm for SlowSave {
    fn ram(&self) -> Vec<ferry_migrate::ram::RamRegion> {
        self.0.ram()
    }
    fn start_dirty_log(&mut self) -> Result<(), ferry_migrate::VmError> {
        self.0.start_dirty_log()
    }
    fn fetch_dirty(
        &mut self,
        into: &mut ferry_migrate::bitmap::DirtyBitmap,
    ) -> Result<(), ferry_migrate::VmError> {
        self.0.fetch_dirty(into)
    }
    fn stop_dirty_log(&mut self) {
        self.0.stop_dirty_log()
    }
    fn pause(&mut self) -> Result<(), ferry_migrate::VmError> {
        self.0.pause()
    }
    fn resume(&mut self) -> Result<(), ferry_migrate::VmError> {
        ferry_migrate::SourceVm::resume(&mut self.0)
    }
    fn save_state(&mut self) -> Result<Vec<ferry_migrate::Section>, ferry_migrate::VmError> {
        std::thread::sleep(Duration::from_millis(400));
        self.0.save_state()
    }
}

/// A Unix socket forwarded between hosts (socat, ssh) carries the bytes of a LocalRam record
/// but not its descriptors: the destination says so, and maps nothing.
#[test]
fn a_local_ram_record_without_its_descriptors_is_refused_as_from_another_host() {
    use ferry_migrate::wire::{Capabilities, HELLO_SIZE, Hello, LocalRegion};
    use ferry_migrate_testkit::craft;
    use std::io::{Read, Write};
    let (mut a, b) = UnixStream::pair().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    std::thread::scope(|s| {
        let receiver = s.spawn(|| destination::receive(&mut dst, b, &mut no_channels));
        a.write_all(&craft::main_hello_asking(Capabilities::LOCAL))
            .unwrap();
        let mut reply = [0u8; HELLO_SIZE];
        a.read_exact(&mut reply).unwrap();
        let reply = Hello::decode(&reply).unwrap();
        assert!(
            reply.capabilities.contains(Capabilities::LOCAL),
            "{reply:?}"
        );
        let (h, payload) = LocalRegion::encode_all(&[LocalRegion {
            gpa: 0,
            size: 8 * MIB,
            file_offset: 0,
            fd: 0,
        }]);
        a.write_all(&craft::record(h, &payload)).unwrap();
        let e = receiver.join().unwrap().expect_err("refused");
        assert!(e.to_string().contains("not on this host"), "{e}");
        let mut said = Vec::new();
        let _ = a.read_to_end(&mut said);
        assert!(
            String::from_utf8_lossy(&said).contains("migrate without --local"),
            "the source is told why"
        );
    });
    assert!(!dst.resumed);
}

/// The fake device whose file the tests pass: section 0x44, instance 1.
const DEVICE: (ferry_migrate::wire::SectionId, u32) = (ferry_migrate::wire::SectionId(0x44), 1);

/// A device's file (a disk's image) in a source that passes it.
fn with_device_file(src: &mut FakeVm) -> std::fs::File {
    use ferry_migrate_testkit::device_files::DeviceFile;
    let file = tempfile::tempfile().unwrap();
    src.devices.files.push(DeviceFile {
        id: DEVICE.0,
        instance: DEVICE.1,
        file: file.try_clone().unwrap(),
    });
    file
}

/// Devices' descriptors travel with guest RAM, before the state is loaded (the fake refuses
/// them after), named as the source named them, and they are the source's open files: the
/// same open file description, not a file opened again.
#[test]
fn a_local_handover_passes_devices_descriptors_before_the_state() {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::MetadataExt;
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(4);
    let mut mine = with_device_file(&mut src);
    let mut dst = FakeVm::new(16 * MIB, 1);
    dst.devices.takes = vec![DEVICE];
    let (sent, received) = hand_over(&mut src, &mut dst, &params());
    sent.expect("the handover");
    received.expect("the destination");
    assert!(dst.resumed);
    let [passed] = &dst.devices.files[..] else {
        panic!("{:?}", dst.devices.files);
    };
    assert_eq!((passed.id, passed.instance), DEVICE);
    let (a, b) = (mine.metadata().unwrap(), passed.file.metadata().unwrap());
    assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "the same file");
    // One open file description: an offset moved through one is the other's.
    (&passed.file).seek(SeekFrom::Start(4242)).unwrap();
    assert_eq!(mine.stream_position().unwrap(), 4242);
}

/// A destination whose VMM opens its devices' files itself (an older ferry, or a VMM without
/// the hook) does not grant the capability: the source passes nothing and the handover goes
/// on as before.
#[test]
fn a_destination_that_opens_its_own_files_is_passed_no_descriptor() {
    let mut src = FakeVm::new(16 * MIB, 1);
    let _mine = with_device_file(&mut src);
    let mut dst = FakeVm::new(16 * MIB, 1);
    let (sent, received) = hand_over(&mut src, &mut dst, &params());
    sent.expect("the handover");
    received.expect("the destination");
    assert!(dst.resumed && dst.devices.files.is_empty());
}

/// A descriptor for a device the destination has none of is refused before the pause (the
/// source waits for DevicesAdopted): the source's guest runs on, never paused.
#[test]
fn a_descriptor_no_destination_device_takes_is_refused_before_the_pause() {
    let mut src = FakeVm::new(16 * MIB, 1);
    let _mine = with_device_file(&mut src);
    let mut src = Pauses(src, 0);
    let mut dst = FakeVm::new(16 * MIB, 1);
    dst.devices.takes = vec![(DEVICE.0, 2)];
    let (a, b) = UnixStream::pair().unwrap();
    let sent = std::thread::scope(|s| {
        let receiver = s.spawn(|| destination::receive(&mut dst, b, &mut no_channels));
        let connect = || -> std::io::Result<UnixStream> { panic!("reconnected") };
        let sent = source::migrate(&mut src, a, &connect, &params(), &Control::default());
        receiver
            .join()
            .unwrap()
            .expect_err("the destination refused");
        sent
    });
    let e = sent.expect_err("refused");
    assert!(e.to_string().contains("no device of the fake takes"), "{e}");
    assert_eq!(src.1, 0, "the guest was never paused");
    assert!(!src.0.is_paused());
    assert!(!dst.resumed && dst.devices.files.is_empty());
}

/// A source VM that counts its pauses and passes its devices' files.
struct Pauses(FakeVm, u32);

// SAFETY: every call goes to the fake, whose `ram()` keeps its promise.
unsafe impl ferry_migrate::SourceVm for Pauses {
    fn ram(&self) -> Vec<ferry_migrate::ram::RamRegion> {
        self.0.ram()
    }
    fn device_fds(&self) -> Result<Vec<ferry_migrate::DeviceFd>, ferry_migrate::VmError> {
        self.0.device_fds()
    }
    fn start_dirty_log(&mut self) -> Result<(), ferry_migrate::VmError> {
        self.0.start_dirty_log()
    }
    fn fetch_dirty(
        &mut self,
        into: &mut ferry_migrate::bitmap::DirtyBitmap,
    ) -> Result<(), ferry_migrate::VmError> {
        self.0.fetch_dirty(into)
    }
    fn stop_dirty_log(&mut self) {
        self.0.stop_dirty_log()
    }
    fn pause(&mut self) -> Result<(), ferry_migrate::VmError> {
        self.1 += 1;
        self.0.pause()
    }
    fn resume(&mut self) -> Result<(), ferry_migrate::VmError> {
        ferry_migrate::SourceVm::resume(&mut self.0)
    }
    fn save_state(&mut self) -> Result<Vec<ferry_migrate::Section>, ferry_migrate::VmError> {
        self.0.save_state()
    }
}
