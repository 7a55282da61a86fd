//! Identity servers in pod namespaces, and clients that ask them who answered.
//!
//! A server answers every line (TCP) or datagram (UDP) with `<identity> <port> <peer-ip>`:
//! which pod answered, on which port, and the source address it saw.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd as _, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::netns::in_ns;

mod sys {
    use std::os::raw::c_int;
    unsafe extern "C" {
        pub fn shutdown(fd: c_int, how: c_int) -> c_int;
    }
    pub const SHUT_RDWR: c_int = 2;
}

/// Wakes up a thread blocked in accept/recv on `fd` (std has no shutdown for listeners or
/// UDP sockets).
fn wake(fd: RawFd) {
    // SAFETY: `fd` is owned by a socket that outlives this call; shutdown does not close it.
    unsafe {
        sys::shutdown(fd, sys::SHUT_RDWR);
    }
}

/// What a server said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub identity: String,
    pub port: u16,
    pub peer: IpAddr,
}

impl Reply {
    fn parse(text: &str) -> std::io::Result<Reply> {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unexpected reply {text:?}"));
        let mut parts = text.split_whitespace();
        let identity = parts.next().ok_or_else(bad)?.to_string();
        let port = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let peer = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        Ok(Reply { identity, port, peer })
    }
}

/// An accepted connection (a handle to shut it down) and the thread serving it.
type Connections = Arc<Mutex<Vec<(TcpStream, Option<JoinHandle<()>>)>>>;

/// TCP and UDP identity servers on some ports inside one namespace; stopped on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    fds: Vec<RawFd>,
    threads: Vec<JoinHandle<()>>,
    connections: Connections,
    // Keep the sockets (and so their fds) alive until the threads are joined.
    _sockets: Vec<Arc<dyn Send + Sync>>,
}

impl Server {
    pub fn start(ns: &str, identity: &str, ports: &[u16]) -> Server {
        Self::start_on(ns, identity, ports, "0.0.0.0")
    }

    /// Listening on `::`: IPv6 clients (and IPv4 ones, seen as `::ffff:a.b.c.d`).
    pub fn start_dual_stack(ns: &str, identity: &str, ports: &[u16]) -> Server {
        Self::start_on(ns, identity, ports, "::")
    }

    fn start_on(ns: &str, identity: &str, ports: &[u16], address: &str) -> Server {
        let sockets: Vec<(u16, TcpListener, UdpSocket)> = in_ns(ns, || {
            ports
                .iter()
                .map(|&p| {
                    let tcp = TcpListener::bind((address, p)).unwrap_or_else(|e| panic!("tcp bind {p}: {e}"));
                    let udp = UdpSocket::bind((address, p)).unwrap_or_else(|e| panic!("udp bind {p}: {e}"));
                    (p, tcp, udp)
                })
                .collect()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let connections: Connections = Arc::default();
        let mut server = Server {
            stop: stop.clone(),
            fds: Vec::new(),
            threads: Vec::new(),
            connections: connections.clone(),
            _sockets: Vec::new(),
        };
        for (port, tcp, udp) in sockets {
            let (tcp, udp) = (Arc::new(tcp), Arc::new(udp));
            server.fds.push(tcp.as_raw_fd());
            server.fds.push(udp.as_raw_fd());
            server._sockets.push(tcp.clone());
            server._sockets.push(udp.clone());
            let (id, stop_t, conns) = (identity.to_string(), stop.clone(), connections.clone());
            server.threads.push(std::thread::spawn(move || {
                loop {
                    let accepted = tcp.accept();
                    if stop_t.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok((stream, peer)) = accepted else { continue };
                    let Ok(clone) = stream.try_clone() else { continue };
                    let id = id.clone();
                    let handle = std::thread::spawn(move || {
                        let mut writer = &stream;
                        for line in BufReader::new(&stream).lines() {
                            if line.is_err() || writeln!(writer, "{id} {port} {}", peer.ip()).is_err() {
                                return;
                            }
                        }
                    });
                    conns.lock().unwrap().push((clone, Some(handle)));
                }
            }));
            let (id, stop_u) = (identity.to_string(), stop.clone());
            server.threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                // A fallback in case shutdown does not wake recv: re-check the flag now and then.
                let _ = udp.set_read_timeout(Some(Duration::from_millis(500)));
                while !stop_u.load(Ordering::SeqCst) {
                    if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(format!("{id} {port} {}", peer.ip()).as_bytes(), peer);
                    }
                }
            }));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for fd in &self.fds {
            wake(*fd);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (stream, handle) in self.connections.lock().unwrap().iter_mut() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

/// For exchanges expected to succeed (or be refused): generous, a loaded machine can be slow to
/// answer. A test that expects a drop gives its own short timeout.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// A TCP connection made from inside a namespace, usable from anywhere.
pub struct Conn {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Conn {
    /// Connects from inside `ns` (only the socket's creation needs the namespace).
    pub fn open(ns: &str, to: SocketAddr, timeout: Duration) -> std::io::Result<Conn> {
        let stream = in_ns(ns, || TcpStream::connect_timeout(&to, timeout))?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        stream.set_write_timeout(Some(TIMEOUT))?;
        Ok(Conn { reader: BufReader::new(stream.try_clone()?), stream })
    }

    /// Asks who is on the other end (again).
    pub fn ask(&mut self) -> std::io::Result<Reply> {
        self.stream.write_all(b"who\n")?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Reply::parse(&line)
    }
}

/// One TCP connection (from a socket already in the right namespace): who answers?
pub fn tcp_ask(to: SocketAddr, timeout: Duration) -> std::io::Result<Reply> {
    let stream = TcpStream::connect_timeout(&to, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut conn = Conn { reader: BufReader::new(stream.try_clone()?), stream };
    conn.ask()
}

/// Source ports of UDP probes, below the kernel's ephemeral range and not reused within a
/// run: a kernel-chosen port can repeat an earlier probe's, and conntrack then still has
/// that flow (a policy enforced after it lets it through as established; seen once in CI).
static NEXT_UDP_SOURCE_PORT: AtomicU16 = AtomicU16::new(0);
const UDP_SOURCE_PORTS: std::ops::Range<u16> = 20_000..30_000;

/// A UDP socket on a source port no earlier probe of this run used.
fn fresh_udp_socket(v6: bool) -> std::io::Result<UdpSocket> {
    let span = UDP_SOURCE_PORTS.end - UDP_SOURCE_PORTS.start;
    for _ in 0..span {
        let port = UDP_SOURCE_PORTS.start + NEXT_UDP_SOURCE_PORT.fetch_add(1, Ordering::Relaxed) % span;
        let bound = if v6 { UdpSocket::bind(("::", port)) } else { UdpSocket::bind(("0.0.0.0", port)) };
        match bound {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            other => return other,
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "every probe source port is in use"))
}

/// One UDP exchange from a fresh socket (a new flow each time): who answers?
pub fn udp_ask(to: SocketAddr, timeout: Duration) -> std::io::Result<Reply> {
    let socket = fresh_udp_socket(to.is_ipv6())?;
    socket.connect(to)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.send(b"who")?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf)?;
    Reply::parse(&String::from_utf8_lossy(&buf[..n]))
}

/// `n` fresh TCP connections from inside `ns`.
pub fn tcp_many(ns: &str, to: SocketAddr, n: usize) -> Vec<std::io::Result<Reply>> {
    in_ns(ns, || (0..n).map(|_| tcp_ask(to, TIMEOUT)).collect())
}

/// `n` fresh UDP flows from inside `ns`.
pub fn udp_many(ns: &str, to: SocketAddr, n: usize) -> Vec<std::io::Result<Reply>> {
    in_ns(ns, || (0..n).map(|_| udp_ask(to, TIMEOUT)).collect())
}
