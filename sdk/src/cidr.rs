//! Minimal CIDR handling for guests (no dependencies, so guests stay small).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address prefix such as `10.244.0.0/16`; a bare address is a full-length prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError(pub String);

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid CIDR {:?}", self.0)
    }
}

impl std::error::Error for CidrError {}

impl FromStr for Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || CidrError(s.to_string());
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| err())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = match len {
            Some(l) => l.parse::<u8>().map_err(|_| err())?,
            None => max,
        };
        if prefix_len > max {
            return Err(err());
        }
        Ok(Cidr { addr, prefix_len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

impl Cidr {
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// Whether `ip` lies inside this prefix (never across address families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        fn masked(bits: u128, len: u8, width: u8) -> u128 {
            if len == 0 { 0 } else { bits >> (width - len) }
        }
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                masked(u32::from(net) as u128, self.prefix_len, 32)
                    == masked(u32::from(ip) as u128, self.prefix_len, 32)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                masked(u128::from(net), self.prefix_len, 128) == masked(u128::from(ip), self.prefix_len, 128)
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_contains() {
        let c: Cidr = "10.244.0.0/16".parse().unwrap();
        assert!(c.contains("10.244.3.4".parse().unwrap()));
        assert!(!c.contains("10.245.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        let host: Cidr = "10.96.0.1".parse().unwrap();
        assert_eq!(host.prefix_len, 32);
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().contains("8.8.8.8".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("banana".parse::<Cidr>().is_err());
    }
}
