//! A process of another uid, for the tests of a local handover's peer check: the test binary
//! started again as `nobody` ([`NOBODY`]), running one [`Role`] against a Unix socket path and
//! saying on its stdout what happened ([`Report`]).
//!
//! A test binary that uses it has a test named [`HOOK`] that calls [`serve_if_asked`]: in an
//! ordinary run it does nothing; in the process [`spawn`] starts it plays its role. Starting a
//! process of another uid needs root (`Command::uid`); elsewhere [`spawn`] returns `None`
//! and the test says it was skipped, so what these tests prove is proven only as root.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_migrate::transport::Stream;
use ferry_migrate::wire::{HELLO_SIZE, Header, Hello, Kind};

/// The overflow uid and gid every Linux has: it owns nothing, and is not root.
pub const NOBODY: u32 = 65534;
/// The test each binary that starts strangers has, which [`serve_if_asked`].
pub const HOOK: &str = "stranger_hook";
/// Where the parent tells the stranger what to do: `ROLE:PATH`.
const ASK: &str = "FERRY_STRANGER";
/// What every line a stranger reports starts with (libtest prints its own lines around them).
const SAYS: &str = "ferry-stranger: ";
/// Guest pages a thief writes into each descriptor it gets: what the reproduction of the bug
/// saw (a fake destination that wrote 8 pages, then answered Error).
pub const THIEF_PAGES: u64 = 8;
/// The byte a thief writes into the pages it steals, so the guest can tell them.
pub const THIEF_BYTE: u8 = 0xee;
/// How long a stranger waits for its peer: far more than any step of a handover on one host.
const PATIENCE: Duration = Duration::from_secs(20);
/// The byte pattern stride a stranger source fills its guest with (`FakeVm::fill`).
pub const SOURCE_FILL: u64 = 9;

/// What the stranger does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A fake destination: listens on the path, grants a local handover to the source that
    /// connects, writes [`THIEF_PAGES`] into every descriptor it gets and answers Error.
    Thief,
    /// A source of a `memory`-byte fake guest filled with [`SOURCE_FILL`]: connects to the
    /// path and hands its guest over locally, allowing uid 0 (so that it does send its
    /// descriptors, and only the destination's own check can stop them).
    Source { memory: u64 },
}

/// What a stranger said when it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Why it could not connect (a source), if it could not.
    pub connect_error: Option<String>,
    /// Descriptors it received (a thief).
    pub descriptors: u64,
    /// Guest pages it wrote through them (a thief).
    pub pages_written: u64,
    /// The migration's end (a source): `ok`, or its error.
    pub result: Option<String>,
}

/// A stranger started by [`spawn`].
#[derive(Debug)]
pub struct Stranger {
    child: Child,
    out: BufReader<ChildStdout>,
    said: Report,
}

/// Starts this test binary again as uid and gid [`NOBODY`], playing `role` against `path`;
/// `None` when this process may not (it is not root), said on stderr.
pub fn spawn(role: Role, path: &Path) -> Option<Stranger> {
    let ask = match role {
        Role::Thief => format!("thief:{}", path.display()),
        Role::Source { memory } => format!("source-{memory}:{}", path.display()),
    };
    let spawned = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", HOOK, "--nocapture", "--test-threads", "1"])
        .env(ASK, ask)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("skipped: starting a process of uid {NOBODY} needs root ({e})");
            return None;
        }
        Err(e) => panic!("cannot start a stranger: {e}"),
    };
    let out = BufReader::new(child.stdout.take().expect("piped"));
    Some(Stranger {
        child,
        out,
        said: Report::default(),
    })
}

impl Stranger {
    /// Waits until the stranger says `what` (e.g. `listening`).
    pub fn wait_for(&mut self, what: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .out
                .read_line(&mut line)
                .expect("the stranger's stdout");
            assert!(n > 0, "the stranger ended before it said {what:?}");
            if said(&line) == Some(what) {
                return;
            }
            self.note(&line);
        }
    }

    /// Waits for the stranger to end; what it said.
    pub fn report(mut self) -> Report {
        let mut rest = String::new();
        let _ = self.out.read_to_string(&mut rest);
        for line in rest.lines() {
            self.note(line);
        }
        let status = self.child.wait().expect("the stranger ends");
        assert!(status.success(), "the stranger failed: {status}\n{rest}");
        std::mem::take(&mut self.said)
    }

    fn note(&mut self, line: &str) {
        let Some(said) = said(line) else {
            return;
        };
        let number = |v: &str| v.parse::<u64>().expect("a count");
        if let Some(v) = said.strip_prefix("connect: ") {
            self.said.connect_error = Some(v.into());
        } else if let Some(v) = said.strip_prefix("descriptors received: ") {
            self.said.descriptors = number(v);
        } else if let Some(v) = said.strip_prefix("pages written: ") {
            self.said.pages_written = number(v);
        } else if let Some(v) = said.strip_prefix("result: ") {
            self.said.result = Some(v.into());
        }
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In the [`HOOK`] test: plays the role the parent asked for, if it asked.
pub fn serve_if_asked() {
    let Ok(ask) = std::env::var(ASK) else {
        return;
    };
    let (role, path) = ask.split_once(':').expect("ROLE:PATH");
    let path = PathBuf::from(path);
    match role {
        "thief" => thief(&path),
        source => {
            let memory = source
                .strip_prefix("source-")
                .and_then(|m| m.parse().ok())
                .expect("source-MEMORY");
            stranger_source(&path, memory);
        }
    }
}

/// What a stranger said on `line`, if it is one of its (libtest may have begun the line with
/// `test stranger_hook ... `).
fn said(line: &str) -> Option<&str> {
    line.find(SAYS).map(|at| line[at + SAYS.len()..].trim_end())
}

fn say(what: impl std::fmt::Display) {
    println!("{SAYS}{what}");
    let _ = std::io::stdout().flush();
}

/// [`Role::Thief`].
fn thief(path: &Path) {
    let listener = UnixListener::bind(path).expect("the thief listens");
    say("listening");
    let (mut s, _) = listener.accept().expect("a source");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut hello = [0u8; HELLO_SIZE];
    s.read_exact(&mut hello).expect("the source's hello");
    let asked = Hello::decode(&hello).expect("a hello");
    // Everything asked for is granted, the local handover first of all.
    let reply = Hello {
        status: 0,
        postcopy_page_shift: 0,
        ..asked
    };
    s.write_all(&reply.encode()).unwrap();
    let (mut descriptors, mut pages, mut answered) = (0u64, 0u64, false);
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        let mut buf = [0u8; 4096];
        let mut fds = Vec::new();
        let n = match s.recv_with_fds(&mut buf, &mut fds) {
            Ok(n) => n,
            Err(_) => break,
        };
        for fd in fds {
            descriptors += 1;
            let file = std::fs::File::from(fd);
            for page in 0..THIEF_PAGES {
                if file.write_at(&[THIEF_BYTE; 4096], page * 4096).is_ok() {
                    pages += 1;
                }
            }
        }
        if descriptors > 0 && !answered {
            let why = b"a fake destination: failed (after writing into guest RAM)";
            let h = Header::new(
                Kind::Error,
                ferry_migrate::wire::ERROR_FAILED,
                why.len() as u64,
            );
            let _ = s.write_all(&crate::craft::record(h, why));
            answered = true;
        }
        if n == 0 {
            break;
        }
    }
    say(format!("descriptors received: {descriptors}"));
    say(format!("pages written: {pages}"));
}

/// [`Role::Source`].
fn stranger_source(path: &Path, memory: u64) {
    let stream = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) => {
            say(format!("connect: {e}"));
            return;
        }
    };
    let mut vm = crate::FakeVm::new(memory, 1);
    vm.fill(SOURCE_FILL);
    let mut p = ferry_migrate::source::SourceParams::new(ferry_migrate::Policy::default(), [5; 16]);
    p.mode = ferry_migrate::source::Mode::Local;
    p.allow_uids = vec![0];
    p.peer_timeout = Some(PATIENCE);
    let connect = || -> std::io::Result<UnixStream> { panic!("a local handover reconnected") };
    let r = ferry_migrate::source::migrate(
        &mut vm,
        stream,
        &connect,
        &p,
        &ferry_migrate::Control::default(),
    );
    say(format!(
        "result: {}",
        r.map_or_else(|e| format!("error: {e}"), |_| "ok".into())
    ));
}
