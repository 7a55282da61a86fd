//! Helpers for tests that run the host against the real kernel with real traffic.
#![allow(dead_code)]

pub mod cluster;
pub mod echo;
pub mod netns;
pub mod registry;
pub mod rest;
pub mod sctp;
pub mod tls;

/// Whether set `set` holds `element`, in an `nft list ruleset` listing or in the host's
/// rendered transaction (`add element … {set} { … }`). A frontend load balanced as data is
/// counted in its shard's `frontends-N` set, N its backends (see `nft::CountedKeys`).
pub fn set_holds(text: &str, set: &str, element: &str) -> bool {
    text.match_indices(&format!(" {set} {{")).any(|(at, opening)| {
        // Up to the first closing brace: a rendered line's elements, or a listed set's
        // `type …` and `elements = { … }`.
        let rest = &text[at + opening.len()..];
        let body = &rest[..rest.find('}').unwrap_or(rest.len())];
        body.split([',', '{']).any(|e| e.trim() == element)
    })
}
