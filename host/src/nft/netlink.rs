//! The incremental path's kernel interface: an incremental transaction's statements encoded
//! as one nf_tables netlink batch, sent on a socket the writer keeps open.
//!
//! Why: `nft -f` fills its cache before it evaluates any `add rule` or `add element`, and
//! that fill dumps every chain of the table (superlinear in the kernel's chain dump): a
//! one-service change cost 28 ms at 1k services and 1.9 s at 50k, > 93% of it in `nft`.
//! The kernel itself needs no cache: chains, sets and jump targets are resolved by name
//! inside the batch. Sending only the batch removes nft's share (a one-service change at
//! 50k services: 4.7 s through `nft -f`, 0.52 s as a batch); what remains is the kernel's
//! commit, which is not constant either (see `nft.rs`).
//!
//! Scope: exactly the statements [`super::object_delta`] renders (add/flush/delete chain,
//! add rule in the guest rule vocabulary, add/delete element, add/delete set of addresses),
//! and the elements of the host's firewall ranges and host port maps. Anything else (the skeleton, other
//! interval sets, a rule outside the vocabulary) is [`Unsupported`], and the caller sends
//! the whole transaction through `nft -f` instead, so one transaction is always applied by
//! one mechanism, atomically. Full syncs stay text: they are kernel-bound
//! and cost the same either way (see `nft.rs`).
//!
//! The bytecode mirrors what nft 1.0.6 generates for the same text (`nft --debug=netlink`),
//! so `nft list` prints our rules exactly as if nft had written them; the tests compare
//! the listings of both paths. No crate here encodes numgen, fib, dynset and verdict-map
//! elements (nftnl, rustables), and the wire format is the kernel's UAPI
//! (`linux/netfilter/nf_tables.h`), so it is encoded here, attribute by attribute.

use std::net::IpAddr;

use super::{FAMILY, is_our_table};

/// A statement outside what this encoder covers (the transaction then goes through nft).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("not encoded as netlink: {reason} in {statement:?}")]
pub struct Unsupported {
    pub statement: String,
    pub reason: String,
}

// nfnetlink / nf_tables UAPI constants.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_DELSET: u16 = 11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFPROTO_INET: u8 = 1;
const NFPROTO_IPV4: u32 = 2;
const NFPROTO_IPV6: u32 = 10;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_APPEND: u16 = 0x800;
const NLM_F_CREATE: u16 = 0x400;
const NLA_F_NESTED: u16 = 0x8000;

const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;

const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;

/// Netlink's 4-byte alignment of messages and attributes.
fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// A growing netlink buffer: messages and (nested) attributes, lengths patched on close.
#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn begin_message(&mut self, msg_type: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by end_message
        self.buf.extend_from_slice(&msg_type.to_ne_bytes());
        self.buf.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        // struct nfgenmsg
        self.buf.push(family);
        self.buf.push(0); // NFNETLINK_V0
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        start
    }

    fn end_message(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align(self.buf.len()), 0);
    }

    fn attr_str(&mut self, ty: u16, s: &str) {
        let mut data = Vec::with_capacity(s.len() + 1);
        data.extend_from_slice(s.as_bytes());
        data.push(0);
        self.attr(ty, &data);
    }

    /// nf_tables integers are big endian on the wire.
    fn attr_u32(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_be_bytes());
    }

    fn attr_u64(&mut self, ty: u16, v: u64) {
        self.attr(ty, &v.to_be_bytes());
    }

    fn nest(&mut self, ty: u16, body: impl FnOnce(&mut Writer)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        body(self);
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    /// `NFTA_DATA_VALUE` inside a nest of type `ty`.
    fn data_value(&mut self, ty: u16, value: &[u8]) {
        self.nest(ty, |w| w.attr(1, value));
    }

    /// `NFTA_DATA_VERDICT` inside a nest of type `ty`.
    fn data_verdict(&mut self, ty: u16, verdict: &Verdict) {
        self.nest(ty, |w| {
            w.nest(2, |w| {
                w.attr(1, &verdict.code.to_be_bytes());
                if let Some(chain) = &verdict.chain {
                    w.attr_str(2, chain);
                }
            })
        });
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Verdict {
    code: i32,
    chain: Option<String>,
}

/// One nf_tables expression, as nft 1.0.6 would generate it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expr {
    Meta {
        key: u32,
    },
    Payload {
        base: u32,
        offset: u32,
        len: u32,
    },
    Cmp {
        op: u32,
        data: Vec<u8>,
    },
    Bitwise {
        len: u32,
        mask: Vec<u8>,
    },
    CtState,
    FibDaddrType,
    Numgen {
        modulus: u32,
    },
    /// `invert`: `!= @set` (`NFT_LOOKUP_F_INV`).
    Lookup {
        set: String,
        invert: bool,
    },
    /// `update @set { key [timeout Ns] [limit …] }`: `limit` meters each key on its own
    /// (a stateful expression per element, as `meter` rules are).
    Dynset {
        set: String,
        timeout_ms: Option<u64>,
        limit: Option<Box<Expr>>,
    },
    Counter,
    /// `group`: to the NFLOG group (a listener reads it), else to the kernel log.
    Log {
        prefix: String,
        group: Option<u16>,
    },
    /// `limit rate N/second burst M packets`: the rule stops here above the rate.
    Limit {
        per_second: u64,
        burst: u32,
    },
    Immediate {
        reg: u32,
        data: Vec<u8>,
    },
    Verdict(Verdict),
    Dnat {
        family: u32,
    },
    Reject {
        kind: u32,
        code: u8,
    },
}

const META_IIFNAME: u32 = 6;
const META_NFPROTO: u32 = 15;
const META_L4PROTO: u32 = 16;
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const CMP_LTE: u32 = 3;
const CMP_GTE: u32 = 5;

impl Expr {
    /// `NFTA_LIST_ELEM { NFTA_EXPR_NAME, NFTA_EXPR_DATA }`.
    fn encode(&self, w: &mut Writer) {
        w.nest(1, |w| {
            w.attr_str(1, self.name());
            w.nest(2, |w| self.encode_data(w));
        });
    }

    fn name(&self) -> &'static str {
        match self {
            Expr::Meta { .. } => "meta",
            Expr::Payload { .. } => "payload",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::CtState => "ct",
            Expr::FibDaddrType => "fib",
            Expr::Numgen { .. } => "numgen",
            Expr::Lookup { .. } => "lookup",
            Expr::Dynset { .. } => "dynset",
            Expr::Counter => "counter",
            Expr::Log { .. } => "log",
            Expr::Limit { .. } => "limit",
            Expr::Immediate { .. } | Expr::Verdict(_) => "immediate",
            Expr::Dnat { .. } => "nat",
            Expr::Reject { .. } => "reject",
        }
    }

    /// The expression's attributes (`NFTA_<NAME>_*`).
    fn encode_data(&self, w: &mut Writer) {
        match self {
            Expr::Meta { key } => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, *key);
            }
            Expr::Payload { base, offset, len } => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, *base);
                w.attr_u32(3, *offset);
                w.attr_u32(4, *len);
            }
            Expr::Cmp { op, data } => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, *op);
                w.data_value(3, data);
            }
            Expr::Bitwise { len, mask } => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, NFT_REG_1);
                w.attr_u32(3, *len);
                w.data_value(4, mask);
                w.data_value(5, &vec![0; mask.len()]);
            }
            Expr::CtState => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, 0); // NFT_CT_STATE
            }
            Expr::FibDaddrType => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, 3); // NFT_FIB_RESULT_ADDRTYPE
                w.attr_u32(3, 1 << 1); // NFTA_FIB_F_DADDR
            }
            Expr::Numgen { modulus } => {
                w.attr_u32(1, NFT_REG_1);
                w.attr_u32(2, *modulus);
                w.attr_u32(3, 1); // NFT_NG_RANDOM
                w.attr_u32(4, 0);
            }
            Expr::Lookup { set, invert } => {
                w.attr_str(1, set);
                w.attr_u32(2, NFT_REG_1);
                // As nft: the flags only when inverted.
                if *invert {
                    w.attr_u32(5, 1); // NFTA_LOOKUP_FLAGS: NFT_LOOKUP_F_INV
                }
            }
            Expr::Dynset { set, timeout_ms, limit } => {
                w.attr_str(1, set);
                w.attr_u32(3, 1); // NFT_DYNSET_OP_UPDATE
                w.attr_u32(4, NFT_REG_1);
                if let Some(ms) = timeout_ms {
                    w.attr_u64(6, *ms);
                }
                // NFTA_DYNSET_EXPR: one expression, its name and data without a list element.
                if let Some(expr) = limit {
                    w.nest(7, |w| {
                        w.attr_str(1, expr.name());
                        w.nest(2, |w| expr.encode_data(w));
                    });
                }
            }
            Expr::Counter => {
                w.attr_u64(1, 0);
                w.attr_u64(2, 0);
            }
            Expr::Log { prefix, group } => {
                if let Some(group) = group {
                    w.attr(1, &group.to_be_bytes()); // NFTA_LOG_GROUP
                }
                w.attr_str(2, prefix);
            }
            Expr::Limit { per_second, burst } => {
                w.attr_u64(1, *per_second); // NFTA_LIMIT_RATE
                w.attr_u64(2, 1); // NFTA_LIMIT_UNIT: seconds
                w.attr_u32(3, *burst); // NFTA_LIMIT_BURST
                w.attr_u32(4, 0); // NFTA_LIMIT_TYPE: NFT_LIMIT_PKTS
                w.attr_u32(5, 0); // NFTA_LIMIT_FLAGS: not inverted
            }
            Expr::Immediate { reg, data } => {
                w.attr_u32(1, *reg);
                w.data_value(2, data);
            }
            Expr::Verdict(v) => {
                w.attr_u32(1, NFT_REG_VERDICT);
                w.data_verdict(2, v);
            }
            Expr::Dnat { family } => {
                w.attr_u32(1, 1); // NFT_NAT_DNAT
                w.attr_u32(2, *family);
                w.attr_u32(3, NFT_REG_1);
                w.attr_u32(5, NFT_REG_2);
                w.attr_u32(7, 0x2); // NF_NAT_RANGE_PROTO_SPECIFIED
            }
            Expr::Reject { kind, code } => {
                w.attr_u32(1, *kind);
                w.attr(2, &[*code]);
            }
        }
    }
}

/// Splits a statement into words, a double-quoted string being one word (quotes removed).
/// Our renderer never puts a quote inside a quoted string.
fn words(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').ok_or("unterminated string")?;
            out.push(quoted[..end].to_string());
            rest = quoted[end + 1..].trim_start();
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = rest[end..].trim_start();
        }
    }
    Ok(out)
}

fn ip_bytes(addr: &IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The bytes nft compares an interface name with: a prefix (`veth*`) by its own bytes only,
/// a name by all of `IFNAMSIZ`, NUL padded. Names the host would not render (see
/// [`super::PodTraffic::interface_name_problem`]: those nft escapes, refuses, or reads as a
/// wildcard other than a trailing one) are refused here (nft -f then decides).
fn interface_name_bytes(value: &str) -> Result<Vec<u8>, String> {
    const IFNAMSIZ: usize = 16;
    let (name, prefix) = match value.strip_suffix('*') {
        Some(name) => (name, true),
        None => (value, false),
    };
    if let Some(why) = super::PodTraffic::interface_name_problem(name, prefix) {
        return Err(format!("interface name {value:?}: {why}"));
    }
    let mut bytes = name.as_bytes().to_vec();
    if !prefix {
        bytes.resize(IFNAMSIZ, 0);
    }
    Ok(bytes)
}

fn protocol_number(name: &str) -> Option<u8> {
    match name {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    }
}

/// A rule in the guest vocabulary (`nft.rs`'s `Validator::rule`, the policy dispatch rules)
/// as expressions, and its comment.
struct RuleCompiler {
    exprs: Vec<Expr>,
    /// The network protocol the rule already checked (`meta nfproto`), as nft tracks it.
    context: Option<u32>,
}

impl RuleCompiler {
    fn require_family(&mut self, family: u32) {
        if self.context != Some(family) {
            self.exprs.push(Expr::Meta { key: META_NFPROTO });
            self.exprs.push(Expr::Cmp { op: CMP_EQ, data: vec![family as u8] });
            self.context = Some(family);
        }
    }

    /// `ip|ip6 saddr|daddr` into register 1: the load of `len` bytes of the address.
    fn load_address(&mut self, family_word: &str, direction: &str, len: Option<u32>) -> Result<u32, String> {
        let (family, width, saddr_offset, daddr_offset) = match family_word {
            "ip" => (NFPROTO_IPV4, 4, 12, 16),
            "ip6" => (NFPROTO_IPV6, 16, 8, 24),
            other => return Err(format!("address family {other:?}")),
        };
        let offset = match direction {
            "saddr" => saddr_offset,
            "daddr" => daddr_offset,
            other => return Err(format!("address field {other:?}")),
        };
        self.require_family(family);
        self.exprs.push(Expr::Payload { base: PAYLOAD_NETWORK, offset, len: len.unwrap_or(width) });
        Ok(family)
    }

    fn compile(rule: &str) -> Result<(Vec<Expr>, Option<String>), String> {
        let words = words(rule)?;
        let mut c = RuleCompiler { exprs: Vec::new(), context: None };
        let mut comment = None;
        let mut i = 0;
        let word = |i: usize| words.get(i).map(String::as_str).ok_or_else(|| "rule ends early".to_string());
        while i < words.len() {
            match word(i)? {
                fam @ ("ip" | "ip6") => {
                    let direction = word(i + 1)?;
                    let mut value = word(i + 2)?;
                    let negate = value == "!=";
                    if negate {
                        value = word(i + 3)?;
                    }
                    i += if negate { 4 } else { 3 };
                    if let Some(set) = value.strip_prefix('@') {
                        c.load_address(fam, direction, None)?;
                        c.exprs.push(Expr::Lookup { set: set.to_string(), invert: negate });
                        continue;
                    }
                    let (addr, prefix) = match value.split_once('/') {
                        Some((a, p)) => (
                            a.parse::<IpAddr>().map_err(|e| e.to_string())?,
                            Some(p.parse::<u32>().map_err(|e| e.to_string())?),
                        ),
                        None => (value.parse::<IpAddr>().map_err(|e| e.to_string())?, None),
                    };
                    if (fam == "ip") != addr.is_ipv4() {
                        return Err(format!("{value} is not an {fam} address"));
                    }
                    let bytes = ip_bytes(&addr);
                    let width = bytes.len() as u32 * 8;
                    let op = if negate { CMP_NEQ } else { CMP_EQ };
                    match prefix {
                        Some(p) if p > width => return Err(format!("prefix /{p}")),
                        // A byte-aligned prefix loads only its bytes; others mask the address.
                        Some(p) if p % 8 == 0 && p > 0 => {
                            c.load_address(fam, direction, Some(p / 8))?;
                            c.exprs.push(Expr::Cmp { op, data: bytes[..(p / 8) as usize].to_vec() });
                        }
                        Some(p) if p < width => {
                            c.load_address(fam, direction, None)?;
                            let mask: Vec<u8> = (0..bytes.len() as u32)
                                .map(|b| {
                                    let bits = p.saturating_sub(b * 8).min(8);
                                    if bits == 0 { 0 } else { 0xffu8 << (8 - bits) }
                                })
                                .collect();
                            let masked: Vec<u8> = bytes.iter().zip(&mask).map(|(a, m)| a & m).collect();
                            c.exprs.push(Expr::Bitwise { len: bytes.len() as u32, mask });
                            c.exprs.push(Expr::Cmp { op, data: masked });
                        }
                        _ => {
                            c.load_address(fam, direction, None)?;
                            c.exprs.push(Expr::Cmp { op, data: bytes });
                        }
                    }
                }
                "iifname" => {
                    // `iifname ["!="] "NAME"` or `"PREFIX*"` (the pod-traffic match by interface).
                    let mut value = word(i + 1)?;
                    let negate = value == "!=";
                    if negate {
                        value = word(i + 2)?;
                    }
                    i += if negate { 3 } else { 2 };
                    c.exprs.push(Expr::Meta { key: META_IIFNAME });
                    c.exprs.push(Expr::Cmp {
                        op: if negate { CMP_NEQ } else { CMP_EQ },
                        data: interface_name_bytes(value)?,
                    });
                }
                "meta" if word(i + 1)? == "l4proto" => {
                    let proto = protocol_number(word(i + 2)?).ok_or("unknown protocol")?;
                    c.exprs.push(Expr::Meta { key: META_L4PROTO });
                    c.exprs.push(Expr::Cmp { op: CMP_EQ, data: vec![proto] });
                    i += 3;
                }
                "th" if word(i + 1)? == "dport" => {
                    let ports = word(i + 2)?;
                    c.exprs.push(Expr::Payload { base: PAYLOAD_TRANSPORT, offset: 2, len: 2 });
                    let port = |p: &str| p.parse::<u16>().map(|p| p.to_be_bytes().to_vec()).map_err(|e| e.to_string());
                    match ports.split_once('-') {
                        Some((a, b)) => {
                            c.exprs.push(Expr::Cmp { op: CMP_GTE, data: port(a)? });
                            c.exprs.push(Expr::Cmp { op: CMP_LTE, data: port(b)? });
                        }
                        None => c.exprs.push(Expr::Cmp { op: CMP_EQ, data: port(ports)? }),
                    }
                    i += 3;
                }
                "fib" if words[i..].starts_with(&["fib".into(), "daddr".into(), "type".into(), "local".into()]) => {
                    c.exprs.push(Expr::FibDaddrType);
                    c.exprs.push(Expr::Cmp { op: CMP_EQ, data: 2u32.to_ne_bytes().to_vec() }); // RTN_LOCAL
                    i += 4;
                }
                "ct" if word(i + 1)? == "state" && word(i + 2)? == "established,related" => {
                    c.exprs.push(Expr::CtState);
                    // IP_CT_ESTABLISHED and IP_CT_RELATED bits of the state bitmask.
                    c.exprs.push(Expr::Bitwise { len: 4, mask: 6u32.to_ne_bytes().to_vec() });
                    c.exprs.push(Expr::Cmp { op: CMP_NEQ, data: vec![0; 4] });
                    i += 3;
                }
                "numgen" if word(i + 1)? == "random" && word(i + 2)? == "mod" && word(i + 4)? == "==" => {
                    let modulus: u32 = word(i + 3)?.parse().map_err(|_| "numgen modulus")?;
                    let value: u32 = word(i + 5)?.parse().map_err(|_| "numgen value")?;
                    c.exprs.push(Expr::Numgen { modulus });
                    c.exprs.push(Expr::Cmp { op: CMP_EQ, data: value.to_ne_bytes().to_vec() });
                    i += 6;
                }
                "counter" => {
                    c.exprs.push(Expr::Counter);
                    i += 1;
                }
                "log" if word(i + 1)? == "prefix" => {
                    c.exprs.push(Expr::Log { prefix: word(i + 2)?.to_string(), group: None });
                    i += 3;
                }
                "log" if word(i + 1)? == "group" && word(i + 3)? == "prefix" => {
                    let group: u16 = word(i + 2)?.parse().map_err(|_| "log group")?;
                    c.exprs.push(Expr::Log { prefix: word(i + 4)?.to_string(), group: Some(group) });
                    i += 5;
                }
                "limit" => {
                    c.exprs.push(parse_limit(&words[i..])?);
                    i += 6;
                }
                "dnat" if word(i + 2)? == "to" => {
                    let target = word(i + 3)?;
                    let (family, addr, port) = match word(i + 1)? {
                        "ip" => {
                            let (a, p) = target.rsplit_once(':').ok_or("dnat target without port")?;
                            (NFPROTO_IPV4, a.parse::<std::net::Ipv4Addr>().map_err(|e| e.to_string())?.into(), p)
                        }
                        "ip6" => {
                            let (a, p) =
                                target.strip_prefix('[').and_then(|t| t.split_once("]:")).ok_or("dnat ip6 target")?;
                            (NFPROTO_IPV6, a.parse::<std::net::Ipv6Addr>().map_err(|e| e.to_string())?.into(), p)
                        }
                        other => return Err(format!("dnat family {other:?}")),
                    };
                    let port: u16 = port.parse().map_err(|_| "dnat port")?;
                    c.exprs.push(Expr::Immediate { reg: NFT_REG_1, data: ip_bytes(&addr) });
                    c.exprs.push(Expr::Immediate { reg: NFT_REG_2, data: port.to_be_bytes().to_vec() });
                    c.exprs.push(Expr::Dnat { family });
                    i += 4;
                }
                "update" => {
                    // update @SET { ip|ip6 saddr|daddr [timeout Ns] [limit rate N/second burst M packets] }
                    let set = word(i + 1)?.strip_prefix('@').ok_or("update without @set")?.to_string();
                    if word(i + 2)? != "{" {
                        return Err("update without {".into());
                    }
                    c.load_address(word(i + 3)?, word(i + 4)?, None)?;
                    let mut j = i + 5;
                    let mut timeout_ms = None;
                    if word(j)? == "timeout" {
                        let t = word(j + 1)?;
                        let secs: u64 = t.strip_suffix('s').and_then(|s| s.parse().ok()).ok_or("timeout")?;
                        timeout_ms = Some(secs * 1000);
                        j += 2;
                    }
                    let mut limit = None;
                    if word(j)? == "limit" {
                        limit = Some(Box::new(parse_limit(&words[j..])?));
                        j += 6;
                    }
                    if word(j)? != "}" {
                        return Err("update without }".into());
                    }
                    c.exprs.push(Expr::Dynset { set, timeout_ms, limit });
                    i = j + 1;
                }
                "comment" => {
                    comment = Some(word(i + 1)?.to_string());
                    i += 2;
                }
                "reject" => {
                    // As nft: ICMP port unreachable of the family the rule matched, else
                    // ICMPX (the inet family's family-independent code).
                    c.exprs.push(match c.context {
                        Some(NFPROTO_IPV4) => Expr::Reject { kind: 0, code: 3 },
                        Some(NFPROTO_IPV6) => Expr::Reject { kind: 0, code: 4 },
                        _ => Expr::Reject { kind: 2, code: 1 },
                    });
                    i += 1;
                }
                verdict @ ("accept" | "drop" | "return" | "jump" | "goto") => {
                    let (code, chain) = match verdict {
                        "accept" => (NF_ACCEPT, None),
                        "drop" => (NF_DROP, None),
                        "return" => (NFT_RETURN, None),
                        "jump" => (NFT_JUMP, Some(word(i + 1)?.to_string())),
                        _ => (NFT_GOTO, Some(word(i + 1)?.to_string())),
                    };
                    i += if chain.is_some() { 2 } else { 1 };
                    c.exprs.push(Expr::Verdict(Verdict { code, chain }));
                }
                other => return Err(format!("unknown word {other:?}")),
            }
        }
        Ok((c.exprs, comment))
    }
}

/// `limit rate N/second burst M packets` at the start of `words` (six of them).
fn parse_limit(words: &[String]) -> Result<Expr, String> {
    let word = |i: usize| words.get(i).map(String::as_str).ok_or_else(|| "limit ends early".to_string());
    if word(1)? != "rate" || word(3)? != "burst" || word(5)? != "packets" {
        return Err(format!("limit {:?}", words.iter().take(6).collect::<Vec<_>>()));
    }
    let per_second: u64 = word(2)?.strip_suffix("/second").and_then(|r| r.parse().ok()).ok_or("limit rate")?;
    let burst: u32 = word(4)?.parse().map_err(|_| "limit burst")?;
    Ok(Expr::Limit { per_second, burst })
}

fn parse_verdict(text: &str) -> Result<Verdict, String> {
    let mut it = text.split_whitespace();
    let code = match it.next() {
        Some("accept") => NF_ACCEPT,
        Some("drop") => NF_DROP,
        Some("return") => NFT_RETURN,
        Some("jump") => NFT_JUMP,
        Some("goto") => NFT_GOTO,
        other => return Err(format!("verdict {other:?}")),
    };
    let chain = it.next().map(str::to_string);
    if (code == NFT_JUMP || code == NFT_GOTO) != chain.is_some() || it.next().is_some() {
        return Err(format!("verdict {text:?}"));
    }
    Ok(Verdict { code, chain })
}

/// A set element key as the kernel stores it: an address, or a concatenation whose
/// fields each take a multiple of 4 bytes (address . protocol . port).
fn element_key(text: &str) -> Result<Vec<u8>, String> {
    let parts: Vec<&str> = text.split(" . ").map(str::trim).collect();
    if let [single] = parts.as_slice() {
        return single.parse::<IpAddr>().map(|a| ip_bytes(&a)).map_err(|_| format!("key {single:?}"));
    }
    let mut key = Vec::new();
    for part in parts {
        if let Ok(addr) = part.parse::<IpAddr>() {
            key.extend(ip_bytes(&addr));
        } else if let Some(proto) = protocol_number(part) {
            key.extend([proto, 0, 0, 0]);
        } else if let Ok(port) = part.parse::<u16>() {
            key.extend(port.to_be_bytes());
            key.extend([0, 0]);
        } else {
            return Err(format!("key part {part:?}"));
        }
    }
    Ok(key)
}

/// An element of a concatenated interval set ([`super::is_range_set`]): its first key and
/// its last, the ranged part last (`address . protocol . port . network`). nft sends both
/// for every element of such a set, a single address too.
fn range_keys(text: &str) -> Result<(Vec<u8>, Vec<u8>), String> {
    let (front, range) = text.rsplit_once(" . ").ok_or_else(|| format!("range key {text:?}"))?;
    let mut first = element_key(front)?;
    let mut last = first.clone();
    let net = match range.trim().parse::<ipnet::IpNet>() {
        Ok(net) => net,
        Err(_) => range.trim().parse::<IpAddr>().map(ipnet::IpNet::from).map_err(|_| format!("range {range:?}"))?,
    };
    first.extend(ip_bytes(&net.network()));
    last.extend(ip_bytes(&net.broadcast()));
    Ok((first, last))
}

/// What an element maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ElementValue {
    Verdict(Verdict),
    /// A data map's value (`address . port` in the endpoint maps).
    Data(Vec<u8>),
}

/// The endpoint maps: keys end in a `numgen` value (a host-order u32), values are data.
/// Returns how many parts their keys have (frontend parts and the number).
fn endpoint_map_key_parts(set: &str) -> Option<usize> {
    match set {
        "service-endpoints" | "service-endpoints6" => Some(4),
        "nodeport-endpoints" | "nodeport-endpoints6" => Some(3),
        _ => None,
    }
}

/// A set or map element: its key's bytes, the last key of a range, and, in a map, its value.
#[derive(Debug, PartialEq, Eq)]
struct Element {
    key: Vec<u8>,
    key_end: Option<Vec<u8>>,
    value: Option<ElementValue>,
}

/// The elements between `{` and `}` of `set`: `key [: verdict or data]`, comma separated.
fn parse_elements(set: &str, body: &str) -> Result<Vec<Element>, String> {
    body.split(',')
        .map(|element| {
            let (key, value) = match element.split_once(" : ") {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (element.trim(), None),
            };
            if super::is_range_set(set) {
                let (key, key_end) = range_keys(key)?;
                return Ok(Element { key, key_end: Some(key_end), value: None });
            }
            if super::is_hostport_map(set) {
                // `[address .] protocol . port : address . port`, both concatenations.
                let data = value.map(element_key).transpose()?.filter(|d| d.len() == 8 || d.len() == 20);
                if value.is_some() && data.is_none() {
                    return Err(format!("host port target {value:?} is not address . port"));
                }
                return Ok(Element { key: element_key(key)?, key_end: None, value: data.map(ElementValue::Data) });
            }
            let Some(parts) = endpoint_map_key_parts(set) else {
                return Ok(Element {
                    key: element_key(key)?,
                    key_end: None,
                    value: value.map(parse_verdict).transpose()?.map(ElementValue::Verdict),
                });
            };
            // [address .] protocol . port . number
            let (front, index) = key
                .rsplit_once(" . ")
                .filter(|_| key.split(" . ").count() == parts)
                .ok_or_else(|| format!("endpoint key {key:?} is not frontend . number"))?;
            let mut bytes = element_key(front)?;
            bytes.extend(index.trim().parse::<u32>().map_err(|_| format!("endpoint number {index:?}"))?.to_ne_bytes());
            Ok(Element {
                key: bytes,
                key_end: None,
                value: value.map(element_key).transpose()?.map(ElementValue::Data),
            })
        })
        .collect()
}

/// Adds (`NFT_MSG_NEWSETELEM`, with their verdicts) or deletes elements of one set or map.
fn encode_elements(w: &mut Writer, msg: u16, seq: u32, table: &str, set: &str, elements: &[Element]) {
    let adding = msg == NFT_MSG_NEWSETELEM;
    let m =
        w.begin_message((NFNL_SUBSYS_NFTABLES << 8) | msg, if adding { NLM_F_CREATE } else { 0 }, seq, NFPROTO_INET, 0);
    w.attr_str(1, table);
    w.attr_str(2, set);
    w.nest(3, |w| {
        for Element { key, key_end, value } in elements {
            w.nest(1, |w| {
                w.data_value(1, key);
                if let Some(end) = key_end {
                    w.data_value(10, end); // NFTA_SET_ELEM_KEY_END
                }
                match (value, adding) {
                    (Some(ElementValue::Verdict(v)), true) => w.data_verdict(2, v),
                    (Some(ElementValue::Data(data)), true) => w.data_value(2, data),
                    _ => {}
                }
            });
        }
    });
    w.end_message(m);
}

/// The set declarations objects use: addresses, optionally dynamic (updated from the
/// packet path) with a default timeout.
struct SetDeclaration {
    flags: u32,
    key_type: u32,
    key_len: u32,
    timeout_ms: Option<u64>,
}

impl SetDeclaration {
    fn parse(text: &str) -> Result<SetDeclaration, String> {
        const NFT_SET_TIMEOUT: u32 = 0x10;
        const NFT_SET_EVAL: u32 = 0x20;
        let mut set = SetDeclaration { flags: 0, key_type: 0, key_len: 0, timeout_ms: None };
        for clause in text.split(';').map(str::trim).filter(|c| !c.is_empty()) {
            match clause.split_once(' ') {
                // nft's datatype numbers (TYPE_IPADDR, TYPE_IP6ADDR).
                Some(("type", "ipv4_addr")) => (set.key_type, set.key_len) = (7, 4),
                Some(("type", "ipv6_addr")) => (set.key_type, set.key_len) = (8, 16),
                Some(("flags", flags)) => {
                    for flag in flags.split(',').map(str::trim) {
                        set.flags |= match flag {
                            "dynamic" => NFT_SET_EVAL,
                            "timeout" => NFT_SET_TIMEOUT,
                            other => return Err(format!("set flag {other:?}")),
                        };
                    }
                }
                Some(("timeout", t)) => {
                    let secs: u64 =
                        t.strip_suffix('s').and_then(|s| s.parse().ok()).ok_or_else(|| format!("set timeout {t:?}"))?;
                    set.timeout_ms = Some(secs * 1000);
                }
                _ => return Err(format!("set clause {clause:?}")),
            }
        }
        if set.key_len == 0 {
            return Err("set without a type".into());
        }
        Ok(set)
    }
}

/// An encoded batch and, per message, the statement it came from (to name the statement a
/// kernel error refers to).
pub struct Batch {
    pub bytes: Vec<u8>,
    /// (sequence number, statement line) of every statement's message. No message asks for
    /// an acknowledgement: the kernel processes a batch within the `send`, so an empty
    /// receive queue afterwards means it went in, and each failure comes back as an error
    /// naming its message's sequence number (a failed commit names the batch's first).
    pub messages: Vec<(u32, usize)>,
}

/// Encodes an incremental transaction (one statement per line) as one batch, sequence
/// numbers from `first_seq`.
pub fn encode_transaction(text: &str, first_seq: u32) -> Result<Batch, Unsupported> {
    let family_prefix = format!("{FAMILY} ");
    let mut w = Writer::default();
    let mut seq = first_seq;
    let mut messages = Vec::new();
    let begin = w.begin_message(NFNL_MSG_BATCH_BEGIN, 0, seq, 0, NFNL_SUBSYS_NFTABLES);
    w.end_message(begin);
    for (line_no, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let unsupported = |reason: String| Unsupported { statement: line.chars().take(200).collect(), reason };
        let (verb, rest) = [
            "add chain ",
            "flush chain ",
            "delete chain ",
            "add rule ",
            "add element ",
            "delete element ",
            "delete set ",
            "add set ",
        ]
        .iter()
        .find_map(|verb| line.strip_prefix(verb).map(|rest| (verb.trim_end(), rest)))
        .ok_or_else(|| unsupported("statement kind".into()))?;
        let (table, rest) = rest
            .strip_prefix(&family_prefix)
            .and_then(|rest| rest.split_once(' '))
            .filter(|(table, _)| is_our_table(table))
            .ok_or_else(|| unsupported("another table".into()))?;
        let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
        let tail = tail.trim();
        seq += 1;
        let nft = |msg: u16| (NFNL_SUBSYS_NFTABLES << 8) | msg;
        match verb {
            "add chain" | "flush chain" | "delete chain" | "delete set" => {
                if !tail.is_empty() {
                    return Err(unsupported("chain or set with a body".into()));
                }
                let (msg, flags, name_attr) = match verb {
                    "add chain" => (NFT_MSG_NEWCHAIN, NLM_F_CREATE, 3),
                    // A rule deletion naming only the chain deletes all of its rules.
                    "flush chain" => (NFT_MSG_DELRULE, 0, 2),
                    "delete chain" => (NFT_MSG_DELCHAIN, 0, 3),
                    _ => (NFT_MSG_DELSET, 0, 2),
                };
                let m = w.begin_message(nft(msg), flags, seq, NFPROTO_INET, 0);
                w.attr_str(1, table);
                w.attr_str(name_attr, name);
                w.end_message(m);
            }
            "add set" => {
                let body = tail
                    .strip_prefix('{')
                    .and_then(|b| b.strip_suffix('}'))
                    .ok_or_else(|| unsupported("set body not in braces".into()))?;
                let (declaration, elements) = match body.split_once("elements = {") {
                    Some((d, e)) => {
                        let e = e
                            .trim_end()
                            .strip_suffix(';')
                            .and_then(|e| e.trim_end().strip_suffix('}'))
                            .ok_or_else(|| unsupported("elements".into()))?;
                        (d, Some(parse_elements(name, e.trim()).map_err(unsupported)?))
                    }
                    None => (body, None),
                };
                let set = SetDeclaration::parse(declaration).map_err(unsupported)?;
                let m = w.begin_message(nft(NFT_MSG_NEWSET), NLM_F_CREATE, seq, NFPROTO_INET, 0);
                w.attr_str(1, table);
                w.attr_str(2, name);
                w.attr_u32(3, set.flags);
                w.attr_u32(4, set.key_type);
                w.attr_u32(5, set.key_len);
                w.attr_u32(10, seq); // NFTA_SET_ID: unique within the batch
                if let Some(ms) = set.timeout_ms {
                    w.attr_u64(11, ms);
                }
                // libnftnl's set userdata: key byte order (NFTNL_UDATA_SET_KEYBYTEORDER) big
                // endian, as nft records it (its listing reads it back).
                let mut udata = vec![0u8, 4];
                udata.extend(2u32.to_ne_bytes());
                w.attr(13, &udata);
                w.end_message(m);
                if let Some(elements) = elements.filter(|e| !e.is_empty()) {
                    messages.push((seq, line_no));
                    seq += 1;
                    encode_elements(&mut w, NFT_MSG_NEWSETELEM, seq, table, name, &elements);
                }
            }
            "add rule" => {
                let (exprs, comment) = RuleCompiler::compile(tail).map_err(unsupported)?;
                let m = w.begin_message(nft(NFT_MSG_NEWRULE), NLM_F_CREATE | NLM_F_APPEND, seq, NFPROTO_INET, 0);
                w.attr_str(1, table);
                w.attr_str(2, name);
                w.nest(4, |w| exprs.iter().for_each(|e| e.encode(w)));
                if let Some(comment) = comment {
                    // libnftnl's rule userdata: a TLV of type NFTNL_UDATA_RULE_COMMENT (0).
                    let mut udata = vec![0u8, (comment.len() + 1).min(255) as u8];
                    udata.extend(comment.bytes().take(254));
                    udata.push(0);
                    w.attr(7, &udata);
                }
                w.end_message(m);
            }
            _ => {
                let body = tail
                    .strip_prefix('{')
                    .and_then(|b| b.strip_suffix('}'))
                    .ok_or_else(|| unsupported("elements not in braces".into()))?;
                let elements = parse_elements(name, body.trim()).map_err(unsupported)?;
                encode_elements(
                    &mut w,
                    if verb == "add element" { NFT_MSG_NEWSETELEM } else { NFT_MSG_DELSETELEM },
                    seq,
                    table,
                    name,
                    &elements,
                );
            }
        }
        messages.push((seq, line_no));
    }
    seq += 1;
    let end = w.begin_message(NFNL_MSG_BATCH_END, 0, seq, 0, NFNL_SUBSYS_NFTABLES);
    w.end_message(end);
    Ok(Batch { bytes: w.buf, messages })
}

// Listing (dumps): what the writer needs to reconcile, without nft.
pub const NFT_MSG_GETCHAIN: u16 = 4;
pub const NFT_MSG_GETSET: u16 = 10;
/// The table attribute, the same number for chains and sets.
pub const NFTA_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFT_SET_ANONYMOUS: u32 = 0x1;
pub const NFT_SET_MAP: u32 = 0x8;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// A request for every object of kind `msg` (`NFT_MSG_GETCHAIN`...) of the inet family.
pub fn dump_request(msg: u16, seq: u32) -> Vec<u8> {
    let mut w = Writer::default();
    let m = w.begin_message((NFNL_SUBSYS_NFTABLES << 8) | msg, NLM_F_DUMP, seq, NFPROTO_INET, 0);
    w.end_message(m);
    w.buf
}

/// What one received buffer of a dump held (messages of other sequence numbers ignored).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DumpPart {
    /// Each object's attributes.
    pub objects: Vec<Vec<u8>>,
    /// The dump ended (`NLMSG_DONE`).
    pub done: bool,
    /// The ruleset changed while it was dumped: the dump may be incomplete.
    pub interrupted: bool,
    /// The kernel refused the dump (an errno).
    pub error: Option<i32>,
}

/// Parses one received buffer of the dump with sequence number `seq`.
pub fn parse_dump(buf: &[u8], seq: u32) -> DumpPart {
    let read_u16 = |at: usize| u16::from_ne_bytes([buf[at], buf[at + 1]]);
    let read_u32 = |at: usize| u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap());
    let mut part = DumpPart::default();
    let mut offset = 0;
    while offset + 16 <= buf.len() {
        let len = read_u32(offset) as usize;
        if len < 16 || offset + len > buf.len() {
            break;
        }
        let (kind, flags, message_seq) = (read_u16(offset + 4), read_u16(offset + 6), read_u32(offset + 8));
        if message_seq == seq {
            match kind {
                NLMSG_DONE => part.done = true,
                NLMSG_ERROR if len >= 20 => {
                    let code = read_u32(offset + 16) as i32;
                    if code != 0 {
                        part.error = Some(-code);
                    }
                }
                NLMSG_ERROR => part.error = Some(libc::EPROTO),
                _ => {
                    part.interrupted |= flags & NLM_F_DUMP_INTR != 0;
                    // After the header (16 bytes) and struct nfgenmsg (4): attributes.
                    part.objects.push(buf[(offset + 20).min(offset + len)..offset + len].to_vec());
                }
            }
        }
        offset += (len + 3) & !3;
    }
    part
}

/// The value of attribute `wanted` among netlink attributes.
pub fn attribute(mut attributes: &[u8], wanted: u16) -> Option<&[u8]> {
    while attributes.len() >= 4 {
        let len = u16::from_ne_bytes([attributes[0], attributes[1]]) as usize;
        // The top bits are flags (nested, byte order), not part of the type.
        let kind = u16::from_ne_bytes([attributes[2], attributes[3]]) & 0x3fff;
        if len < 4 || len > attributes.len() {
            return None;
        }
        if kind == wanted {
            return Some(&attributes[4..len]);
        }
        attributes = &attributes[((len + 3) & !3).min(attributes.len())..];
    }
    None
}

/// A string attribute (NUL-terminated).
pub fn string_attribute(attributes: &[u8], wanted: u16) -> Option<String> {
    let value = attribute(attributes, wanted)?;
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    std::str::from_utf8(&value[..end]).ok().map(str::to_string)
}

/// A 32-bit attribute (nf_tables sends them big endian).
pub fn u32_attribute(attributes: &[u8], wanted: u16) -> Option<u32> {
    Some(u32::from_be_bytes(attribute(attributes, wanted)?.get(..4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumps_parse_objects_end_and_errors_of_their_own_sequence_only() {
        let chain = |w: &mut Writer, seq: u32, table: &str, name: &str, flags: u16| {
            let m = w.begin_message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN, flags, seq, NFPROTO_INET, 0);
            w.attr_str(NFTA_TABLE, table);
            w.attr_u32(2, 7); // a handle between the two strings
            w.attr_str(NFTA_CHAIN_NAME, name);
            w.end_message(m);
        };
        let mut w = Writer::default();
        chain(&mut w, 5, "wasmplane-s1", "svc/ns/a", 0);
        chain(&mut w, 4, "other", "from-another-request", 0);
        chain(&mut w, 5, "wasmplane", "services", NLM_F_DUMP_INTR);
        let done = w.begin_message(NLMSG_DONE, 0, 5, 0, 0);
        w.end_message(done);
        let part = parse_dump(&w.buf, 5);
        assert!(part.done && part.interrupted && part.error.is_none());
        let names: Vec<(Option<String>, Option<String>)> = part
            .objects
            .iter()
            .map(|a| (string_attribute(a, NFTA_TABLE), string_attribute(a, NFTA_CHAIN_NAME)))
            .collect();
        assert_eq!(
            names,
            vec![
                (Some("wasmplane-s1".into()), Some("svc/ns/a".into())),
                (Some("wasmplane".into()), Some("services".into()))
            ]
        );
        assert_eq!(u32_attribute(&part.objects[0], 2), Some(7));
        assert_eq!(attribute(&part.objects[0], 9), None);

        // An error for our request: its errno (the message carries it negated).
        let mut w = Writer::default();
        let e = w.begin_message(NLMSG_ERROR, 0, 9, 0, 0);
        w.buf.truncate(e + 16);
        w.buf.extend((-2i32).to_ne_bytes());
        w.end_message(e);
        assert_eq!(parse_dump(&w.buf, 9).error, Some(2));
        assert_eq!(parse_dump(&w.buf, 8), DumpPart::default());
        // A request is one message: header and nfgenmsg, the dump flags set.
        let request = dump_request(NFT_MSG_GETSET, 3);
        assert_eq!(request.len(), 20);
        assert_eq!(u16::from_ne_bytes([request[6], request[7]]), NLM_F_DUMP | NLM_F_REQUEST);
    }

    #[test]
    fn rules_compile_like_nft() {
        let (exprs, comment) =
            RuleCompiler::compile("ip saddr != 10.244.16.0/20 counter accept comment \"x y\"").unwrap();
        assert_eq!(comment.as_deref(), Some("x y"));
        assert_eq!(exprs[0], Expr::Meta { key: META_NFPROTO });
        assert_eq!(exprs[2], Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 4 });
        assert_eq!(exprs[3], Expr::Bitwise { len: 4, mask: vec![0xff, 0xff, 0xf0, 0] });
        assert_eq!(exprs[4], Expr::Cmp { op: CMP_NEQ, data: vec![10, 244, 16, 0] });
        // A byte-aligned prefix loads only its bytes; the family is checked once per rule.
        let (exprs, _) = RuleCompiler::compile("ip saddr 10.244.0.0/16 ip daddr 10.96.0.1 accept").unwrap();
        assert_eq!(exprs.iter().filter(|e| **e == Expr::Meta { key: META_NFPROTO }).count(), 1);
        assert!(exprs.contains(&Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 2 }));
        // reject follows the family the rule matched.
        let (exprs, _) = RuleCompiler::compile("ip6 saddr @s reject").unwrap();
        assert_eq!(exprs.last(), Some(&Expr::Reject { kind: 0, code: 4 }));
        let (exprs, _) = RuleCompiler::compile("reject").unwrap();
        assert_eq!(exprs, vec![Expr::Reject { kind: 2, code: 1 }]);
    }

    /// The pod-traffic matches (`nft::PodTraffic::render`), as `nft --debug=netlink` 1.0.6
    /// shows them: a lookup inverted by its flags, no family check for an interface name, a
    /// prefix compared by its bytes only, a name by all 16, NUL padded.
    #[test]
    fn pod_traffic_matches_compile_like_nft() {
        let compiled = |rule: &str| RuleCompiler::compile(rule).unwrap_or_else(|e| panic!("{rule}: {e}")).0;
        let accept = Expr::Verdict(Verdict { code: NF_ACCEPT, chain: None });
        let family = |f: u8| [Expr::Meta { key: META_NFPROTO }, Expr::Cmp { op: CMP_EQ, data: vec![f] }];
        let v4 = Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 4 };
        let v6 = Expr::Payload { base: PAYLOAD_NETWORK, offset: 8, len: 16 };
        let lookup = |set: &str, invert| Expr::Lookup { set: set.into(), invert };
        assert_eq!(
            compiled("ip saddr @cluster-cidrs accept"),
            [&family(2)[..], &[v4.clone(), lookup("cluster-cidrs", false), accept.clone()]].concat()
        );
        assert_eq!(
            compiled("ip saddr != @cluster-cidrs accept"),
            [&family(2)[..], &[v4, lookup("cluster-cidrs", true), accept.clone()]].concat()
        );
        assert_eq!(
            compiled("ip6 saddr != @cluster-cidrs6 accept"),
            [&family(10)[..], &[v6, lookup("cluster-cidrs6", true), accept.clone()]].concat()
        );
        let iifname = |op, data: &[u8]| {
            vec![Expr::Meta { key: META_IIFNAME }, Expr::Cmp { op, data: data.to_vec() }, accept.clone()]
        };
        assert_eq!(compiled("iifname \"veth*\" accept"), iifname(CMP_EQ, b"veth"));
        assert_eq!(compiled("iifname != \"veth*\" accept"), iifname(CMP_NEQ, b"veth"));
        assert_eq!(compiled("iifname \"eth*\" accept"), iifname(CMP_EQ, b"eth"));
        let cbr0 = *b"cbr0\0\0\0\0\0\0\0\0\0\0\0\0";
        assert_eq!(compiled("iifname \"cbr0\" accept"), iifname(CMP_EQ, &cbr0));
        assert_eq!(compiled("iifname != \"cbr0\" accept"), iifname(CMP_NEQ, &cbr0));
        assert_eq!(
            compiled("iifname \"abcdefghijklmn*\" accept")[1],
            Expr::Cmp { op: CMP_EQ, data: b"abcdefghijklmn".to_vec() },
            "the longest prefix nft takes"
        );
        assert_eq!(
            compiled("iifname \"abcdefghijklmno\" accept")[1],
            Expr::Cmp { op: CMP_EQ, data: b"abcdefghijklmno\0".to_vec() },
            "the longest name"
        );
        // A family match after an interface match still checks the family, as nft does.
        let with_family = compiled("iifname \"veth*\" ip daddr 10.96.0.1 accept");
        assert_eq!(with_family[2..4], family(2));
        // On the wire: NFTA_LOOKUP_FLAGS (5) = NFT_LOOKUP_F_INV only when inverted.
        let data = |e: &Expr| {
            let mut w = Writer::default();
            e.encode_data(&mut w);
            w.buf
        };
        let inverted = data(&lookup("cluster-cidrs", true));
        assert_eq!(
            (string_attribute(&inverted, 1).as_deref(), u32_attribute(&inverted, 2), u32_attribute(&inverted, 5)),
            (Some("cluster-cidrs"), Some(NFT_REG_1), Some(1))
        );
        assert_eq!(attribute(&data(&lookup("cluster-cidrs", false)), 5), None);
        let meta = data(&Expr::Meta { key: META_IIFNAME });
        assert_eq!((u32_attribute(&meta, 1), u32_attribute(&meta, 2)), (Some(NFT_REG_1), Some(6)));
    }

    #[test]
    fn words_outside_the_vocabulary_are_refused() {
        for rule in [
            "meta mark set meta mark | 0x4000",
            "ct state new accept",
            "dnat to 1.2.3.4",
            "jump",
            // Interface names nft refuses or reads otherwise (wildcards, escapes, too long).
            "iifname \"*\" accept",
            "iifname \"\" accept",
            "iifname \"ve*th\" accept",
            "iifname \"veth\\*\" accept",
            "iifname \"abcdefghijklmnop\" accept",
            "iifname \"abcdefghijklmno*\" accept",
            "iifname !=",
        ] {
            assert!(RuleCompiler::compile(rule).is_err(), "{rule}");
        }
        let err = encode_transaction("add table inet wasmplane\n", 1).err().unwrap();
        assert_eq!(err.reason, "statement kind");
        assert!(encode_transaction("add set inet wasmplane s { type ipv4_addr; flags interval; }\n", 1).is_err());
        assert!(
            encode_transaction("add set inet wasmplane s { type ipv4_addr; elements = { 10.0.0.1, 10.0.0.2 }; }\n", 1)
                .is_ok()
        );
        assert!(encode_transaction("add rule ip other c accept\n", 1).is_err());
    }

    #[test]
    fn element_keys_are_padded_concatenations() {
        assert_eq!(element_key("10.96.0.1 . tcp . 80").unwrap(), vec![10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]);
        assert_eq!(element_key("udp . 30053").unwrap(), vec![17, 0, 0, 0, 0x75, 0x65, 0, 0]);
        assert_eq!(element_key("fd00::1").unwrap().len(), 16);
        assert!(element_key("80").is_err());
        let elements = parse_elements("s", "10.0.0.1, 10.0.0.2").unwrap();
        assert_eq!(elements.len(), 2);
        let elements = parse_elements("service-ips", "10.96.0.1 . tcp . 80 : goto svc/a/b").unwrap();
        assert_eq!(
            elements[0].value,
            Some(ElementValue::Verdict(Verdict { code: NFT_GOTO, chain: Some("svc/a/b".into()) }))
        );
        // The endpoint maps: a numgen value (host order) ends the key, the value is data.
        let elements = parse_elements("service-endpoints", "10.96.0.1 . tcp . 80 . 2 : 10.244.0.3 . 8080").unwrap();
        let mut key = vec![10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0];
        key.extend(2u32.to_ne_bytes());
        assert_eq!(
            elements[0],
            Element { key, key_end: None, value: Some(ElementValue::Data(vec![10, 244, 0, 3, 0x1f, 0x90, 0, 0])) }
        );
        assert!(parse_elements("service-endpoints", "10.96.0.1 . tcp . 80 : 10.244.0.3 . 8080").is_err(), "no number");
        // A node port's: protocol . port . number.
        let elements = parse_elements("nodeport-endpoints", "tcp . 30001 . 2 : 10.244.0.7 . 8080").unwrap();
        let mut key = vec![6, 0, 0, 0, 0x75, 0x31, 0, 0];
        key.extend(2u32.to_ne_bytes());
        assert_eq!(
            elements[0],
            Element { key, key_end: None, value: Some(ElementValue::Data(vec![10, 244, 0, 7, 0x1f, 0x90, 0, 0])) }
        );
        // The firewall's ranges: first and last key, a single address a range of one.
        let elements = parse_elements(
            "firewall-allowed",
            "203.0.113.10 . tcp . 80 . 192.168.0.0/16, 203.0.113.10 . tcp . 80 . 203.0.113.10",
        )
        .unwrap();
        let front = [203, 0, 113, 10, 6, 0, 0, 0, 0, 80, 0, 0];
        let keys = |last: [u8; 4]| [&front[..], &last[..]].concat();
        assert_eq!(
            (&elements[0].key, elements[0].key_end.as_deref()),
            (&keys([192, 168, 0, 0]), Some(&keys([192, 168, 255, 255])[..]))
        );
        assert_eq!(
            (&elements[1].key, elements[1].key_end.as_deref()),
            (&keys([203, 0, 113, 10]), Some(&keys([203, 0, 113, 10])[..]))
        );
        assert!(parse_elements("firewall-allowed", "203.0.113.10 . tcp . 80 . office").is_err());
        assert!(
            parse_elements("nodeport-endpoints", "10.96.0.1 . tcp . 80 . 1 : 10.244.0.3 . 8080").is_err(),
            "a service key"
        );
        // Host ports: a plain concatenated key, an address . port value (data, not a verdict).
        let elements = parse_elements("hostports", "192.168.77.1 . udp . 5353 : 10.244.0.11 . 53").unwrap();
        let data = |address: &[u8], port: u16| [address, &port.to_be_bytes()[..], &[0, 0]].concat();
        assert_eq!(
            elements[0],
            Element {
                key: vec![192, 168, 77, 1, 17, 0, 0, 0, 0x14, 0xe9, 0, 0],
                key_end: None,
                value: Some(ElementValue::Data(data(&[10, 244, 0, 11], 53)))
            }
        );
        let elements = parse_elements("hostports-any6", "tcp . 18080 : fd00::11 . 8080").unwrap();
        let pod6: std::net::Ipv6Addr = "fd00::11".parse().unwrap();
        assert_eq!(
            elements[0],
            Element {
                key: vec![6, 0, 0, 0, 0x46, 0xa0, 0, 0],
                key_end: None,
                value: Some(ElementValue::Data(data(&pod6.octets(), 8080)))
            }
        );
        // Deleting names the key only.
        assert_eq!(parse_elements("hostports-any", "tcp . 18080").unwrap()[0].value, None);
        for bad in ["tcp . 18080 : goto svc/a/b", "tcp . 18080 : 10.244.0.11", "tcp . 18080 : 10.244.0.11 . 8080 . 1"] {
            assert!(parse_elements("hostports-any", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_batch_is_framed_and_every_statement_acknowledged() {
        let batch = encode_transaction(
            "add chain inet wasmplane svc/a/b\nadd rule inet wasmplane svc/a/b ip daddr 10.96.0.1 goto svc/a/b\nflush chain inet wasmplane svc/a/b\n",
            7,
        )
        .unwrap();
        assert_eq!(batch.messages, vec![(8, 0), (9, 1), (10, 2)]);
        // Walk the messages: lengths add up to the buffer, begin and end frame the batch.
        let mut offset = 0;
        let mut types = Vec::new();
        while offset < batch.bytes.len() {
            let len = u32::from_ne_bytes(batch.bytes[offset..offset + 4].try_into().unwrap()) as usize;
            types.push(u16::from_ne_bytes(batch.bytes[offset + 4..offset + 6].try_into().unwrap()));
            offset += align(len);
        }
        assert_eq!(offset, batch.bytes.len());
        assert_eq!(types, vec![NFNL_MSG_BATCH_BEGIN, 0x0a03, 0x0a06, 0x0a08, NFNL_MSG_BATCH_END]);
    }
}
