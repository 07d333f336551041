//! A TCP proxy between a source and a destination that a test breaks on purpose: the network
//! failures postcopy recovery must survive, made on loopback. Every connection it accepts is
//! forwarded to the current target (which a test moves to the destination's recovery
//! listener); it learns each connection's role from the hello it forwards, paces what the
//! source sends (so a migration lasts long enough to be broken in postcopy), and can hold all
//! traffic, cut every connection or only those of one role, and cut the next connections
//! right after their hello (a failure during a recovery). It also reads the main connection's
//! records as they pass, so that a test can hold all traffic just before a record of a given
//! kind goes by ([`Proxy::hold_at`]): the way to strike in a phase that lasts milliseconds.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ferry_migrate::wire::{HEADER_SIZE, HELLO_SIZE, Header, Hello, Kind, Role};

/// One forwarded connection: both of its sockets, and the role its hello named.
#[derive(Debug)]
struct Link {
    role: Option<Role>,
    source: TcpStream,
    target: TcpStream,
}

/// What the proxy does at the record a test names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strike {
    Hold,
    /// Flip a bit of its header's checksum and forward it: a record damaged on the way.
    Corrupt,
}

/// Which way bytes go through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    ToDestination,
    ToSource,
}

#[derive(Debug)]
struct State {
    target: String,
    /// Hold all traffic just before the main connection forwards a record of this kind this
    /// way, or corrupt that record's header (once).
    hold_at: Option<(Direction, Kind, Strike)>,
    /// A `hold_at` struck.
    struck: bool,
    links: Vec<Link>,
    /// Connections accepted from now on are cut right after their hello was forwarded.
    cut_after_hello: bool,
    held: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    released: Condvar,
    /// Bytes per second each connection may forward from the source.
    rate: u64,
    stop: AtomicBool,
}

/// A running proxy; dropping it stops accepting and cuts every connection.
#[derive(Debug)]
pub struct Proxy {
    shared: Arc<Shared>,
    address: String,
    accepting: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Listens on loopback and forwards to `target` (`HOST:PORT`), each connection's source
    /// side paced to `rate` bytes per second (more than 0).
    pub fn start(target: &str, rate: u64) -> Proxy {
        assert!(rate > 0, "a proxy that forwards nothing");
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the proxy");
        listener
            .set_nonblocking(true)
            .expect("a nonblocking listener");
        let address = listener.local_addr().expect("its address").to_string();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                target: target.into(),
                hold_at: None,
                struck: false,
                links: Vec::new(),
                cut_after_hello: false,
                held: false,
            }),
            released: Condvar::new(),
            rate,
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accepting = std::thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((source, _)) => forward(&s, source),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Proxy {
            shared,
            address,
            accepting: Some(accepting),
        }
    }

    /// Where sources connect: `HOST:PORT`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Forwards connections accepted from now on to `target` (`HOST:PORT`).
    pub fn retarget(&self, target: &str) {
        self.shared.state.lock().unwrap().target = target.into();
    }

    /// Stops forwarding in both directions (the connections stay open) until [`Proxy::release`].
    pub fn hold(&self) {
        self.shared.state.lock().unwrap().held = true;
    }

    /// Holds all traffic, as [`Proxy::hold`] does, at the moment the main connection is
    /// about to forward the header of a record of `kind` in `direction` (what came before it
    /// went through; the record and everything after wait). Once.
    pub fn hold_at(&self, direction: Direction, kind: Kind) {
        self.strike_at(direction, kind, Strike::Hold);
    }

    /// Damages the header of the next record of `kind` that the main connection forwards in
    /// `direction` (one flipped bit; everything else passes as it is). Once;
    /// [`Proxy::wait_struck`] tells when it happened.
    pub fn corrupt_at(&self, direction: Direction, kind: Kind) {
        self.strike_at(direction, kind, Strike::Corrupt);
    }

    fn strike_at(&self, direction: Direction, kind: Kind, strike: Strike) {
        let mut state = self.shared.state.lock().unwrap();
        state.hold_at = Some((direction, kind, strike));
        state.struck = false;
    }

    /// Waits up to `timeout` for a [`Proxy::hold_at`] to strike; whether it did.
    pub fn wait_struck(&self, timeout: Duration) -> bool {
        let state = self.shared.state.lock().unwrap();
        let (state, _) = self
            .shared
            .released
            .wait_timeout_while(state, timeout, |s| !s.struck)
            .unwrap();
        state.struck
    }

    pub fn release(&self) {
        self.shared.state.lock().unwrap().held = false;
        self.shared.released.notify_all();
    }

    /// Cuts every connection: both ends see it closed, as when a link between hosts fails.
    /// Returns how many it cut.
    pub fn cut_all(&self) -> usize {
        self.cut_where(|_| true)
    }

    /// Cuts only the connections whose hello named `role`; returns how many.
    pub fn cut_role(&self, role: Role) -> usize {
        self.cut_where(|r| r == Some(role))
    }

    /// Cuts one connection whose hello named `role` (the first the proxy accepted); whether
    /// there was one.
    pub fn cut_one(&self, role: Role) -> bool {
        let mut state = self.shared.state.lock().unwrap();
        let Some(i) = state.links.iter().position(|l| l.role == Some(role)) else {
            return false;
        };
        let l = state.links.remove(i);
        cut(&l.source, &l.target);
        true
    }

    /// Connections accepted from now on (while `on`) are cut just after their hello reached
    /// the target: a recovery that fails half way.
    pub fn cut_after_hello(&self, on: bool) {
        self.shared.state.lock().unwrap().cut_after_hello = on;
    }

    fn cut_where(&self, which: impl Fn(Option<Role>) -> bool) -> usize {
        let mut state = self.shared.state.lock().unwrap();
        let (cut, kept): (Vec<Link>, Vec<Link>) =
            state.links.drain(..).partition(|l| which(l.role));
        state.links = kept;
        for l in &cut {
            self::cut(&l.source, &l.target);
        }
        cut.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.release();
        self.cut_all();
        if let Some(t) = self.accepting.take() {
            let _ = t.join();
        }
    }
}

/// Connects to the target and starts the two pumps of a new connection.
fn forward(shared: &Arc<Shared>, source: TcpStream) {
    let _ = source.set_nonblocking(false);
    let target_address = shared.state.lock().unwrap().target.clone();
    let Ok(target) = TcpStream::connect(&target_address) else {
        // Nobody listens there: the source sees its connection closed, as it would.
        return;
    };
    let _ = source.set_nodelay(true);
    let _ = target.set_nodelay(true);
    let (Ok(s2), Ok(t2), Ok(s3), Ok(t3)) = (
        source.try_clone(),
        target.try_clone(),
        source.try_clone(),
        target.try_clone(),
    ) else {
        return;
    };
    let cut_after_hello = {
        let mut state = shared.state.lock().unwrap();
        state.links.push(Link {
            role: None,
            source: s3,
            target: t3,
        });
        state.cut_after_hello
    };
    let up = shared.clone();
    std::thread::spawn(move || upstream(&up, source, target, cut_after_hello));
    if !cut_after_hello {
        // A connection to be cut never hears the target's answer.
        let down = shared.clone();
        std::thread::spawn(move || downstream(&down, s2, t2));
    }
}

/// Source to target: the hello first (its role is recorded), then paced.
fn upstream(shared: &Shared, mut source: TcpStream, mut target: TcpStream, cut_after_hello: bool) {
    let mut hello = [0u8; HELLO_SIZE];
    if source.read_exact(&mut hello).is_err() {
        cut(&source, &target);
        return;
    }
    let role = Hello::decode(&hello).ok().map(|h| h.role);
    let peer = source.peer_addr().ok();
    {
        let mut state = shared.state.lock().unwrap();
        if let Some(l) = state
            .links
            .iter_mut()
            .find(|l| l.source.peer_addr().ok() == peer)
        {
            l.role = role;
        }
    }
    // The role is known before the target can answer: the answer's pump reads it.
    if target.write_all(&hello).is_err() {
        cut(&source, &target);
        return;
    }
    if cut_after_hello {
        // Let the target read the hello and begin answering, then fail.
        std::thread::sleep(Duration::from_millis(20));
        cut(&source, &target);
        return;
    }
    let records = (role == Some(Role::Main)).then(|| Records::after(0));
    let way = (Direction::ToDestination, records);
    pump(shared, &mut source, &mut target, Some(shared.rate), way);
    forget(shared, peer);
}

/// Drops the proxy's own handles on a connection that ended, so that its sockets close once
/// both pumps are done: a source that writes on then gets a reset, as from a dead peer.
fn forget(shared: &Shared, peer: Option<std::net::SocketAddr>) {
    let mut state = shared.state.lock().unwrap();
    state.links.retain(|l| l.source.peer_addr().ok() != peer);
}

/// Target to source, unpaced.
fn downstream(shared: &Shared, mut source: TcpStream, mut target: TcpStream) {
    // The target answers only once the hello reached it, after its role was recorded.
    let _ = target.peek(&mut [0u8; 1]);
    let peer = source.peer_addr().ok();
    let main = shared
        .state
        .lock()
        .unwrap()
        .links
        .iter()
        .any(|l| l.role == Some(Role::Main) && l.source.peer_addr().ok() == peer);
    // The main connection's answer: a hello, then records.
    let records = main.then(|| Records::after(HELLO_SIZE as u64));
    pump(
        shared,
        &mut target,
        &mut source,
        None,
        (Direction::ToSource, records),
    );
    forget(shared, peer);
}

/// Follows the record boundaries of a main connection's stream, to find where a record of a
/// given kind begins.
#[derive(Debug)]
struct Records {
    /// Bytes still to pass before the next header begins.
    skip: u64,
    header: Vec<u8>,
}

impl Records {
    fn after(skip: u64) -> Records {
        Records {
            skip,
            header: Vec::with_capacity(HEADER_SIZE),
        }
    }

    /// Reads `bytes` on; the offset in them at which the header of a record of `kind` is
    /// complete, if one is. A stream that does not parse is followed no further.
    fn find(&mut self, bytes: &[u8], kind: Option<Kind>) -> Option<usize> {
        let mut at = 0;
        while at < bytes.len() {
            if self.skip > 0 {
                let n = (self.skip.min((bytes.len() - at) as u64)) as usize;
                self.skip -= n as u64;
                at += n;
                continue;
            }
            let n = (HEADER_SIZE - self.header.len()).min(bytes.len() - at);
            self.header.extend_from_slice(&bytes[at..at + n]);
            at += n;
            if self.header.len() < HEADER_SIZE {
                break;
            }
            let raw: [u8; HEADER_SIZE] = self.header[..].try_into().unwrap();
            self.header.clear();
            let Ok(h) = Header::decode(&raw) else {
                self.skip = u64::MAX;
                break;
            };
            self.skip = h.len;
            if Some(h.kind) == kind {
                return Some(at);
            }
        }
        None
    }
}

/// Copies `from` to `to` until either ends (waiting while the proxy holds, and paced to `rate`
/// bytes per second if given), then cuts the connection. On a main connection (`way` carries
/// its records), holds everything when a [`Proxy::hold_at`] for this direction strikes.
fn pump(
    shared: &Shared,
    from: &mut TcpStream,
    to: &mut TcpStream,
    rate: Option<u64>,
    way: (Direction, Option<Records>),
) {
    let (direction, mut records) = way;
    let started = Instant::now();
    let mut sent = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut from_byte = 0;
        if let Some(records) = records.as_mut() {
            let trigger = shared
                .state
                .lock()
                .unwrap()
                .hold_at
                .filter(|(d, _, _)| *d == direction);
            if let Some(at) = records.find(&buf[..n], trigger.map(|(_, k, _)| k)) {
                let strike = trigger.map_or(Strike::Hold, |(_, _, s)| s);
                if strike == Strike::Corrupt {
                    // The header's last byte (its own checksum) is in this chunk.
                    buf[at - 1] ^= 1;
                } else {
                    // What precedes the record's header goes; the rest waits for the release.
                    let start = at - HEADER_SIZE.min(at);
                    if to.write_all(&buf[..start]).is_err() {
                        break;
                    }
                    from_byte = start;
                }
                strike_now(shared, strike);
                // Read the rest of this chunk's records (the strike came once).
                records.find(&buf[at..n], None);
            }
        }
        wait_while_held(shared);
        if to.write_all(&buf[from_byte..n]).is_err() {
            break;
        }
        sent += n as u64;
        if let Some(rate) = rate {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(ahead) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(ahead);
            }
        }
    }
    cut(from, to);
}

/// A [`Proxy::hold_at`] or [`Proxy::corrupt_at`] struck: hold everything from now, or not.
fn strike_now(shared: &Shared, strike: Strike) {
    let mut state = shared.state.lock().unwrap();
    state.hold_at = None;
    state.struck = true;
    state.held |= strike == Strike::Hold;
    shared.released.notify_all();
}

fn wait_while_held(shared: &Shared) {
    let mut state = shared.state.lock().unwrap();
    while state.held && !shared.stop.load(Ordering::Relaxed) {
        state = shared.released.wait(state).unwrap();
    }
}

/// Shuts both sockets of a connection: each end sees it closed.
fn cut(a: &TcpStream, b: &TcpStream) {
    let _ = a.shutdown(Shutdown::Both);
    let _ = b.shutdown(Shutdown::Both);
}
