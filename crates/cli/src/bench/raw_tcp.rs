//! The references the benches hold a migration's rate to: raw loopback TCP, one stream or
//! several in parallel, measured in the same run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Bytes per second of `n` loopback TCP streams carrying `bytes` in all, in parallel: the
/// reference a migration over `n` channels is held to.
pub(super) fn raw_tcp_streams(bytes: u64, n: u16) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let per = (bytes / u64::from(n)).max(1 << 20);
    let start = Instant::now();
    let writers: Vec<_> = (0..n)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = TcpStream::connect(addr)?;
                let chunk = vec![0x5au8; 1 << 20];
                let mut left = per;
                while left > 0 {
                    let k = left.min(chunk.len() as u64) as usize;
                    s.write_all(&chunk[..k])?;
                    left -= k as u64;
                }
                Ok(())
            })
        })
        .collect();
    let mut readers = Vec::new();
    for _ in 0..n {
        let (mut s, _) = listener.accept()?;
        readers.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0u64;
            while let Ok(k) = s.read(&mut buf) {
                if k == 0 {
                    break;
                }
                total += k as u64;
            }
            total
        }));
    }
    for w in writers {
        w.join().expect("writer thread")?;
    }
    let total: u64 = readers
        .into_iter()
        .map(|r| r.join().expect("reader thread"))
        .sum();
    anyhow::ensure!(
        total == per * u64::from(n),
        "the reference streams lost bytes"
    );
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// Bytes per second of one loopback TCP stream carrying `bytes` from a writer thread to a
/// reader thread, in 1 MiB writes and reads: the reference a migration's data rate is held to.
pub(super) fn raw_tcp(bytes: u64) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0;
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let chunk = vec![0x5au8; 1 << 20];
    let start = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    drop(s);
    let received = reader.join().expect("reader thread")?;
    let elapsed = start.elapsed().as_secs_f64();
    anyhow::ensure!(received == bytes, "the reference stream lost bytes");
    Ok(bytes as f64 / elapsed)
}
