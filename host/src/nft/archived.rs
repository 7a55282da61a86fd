//! A service translator's map elements as the validator reads them, from a typed ruleset or
//! an archived one (`wasmplane-archive`).
//!
//! Elements are what every service has and what a change of endpoints changes, so those of an
//! archive are read in place: their addresses are integers already. Chains and sets, which
//! only ports with chains of their own have, are named by the runtime
//! (`wasmplane_runtime::archived`) and then checked and rendered by the typed world's code,
//! the one place that knows nftables rule syntax.

use std::borrow::Cow;
use std::net::IpAddr;

use wasmplane_archive as archive;
use wasmplane_runtime::{archived, wit};

use super::{InvalidOutput, Validator};

/// One part of a map element's key, its address parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Part {
    Address(IpAddr),
    Protocol(wit::Protocol),
    Port(u16),
}

/// The most parts a key of the host's maps has (`service-backends`).
const MAX_PARTS: usize = archive::MAX_KEY_PARTS;

/// A map element's key: at most [`MAX_PARTS`] parts, inline.
pub(super) struct Key {
    parts: [Part; MAX_PARTS],
    len: usize,
}

impl Key {
    pub fn as_slice(&self) -> &[Part] {
        &self.parts[..self.len]
    }

    fn push(&mut self, part: Part) {
        self.parts[self.len] = part;
        self.len += 1;
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// One map element of either world.
pub(super) struct ElementIn<'e> {
    pub map_name: Cow<'e, str>,
    pub key: Key,
    pub verdict: Cow<'e, wit::Verdict>,
}

/// A result's map elements, of either world.
pub(super) enum ElementsIn<'o> {
    Typed(&'o [wit::MapElement]),
    Archived(&'o archive::rkyv::vec::ArchivedVec<archive::ArchivedElement>, &'o archive::Names<'o>),
}

impl ElementsIn<'_> {
    pub fn len(&self) -> usize {
        match self {
            ElementsIn::Typed(elements) => elements.len(),
            ElementsIn::Archived(elements, _) => elements.len(),
        }
    }

    /// Element `index`, its addresses parsed (typed) or read (archived); `v` says what fails.
    pub fn get(&self, index: usize, v: &Validator<'_>) -> Result<ElementIn<'_>, InvalidOutput> {
        let mut key = Key { parts: [Part::Port(0); MAX_PARTS], len: 0 };
        match self {
            ElementsIn::Typed(elements) => {
                let element = &elements[index];
                if element.key.len() > MAX_PARTS {
                    return v.fail(format!("map {:?}: key {:?} has the wrong shape", element.map_name, element.key));
                }
                for part in &element.key {
                    key.push(match part {
                        wit::KeyPart::Address(a) => Part::Address(v.address(a)?),
                        wit::KeyPart::Protocol(p) => Part::Protocol(*p),
                        wit::KeyPart::Port(p) => Part::Port(*p),
                    });
                }
                Ok(ElementIn {
                    map_name: Cow::Borrowed(&element.map_name),
                    key,
                    verdict: Cow::Borrowed(&element.verdict),
                })
            }
            ElementsIn::Archived(elements, names) => {
                let element = &elements[index];
                for part in element.key.iter().filter_map(|p| p.as_ref()) {
                    key.push(match part {
                        archive::ArchivedKeyPart::Address(a) => Part::Address(a.as_ipaddr()),
                        archive::ArchivedKeyPart::Protocol(p) => Part::Protocol(archived::typed_protocol(p.native())),
                        archive::ArchivedKeyPart::Port(p) => Part::Port(p.to_native()),
                    });
                }
                let verdict = archived::verdict(&element.verdict, names).or_else(|reason| v.fail(reason))?;
                Ok(ElementIn { map_name: element.map.native().name(), key, verdict: Cow::Owned(verdict) })
            }
        }
    }
}
