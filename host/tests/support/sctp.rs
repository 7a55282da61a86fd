//! SCTP without an SCTP stack: this kernel has no SCTP sockets (no module, no modprobe), but
//! conntrack and NAT handle SCTP on their own. A raw IP socket sends a well-formed INIT
//! (correct CRC32c, so conntrack accepts it as a new association) and another raw socket in
//! the backend pod sees whether it arrived DNATed.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::FromRawFd as _;
use std::time::Duration;

mod sys {
    use std::os::raw::c_int;
    unsafe extern "C" {
        pub fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    }
    pub const AF_INET: c_int = 2;
    pub const SOCK_RAW: c_int = 3;
    pub const SOCK_CLOEXEC: c_int = 0o2000000;
}

pub const IPPROTO_SCTP: i32 = 132;

/// A raw IPv4 socket for SCTP packets, wrapped in a `UdpSocket` for its send/recv/timeout
/// plumbing (raw sockets ignore the port of a destination address). Must be called from a
/// thread inside the namespace it should belong to.
pub fn raw_socket() -> std::io::Result<UdpSocket> {
    // SAFETY: plain syscall; on success we own the returned descriptor.
    let fd = unsafe { sys::socket(sys::AF_INET, sys::SOCK_RAW | sys::SOCK_CLOEXEC, IPPROTO_SCTP) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket descriptor nobody else owns.
    let socket = unsafe { UdpSocket::from_raw_fd(fd) };
    socket.set_read_timeout(Some(Duration::from_millis(200)))?;
    Ok(socket)
}

/// CRC32c (Castagnoli), as SCTP's checksum uses it.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// An SCTP packet holding one INIT chunk.
pub fn init_packet(src_port: u16, dst_port: u16, tag: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&src_port.to_be_bytes());
    p.extend_from_slice(&dst_port.to_be_bytes());
    p.extend_from_slice(&0u32.to_be_bytes()); // verification tag: 0 for INIT
    p.extend_from_slice(&0u32.to_be_bytes()); // checksum, filled below
    p.extend_from_slice(&[1, 0]); // chunk type INIT, flags
    p.extend_from_slice(&20u16.to_be_bytes());
    p.extend_from_slice(&tag.to_be_bytes()); // initiate tag
    p.extend_from_slice(&65535u32.to_be_bytes()); // a_rwnd
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    p.extend_from_slice(&tag.to_be_bytes()); // initial TSN
    let crc = crc32c(&p);
    // SCTP stores the CRC32c little-endian (RFC 4960, appendix B).
    p[8..12].copy_from_slice(&crc.to_le_bytes());
    p
}

/// An SCTP INIT as a raw socket received it (IP header included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenInit {
    pub source: Ipv4Addr,
    pub destination: Ipv4Addr,
    pub src_port: u16,
    pub dst_port: u16,
}

pub fn parse_received(packet: &[u8]) -> Option<SeenInit> {
    let ihl = (*packet.first()? & 0x0f) as usize * 4;
    let sctp = packet.get(ihl..)?;
    if packet.get(9) != Some(&(IPPROTO_SCTP as u8)) || sctp.len() < 16 || sctp[12] != 1 {
        return None;
    }
    Some(SeenInit {
        source: Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]),
        destination: Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]),
        src_port: u16::from_be_bytes([sctp[0], sctp[1]]),
        dst_port: u16::from_be_bytes([sctp[2], sctp[3]]),
    })
}

pub fn send_init(socket: &UdpSocket, to: Ipv4Addr, src_port: u16, dst_port: u16) -> std::io::Result<()> {
    socket.send_to(&init_packet(src_port, dst_port, 0x1234_5678), SocketAddr::from((to, 0))).map(|_| ())
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_check_value() {
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
    }
}
