//! Loopback ports.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How many ports `free_port` hands out before it starts over.
static HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// A loopback port that was free a moment ago, and that no other call in this process has returned.
///
/// The ports come from below the kernel's ephemeral range, walked in order from an offset the
/// process id sets. Asking the OS for port 0 instead can give the same port twice in a row (once the
/// first listener closes), and a port from the ephemeral range can be taken by any outgoing
/// connection's local end before the child that was meant to listen binds it: CI once saw HAProxy
/// fail to bind the port etcd had just been given.
pub fn free_port() -> u16 {
    let (low, high) = unclaimed_range();
    let size = u32::from(high - low);
    let offset = std::process::id().wrapping_mul(7919) % size;
    for _ in 0..size {
        let n = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = low + ((offset + n) % size) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot bind a loopback port: {e}"))
}

/// Ports no outgoing connection is given: the span below the ephemeral range (Linux's
/// `ip_local_port_range`, 32768 by default), down to half its start.
fn unclaimed_range() -> (u16, u16) {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .filter(|&start| start >= 4096)
        .unwrap_or(32768);
    (ephemeral_start / 2, ephemeral_start)
}

/// Waits until something accepts TCP connections on 127.0.0.1:`port`.
pub fn wait_for_port(port: u16, timeout: Duration) -> Result<(), String> {
    wait_for_addr(SocketAddr::from(([127, 0, 0, 1], port)), timeout)
}

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_for_addr(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Err(format!("nothing listened on {addr} within {timeout:?}"))
}

/// Minimal HTTP/1.1 GET for admin endpoints, so the harness needs no async runtime for it.
pub fn http_get_blocking(port: u16, path: &str) -> Result<String, String> {
    http_get_at(SocketAddr::from(([127, 0, 0, 1], port)), path)
}

/// [`http_get_blocking`] to `addr`: the body of a 200, else the status line or the error. A
/// peer that does not answer the connection within 5 s is an error too (a cut link).
pub fn http_get_at(addr: SocketAddr, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed HTTP answer")?;
    let status_line = head.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) != Some("200") {
        return Err(status_line.to_owned());
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_owned())
}

/// Decodes a chunked HTTP/1.1 body (the admin server streams some answers).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size_line, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_below_the_ephemeral_range() {
        let (_, ephemeral_start) = unclaimed_range();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        assert!(ports.iter().all(|&p| p < ephemeral_start), "{ports:?}");
    }
}
